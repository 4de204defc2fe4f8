"""Keeping validation text apart from training text.

A run validates on shards it never trains on.  When only training shards are named, the
validation shards are named from them by one explicit rule (:func:`val_glob_for`); anything else
needs ``--val-data``.  :func:`refuse_overlap` refuses a train and a validation set that share a
file, unless the configuration allows it (``data.allow_val_overlap``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from speedrun.errors import ConfigError, DataError

RULE = ("the validation glob is the training glob with 'train' replaced by 'val' in the last path "
        "part that contains 'train' (e.g. data/fineweb10B/fineweb_train_*.bin -> "
        "data/fineweb10B/fineweb_val_*.bin)")


def val_glob_for(train_glob: str) -> str:
    """The validation glob named from ``train_glob`` by :data:`RULE`; ConfigError when the rule
    does not apply (no path part contains 'train')."""
    parts = train_glob.replace("\\", "/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        if "train" in parts[i]:
            parts[i] = parts[i].replace("train", "val")
            return "/".join(parts)
    raise ConfigError(f"--data {train_glob!r} has no 'train' in its name, so its validation shards cannot be "
                      f"named from it ({RULE}): pass --val-data with a glob of validation shards that are not "
                      f"training shards")


def refuse_overlap(train_files: Sequence[Path], val_files: Sequence[Path], allowed: bool) -> None:
    """DataError when a validation shard is also a training shard (the same file, by real path),
    unless ``allowed``."""
    if allowed:
        return
    train = {os.path.realpath(p) for p in train_files}
    shared = [str(p) for p in val_files if os.path.realpath(p) in train]
    if shared:
        more = f" and {len(shared) - 3} more" if len(shared) > 3 else ""
        raise DataError(f"{len(shared)} validation shard(s) are also training shards ({', '.join(shared[:3])}{more}): "
                        f"the run would validate on text it trains on.  Pass --val-data with other shards, or "
                        f"--allow-val-overlap (data.allow_val_overlap=true) to accept it")
