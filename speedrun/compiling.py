"""Dynamo settings the staged schedule needs (no side effect at import: callers apply them)."""

from __future__ import annotations

import torch

SCHEDULE_RECOMPILE_LIMIT = 64  # the recipe's own setting (f411b3d TG:L50)


def allow_schedule_variants(limit: int = SCHEDULE_RECOMPILE_LIMIT) -> None:
    """Let Dynamo keep one compiled graph per schedule variant.

    With ``dynamic=False`` every stage shape, window pair and grad mode (training vs validation)
    is its own graph: a staged schedule needs up to ~10 (four stage shapes x train/eval, more
    when validations see other windows), past Dynamo's default limit of 8, beyond which a
    ``fullgraph`` compile fails outright.  Raised, never lowered; the timed region is still
    checked for compilations (``compilations during the timed region``)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), limit))
