"""Read training logs: ours and upstream modded-nanogpt ones.

Both write the same line formats (times in milliseconds, losses in nats per token)::

    step:N/M train_time:Tms step_avg:Sms                 one per training step
    step:N/M val_loss:X train_time:Tms step_avg:Sms      one per validation
    peak memory allocated: X MiB reserved: Y MiB
    Running Python 3.12.3 (...)
    Running PyTorch 2.10.0+cu128 compiled for CUDA 12.8
    Running Triton version 3.6.0
    seed: 1337                                          (our logs; upstream logs have none)

plus the ``nvidia-smi`` table, from which GPU names and the driver version are read.  A run's
result is its LAST validation line: the loss there is the final loss and its ``train_time`` is the
run's time.  A run is *complete* when that last validation line is at the final step (N == M).

Upstream logs start with the training script's source code; the patterns below only accept
literal numbers, so f-string templates in that source (``step:{step}/...``) never match.
"""

from __future__ import annotations

import glob
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from speedrun.errors import DataError

_VAL = re.compile(
    r"^step:(\d+)/(\d+)\s+val_loss:([-+0-9.eE]+|nan|inf)\s+train_time:(\d+(?:\.\d+)?)ms", re.M
)
_STEP = re.compile(r"^step:(\d+)/(\d+)\s+train_time:(\d+(?:\.\d+)?)ms\s+step_avg:([0-9.]+)ms", re.M)
_PEAK = re.compile(r"^peak memory allocated:\s*(\d+)\s*MiB\s+reserved:\s*(\d+)\s*MiB", re.M)
_PYTHON = re.compile(r"^Running Python (\d+\.\d+\.\d+\S*)", re.M)
_TORCH = re.compile(r"^Running PyTorch (\d\S*)(?: compiled for CUDA (\d\S*))?", re.M)
_TRITON = re.compile(r"^Running Triton version (\d\S*)", re.M)
_SEED = re.compile(r"(?:^|[\s,;|.])seed:\s*(-?\d+)\b", re.M)
_DRIVER = re.compile(r"Driver Version:\s*([0-9.]+)")
# A GPU row of the nvidia-smi table: "|   0  NVIDIA H100 80GB HBM3   On  |   00000000:8D:00.0 Off |"
_SMI_GPU = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|\s+[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:", re.M)
# Our own logs may name the device directly.
_GPU_LINE = re.compile(r"^gpu:\s*(.+?)\s*$", re.M)

LOG_SUFFIXES = (".txt", ".log")


@dataclass
class RunSummary:
    """What one log says about its run.

    Times are milliseconds (``*_ms``) or seconds (``*_s``); memory is MiB per GPU.
    ``val_curve`` holds ``(step, val_loss, train_time_ms)`` and ``step_times``
    ``(step, train_time_ms)`` in log order.  ``label`` names the arm/group the run belongs to.
    """

    path: str
    label: str = ""
    complete: bool = False
    final_step: int | None = None
    total_steps: int | None = None
    val_loss: float | None = None
    train_time_ms: float | None = None
    val_curve: list[tuple[int, float, float]] = field(default_factory=list)
    step_times: list[tuple[int, float]] = field(default_factory=list)
    peak_allocated_mib: int | None = None
    peak_reserved_mib: int | None = None
    python_version: str | None = None
    torch_version: str | None = None
    cuda_version: str | None = None
    triton_version: str | None = None
    driver_version: str | None = None
    gpus: list[str] = field(default_factory=list)
    seed: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return Path(self.path).name

    @property
    def train_time_s(self) -> float | None:
        return None if self.train_time_ms is None else self.train_time_ms / 1000.0

    @property
    def usable(self) -> bool:
        """Complete and with a finite final loss: counted in statistics."""
        return self.complete and self.val_loss is not None and math.isfinite(self.val_loss)

    def step_durations_ms(self) -> list[tuple[int, float]]:
        """``(step, ms)`` for each step whose predecessor was also logged: consecutive deltas."""
        out = []
        for (s0, t0), (s1, t1) in zip(self.step_times, self.step_times[1:]):
            if s1 == s0 + 1:
                out.append((s1, t1 - t0))
        return out

    def to_dict(self, curves: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["name"] = self.name
        d["train_time_s"] = self.train_time_s
        if self.val_loss is not None and not math.isfinite(self.val_loss):
            d["val_loss"] = None  # strict JSON has no NaN; ``problems`` says what the log held
        if not curves:
            d.pop("step_times")
            d.pop("val_curve")
        return d


def parse_text(text: str, path: str = "<text>", label: str = "") -> RunSummary:
    """Parse the text of one log.  Raises :class:`DataError` if it holds no step lines at all."""
    vals = [(int(m[1]), int(m[2]), float(m[3]), float(m[4])) for m in _VAL.finditer(text)]
    steps = [(int(m[1]), int(m[2]), float(m[3])) for m in _STEP.finditer(text)]
    if not vals and not steps:
        raise DataError(
            f"{path}: not a speedrun log (no 'step:N/M train_time:...' or 'step:N/M val_loss:...' lines)"
        )
    run = RunSummary(path=str(path), label=label)
    run.val_curve = [(s, loss, t) for s, _, loss, t in vals]
    run.step_times = [(s, t) for s, _, t in steps]
    totals = {m for _, m, _, _ in vals} | {m for _, m, _ in steps}
    run.total_steps = max(totals)
    if len(totals) > 1:
        run.problems.append(f"step totals disagree within the log: {sorted(totals)}")
    if vals:
        s, m, loss, t = vals[-1]
        run.final_step, run.val_loss, run.train_time_ms = s, loss, t
        run.complete = s == m
    if not run.complete:
        last = vals[-1][0] if vals else None
        run.problems.append(
            f"incomplete: last validation at step {last} of {run.total_steps}"
            if vals
            else f"incomplete: no validation line (last step logged {steps[-1][0]} of {run.total_steps})"
        )
    elif not math.isfinite(run.val_loss):
        run.problems.append(f"final val_loss is {run.val_loss}")

    if m := _PEAK.search(text):
        run.peak_allocated_mib, run.peak_reserved_mib = int(m[1]), int(m[2])
    if m := _PYTHON.search(text):
        run.python_version = m[1]
    if m := _TORCH.search(text):
        run.torch_version, run.cuda_version = m[1], m[2]
    if m := _TRITON.search(text):
        run.triton_version = m[1]
    if m := _DRIVER.search(text):
        run.driver_version = m[1]
    run.gpus = [m[2].strip() for m in _SMI_GPU.finditer(text)] or [m[1] for m in _GPU_LINE.finditer(text)]
    seeds = {int(m[1]) for m in _SEED.finditer(text)}
    if len(seeds) == 1:
        run.seed = seeds.pop()
    elif len(seeds) > 1:
        run.problems.append(f"several seeds stated: {sorted(seeds)}")
    return run


def parse_log(path: str | Path, label: str = "") -> RunSummary:
    """Parse one log file.  Raises :class:`DataError` for a missing, unreadable or foreign file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise DataError(f"{p}: cannot read log ({e.strerror or e})") from None
    return parse_text(text, str(p), label)


def expand(spec: str | Path) -> list[Path]:
    """Log files named by ``spec``: a file, a folder (searched recursively for *.txt / *.log) or a glob."""
    p = Path(spec)
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in LOG_SUFFIXES)
    matches = sorted(Path(m) for m in glob.glob(str(spec), recursive=True))
    files = []
    for m in matches:
        files.extend(expand(m) if m.is_dir() else [m])
    if not files:
        raise DataError(f"{spec}: no such file or folder, and no file matches it as a glob")
    return files


def load_group(spec: str | Path | list, label: str = "") -> tuple[list[RunSummary], list[str]]:
    """Parse every log a spec (or list of specs) names.

    Returns ``(runs, warnings)``.  Files in a folder or glob that are not logs are skipped with a
    warning; a file named explicitly that is not a log raises :class:`DataError`.  Incomplete runs
    are returned (``usable`` False) and reported in the warnings.
    """
    specs = spec if isinstance(spec, list) else [spec]
    runs: list[RunSummary] = []
    warnings: list[str] = []
    for s in specs:
        explicit = Path(s).is_file()
        for f in expand(s):
            try:
                run = parse_log(f, label)
            except DataError as e:
                if explicit:
                    raise
                warnings.append(f"skipped {e}")
                continue
            runs.append(run)
    if not runs:
        raise DataError(f"{specs}: no speedrun logs found")
    for r in runs:
        if not r.usable:
            warnings.append(f"{r.path}: excluded from statistics ({'; '.join(r.problems)})")
    return runs, warnings
