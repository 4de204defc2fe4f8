"""Compulsory bytes and FLOPs of our Triton launches, for ``speedrun profile``.

The torch profiler names a Triton kernel but records no shapes for it, so a profile could not say
how many bytes one of our kernels *needs* (the "needed" column next to Nsight Compute's measured
DRAM bytes).  Each launcher therefore wraps its launch in :func:`launch_note`: while a profiler
records, the launch sits in a ``record_function`` range named
``speedrun.kernel:<kind>:<kernel>:bytes=<n>:flops=<f>`` (every input read once and every output
written once, from the tensors the launcher passes); otherwise the note costs one flag check.
:func:`parse_launch_note` reads such a name back (``speedrun.evidence.profile`` does).
"""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, NamedTuple, Sequence

if TYPE_CHECKING:
    import torch

# (torch is imported inside the functions: speedrun.evidence.profile parses notes without it)
PREFIX = "speedrun.kernel"
_NAME = re.compile(rf"^{re.escape(PREFIX)}:(?P<kind>[a-z0-9_]+):(?P<kernel>[A-Za-z0-9_]+):bytes=(?P<bytes>\d+):flops=(?P<flops>\d+)$")
_NULL = contextlib.nullcontext()
_PROFILER = None  # torch.autograd.profiler, bound on first use (a per-call import costs host time)


def _load_profiler():
    global _PROFILER
    from torch.autograd import profiler

    _PROFILER = profiler
    return profiler


class LaunchNote(NamedTuple):
    """One annotated launch: ``kind`` "gemm", "gemm_fp8" (FP8 operands: twice the bf16 matmul
    rate) or "memory"."""

    kernel: str
    kind: str
    nbytes: int
    flops: int


def tensor_bytes(tensors: Sequence["torch.Tensor | None"]) -> int:
    """Bytes of the tensors' elements (views count their own elements; None entries are skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def launch_note(kernel: str, reads: Sequence["torch.Tensor | None"] = (), writes: Sequence["torch.Tensor | None"] = (),
                flops: float = 0.0, extra_bytes: int = 0):
    """Context manager around one launch of ``kernel`` (its Triton function name): reads and
    writes are the tensors it must read and write at least once (whole tensors), ``extra_bytes``
    what it needs of others (e.g. the rows it reads of a table); ``flops`` > 0 marks a GEMM."""
    profiler = _PROFILER or _load_profiler()
    if not profiler._is_profiler_enabled:
        return _NULL
    kind = "memory"
    if flops > 0:
        kind = "gemm_fp8" if any(t is not None and t.element_size() == 1 for t in reads) else "gemm"
    nbytes = tensor_bytes(reads) + tensor_bytes(writes) + int(extra_bytes)
    return profiler.record_function(f"{PREFIX}:{kind}:{kernel}:bytes={nbytes}:flops={int(flops)}")


def parse_launch_note(name: str) -> LaunchNote | None:
    """The note in a profiler range name, or None if ``name`` is not one."""
    m = _NAME.match(name)
    if m is None:
        return None
    return LaunchNote(m["kernel"], m["kind"], int(m["bytes"]), int(m["flops"]))
