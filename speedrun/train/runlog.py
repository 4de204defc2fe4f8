"""The run folder and its logs.

A run folder holds ``config.json`` (the full RunConfig), ``log.txt`` (human log whose step and
validation lines use the upstream speedrun format, so upstream tools and ``speedrun stats`` parse
both), ``metrics.jsonl`` (one JSON object per logged event), ``checkpoints/``, ``sample.txt`` and,
once finished, ``summary.json``.  Only rank 0 writes.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
import sys
import uuid
from pathlib import Path

import torch


def new_run_dir(out_dir: str | Path, name: str) -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = Path(out_dir) / f"{name}-{stamp}-{uuid.uuid4().hex[:6]}"
    path.mkdir(parents=True, exist_ok=False)
    return path


def step_line(step: int, total: int, train_time_ms: float, step_avg_ms: float) -> str:
    """Upstream per-step line: ``step:N/M train_time:Tms step_avg:Sms``."""
    return f"step:{step}/{total} train_time:{train_time_ms:.0f}ms step_avg:{step_avg_ms:.2f}ms"


def val_line(step: int, total: int, val_loss: float, train_time_ms: float, step_avg_ms: float) -> str:
    """Upstream validation line: ``step:N/M val_loss:X train_time:Tms step_avg:Sms``."""
    return f"step:{step}/{total} val_loss:{val_loss:.4f} train_time:{train_time_ms:.0f}ms step_avg:{step_avg_ms:.2f}ms"


def git_commit() -> str:
    """The commit of the speedrun source tree, with ``+dirty`` when it has local changes."""
    src = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit or "unknown") + ("+dirty" if dirty else "")


def environment_lines(device: torch.device) -> list[str]:
    """Versions and hardware, in the upstream log's wording where it has one."""
    lines = [
        f"Running Python {sys.version.split()[0]} on {platform.platform()}",
        f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
    ]
    try:
        import triton

        lines.append(f"Running Triton version {triton.__version__}")
    except ImportError:
        lines.append("Running Triton version none")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(f"device: {props.name} ({props.total_memory / 2**30:.0f} GiB, sm{props.major}{props.minor}, "
                     f"{props.multi_processor_count} SMs) x {torch.cuda.device_count()}")
    else:
        lines.append(f"device: cpu ({torch.get_num_threads()} threads)")
    lines.append(f"git commit: {git_commit()}")
    return lines


class RunLog:
    """Writes log.txt and metrics.jsonl on rank 0; echoes chosen lines to the console."""

    def __init__(self, run_dir: Path, enabled: bool = True, console: bool = True):
        self.run_dir = run_dir
        self.enabled = enabled
        self.console = console and enabled
        self._log = open(run_dir / "log.txt", "a", encoding="utf-8") if enabled else None
        self._metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8") if enabled else None

    def print(self, line: str, console: bool = True) -> None:
        if not self.enabled:
            return
        self._log.write(line + "\n")
        self._log.flush()
        if console and self.console:
            print(line, flush=True)

    def metric(self, **fields) -> None:
        if not self.enabled:
            return
        self._metrics.write(json.dumps(fields, sort_keys=True) + "\n")
        self._metrics.flush()

    def close(self) -> None:
        for f in (self._log, self._metrics):
            if f is not None:
                f.close()
