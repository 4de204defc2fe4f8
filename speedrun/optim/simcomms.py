"""One rank of an N-rank run, simulated in a single process: collectives as no-ops.

:class:`~speedrun.optim.normuon.NorMuonAndAdam` shards its matrix banks and its row-sharded Adam
tables over the ranks of its communicator.  Given a :class:`SimulatedComms` of world ``N`` and
rank ``r``, it builds exactly rank ``r``'s part of an N-rank optimizer: the momentum and
second-moment buffers of rank ``r``'s matrices, the Adam moments of its rows, Polar Express on its
``(chunk, rows, cols)`` shard (the N-rank shapes), the padding copies the optimizer makes for a
bank whose matrix count does not divide by N; while every collective returns at once with a
tensor of the shape the real one returns:

- ``all_reduce_avg``: the local tensor unchanged (the average of N equal tensors);
- ``reduce_scatter_avg``: this rank's dim-0 chunk of the local tensor (a view, nothing copied);
- ``all_gather``: this rank's shard is written into its place of the output, and the other ranks'
  parts stay as they are: the current weights, where the output is the parameter itself (every
  sharded Adam table, and a bank whose count divides by N).  A freshly allocated output (a bank
  the optimizer pads itself, the Adam moments gathered by ``untie``) holds no values yet: its other
  parts get copies of this rank's shard, so what is copied back from it stays finite and of the
  size training gives it (never uninitialised memory);
- the sparse bigram exchange (``exchange_counts``, ``all_to_all``): nothing arrives from the other
  ranks, so this rank's shard holds its own touched rows, averaged over N as the real exchange
  averages them.

Left out, by design: the time of the collectives themselves, the link, and waits for slower
ranks.  A step timed this way is one rank's compute and memory traffic, the part of an N-GPU step
that one GPU can measure (``speedrun bench step --as-rank-of N``).  What the collectives would
have moved is counted instead (:attr:`SimulatedComms.traffic`), so a projection can add their time
at a bus bandwidth it is given (:mod:`speedrun.evidence.projection`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from speedrun.optim.normuon import _Comms, _Pending

__all__ = ["SimulatedComms", "TRAFFIC_KINDS", "comms_for"]


# Collective kinds counted in ``SimulatedComms.traffic``.
TRAFFIC_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all")


class SimulatedComms(_Comms):
    """Rank ``rank`` of ``world`` ranks, alone in this process (see the module docstring).

    ``traffic``: bytes per collective kind since construction, as NCCL's bus-bandwidth
    accounting sizes them: an all-reduce its tensor, a reduce-scatter its full input, an
    all-gather its full output, an all-to-all what this rank sends (the rows of the sparse
    exchange that other ranks own; what it would receive is not known here, and a full-duplex
    link receives while it sends)."""

    def __init__(self, world: int, rank: int = 0):
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"SimulatedComms: rank {rank} is not in [0, world={world})")
        self.group = None
        self.active = False
        self.nccl = False
        self.world, self.rank = int(world), int(rank)
        self.traffic: dict[str, int] = dict.fromkeys(TRAFFIC_KINDS, 0)

    def _count(self, kind: str, t: Tensor) -> None:
        self.traffic[kind] += t.numel() * t.element_size()

    def _mine(self, t: Tensor) -> Tensor:
        chunk = t.size(0) // self.world
        return t[self.rank * chunk:(self.rank + 1) * chunk]

    def all_reduce_avg(self, t: Tensor) -> _Pending:
        self._count("all_reduce", t)
        return _Pending(None, lambda: t)

    def reduce_scatter_avg(self, full: Tensor) -> _Pending:
        if full.size(0) % self.world:
            raise ValueError(f"reduce_scatter: dim 0 of {tuple(full.shape)} does not split over {self.world} ranks")
        self._count("reduce_scatter", full)
        part = self._mine(full.contiguous())
        return _Pending(None, lambda: part)

    def all_gather(self, out: Tensor, shard: Tensor) -> _Pending:
        chunk = out.size(0) // self.world
        if out.size(0) % self.world or tuple(shard.shape) != (chunk, *out.shape[1:]):
            raise ValueError(f"all_gather: a shard of {tuple(shard.shape)} does not fill 1/{self.world} of "
                             f"{tuple(out.shape)}")
        self._count("all_gather", out)
        mine = self._mine(out)
        if out.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr():
            # the output is the tensor the shard was updated in: the others' parts are its values
            if shard.data_ptr() != mine.data_ptr() or shard.stride() != mine.stride():
                mine.copy_(shard)
        else:  # a fresh buffer: every part gets this rank's values (none is left uninitialised)
            out.unflatten(0, (self.world, chunk)).copy_(shard.unsqueeze(0))
        return _Pending(None, lambda: out)

    def all_to_all(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        if sum(out_splits) or out.numel():
            raise ValueError("all_to_all: a simulated rank receives nothing, but "
                             f"{sum(out_splits)} items were expected")
        self._count("all_to_all", inp)

    def exchange_counts(self, send_counts: Tensor) -> Tensor:
        return torch.zeros_like(send_counts)


def comms_for(info) -> SimulatedComms | None:
    """The communicator for ``info`` (:class:`speedrun.distributed.DistInfo`): a
    :class:`SimulatedComms` for a simulated rank, else None (the optimizer uses the process group)."""
    if getattr(info, "simulated", False):
        return SimulatedComms(info.world_size, info.rank)
    return None
