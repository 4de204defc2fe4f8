"""A small fp32 device buffer rewritten once per training step from pinned host memory.

A CUDA graph reads fixed addresses, so a value that changes every step (a loss weight, a learning
rate, Adam's bias correction) reaches a captured step through a buffer like this one: the host
writes the step's values into pinned memory and one non-blocking copy, queued before the replay on
the same stream, moves them to the device.  Eager code reads the same buffer, so eager and replayed
steps compute with the same numbers.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["StepValues"]


class StepValues:
    """``size`` fp32 values on ``device`` (``buffer``), rewritten by :meth:`write` from pinned host
    memory (a queued non-blocking copy on CUDA).  Host buffers rotate through a ring and each waits
    for its previous copy, so the host never overwrites values a queued copy has yet to read."""

    RING = 4

    def __init__(self, device: torch.device, size: int):
        self.device = device
        self.buffer = torch.zeros(size, dtype=torch.float32, device=device)
        cuda = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.float32, pin_memory=cuda) for _ in range(self.RING)]
        self._host_np = [h.numpy() for h in self._host]  # the same memory, written without torch ops
        # one event per ring slot, recorded after its copy is queued (never recorded yet: no wait)
        self._done = [torch.cuda.Event() if cuda else None for _ in range(self.RING)]
        self._next = 0

    def write(self, values: Sequence[float]) -> torch.Tensor:
        """Queue ``values`` (at most ``size``; the rest of the buffer becomes 0) into ``buffer``,
        each rounded from the host's float64 to fp32 once; returns ``buffer``."""
        if len(values) > self.buffer.numel():
            raise ValueError(f"StepValues: {len(values)} values for a buffer of {self.buffer.numel()}")
        i = self._next
        self._next = (i + 1) % self.RING
        done = self._done[i]
        if done is not None:
            done.synchronize()  # the copy that last read this slot has run
        host = self._host_np[i]
        host.fill(0.0)
        host[: len(values)] = values  # float64 -> fp32, rounded to nearest as torch.tensor(...) does
        self.buffer.copy_(self._host[i], non_blocking=True)
        if done is not None:
            done.record()
        return self.buffer
