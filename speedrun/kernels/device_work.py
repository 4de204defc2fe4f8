"""Device work whose host half has already run: what a CUDA graph may capture and replay.

Some work after an optimizer update takes host decisions before its kernels (which scaling rule an
FP8 weight copy uses this time, whether a gradient buffer exists yet) and keeps host records
(refresh counters, version numbers).  A CUDA graph replays kernels only, so such work is split:
a ``prepare_*`` method takes every decision and keeps every record, and returns a
:class:`DeviceWork` whose :meth:`~DeviceWork.launch` issues kernels and nothing else.  Run
eagerly, ``prepare`` then ``launch`` is the old single call; captured, ``prepare`` runs every step
and the graph replays ``launch``.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import torch

__all__ = ["DeviceWork", "DeviceWorkChain"]


class DeviceWork:
    """Kernels to issue once their host half has run (see the module docstring).

    ``key``: hashable, equal between two launches that issue the same kernels, so that one capture
    serves both as long as the tensors keep their addresses (a capturer adds the addresses of
    :meth:`written` to it; what the work only reads must be tensors that keep theirs, such as the
    model's parameters); None when this launch must run eagerly (it allocates what later launches
    reuse, or reads host values that a replay would not).  Subclasses set ``key`` and implement
    :meth:`launch` and :meth:`written`, and :meth:`settle` where they keep host records that
    depend on when the work was issued."""

    key: Hashable | None = None

    def launch(self) -> None:
        """Issue the kernels.  With a ``key``, no host state is read or changed here."""
        raise NotImplementedError

    def written(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of everything :meth:`launch` writes (a capture snapshots and restores
        them, and its self-check compares them)."""
        raise NotImplementedError

    def settle(self) -> None:
        """Host records to take once this work, and whatever else its step issues before it,
        have been issued, replayed or not: e.g. the version counters of the weights an FP8 copy
        was made from, which an optimizer update issued eagerly advances and a replayed one does
        not.  Called on the host every step; nothing by default."""


class DeviceWorkChain(DeviceWork):
    """Several pieces of device work launched in order, as one; its key is the parts' keys, None
    when any part's is."""

    def __init__(self, parts: Sequence[DeviceWork]):
        self.parts = list(parts)
        keys = tuple(p.key for p in self.parts)
        self.key = None if any(k is None for k in keys) else keys

    def launch(self) -> None:
        for p in self.parts:
            p.launch()

    def written(self) -> list[tuple[str, torch.Tensor]]:
        return [item for p in self.parts for item in p.written()]

    def settle(self) -> None:
        for p in self.parts:
            p.settle()
