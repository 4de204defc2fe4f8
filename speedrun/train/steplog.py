"""Step times and logged losses of the timed region, read without synchronising every step.

A step's loss and its end live on the device until the device gets there.  Reading them at once
(``loss.item()``, ``torch.cuda.synchronize()``) stops the host until the GPU has finished the step,
so the GPU then idles while the host prepares the next one (its batches, the step key, the
launches): a bubble in every logged step, and the record preset logs every step.  Instead the loop
records each step's end here (a CUDA event on the GPU, the host clock on the CPU, where work runs
as it is issued) and, for a step that logs, queues its loss as a non-blocking copy into pinned host
memory.  It reads a step only after it has issued the next one (:meth:`StepLog.finished` with
``keep=1``), so the GPU always has a step queued while the host waits and reads.

A step's time is the interval between its end and the previous step's end, when both lie in one
window of the loop's clock (see :class:`speedrun.train.loop.Clock`: no pause, such as a CUDA-graph
capture, and no stop for validation or a checkpoint between them).  The first step of a window is
timed from the window's start.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Finished:
    """A step the device has finished.  ``loss``: the mean training loss of the steps logged with
    it (``steps_logged`` of them), on the host; None for a step that does not log.  ``step_ms``:
    its own time (ms), None where no earlier end lies in its clock window."""

    step: int  # steps done after it
    stage: int
    loss: float | None
    steps_logged: int
    step_ms: float | None


@dataclass
class _Mark:
    step: int | None  # None: a window's start
    stage: int
    window: int
    end: Any  # torch.cuda.Event, or host seconds (time.perf_counter) off the GPU
    loss: torch.Tensor | None  # pinned host copy (or the CPU tensor itself), complete once ``end`` is
    steps_logged: int


class StepLog:
    """The queue of recorded step ends (see the module docstring).

    device: where the steps run (CUDA: events and pinned copies; else the host clock).
    clock: anything with an integer ``generation`` that changes whenever the loop's clock starts
    or resumes from a pause (:class:`speedrun.train.loop.Clock`): marks of different generations
    are never subtracted."""

    def __init__(self, device: torch.device, clock):
        self._cuda = device.type == "cuda"
        self._clock = clock
        self._queue: deque[_Mark] = deque()
        self._prev: _Mark | None = None  # the newest mark already handed out

    def start_window(self) -> None:
        """Mark the start of a clock window (after the clock started): its first step is timed from here."""
        self._queue.append(_Mark(None, -1, self._clock.generation, self._now(), None, 0))

    def record(self, step: int, stage: int, loss: torch.Tensor | None = None, steps_logged: int = 0) -> None:
        """The end of the step that leaves ``step`` steps done (in stage ``stage``), issued after all
        of its work.  ``loss``: a 0-d device tensor to read back (the logging window's mean), or None."""
        host = None
        if loss is not None:
            loss = loss.detach().float()
            if self._cuda:
                host = torch.empty((), dtype=torch.float32, pin_memory=True)
                host.copy_(loss, non_blocking=True)
            else:
                host = loss.clone()  # the caller may reuse its tensor
        self._queue.append(_Mark(step, stage, self._clock.generation, self._now(), host, steps_logged))

    def finished(self, keep: int = 0) -> list[Finished]:
        """The recorded steps except the newest ``keep``, oldest first, each once: waits for each
        one's end on the device (not for anything queued after it)."""
        out = []
        while len(self._queue) > keep:
            mark = self._queue.popleft()
            if self._cuda:
                mark.end.synchronize()
            prev, self._prev = self._prev, mark
            if mark.step is None:
                continue
            ms = None
            if prev is not None and prev.window == mark.window:
                ms = prev.end.elapsed_time(mark.end) if self._cuda else (mark.end - prev.end) * 1000.0
            loss = None if mark.loss is None else float(mark.loss.item())
            out.append(Finished(mark.step, mark.stage, loss, mark.steps_logged, ms))
        return out

    def pending(self) -> int:
        """Recorded marks (window starts included) not yet handed out."""
        return len(self._queue)

    def _now(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()
