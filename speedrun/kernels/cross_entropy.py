"""The loss head: lm_head GEMM (bf16 or FP8) + softcapped multi-token cross-entropy.

The training loss at row ``t`` of a flat (varlen) batch of ``N`` tokens is

    loss_t = sum_k w_k * CE(s_t, targets[t + k]) + prefix_weight * CE(s_t, prefix_targets[t])

with softcapped logits ``s = A * sigmoid((z + B) / C)`` (record: A, B, C = 23, 5, 7.5), ``z = x @ W``
and the log-softmax taken in fp32 over the *real* vocabulary only (columns ``>= vocab_size`` of a
padded head are masked out and get zero gradient).

Input format (the same everywhere in this module):

* ``targets``: (N_t,) int64 (int32 accepted), ``N_t >= N``.  ``targets[t]`` is the next token of
  row ``t``; the MTP term ``k`` (0-based, k=0 is the next token) of row ``t`` uses
  ``targets[t + k]``.  Terms with ``t + k >= N_t`` (the end of the batch) are dropped, and so is
  any term whose target is ``-1``.  MTP targets cross document boundaries, as in the record.
  Passing ``N_t > N`` lets a caller evaluate a slice of rows that still sees the following targets.
* ``mtp_weights``: (K,) fp32 tensor (or a sequence of floats), K >= 1; entry 0 weighs the next token.
  A tensor on the device changes every step without recompiles or host copies.
* ``prefix_targets``: (N,) int64 or ``None``; ``-1`` disables the term for that row.
* ``prefix_weight``: float or 1-element fp32 tensor.
* Any other target id outside ``[0, vocab_size)`` is invalid: the kernels turn that row's loss into
  NaN (no host sync needed); on CPU tensors the Python entry points raise
  :class:`speedrun.errors.DataError` first.

Layout: the head weight is ``W`` of shape (D, V_pad), contiguous -- the record's "transposed"
lm_head layout (768, 50304) -- so ``logits = x @ W``.

What is here:

* :func:`softcapped_multitoken_ce_reference` -- per-token loss in plain PyTorch (autograd-able).
* :func:`softcapped_ce_fwd_bwd` (Triton) and :func:`softcapped_ce_fwd_bwd_reference` (PyTorch): one
  kernel over a logits matrix giving the per-token loss and ``dlogits = d(sum_t loss_t)/dlogits``
  times ``grad_out_scale``, written as bf16/fp32 or directly as FP8 e5m2.  It reads each row
  twice (statistics, then gradients): Nsight Compute measured twice the logits' bytes read.
* :func:`fused_softcapped_ce` (autograd Function :class:`FusedSoftcappedCE`) and its reference
  :func:`fused_softcapped_ce_reference`: the whole head from ``x`` and ``W``.  Forward runs the GEMM
  and the CE kernel, which also writes ``dlogits``; backward is two GEMMs.
* :func:`softcapped_ce_eval` -- the validation loss (bf16 GEMM, softcap, fp32 ``F.cross_entropy``).

FP8 (record §2.5): static tensorwise scales ``x_s = 100/448`` and ``w_s = 1.6/448`` quantise x and
W to e4m3 for the forward GEMM; the CE kernel writes ``dlogits / g_s`` as e5m2 with
``g_s = 0.75/448``; ``dX = dlogits @ W^T`` is e5m2 x e4m3 and ``dW = x^T @ dlogits`` is
e4m3 x e5m2.  Unlike the record, backward honours ``grad_output`` (a per-row factor, applied to
``dX`` rows and folded into the dW operand ``x`` at O(N*D) cost) instead of baking
``grad_scale`` in at forward time; the e5m2 bytes are the same as the record's because its
``grad_scale`` cancels between ``dlogits`` and ``grad_s = grad_scale * 0.75/448``.  cuBLAS wants
the dW GEMM's e5m2 operand K-major, i.e. ``dlogits`` transposed: ``grad_layout="transpose"``
transposes it in the backward (as the record does), ``"dual"`` has the CE kernel store both
layouts (``dlogits_t_out``), saving that pass's read.

Other deliberate differences from the record's CUDA kernel (f411b3d ``ce_fwd_bwd_kernel``): the
softmax excludes padded columns (the record normalises over all 50304); the softmax-gradient
weight sums only the terms that are active for the row (the record adds every MTP weight even where
the batch end masks the term); ``sigmoid`` is kept in fp32 rather than staged as bf16.  All three
make the kernel equal to the autograd gradient of the reference loss.  What limits the kernel is
the GPU's special-function unit (ex2, rcp, tanh: 16 per clock per SM on Hopper), not memory: a
stage-3 call runs near the time of its six SFU instructions per logit (docs/kernels/cross_entropy.md).
``sigmoid="tanh"`` (``train.ce_sigmoid``) evaluates the sigmoid as ``0.5 + 0.5 tanh(x / 2)``
with ``tanh.approx.f32`` as the record does (four per logit); the capped logits then move by up to ``A * 2**-12``, about 0.006, where
the record's bf16 staging moves them by up to ``A * 2**-9``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from speedrun.config import CE_GRAD_LAYOUT_CHOICES, CE_SIGMOID_CHOICES
from speedrun.errors import DataError
from speedrun.kernels._triton import cdiv, interpreting, launch, next_pow2
from speedrun.kernels.fp8_cache import _fp8_bits, grid_constants, quantize_rows_scaled_t, quantize_static
from speedrun.kernels.fp8_ops import cuda_capability, quantize_tensorwise, scaled_mm, to_scale_tensor
from speedrun.kernels.launch_notes import launch_note

__all__ = [
    "DEFAULT_SOFTCAP",
    "X_SCALE",
    "W_SCALE",
    "GRAD_UNIT_SCALE",
    "mtp_target_matrix",
    "softcapped_multitoken_ce_reference",
    "softcapped_ce_fwd_bwd",
    "softcapped_ce_fwd_bwd_reference",
    "FusedSoftcappedCE",
    "HeadFP8Weight",
    "quantize_head_weight",
    "fused_softcapped_ce",
    "fused_softcapped_ce_reference",
    "softcapped_ce_eval",
    "transpose_fp8",
]

DEFAULT_SOFTCAP = (23.0, 5.0, 7.5)
X_SCALE = 100.0 / 448.0  # real value of one e4m3 unit of x (record: lm_head x_s)
W_SCALE = 1.6 / 448.0  # real value of one e4m3 unit of W (record: lm_head w_s)
GRAD_UNIT_SCALE = 0.75 / 448.0  # real value of one e5m2 unit of dlogits (record grad_s / grad_scale)
# How the CE kernel evaluates the softcap's sigmoid (``sigmoid``, from train.ce_sigmoid): "exact"
# (exp2 and a reciprocal: two special-function instructions per logit and pass) or "tanh"
# (0.5 + 0.5 tanh(x/2) with the GPU's tanh.approx.f32: one, max relative error ~2**-11, as
# upstream's CUDA kernel does); the validation loss is always exact.
SIGMOID_CHOICES = CE_SIGMOID_CHOICES
# Layouts of the FP8 head's e5m2 logit gradient (``grad_layout``, from train.ce_grad_layout):
# "transpose" (the CE kernel writes it row-major for dx; the backward transposes it for dW, a read
# and a write of N x V_pad bytes, as upstream) or "dual" (the CE kernel writes both layouts).
GRAD_LAYOUT_CHOICES = CE_GRAD_LAYOUT_CHOICES
_LOG2E = 1.4426950408889634

# The Triton 3.6 interpreter's fp32 -> e5m2 cast gets the exponent wrong when rounding carries into
# the next binade, and its fp32 -> bf16 cast truncates, so under TRITON_INTERPRET the kernel rounds
# in software first (exactly, RTNE) and the cast only copies an already representable value.

# ----------------------------------------------------------------------------------------------
# Input checks shared by every entry point


_WEIGHT_TENSORS: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}


def _weights_tensor(w: torch.Tensor | Sequence[float], device: torch.device, name: str) -> torch.Tensor:
    """``w`` as a contiguous fp32 vector on ``device``.  A sequence of floats is copied once per
    distinct value tuple and device (every micro-batch of a step reuses it), and on CUDA from
    pinned memory without blocking: ``torch.tensor(values, device="cuda")`` is a blocking copy
    that drains the GPU's queue once per call (found by ``speedrun bench step --sync-scan``)."""
    if isinstance(w, torch.Tensor):
        if not w.is_floating_point():
            raise ValueError(f"{name} must be a floating tensor, got {w.dtype}")
        return w.reshape(-1).to(device=device, dtype=torch.float32).contiguous()
    key = (tuple(float(v) for v in w), torch.device(device))
    t = _WEIGHT_TENSORS.get(key)
    if t is None:
        host = torch.tensor(key[0], dtype=torch.float32)
        if key[1].type == "cuda":
            t = host.pin_memory().to(key[1], non_blocking=True)
        else:
            t = host.to(key[1])
        if len(_WEIGHT_TENSORS) >= 64:  # ramped weights make a new tuple every step
            _WEIGHT_TENSORS.clear()
        _WEIGHT_TENSORS[key] = t
    return t


