"""Describe and measure the node a timing was taken on.

:func:`node_fingerprint` records host, GPUs, driver, software versions and clocks, and (with
``measure``) two measured ceilings: dense bf16 matmul TFLOP/s and device-to-device copy TB/s.
Take one before and one after a set of timed runs; a drop between them means the node throttled.
The measurement functions are reusable as roofline ceilings.  Nothing here touches CUDA at import.
"""

from __future__ import annotations

import platform
import shutil
import socket
import subprocess
from typing import Any

import torch


def _nvidia_smi(query: str) -> list[list[str]] | None:
    """Rows of ``nvidia-smi --query-gpu=<query> --format=csv,noheader,nounits``; None if unavailable."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:  # "[N/A]" and similar
        return None


def time_cuda_ms(fn, iters: int, warmup: int) -> list[float]:
    """Milliseconds per call of ``fn`` for ``iters`` calls, each timed by its own CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def measure_matmul_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192, iters: int = 30,
                          warmup: int = 10, device: str | torch.device = "cuda") -> float:
    """Dense ``n x n @ n x n`` matmul throughput in TFLOP/s (2 n^3 flops; median of ``iters``
    CUDA-event-timed runs after ``warmup``).  Needs CUDA; raises RuntimeError without it."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_matmul_tflops needs a CUDA GPU")
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    times = time_cuda_ms(lambda: torch.mm(a, b, out=out), iters, warmup)
    ms = sorted(times)[len(times) // 2]
    return 2.0 * n**3 / (ms * 1e-3) / 1e12


def measure_copy_tbps(nbytes: int = 2**31, iters: int = 20, warmup: int = 3,
                      device: str | torch.device = "cuda") -> float:
    """Device-to-device copy bandwidth in TB/s: ``2 * nbytes`` (read + write) / median time.
    Needs CUDA and ``2 * nbytes`` of free device memory; raises RuntimeError without CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError("measure_copy_tbps needs a CUDA GPU")
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    times = time_cuda_ms(lambda: dst.copy_(src), iters, warmup)
    ms = sorted(times)[len(times) // 2]
    return 2.0 * nbytes / (ms * 1e-3) / 1e12


def node_fingerprint(measure: bool = True) -> dict[str, Any]:
    """A flat dict describing this node; GPU fields are None where there is no GPU.

    Keys: hostname, python, torch, cuda (torch's CUDA build), triton, gpu_name, gpu_count,
    gpu_capability ("9.0"), driver, clocks_sm_mhz / clocks_mem_mhz / clocks_max_sm_mhz (of GPU 0),
    matmul_bf16_tflops, copy_tbps (measured when ``measure`` and CUDA is available), errors.
    """
    fp: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": None,
        "gpu_name": None,
        "gpu_count": 0,
        "gpu_capability": None,
        "driver": None,
        "clocks_sm_mhz": None,
        "clocks_mem_mhz": None,
        "clocks_max_sm_mhz": None,
        "matmul_bf16_tflops": None,
        "copy_tbps": None,
        "errors": [],
    }
    try:
        import triton

        fp["triton"] = triton.__version__
    except ImportError:
        pass
    rows = _nvidia_smi("name,driver_version,clocks.sm,clocks.mem,clocks.max.sm")
    if rows:
        r0 = rows[0] + [""] * 5
        fp["gpu_name"], fp["driver"] = r0[0] or None, r0[1] or None
        fp["clocks_sm_mhz"], fp["clocks_mem_mhz"], fp["clocks_max_sm_mhz"] = map(_num, r0[2:5])
        fp["gpu_count"] = len(rows)
    if torch.cuda.is_available():
        fp["gpu_count"] = torch.cuda.device_count()
        fp["gpu_name"] = torch.cuda.get_device_name(0)
        fp["gpu_capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
        if measure:
            for key, fn in (("matmul_bf16_tflops", measure_matmul_tflops), ("copy_tbps", measure_copy_tbps)):
                try:
                    fp[key] = round(fn(), 3)
                except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                    fp["errors"].append(f"{key}: {e}")
            torch.cuda.empty_cache()
    return fp
