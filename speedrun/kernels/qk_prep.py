"""Fused QK-prep: packed QKV projection output -> q, k, v in the attention backend's layout.

Input: ``qkv`` (T, H P) from :func:`speedrun.kernels.qkv_pack.packed_qkv_linear`, per head
``[q_h (Dqk) | k_h (Dqk) | v_h (Dv)]`` (P = 2 Dqk + Dv; record 96 + 96 + 128 = 320).  Per (token t,
head h), exactly what ``RecordGPT._attention`` does after its GEMM:

1. ``q = rms_norm(q_h)``, ``k = rms_norm(k_h)`` over Dqk (``F.rms_norm`` default eps, which is fp32's
   epsilon 2^-23 for bf16/fp16/fp32 inputs), result rounded to the input dtype as the record's
   bf16 ``F.rms_norm`` does;
2. rotation with the given tables ``cos, sin`` (positions, n) fp32 (:mod:`speedrun.model.rotary`
   convention): interleaved pairs ``(x[2i], x[2i+1])``, ``i < n``, ``y0 = x0 c - x1 s``,
   ``y1 = x0 s + x1 c``; dims ``2n .. Dqk`` are stationary; rounded to the input dtype again
   (so the kernel reproduces the record's two roundings, not just its math);
   position = t, or ``2t + h % 2`` on paired-head layers (``Yarn.rotate_paired``);
3. key offset (long-window layers, unpaired only): the stationary dims of k at t are those of the
   normalised k at ``t - 1``; t = 0 keeps its own (record: ``cat((k[:1, :, r:], k[:-1, :, r:]))``);
4. ``v = v_h (+ aux_v[t, h])`` (the record's ``v + aux_v.view(T, H, Dv)``, optional);
5. q, k zero-padded to ``pad_to`` columns (for backends that need Dqk == Dv), optional.

Outputs are contiguous (T, H, D) tensors, or their (2T, H/2, D) views on paired layers (the same
memory: the record's reshape).

Backward (one kernel): from dq, dk, dv (any strides with unit last stride) to ``d qkv`` (T, H P):
drop the padding, route the stationary key gradient back one token (``g[t] = dk[t+1]``, plus
``dk[0]`` at t = 0), inverse rotation (``x0 = y0 c + y1 s``, ``x1 = -y0 s + y1 c``), RMS-norm
backward ``dx = r (g - x r^2 mean(g x))`` from the saved qkv; ``d aux_v = dv``.  Roundings are
straight-through, as in autograd of the reference.

Kernel shape: one program per ``BLOCK_R`` flat rows ``r = t H + h`` (so q/k/v stores are fully
contiguous runs), each row a BLOCK_D = next_pow2(max(Dqk, pad_to)) vector (128 for 96: 25% idle
lanes, no extra bytes).  Pairs are formed in registers with ``tl.reshape(.., (BLOCK_R, BLOCK_D/2,
2))`` + ``tl.split`` / ``tl.join``: at the record shape the loads are 8-wide vectors, so a pair sits
in one thread and the sm90 build uses no shared memory and no layout conversion at all (checked by
compiling for sm90 on the CPU in tests/test_qk_prep.py).  It is purely bandwidth bound: forward
bytes per token = read 2 H P (+ 8 n of tables), write 2 H (2 Dout + Dv) (bf16);
see :func:`qk_prep_bytes` and benchmarks/bench_qk_prep.py.

The epsilon is a constexpr (Inductor launches user kernels with fp64 float arguments, which would
promote the norm to fp64).  :data:`CONFIGS` holds the launch parameters; on the H200 tune
``BLOCK_R`` in {8, 16, 32, 64} and ``num_warps`` in {2, 4, 8} for fwd and bwd at T = 49152
(``benchmarks/bench_qk_prep.py --sweep``; done on the H200, see :data:`CONFIGS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from speedrun.kernels._triton import cdiv, interpreting, launch, next_pow2, triton_usable
from speedrun.kernels.fp8_cache import E5M2, _fp8_bits, _fp8_bits_hw, _round_to_grid, grid_constants
from speedrun.kernels.launch_notes import launch_note
from speedrun.kernels.rotary import apply_rotary

__all__ = ["CONFIGS", "qk_prep", "qk_prep_reference", "qk_prep_bytes"]

# Launch parameters on GPU: rows (token x head) per program and warps, the fastest of
# `bench_qk_prep.py --sweep` on the H200 summed over the layouts the candidate launches at stage 3
# (faster than 32 rows / 4 warps forward and 16 / 4 backward): small programs keep more of them in
# flight per SM.
CONFIGS = {
    "fwd": {"BLOCK_R": 8, "num_warps": 2},
    "bwd": {"BLOCK_R": 8, "num_warps": 2},
}
_INTERP_CONFIG = {"BLOCK_R": 128, "num_warps": 1}  # few programs: the interpreter pays per program
DEFAULT_EPS = torch.finfo(torch.float32).eps  # F.rms_norm(eps=None) on bf16/fp16/fp32 inputs
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _round(x, ROUND: tl.constexpr, EXACT: tl.constexpr,
           MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr, MIN_NORMAL: tl.constexpr):
    """fp32 -> nearest value of the 16-bit storage dtype (MANT 7: bf16, 10: fp16), still fp32;
    identity when ROUND is False (fp32 storage)."""
    if ROUND:
        if EXACT:  # the interpreter's casts truncate
            x = _round_to_grid(x, MANT, EMIN, SUB_C, MIN_NORMAL)
        elif MANT == 7:
            x = x.to(tl.bfloat16).to(tl.float32)
        else:
            x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _rotate(x, c, s, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate interleaved pairs of x (BLOCK_R, BLOCK_D) by (c, s) (BLOCK_R, BLOCK_D/2) in registers."""
    a, b = tl.split(tl.reshape(x, (BLOCK_R, BLOCK_D // 2, 2)))
    return tl.reshape(tl.join(a * c - b * s, a * s + b * c), (BLOCK_R, BLOCK_D))


@triton.jit
def _tables(cos_ptr, sin_ptr, pos, stride_cos, row_ok, NF: tl.constexpr, BLOCK_D: tl.constexpr):
    """cos/sin at each row's position, (BLOCK_R, BLOCK_D/2); pairs i >= NF get (1, 0): identity."""
    i = tl.arange(0, BLOCK_D // 2)
    m = row_ok[:, None] & (i[None, :] < NF)
    off = pos[:, None].to(tl.int64) * stride_cos + i[None, :]
    c = tl.load(cos_ptr + off, mask=m, other=1.0)
    s = tl.load(sin_ptr + off, mask=m, other=0.0)
    return c, s


@triton.jit
def _rms_scale(x, EPS: tl.constexpr, DQK: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) per row of x (padding columns are 0)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / DQK + EPS)


@triton.jit
def _qk_prep_fwd_kernel(
    qkv_ptr, cos_ptr, sin_ptr, aux_ptr, q_ptr, k_ptr, v_ptr,
    T, stride_t, stride_cos, stride_aux,
    EPS: tl.constexpr, H: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, NF: tl.constexpr, DOUT: tl.constexpr,
    PAIRED: tl.constexpr, KEY_OFFSET: tl.constexpr, HAS_AUX: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    ROUND: tl.constexpr, EXACT: tl.constexpr,
    MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr, MIN_NORMAL: tl.constexpr,
):
    P: tl.constexpr = 2 * DQK + DV
    out_ty = q_ptr.dtype.element_ty
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < T * H
    t = r // H
    h = r % H
    if PAIRED:
        pos = 2 * t + (h % 2)
    else:
        pos = t
    d = tl.arange(0, BLOCK_D)
    m_in = row_ok[:, None] & (d[None, :] < DQK)
    m_out = row_ok[:, None] & (d[None, :] < DOUT)
    base = qkv_ptr + t[:, None].to(tl.int64) * stride_t + h[:, None] * P
    out_off = r[:, None].to(tl.int64) * DOUT + d[None, :]
    c, s = _tables(cos_ptr, sin_ptr, pos, stride_cos, row_ok, NF, BLOCK_D)

    x = tl.load(base + d[None, :], mask=m_in, other=0.0).to(tl.float32)
    xn = _round(x * _rms_scale(x, EPS, DQK)[:, None], ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
    y = _round(_rotate(xn, c, s, BLOCK_R, BLOCK_D), ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
    tl.store(q_ptr + out_off, y.to(out_ty), mask=m_out)

    x = tl.load(base + DQK + d[None, :], mask=m_in, other=0.0).to(tl.float32)
    xn = _round(x * _rms_scale(x, EPS, DQK)[:, None], ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
    y = _round(_rotate(xn, c, s, BLOCK_R, BLOCK_D), ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
    if KEY_OFFSET:
        # Stationary dims from the previous token's normalised key (t = 0 keeps its own); that row
        # was just read by the neighbouring row of this or the previous program, so it comes from cache.
        tp = tl.maximum(t - 1, 0)
        prev = qkv_ptr + tp[:, None].to(tl.int64) * stride_t + h[:, None] * P + DQK
        xp = tl.load(prev + d[None, :], mask=m_in, other=0.0).to(tl.float32)
        xpn = _round(xp * _rms_scale(xp, EPS, DQK)[:, None], ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
        y = tl.where(d[None, :] >= 2 * NF, xpn, y)
    tl.store(k_ptr + out_off, y.to(out_ty), mask=m_out)

    e = tl.arange(0, BLOCK_V)
    m_v = row_ok[:, None] & (e[None, :] < DV)
    v = tl.load(base + 2 * DQK + e[None, :], mask=m_v, other=0.0).to(tl.float32)
    if HAS_AUX:
        a = tl.load(aux_ptr + t[:, None].to(tl.int64) * stride_aux + h[:, None] * DV + e[None, :], mask=m_v, other=0.0)
        v = _round(v + a.to(tl.float32), ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
    tl.store(v_ptr + r[:, None].to(tl.int64) * DV + e[None, :], v.to(out_ty), mask=m_v)


@triton.jit
def _store_e5m2(ptr, v, inv, mask, EXACT: tl.constexpr, Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr,
                Q_SUB_C: tl.constexpr, Q_MIN_NORMAL: tl.constexpr):
    """Store ``v`` (the stored 16-bit values, in fp32) quantised to e5m2 with multiplier ``inv``,
    exactly as the delayed quantise kernel would from the stored tensor; returns max |v| of the tile."""
    qf = tl.minimum(tl.maximum(v * inv, -57344.0), 57344.0)
    if EXACT:
        q = _fp8_bits(qf, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL)
    else:
        q = _fp8_bits_hw(qf, True)
    tl.store(ptr, q, mask=mask)
    return tl.max(tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1), axis=0)


@triton.jit
def _qk_prep_bwd_kernel(
    qkv_ptr, cos_ptr, sin_ptr, dq_ptr, dk_ptr, dv_ptr, dx_ptr, dx8_ptr, scale8_ptr, amax8_ptr,
    T, stride_t, stride_cos, stride_dx,
    stride_dq_t, stride_dq_h, stride_dk_t, stride_dk_h, stride_dv_t, stride_dv_h,
    EPS: tl.constexpr, H: tl.constexpr, DQK: tl.constexpr, DV: tl.constexpr, NF: tl.constexpr,
    PAIRED: tl.constexpr, KEY_OFFSET: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    ROUND: tl.constexpr, EXACT: tl.constexpr,
    MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr, MIN_NORMAL: tl.constexpr,
    STORE_E5M2: tl.constexpr, Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr, Q_SUB_C: tl.constexpr,
    Q_MIN_NORMAL: tl.constexpr,
):
    # STORE_E5M2: d qkv also goes out as e5m2 (dx8, same layout) with the delayed scale at
    # scale8_ptr, and max |d qkv| is max-accumulated into amax8_ptr: the packed QKV GEMM's dX then
    # needs no quantise pass over d qkv (model.qk_prep_fp8_grad).
    P: tl.constexpr = 2 * DQK + DV
    out_ty = dx_ptr.dtype.element_ty
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < T * H
    t = r // H
    h = r % H
    if PAIRED:
        pos = 2 * t + (h % 2)
    else:
        pos = t
    d = tl.arange(0, BLOCK_D)
    m_in = row_ok[:, None] & (d[None, :] < DQK)
    base = qkv_ptr + t[:, None].to(tl.int64) * stride_t + h[:, None] * P
    dbase = dx_ptr + t[:, None].to(tl.int64) * stride_dx + h[:, None] * P
    qbase = dx8_ptr + t[:, None].to(tl.int64) * stride_dx + h[:, None] * P
    if STORE_E5M2:
        inv8 = tl.math.div_rn(1.0, tl.load(scale8_ptr))
    c, s = _tables(cos_ptr, sin_ptr, pos, stride_cos, row_ok, NF, BLOCK_D)
    t64 = t[:, None].to(tl.int64)

    # q: inverse rotation (rotation by -angle), then RMS-norm backward.
    g = tl.load(dq_ptr + t64 * stride_dq_t + h[:, None] * stride_dq_h + d[None, :], mask=m_in, other=0.0).to(tl.float32)
    g = _rotate(g, c, -s, BLOCK_R, BLOCK_D)
    x = tl.load(base + d[None, :], mask=m_in, other=0.0).to(tl.float32)
    rs = _rms_scale(x, EPS, DQK)
    dot = tl.sum(g * x, axis=1) / DQK
    dx = rs[:, None] * (g - x * (rs * rs * dot)[:, None])
    dx = _round(dx, ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
    tl.store(dbase + d[None, :], dx.to(out_ty), mask=m_in)
    if STORE_E5M2:
        m8 = _store_e5m2(qbase + d[None, :], dx, inv8, m_in, EXACT, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL)

    # k: as q, with the key offset's stationary gradient taken from the next token.
    gk = tl.load(dk_ptr + t64 * stride_dk_t + h[:, None] * stride_dk_h + d[None, :], mask=m_in, other=0.0).to(tl.float32)
    g = _rotate(gk, c, -s, BLOCK_R, BLOCK_D)
    if KEY_OFFSET:
        has_next = row_ok & (t + 1 < T)
        gn = tl.load(dk_ptr + (t64 + 1) * stride_dk_t + h[:, None] * stride_dk_h + d[None, :],
                     mask=has_next[:, None] & (d[None, :] < DQK), other=0.0).to(tl.float32)
        stat = gn + tl.where((t == 0)[:, None], gk, 0.0)
        g = tl.where(d[None, :] >= 2 * NF, stat, g)
    x = tl.load(base + DQK + d[None, :], mask=m_in, other=0.0).to(tl.float32)
    rs = _rms_scale(x, EPS, DQK)
    dot = tl.sum(g * x, axis=1) / DQK
    dx = rs[:, None] * (g - x * (rs * rs * dot)[:, None])
    dx = _round(dx, ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
    tl.store(dbase + DQK + d[None, :], dx.to(out_ty), mask=m_in)
    if STORE_E5M2:
        m8 = tl.maximum(m8, _store_e5m2(qbase + DQK + d[None, :], dx, inv8, m_in, EXACT, Q_MANT, Q_EMIN, Q_SUB_C,
                                        Q_MIN_NORMAL))

    e = tl.arange(0, BLOCK_V)
    m_v = row_ok[:, None] & (e[None, :] < DV)
    gv = tl.load(dv_ptr + t64 * stride_dv_t + h[:, None] * stride_dv_h + e[None, :], mask=m_v, other=0.0).to(tl.float32)
    gv = _round(gv, ROUND, EXACT, MANT, EMIN, SUB_C, MIN_NORMAL)
    tl.store(dbase + 2 * DQK + e[None, :], gv.to(out_ty), mask=m_v)
    if STORE_E5M2:
        m8 = tl.maximum(m8, _store_e5m2(qbase + 2 * DQK + e[None, :], gv, inv8, m_v, EXACT, Q_MANT, Q_EMIN, Q_SUB_C,
                                        Q_MIN_NORMAL))
        # |d qkv| >= 0: a float atomic max is exact and order-independent
        tl.atomic_max(amax8_ptr, m8)


# ----------------------------------------------------------------------------------------------
# Argument checks and launchers


def _check(qkv, cos, sin, num_heads, qk_dim, v_dim, paired, key_offset, pad_to, aux_v, eps, name):
    """Validate; returns (T, H, Dqk, Dv, n, Dout)."""
    H, dqk, dv = int(num_heads), int(qk_dim), int(v_dim)
    if H < 1 or dqk < 1 or dv < 1:
        raise ValueError(f"{name}: num_heads, qk_dim, v_dim must be positive, got {H}, {dqk}, {dv}")
    P = 2 * dqk + dv
    if qkv.dim() != 2 or qkv.shape[1] != H * P:
        raise ValueError(f"{name}: qkv must be (T, H*(2*Dqk+Dv)) = (T, {H * P}) for H={H}, Dqk={dqk}, Dv={dv}; "
                         f"got shape {tuple(qkv.shape)}")
    if qkv.dtype not in _DTYPES:
        raise ValueError(f"{name}: qkv must be bf16/fp16/fp32, got {qkv.dtype} with shape {tuple(qkv.shape)}")
    if qkv.stride(1) != 1:
        raise ValueError(f"{name}: qkv {tuple(qkv.shape)} needs unit column stride, got strides {qkv.stride()}")
    T = qkv.shape[0]
    if cos.dim() != 2 or cos.shape != sin.shape or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"{name}: cos, sin must be fp32 (positions, n) of one shape, got cos {cos.dtype} "
                         f"{tuple(cos.shape)}, sin {sin.dtype} {tuple(sin.shape)}")
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        raise ValueError(f"{name}: cos/sin tables need unit column stride and equal strides, got {cos.stride()}, {sin.stride()}")
    n = cos.shape[1]
    if 2 * n > dqk:
        raise ValueError(f"{name}: tables rotate 2*{n} dims but Dqk={dqk} (cos shape {tuple(cos.shape)})")
    need = 2 * T if paired else T
    if cos.shape[0] < need:
        raise ValueError(f"{name}: tables have {cos.shape[0]} positions, need {need} for T={T}{' (paired)' if paired else ''}; "
                         f"cos shape {tuple(cos.shape)}")
    if paired and H % 2:
        raise ValueError(f"{name}: paired heads need an even num_heads, got {H} (qkv shape {tuple(qkv.shape)})")
    if paired and key_offset:
        raise ValueError(f"{name}: key_offset is only defined on unpaired layers (record.py applies it there)")
    dout = dqk if pad_to is None else int(pad_to)
    if dout < dqk:
        raise ValueError(f"{name}: pad_to={pad_to} is below Dqk={dqk}")
    if aux_v is not None:
        if aux_v.shape not in ((T, H * dv), (T, H, dv)) or aux_v.dtype != qkv.dtype:
            raise ValueError(f"{name}: aux_v must be ({T}, {H * dv}) or ({T}, {H}, {dv}) {qkv.dtype}, "
                             f"got {aux_v.dtype} {tuple(aux_v.shape)}")
    if eps is not None and not eps >= 0:
        raise ValueError(f"{name}: eps must be >= 0 or None, got {eps}")
    return T, H, dqk, dv, n, dout


def _round_consts(dt: torch.dtype) -> dict:
    """Constexprs of :func:`_round` for a storage dtype (unused for fp32, whose ROUND is False)."""
    return grid_constants(dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16)


def _shape_out(x: torch.Tensor, T: int, H: int, paired: bool) -> torch.Tensor:
    return x.view(2 * T, H // 2, x.shape[-1]) if paired else x


def qk_prep_reference(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    paired: bool = False,
    key_offset: bool = False,
    pad_to: int | None = None,
    aux_v: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain-PyTorch QK-prep with record.py's ops (same signature as :func:`qk_prep`).

    Args:
        qkv: (T, H (2 Dqk + Dv)) bf16/fp16/fp32 in the packed per-head order.
        cos, sin: (>= T positions, or >= 2T when ``paired``, n) fp32 rotation tables, 2n <= Dqk.
        num_heads, qk_dim, v_dim: H, Dqk, Dv.
        paired: rotate head h at position 2t + h%2 and return (2T, H/2, D) views.
        key_offset: shift k's stationary dims (2n ..) forward one token (unpaired only).
        pad_to: zero-pad q and k to this width (>= Dqk).
        aux_v: (T, H Dv) or (T, H, Dv), added to v.
        eps: RMS-norm epsilon; None = ``F.rms_norm``'s default.

    Returns q, k (T, H, Dout) and v (T, H, Dv) in qkv's dtype (paired: (2T, H/2, .) views).
    """
    T, H, dqk, dv, n, dout = _check(qkv, cos, sin, num_heads, qk_dim, v_dim, paired, key_offset, pad_to, aux_v, eps,
                                    "qk_prep_reference")
    x = qkv.view(T, H, 2 * dqk + dv)
    q = F.rms_norm(x[..., :dqk], (dqk,), eps=eps)
    k = F.rms_norm(x[..., dqk : 2 * dqk], (dqk,), eps=eps)
    v = x[..., 2 * dqk :]
    if paired:  # Yarn.rotate_paired with explicit tables
        rot = lambda z: torch.stack(  # noqa: E731
            (apply_rotary(z[:, 0::2], cos[0 : 2 * T : 2], sin[0 : 2 * T : 2]),
             apply_rotary(z[:, 1::2], cos[1 : 2 * T : 2], sin[1 : 2 * T : 2])), dim=2).flatten(1, 2)
        q, k = rot(q), rot(k)
    else:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if key_offset and T > 1:
            r = 2 * n
            shifted = torch.cat((k[:1, :, r:], k[:-1, :, r:]))
            k = torch.cat((k[:, :, :r], shifted), dim=-1)
    if aux_v is not None:
        v = v + aux_v.view(T, H, dv)
    if dout > dqk:
        q, k = F.pad(q, (0, dout - dqk)), F.pad(k, (0, dout - dqk))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _shape_out(q, T, H, paired), _shape_out(k, T, H, paired), _shape_out(v, T, H, paired)


def _launch_fwd(qkv, cos, sin, aux, T, H, dqk, dv, n, dout, paired, key_offset, eps, q=None, k=None, v=None):
    dev, dt = qkv.device, qkv.dtype
    q = torch.empty((T, H, dout), dtype=dt, device=dev) if q is None else q
    k = torch.empty((T, H, dout), dtype=dt, device=dev) if k is None else k
    v = torch.empty((T, H, dv), dtype=dt, device=dev) if v is None else v
    cfg = _INTERP_CONFIG if interpreting() else CONFIGS["fwd"]
    br = cfg["BLOCK_R"]
    if T * H == 0:
        return q, k, v
    aux2 = aux.reshape(T, H * dv) if aux is not None else qkv
    if aux is not None and aux2.stride(1) != 1:
        aux2 = aux2.contiguous()
    # the cos/sin rows it reads: T positions, 2T on paired layers
    tables = 2 * (2 * T if paired else T) * cos.shape[-1] * cos.element_size()
    with launch_note("_qk_prep_fwd_kernel", reads=(qkv, aux2 if aux is not None else None), writes=(q, k, v),
                     extra_bytes=tables):
        launch(_qk_prep_fwd_kernel, (cdiv(T * H, br),),
            qkv, cos, sin, aux2, q, k, v, T, qkv.stride(0), cos.stride(0), aux2.stride(0),
            EPS=float(eps), H=H, DQK=dqk, DV=dv, NF=n, DOUT=dout, PAIRED=paired, KEY_OFFSET=key_offset and T > 1,
            HAS_AUX=aux is not None, BLOCK_R=br, BLOCK_D=next_pow2(dout),
            BLOCK_V=next_pow2(dv), ROUND=dt != torch.float32, EXACT=interpreting(),
            num_warps=cfg["num_warps"], **_round_consts(dt),
        )
    return q, k, v


def _as_thd(g: torch.Tensor | None, T, H, D, like) -> torch.Tensor:
    """A gradient of a (T, H, D) / (2T, H/2, D) output as (T, H, D) with unit last stride."""
    if g is None:
        return like.new_zeros((T, H, D))
    g = g.reshape(T, H, D)
    return g if g.stride(2) == 1 else g.contiguous()


def _check_fp8_out(fp8_out, shape, device) -> None:
    q, scale, amax = fp8_out
    if q.dtype != E5M2 or tuple(q.shape) != tuple(shape) or not q.is_contiguous() or q.device != device:
        raise ValueError(f"qk_prep_backward: fp8_out's tensor must be a contiguous e5m2 {tuple(shape)} tensor on "
                         f"{device}, got {q.dtype} {tuple(q.shape)} on {q.device}")
    for name, t in (("scale", scale), ("amax", amax)):
        if t.dtype != torch.float32 or t.dim() != 0 or t.device != device:
            raise ValueError(f"qk_prep_backward: fp8_out's {name} must be a 0-d fp32 tensor on {device}, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device}")


def _launch_bwd(qkv, cos, sin, dq, dk, dv, T, H, dqk, dv_dim, n, paired, key_offset, eps, out=None, fp8_out=None):
    dt = qkv.dtype
    dx = torch.empty((T, H * (2 * dqk + dv_dim)), dtype=dt, device=qkv.device) if out is None else out
    if fp8_out is not None:
        _check_fp8_out(fp8_out, dx.shape, dx.device)
        if dt == torch.float32:
            raise ValueError("qk_prep_backward: fp8_out needs 16-bit qkv (its e5m2 bytes quantise the stored gradient)")
    cfg = _INTERP_CONFIG if interpreting() else CONFIGS["bwd"]
    br = cfg["BLOCK_R"]
    if T * H == 0:
        return dx
    tables = 2 * (2 * T if paired else T) * cos.shape[-1] * cos.element_size()
    q8, scale8, amax8 = (fp8_out[0].view(torch.uint8), fp8_out[1], fp8_out[2]) if fp8_out is not None else (dx, dx, dx)
    q_consts = {f"Q_{k}": v for k, v in grid_constants(E5M2).items()}
    with launch_note("_qk_prep_bwd_kernel", reads=(qkv, dq, dk, dv), writes=(dx, None if fp8_out is None else q8),
                     extra_bytes=tables):
        launch(_qk_prep_bwd_kernel, (cdiv(T * H, br),),
            qkv, cos, sin, dq, dk, dv, dx, q8, scale8, amax8, T, qkv.stride(0), cos.stride(0), dx.stride(0),
            dq.stride(0), dq.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            EPS=float(eps), H=H, DQK=dqk, DV=dv_dim, NF=n, PAIRED=paired, KEY_OFFSET=key_offset and T > 1,
            BLOCK_R=br, BLOCK_D=next_pow2(dqk), BLOCK_V=next_pow2(dv_dim),
            ROUND=dt != torch.float32, EXACT=interpreting(), num_warps=cfg["num_warps"], **_round_consts(dt),
            STORE_E5M2=fp8_out is not None, **q_consts,
        )
    return dx


class _QKPrep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, aux_v, cos, sin, dims, flags, eps):
        T, H, dqk, dv, n, dout = dims
        paired, key_offset = flags
        q, k, v = _launch_fwd(qkv, cos, sin, aux_v, T, H, dqk, dv, n, dout, paired, key_offset, eps)
        ctx.save_for_backward(qkv, cos, sin)
        ctx.dims, ctx.flags, ctx.eps = dims, flags, eps
        ctx.aux_shape = None if aux_v is None else aux_v.shape
        return _shape_out(q, T, H, paired), _shape_out(k, T, H, paired), _shape_out(v, T, H, paired)

    @staticmethod
    def backward(ctx, dq, dk, dv, fp8_out=None):
        qkv, cos, sin = ctx.saved_tensors
        T, H, dqk, dvd, n, dout = ctx.dims
        paired, key_offset = ctx.flags
        dq = _as_thd(dq, T, H, dout, qkv)
        dk = _as_thd(dk, T, H, dout, qkv)
        dv = _as_thd(dv, T, H, dvd, qkv)
        dx = _launch_bwd(qkv, cos, sin, dq, dk, dv, T, H, dqk, dvd, n, paired, key_offset, ctx.eps, fp8_out=fp8_out)
        daux = None
        if ctx.aux_shape is not None and ctx.needs_input_grad[1]:
            daux = dv.reshape(ctx.aux_shape).to(qkv.dtype)
        return dx, daux, None, None, None, None, None


def qk_prep(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    num_heads: int,
    qk_dim: int,
    v_dim: int,
    paired: bool = False,
    key_offset: bool = False,
    pad_to: int | None = None,
    aux_v: torch.Tensor | None = None,
    eps: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused QK-prep (Triton forward and backward); see the module docstring and
    :func:`qk_prep_reference` for arguments and outputs (identical).  Gradients flow to ``qkv`` and
    ``aux_v`` (the tables are constants).  Off-GPU without ``TRITON_INTERPRET=1`` it runs the reference."""
    dims = _check(qkv, cos, sin, num_heads, qk_dim, v_dim, paired, key_offset, pad_to, aux_v, eps, "qk_prep")
    if not triton_usable(qkv):
        return qk_prep_reference(qkv, cos, sin, num_heads=num_heads, qk_dim=qk_dim, v_dim=v_dim, paired=paired,
                                 key_offset=key_offset, pad_to=pad_to, aux_v=aux_v, eps=eps)
    if cos.device != qkv.device or (aux_v is not None and aux_v.device != qkv.device):
        raise ValueError(f"qk_prep: qkv on {qkv.device}, cos on {cos.device}"
                         f"{'' if aux_v is None else f', aux_v on {aux_v.device}'}: all must share a device")
    return _QKPrep.apply(qkv, aux_v, cos, sin, dims, (bool(paired), bool(key_offset)),
                         DEFAULT_EPS if eps is None else float(eps))


def qk_prep_forward(ctx, qkv, cos, sin, *, num_heads: int, qk_dim: int, v_dim: int, paired: bool = False,
                    key_offset: bool = False, pad_to: int | None = None, aux_v=None, eps: float | None = None):
    """The fused forward of :func:`qk_prep` (same arguments, Triton only) for callers that run
    forward and backward themselves (:mod:`speedrun.kernels.opaque`); state on ``ctx``."""
    dims = _check(qkv, cos, sin, num_heads, qk_dim, v_dim, paired, key_offset, pad_to, aux_v, eps, "qk_prep")
    ctx.needs_input_grad = (True, aux_v is not None, False, False, False, False, False)
    return _QKPrep.forward(ctx, qkv, aux_v, cos, sin, dims, (bool(paired), bool(key_offset)),
                           DEFAULT_EPS if eps is None else float(eps))


def qk_prep_backward(ctx, dq, dk, dv, *, fp8_out=None):
    """The backward half: (dq, dk, dv) -> (dqkv, daux_v or None).

    ``fp8_out = (q (T, N) e5m2, scale 0-d fp32, amax 0-d fp32)``: the kernel also writes dqkv
    quantised with ``scale`` into q (the bits :func:`~speedrun.kernels.fp8_cache.quantize_delayed`
    would make from dqkv) and max-accumulates ``max |dqkv|`` into amax: the delayed-scaled dy of
    the packed FP8 QKV GEMM's backward without a pass over dqkv.  16-bit qkv only."""
    return _QKPrep.backward(ctx, dq, dk, dv, fp8_out)[:2]


class _ValueResidualGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, v, aux_v):
        ctx.aux_shape = aux_v.shape
        return v.view_as(v)

    @staticmethod
    def backward(ctx, dv):
        return dv, dv.reshape(ctx.aux_shape)


def attach_value_residual_grad(v: torch.Tensor, aux_v: torch.Tensor) -> torch.Tensor:
    """``v`` (a view of it) whose gradient also flows, reshaped, to ``aux_v``.

    QK-prep adds the value residual ``aux_v`` (T, H * Dv) into v inside its kernel, so aux_v's
    gradient is v's gradient.  Run as an opaque custom op (:mod:`speedrun.kernels.opaque`) the
    kernel may not return that gradient, a tensor it was handed, without copying it (T x H x Dv,
    per layer with a value residual and micro-batch); so aux_v enters the op without a gradient
    and this node in the caller's graph hands v's gradient to both, by reference."""
    return _ValueResidualGrad.apply(v, aux_v)


def qk_prep_out_shapes(T: int, num_heads: int, qk_dim: int, v_dim: int, *, paired: bool = False,
                       pad_to: int | None = None) -> list[tuple[int, ...]]:
    """Shapes of (q, k, v) as :func:`qk_prep` returns them."""
    dout = qk_dim if pad_to is None else pad_to
    if paired:
        return [(2 * T, num_heads // 2, dout), (2 * T, num_heads // 2, dout), (2 * T, num_heads // 2, v_dim)]
    return [(T, num_heads, dout), (T, num_heads, dout), (T, num_heads, v_dim)]


def qk_prep_bytes(T: int, num_heads: int, qk_dim: int, v_dim: int, n_freq: int, *, pad_to: int | None = None,
                  key_offset: bool = False, aux_v: bool = False, itemsize: int = 2, backward: bool = False) -> int:
    """Compulsory DRAM bytes of one qk_prep call (forward, or ``backward``), for roofline numbers.

    Forward: read qkv (+ aux_v) + tables, write q, k, v.  Backward: read dq, dk, dv, the q/k part of
    qkv and the tables, write d qkv.  The key offset's previous-row read is a cache hit, not counted.
    """
    H, dqk, dv = num_heads, qk_dim, v_dim
    dout = dqk if pad_to is None else pad_to
    tables = 2 * T * n_freq * 4
    if not backward:
        return T * H * itemsize * ((2 * dqk + dv) + (dv if aux_v else 0) + 2 * dout + dv) + tables
    return T * H * itemsize * (2 * dout + dv + 2 * dqk + (2 * dqk + dv)) + tables
