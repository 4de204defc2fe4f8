"""One optimizer step's micro-batches: forward and backward of each, gradients accumulated.

The loop body that :func:`speedrun.train.loop.run_step` runs eagerly and that
:mod:`speedrun.train.graphs` runs to capture a step (the same code, so a captured step is the
eager step)."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch

from speedrun.model.interface import ForwardArgs


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast on ``device``, or none for fp32."""
    if dtype == torch.float32:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


def accumulate(model, batches: Iterable, args: ForwardArgs, scale: float, device: torch.device,
               dtype: torch.dtype, mark: Callable[[str], None] | None = None) -> torch.Tensor:
    """Backward of ``model.loss(batch, args) * scale`` for every batch (gradients add up in
    ``.grad`` and the model's accumulators); returns the scaled losses' sum, a 0-d fp32 device
    tensor.  Device work only: this is what a CUDA graph of the step holds, so host work per
    micro-batch belongs in :func:`micro_batches`' ``on_batch``.  ``mark`` is called with "data",
    "forward", "backward", "after_backward" per micro-batch (host phase tracing)."""
    mark = mark or (lambda _: None)
    total = torch.zeros((), device=device)
    for batch in batches:
        mark("data")
        with autocast(device, dtype):
            loss = model.loss(batch, args) * scale
        mark("forward")
        loss.backward()
        mark("backward")
        total += loss.detach()
        mark("after_backward")
    return total


def micro_batches(loader, count: int, on_batch: Callable[[object], None] | None = None, *,
                  on_host: bool = False) -> Iterator:
    """``count`` batches from ``loader``, each fetched when the iteration reaches it and handed to
    ``on_batch`` first (host work per micro-batch, e.g. the recipe's ``note_batch``: it runs once
    per micro-batch whether the loop then runs eagerly or is replayed from a graph).  ``on_host``:
    left in host memory (see :meth:`speedrun.data.loader.TrainLoader.next_batch`)."""
    for _ in range(count):
        batch = loader.next_batch(on_host=on_host)
        if on_batch is not None:
            on_batch(batch)
        yield batch
