"""Python's cyclic garbage collector during timed steps: freeze what exists after the warmup, and
measure how long the collections that still run take.

A compiled training process holds millions of long-lived Python objects (Dynamo's and Inductor's
graphs, guards, generated modules, the model).  CPython's collector walks all of them whenever it
runs a full (generation 2) collection, and it decides to run one from the number of objects that
the steps allocate, so a full collection lands in some timed step at random and stalls the host
for tens to hundreds of milliseconds.  A step whose host work is close to its GPU time (the
candidate at stage 3, any arm at stage 1 on one GPU) pays that stall in full.

:func:`freeze_long_lived` runs one full collection and then moves every surviving object to the
collector's permanent generation (``gc.freeze()``): later collections skip them, while the objects
each step creates and drops are still collected as before.  ``train.gc_freeze`` (on by default)
applies it after the warmup in ``speedrun train``, after the arms' warmups in ``speedrun bench
step`` and before the profiled steps of ``speedrun profile``; each :func:`thaw` when it finishes.
:class:`CollectionMeter` sums the collector's pauses per label (the bench labels each arm's timed
steps) through ``gc.callbacks``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field


def freeze_long_lived() -> int:
    """One full collection, then freeze the survivors; returns how many objects are now frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Undo :func:`freeze_long_lived` (the frozen objects become collectable again)."""
    gc.unfreeze()


@dataclass
class CollectionStats:
    """Collections seen under one label: ``count[g]`` collections of generation ``g`` and their
    summed pause ``ms[g]`` (wall clock, milliseconds); ``longest_ms`` the longest single pause."""

    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    ms: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_ms: float = 0.0

    def as_dict(self) -> dict:
        return {"count_by_generation": list(self.count), "ms_by_generation": [round(v, 3) for v in self.ms],
                "total_ms": round(sum(self.ms), 3), "longest_ms": round(self.longest_ms, 3)}


class CollectionMeter:
    """Context manager: while active, every collection's pause is added to ``stats[label]`` (the
    current ``label``; collections while it is None are not counted)."""

    def __init__(self) -> None:
        self.label: str | None = None
        self.stats: dict[str, CollectionStats] = {}
        self._started: float | None = None

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None or self.label is None:
            self._started = None
            return
        ms = (time.perf_counter() - self._started) * 1000.0
        self._started = None
        st = self.stats.setdefault(self.label, CollectionStats())
        g = min(int(info.get("generation", 2)), 2)
        st.count[g] += 1
        st.ms[g] += ms
        st.longest_ms = max(st.longest_ms, ms)

    def __enter__(self) -> "CollectionMeter":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, dict]:
        return {k: v.as_dict() for k, v in self.stats.items()}