def _prefix_weight_tensor(pw: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    return to_scale_tensor(pw, device).reshape(1)


def _check_targets(
    n_rows: int,
    targets: torch.Tensor,
    prefix_targets: torch.Tensor | None,
    vocab_size: int,
    check_values: bool | None,
) -> None:
    for name, t, min_len in (("targets", targets, n_rows), ("prefix_targets", prefix_targets, n_rows)):
        if t is None:
            continue
        if t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"{name} must be int64 or int32 token ids, got {t.dtype}")
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D (one id per row), got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous()), got stride {t.stride()}")
        if name == "prefix_targets" and t.shape[0] != n_rows:
            raise ValueError(f"prefix_targets must have one entry per row: {n_rows}, got {t.shape[0]}")
        if t.shape[0] < min_len:
            raise ValueError(f"{name} needs at least one entry per row ({n_rows}), got {t.shape[0]}")
    if check_values is None:
        check_values = targets.device.type == "cpu"
    if check_values:
        for name, t in (("targets", targets), ("prefix_targets", prefix_targets)):
            if t is None or t.numel() == 0:
                continue
            lo, hi = int(t.min()), int(t.max())
            if lo < -1 or hi >= vocab_size:
                raise DataError(
                    f"{name} hold ids in [{lo}, {hi}] but the head has vocab_size={vocab_size} "
                    f"(valid ids: 0..{vocab_size - 1}, or -1 to mask a term)"
                )


def _check_softcap(softcap) -> None:
    if softcap is None:
        return
    if len(softcap) != 3:
        raise ValueError(f"softcap must be (A, B, C) for A*sigmoid((z+B)/C) or None, got {softcap!r}")
    if softcap[0] <= 0 or softcap[2] == 0:
        raise ValueError(f"softcap (A, B, C) needs A > 0 and C != 0, got {softcap!r}")


def _check_logits(logits: torch.Tensor, vocab_size: int | None) -> int:
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D (N, V_pad), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point() or logits.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"logits must be bf16, fp16 or fp32, got {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits rows must be contiguous (stride(1) == 1), got strides {logits.stride()}")
    v_pad = logits.shape[1]
    vocab_size = v_pad if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= v_pad:
        raise ValueError(f"vocab_size={vocab_size} must lie in [1, {v_pad}] (the logits' width)")
    return vocab_size


# ----------------------------------------------------------------------------------------------
# Plain-PyTorch references


def _softcap(z: torch.Tensor, softcap) -> torch.Tensor:
    if softcap is None:
        return z
    a, b, c = softcap
    return a * torch.sigmoid((z + b) / c)


def mtp_target_matrix(targets: torch.Tensor, n_rows: int, n_predict: int) -> torch.Tensor:
    """(n_rows, n_predict) int64 matrix whose column k is ``targets[t + k]``, ``-1`` past the end.

    ``targets``: (N_t,) with ``N_t >= n_rows``.  Only the end of ``targets`` is masked: rows near a
    document boundary predict tokens of the next document, as in the record.
    """
    t = targets.to(torch.int64)
    out = torch.full((n_rows, n_predict), -1, dtype=torch.int64, device=targets.device)
    for k in range(n_predict):
        m = max(0, min(n_rows, t.shape[0] - k))
        out[:m, k] = t[k : k + m]
    return out


def _masked_logprobs(logits: torch.Tensor, vocab_size: int, softcap) -> torch.Tensor:
    s = _softcap(logits.float(), softcap)
    if vocab_size < s.shape[1]:
        pad = torch.arange(s.shape[1], device=s.device) >= vocab_size
        s = s.masked_fill(pad, float("-inf"))
    return torch.log_softmax(s, dim=-1)


