"""The record's Adam update as one Triton pass: read p, grad, exp_avg, exp_avg_sq once, write p
and both moments once.

:func:`speedrun.optim.adam.adam_update_` (the reference, same signature) runs the update as ~13
eager element-wise kernels that move ~130 bytes per bf16 parameter; this kernel moves 22 (2 + 2 +
4 + 4 read, 2 + 4 + 4 written).  The record's Adam tables hold ~560 M elements (lm_head and embed
38.6 M each, value embeddings 193 M, bigram table 290 M), updated on odd steps: ~73 GB of traffic
per update in the reference against ~12 GB here.

The arithmetic follows the reference operation by operation in fp32 (``lerp`` with torch's
two-sided formula, correctly rounded ``sqrt`` and division).  The two ``addcmul``s (second moment,
cautious decay) are torch's ``a + value * (b * c)``, which nvcc contracts into one FMA; a Triton
compiler free to contract as it chooses came within 4 fp32 ulps, so the GPU build spells the
roundings out with libdevice (``mul_rn``, ``fma_rn``).  On the H200 (3 steps at the record's
table shapes, tests/gpu/test_fused_adam_gpu.py): exp_avg, exp_avg_sq and p **bit-equal** to the eager
reference (with ``fma(value * b, c, a)`` instead, 14% of exp_avg_sq differed).  The interpreter has
no libdevice: on the CPU the tests bound the moments at a few fp32 ulps and p at a few ulps of
its dtype.

Dispatch: :func:`speedrun.optim.adam.adam_update_auto_` (what NorMuonAndAdam calls) takes this kernel for contiguous
CUDA tensors and the reference otherwise; ``use_triton=True`` forces the kernel (on CPU tensors
under ``TRITON_INTERPRET=1``, as the tests do).  Importing needs no GPU.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from speedrun.kernels._triton import launch
from speedrun.kernels.launch_notes import launch_note

try:  # optional on CPU installs: the optimizer then runs the reference (fp8_cache needs Triton)
    import triton
    import triton.language as tl

    from triton.language.extra import libdevice

    from speedrun.kernels._triton import cdiv, interpreting

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - CPU installs without triton use the reference
    triton = None
    tl = None
    _HAVE_TRITON = False

__all__ = ["adam_scalars", "adam_update_fused_", "adam_apply_fused_", "fused_adam_supported"]

_BLOCK = 1024  # elements per program: 8 fp32 loads of 4 per thread at 4 warps, enough in flight
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

if _HAVE_TRITON:

    @triton.jit
    def _adam_update_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, one_minus_beta1, beta2, one_minus_beta2,
                            eps, step_size, decay, BLOCK: tl.constexpr, EXACT_ROUNDING: tl.constexpr,
                            SCALARS_IN_MEMORY: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if SCALARS_IN_MEMORY:  # fp32 device scalars (a captured step reads this step's values)
            step_size = tl.load(step_size)
            decay = tl.load(decay)
        p_raw = tl.load(p_ptr + offs, mask=mask, other=0.0)
        p = p_raw.to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        # torch.lerp(m, g, w): m + w * (g - m) for |w| < 0.5, else g - (g - m) * (1 - w), w in fp32
        diff = g - m
        m = tl.where(one_minus_beta1 < 0.5, m + one_minus_beta1 * diff, g - diff * (1.0 - one_minus_beta1))
        # v.mul_(beta2).addcmul_(g, g, value=1 - beta2): two eager kernels on CUDA, the first
        # rounding v * beta2, the second computing a + value * (b * c) in fp32, which nvcc
        # contracts to fma(value, b * c, a).  The GPU build spells those roundings out (the
        # compiler would otherwise contract as it chooses); the interpreter has no libdevice.
        if EXACT_ROUNDING:
            v = libdevice.fma_rn(one_minus_beta2, libdevice.mul_rn(g, g), libdevice.mul_rn(v, beta2))
        else:
            v = v * beta2
            v = v + one_minus_beta2 * (g * g)
        update = tl.sqrt_rn(v) + eps
        update = tl.div_rn(m, update) * step_size
        # cautious decay: only where the update and the weight agree in sign
        keep = (update * p) > 0
        # update.addcmul_(p, keep, value=decay): a + value * (b * c), one rounding after the FMA
        if EXACT_ROUNDING:
            update = libdevice.fma_rn(decay, tl.where(keep, p, 0.0), update)
        else:
            update = update + tl.where(keep, decay * p, 0.0)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(p_ptr + offs, (p - update).to(p_raw.dtype), mask=mask)


def fused_adam_supported(p: Tensor, grad: Tensor) -> bool:
    """Whether :func:`adam_update_fused_` can take these tensors here: Triton present, contiguous
    tensors of a supported dtype, on CUDA (or on the CPU under ``TRITON_INTERPRET=1``)."""
    if not _HAVE_TRITON or p.dtype not in _DTYPES or grad.dtype not in _DTYPES:
        return False
    if not (p.is_contiguous() and grad.is_contiguous()):
        return False
    return p.is_cuda != interpreting()


def adam_scalars(step: int, *, lr: float, betas: tuple[float, float], weight_decay: float) -> tuple[float, float]:
    """The two values of Adam step ``step`` (1-based) that change from step to step, computed on
    the host in float64: the bias-corrected step size ``lr * sqrt(1 - beta2**t) / (1 - beta1**t)``
    and the cautious decay's factor ``lr**2 * weight_decay``."""
    beta1, beta2 = betas
    return lr * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step), lr * lr * weight_decay


