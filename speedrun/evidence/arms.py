"""Arm specifications: a named preset plus overrides, as given on the command line.

Syntax of one arm (``--arm`` of ``speedrun bench step`` and ``speedrun compare``)::

    NAME=PRESET[:SECTION.FIELD=VALUE,SECTION.FIELD=VALUE,...]
    PRESET                                  (the arm is named after the preset)

e.g. ``base=tiny`` or ``cand=tiny:model.qk_head_dim=16,train.lr=1e-3``.  Overrides are split at
commas that start a new ``field=`` assignment, so JSON values with commas (``train.stages=[...]``)
survive.  Names may hold letters, digits, ``-``, ``_`` and ``.``.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass
from typing import Sequence

from speedrun.config import RunConfig, Stage, apply_overrides, preset
from speedrun.config_check import validate_config
from speedrun.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
# A comma followed by the start of the next "[section.]field=" assignment.
_SPLIT = re.compile(r",(?=\s*(?:[A-Za-z_]\w*\.)?[A-Za-z_]\w*\s*=)")

ARM_SYNTAX = "NAME=PRESET[:SECTION.FIELD=VALUE,...] (e.g. base=tiny  cand=tiny:model.qk_head_dim=16,train.lr=1e-3)"


@dataclass(frozen=True)
class ArmSpec:
    """One arm: ``name``, a preset name and ``section.field=value`` overrides (applied in order)."""

    name: str
    preset: str
    overrides: tuple[str, ...] = ()

    def config(self, common: Sequence[str] = ()) -> RunConfig:
        """The arm's RunConfig: the preset, then ``common`` overrides, then the arm's own."""
        try:
            cfg = preset(self.preset)
        except KeyError as e:
            raise ConfigError(f"arm {self.name!r}: {e.args[0]}") from None
        try:
            apply_overrides(cfg, list(common))
            apply_overrides(cfg, list(self.overrides))
        except ConfigError as e:
            raise ConfigError(f"arm {self.name!r}: {e}") from None
        cfg.train.stages = [_as_stage(s, self.name) for s in cfg.train.stages]
        try:
            validate_config(cfg)
        except ConfigError as e:
            raise ConfigError(f"arm {self.name!r}: {e}") from None
        return cfg

    def to_dict(self) -> dict:
        return {"name": self.name, "preset": self.preset, "overrides": list(self.overrides)}

    def __str__(self) -> str:
        tail = (":" + ",".join(self.overrides)) if self.overrides else ""
        return f"{self.name}={self.preset}{tail}"


def _as_stage(s, arm: str) -> Stage:
    """``train.stages=[[start, batch, seq, ws, wl, ...], ...]`` overrides arrive as JSON lists
    (or objects); make them Stages."""
    if isinstance(s, Stage):
        return s
    try:
        if isinstance(s, dict):
            return Stage(**{k: tuple(v) if isinstance(v, list) else v for k, v in s.items()})
        return Stage(*[tuple(v) if isinstance(v, list) else v for v in s])
    except TypeError as e:
        raise ConfigError(f"arm {arm!r}: a stage must be [start_step, batch_tokens, max_seq_len, window_short, "
                          f"window_long(, mtp_weights, prefix_weight)] or an object of those fields, got {s!r} ({e})")


def parse_arm(spec: str) -> ArmSpec:
    """Parse ``NAME=PRESET[:overrides]`` (or a bare ``PRESET``); raises ConfigError on bad syntax."""
    text = spec.strip()
    head, sep, tail = text.partition(":")
    if "=" in head:
        name, _, preset_name = head.partition("=")
    else:
        name = preset_name = head
    name, preset_name = name.strip(), preset_name.strip()
    if not name or not preset_name:
        raise ConfigError(f"arm {spec!r}: expected {ARM_SYNTAX}")
    if not _NAME.match(name):
        raise ConfigError(f"arm name {name!r} may only hold letters, digits, '-', '_' and '.'")
    overrides: tuple[str, ...] = ()
    if sep:
        if not tail.strip():
            raise ConfigError(f"arm {spec!r}: nothing after ':'; expected {ARM_SYNTAX}")
        overrides = tuple(p.strip() for p in _SPLIT.split(tail) if p.strip())
        for o in overrides:
            if "=" not in o:
                raise ConfigError(f"arm {spec!r}: override {o!r} is not SECTION.FIELD=VALUE")
    return ArmSpec(name, preset_name, overrides)


def parse_arms(specs: Sequence[str], minimum: int = 1) -> list[ArmSpec]:
    """Parse several arm specs; names must be distinct and there must be at least ``minimum``."""
    arms = [parse_arm(s) for s in specs]
    if len(arms) < minimum:
        raise ConfigError(f"need at least {minimum} --arm, got {len(arms)}; syntax: {ARM_SYNTAX}")
    names = [a.name for a in arms]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"arm names must differ; repeated: {', '.join(dup)} (use NAME=PRESET to name arms)")
    return arms


def data_overrides(train_glob: str | None, val_glob: str | None = None, validates: bool = True) -> list[str]:
    """Overrides for ``--data``/``--val-data``: read shards; validation shards named from the
    training glob by :func:`speedrun.data.splits.val_glob_for` when not given.  ``validates=False``
    (commands that never validate: bench, profile) accepts a glob the rule cannot name from."""
    from speedrun.data.splits import val_glob_for

    if not train_glob:
        return []
    if val_glob or validates:
        val = val_glob or val_glob_for(train_glob)
        return ["data.source=shards", f"data.train_files={train_glob}", f"data.val_files={val}"]
    if "train" in train_glob:  # the named validation shards when they exist (nothing reads them here)
        val = val_glob_for(train_glob)
        if glob.glob(os.path.expanduser(val)):
            return ["data.source=shards", f"data.train_files={train_glob}", f"data.val_files={val}"]
    return ["data.source=shards", f"data.train_files={train_glob}", f"data.val_files={train_glob}",
            "data.allow_val_overlap=true"]
