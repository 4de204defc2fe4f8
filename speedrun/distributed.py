"""Process groups for torchrun, with a single-process fallback.

Reads the usual torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK).  With WORLD_SIZE unset or 1,
nothing is initialised and every collective helper here is a no-op, so the same training code
runs as one plain process on a laptop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    """This process's place among the ranks.  ``simulated``: one process stands in for rank
    ``rank`` of ``world_size`` (``speedrun bench step --as-rank-of``, see :func:`simulated_rank`):
    no process group exists, so ``enabled`` is False and every collective here is a no-op.
    ``host_group``: the group for host values beside an NCCL one (gloo over the same ranks; None
    where the default group is gloo already, or there is none): see :func:`any_rank`."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    simulated: bool = False
    host_group: Any = field(default=None, compare=False, repr=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """A process group of several ranks is running (never for a simulated rank)."""
        return self.world_size > 1 and not self.simulated


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` -> this rank's CUDA device when CUDA exists, else the CPU."""
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device=cuda was asked for but this machine has no CUDA GPU")
        if device.index is None:
            device = torch.device("cuda", local_rank)
    return device


def setup(device_name: str = "auto") -> DistInfo:
    """Initialise the process group when launched by torchrun with WORLD_SIZE > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_name, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host_group = None
    if world > 1:
        if not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
        if dist.get_backend() == "nccl":
            # collective: every rank sets up at the same point of its run
            host_group = dist.new_group(backend="gloo")
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=device, host_group=host_group)


def simulated_rank(info: DistInfo, world_size: int, rank: int = 0) -> DistInfo:
    """``info`` (a single process) as rank ``rank`` of a simulated ``world_size``-rank run: the
    micro-batching, the loader's slice and the optimizer's shards of that rank, with collectives
    replaced by no-ops (:class:`speedrun.optim.simcomms.SimulatedComms`)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"a simulated world needs a whole number of ranks >= 1, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in [0, {world_size})")
    if info.enabled:
        raise ConfigError(f"simulating rank {rank} of {world_size} needs one process; this one is rank "
                          f"{info.rank} of {info.world_size} under torchrun")
    return DistInfo(rank=rank, world_size=world_size, local_rank=info.local_rank, device=info.device, simulated=True)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_mean_(tensors: list[torch.Tensor], info: DistInfo) -> None:
    """Average tensors in place across ranks (no-op on one rank)."""
    if not info.enabled:
        return
    for t in tensors:
        dist.all_reduce(t, op=dist.ReduceOp.AVG if t.device.type == "cuda" else dist.ReduceOp.SUM)
        if t.device.type != "cuda":
            t.div_(info.world_size)


def any_rank(flags: Sequence[bool], info: DistInfo) -> list[bool]:
    """Each of ``flags`` OR-ed over the ranks (as given on one process).  Host values over the host
    group, so the call waits for the other ranks' hosts, never for a device stream: the training
    loop asks it between steps without synchronising with the GPU work it has queued."""
    if not info.enabled:
        return [bool(f) for f in flags]
    t = torch.tensor([float(bool(f)) for f in flags])
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=info.host_group)
    return [bool(v) for v in t.tolist()]


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