@torch.no_grad()
def adam_update_fused_(
    p: Tensor,
    grad: Tensor,
    state: dict,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> Tensor:
    """One Adam step on ``p`` in place in one kernel; returns ``p``.  Arguments as
    :func:`speedrun.optim.adam.adam_update_` (the reference): p contiguous fp32/bf16/fp16, grad
    contiguous of p's shape (any of those dtypes), state's ``exp_avg`` / ``exp_avg_sq``
    contiguous fp32 of p's shape; lr, eps and weight_decay plain floats."""
    state["step"] += 1
    step_size, decay = adam_scalars(state["step"], lr=lr, betas=betas, weight_decay=weight_decay)
    return adam_apply_fused_(p, grad, state["exp_avg"], state["exp_avg_sq"], betas=betas, eps=eps,
                             step_size=step_size, decay=decay)


@torch.no_grad()
def adam_apply_fused_(p: Tensor, grad: Tensor, m: Tensor, v: Tensor, *, betas: tuple[float, float], eps: float,
                      step_size: float | Tensor, decay: float | Tensor) -> Tensor:
    """The kernel behind :func:`adam_update_fused_`, with the step's scalars given (see
    :func:`speedrun.optim.adam.adam_apply_`): floats, or 0-d fp32 tensors on p's device that the
    kernel reads when it runs (so a CUDA graph of it takes each step's values)."""
    if p.shape != grad.shape or p.shape != m.shape or p.shape != v.shape:
        raise ValueError(f"adam_update_fused_: p {tuple(p.shape)}, grad {tuple(grad.shape)} and state "
                         f"{tuple(m.shape)} / {tuple(v.shape)} must have the same shape")
    if m.dtype != torch.float32 or v.dtype != torch.float32:
        raise ValueError(f"adam_update_fused_: the moments must be fp32, got {m.dtype} / {v.dtype}")
    if not (fused_adam_supported(p, grad) and m.is_contiguous() and v.is_contiguous()):
        raise ValueError("adam_update_fused_: needs Triton, contiguous fp32/bf16/fp16 tensors and a CUDA "
                         "device (or CPU tensors under TRITON_INTERPRET=1); use adam_update_ otherwise")
    if len({p.device, grad.device, m.device, v.device}) != 1:
        raise ValueError("adam_update_fused_: p, grad and the moments must be on one device")
    in_memory = isinstance(step_size, Tensor)
    if in_memory != isinstance(decay, Tensor):
        raise ValueError("adam_apply_fused_: step_size and decay must both be floats or both tensors")
    if in_memory:
        for name, t in (("step_size", step_size), ("decay", decay)):
            if t.dtype != torch.float32 or t.numel() != 1 or t.device != p.device:
                raise ValueError(f"adam_apply_fused_: {name} must be a one-element fp32 tensor on {p.device}, "
                                 f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    beta1, beta2 = betas
    n = p.numel()
    if n:
        with launch_note("_adam_update_kernel", reads=(p, grad, m, v), writes=(p, m, v)):
            launch(_adam_update_kernel, (cdiv(n, _BLOCK),),
                p, grad, m, v, n, 1.0 - beta1, beta2, 1.0 - beta2, eps, step_size, decay,
                BLOCK=_BLOCK, EXACT_ROUNDING=not interpreting(), SCALARS_IN_MEMORY=in_memory, num_warps=4)
    return p