def _term_nll(logp: torch.Tensor, target: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(-log p[target], active) per row; invalid ids give NaN, -1 gives an inactive zero."""
    valid = (target >= 0) & (target < vocab_size)
    bad = (target < -1) | (target >= vocab_size)
    nll = -logp.gather(1, target.clamp(0, vocab_size - 1).unsqueeze(1)).squeeze(1)
    nll = torch.where(valid, nll, torch.zeros_like(nll))
    nll = torch.where(bad, torch.full_like(nll, float("nan")), nll)
    return nll, valid


def softcapped_multitoken_ce_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mtp_weights: torch.Tensor | Sequence[float] = (1.0,),
    prefix_targets: torch.Tensor | None = None,
    prefix_weight: float | torch.Tensor = 0.0,
    softcap: tuple[float, float, float] | None = DEFAULT_SOFTCAP,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """Per-token softcapped multi-token + prefix-token cross-entropy, plain PyTorch.

    ``logits``: (N, V_pad) any float dtype (upcast to fp32); ``targets``: (N_t >= N,) ids;
    ``mtp_weights``: (K,); ``prefix_targets``: (N,) or None; ``prefix_weight``: float or tensor;
    ``softcap``: (A, B, C) or None for raw logits; ``vocab_size``: real vocabulary (columns at or
    beyond it are excluded from the softmax), default V_pad.  Returns (N,) fp32 losses in nats,
    differentiable w.r.t. ``logits``.  See the module docstring for the masking rules.
    """
    vocab_size = _check_logits(logits, vocab_size)
    _check_softcap(softcap)
    n = logits.shape[0]
    _check_targets(n, targets, prefix_targets, vocab_size, check_values=False)
    w = _weights_tensor(mtp_weights, logits.device, "mtp_weights")
    logp = _masked_logprobs(logits, vocab_size, softcap)
    tm = mtp_target_matrix(targets, n, w.numel())
    loss = torch.zeros(n, dtype=torch.float32, device=logits.device)
    for k in range(w.numel()):
        nll, _ = _term_nll(logp, tm[:, k], vocab_size)
        loss = loss + w[k] * nll
    if prefix_targets is not None:
        nll, _ = _term_nll(logp, prefix_targets.to(torch.int64), vocab_size)
        loss = loss + _prefix_weight_tensor(prefix_weight, logits.device)[0] * nll
    return loss


def _store_grad(g: torch.Tensor, grad_dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor:
    if grad_dtype == torch.float8_e5m2:
        q = quantize_tensorwise(g, 1.0, torch.float8_e5m2)
    else:
        q = g.to(grad_dtype)
    if out is None:
        return q
    out.copy_(q)
    return out


def softcapped_ce_fwd_bwd_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mtp_weights: torch.Tensor | Sequence[float] = (1.0,),
    prefix_targets: torch.Tensor | None = None,
    prefix_weight: float | torch.Tensor = 0.0,
    *,
    softcap: tuple[float, float, float] | None = DEFAULT_SOFTCAP,
    vocab_size: int | None = None,
    grad_out_scale: float = 1.0,
    grad_dtype: torch.dtype | None = None,
    losses_out: torch.Tensor | None = None,
    dlogits_out: torch.Tensor | None = None,
    dlogits_t_out: torch.Tensor | None = None,
    check_targets: bool | None = None,
    block_v: int | None = None,
    block_m: int | None = None,
    num_warps: int = 4,
    max_programs: int | None = None,
    sigmoid: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`softcapped_ce_fwd_bwd` (same signature), by autograd in fp32.

    Returns ``(losses, dlogits)``: losses (N,) fp32; dlogits (N, V_pad) in ``grad_dtype`` (default
    ``logits.dtype``; ``torch.float8_e5m2`` saturates at +-57344) equal to
    ``grad_out_scale * d(sum_t loss_t)/d logits``, zero in padded columns; ``dlogits_t_out``
    (V_pad, N), when given, receives its transpose.  ``block_v``, ``block_m``, ``num_warps`` and
    ``max_programs`` (tuning knobs of the kernel) and ``sigmoid`` (always exact here) are ignored.
    """
    vocab_size = _check_logits(logits, vocab_size)
    _check_targets(logits.shape[0], targets, prefix_targets, vocab_size, check_targets)
    grad_dtype = logits.dtype if grad_dtype is None else grad_dtype
    _check_transposed_out(dlogits_t_out, logits.shape, grad_dtype)
    with torch.enable_grad():
        z = logits.detach().float().requires_grad_(True)
        loss = softcapped_multitoken_ce_reference(
            z, targets, mtp_weights, prefix_targets, prefix_weight, softcap, vocab_size
        )
        (g,) = torch.autograd.grad(loss.sum(), z)
    g = torch.nan_to_num(g, nan=0.0) * grad_out_scale  # rows with invalid ids have NaN loss anyway
    losses = loss.detach()
    if losses_out is not None:
        losses = losses_out.copy_(losses)
    dlogits = _store_grad(g, grad_dtype, dlogits_out)
    if dlogits_t_out is not None:
        dlogits_t_out.copy_(dlogits.t())
    return losses, dlogits


def _check_transposed_out(dlogits_t_out: torch.Tensor | None, shape, grad_dtype: torch.dtype) -> None:
    if dlogits_t_out is None:
        return
    n, v_pad = shape
    if tuple(dlogits_t_out.shape) != (v_pad, n) or dlogits_t_out.dtype != grad_dtype or not dlogits_t_out.is_contiguous():
        raise ValueError(f"dlogits_t_out must be a contiguous {grad_dtype} tensor of shape ({v_pad}, {n}) (the "
                         f"transposed logits gradient), got {dlogits_t_out.dtype} {tuple(dlogits_t_out.shape)}")


# ----------------------------------------------------------------------------------------------
# Triton kernel


@triton.jit
def _tanh(y, ASM: tl.constexpr):
    if ASM:
        # one special-function-unit instruction (max relative error ~2**-11) where the exact
        # sigmoid costs two (ex2 and rcp); that unit's throughput limits the kernel
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 2.0 / (1.0 + tl.exp(-2.0 * y)) - 1.0


@triton.jit
def _softcap_u(z, k1, k2, SIGMOID_TANH: tl.constexpr, TANH_ASM: tl.constexpr):
    # sigmoid((z + B) / C) with the constants folded outside the loops (_sigmoid_constants):
    # exact: 1 / (1 + 2**(z*k1 + k2)); SIGMOID_TANH: 0.5 + 0.5 * tanh(z*k1 + k2).
    # TANH_ASM: with the hardware's approximate tanh (else an exact one: the interpreter's route,
    # which checks the identity's constants).
    if SIGMOID_TANH:
        return 0.5 + 0.5 * _tanh(z * k1 + k2, TANH_ASM)
    else:
        return 1.0 / (1.0 + tl.exp2(z * k1 + k2))


@triton.jit
def _sigmoid_constants(k1, k2, SIGMOID_TANH: tl.constexpr):
    # The host passes k1 = -log2(e)/C, k2 = -B*log2(e)/C (the exact route's); the tanh route wants
    # (z + B) / 2C = -(z*k1 + k2) * ln(2)/2, so both scale by -ln(2)/2 once per program.
    if SIGMOID_TANH:
        HALF_LN2: tl.constexpr = 0.34657359027997264
        return k1 * -HALF_LN2, k2 * -HALF_LN2
    else:
        return k1, k2


@triton.jit
def _grad_cast(g, dlogits_ptr, GRAD_FP8: tl.constexpr, SOFT_ROUND: tl.constexpr, SOFT_ROUND_BF16: tl.constexpr):
    """fp32 ``g`` in dlogits' storage type: e5m2 saturating at +-57344 with RTNE, or the pointer's
    dtype.  SOFT_ROUND / SOFT_ROUND_BF16 (the interpreter, whose own casts truncate) round exactly
    in fp32 first."""
    if GRAD_FP8:
        g = tl.minimum(tl.maximum(g, -57344.0), 57344.0)
        if SOFT_ROUND:
            # adding and subtracting 1.5 * 2**(q + 23) rounds to a multiple of 2**q, q being the
            # e5m2 spacing at |g| (two mantissa bits, fixed below the normal range)
            q_exp = tl.maximum(((g.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -14) - 2
            magic = (((q_exp + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
            r = (tl.abs(g) + magic) - magic
            g = tl.where(g < 0, -r, r)
        return g.to(tl.float8e5, fp_downcast_rounding="rtne")
    if SOFT_ROUND_BF16:
        bits = g.to(tl.int32, bitcast=True)
        g = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return g.to(dlogits_ptr.dtype.element_ty)


@triton.jit
def _grad_out(g, dlogits_ptr, GRAD_FP8: tl.constexpr, SOFT_ROUND: tl.constexpr, SOFT_ROUND_BF16: tl.constexpr,
              FP8_BITS: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr, SUB_C: tl.constexpr,
              MIN_NORMAL: tl.constexpr):
    """The stored value of fp32 ``g``: :func:`_grad_cast`, or with ``FP8_BITS`` (an e5m2 gradient
    stored in both layouts) the same e5m2 code as a uint8 made by integer arithmetic
    (:func:`~speedrun.kernels.fp8_cache._fp8_bits`: the cvt path corrupts FP8 tiles stored both
    row-major and transposed on sm90 with Triton 3.6's ptxas, triton-lang/triton#11111)."""
    # one return statement: Triton type-checks every return, even under a constexpr branch
    if FP8_BITS:
        out = _fp8_bits(tl.minimum(tl.maximum(g, -57344.0), 57344.0), MANT, EMIN, SUB_C, MIN_NORMAL)
    else:
        out = _grad_cast(g, dlogits_ptr, GRAD_FP8, SOFT_ROUND, SOFT_ROUND_BF16)
    return out


@triton.jit
def _target_term(logits_ptr, rows, stride_logits, row_ok, t, w, lse, vocab_size, cap_a, k1, k2,
                 SOFTCAP: tl.constexpr, SIGMOID_TANH: tl.constexpr, TANH_ASM: tl.constexpr):
    """One loss term per row for target ids ``t`` (-1: none) of weight ``w``: its contribution to
    the loss (``w * (lse - z_t)``), to the weight sum, and whether ``t`` is out of range (< -1 or
    >= vocab_size: the row's loss becomes NaN)."""
    ok = (t >= 0) & (t < vocab_size)
    bad = (t < -1) | (t >= vocab_size)
    zt = tl.load(logits_ptr + rows * stride_logits + t, mask=row_ok & ok, other=0.0).to(tl.float32)
    if SOFTCAP:
        zt = cap_a * _softcap_u(zt, k1, k2, SIGMOID_TANH, TANH_ASM)
    return tl.where(ok, w * (lse - zt), 0.0), tl.where(ok, w, 0.0), bad


@triton.jit
def _ce_fwd_bwd_kernel(
    logits_ptr,
    stride_logits,
    dlogits_ptr,
    stride_dlogits,
    dlogits_t_ptr,
    stride_dlogits_t,
    losses_ptr,
    targets_ptr,
    n_rows,
    n_targets,
    mtp_w_ptr,
    prefix_ptr,
    prefix_w_ptr,
    n_cols,
    vocab_size,
    cap_a,
    k1,
    k2,
    a_over_c,
    grad_mult,
    n_row_blocks,
    N_PREDICT: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
    SOFTCAP: tl.constexpr,
    GRAD_FP8: tl.constexpr,
    SOFT_ROUND: tl.constexpr,
    SOFT_ROUND_BF16: tl.constexpr,
    SIGMOID_TANH: tl.constexpr,
    TANH_ASM: tl.constexpr,
    STORE_T: tl.constexpr,
    FP8_BITS: tl.constexpr,
    MANT: tl.constexpr,
    EMIN: tl.constexpr,
    SUB_C: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Each program owns BLOCK_M whole rows at a time.  Pass 1 reads them for the log-sum-exp, pass 2
    # reads them again and writes dlogits densely (softmax part only); a third step rewrites the
    # few target columns.  STORE_T: every store also goes to dlogits_t (V_pad, N), the layout the
    # weight-gradient GEMM reads, so no transpose pass follows.  At the record's vocab a row is
    # 100 KB: with one program per row block thousands of rows are in flight, pass 2 misses L2, and
    # Nsight Compute measured twice the logits' bytes read;
    # ``max_programs`` bounds the rows in flight.
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    # Under torch.compile, Inductor launches this kernel with fp64 float arguments; keep all the
    # per-element arithmetic in fp32.
    cap_a = tl.cast(cap_a, tl.float32)
    k1 = tl.cast(k1, tl.float32)
    k2 = tl.cast(k2, tl.float32)
    k1, k2 = _sigmoid_constants(k1, k2, SIGMOID_TANH)
    a_over_c = tl.cast(a_over_c, tl.float32)
    grad_mult = tl.cast(grad_mult, tl.float32)
    # Row blocks pid, pid + G, ... (G programs): one block each with the default grid; a smaller
    # (persistent) grid keeps fewer rows in flight, so pass 2 can find them in L2.
    row_block = tl.program_id(0)
    while row_block < n_row_blocks:
        rows = row_block.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        logit_rows = logits_ptr + rows[:, None] * stride_logits
        grad_rows = dlogits_ptr + rows[:, None] * stride_dlogits
        offs = tl.arange(0, BLOCK_V)

        # `while` rather than `for ... in range(runtime bound)`: the Triton 3.6 interpreter cannot
        # index a runtime scalar under NumPy >= 2.4, and the CPU tests run there.
        # Loads are masked by the padded row length (n_cols, a multiple of 16 in the record: Triton
        # then issues 16-byte vector loads) and the padded columns dropped with `where`; a mask
        # at the real vocabulary (50,257, odd) would make every load a scalar 2-byte one.
        if SOFTCAP:
            # Softcapped logits never exceed A, so A is a fixed softmax offset: no running max, and
            # per-lane partial sums reduced once at the end (exp(s - A) >= exp(-A) cannot underflow
            # for the A <= 64 the launcher allows here).
            acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
            a_log2e = cap_a * LOG2E
            start = 0
            while start < vocab_size:
                cols = start + offs
                real = cols < vocab_size
                in_row = cols < n_cols
                z = tl.load(logit_rows + cols[None, :], mask=row_ok[:, None] & in_row[None, :], other=0.0).to(tl.float32)
                e = tl.exp2(_softcap_u(z, k1, k2, SIGMOID_TANH, TANH_ASM) * a_log2e - a_log2e)
                acc += tl.where(real[None, :], e, 0.0)
                start += BLOCK_V
            lse = cap_a + tl.log2(tl.sum(acc, axis=1)) * LN2
        else:
            m = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l = tl.zeros([BLOCK_M], tl.float32)
            start = 0
            while start < vocab_size:
                cols = start + offs
                real = cols < vocab_size
                in_row = cols < n_cols
                z = tl.load(logit_rows + cols[None, :], mask=row_ok[:, None] & in_row[None, :], other=0.0).to(tl.float32)
                z = tl.where(real[None, :], z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, axis=1))
                l = l * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
                m = m_new
                start += BLOCK_V
            lse = m + tl.log(l)

        loss = tl.zeros([BLOCK_M], tl.float32)
        weight_sum = tl.zeros([BLOCK_M], tl.float32)
        bad = rows < 0
        for k in tl.static_range(N_PREDICT):
            t = tl.load(targets_ptr + rows + k, mask=row_ok & (rows + k < n_targets), other=-1).to(tl.int64)
            term, w_term, bad_t = _target_term(logits_ptr, rows, stride_logits, row_ok, t, tl.load(mtp_w_ptr + k),
                                               lse, vocab_size, cap_a, k1, k2, SOFTCAP, SIGMOID_TANH, TANH_ASM)
            loss += term
            weight_sum += w_term
            bad = bad | bad_t
        if HAS_PREFIX:
            pt = tl.load(prefix_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
            pw = tl.load(prefix_w_ptr)
            term, w_term, bad_t = _target_term(logits_ptr, rows, stride_logits, row_ok, pt, pw,
                                               lse, vocab_size, cap_a, k1, k2, SOFTCAP, SIGMOID_TANH, TANH_ASM)
            loss += term
            weight_sum += w_term
            bad = bad | bad_t
        tl.store(losses_ptr + rows, tl.where(bad, float("nan"), loss), mask=row_ok)

        # Dense part of d loss / d s_j = weight_sum * p_j - (weights whose target is j).
        lse_log2e = lse * LOG2E
        coef = weight_sum * grad_mult
        if SOFTCAP:
            coef = coef * a_over_c
        start = 0
        while start < n_cols:
            cols = start + offs
            real = cols < vocab_size
            in_row = cols < n_cols
            z = tl.load(logit_rows + cols[None, :], mask=row_ok[:, None] & in_row[None, :], other=0.0).to(tl.float32)
            if SOFTCAP:
                u = _softcap_u(z, k1, k2, SIGMOID_TANH, TANH_ASM)
                p = tl.exp2(u * a_log2e - lse_log2e[:, None])
                g = p * (u - u * u) * coef[:, None]
            else:
                g = tl.exp2(z * LOG2E - lse_log2e[:, None]) * coef[:, None]
            g = tl.where(real[None, :], g, 0.0)
            out = _grad_out(g, dlogits_ptr, GRAD_FP8, SOFT_ROUND, SOFT_ROUND_BF16, FP8_BITS, MANT, EMIN, SUB_C, MIN_NORMAL)
            tl.store(grad_rows + cols[None, :], out, mask=row_ok[:, None] & in_row[None, :])
            if STORE_T:
                tl.store(dlogits_t_ptr + cols[None, :].to(tl.int64) * stride_dlogits_t + rows[:, None], out,
                         mask=row_ok[:, None] & in_row[None, :])
            start += BLOCK_V

        # Sparse correction: rewrite each target column with its full value.  A column hit by several
        # terms gets the same value from each (idempotent).  The barrier orders these stores after
        # the dense ones of other threads in this program.
        tl.debug_barrier()
        for j in tl.static_range(N_PREDICT + HAS_PREFIX):
            if j < N_PREDICT:
                col = tl.load(targets_ptr + rows + j, mask=row_ok & (rows + j < n_targets), other=-1).to(tl.int64)
            else:
                col = pt
            ok = row_ok & (col >= 0) & (col < vocab_size)
            hit = tl.zeros([BLOCK_M], tl.float32)
            for k in tl.static_range(N_PREDICT):
                t = tl.load(targets_ptr + rows + k, mask=row_ok & (rows + k < n_targets), other=-1).to(tl.int64)
                hit += tl.where(t == col, tl.load(mtp_w_ptr + k), 0.0)
            if HAS_PREFIX:
                hit += tl.where(pt == col, pw, 0.0)
            z = tl.load(logits_ptr + rows * stride_logits + col, mask=ok, other=0.0).to(tl.float32)
            if SOFTCAP:
                u = _softcap_u(z, k1, k2, SIGMOID_TANH, TANH_ASM)
                p = tl.exp2(u * a_log2e - lse_log2e)
                g = (weight_sum * p - hit) * (u - u * u) * (a_over_c * grad_mult)
            else:
                g = (weight_sum * tl.exp2(z * LOG2E - lse_log2e) - hit) * grad_mult
            out = _grad_out(g, dlogits_ptr, GRAD_FP8, SOFT_ROUND, SOFT_ROUND_BF16, FP8_BITS, MANT, EMIN, SUB_C, MIN_NORMAL)
            tl.store(dlogits_ptr + rows * stride_dlogits + col, out, mask=ok)
            if STORE_T:
                tl.store(dlogits_t_ptr + col * stride_dlogits_t + rows, out, mask=ok)
        row_block += tl.num_programs(0)


@triton.jit
def _transpose_bytes_kernel(src_ptr, dst_ptr, n_rows, n_cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # dst (n_cols, n_rows) = src (n_rows, n_cols)^T, both contiguous, one byte per element; the
    # compiler stages the tile through shared memory so both sides are coalesced.
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
    tile = tl.load(src_ptr + r[:, None] * n_cols + c[None, :], mask=mask)
    tl.store(dst_ptr + c[None, :] * n_rows + r[:, None], tile, mask=mask)


def transpose_fp8(x: torch.Tensor) -> torch.Tensor:
    """Contiguous transpose of a contiguous 2-D FP8 (or any 1-byte) tensor: (R, C) -> (C, R).

    Triton on CUDA or under the interpreter (torch's strided copy of 1-byte types runs at a small
    fraction of bandwidth), ``x.t().contiguous()`` elsewhere.
    """
    if x.dim() != 2 or x.element_size() != 1 or not x.is_contiguous():
        raise ValueError(f"transpose_fp8 needs a contiguous 2-D 1-byte tensor, got {x.dtype} {tuple(x.shape)}")
    if not (x.is_cuda or interpreting()) or x.numel() == 0:
        return x.t().contiguous()
    r, c = x.shape
    out = torch.empty((c, r), dtype=x.dtype, device=x.device)
    block_r, block_c = 64, 128
    with launch_note("_transpose_bytes_kernel", reads=(x,), writes=(out,)):
        launch(_transpose_bytes_kernel, (cdiv(r, block_r), cdiv(c, block_c)),
            x.view(torch.uint8), out.view(torch.uint8), r, c, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4
        )
    return out


@triton.jit
def _scale_rows_kernel(x_ptr, s_ptr, n_rows, n_cols, ROUND_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    # x[r, :] = x[r, :] * s[r] in place, the fp32 product rounded once to x's dtype
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r[:, None] < n_rows) & (c[None, :] < n_cols)
    ptrs = x_ptr + r[:, None] * n_cols + c[None, :]
    v = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * tl.load(s_ptr + r, mask=r < n_rows, other=0.0)[:, None]
    # ROUND_BF16: the interpreter's fp32 -> bf16 cast truncates, so round to nearest even first
    tl.store(ptrs, _grad_cast(v, x_ptr, False, False, ROUND_BF16), mask=mask)


def _check_scale_rows(x: torch.Tensor, row_scale: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or not x.is_contiguous() or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: x must be a contiguous 2-D bf16/fp16 tensor, got {x.dtype} {tuple(x.shape)}")
    if (row_scale.dtype != torch.float32 or tuple(row_scale.shape) != (x.shape[0],) or not row_scale.is_contiguous()
            or row_scale.device != x.device):
        raise ValueError(f"{name}: row_scale must be a contiguous fp32 ({x.shape[0]},) tensor on {x.device}, got "
                         f"{row_scale.dtype} {tuple(row_scale.shape)} on {row_scale.device}")


def scale_rows_(x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """``x[i, :] *= row_scale[i]`` in place, the product in fp32 rounded once to x's dtype: the
    per-token loss gradient applied to the head's dX (one read and one write of x; eager torch
    took three passes and two fp32 temporaries).

    x: (N, D) contiguous bf16/fp16; row_scale: (N,) contiguous fp32.  Returns x.  Triton on CUDA
    or under the interpreter, else :func:`scale_rows_reference_` (same bits)."""
    _check_scale_rows(x, row_scale, "scale_rows_")
    if not (x.is_cuda or interpreting()) or x.numel() == 0:
        return scale_rows_reference_(x, row_scale)
    n, d = x.shape
    block_r, block_c = 16, min(256, next_pow2(d))
    with launch_note("_scale_rows_kernel", reads=(x, row_scale), writes=(x,)):
        launch(_scale_rows_kernel, (cdiv(n, block_r), cdiv(d, block_c)), x, row_scale, n, d,
               ROUND_BF16=interpreting() and x.dtype == torch.bfloat16, BLOCK_R=block_r, BLOCK_C=block_c,
               num_warps=4)
    return x


def scale_rows_reference_(x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch reference of :func:`scale_rows_` (same signature, same bits)."""
    _check_scale_rows(x, row_scale, "scale_rows_reference_")
    return x.copy_((x.float() * row_scale[:, None]).to(x.dtype))


_GRAD_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e5m2)


def hardware_tanh(device: torch.device) -> bool:
    """Whether the kernel can use PTX ``tanh.approx.f32`` on ``device``: an NVIDIA GPU of compute
    capability >= 7.5 (not ROCm, not the interpreter).  Elsewhere ``sigmoid="tanh"`` runs the same
    identity with an exact tanh (no faster than ``"exact"``, and as accurate)."""
    if interpreting() or device.type != "cuda" or torch.version.hip is not None:
        return False
    return cuda_capability(device) >= (7, 5)


# Rows per program and vocabulary chunk when the kernel also writes the transposed gradient: each
# vocabulary row of a tile gets BLOCK_M consecutive bytes (e5m2), so 32 rows fill a 32-byte
# sector.  Not tuned on a GPU yet (benchmarks/bench_cross_entropy.py --sweep-transposed).
TRANSPOSED_BLOCK_M = 32
TRANSPOSED_BLOCK_V = 128


def _default_block_v(n_cols: int) -> int:
    # H200, N=49152, V=50304, e5m2 out (benchmarks/bench_cross_entropy.py --sweep): 1024 columns
    # x 4 warps and 512 x 2 warps tie for fastest; 4096 x 8 warps is slower; 2 rows per program no better.
    return min(1024, next_pow2(max(n_cols, 16)))


def softcapped_ce_fwd_bwd(
    logits: torch.Tensor,
    targets: torch.Tensor,
    mtp_weights: torch.Tensor | Sequence[float] = (1.0,),
    prefix_targets: torch.Tensor | None = None,
    prefix_weight: float | torch.Tensor = 0.0,
    *,
    softcap: tuple[float, float, float] | None = DEFAULT_SOFTCAP,
    vocab_size: int | None = None,
    grad_out_scale: float = 1.0,
    grad_dtype: torch.dtype | None = None,
    losses_out: torch.Tensor | None = None,
    dlogits_out: torch.Tensor | None = None,
    dlogits_t_out: torch.Tensor | None = None,
    check_targets: bool | None = None,
    block_v: int | None = None,
    block_m: int | None = None,
    num_warps: int = 4,
    max_programs: int | None = None,
    sigmoid: str = "exact",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token loss and its logits gradient in one Triton pass (forward and backward together).

    ``logits``: (N, V_pad) bf16/fp16/fp32 with unit column stride; targets etc. as in the module
    docstring.  Returns ``(losses, dlogits)``: losses (N,) fp32 in nats; dlogits (N, V_pad) in
    ``grad_dtype`` (default ``logits.dtype``; ``torch.float8_e5m2`` for the FP8 head, saturating at
    +-57344) holding ``grad_out_scale * d(sum_t loss_t)/d logits`` -- zero in padded columns.
    ``losses_out`` / ``dlogits_out`` are optional preallocated outputs (contiguous).
    ``dlogits_t_out``: (V_pad, N) contiguous in ``grad_dtype``; when given, the kernel writes the
    gradient's transpose there too (same bits), the layout the head's weight-gradient GEMM reads,
    instead of a separate transpose pass reading dlogits back.  Its stores are coalesced when a
    program owns many rows: ``block_m`` then defaults to ``TRANSPOSED_BLOCK_M``.
    ``check_targets``: verify id ranges on the host (None: only for CPU tensors, where it is free).
    ``block_v``: vocabulary chunk per loop step (power of two), default min(1024, V_pad);
    ``block_m``: rows per program (power of two), default 1 (64 under the interpreter);
    ``num_warps``: Triton warps per program.
    ``max_programs``: at most this many programs, each looping over row blocks (a persistent grid:
    fewer rows in flight, so the second pass over a row can hit L2); None = one program per block.
    ``sigmoid``: "exact" or "tanh" (the hardware's approximate tanh where :func:`hardware_tanh`
    says so, else an exact tanh through the same identity).
    """
    vocab_size = _check_logits(logits, vocab_size)
    if sigmoid not in SIGMOID_CHOICES:
        raise ValueError(f"sigmoid must be one of {SIGMOID_CHOICES}, got {sigmoid!r}")
    if logits.device.type != "cuda" and not interpreting():
        raise ValueError("softcapped_ce_fwd_bwd: the Triton kernel needs a CUDA tensor or TRITON_INTERPRET=1 "
                         "(set before import); use softcapped_ce_fwd_bwd_reference on this device")
    _check_softcap(softcap)
    n, v_pad = logits.shape
    _check_targets(n, targets, prefix_targets, vocab_size, check_targets)
    grad_dtype = logits.dtype if grad_dtype is None else grad_dtype
    if grad_dtype not in _GRAD_DTYPES:
        raise ValueError(f"grad_dtype must be one of {_GRAD_DTYPES}, got {grad_dtype}")
    device = logits.device
    for name, t in (("targets", targets), ("prefix_targets", prefix_targets)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but logits are on {device}")
    w = _weights_tensor(mtp_weights, device, "mtp_weights")
    if w.numel() < 1:
        raise ValueError("mtp_weights needs at least one entry (the next-token weight)")
    pw = _prefix_weight_tensor(prefix_weight, device)

    if losses_out is None:
        losses_out = torch.empty(n, dtype=torch.float32, device=device)
    elif losses_out.shape != (n,) or losses_out.dtype != torch.float32 or not losses_out.is_contiguous():
        raise ValueError(f"losses_out must be a contiguous fp32 tensor of shape ({n},)")
    if dlogits_out is None:
        dlogits_out = torch.empty((n, v_pad), dtype=grad_dtype, device=device)
    elif dlogits_out.shape != (n, v_pad) or dlogits_out.dtype != grad_dtype or dlogits_out.stride(1) != 1:
        raise ValueError(f"dlogits_out must be {grad_dtype} of shape ({n}, {v_pad}) with unit column stride")
    _check_transposed_out(dlogits_t_out, (n, v_pad), grad_dtype)
    if dlogits_t_out is not None and dlogits_out.stride(0) != v_pad:
        raise ValueError("dlogits_out must be contiguous when dlogits_t_out is given")
    if n == 0:
        return losses_out, dlogits_out

    store_t = dlogits_t_out is not None
    if block_v is None:
        block_v = _default_block_v(v_pad)
        if store_t and not interpreting():
            block_v = min(block_v, TRANSPOSED_BLOCK_V)
    block_v = int(block_v)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    if block_m is None:
        # The interpreter pays per operation, not per element: whole-batch tiles keep tests fast.
        block_m = min(64, next_pow2(n)) if interpreting() else (TRANSPOSED_BLOCK_M if store_t else 1)
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 1, got {block_m}")
    if max_programs is not None and max_programs < 1:
        raise ValueError(f"max_programs must be >= 1 or None, got {max_programs}")
    row_blocks = cdiv(n, block_m)
    programs = row_blocks if max_programs is None else min(row_blocks, int(max_programs))
    a, b, c = softcap if softcap is not None else (1.0, 0.0, 1.0)
    if softcap is not None and a > 64:
        raise ValueError(f"softcap A={a} is too large for the kernel's fixed softmax offset (A <= 64)")
    # Both layouts of an e5m2 gradient go out as integer-made bytes through uint8 views (_grad_out).
    fp8_bits = store_t and grad_dtype == torch.float8_e5m2
    grad_arg = dlogits_out.view(torch.uint8) if fp8_bits else dlogits_out
    grad_t_arg = (dlogits_t_out.view(torch.uint8) if fp8_bits else dlogits_t_out) if store_t else grad_arg
    with launch_note("_ce_fwd_bwd_kernel", reads=(logits, targets, prefix_targets),
                     writes=(dlogits_out, dlogits_t_out, losses_out)):
        launch(_ce_fwd_bwd_kernel, (programs,),
            logits,
            logits.stride(0),
            grad_arg,
            dlogits_out.stride(0),
            grad_t_arg,
            n,
            losses_out,
            targets,
            n,
            targets.shape[0],
            w,
            prefix_targets if prefix_targets is not None else targets,
            pw,
            v_pad,
            vocab_size,
            float(a),
            -_LOG2E / float(c),
            -float(b) * _LOG2E / float(c),
            float(a) / float(c),
            float(grad_out_scale),
            row_blocks,
            N_PREDICT=w.numel(),
            HAS_PREFIX=prefix_targets is not None,
            SOFTCAP=softcap is not None,
            GRAD_FP8=grad_dtype == torch.float8_e5m2,
            SOFT_ROUND=interpreting(),
            SOFT_ROUND_BF16=interpreting() and grad_dtype == torch.bfloat16,
            SIGMOID_TANH=sigmoid == "tanh",
            TANH_ASM=sigmoid == "tanh" and hardware_tanh(device),
            STORE_T=store_t,
            FP8_BITS=fp8_bits,
            **grid_constants(torch.float8_e5m2),  # MANT, EMIN, SUB_C, MIN_NORMAL of FP8_BITS
            BLOCK_M=block_m,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    return losses_out, dlogits_out


# ----------------------------------------------------------------------------------------------
# The whole head: GEMM + CE forward, GEMM backward


def _check_head_inputs(x: torch.Tensor, weight: torch.Tensor, vocab_size: int | None) -> int:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"x must be (N, D) and weight (D, V_pad); got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if x.shape[1] != weight.shape[0]:
        raise ValueError(
            f"weight must be laid out (D, V_pad) = ({x.shape[1]}, V_pad) to match x {tuple(x.shape)}, "
            f"got {tuple(weight.shape)} (the record's transposed lm_head layout)"
        )
    for name, t in (("x", x), ("weight", weight)):
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{name} must be bf16, fp16 or fp32, got {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight on {weight.device}")
    v_pad = weight.shape[1]
    vocab_size = v_pad if vocab_size is None else int(vocab_size)
    if not 0 < vocab_size <= v_pad:
        raise ValueError(f"vocab_size={vocab_size} must lie in [1, {v_pad}] (weight's V_pad)")
    return vocab_size


def _ce_impl(backend: str, device: torch.device):
    if backend == "auto":  # the Triton kernel where it can run (CUDA, or CPU under the interpreter)
        backend = "triton" if (device.type == "cuda" or interpreting()) else "reference"
    if backend == "triton":
        return softcapped_ce_fwd_bwd
    if backend == "reference":
        return softcapped_ce_fwd_bwd_reference
    raise ValueError(f"ce_backend must be 'auto', 'triton' or 'reference', got {backend!r}")


@dataclass(frozen=True)
class HeadFP8Weight:
    """The FP8 head weight of one optimizer update (static scale, so it depends on the weight only).

    ``data``: (D, V_pad) e4m3 row-major (the dX GEMM's operand); ``data_cm``: the same values as a
    (D, V_pad) column-major view of a (V_pad, D) buffer (the forward GEMM's B); ``scale``: the real
    value of one e4m3 unit (``w_scale``).  Made by :func:`quantize_head_weight`."""

    data: torch.Tensor
    data_cm: torch.Tensor
    scale: float


def quantize_head_weight(weight: torch.Tensor, w_scale: float = W_SCALE,
                         out: HeadFP8Weight | None = None) -> HeadFP8Weight:
    """Quantise the head weight (D, V_pad) once, in both layouts, exactly as the FP8 head's forward
    does per call.  The model caches it per optimizer update: 8 micro-batches then quantise the
    (768, 50304) weight once instead of 8 times (4 passes over it each).  ``out``: a previous
    result of the same shape and scale, rewritten in place and returned (its tensors keep their
    addresses, as code captured in a CUDA graph needs)."""
    w_f8 = quantize_tensorwise(weight.detach(), float(w_scale), torch.float8_e4m3fn)
    if out is None:
        return HeadFP8Weight(w_f8, w_f8.t().contiguous().t(), float(w_scale))
    if out.data.shape != w_f8.shape or out.scale != float(w_scale):
        raise ValueError(f"quantize_head_weight: out holds a {tuple(out.data.shape)} weight at scale {out.scale}, "
                         f"asked for {tuple(w_f8.shape)} at {float(w_scale)}")
    out.data.copy_(w_f8)
    out.data_cm.copy_(w_f8)  # a column-major view: copy_ writes through its strides
    return out


_SCALE_TENSORS: dict[tuple[float, torch.device], torch.Tensor] = {}


def _static_scale(value: float, device: torch.device) -> torch.Tensor:
    """A 0-d fp32 tensor holding the static ``value`` on ``device``, made once (not a fill kernel
    per call)."""
    key = (float(value), torch.device(device))
    t = _SCALE_TENSORS.get(key)
    if t is None:
        t = _SCALE_TENSORS[key] = to_scale_tensor(float(value), key[1])
    return t


def _fp8_kernel_shape(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] % 16 == 0 and x.shape[1] % 16 == 0 and x.is_contiguous()


def _quantize_x(x: torch.Tensor, x_scale: float) -> torch.Tensor:
    """e4m3 x (N, D) with the head's static scale: one Triton pass (:func:`quantize_static`) where
    the shape allows (N, D multiples of 16), else the eager ``quantize_tensorwise``."""
    if _fp8_kernel_shape(x):
        return quantize_static(x, _static_scale(x_scale, x.device))
    return quantize_tensorwise(x, x_scale, torch.float8_e4m3fn)


def _quantize_rows_scaled_x_t(x: torch.Tensor, go: torch.Tensor, xg_scale: torch.Tensor) -> torch.Tensor:
    """``((x ⊙ go) / xg_scale)ᵀ`` as contiguous e4m3 (D, N): one Triton pass
    (:func:`quantize_rows_scaled_t`) where the shape allows, else eager ops.  go: (N, 1) fp32."""
    if _fp8_kernel_shape(x):
        return quantize_rows_scaled_t(x, go.reshape(-1).contiguous(), xg_scale.reshape(()))
    return quantize_tensorwise((x.float() * go).t(), xg_scale, torch.float8_e4m3fn).contiguous()


class FusedSoftcappedCE(torch.autograd.Function):
    """Autograd Function behind :func:`fused_softcapped_ce` (positional arguments in its order)."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        targets,
        mtp_weights,
        prefix_targets,
        prefix_weight,
        use_fp8,
        vocab_size,
        softcap,
        x_scale,
        w_scale,
        grad_unit_scale,
        ce_backend,
        fp8_weight,
        sigmoid,
        grad_layout,
    ):
        ce = _ce_impl(ce_backend, x.device)
        if use_fp8:
            x_f8 = _quantize_x(x, x_scale)
            if fp8_weight is None:
                fp8_weight = quantize_head_weight(weight, w_scale)
            w_f8 = fp8_weight.data  # (D, V) row-major
            # FP8 tensor cores want B column-major: the cached transposed copy.
            logits = scaled_mm(x_f8, fp8_weight.data_cm, x_scale, w_scale, torch.bfloat16, use_fast_accum=True)
            # grad_layout "dual": the CE kernel also writes the transposed gradient that the weight
            # GEMM reads (else the backward transposes dlogits: one more read of it)
            dlogits_t = (torch.empty(logits.shape[::-1], dtype=torch.float8_e5m2, device=logits.device)
                         if grad_layout == "dual" else None)
            losses, dlogits = ce(
                logits, targets, mtp_weights, prefix_targets, prefix_weight, softcap=softcap,
                vocab_size=vocab_size, grad_out_scale=1.0 / grad_unit_scale, grad_dtype=torch.float8_e5m2,
                dlogits_t_out=dlogits_t, sigmoid=sigmoid,
            )
            ctx.save_for_backward(x, w_f8, dlogits, dlogits_t)
        else:
            logits = x @ weight
            losses, dlogits = ce(
                logits, targets, mtp_weights, prefix_targets, prefix_weight, softcap=softcap,
                vocab_size=vocab_size, grad_out_scale=1.0, grad_dtype=x.dtype, sigmoid=sigmoid,
            )
            ctx.save_for_backward(x, weight, dlogits, None)
        del logits
        ctx.use_fp8 = use_fp8
        ctx.scales = (x_scale, w_scale, grad_unit_scale)
        ctx.weight_dtype = weight.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        x, w_saved, dlogits, dlogits_t = ctx.saved_tensors
        x_scale, w_scale, g_unit = ctx.scales
        # contiguous: the usual grad_output is a scalar expanded over the rows (stride 0)
        go = grad_losses.float().reshape(-1, 1).contiguous()
        dx = dw = None
        if ctx.use_fp8:
            if ctx.needs_input_grad[0]:
                # w_f8 is (D, V) row-major, so its .t() is the column-major B this GEMM needs.
                dx = scaled_mm(dlogits, w_saved.t(), g_unit, w_scale, x.dtype, use_fast_accum=False)
                dx = _scale_dx_rows(dx, go)
            if ctx.needs_input_grad[1]:
                # Fold the per-row grad_output into x; scaling by its max keeps the e4m3 range of
                # the forward quantisation when grad_output is uniform (the usual loss.sum()*c).
                amax = go.abs().amax().clamp_min(1e-30)
                xg_scale = amax * x_scale
                xg_t = _quantize_rows_scaled_x_t(x, go, xg_scale)
                # K-major for cuBLAS: the kernel's transposed copy, or a transpose now (as upstream)
                d_col = (dlogits_t if dlogits_t is not None else transpose_fp8(dlogits)).t()
                dw = scaled_mm(xg_t, d_col, xg_scale, g_unit, ctx.weight_dtype, use_fast_accum=False)
        else:
            if ctx.needs_input_grad[0]:
                dx = _scale_dx_rows(dlogits @ w_saved.t(), go)
            if ctx.needs_input_grad[1]:
                dw = ((x.float() * go).to(x.dtype).t() @ dlogits).to(ctx.weight_dtype)
        return dx, dw, None, None, None, None, None, None, None, None, None, None, None, None, None, None


def _scale_dx_rows(dx: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
    """dX rows times the per-token loss gradient ``go`` (N, 1) fp32, one rounding to dX's dtype."""
    if dx.dtype in (torch.bfloat16, torch.float16) and dx.is_contiguous():
        return scale_rows_(dx, go.reshape(-1))
    return (dx.float() * go).to(dx.dtype)


def fused_softcapped_ce(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mtp_weights: torch.Tensor | Sequence[float] = (1.0,),
    prefix_targets: torch.Tensor | None = None,
    prefix_weight: float | torch.Tensor = 0.0,
    *,
    use_fp8: bool = False,
    vocab_size: int | None = None,
    softcap: tuple[float, float, float] | None = DEFAULT_SOFTCAP,
    x_scale: float = X_SCALE,
    w_scale: float = W_SCALE,
    grad_unit_scale: float = GRAD_UNIT_SCALE,
    ce_backend: str = "auto",
    fp8_weight: HeadFP8Weight | None = None,
    sigmoid: str = "exact",
    grad_layout: str = "transpose",
) -> torch.Tensor:
    """Training loss head: per-token losses (N,) fp32 from hidden states ``x`` and head ``weight``.

    ``x``: (N, D) bf16 (fp16/fp32 allowed off the FP8 path), contiguous; ``weight``: (D, V_pad),
    contiguous, same dtype (the record's lm_head (768, 50304)); ``vocab_size``: real vocabulary
    (record 50257), columns beyond it are masked.  ``use_fp8``: e4m3 forward GEMM with static
    scales ``x_scale``/``w_scale``, dlogits stored as e5m2 in units of ``grad_unit_scale``, and FP8
    backward GEMMs; on devices without FP8 tensor cores the GEMMs are emulated exactly in fp32
    (see :mod:`speedrun.kernels.fp8_ops`).  On CUDA the FP8 path needs N, D, V_pad divisible by 16.

    Forward also computes ``dlogits`` (kept for backward, N*V_pad elements: 2.5 GB in e5m2 at
    N=49152), so backward is only the dX and dW GEMMs; ``grad_output`` is honoured per row.
    Gradients flow to ``x`` and ``weight`` only.  ``ce_backend``: "triton" (the fused kernel),
    "reference" (its PyTorch reference, for tests) or "auto" (Triton on CUDA and under
    ``TRITON_INTERPRET=1``, else the reference).  ``fp8_weight``: ``weight`` already quantised by
    :func:`quantize_head_weight` (with ``w_scale``) for this optimizer update, or None to quantise
    it in this call; the caller guarantees it represents ``weight`` (gradients still go to ``weight``).
    ``sigmoid``: the CE kernel's softcap sigmoid (see :func:`softcapped_ce_fwd_bwd`);
    ``grad_layout``: "transpose" or "dual" (the FP8 path's dW operand, see the module constants).
    """
    if sigmoid not in SIGMOID_CHOICES:
        raise ValueError(f"sigmoid must be one of {SIGMOID_CHOICES}, got {sigmoid!r}")
    if grad_layout not in GRAD_LAYOUT_CHOICES:
        raise ValueError(f"grad_layout must be one of {GRAD_LAYOUT_CHOICES}, got {grad_layout!r}")
    vocab_size = _check_head_inputs(x, weight, vocab_size)
    if fp8_weight is not None:
        if not use_fp8:
            raise ValueError("fused_softcapped_ce: fp8_weight is only used with use_fp8=True")
        if tuple(fp8_weight.data.shape) != tuple(weight.shape) or fp8_weight.scale != float(w_scale):
            raise ValueError(f"fused_softcapped_ce: fp8_weight {tuple(fp8_weight.data.shape)} with scale "
                             f"{fp8_weight.scale} does not match weight {tuple(weight.shape)} with w_scale {w_scale}")
    _check_softcap(softcap)
    if use_fp8 and x.device.type == "cuda":
        n, d = x.shape
        if n % 16 or d % 16 or weight.shape[1] % 16:
            raise ValueError(
                f"the FP8 head needs N, D and V_pad divisible by 16 on CUDA, got N={n}, D={d}, V_pad={weight.shape[1]}"
            )
    softcap = None if softcap is None else tuple(float(v) for v in softcap)
    return FusedSoftcappedCE.apply(
        x, weight, targets, mtp_weights, prefix_targets, prefix_weight, bool(use_fp8), vocab_size,
        softcap, float(x_scale), float(w_scale), float(grad_unit_scale), ce_backend, fp8_weight, sigmoid, grad_layout,
    )


class _FakeQuantE4M3(torch.autograd.Function):
    """Quantise-dequantise to e4m3 with a straight-through gradient (the FP8 reference's model)."""

    @staticmethod
    def forward(ctx, t, scale):
        return quantize_tensorwise(t, scale, torch.float8_e4m3fn).float() * scale

    @staticmethod
    def backward(ctx, g):
        return g, None


def fused_softcapped_ce_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    mtp_weights: torch.Tensor | Sequence[float] = (1.0,),
    prefix_targets: torch.Tensor | None = None,
    prefix_weight: float | torch.Tensor = 0.0,
    *,
    use_fp8: bool = False,
    vocab_size: int | None = None,
    softcap: tuple[float, float, float] | None = DEFAULT_SOFTCAP,
    x_scale: float = X_SCALE,
    w_scale: float = W_SCALE,
    grad_unit_scale: float = GRAD_UNIT_SCALE,
    ce_backend: str = "auto",
) -> torch.Tensor:
    """Reference for :func:`fused_softcapped_ce` (same signature) by plain autograd.

    bf16: ``logits = x @ weight`` in the input dtype, then the reference loss.  FP8: x and W are
    quantised to e4m3 and dequantised (straight-through gradient), multiplied in fp32 and rounded
    to bf16 -- the forward of the fused path exactly -- while the backward is exact (no e5m2
    rounding of dlogits, no FP8 backward GEMMs): it is the gradient the FP8 path approximates.
    ``grad_unit_scale`` and ``ce_backend`` are accepted for signature parity and unused.
    """
    vocab_size = _check_head_inputs(x, weight, vocab_size)
    if use_fp8:
        xq = _FakeQuantE4M3.apply(x, x_scale)
        wq = _FakeQuantE4M3.apply(weight, w_scale)
        logits = (xq @ wq).to(torch.bfloat16)
    else:
        logits = x @ weight
    return softcapped_multitoken_ce_reference(
        logits, targets, mtp_weights, prefix_targets, prefix_weight, softcap, vocab_size
    )


# ----------------------------------------------------------------------------------------------
# Validation loss


def softcapped_ce_eval(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    vocab_size: int | None = None,
    softcap: tuple[float, float, float] | None = DEFAULT_SOFTCAP,
    chunk_rows: int = 8192,
) -> torch.Tensor:
    """Validation loss: per-token fp32 next-token CE (no MTP, no prefix term).

    ``x``: (N, D); ``weight``: (D, V_pad); ``targets``: (N,) ids, ``-1`` gives loss 0 (ignored).
    Logits come from a GEMM in the input dtype (bf16 in training), are softcapped in fp32 and fed
    to ``F.cross_entropy`` with padded columns masked.  Rows go ``chunk_rows`` at a time so the
    fp32 logits never exceed ``chunk_rows * V_pad * 4`` bytes.  Returns (N,) fp32 nats.
    """
    vocab_size = _check_head_inputs(x, weight, vocab_size)
    _check_softcap(softcap)
    if targets.dim() != 1 or targets.shape[0] != x.shape[0]:
        raise ValueError(f"targets must be (N,) = ({x.shape[0]},), got {tuple(targets.shape)}")
    _check_targets(x.shape[0], targets, None, vocab_size, None)
    out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], max(1, int(chunk_rows))):
        end = min(start + chunk_rows, x.shape[0])
        s = _softcap((x[start:end] @ weight).float(), softcap)
        if vocab_size < s.shape[1]:
            pad = torch.arange(s.shape[1], device=s.device) >= vocab_size
            s = s.masked_fill(pad, float("-inf"))
        out[start:end] = F.cross_entropy(s, targets[start:end].long(), reduction="none", ignore_index=-1)
    return out
