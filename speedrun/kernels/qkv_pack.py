"""One packed FP8 QKV projection per attention layer: the weight pack kernel and the autograd GEMM.

Record layout of the weights (``speedrun/model/record.py``): layer ``j`` owns
``w_qk = qk_bank[j*H:(j+1)*H]`` (H, 2 Dqk, D), which flattens to (2 H Dqk, D) = ``[Q heads 0..H-1 |
K heads 0..H-1]`` (head h of Q at rows ``h Dqk ..``, of K at ``H Dqk + h Dqk ..``), and
``w_v = vo_bank[2j]`` (H Dv, D) (head h at rows ``h Dv ..``).  The record computes
``F.linear(x, sa_lambda * cat(w_qk, w_v))``.

Packed column order (what the GEMM here writes and :mod:`speedrun.kernels.qk_prep` reads)::

    per head h = 0..H-1:  [ q_h (Dqk) | k_h (Dqk) | v_h (Dv) ]      P = 2 Dqk + Dv columns per head
    N = H * P columns     (record: 6 x (96 + 96 + 128) = 1920; equal widths 6 x 384 = 2304)

so the QK-prep kernel reads, per (token, head), one contiguous run of P elements (320 bf16 = 640 B).
:func:`packed_column_order` maps packed columns to the record's ``[Q | K | V]`` columns.

FP8 weight (:func:`pack_qkv_fp8`, one Triton kernel): reads each bf16 element of ``w_qk`` and
``w_v`` once, permutes rows into the packed order in the addressing (no concatenated copy), and
writes e4m3 ``data`` (N, D) row-major for the forward GEMM and ``data_t`` (D, N) for the backward dX
GEMM (bit patterns by integer arithmetic, as in :mod:`speedrun.kernels.fp8_cache`: the hardware
cvt corrupts a tile stored in both layouts on sm90 with Triton 3.6).  It also max-accumulates
``max |w|`` (the next delayed scale).  One tensorwise scale covers Q, K and V (they share init and
optimizer, so their ranges match; per-pack scales would need row-wise ``_scaled_mm``).

Scales (dequantisation scales, ``real ~= fp8 * s``):

* ``raw_scale``: given (delayed: ``delayed_scale(prev.amax)``) or, when None, current
  ``max(amax, 1e-12) / 448`` from a first pass of the same kernel in amax-only mode (a reduction: no
  ``|w|`` tensor is materialised).
* ``sa_lambda`` is folded in: the payload is ``quantise(sign(sa) * w / raw_scale)`` and
  ``scale = raw_scale * |sa|``, so ``data * scale ~= sa * W_packed`` with a positive GEMM scale.

Autograd GEMM (:func:`packed_qkv_linear`): forward ``y = x W_effᵀ`` with ``W_eff = sa W_packed``:
x e4m3 x e4m3 weight, ``torch._scaled_mm`` (exact fp32 emulation off-GPU), output in x's dtype.
Backward: ``dX = dy W_eff`` as e5m2 dy x e4m3 ``data_t``.  x and dy are current-scaled, or
delayed-scaled through the layer's :class:`~speedrun.kernels.fp8_cache.InputScaling` (``inputs``);
``dW_eff = dyᵀ x`` in bf16 (``dw_fp8=False``, default) or e5m2 x e4m3 (``dw_fp8=True``: x is
saved as e4m3 in its transposed layout, dy quantised in both layouts from one read).  Then, exactly
as autograd of ``F.linear(x, sa * cat(...))`` would: ``dW_bank = sa * dW_eff`` (un-permuted into the
bank shapes) and ``dsa = sum(dW_eff * W_cat)`` (fp32 sum).  No gradient flows through the FP8
payload itself; the bf16 bank slices are the leaves.

Error bounds (documented, tested): e4m3 keeps 3 mantissa bits (relative rounding 2^-4), so a
K-term dot product of e4m3 operands is off by about 2^-4 / sqrt(3) ~ 4% per operand in the worst
element and ~3% relative Frobenius overall; e5m2 gradients (2 bits) about 6%.  Against the same
quantised operands the CPU emulation is exact up to fp32 summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from speedrun.kernels._triton import cdiv, interpreting, launch, triton_usable
from speedrun.kernels.addressing import AddressVersioned
from speedrun.kernels.fp8_cache import (
    current_scale,
    E4M3,
    FP8_MAX,
    GRID,
    _fp8_bits,
    _round_to_grid,
    grid_constants,
    headroom_scale,
    InputScaling,
)
from speedrun.kernels.fp8_ops import scaled_mm
from speedrun.kernels.launch_notes import launch_note

__all__ = [
    "PackedQKV",
    "delayed_scale",
    "pack_qkv_fp8",
    "pack_qkv_fp8_reference",
    "packed_column_order",
    "repack_qkv_fp8",
    "packed_qkv_linear",
    "packed_qkv_linear_reference",
    "packed_weight_reference",
    "unpack_packed_grad",
    "unpack_packed_grad_reference",
]

WEIGHT_HEADROOM = 1.12  # delayed weight scale headroom (as FP8WeightCache)
# (BLOCK_N, BLOCK_D, num_warps) of the pack kernel on GPU; the job is ~3 MB, any sane tile works.
PACK_CONFIG = (64, 128, 4)
_INTERP_PACK_CONFIG = (32, 64, 1)  # few programs: the interpreter pays per program


# ----------------------------------------------------------------------------------------------
# Layout helpers


def _dims(w_qk: torch.Tensor, w_v: torch.Tensor, num_heads: int | None, name: str) -> tuple[int, int, int, int]:
    """Validate the two bank slices; returns (H, Dqk, Dv, D)."""
    if w_qk.dim() == 3:
        H = w_qk.shape[0]
        if num_heads is not None and num_heads != H:
            raise ValueError(f"{name}: w_qk shape {tuple(w_qk.shape)} has {H} head groups but num_heads={num_heads}")
        if w_qk.shape[1] % 2:
            raise ValueError(f"{name}: w_qk (H, 2 Dqk, D) needs an even middle dim, got shape {tuple(w_qk.shape)}")
        dqk, D = w_qk.shape[1] // 2, w_qk.shape[2]
    elif w_qk.dim() == 2:
        if num_heads is None or num_heads < 1:
            raise ValueError(f"{name}: a 2-D w_qk {tuple(w_qk.shape)} needs num_heads")
        H = num_heads
        if w_qk.shape[0] % (2 * H):
            raise ValueError(f"{name}: w_qk rows {w_qk.shape[0]} (shape {tuple(w_qk.shape)}) are not 2 * {H} * Dqk")
        dqk, D = w_qk.shape[0] // (2 * H), w_qk.shape[1]
    else:
        raise ValueError(f"{name}: w_qk must be (H, 2 Dqk, D) or (2 H Dqk, D), got shape {tuple(w_qk.shape)}")
    if w_v.dim() != 2 or w_v.shape[1] != D or w_v.shape[0] % H:
        raise ValueError(f"{name}: w_v must be (H * Dv, {D}) with H={H}, got shape {tuple(w_v.shape)} (w_qk {tuple(w_qk.shape)})")
    dv = w_v.shape[0] // H
    for nm, t in (("w_qk", w_qk), ("w_v", w_v)):
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name}: {nm} must be bf16/fp16/fp32, got {t.dtype} with shape {tuple(t.shape)}")
    if w_qk.dtype != w_v.dtype:
        raise ValueError(f"{name}: w_qk and w_v dtypes differ ({w_qk.dtype} vs {w_v.dtype})")
    return H, dqk, dv, D


def packed_column_order(num_heads: int, qk_dim: int, v_dim: int, device=None) -> torch.Tensor:
    """(N,) int64: for each packed column, its index in the record's ``[Q | K | V]`` column order.

    ``y_packed = y_record[:, order]`` and ``W_packed = W_record[order]``.
    """
    H, dqk, dv = num_heads, qk_dim, v_dim
    h = torch.arange(H, device=device)[:, None]
    q = h * dqk + torch.arange(dqk, device=device)
    k = H * dqk + h * dqk + torch.arange(dqk, device=device)
    v = 2 * H * dqk + h * dv + torch.arange(dv, device=device)
    return torch.cat((q, k, v), dim=1).reshape(-1)


def packed_weight_reference(w_qk: torch.Tensor, w_v: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
    """The packed weight (H (2 Dqk + Dv), D) in w's dtype, by plain torch ops (materialised; reference only)."""
    H, dqk, dv, D = _dims(w_qk, w_v, num_heads, "packed_weight_reference")
    qk = w_qk.reshape(2, H, dqk, D)
    return torch.cat((qk[0], qk[1], w_v.reshape(H, dv, D)), dim=1).reshape(H * (2 * dqk + dv), D)


