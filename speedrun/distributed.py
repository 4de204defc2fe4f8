"""Process groups for torchrun, with a single-process fallback.

Reads the usual torchrun variables (RANK, WORLD_SIZE, LOCAL_RANK).  With WORLD_SIZE unset or 1,
nothing is initialised and every collective helper here is a no-op, so the same training code
runs as one plain process on a laptop.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


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
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return DistInfo(rank=rank, world_size=world, local_rank=local, device=device)


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


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()
