"""The host's side of a training step: how long the CPU takes to issue each phase of a step, how
far the GPU trails it, and which calls make the CPU wait for the GPU.

A CUDA step takes as long as the slower of two things: the GPU's kernels, and the host's Python
that issues them (launches, the compiled graphs' wrappers, the opaque kernel calls, the optimizer's
eager ops).  A call that synchronises (``.item()``, a blocking host-to-device copy such as
``torch.tensor(values, device="cuda")``) drains the GPU's queue, so whatever host work follows it
runs with the GPU idle.  ``speedrun bench step`` times whole steps with CUDA events; these helpers
take the host's part apart:

- :class:`PhaseRecorder` (passed to :func:`speedrun.train.loop.run_step` as ``on_phase``): at the
  end of each phase it notes the host clock and records a CUDA event.  After the step, for every
  phase: the host's issue time, the GPU's time between the events, and the *lead*: how long after
  the host issued the phase's end the GPU got there.  A lead near zero means the GPU had caught up
  with the host there: the step is host-bound at that point (or synchronised just before).  A
  host that runs far ahead can also be held back by the driver's launch queue, so host times of a
  GPU-bound phase are upper bounds of its issue cost, not measurements of it.
- :func:`find_syncs`: one step under ``torch.cuda.set_sync_debug_mode("warn")``, collecting every
  synchronising call with the lines of our code that made it (torch calls the mode a prototype:
  it does not see every kind of synchronisation).

Off CUDA the host is the whole step: the recorder gives host times only and the scan finds nothing.
"""

from __future__ import annotations

import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

SYNC_WARNING = "synchronizing CUDA operation"  # torch's sync-debug warning text
_OWN_FILE = __file__.replace("\\", "/")
# The package's own folder ("/.../speedrun/"): a frame is ours when its file lies below it, not
# when its path merely contains "/speedrun/" (a clone's folder may have that name too).
_PKG_DIR = _OWN_FILE.rsplit("/", 2)[0] + "/"


@dataclass
class PhaseTiming:
    """One phase of one step, summed over its occurrences (one per micro-batch for the micro-batch
    phases).  host_ms: host issue time; gpu_ms: GPU time between the phase's events (None off
    CUDA); lead_min_ms: the least, over the occurrences, of how long after the host issued the
    phase's end the GPU reached it (None off CUDA)."""

    host_ms: float
    gpu_ms: float | None = None
    lead_min_ms: float | None = None
    count: int = 1


class PhaseRecorder:
    """``on_phase`` callback for :func:`speedrun.train.loop.run_step`: per call, the host clock and
    (on CUDA) a timing event on the current stream.  Call :meth:`timings` after the step has
    finished on the device (it synchronises on the last event)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.names: list[str] = []
        self.host_s: list[float] = []
        self.events: list[Any] = []

    def __call__(self, name: str) -> None:
        self.host_s.append(time.perf_counter())
        self.names.append(name)
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.events.append(ev)

    def timings(self) -> dict[str, PhaseTiming]:
        """Per phase name (the first mark only opens the first phase), in first-seen order."""
        n = len(self.names)
        if n < 2:
            return {}
        if any(b < a for a, b in zip(self.host_s, self.host_s[1:])):
            raise ValueError("phase marks out of time order")
        gpu_at = lead = None
        if self.cuda:
            self.events[-1].synchronize()
            # The first event ran as soon as it was recorded (the bench starts each step from an
            # idle GPU), so GPU times map onto the host clock from there.
            gpu_at = [0.0] + [self.events[0].elapsed_time(e) for e in self.events[1:]]
            lead = [gpu_at[k] - (self.host_s[k] - self.host_s[0]) * 1000.0 for k in range(n)]
        acc: dict[str, dict[str, list[float]]] = {}
        for k in range(1, n):
            a = acc.setdefault(self.names[k], {"host": [], "gpu": [], "lead": []})
            a["host"].append((self.host_s[k] - self.host_s[k - 1]) * 1000.0)
            if gpu_at is not None:
                a["gpu"].append(gpu_at[k] - gpu_at[k - 1])
                a["lead"].append(lead[k])
        out = {}
        for name, a in acc.items():
            out[name] = PhaseTiming(
                host_ms=float(sum(a["host"])),
                gpu_ms=float(sum(a["gpu"])) if a["gpu"] else None,
                lead_min_ms=float(min(a["lead"])) if a["lead"] else None,
                count=len(a["host"]),
            )
        return out


@dataclass
class StepTrace:
    """One traced step: host_ms is the wall time of the call; phases as in :class:`PhaseTiming`."""

    host_ms: float
    phases: dict[str, PhaseTiming] = field(default_factory=dict)


def trace_step(step: Callable[..., Any], device: torch.device) -> StepTrace:
    """Run ``step(on_phase=recorder)`` (a callable like :meth:`Session.step`) from an idle device
    and return its :class:`StepTrace`."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rec = PhaseRecorder(device)
    t0 = time.perf_counter()
    step(on_phase=rec)
    t1 = time.perf_counter()
    return StepTrace((t1 - t0) * 1000.0, rec.timings())