def delayed_scale(amax: torch.Tensor, headroom: float = WEIGHT_HEADROOM) -> torch.Tensor:
    """Raw weight scale for the next update from the amax the pack kernel measured: 0-d fp32."""
    return headroom_scale(amax.float(), headroom, FP8_MAX[E4M3])


@dataclass(frozen=True)
class PackedQKV(AddressVersioned):
    """An FP8 packed QKV weight (see the module docstring for the column order).

    ``data`` (N, D) e4m3 row-major; ``data_t`` (D, N) e4m3 contiguous; ``scale`` 0-d fp32 with
    ``data * scale ~= sa_lambda * W_packed``; ``raw_scale`` 0-d fp32 (without sa); ``amax`` 0-d fp32
    ``max |w|`` over Q, K, V as read by the kernel (feed :func:`delayed_scale` next update).
    Frozen, so its ``address_version`` never moves: the CUDA graphs' address watch checks that
    number instead of its five tensors (:mod:`speedrun.kernels.addressing`).
    """

    data: torch.Tensor
    data_t: torch.Tensor
    scale: torch.Tensor
    raw_scale: torch.Tensor
    amax: torch.Tensor
    num_heads: int
    qk_dim: int
    v_dim: int

    @property
    def width(self) -> int:
        return 2 * self.qk_dim + self.v_dim


