"""The networks.  :func:`build_model` picks one by ``ModelConfig.architecture``."""

from __future__ import annotations

import torch.nn as nn

from speedrun.config import ModelConfig
from speedrun.errors import ConfigError


def build_model(cfg: ModelConfig) -> nn.Module:
    """A freshly initialised model on the CPU in float32 (move and cast it afterwards)."""
    if cfg.architecture == "core":
        from speedrun.model.gpt import GPT

        return GPT(cfg)
    if cfg.architecture == "record":
        from speedrun.model.record import RecordGPT

        return RecordGPT(cfg)
    raise ConfigError(f"unknown model.architecture {cfg.architecture!r}; known: core, record")
