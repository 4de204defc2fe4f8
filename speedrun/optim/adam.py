"""The record's Adam update for embeddings, gates and scalars (record recipe §4.1).

Plain bias-corrected Adam with fp32 state and *cautious* decoupled weight decay: decay is applied
only where the update and the weight have the same sign, with strength ``lr**2 * wd * wd_mul``
(note the square: ``lr`` already includes the parameter's ``lr_mul``).  The combined optimizer
(:class:`speedrun.optim.normuon.NorMuonAndAdam`) calls :func:`adam_update_` on each parameter's
own shard, only on odd steps, with the gradient summed over the two steps since the last update.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speedrun.kernels.fused_adam import adam_apply_fused_, adam_scalars, adam_update_fused_, fused_adam_supported

__all__ = ["adam_update_", "adam_apply_", "adam_update_auto_", "adam_apply_auto_", "adam_scalars", "AdamState",
           "new_adam_state"]

AdamState = dict  # {"step": int, "exp_avg": fp32 Tensor, "exp_avg_sq": fp32 Tensor}


def new_adam_state(like: Tensor) -> AdamState:
    """Zero fp32 moments shaped like ``like`` (the parameter shard this rank updates)."""
    return {
        "step": 0,
        "exp_avg": torch.zeros(like.shape, dtype=torch.float32, device=like.device),
        "exp_avg_sq": torch.zeros(like.shape, dtype=torch.float32, device=like.device),
    }


@torch.no_grad()
def adam_update_(
    p: Tensor,
    grad: Tensor,
    state: AdamState,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> Tensor:
    """One Adam step on ``p`` in place; returns ``p``.

    p: parameter shard, any float dtype (bf16 weights are updated through fp32 math then rounded).
    grad: same shape as p, any float dtype.  state: from :func:`new_adam_state`, updated in place.
    lr: the effective learning rate (base lr x schedule multiplier x per-parameter lr_mul).
    weight_decay: ``wd * wd_mul``; the applied decay is ``lr**2 * weight_decay`` on the masked
    coordinates.
    """
    if p.shape != grad.shape or p.shape != state["exp_avg"].shape:
        raise ValueError(f"adam_update_: p {tuple(p.shape)}, grad {tuple(grad.shape)} and state "
                         f"{tuple(state['exp_avg'].shape)} must have the same shape")
    state["step"] += 1
    step_size, decay = adam_scalars(state["step"], lr=lr, betas=betas, weight_decay=weight_decay)
    return adam_apply_(p, grad, state["exp_avg"], state["exp_avg_sq"], betas=betas, eps=eps,
                       step_size=step_size, decay=decay)


@torch.no_grad()
def adam_apply_(p: Tensor, grad: Tensor, m: Tensor, v: Tensor, *, betas: tuple[float, float], eps: float,
                step_size: float | Tensor, decay: float | Tensor) -> Tensor:
    """The update of :func:`adam_update_` with the step's two changing values given
    (:func:`~speedrun.kernels.fused_adam.adam_scalars`): floats, or 0-d fp32 tensors on p's device
    (a captured optimizer step reads them from a buffer written each step).  m, v: the fp32
    moments, updated in place."""
    beta1, beta2 = betas
    g = grad.float()
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    # In-place chains keep the transient memory to ~two fp32 copies (the tables reach 1.1 GB).
    update = v.sqrt().add_(eps)
    torch.div(m, update, out=update).mul_(step_size)
    p32 = p if p.dtype == torch.float32 else p.float()
    # Cautious WD: only pull a weight toward zero where the update already pushes it that way.
    keep = update * p32 > 0
    if isinstance(decay, Tensor):
        update.add_(p32 * keep * decay)  # addcmul's value must be a number
    else:
        update.addcmul_(p32, keep, value=decay)
    if p32 is p:
        p.sub_(update)
    else:
        p.copy_(p32.sub_(update))
    return p


def adam_update_auto_(p: Tensor, grad: Tensor, state: dict, *, lr: float, betas: tuple[float, float],
                      eps: float, weight_decay: float, use_triton: bool | None = None) -> Tensor:
    """The Adam step through :func:`adam_update_fused_` or the reference.  ``use_triton`` None: the
    kernel for CUDA tensors it supports (:func:`fused_adam_supported`), the reference otherwise
    (as Polar Express decides); False: the reference; True: the kernel or a clear error (on CPU
    tensors only under ``TRITON_INTERPRET=1``)."""
    fn = adam_update_fused_ if _fused(p, grad, use_triton) else adam_update_
    return fn(p, grad, state, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def adam_apply_auto_(p: Tensor, grad: Tensor, m: Tensor, v: Tensor, *, betas: tuple[float, float], eps: float,
                     step_size: float | Tensor, decay: float | Tensor, use_triton: bool | None = None) -> Tensor:
    """:func:`adam_apply_` through the kernel or the reference, chosen as :func:`adam_update_auto_`
    chooses."""
    fn = adam_apply_fused_ if _fused(p, grad, use_triton) else adam_apply_
    return fn(p, grad, m, v, betas=betas, eps=eps, step_size=step_size, decay=decay)


def _fused(p: Tensor, grad: Tensor, use_triton: bool | None) -> bool:
    return (p.is_cuda and fused_adam_supported(p, grad)) if use_triton is None else use_triton