# The phases of a step that belong to its micro-batches (speedrun.train.loop.run_step): fetching
# them and issuing their forward and backward, eagerly or as a replayed graph (key, input copies,
# launch, what follows it: speedrun.train.loop.GRAPH_PHASES).  The rest of a step (setup, step end,
# reduction, optimizer, FP8 refresh) is once per step.
MICRO_BATCH_PHASES = ("data", "forward", "backward", "after_backward", "graph_key", "graph_inputs", "graph_launch",
                      "graph_after")


def summarize_traces(traces: Sequence[StepTrace], micro_batches: int | None = None) -> dict[str, Any]:
    """Medians over traced steps: ``host_ms`` (the whole call) and per phase ``host_ms``,
    ``gpu_ms``, ``lead_min_ms`` (None where not measured), plus ``steps``.  With
    ``micro_batches`` (per step) also ``micro_batch_host_ms``: the host time of a step's
    :data:`MICRO_BATCH_PHASES` over that count, the issue time per micro-batch.  Like every host
    time here it is an upper bound where the GPU trails far behind: a graph of many micro-batches
    fills the driver's launch queue, and its launch then waits for the GPU (a large lead).  So
    where a step has a ``graph_launch`` phase, ``micro_batch_host_ms_no_launch`` is the same sum
    without it: the host's own work around the launch, which no queue holds up."""
    if not traces:
        raise ValueError("no traced steps")
    if micro_batches is not None and micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    names: list[str] = []
    for t in traces:
        names += [n for n in t.phases if n not in names]

    def med(name: str, attr: str) -> float | None:
        vals = [getattr(t.phases[name], attr) for t in traces if name in t.phases]
        vals = [v for v in vals if v is not None]
        return float(np.median(vals)) if vals else None

    out = {
        "steps": len(traces),
        "host_ms": float(np.median([t.host_ms for t in traces])),
        "phases": {n: {"host_ms": med(n, "host_ms"), "gpu_ms": med(n, "gpu_ms"), "lead_min_ms": med(n, "lead_min_ms")}
                   for n in names},
    }
    if micro_batches is not None:
        def per_micro_batch(phases: Sequence[str]) -> float:
            per_step = [sum(p.host_ms for n, p in t.phases.items() if n in phases) for t in traces]
            return float(np.median(per_step)) / micro_batches

        out["micro_batches"] = micro_batches
        out["micro_batch_host_ms"] = per_micro_batch(MICRO_BATCH_PHASES)
        if "graph_launch" in names:
            out["micro_batch_host_ms_no_launch"] = per_micro_batch(
                [n for n in MICRO_BATCH_PHASES if n != "graph_launch"])
    return out


def _frame_text(f: traceback.FrameSummary) -> str:
    path = f.filename.replace("\\", "/")
    if path.startswith(_PKG_DIR):
        path = "speedrun/" + path[len(_PKG_DIR):]
    else:
        path = path.rsplit("/", 1)[-1]
    return f"{path}:{f.lineno} {f.name}"


def sync_site(stack: Sequence[traceback.FrameSummary], depth: int = 3) -> str:
    """Where a synchronising call came from: up to ``depth`` innermost frames of our package
    (outside this module), innermost first, joined by " < "; the innermost frame of any file when
    none of ours is on the stack."""
    def path(f):
        return f.filename.replace("\\", "/")

    ours = [f for f in reversed(stack)
            if path(f).startswith(_PKG_DIR) and path(f) != _OWN_FILE]
    if ours:
        return " < ".join(_frame_text(f) for f in ours[:depth])
    inner = [f for f in reversed(stack) if path(f) != _OWN_FILE and not path(f).endswith("/warnings.py")]
    return _frame_text(inner[0]) if inner else "<unknown>"


def collect_sync_warnings(run: Callable[[], Any]) -> list[dict[str, Any]]:
    """Run ``run()`` and collect every warning whose text names a synchronising CUDA operation,
    grouped by :func:`sync_site`: ``[{"site", "count", "message"}]``, most frequent first.  Other
    warnings pass through to the previous handler.  (Turning torch's sync debug mode on is
    :func:`find_syncs`'s job; this part is device-independent.)"""
    sites: dict[str, dict[str, Any]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        passthrough = warnings.showwarning

        def hook(message, category, filename, lineno, file=None, line=None):
            text = str(message)
            if SYNC_WARNING not in text:
                passthrough(message, category, filename, lineno, file, line)
                return
            site = sync_site(traceback.extract_stack()[:-1])
            entry = sites.setdefault(site, {"site": site, "count": 0, "message": text.splitlines()[0][:160]})
            entry["count"] += 1

        warnings.showwarning = hook
        run()
    return sorted(sites.values(), key=lambda e: -e["count"])


def find_syncs(run: Callable[[], Any], device: torch.device) -> list[dict[str, Any]] | None:
    """The synchronising calls ``run()`` makes on ``device`` (see :func:`collect_sync_warnings`),
    found with ``torch.cuda.set_sync_debug_mode("warn")``; None off CUDA (nothing to find)."""
    if device.type != "cuda":
        return None
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.synchronize(device)

    def guarded():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode(previous)

    found = collect_sync_warnings(guarded)
    torch.cuda.synchronize(device)
    return found
