"""Checkpoints: everything needed to continue a run bit-for-bit.

A checkpoint holds the model and optimizer state, every rank's data-loader position, the RNG
states, the step reached and the training time spent so far.  Files are written to a temporary
name and renamed, so a run killed while saving never leaves a half-written latest checkpoint
(the temporary files such a kill leaves are removed by the next save).  The newest two are kept;
a latest checkpoint that cannot be read falls back to the one before, with a message.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from speedrun.errors import SpeedrunError

_NAME = re.compile(r"^step_(\d{6,})\.pt$")


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}.pt"


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``state`` for ``step`` atomically; keep only the newest ``keep`` checkpoints."""
    path = checkpoint_path(run_dir, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    # Left by a process killed while writing (every rank's part of this step is in place by now).
    for stale in path.parent.glob("step_*.tmp"):
        stale.unlink(missing_ok=True)
    for old in list_checkpoints(run_dir)[:-keep]:
        old.unlink(missing_ok=True)
        for shard in old.parent.glob(old.stem + ".rank*.pt"):
            shard.unlink(missing_ok=True)
    return path


def rank_state_path(run_dir: Path, step: int, rank: int) -> Path:
    """Where rank ``rank`` keeps its own part of the step-``step`` checkpoint (sharded optimizer state)."""
    return checkpoint_path(run_dir, step).with_suffix(f".rank{rank}.pt")


def save_rank_state(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> Path:
    path = rank_state_path(run_dir, step, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def load_rank_state(run_dir: Path, step: int, rank: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    path = rank_state_path(run_dir, step, rank)
    if not path.exists():
        raise SpeedrunError(f"checkpoint of step {step} lacks rank {rank}'s part ({path}); was it written "
                            f"with a different world size?")
    return torch.load(path, map_location=map_location, weights_only=False)


def list_checkpoints(run_dir: Path) -> list[Path]:
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def load_latest(run_dir: Path, map_location: str | torch.device = "cpu",
                warn: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The newest readable checkpoint of ``run_dir``: one that cannot be read (or lacks the
    fields a resume needs) is reported through ``warn`` and the one before it is tried.  A clear
    error if there is none or none is readable."""
    found = list_checkpoints(run_dir)
    if not found:
        raise SpeedrunError(f"{run_dir} has no checkpoints to resume from (looked in {run_dir / 'checkpoints'}): "
                            "the run stopped before its first one (written every train.checkpoint_every steps, "
                            "every train.checkpoint_every_s seconds, at stage boundaries and on SIGINT/SIGTERM); "
                            "start it again")
    problems = []
    for path in reversed(found):
        try:
            state = torch.load(path, map_location=map_location, weights_only=False)
            missing = [k for k in _REQUIRED if k not in state]
            if missing:
                raise ValueError(f"lacks {', '.join(missing)}")
        except Exception as e:
            problems.append(f"{path.name}: {type(e).__name__}: {e}")
            if warn is not None:
                warn(f"checkpoint {path} cannot be read ({type(e).__name__}: {e}); trying the one before it")
            continue
        return state
    raise SpeedrunError(f"no readable checkpoint in {run_dir / 'checkpoints'}: " + "; ".join(problems))


# What a resume reads from a checkpoint (speedrun.train.loop).
_REQUIRED = ("step", "train_time_ms", "model", "optimizer", "loaders", "rng")