# ----------------------------------------------------------------------------------------------
# The pack kernel


@triton.jit
def _pack_kernel(
    qk_ptr, v_ptr, inv_ptr, q_ptr, qt_ptr, amax_ptr,
    N, stride_qk, stride_v,
    H: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, D: tl.constexpr,
    AMAX_ONLY: tl.constexpr, FMAX: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr, MIN_NORMAL: tl.constexpr,
):
    """One (BLOCK_N packed rows) x (BLOCK_D cols) tile: gather the source rows from the two banks,
    max-accumulate |w|, and (unless AMAX_ONLY) quantise and store both layouts."""
    P: tl.constexpr = 2 * DQK + DV
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < N
    head = rows // P
    c = rows % P
    is_v = c >= 2 * DQK
    # Q rows of head h sit at h*DQK, K rows at (H + h)*DQK in the flattened (2 H DQK, D) slice.
    qk_row = tl.where(c < DQK, head * DQK + c, (H + head) * DQK + (c - DQK))
    v_row = head * DV + (c - 2 * DQK)
    col_ok = cols[None, :] < D
    m_qk = (row_ok & ~is_v)[:, None] & col_ok
    m_v = (row_ok & is_v)[:, None] & col_ok
    wq = tl.load(qk_ptr + tl.where(is_v, 0, qk_row)[:, None].to(tl.int64) * stride_qk + cols[None, :], mask=m_qk, other=0.0)
    wv = tl.load(v_ptr + tl.where(is_v, v_row, 0)[:, None].to(tl.int64) * stride_v + cols[None, :], mask=m_v, other=0.0)
    w = tl.where(is_v[:, None], wv.to(tl.float32), wq.to(tl.float32))
    # |w| >= 0: a float atomic max is exact and order-independent.
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    if not AMAX_ONLY:
        inv = tl.load(inv_ptr)
        qf = tl.minimum(tl.maximum(w * inv, -FMAX), FMAX)
        q = _fp8_bits(qf, MANT, EMIN, SUB_C, MIN_NORMAL)
        mask = row_ok[:, None] & col_ok
        tl.store(q_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], q, mask=mask)
        tl.store(qt_ptr + cols[None, :].to(tl.int64) * N + rows[:, None], q, mask=mask)


