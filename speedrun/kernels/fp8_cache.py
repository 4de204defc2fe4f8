"""FP8 quantisation into both layouts from one read, and the per-optimizer-update FP8 weight cache.

Hopper FP8 GEMMs (``torch._scaled_mm``) take both operands K-major, so a weight ``W`` (R, C) used as
``x @ W.T`` in the forward and as ``g @ W`` in the backward is needed twice: row-major (R, C) and
transposed (C, R).  :func:`quantize_dual_layout` reads each bf16 element once and writes both FP8
layouts plus the absolute maximum of what it read (the amax that sets the *next* delayed scale).

Scale convention (everywhere in ``speedrun.kernels``): a *dequantisation* scale ``s`` (fp32) with
``real ~= fp8 * s``.  Quantisation is ``clamp(w * (1 / s), -FMAX, FMAX)`` rounded to nearest even,
with ``1 / s`` computed once in IEEE fp32, so the Triton kernel and the PyTorch reference agree
bit for bit.  FMAX is 448 for e4m3 (``torch.float8_e4m3fn``) and 57344 for e5m2.

:class:`FP8WeightCache` holds, for a set of named weights, both FP8 layouts and their scales.  It is
refreshed once per optimizer update (after ``optimizer.step()``), used by forward and backward, and
raises :class:`StaleFP8CacheError` when read after the weights changed without a refresh; it never
rebuilds itself inside a step.

Weight scaling policy (documented here, used by the cache):

* The first ``bootstrap_refreshes`` refreshes of a name use **current scaling**:
  ``s = amax(w) / 448`` from an extra read of ``w`` (one ``abs().amax`` pass), so a fresh or
  zero-initialised weight gets a sane scale.  (The record re-bootstraps for its first 16 steps.)
* After that, **delayed scaling**: ``s = max(amax_prev, 1e-12) * headroom / 448`` where
  ``amax_prev`` is the amax the kernel measured while quantising the previous update's weights.
  One optimizer update moves weights by a small fraction, so ``headroom`` (default 1.12, as in the
  record's W2 cache) covers the growth; anything larger saturates at +-448 (never inf/NaN).
  :meth:`FP8WeightCache.saturated` reports, on device, whether the last refresh clipped.
* Names in ``current_names`` use current scaling at every refresh (upstream f411b3d scales its
  MLP up projection this way; only its down projection is delayed).
* A ``multiplier`` (tensor or float) per name is folded into the returned dequantisation scale:
  the cache then represents ``multiplier * w`` while the FP8 payload stays ``quantise(w)``.  This is
  how a per-layer scalar such as the attention ``sa_lambda`` rides along for free.  No gradient flows
  to the multiplier through the cache.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch
import triton
import triton.language as tl

from speedrun.kernels._triton import cdiv, interpreting, launch, next_pow2, sm_count, triton_usable  # noqa: F401
from speedrun.kernels.addressing import AddressVersioned
from speedrun.kernels.device_work import DeviceWork
from speedrun.kernels.launch_notes import launch_note

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
AMAX_FLOOR = 1e-12  # keeps an all-zero tensor's scale finite (its payload is then all zeros)
_SCALAR_FP32 = torch.zeros((), dtype=torch.float32)  # stands in for a scale in argument checks


class StaleFP8CacheError(RuntimeError):
    """The FP8 weight cache was read after an optimizer update without :meth:`FP8WeightCache.refresh`."""


# (mantissa bits, smallest normal exponent) of each storage format, for _round_to_grid.
GRID = {E4M3: (3, -6), E5M2: (2, -14), torch.bfloat16: (7, -126), torch.float16: (10, -14)}


# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _round_to_grid(v, MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """Round fp32 ``v`` to nearest-even on a float grid with MANT mantissa bits (result still fp32).

    Only for the CPU interpreter, whose fp32 -> bf16/fp8 casts truncate or drop the carry into the
    exponent; rounding first makes its cast exact.  On GPU the hardware cast (cvt.rn) is used.
    Normals: add half an ulp (ties to even) to the bit pattern and clear the dropped bits.
    Subnormals (|v| < 2**EMIN): the fixed-ulp magic-number trick, SUB_C = 1.5 * 2**(23 + EMIN - MANT).
    """
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> (23 - MANT)) & 1
    r = ((bits + ((1 << (22 - MANT)) - 1) + lsb) >> (23 - MANT)) << (23 - MANT)
    normal = r.to(tl.float32, bitcast=True)
    # On |v|, then v's sign bit put back, so tiny negatives round to -0 like the hardware.
    mag = (tl.abs(v) + SUB_C) - SUB_C
    sub = (mag.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < MIN_NORMAL, sub, normal)


@triton.jit
def _fp8_bits(qf, MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """fp32 already clamped to +-FMAX -> FP8 bit pattern (uint8), round to nearest even.

    Integer arithmetic, no cvt instruction: when a kernel stores an FP8 tile both row-major and
    transposed, the cvt-packed bytes come out corrupted on sm90 with the ptxas that Triton 3.6
    bundles (triton-lang/triton#11111; seen here in the GEMM epilogue), while plain 8-bit integer
    data survives the same layout conversion.  It also sidesteps the CPU interpreter's inexact casts.
    """
    g = _round_to_grid(qf, MANT, EMIN, SUB_C, MIN_NORMAL)  # exactly on the FP8 grid now
    bits = g.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    e = ((bits >> 23) & 0xFF) - 127
    normal = ((e - EMIN + 1) << MANT) | ((bits & 0x7FFFFF) >> (23 - MANT))
    # Subnormals (and zero) are integer multiples of 2**(EMIN - MANT); scaling by a power of 2 is exact.
    sub = (tl.minimum(tl.abs(g), MIN_NORMAL) * (1.0 / (MIN_NORMAL * (0.5**MANT)))).to(tl.int32)
    code = tl.where(tl.abs(g) < MIN_NORMAL, sub, normal)
    return (sign | code).to(tl.uint8)


@triton.jit
def _fp8_bits_hw(qf, E5M2: tl.constexpr):
    """fp32 already clamped to +-FMAX -> FP8 bit pattern (uint8) with the hardware cvt (RNE).

    Safe where a kernel stores each FP8 tile once, or in a blocked layout (the quantise kernel,
    checked bit for bit at record shapes in tests/gpu); see :func:`_fp8_bits` for where it is not.
    """
    if E5M2:
        return qf.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return qf.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


def grid_constants(dtype: torch.dtype) -> dict:
    """Constexpr arguments of :func:`_round_to_grid` for a storage dtype (prefixed by the caller)."""
    mant, emin = GRID[dtype]
    return dict(MANT=mant, EMIN=emin, SUB_C=1.5 * 2.0 ** (23 + emin - mant), MIN_NORMAL=2.0**emin)


@triton.jit
def _dual_layout_kernel(
    w_ptr, q_ptr, qt_ptr, scale_ptr, amax_ptr, row_scale_ptr,
    R, C, stride_wb, stride_wr, n_partials,
    SCALE_PER_MATRIX: tl.constexpr, FMAX: tl.constexpr, FP8_E5M2: tl.constexpr, STORE_T: tl.constexpr,
    SCALE_FROM_AMAX: tl.constexpr, AMAX_FLOOR_C: tl.constexpr, ROW_SCALE: tl.constexpr, STORE_Q: tl.constexpr,
    PARTIALS_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    EXACT_CASTS: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr, MIN_NORMAL: tl.constexpr,
):
    """SCALE_FROM_AMAX (current scaling of one matrix): ``amax_ptr`` is an input holding the
    measured max |w| and ``scale_ptr`` an output, ``s = max(amax, floor) / FMAX`` computed here
    (saves the two tiny torch kernels that computed it, and the atomic amax this pass would repeat);
    otherwise ``scale_ptr`` is an input and max |w| is max-accumulated into ``amax_ptr``.
    PARTIALS_BLOCK > 0 (with SCALE_FROM_AMAX): ``amax_ptr`` holds ``n_partials`` per-program maxima
    of the abs-max pass (:func:`abs_max_partials`), reduced here by every program (NaN propagates).
    ROW_SCALE: each row is first multiplied by ``row_scale_ptr[row]`` (fp32), and the amax is of
    the scaled rows; STORE_Q False skips the row-major output (transposed layout only)."""
    pid = tl.program_id(0)
    b = tl.program_id(1)
    tiles_c = tl.cdiv(C, BLOCK_C)
    offs_r = (pid // tiles_c) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_c = (pid % tiles_c) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_r[:, None] < R) & (offs_c[None, :] < C)
    w = tl.load(w_ptr + b * stride_wb + offs_r[:, None] * stride_wr + offs_c[None, :], mask=mask, other=0.0)
    w = w.to(tl.float32)
    if ROW_SCALE:
        w = w * tl.load(row_scale_ptr + offs_r, mask=offs_r < R, other=0.0)[:, None]
    if SCALE_FROM_AMAX:
        if PARTIALS_BLOCK > 0:
            k = tl.arange(0, PARTIALS_BLOCK)
            parts = tl.load(amax_ptr + k, mask=k < n_partials, other=0.0)
            a = tl.max(parts, axis=0)
            a = tl.where(tl.max((parts != parts).to(tl.int32), axis=0) > 0, float("nan"), a)
        else:
            a = tl.load(amax_ptr)
        # torch's clamp_min propagates NaN; so does this (a NaN input gives NaN payload and scale).
        s = tl.math.div_rn(tl.where(a != a, a, tl.maximum(a, AMAX_FLOOR_C)), FMAX)
        tl.store(scale_ptr, s, mask=(pid == 0) & (b == 0))
    elif SCALE_PER_MATRIX:
        s = tl.load(scale_ptr + b)
    else:
        s = tl.load(scale_ptr)
    inv = tl.math.div_rn(1.0, s)
    qf = tl.minimum(tl.maximum(w * inv, -FMAX), FMAX)
    if EXACT_CASTS:
        q = _fp8_bits(qf, MANT, EMIN, SUB_C, MIN_NORMAL)
    else:
        q = _fp8_bits_hw(qf, FP8_E5M2)
    base = b.to(tl.int64) * R * C
    if STORE_Q:
        tl.store(q_ptr + base + offs_r[:, None] * C + offs_c[None, :], q, mask=mask)
    if STORE_T:
        # Same tile, transposed addressing: the compiler stages it through shared memory so the
        # (C, R) writes stay coalesced.
        tl.store(qt_ptr + base + offs_c[None, :] * R + offs_r[:, None], q, mask=mask)
    if not SCALE_FROM_AMAX:
        # |w| >= 0, so a float atomic max is exact and order-independent.
        tl.atomic_max(amax_ptr + b, tl.max(tl.max(tl.abs(w), axis=1), axis=0))


def _check_quant_args(w: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, name: str) -> None:
    if w.dim() not in (2, 3):
        raise ValueError(f"{name}: expected a (R, C) or (B, R, C) tensor, got shape {tuple(w.shape)}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: expected bf16/fp16/fp32 input, got {w.dtype} with shape {tuple(w.shape)}")
    R, C = w.shape[-2:]
    if R % 16 or C % 16:
        raise ValueError(f"{name}: both matrix dims must be multiples of 16 (FP8 GEMM), got shape {tuple(w.shape)}")
    if w.stride(-1) != 1 or (R > 1 and w.stride(-2) != C):
        raise ValueError(f"{name}: each matrix must be row-major contiguous, got shape {tuple(w.shape)} strides {w.stride()}")
    if fp8_dtype not in FP8_MAX:
        raise ValueError(f"{name}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
        raise ValueError(f"{name}: scale must be an fp32 tensor, got {type(scale).__name__} {getattr(scale, 'dtype', '')}")
    batch = w.shape[0] if w.dim() == 3 else None
    if not (scale.dim() == 0 or (batch is not None and tuple(scale.shape) == (batch,))):
        raise ValueError(
            f"{name}: scale must be 0-d or per-matrix ({batch},) for input shape {tuple(w.shape)}, got {tuple(scale.shape)}"
        )


def _alloc(w, fp8_dtype, out, out_t, amax, transposed=True, check_out=True, check_amax=True):
    R, C = w.shape[-2:]
    lead = tuple(w.shape[:-2])
    if out is None:
        out = torch.empty(lead + (R, C), dtype=fp8_dtype, device=w.device)
    if out_t is None:
        # Without the transposed layout the kernel never touches out_t; a 0-element placeholder.
        out_t = torch.empty(lead + (C, R) if transposed else (0,), dtype=fp8_dtype, device=w.device)
    if amax is None:
        amax = torch.zeros(lead, dtype=torch.float32, device=w.device)
    checks = ([(out, lead + (R, C), "out")] if check_out else []) + ([(out_t, lead + (C, R), "out_t")] if transposed else [])
    for t, shape, what in checks:
        if tuple(t.shape) != shape or t.dtype != fp8_dtype or not t.is_contiguous():
            raise ValueError(f"{what} must be a contiguous {fp8_dtype} tensor of shape {shape}, got {t.dtype} {tuple(t.shape)}")
    if check_amax and (tuple(amax.shape) != lead or amax.dtype != torch.float32):
        raise ValueError(f"amax must be an fp32 tensor of shape {lead}, got {amax.dtype} {tuple(amax.shape)}")
    return out, out_t, amax


def quantize_dual_layout(
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_dtype: torch.dtype = E4M3,
    out: torch.Tensor | None = None,
    out_t: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantise ``w`` to FP8 in both layouts with one read (Triton).

    Args:
        w: (R, C) or (B, R, C) bf16/fp16/fp32, each matrix row-major (a batch stride is allowed, so
            ``bank[:, 0]`` works); R and C multiples of 16.
        scale: fp32 dequantisation scale, 0-d or per matrix (B,).
        fp8_dtype: ``torch.float8_e4m3fn`` (weights, activations) or ``torch.float8_e5m2`` (gradients).
        out, out_t, amax: optional preallocated outputs.  ``amax`` is max-accumulated into (pass
            zeros for a fresh measurement).

    Returns:
        ``(w_fp8 (.., R, C), w_fp8_t (.., C, R) contiguous, amax (..) fp32 = max |w| per matrix)``.
    """
    _check_quant_args(w, scale, fp8_dtype, "quantize_dual_layout")
    return _quantize(w, scale, fp8_dtype, transposed=True, out=out, out_t=out_t, amax=amax)


def quantize_dual_layout_reference(
    w: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_dtype: torch.dtype = E4M3,
    out: torch.Tensor | None = None,
    out_t: torch.Tensor | None = None,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch reference of :func:`quantize_dual_layout` (same signature, same bits)."""
    _check_quant_args(w, scale, fp8_dtype, "quantize_dual_layout_reference")
    out, out_t, amax = _alloc(w, fp8_dtype, out, out_t, amax)
    fmax = FP8_MAX[fp8_dtype]
    inv = 1.0 / scale
    if w.dim() == 3 and scale.dim() == 1:
        inv = inv[:, None, None]
    q = (w.float() * inv).clamp(-fmax, fmax).to(fp8_dtype)
    out.copy_(q)
    out_t.copy_(q.transpose(-1, -2))
    amax.copy_(torch.maximum(amax, w.float().abs().amax(dim=(-2, -1))))
    return out, out_t, amax


def quantize_static(x: torch.Tensor, scale: torch.Tensor, *, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """Row-major FP8 copy of one matrix with a scale chosen in advance (static or delayed): one
    read, one Triton launch (eager torch needs four kernels and fp32 temporaries).

    x: (R, C) row-major bf16/fp16/fp32, R and C multiples of 16; scale: 0-d fp32.  Values beyond
    ``FMAX * scale`` saturate.  Returns (R, C) FP8, the bits of :func:`quantize_static_reference`."""
    _check_matrix_and_scale(x, scale, fp8_dtype, "quantize_static")
    return _quantize(x, scale, fp8_dtype, transposed=False)[0]


def quantize_static_reference(x: torch.Tensor, scale: torch.Tensor, *, fp8_dtype: torch.dtype = E4M3) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`quantize_static` (same signature, same bits)."""
    _check_matrix_and_scale(x, scale, fp8_dtype, "quantize_static_reference")
    return quantize_dual_layout_reference(x, scale, fp8_dtype=fp8_dtype)[0]


def quantize_rows_scaled_t(
    x: torch.Tensor, row_scale: torch.Tensor, scale: torch.Tensor, *, fp8_dtype: torch.dtype = E4M3
) -> torch.Tensor:
    """The transposed FP8 layout of row-scaled x, ``((x * row_scale[:, None]) / scale)ᵀ``, from one
    read of x (Triton): what a weight-gradient GEMM ``(x ⊙ g)ᵀ @ dY`` wants when each row carries
    its own output-gradient factor (the LM head's per-token loss gradient).

    x: (R, C) row-major bf16/fp16/fp32, R and C multiples of 16; row_scale: (R,) fp32;
    scale: 0-d fp32.  Returns (C, R) contiguous FP8, the bits of
    :func:`quantize_rows_scaled_t_reference`."""
    _check_rows_scaled(x, row_scale, scale, fp8_dtype, "quantize_rows_scaled_t")
    return _quantize(x, scale, fp8_dtype, transposed=True, row_scale=row_scale, store_rowmajor=False)[1]


def quantize_rows_scaled_t_reference(
    x: torch.Tensor, row_scale: torch.Tensor, scale: torch.Tensor, *, fp8_dtype: torch.dtype = E4M3
) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`quantize_rows_scaled_t` (same signature, same bits)."""
    _check_rows_scaled(x, row_scale, scale, fp8_dtype, "quantize_rows_scaled_t_reference")
    fmax = FP8_MAX[fp8_dtype]
    q = ((x.float() * row_scale[:, None]) * (1.0 / scale)).clamp(-fmax, fmax).to(fp8_dtype)
    return q.t().contiguous()


def _check_matrix_and_scale(x, scale, fp8_dtype, name):
    """One (R, C) matrix and a 0-d fp32 scale (a 2-D input admits no per-matrix scale)."""
    _check_quant_args(x, scale, fp8_dtype, name)
    if x.dim() != 2:
        raise ValueError(f"{name}: expected one (R, C) matrix, got shape {tuple(x.shape)}")


def _check_rows_scaled(x, row_scale, scale, fp8_dtype, name):
    _check_matrix_and_scale(x, scale, fp8_dtype, name)
    if (not isinstance(row_scale, torch.Tensor) or row_scale.dtype != torch.float32
            or tuple(row_scale.shape) != (x.shape[0],) or not row_scale.is_contiguous()):
        raise ValueError(f"{name}: row_scale must be a contiguous fp32 ({x.shape[0]},) tensor, got "
                         f"{getattr(row_scale, 'dtype', type(row_scale).__name__)} {tuple(getattr(row_scale, 'shape', ()))}")


# (BLOCK_R, BLOCK_C, num_warps) on GPU; benchmarks/bench_mlp.py --sweep times alternatives.
QUANT_CONFIG = (32, 128, 4)


def _quantize(w, scale, fp8_dtype, *, transposed, out=None, out_t=None, amax=None, scale_from_amax=False,
              row_scale=None, store_rowmajor=True, partials=None):
    """Shared launcher: the dual-layout kernel, or row-major only when ``transposed`` is False.

    ``scale_from_amax`` (Triton only, one matrix): ``amax`` holds the measured max |w| and the
    kernel writes ``scale`` (an output) from it instead of reading it; or ``partials`` (1-D fp32,
    with ``scale_from_amax``, Triton only) holds per-program maxima the kernel reduces first.
    ``row_scale`` (R,) fp32 (one matrix) multiplies each row first; ``store_rowmajor`` False
    writes only the transposed layout (``out`` is then a 0-element placeholder)."""
    if partials is not None and not (scale_from_amax and triton_usable(w) and w.dim() == 2 and partials.dim() == 1
                                     and partials.dtype == torch.float32 and partials.numel() > 0):
        raise ValueError("_quantize: partials need scale_from_amax, the Triton path, one matrix and a "
                         f"non-empty 1-D fp32 tensor, got {partials.dtype} {tuple(partials.shape)}")
    if not store_rowmajor and out is None:
        out = torch.empty((0,), dtype=fp8_dtype, device=w.device)
    out, out_t, amax = _alloc(w, fp8_dtype, out, out_t, partials if partials is not None else amax, transposed,
                              check_out=store_rowmajor, check_amax=partials is None)
    if not triton_usable(w):
        src = w if row_scale is None else w.float() * row_scale[:, None]  # the kernel's order: scale rows, then 1/s
        q, qt, a = quantize_dual_layout_reference(src, scale, fp8_dtype=fp8_dtype)
        if store_rowmajor:
            out.copy_(q)
        if transposed:
            out_t.copy_(qt)
        amax.copy_(torch.maximum(amax, a))
        return out, out_t, amax
    R, C = w.shape[-2:]
    B = w.shape[0] if w.dim() == 3 else 1
    if interpreting():
        br, bc, warps = 128, 128, 1  # few programs: the interpreter pays per program and per op
    else:
        br, bc, warps = QUANT_CONFIG
    grid = (cdiv(R, br) * cdiv(C, bc), B)
    with launch_note("_dual_layout_kernel", reads=(w, row_scale, partials),
                     writes=(out if store_rowmajor else None, out_t if transposed else None)):
        launch(_dual_layout_kernel, grid,
            w, out.view(torch.uint8), out_t.view(torch.uint8), scale, amax, row_scale if row_scale is not None else scale,
            R, C, w.stride(0) if w.dim() == 3 else 0, w.stride(-2), partials.numel() if partials is not None else 0,
            SCALE_PER_MATRIX=scale.dim() == 1, FMAX=FP8_MAX[fp8_dtype], FP8_E5M2=fp8_dtype == E5M2, STORE_T=transposed,
            SCALE_FROM_AMAX=scale_from_amax, AMAX_FLOOR_C=AMAX_FLOOR, ROW_SCALE=row_scale is not None,
            STORE_Q=store_rowmajor, PARTIALS_BLOCK=next_pow2(partials.numel()) if partials is not None else 0,
            BLOCK_R=br, BLOCK_C=bc, num_warps=warps,
            EXACT_CASTS=interpreting(), **grid_constants(fp8_dtype),
        )
    return out, out_t, amax


@triton.jit
def _abs_max_kernel(x_ptr, amax_ptr, n, step, BLOCK: tl.constexpr, ITERS: tl.constexpr, PARTIALS: tl.constexpr):
    """max |x| over a flat tensor: grid-stride loop of ITERS blocks ``step`` = programs x BLOCK
    apart; NaN propagates.  Each program max-accumulates its maximum into ``amax_ptr[0]`` with one
    atomic (the buffer zeroed first), or with PARTIALS stores it to ``amax_ptr[program]`` (no
    zeroing, no atomic: the consumer reduces the partials).  ITERS is a constexpr because the CPU
    interpreter cannot take a runtime loop bound (few values occur: one per tensor size)."""
    pid = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in range(0, ITERS):
        offs = pid * BLOCK + i * step + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
        bad = tl.maximum(bad, (x != x).to(tl.int32))
    m = tl.max(acc, axis=0)
    m = tl.where(tl.max(bad, axis=0) > 0, float("nan"), m)
    if PARTIALS:
        tl.store(amax_ptr + pid, m)
    else:
        # Non-negative floats order like their bit patterns (NaN above inf), so the atomic is exact.
        tl.atomic_max(amax_ptr, m)


ABS_MAX_CONFIG = (4096, 8, 4)  # BLOCK elements per iteration, num_warps, programs per SM


def _abs_max_triton_ok(x: torch.Tensor) -> bool:
    return triton_usable(x) and x.is_contiguous() and 0 < x.numel() < 2**31


def _launch_abs_max(x: torch.Tensor, partials: bool) -> torch.Tensor:
    n = x.numel()
    block, warps, per_sm = (1024, 1, 0) if interpreting() else ABS_MAX_CONFIG
    programs = cdiv(n, block)
    if x.is_cuda:
        programs = min(programs, per_sm * sm_count(x.device))
    else:
        programs = min(programs, 4)  # the interpreter pays per program
    # partials: every program writes its own slot (no zeroing); else one zeroed slot, atomics
    out = (torch.empty((programs,), dtype=torch.float32, device=x.device) if partials
           else torch.zeros((), dtype=torch.float32, device=x.device))
    step = programs * block
    with launch_note("_abs_max_kernel", reads=(x,), writes=(out,)):
        launch(_abs_max_kernel, (programs,), x, out, n, step, BLOCK=block, ITERS=cdiv(n, step), PARTIALS=partials,
               num_warps=warps)
    return out


def abs_max(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` as a 0-d fp32 tensor (NaN if x holds one), read once at full bandwidth.

    Triton grid-stride reduction on CUDA / under the interpreter for contiguous tensors below 2**31
    elements, else :func:`abs_max_reference`.  Exact: the maximum does not depend on order."""
    if not _abs_max_triton_ok(x):
        return abs_max_reference(x)
    return _launch_abs_max(x, partials=False)


def abs_max_partials(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` left as per-program maxima: a 1-D fp32 tensor (at most 4 per SM) whose max is
    :func:`abs_max` (NaN if x holds one).  Saves the zeroed output and the atomics of
    :func:`abs_max` for a consumer that reduces the partials itself (the quantise kernel of
    :func:`quantize_current`).  Same conditions as :func:`abs_max`; elsewhere one partial, the
    reference's maximum."""
    if not _abs_max_triton_ok(x):
        return abs_max_reference(x).reshape(1)
    return _launch_abs_max(x, partials=True)


def abs_max_reference(x: torch.Tensor) -> torch.Tensor:
    """Reference of :func:`abs_max` (same signature): ``linalg.vector_norm(x, inf)`` in fp32."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return torch.linalg.vector_norm(x, ord=float("inf")).float()


def quantize_current(
    x: torch.Tensor, *, fp8_dtype: torch.dtype = E4M3, transposed: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Current (just-in-time) tensorwise scaling of one matrix: ``s = max(max|x|, 1e-12) / FMAX``.

    x: (R, C) bf16/fp16/fp32 row-major, R and C multiples of 16.  Two reads of ``x`` (the amax
    pass, leaving per-program maxima, then the quantise kernel, which reduces them and derives the
    scale itself: two Triton launches, no memset, no atomics).  Returns ``(x_fp8 (R, C), x_fp8_t
    (C, R) or None, s 0-d fp32)``, bit-identical to :func:`quantize_current_reference`.
    """
    _check_one_matrix(x, fp8_dtype, "quantize_current")
    return _quantize_from_amax(x, abs_max_partials(x) if _abs_max_triton_ok(x) else abs_max(x), fp8_dtype, transposed)


def quantize_current_graph(
    x: torch.Tensor, *, fp8_dtype: torch.dtype = E4M3, transposed: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """:func:`quantize_current` written as torch ops for ``torch.compile`` to fuse into the code
    that produces ``x`` (same signature; in eager, the bits of :func:`quantize_current_reference`).

    Compiled where ``x`` comes out of an RMS norm (the record MLP's input), Inductor folds
    ``max|x|`` into the norm's reduction and the cast into one pointwise pass, so ``x`` is read
    once after the norm instead of twice.  Compiled, the result is not bit for bit the
    reference's: Inductor divides with ``div.full.f32`` (approximate, at most 2 ulp) unless
    ``TORCHINDUCTOR_EMULATE_DIVISION_ROUNDING=1``, and inside one kernel it may quantise the
    producer's fp32 values without their 16-bit rounding (``emulate_precision_casts`` off); each
    byte stays within one FP8 step of the reference's.
    """
    _check_one_matrix(x, fp8_dtype, "quantize_current_graph")
    fmax = FP8_MAX[fp8_dtype]
    amax = x.abs().amax().float() if x.numel() else torch.zeros((), dtype=torch.float32, device=x.device)
    scale = current_scale(amax, fmax)
    q = (x.float() * (1.0 / scale)).clamp(-fmax, fmax).to(fp8_dtype)
    return q, (q.t().contiguous() if transposed else None), scale


def _check_one_matrix(x: torch.Tensor, fp8_dtype: torch.dtype, name: str) -> None:
    _check_quant_args(x, _SCALAR_FP32, fp8_dtype, name)
    if x.dim() != 2:
        raise ValueError(f"{name}: expected one (R, C) matrix, got shape {tuple(x.shape)}")


def _quantize_from_amax(x, amax, fp8_dtype, transposed):
    """Quantise one checked matrix with ``s = max(amax, 1e-12) / FMAX`` (``amax``: 0-d fp32, the
    measured max |x|, or on the Triton path 1-D :func:`abs_max_partials`); the Triton kernel
    computes s itself.  Returns (q, qt or None, s)."""
    if not triton_usable(x):
        scale = current_scale(amax, FP8_MAX[fp8_dtype])
        q, qt, _ = quantize_dual_layout_reference(x, scale, fp8_dtype=fp8_dtype)
        return q, (qt if transposed else None), scale
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    partials = amax if amax.dim() == 1 else None
    q, qt, _ = _quantize(x, scale, fp8_dtype, transposed=transposed, amax=None if partials is not None else amax,
                         scale_from_amax=True, partials=partials)
    return q, (qt if transposed else None), scale


def quantize_delayed(
    x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, *, fp8_dtype: torch.dtype = E4M3, transposed: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Delayed scaling of one matrix: quantise with a scale chosen earlier (from a previous amax)
    and max-accumulate this call's ``max|x|`` into ``amax`` for the next one: one read of ``x``.

    x: (R, C) row-major bf16/fp16/fp32; scale, amax: 0-d fp32.  Values beyond ``FMAX * scale``
    saturate.  Returns ``(x_fp8 (R, C), x_fp8_t (C, R) or None)``; the reference is
    :func:`quantize_dual_layout_reference` (same bits)."""
    _check_quant_args(x, scale, fp8_dtype, "quantize_delayed")
    if x.dim() != 2 or scale.dim() != 0:
        raise ValueError(f"quantize_delayed: expected one (R, C) matrix and a 0-d scale, got {tuple(x.shape)}, {tuple(scale.shape)}")
    q, qt, _ = _quantize(x, scale, fp8_dtype, transposed=transposed, amax=amax)
    return q, (qt if transposed else None)


def current_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """Current scaling's ``max(amax, 1e-12) / fmax`` (fp32, elementwise), correctly rounded on every
    device, as the quantise kernel computes it (``div_rn``).  Not ``amax / fmax``: torch on CUDA
    divides by a Python scalar as a multiply by the scalar's rounded reciprocal, one ulp off for
    some amaxes (amax 5.25: 0.011718750931 instead of 0.01171875), which
    moves ~3% of the quantised bytes; a same-device tensor divisor takes the true division."""
    return amax.clamp_min(AMAX_FLOOR) / torch.full((), fmax, dtype=torch.float32, device=amax.device)


def headroom_scale(amax: torch.Tensor, headroom: float, fmax: float) -> torch.Tensor:
    """The delayed-scaling formula every FP8 cache and state uses: ``max(amax, 1e-12) * headroom /
    fmax`` (elementwise; amax fp32)."""
    return amax.clamp_min(AMAX_FLOOR) * (headroom / fmax)


def _detached_copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


INPUT_HEADROOM = 1.5
INPUT_SCALINGS = ("current", "delayed")


class StepScale:
    """One slot's step scale ``max(amax, 1e-12) * factor`` (0-d fp32) in a tensor whose address
    never changes, and the amax version it was computed from.  ``amax`` and ``scale`` are bound
    once: the :class:`InputScaling` holding this entry vouches for its addresses
    (:class:`~speedrun.kernels.addressing.AddressVersioned`), and replaces the entry to change them."""

    def __init__(self, amax: torch.Tensor, factor: float, scale: torch.Tensor):
        self.amax, self.factor, self.scale = amax, float(factor), scale
        self.version = amax._version

    def __setattr__(self, name: str, value) -> None:
        if name in ("amax", "scale") and name in self.__dict__:
            raise AttributeError(f"StepScale.{name} is bound once (its holder's address version counts on it)")
        object.__setattr__(self, name, value)

    def update(self) -> None:
        """Recompute in place (the same arithmetic as :func:`headroom_scale`)."""
        torch.mul(self.amax.clamp_min(AMAX_FLOOR), self.factor, out=self.scale)
        self.version = self.amax._version


@dataclass(kw_only=True)
class InputScaling(AddressVersioned):
    """FP8 scaling of one layer's activation input ``x`` (e4m3) and output gradient ``g`` (e5m2),
    and the step-synchronous bookkeeping of delayed scales (subclasses add their own slots).

    ``input_scaling="current"``: :func:`quantize_current` (an exact amax pass, then the quantise
    kernel).  ``"delayed"``: the scale is ``x_amax`` (or ``g_amax``) x ``input_headroom`` / FMAX and
    the quantise kernel max-accumulates this call's amax into ``x_acc`` (:func:`quantize_delayed`):
    one read of the tensor instead of two and no reduction launch.

    Step-synchronous: ``*_amax`` stays fixed through an optimizer step; :func:`end_fp8_step` sets
    it to the max of ``*_acc`` over the step's calls on every rank (one max all-reduce for all
    layers) and zeroes ``*_acc``.  So every micro-batch of a step, on any number of ranks, uses the
    same scale, and N ranks take the same steps as one rank with accumulation.  Until a slot's
    first step end (``*_ready`` False) it uses current scaling per call.  Values above a scale's
    range saturate (a jump is clipped for one step).  0-d fp32 device tensors; no host sync.

    Its ``address_version`` (:class:`~speedrun.kernels.addressing.AddressVersioned`) counts every
    change of the tensors it holds, so the CUDA graphs' address watch checks one number per layer
    and slot; the gradient handover lives within one backward and is not watched.
    """

    address_transient = ("_handoff",)

    input_scaling: str = "current"
    input_headroom: float = INPUT_HEADROOM
    x_amax: torch.Tensor | None = None
    g_amax: torch.Tensor | None = None
    x_acc: torch.Tensor | None = None
    g_acc: torch.Tensor | None = None
    x_ready: bool = False
    g_ready: bool = False

    def __post_init__(self) -> None:
        if self.input_scaling not in INPUT_SCALINGS:
            raise ValueError(f"input_scaling must be one of {INPUT_SCALINGS}, got {self.input_scaling!r}")
        self.used: set[str] = set()  # slots that accumulated since the last step end (not a field)
        # slot -> StepScale: the step's scale, one persistent tensor per slot (not a field)
        self._step_scales: dict[str, StepScale] = {}
        self._handoff: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # see hand_over_g
        self.handoffs_taken = 0  # output gradients whose quantisation a producer's epilogue did

    def slot_scaling(self, slot: str) -> tuple[float, float]:
        """(headroom, FP8 maximum) of ``slot``'s delayed scale."""
        if slot in ("x", "g"):
            return self.input_headroom, FP8_MAX[E4M3 if slot == "x" else E5M2]
        raise KeyError(f"{type(self).__name__} has no scale slot {slot!r}")

    def step_scale(self, slot: str) -> torch.Tensor:
        """The scale of ``slot`` for this step, ``max(<slot>_amax, 1e-12) * headroom / fmax`` (0-d
        fp32, :meth:`slot_scaling`).  The amax is fixed through a step, so the two small kernels
        that compute the scale run once per step instead of once per call, into one tensor per
        slot that keeps its address for the whole run: :func:`end_fp8_step` makes it when the slot
        becomes ready and rewrites it in place whenever it moves the amax, so code captured in a
        CUDA graph reads each step's scale without running this method again.  A scale whose
        amax was replaced or changed by anything else is recomputed here (in place)."""
        amax = getattr(self, f"{slot}_amax")
        entry = self._step_scales.get(slot)
        if entry is None or entry.amax is not amax:
            headroom, fmax = self.slot_scaling(slot)
            entry = self._step_scales[slot] = StepScale(amax, headroom / fmax, headroom_scale(amax, headroom, fmax))
            self.note_address_change()
        elif entry.version != amax._version:
            entry.update()
        return entry.scale

    def host_state(self) -> dict:
        """The Python-side bookkeeping a training micro-batch changes (slots used, the pending
        gradient handover, counters), as a copy: :mod:`speedrun.train.graphs` sets it back after
        replaying a captured step, whose Python never runs."""
        return {"used": set(self.used), "_handoff": self._handoff, "handoffs_taken": self.handoffs_taken,
                "_step_scales": dict(self._step_scales)}

    def set_host_state(self, state: dict) -> None:
        # containers are refilled in place, not replaced: a replayed step sets this state every
        # step, and a new container would look like a structural change to the step key's watch
        # (speedrun.train.addresses), which then walks the whole model again
        for name, value in state.items():
            current = getattr(self, name)
            if current is value:
                continue
            if isinstance(value, (set, dict)) and type(current) is type(value):
                if value != current:  # (a dict's entries compare by identity)
                    if isinstance(value, dict):
                        self.note_address_change()  # other entries: other tensors
                    current.clear()
                    current.update(value)
            else:
                setattr(self, name, value.copy() if isinstance(value, (set, dict)) else value)

    def state_dict(self) -> dict:
        """Every field (a subclass's too), tensors detached and cloned: a checkpoint's view."""
        return {f.name: _detached_copy(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict, **overrides):
        """The inverse of :meth:`state_dict`; ``overrides`` replace saved fields (e.g. the
        configured ``input_scaling`` over a checkpoint's)."""
        return cls(**{**{k: _detached_copy(v) for k, v in state.items()}, **overrides})

    def accumulator(self, slot: str, device: torch.device) -> torch.Tensor:
        """``<slot>_acc`` (created as zeros on first use), marked as used this step."""
        acc = getattr(self, f"{slot}_acc")
        if acc is None:
            acc = torch.zeros((), dtype=torch.float32, device=device)
            setattr(self, f"{slot}_acc", acc)
        self.used.add(slot)
        return acc

    def g_epilogue_args(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(scale, amax accumulator)`` for a kernel that makes the output gradient and can
        quantise it to e5m2 in its own epilogue (delayed scaling once ready; None otherwise: the
        scale of a call before the first step end depends on that call's own amax)."""
        if self.input_scaling != "delayed" or not self.g_ready:
            return None
        return self.step_scale("g"), self.accumulator("g", device)

    def hand_over_g(self, g: torch.Tensor, g_fp8: torch.Tensor, scale: torch.Tensor) -> None:
        """Leave ``g_fp8`` (row-major e5m2 of ``g``, quantised with ``scale`` from
        :meth:`g_epilogue_args`) for the next :meth:`quantize_input` of ``g`` itself (same storage,
        shape and dtype); any other tensor is quantised as usual."""
        self._handoff = (g, g_fp8, scale)

    def quantize_input(self, t: torch.Tensor, which: str, *, transposed: bool):
        """Quantise ``t``: the input (``which="x"``, e4m3) or the output gradient (``"g"``, e5m2).
        Returns ``(t_fp8 (R, C), t_fp8_t (C, R) or None, scale 0-d fp32)``."""
        if which not in ("x", "g"):
            raise ValueError(f"quantize_input: which must be 'x' or 'g', got {which!r}")
        if which == "g" and self._handoff is not None:
            g, g_fp8, scale = self._handoff
            self._handoff = None
            if (not transposed and g.data_ptr() == t.data_ptr() and g.shape == t.shape and g.dtype == t.dtype
                    and g.stride() == t.stride()):
                self.handoffs_taken += 1
                return g_fp8, None, scale
        fp8_dtype = E4M3 if which == "x" else E5M2
        if self.input_scaling == "current":
            return quantize_current(t, fp8_dtype=fp8_dtype, transposed=transposed)
        acc = self.accumulator(which, t.device)
        if not getattr(self, f"{which}_ready"):
            _check_one_matrix(t, fp8_dtype, "quantize_input")
            amax = abs_max(t)  # before the first step end: current scaling, and its amax counts
            torch.maximum(acc, amax, out=acc)
            return _quantize_from_amax(t, amax, fp8_dtype, transposed)
        scale = self.step_scale(which)
        q, qt = quantize_delayed(t, scale, acc, fp8_dtype=fp8_dtype, transposed=transposed)
        return q, qt, scale

    def discard_step(self) -> None:
        """Forget this step's accumulations (after an evaluation, whose amaxes must not steer
        training's scales) and any gradient handed over but not taken."""
        for slot in self.used:
            getattr(self, f"{slot}_acc").zero_()
        self.used.clear()
        self._handoff = None


def end_fp8_step(states: Sequence[InputScaling]) -> None:
    """Close one optimizer step of step-synchronous delayed scaling (see :class:`InputScaling`):
    for every slot used in the step, ``amax`` <- max of its accumulator over the step's calls and,
    under torch.distributed with several ranks, over all ranks (one all-reduce of all slots); the
    accumulator is zeroed and the slot is ready.  Every rank must pass the same states in the same
    order (the same model: same layers, same slots used)."""
    for st in states:
        st._handoff = None  # a gradient handed over and never taken must not outlive its step
    slots = [(st, slot) for st in states for slot in sorted(st.used)]
    if not slots:
        return
    accs = [getattr(st, f"{slot}_acc") for st, slot in slots]
    stacked = torch.stack(accs)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    for st, slot in slots:
        if getattr(st, f"{slot}_amax") is None:
            setattr(st, f"{slot}_amax", torch.zeros_like(getattr(st, f"{slot}_acc")))
        setattr(st, f"{slot}_ready", True)
        st.used.discard(slot)
    # Two multi-tensor kernels for all slots, not two small kernels per slot.
    torch._foreach_copy_([getattr(st, f"{slot}_amax") for st, slot in slots], list(stacked.unbind()))
    torch._foreach_zero_(accs)
    # The next step's scales, in place (their tensors keep their addresses: see step_scale); a
    # slot's first scale is made here, not by the first forward that reads it.
    entries = []
    for st, slot in slots:
        e = st._step_scales.get(slot)
        if e is None or e.amax is not getattr(st, f"{slot}_amax"):
            st.step_scale(slot)
        else:
            entries.append(e)
    if entries:
        clamped = torch._foreach_clamp_min([e.amax for e in entries], AMAX_FLOOR)
        torch._foreach_copy_([e.scale for e in entries], torch._foreach_mul(clamped, [e.factor for e in entries]))
        for e in entries:
            e.version = e.amax._version


def quantize_current_reference(
    x: torch.Tensor, *, fp8_dtype: torch.dtype = E4M3, transposed: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Plain-PyTorch reference of :func:`quantize_current` (same signature, same bits)."""
    _check_quant_args(x, _SCALAR_FP32, fp8_dtype, "quantize_current_reference")
    scale = current_scale(abs_max_reference(x), FP8_MAX[fp8_dtype])
    q, qt, _ = quantize_dual_layout_reference(x, scale, fp8_dtype=fp8_dtype)
    return q, (qt if transposed else None), scale


# ----------------------------------------------------------------------------------------------
# The cache


@dataclass(eq=False)
class FP8Weight(AddressVersioned):
    """One cached weight (or a batch of them): both FP8 layouts and the dequantisation scale.

    ``data`` (.., R, C) row-major, ``data_t`` (.., C, R) contiguous, ``scale`` fp32 0-d or (B,),
    already including any multiplier; ``version`` is the cache version it was read at.  An
    :class:`FP8WeightCache` keeps one per name for good, its tensors rewritten in place and its
    ``version`` advanced at each refresh (the object, like its tensors, keeps its identity, which
    keeps the CUDA graphs' address check cheap: :mod:`speedrun.train.addresses`).
    """

    data: torch.Tensor
    data_t: torch.Tensor
    scale: torch.Tensor
    version: int = 0

    def t(self) -> "FP8Weight":
        """The same weight seen transposed (swaps the two layouts; no copy)."""
        return FP8Weight(self.data_t, self.data, self.scale, self.version)

    def __getitem__(self, i: int) -> "FP8Weight":
        """Matrix ``i`` of a batched entry (views; 0-d scale)."""
        if self.data.dim() != 3:
            raise ValueError(f"indexing needs a batched (B, R, C) entry, got shape {tuple(self.data.shape)}")
        scale = self.scale[i] if self.scale.dim() == 1 else self.scale
        return FP8Weight(self.data[i], self.data_t[i], scale, self.version)


class FP8WeightCache:
    """Both FP8 layouts of a set of named weights, rebuilt once per optimizer update.

    Usage::

        cache = FP8WeightCache()
        cache.refresh({"mlp_w1": bank[:, 0], "mlp_w2": bank[:, 1]})   # after every optimizer step
        w1 = cache.get("mlp_w1")[layer]                                # FP8Weight views

    ``refresh`` launches one :func:`quantize_dual_layout` per name (a batched entry is one launch).
    ``get`` raises :class:`StaleFP8CacheError` if :meth:`invalidate` was called since the last
    refresh, or (``check_versions=True``) if a source tensor was modified in place since (torch's
    version counter; an optimizer's in-place update bumps it).  Scaling policy: module docstring.
    """

    def __init__(
        self,
        *,
        headroom: float = 1.12,
        bootstrap_refreshes: int = 16,
        fp8_dtype: torch.dtype = E4M3,
        check_versions: bool = True,
        current_names: Sequence[str] = (),
    ) -> None:
        if headroom < 1.0:
            raise ValueError(f"headroom must be >= 1, got {headroom}")
        if fp8_dtype not in FP8_MAX:
            raise ValueError(f"fp8_dtype must be an FP8 dtype, got {fp8_dtype}")
        self.headroom = float(headroom)
        self.bootstrap_refreshes = int(bootstrap_refreshes)
        self.fp8_dtype = fp8_dtype
        self.check_versions = check_versions
        self.current_names = frozenset(current_names)
        self.version = 0  # number of refreshes so far
        self._valid = False
        self._entries: dict[str, FP8Weight] = {}
        self._amax: dict[str, torch.Tensor] = {}  # amax measured at the last refresh (next scale)
        self._raw_scale: dict[str, torch.Tensor] = {}  # scale used at the last refresh, no multiplier
        self._refreshes: dict[str, int] = {}
        self._sources: dict[str, torch.Tensor] = {}  # the weight each entry was made from
        self._source_versions: dict[str, int] = {}  # ... and its version counter then
        self._replay: dict[str, torch.Tensor] = {}  # scales the next refresh reuses (after a load)

    @property
    def valid(self) -> bool:
        return self._valid

    def names(self) -> list[str]:
        return list(self._entries)

    def invalidate(self) -> None:
        """Mark every entry stale (call right after an optimizer update if not refreshing at once)."""
        self._valid = False

    def refresh(
        self,
        weights: dict[str, torch.Tensor],
        multipliers: dict[str, torch.Tensor | float] | None = None,
    ) -> None:
        """Re-quantise every named weight (one read each) and mark the cache valid:
        :meth:`prepare_refresh`, then its launch and settle.

        Every name cached so far must be passed again: a partial refresh would leave stale entries.
        """
        work = self.prepare_refresh(weights, multipliers)
        work.launch()
        work.settle()

    def prepare_refresh(
        self,
        weights: dict[str, torch.Tensor],
        multipliers: dict[str, torch.Tensor | float] | None = None,
    ) -> "CacheRefresh":
        """The host half of :meth:`refresh`: picks each weight's scaling rule (a checkpoint's saved
        scale, the current amax during the bootstrap and for ``current_names``, else the last
        refresh's amax with headroom), advances the counters and versions, marks the cache valid,
        and returns the kernels still to launch (:class:`CacheRefresh`; launch it, and settle it
        once the step's writes of the weights are issued, before any read of the cache)."""
        multipliers = multipliers or {}
        missing = set(self._entries) - set(weights)
        if missing:
            raise ValueError(f"refresh must pass every cached weight; missing {sorted(missing)}")
        unknown = set(multipliers) - set(weights)
        if unknown:
            raise ValueError(f"multipliers given for unknown weights {sorted(unknown)}")
        version = self.version + 1
        items = []
        for name, w in weights.items():
            prev = self._entries.get(name)
            if prev is not None and prev.data.shape != w.shape:
                raise ValueError(f"weight {name!r} changed shape from {tuple(prev.data.shape)} to {tuple(w.shape)}")
            n = self._refreshes.get(name, 0)
            replay = self._replay.pop(name, None)
            if replay is not None:
                rule = "replay"
            elif n < self.bootstrap_refreshes or name not in self._amax or name in self.current_names:
                rule = "current"
            else:
                rule = "headroom"
            m = multipliers.get(name)
            # rewritten in place: the entry, its amax and raw scale exist and keep their shapes
            in_place = (prev is not None and name in self._raw_scale and rule != "replay"
                        and (not isinstance(m, torch.Tensor)
                             or torch.broadcast_shapes(prev.scale.shape, m.shape) == prev.scale.shape))
            if in_place:
                prev.version = version
            items.append(_Requantize(name, w.detach(), rule, replay, m, in_place))
            self._refreshes[name] = n + 1
            self._sources[name] = w
        self.version = version
        self._valid = True
        return CacheRefresh(self, items, version)

    def _requantize(self, item: "_Requantize", version: int) -> None:
        """The kernels of one weight's refresh (see :class:`CacheRefresh`)."""
        name, w, m = item.name, item.weight, item.multiplier
        prev = self._entries.get(name)
        fmax = FP8_MAX[self.fp8_dtype]
        if item.rule == "replay":
            scale = item.replay_scale.to(w.device)
        elif item.rule == "current":
            scale = current_scale(w.abs().amax(dim=(-2, -1)).float(), fmax)
        else:
            scale = headroom_scale(self._amax[name], self.headroom, fmax)
        out = prev.data if prev is not None else None
        out_t = prev.data_t if prev is not None else None
        amax = self._amax.get(name) if prev is not None else None
        amax = amax.zero_() if amax is not None else torch.zeros(tuple(w.shape[:-2]), dtype=torch.float32,
                                                                 device=w.device)
        q, qt, amax = quantize_dual_layout(w, scale, fp8_dtype=self.fp8_dtype, out=out, out_t=out_t, amax=amax)
        deq = scale if m is None else scale * (m.detach().float() if isinstance(m, torch.Tensor) else float(m))
        if item.in_place:
            # every tensor of the entry keeps its address from one refresh to the next, so code
            # captured in a CUDA graph reads the current update's values
            prev.scale.copy_(deq)
            self._raw_scale[name].copy_(scale)
            return
        if prev is not None and prev.scale.shape == deq.shape:
            deq = prev.scale.copy_(deq)
        elif deq.dim() == 1:
            # One 16-byte slot per matrix: cuBLASLt wants each 0-d scale view 16-byte aligned.
            slots = torch.zeros((deq.shape[0], 4), dtype=torch.float32, device=deq.device)
            slots[:, 0] = deq
            deq = slots[:, 0]
        else:
            deq = deq.clone()  # never an alias of the raw scale below
        raw = self._raw_scale.get(name)
        scale = raw.copy_(scale) if raw is not None and raw.shape == scale.shape else scale.clone()
        if prev is not None and prev.data is q and prev.data_t is qt and prev.scale is deq:
            prev.version = version
        else:
            self._entries[name] = FP8Weight(q, qt, deq, version)
        self._amax[name] = amax
        self._raw_scale[name] = scale

    def get(self, name: str) -> FP8Weight:
        """The cached entry; raises :class:`StaleFP8CacheError` if it no longer matches its weight."""
        if name not in self._entries:
            raise KeyError(f"no cached FP8 weight {name!r}; cached: {sorted(self._entries)}")
        if not self._valid:
            raise StaleFP8CacheError(
                f"FP8 weight cache read for {name!r} after invalidate() without refresh() (version {self.version})"
            )
        if self.check_versions:
            if self._sources[name]._version != self._source_versions[name]:
                raise StaleFP8CacheError(
                    f"weight {name!r} was modified in place after the FP8 cache refresh (version {self.version}); "
                    "call refresh() once per optimizer update"
                )
        return self._entries[name]

    def state_dict(self) -> dict:
        """The delayed-scaling state (no FP8 data: that is rebuilt from the weights).

        ``raw_scale`` is the scale each entry was quantised with, ``refreshes`` the count per name
        (bootstrap phase).  The amax is not kept: re-quantising the same weights measures it again."""
        return {"version": self.version, "refreshes": dict(self._refreshes),
                "raw_scale": {k: v.detach().clone() for k, v in self._raw_scale.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s state; the next :meth:`refresh` (of the restored weights)
        re-quantises with the saved scales, so it rebuilds the very FP8 entries that were saved."""
        self._replay = {k: v.detach().clone() for k, v in state["raw_scale"].items()}
        # The replaying refresh counts again and bumps the version back to the saved values.
        self._refreshes = {k: n - 1 for k, n in state["refreshes"].items()}
        self.version = state["version"] - 1
        self._valid = False

    def saturated(self, name: str) -> torch.Tensor:
        """Device bool (per matrix): did the last refresh clip values (amax > 448 * scale)?"""
        return self._amax[name] > self._raw_scale[name] * FP8_MAX[self.fp8_dtype]


@dataclass
class _Requantize:
    """One weight's share of a refresh: the scaling rule :meth:`FP8WeightCache.prepare_refresh`
    picked (``"replay"``, ``"current"`` or ``"headroom"``), the saved scale a replay reuses, the
    multiplier, and whether the entry is rewritten in place."""

    name: str
    weight: torch.Tensor
    rule: str
    replay_scale: torch.Tensor | None
    multiplier: torch.Tensor | float | None
    in_place: bool


class CacheRefresh(DeviceWork):
    """The kernels of one :meth:`FP8WeightCache.refresh`, its host half done.

    Capturable (a key) once every entry is rewritten in place under a rule read from device
    tensors: the first refresh of a name allocates its entry, and a checkpoint's replayed scale is
    a one-off, so those run eagerly."""

    def __init__(self, cache: FP8WeightCache, items: list[_Requantize], version: int):
        self.cache, self.items, self.version = cache, items, version
        # a number as multiplier would be baked into the capture
        capturable = all(it.in_place and not isinstance(it.multiplier, (int, float)) for it in items)
        self.key = tuple((it.name, it.rule, it.multiplier is not None) for it in items) if capturable else None

    @torch.no_grad()
    def launch(self) -> None:
        for item in self.items:
            self.cache._requantize(item, self.version)

    def settle(self) -> None:
        """The weights' version counters as the cache's staleness check will compare them."""
        for item in self.items:
            self.cache._source_versions[item.name] = self.cache._sources[item.name]._version

    def written(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for item in self.items:
            e = self.cache._entries.get(item.name)
            if e is None:
                continue
            out += [(f"{item.name}.data", e.data), (f"{item.name}.data_t", e.data_t), (f"{item.name}.scale", e.scale),
                    (f"{item.name}.amax", self.cache._amax[item.name]),
                    (f"{item.name}.raw_scale", self.cache._raw_scale[item.name])]
        return out
