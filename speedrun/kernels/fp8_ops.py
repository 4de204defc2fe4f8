"""Small FP8 helpers shared by the kernels: tensorwise quantisation and a scaled GEMM.

Scales follow the ``torch._scaled_mm`` convention: a quantised tensor ``q`` stands for the real
tensor ``q * scale``, so quantising divides by the scale and the GEMM multiplies the fp32
accumulator by ``scale_a * scale_b``.

On a CUDA device with FP8 tensor cores (sm89 or newer) :func:`scaled_mm` calls
``torch._scaled_mm``; anywhere else it runs an emulation that dequantises both operands to fp32
(exact: every FP8 value is an fp32 value), multiplies in fp32 and casts the result.  The two agree
up to fp32 summation order, plus whatever ``use_fast_accum`` loses on the GPU.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["FP8_DTYPES", "cuda_capability", "fp8_supported", "quantize_tensorwise", "scaled_mm", "to_scale_tensor"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_supported(device: torch.device | str | None) -> bool:
    """True when ``torch._scaled_mm`` runs natively on ``device`` (CUDA, compute capability >= 8.9).

    Never initialises CUDA for a non-CUDA device; ``None`` means "the current CUDA device, if any".
    """
    if device is None:
        if not torch.cuda.is_available():
            return False
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return cuda_capability(device) >= (8, 9)


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) compute capability of a CUDA ``device``, asked once per device: the query
    is slow on the host and the launchers ask on every call (hundreds per step).  Under
    ``torch.compile`` the query is asked directly: Dynamo folds it to a constant, while tracing
    into an ``lru_cache`` makes it warn that the cache is bypassed."""
    index = torch.cuda.current_device() if device.index is None else device.index
    if torch.compiler.is_compiling():
        return tuple(torch.cuda.get_device_capability(index))
    return _capability_of(index)


@functools.lru_cache(maxsize=None)
def _capability_of(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def to_scale_tensor(scale: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor on ``device`` holding ``scale`` (what ``torch._scaled_mm`` expects).

    ``torch.full`` is a device fill, not a host-to-device copy, so this never synchronises.
    """
    if isinstance(scale, torch.Tensor):
        if scale.dim() == 0 and scale.dtype == torch.float32 and scale.device == device:
            return scale  # the usual case (cached and per-step scales): no view, no dispatch
        if scale.numel() != 1:
            raise ValueError(f"a tensorwise scale must hold one value, got shape {tuple(scale.shape)}")
        return scale.reshape(()).to(device=device, dtype=torch.float32)
    return torch.full((), float(scale), dtype=torch.float32, device=device)


def quantize_tensorwise(x: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantise ``x`` to FP8 ``dtype`` with one static scale: ``q = saturate(x / scale)``.

    ``x``: any floating tensor; ``scale``: positive float or 1-element tensor (the real value of one
    FP8 unit); ``dtype``: ``torch.float8_e4m3fn`` or ``torch.float8_e5m2``.  Division happens in fp32
    and values beyond the format's largest finite number saturate to it (a plain cast would give
    NaN or inf there), then the cast rounds to nearest even.  Returns a tensor of ``x``'s shape.
    """
    if dtype not in FP8_DTYPES:
        raise ValueError(f"quantize_tensorwise: dtype must be one of {FP8_DTYPES}, got {dtype}")
    if not x.is_floating_point():
        raise ValueError(f"quantize_tensorwise: x must be a floating tensor, got {x.dtype}")
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=x.device, dtype=torch.float32)
    limit = torch.finfo(dtype).max
    return torch.clamp(x.float() / scale, -limit, limit).to(dtype)


def _is_row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])


def _is_col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0])


def scaled_mm(
    a_fp8: torch.Tensor,
    b_fp8: torch.Tensor,
    scale_a: float | torch.Tensor,
    scale_b: float | torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    use_fast_accum: bool = False,
) -> torch.Tensor:
    """``(a_fp8 * scale_a) @ (b_fp8 * scale_b)`` computed as ``(a @ b) * (scale_a * scale_b)``.

    ``a_fp8``: (M, K) FP8; ``b_fp8``: (K, N) FP8; scales: floats or 1-element fp32 tensors.  Returns
    (M, N) in ``out_dtype``.  On the native CUDA path ``a`` should be row-major and ``b``
    column-major (``b = bt.T`` for a contiguous ``bt``); other layouts are copied into shape first,
    and M, K, N must be multiples of 16.  ``use_fast_accum`` only matters on the GPU.
    """
    if a_fp8.dim() != 2 or b_fp8.dim() != 2:
        raise ValueError(f"scaled_mm: expected 2-D operands, got {tuple(a_fp8.shape)} and {tuple(b_fp8.shape)}")
    if a_fp8.shape[1] != b_fp8.shape[0]:
        raise ValueError(f"scaled_mm: inner dimensions differ: {tuple(a_fp8.shape)} @ {tuple(b_fp8.shape)}")
    if a_fp8.dtype not in FP8_DTYPES or b_fp8.dtype not in FP8_DTYPES:
        raise ValueError(f"scaled_mm: operands must be FP8, got {a_fp8.dtype} and {b_fp8.dtype}")
    if a_fp8.dtype == torch.float8_e5m2 and b_fp8.dtype == torch.float8_e5m2:
        raise ValueError("scaled_mm: e5m2 x e5m2 is not supported by FP8 tensor cores; use e4m3 for one side")
    device = a_fp8.device
    sa = to_scale_tensor(scale_a, device)
    sb = to_scale_tensor(scale_b, device)
    if fp8_supported(device):
        m, k = a_fp8.shape
        n = b_fp8.shape[1]
        if m % 16 or k % 16 or n % 16:
            raise ValueError(
                f"scaled_mm: FP8 tensor-core GEMMs need every dimension divisible by 16, got "
                f"({m}, {k}) @ ({k}, {n})"
            )
        a = a_fp8 if _is_row_major(a_fp8) else a_fp8.contiguous()
        b = b_fp8 if _is_col_major(b_fp8) else b_fp8.t().contiguous().t()
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    acc = a_fp8.float() @ b_fp8.float()
    return (acc * (sa * sb)).to(out_dtype)