def _check_pack_args(w_qk, w_v, sa_lambda, num_heads, scale, name):
    H, dqk, dv, D = _dims(w_qk, w_v, num_heads, name)
    N = H * (2 * dqk + dv)
    if N % 16 or D % 16:
        raise ValueError(f"{name}: packed weight ({N}, {D}) needs both dims multiples of 16 (FP8 GEMM); "
                         f"w_qk {tuple(w_qk.shape)}, w_v {tuple(w_v.shape)}")
    flat_ok = w_qk.dim() == 2 or w_qk.stride(0) == w_qk.shape[1] * w_qk.stride(1)
    if w_qk.stride(-1) != 1 or w_v.stride(-1) != 1 or not flat_ok:
        raise ValueError(f"{name}: w_qk {tuple(w_qk.shape)} strides {w_qk.stride()} and w_v strides {w_v.stride()} "
                         "must be row-major with unit column stride (a bank slice is fine)")
    if isinstance(sa_lambda, torch.Tensor) and sa_lambda.numel() != 1:
        raise ValueError(f"{name}: sa_lambda must be a scalar, got shape {tuple(sa_lambda.shape)}")
    if scale is not None and (not isinstance(scale, torch.Tensor) or scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(f"{name}: scale must be a 1-element fp32 tensor, got {getattr(scale, 'dtype', type(scale))}")
    return H, dqk, dv, D, N


def _sa_tensor(sa_lambda, device) -> torch.Tensor:
    if isinstance(sa_lambda, torch.Tensor):
        return sa_lambda.detach().reshape(()).to(device=device, dtype=torch.float32)
    return torch.full((), float(sa_lambda), dtype=torch.float32, device=device)


def _scales(amax, scale, sa):
    """(raw_scale, quantisation multiplier inv = sign(sa)/raw_scale, dequant scale raw*|sa|)."""
    raw = current_scale(amax, FP8_MAX[E4M3]) if scale is None else scale.reshape(()).float()
    inv = torch.where(sa < 0, -1.0, 1.0) / raw
    return raw, inv, raw * sa.abs()


def _pack_outputs(out, N, D, device, name):
    if out is None:
        return torch.empty((N, D), dtype=E4M3, device=device), torch.empty((D, N), dtype=E4M3, device=device)
    data, data_t = out
    for t, shape, what in ((data, (N, D), "data"), (data_t, (D, N), "data_t")):
        if tuple(t.shape) != shape or t.dtype != E4M3 or not t.is_contiguous() or t.device != torch.device(device):
            raise ValueError(f"{name}: out {what} must be a contiguous e4m3 tensor of shape {shape} on {device}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    return data, data_t


def _qk_2d(w_qk: torch.Tensor, H: int, dqk: int) -> torch.Tensor:
    return w_qk.reshape(2 * H * dqk, w_qk.shape[-1])


def pack_qkv_fp8(
    w_qk: torch.Tensor,
    w_v: torch.Tensor,
    sa_lambda: torch.Tensor | float,
    *,
    num_heads: int | None = None,
    scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PackedQKV:
    """Quantise ``sa_lambda * [Q|K|V]`` of one layer into the packed FP8 layout (Triton).

    Args:
        w_qk: (H, 2 Dqk, D) (``qk_bank[j*H:(j+1)*H]``) or (2 H Dqk, D); bf16/fp16/fp32, row-major.
        w_v: (H Dv, D) (``vo_bank[2j]``), same dtype.
        sa_lambda: scalar (0-d / 1-element tensor or float) folded into ``scale``.
        num_heads: required for a 2-D ``w_qk``; checked against a 3-D one.
        scale: raw dequantisation scale (0-d fp32, e.g. :func:`delayed_scale` of the previous
            ``amax``); None = current scaling from an amax pass (one extra read, no temporaries).
        out: optional preallocated ``(data (N, D), data_t (D, N))`` contiguous e4m3 tensors
            (e.g. last update's, to keep addresses stable for CUDA graphs).

    N = H (2 Dqk + Dv) and D must be multiples of 16.  Returns :class:`PackedQKV`.
    """
    H, dqk, dv, D, N = _check_pack_args(w_qk, w_v, sa_lambda, num_heads, scale, "pack_qkv_fp8")
    data, data_t = _pack_outputs(out, N, D, w_qk.device, "pack_qkv_fp8")
    if not triton_usable(w_qk):
        return pack_qkv_fp8_reference(w_qk, w_v, sa_lambda, num_heads=num_heads, scale=scale, out=(data, data_t))
    dev = w_qk.device
    sa = _sa_tensor(sa_lambda, dev)
    first = None
    if scale is None:
        first = torch.zeros((), dtype=torch.float32, device=dev)
        _launch_pack(w_qk, w_v, (H, dqk, dv, D, N), sa, first, data, data_t, amax_only=True)  # inv unused
    raw, inv, deq = _scales(first, scale, sa)
    amax = torch.zeros((), dtype=torch.float32, device=dev)
    _launch_pack(w_qk, w_v, (H, dqk, dv, D, N), inv.reshape(()).contiguous(), amax, data, data_t)
    return PackedQKV(data, data_t, deq, raw, amax, H, dqk, dv)


def _launch_pack(w_qk, w_v, dims, inv, amax, data, data_t, amax_only: bool = False) -> None:
    """The pack kernel over one layer: max-accumulate ``max |w|`` into ``amax`` (0-d fp32) and,
    unless ``amax_only``, quantise ``[Q|K|V]`` times ``inv`` (0-d fp32) into ``data``/``data_t``."""
    H, dqk, dv, D, N = dims
    qk2 = _qk_2d(w_qk, H, dqk)
    bn, bd, warps = _INTERP_PACK_CONFIG if interpreting() else PACK_CONFIG
    grid = (cdiv(N, bn), cdiv(D, bd))
    with launch_note("_pack_kernel", reads=(qk2, w_v), writes=() if amax_only else (data, data_t)):
        launch(_pack_kernel, grid,
            qk2, w_v, inv, data.view(torch.uint8), data_t.view(torch.uint8), amax, N, qk2.stride(0), w_v.stride(0),
            H=H, DQK=dqk, DV=dv, D=D, AMAX_ONLY=amax_only, FMAX=FP8_MAX[E4M3],
            BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, **grid_constants(E4M3),
        )


def repack_qkv_fp8(packs: list[PackedQKV], sources: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | float]],
                   headroom: float = WEIGHT_HEADROOM) -> None:
    """Every layer's delayed-scaled repack at once, in place: for each ``packs[j]`` (last update's
    :class:`PackedQKV`) and ``sources[j] = (w_qk, w_v, sa_lambda)`` as :func:`pack_qkv_fp8` takes
    them, the same bits as ``pack_qkv_fp8(w_qk, w_v, sa, scale=delayed_scale(packs[j].amax),
    out=(data, data_t))`` copied into ``packs[j]``'s tensors (which keep their addresses).

    Why: per layer that is a dozen small launches for a handful of scalars (the delayed scale,
    sign of sa, quantisation multiplier, dequantisation scale, the amax's zeroing and three
    copies), issued by the host after every optimizer update; here the scalars of all layers are
    computed as vectors (a few launches in all) and each layer costs one pack launch."""
    if len(packs) != len(sources):
        raise ValueError(f"repack_qkv_fp8: {len(packs)} packed weights but {len(sources)} sources")
    if not packs:
        return
    fmax = FP8_MAX[E4M3]
    dims = []
    for pk, (w_qk, w_v, sa) in zip(packs, sources):
        H, dqk, dv, D, N = _check_pack_args(w_qk, w_v, sa, pk.num_heads, None, "repack_qkv_fp8")
        _pack_outputs((pk.data, pk.data_t), N, D, w_qk.device, "repack_qkv_fp8")
        dims.append((H, dqk, dv, D, N))
    dev = packs[0].data.device
    raw = headroom_scale(torch.stack([pk.amax for pk in packs]).float(), headroom, fmax)
    sa = torch.stack([_sa_tensor(s[2], dev) for s in sources])
    inv = torch.where(sa < 0, -1.0, 1.0) / raw
    deq = raw * sa.abs()
    torch._foreach_zero_([pk.amax for pk in packs])
    for j, (pk, (w_qk, w_v, sa_j), d) in enumerate(zip(packs, sources, dims)):
        if triton_usable(w_qk):
            _launch_pack(w_qk, w_v, d, inv[j], pk.amax, pk.data, pk.data_t)
        else:  # the reference, with the same delayed scale
            ref = pack_qkv_fp8_reference(w_qk, w_v, sa_j, num_heads=d[0], scale=raw[j], out=(pk.data, pk.data_t))
            pk.amax.copy_(ref.amax)
    torch._foreach_copy_([pk.raw_scale for pk in packs], list(raw.unbind()))
    torch._foreach_copy_([pk.scale for pk in packs], list(deq.unbind()))


def pack_qkv_fp8_reference(
    w_qk: torch.Tensor,
    w_v: torch.Tensor,
    sa_lambda: torch.Tensor | float,
    *,
    num_heads: int | None = None,
    scale: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PackedQKV:
    """Plain-PyTorch reference of :func:`pack_qkv_fp8` (same signature, same bits; materialises the
    concatenation)."""
    H, dqk, dv, D, N = _check_pack_args(w_qk, w_v, sa_lambda, num_heads, scale, "pack_qkv_fp8_reference")
    data, data_t = _pack_outputs(out, N, D, w_qk.device, "pack_qkv_fp8_reference")
    w = packed_weight_reference(w_qk.detach(), w_v.detach(), H).float()
    amax = w.abs().amax()
    sa = _sa_tensor(sa_lambda, w.device)
    raw, inv, deq = _scales(amax, scale, sa)
    fmax = FP8_MAX[E4M3]
    q = (w * inv).clamp(-fmax, fmax).to(E4M3)
    data.copy_(q)
    data_t.copy_(q.t())
    return PackedQKV(data, data_t, deq, raw, amax, H, dqk, dv)


# ----------------------------------------------------------------------------------------------
# The GEMM


_CURRENT_SCALING = InputScaling()  # current scaling keeps no state, so one instance serves every call


@triton.jit
def _unpack_grad_kernel(
    g_ptr, wqk_ptr, wv_ptr, dqk_ptr, dv_ptr, sa_ptr, partial_ptr, N,
    H: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, D: tl.constexpr, WANT_DSA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EXACT: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr, MIN_NORMAL: tl.constexpr,
):
    """Rows of the packed weight gradient g (N, D) (per head [q | k | v]) into the banks' layouts
    times sa: q and k rows into dqk (2 H DQK, D) = [q heads; k heads], v rows into dv (H DV, D);
    with WANT_DSA, this program's sum of g * W (W read from the banks) into partial_ptr[pid]."""
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    P: tl.constexpr = 2 * DQK + DV
    head = rows // P
    c = rows % P
    is_v = c >= 2 * DQK
    qk_row = tl.where(c < DQK, head * DQK + c, (H + head) * DQK + (c - DQK))
    v_row = head * DV + (c - 2 * DQK)
    ok = rows < N
    m = ok[:, None] & (cols[None, :] < D)
    mq = m & ~is_v[:, None]
    mv = m & is_v[:, None]
    g = tl.load(g_ptr + rows[:, None].to(tl.int64) * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(sa_ptr)
    out = g * s
    if EXACT:  # the interpreter's fp32 -> bf16 cast truncates; round to nearest-even first
        out = _round_to_grid(out, MANT, EMIN, SUB_C, MIN_NORMAL)
    qk_off = qk_row[:, None].to(tl.int64) * D + cols[None, :]
    v_off = v_row[:, None].to(tl.int64) * D + cols[None, :]
    tl.store(dqk_ptr + qk_off, out.to(dqk_ptr.dtype.element_ty), mask=mq)
    tl.store(dv_ptr + v_off, out.to(dv_ptr.dtype.element_ty), mask=mv)
    if WANT_DSA:
        w = tl.load(wqk_ptr + qk_off, mask=mq, other=0.0).to(tl.float32)
        w += tl.load(wv_ptr + v_off, mask=mv, other=0.0).to(tl.float32)
        tl.store(partial_ptr + pid_n * tl.num_programs(1) + pid_d, tl.sum(tl.sum(g * w, axis=1), axis=0))


UNPACK_CONFIG = (32, 256, 4)  # BLOCK_N, BLOCK_D, num_warps (D = 768: three column blocks)


def unpack_packed_grad_reference(g, w_qk, w_v, sa, num_heads: int, want_dsa: bool):
    """Reference of :func:`unpack_packed_grad` (same signature): the packed weight gradient ``g``
    (N, D) (bf16 or fp32, rows per head [q | k | v]) as the banks' gradients ``(dw_qk like w_qk,
    dw_v like w_v)`` times ``sa`` (0-d tensor), and ``dsa = sum(g * W_packed)`` (sa's dtype; None
    without ``want_dsa``), in fp32 math."""
    H = num_heads
    dqk = w_qk.numel() // (2 * H * w_qk.shape[-1])
    D = g.shape[1]
    dv = w_v.shape[0] // H
    per_head = g.float().view(H, 2 * dqk + dv, D)
    dsa = None
    if want_dsa:
        qk = w_qk.reshape(2, H, dqk, D).float()
        dsa = ((per_head[:, :dqk] * qk[0]).sum() + (per_head[:, dqk : 2 * dqk] * qk[1]).sum()
               + (per_head[:, 2 * dqk :] * w_v.view(H, dv, D).float()).sum())
        dsa = dsa.reshape(sa.shape).to(sa.dtype)
    s = sa.float()
    dw_qk = (torch.cat((per_head[:, :dqk], per_head[:, dqk : 2 * dqk]), dim=0) * s).reshape(w_qk.shape).to(w_qk.dtype)
    dw_v = (per_head[:, 2 * dqk :] * s).reshape(w_v.shape).to(w_v.dtype)
    return dw_qk, dw_v, dsa


def unpack_packed_grad(g, w_qk, w_v, sa, num_heads: int, want_dsa: bool):
    """The packed FP8 QKV GEMM's weight gradient into the banks (see the reference for the
    contract), in one Triton pass that reads ``g`` and (for dsa) the weights once: the torch
    version took ~15 small kernels per layer and micro-batch (fp32 copies, three products and
    sums, a cat, casts), each a launch the host pays for.  dsa sums per-program partials in a
    fixed order (deterministic)."""
    ok = (triton_usable(g) and g.is_contiguous() and w_qk.is_contiguous() and w_v.is_contiguous()
          and g.dtype in (torch.float32, torch.bfloat16) and w_qk.dtype == w_v.dtype)
    if not ok:
        return unpack_packed_grad_reference(g, w_qk, w_v, sa, num_heads, want_dsa)
    H = num_heads
    N, D = g.shape
    dqk = w_qk.numel() // (2 * H * D)
    dv = w_v.shape[0] // H
    dw_qk = torch.empty_like(w_qk)
    dw_v = torch.empty_like(w_v)
    bn, bd, warps = (32, 64, 1) if interpreting() else UNPACK_CONFIG
    grid = (cdiv(N, bn), cdiv(D, bd))
    partial = torch.empty(grid[0] * grid[1] if want_dsa else 1, dtype=torch.float32, device=g.device)
    s = sa.detach().reshape(()).float()
    with launch_note("_unpack_grad_kernel", reads=(g, w_qk if want_dsa else None, w_v if want_dsa else None),
                     writes=(dw_qk, dw_v)):
        launch(_unpack_grad_kernel, grid,
            g, w_qk, w_v, dw_qk, dw_v, s, partial, N, H=H, DQK=dqk, DV=dv, D=D, WANT_DSA=want_dsa,
            BLOCK_N=bn, BLOCK_D=bd, num_warps=warps,
            EXACT=interpreting() and w_qk.dtype in GRID, **grid_constants(w_qk.dtype if w_qk.dtype in GRID else torch.bfloat16),
        )
    dsa = partial.sum().reshape(sa.shape).to(sa.dtype) if want_dsa else None
    return dw_qk, dw_v, dsa


class _PackedQKVLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_qk, w_v, sa, data, data_t, scale, H, dqk, dv, dw_fp8, fast_accum, inputs):
        # inputs: the layer's InputScaling (current or delayed scaling of x and dy), or None (current)
        ctx.inputs = inputs = _CURRENT_SCALING if inputs is None else inputs
        xq, xqt, xs = inputs.quantize_input(x, "x", transposed=dw_fp8)
        y = scaled_mm(xq, data.t(), xs, scale, out_dtype=x.dtype, use_fast_accum=fast_accum)
        ctx.dims = (H, dqk, dv)
        ctx.dw_fp8 = dw_fp8
        ctx.sa_is_tensor = isinstance(sa, torch.Tensor)
        sa_t = sa if ctx.sa_is_tensor else torch.full((), float(sa), device=x.device)
        if dw_fp8:
            ctx.save_for_backward(xqt, xs, w_qk, w_v, sa_t, data_t, scale)
        else:
            ctx.save_for_backward(x, w_qk, w_v, sa_t, data_t, scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        H, dqk, dv = ctx.dims
        dy = dy.contiguous()
        if ctx.dw_fp8:
            xqt, xs, w_qk, w_v, sa, data_t, scale = ctx.saved_tensors
        else:
            x, w_qk, w_v, sa, data_t, scale = ctx.saved_tensors
        dyq, dyqt, gs = ctx.inputs.quantize_input(dy, "g", transposed=ctx.dw_fp8)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = scaled_mm(dyq, data_t.t(), gs, scale, out_dtype=dy.dtype)
        need_w = ctx.needs_input_grad[1] or ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        if not need_w:
            return (dx,) + (None,) * 12
        if ctx.dw_fp8:
            dw_eff = scaled_mm(dyqt, xqt.t(), gs, xs, out_dtype=torch.float32)  # (N, D)
        else:
            dw_eff = dy.t() @ x  # (N, D) in x's dtype, fp32 accumulation inside the GEMM
        dw_qk, dw_v, dsa = unpack_packed_grad(dw_eff, w_qk, w_v, sa, H, ctx.sa_is_tensor and ctx.needs_input_grad[3])
        return (dx, dw_qk, dw_v, dsa) + (None,) * 9


def _check_linear_args(x, packed, w_qk, w_v, sa_lambda, num_heads, name):
    H, dqk, dv, D = _dims(w_qk, w_v, num_heads if packed is None else packed.num_heads, name)
    if x.dim() != 2 or x.shape[1] != D:
        raise ValueError(f"{name}: x must be (T, {D}), got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: x must be bf16/fp16/fp32, got {x.dtype}")
    if packed is not None:
        N = H * (2 * dqk + dv)
        if (packed.num_heads, packed.qk_dim, packed.v_dim) != (H, dqk, dv) or tuple(packed.data.shape) != (N, D):
            raise ValueError(f"{name}: packed weight {tuple(packed.data.shape)} (H={packed.num_heads}, Dqk={packed.qk_dim}, "
                             f"Dv={packed.v_dim}) does not match w_qk {tuple(w_qk.shape)}, w_v {tuple(w_v.shape)}")
    if isinstance(sa_lambda, torch.Tensor) and sa_lambda.numel() != 1:
        raise ValueError(f"{name}: sa_lambda must be a scalar, got shape {tuple(sa_lambda.shape)}")
    return H, dqk, dv, D


def packed_qkv_linear(
    x: torch.Tensor,
    packed: PackedQKV | None,
    w_qk: torch.Tensor,
    w_v: torch.Tensor,
    sa_lambda: torch.Tensor | float,
    *,
    num_heads: int | None = None,
    dw_fp8: bool = False,
    use_fast_accum: bool = True,
    inputs: InputScaling | None = None,
) -> torch.Tensor:
    """``F.linear(x, sa_lambda * W_packed)`` with FP8 GEMMs; gradients to x, w_qk, w_v and sa_lambda.

    Args:
        x: (T, D) bf16 (fp16/fp32 work; output and dx take x's dtype); T and D multiples of 16 on GPU.
        packed: :func:`pack_qkv_fp8` of (w_qk, w_v, sa_lambda) for this optimizer update, or None to
            pack now with current scaling (one amax pass + one pack).  It must represent the same
            weights and sa_lambda: the forward uses it, the weight gradients use w_qk/w_v/sa_lambda.
        w_qk: (H, 2 Dqk, D) or (2 H Dqk, D) bank slice; w_v: (H Dv, D) (see the module docstring).
        sa_lambda: scalar tensor (gets a gradient) or float.
        dw_fp8: False = dW from a bf16 GEMM ``dyᵀ x`` (saves x); True = e5m2 dy x e4m3 x (saves x as
            e4m3 transposed, half the memory, ~6% relative dW error).
        use_fast_accum: forward GEMM's fast accumulation (GPU only).
        inputs: the layer's :class:`~speedrun.kernels.fp8_cache.InputScaling` (current or delayed
            scaling of x and dy, kept across calls); None = current scaling.

    Returns y (T, H (2 Dqk + Dv)) in the packed column order, x's dtype.
    """
    H, dqk, dv, D = _check_linear_args(x, packed, w_qk, w_v, sa_lambda, num_heads, "packed_qkv_linear")
    if packed is None:
        packed = pack_qkv_fp8(w_qk.detach(), w_v.detach(), sa_lambda, num_heads=H)
    return _PackedQKVLinear.apply(x.contiguous(), w_qk, w_v, sa_lambda, packed.data, packed.data_t, packed.scale,
                                  H, dqk, dv, dw_fp8, use_fast_accum, inputs)


def packed_qkv_forward(ctx, x, packed, w_qk, w_v, sa_lambda, *, num_heads=None, dw_fp8=False,
                       use_fast_accum=True, inputs: InputScaling | None = None) -> torch.Tensor:
    """The forward half of :func:`packed_qkv_linear` (same arguments) for callers that run forward
    and backward themselves (:mod:`speedrun.kernels.opaque`); state for the backward on ``ctx``."""
    H, dqk, dv, D = _check_linear_args(x, packed, w_qk, w_v, sa_lambda, num_heads, "packed_qkv_linear")
    if packed is None:
        packed = pack_qkv_fp8(w_qk.detach(), w_v.detach(), sa_lambda, num_heads=H)
    ctx.needs_input_grad = (True, True, True, True) + (False,) * 9
    return _PackedQKVLinear.forward(ctx, x.contiguous(), w_qk, w_v, sa_lambda, packed.data, packed.data_t,
                                    packed.scale, H, dqk, dv, dw_fp8, use_fast_accum, inputs)


def packed_qkv_backward(ctx, dy: torch.Tensor):
    """The backward half: dy (T, N) -> (dx, dw_qk, dw_v, dsa_lambda or None)."""
    return _PackedQKVLinear.backward(ctx, dy)[:4]


def packed_qkv_linear_reference(
    x: torch.Tensor,
    packed: PackedQKV | None,
    w_qk: torch.Tensor,
    w_v: torch.Tensor,
    sa_lambda: torch.Tensor | float,
    *,
    num_heads: int | None = None,
    dw_fp8: bool = False,
    use_fast_accum: bool = True,
    inputs: InputScaling | None = None,
) -> torch.Tensor:
    """Reference of :func:`packed_qkv_linear` (same signature): record.py's bf16
    ``F.linear(x, (cat * sa_lambda))`` in the packed column order, differentiable by autograd.
    ``packed``, ``dw_fp8`` and ``use_fast_accum`` are checked but otherwise ignored."""
    H, _, _, _ = _check_linear_args(x, packed, w_qk, w_v, sa_lambda, num_heads, "packed_qkv_linear_reference")
    w = packed_weight_reference(w_qk, w_v, H).type_as(x) * sa_lambda
    return F.linear(x, w)
