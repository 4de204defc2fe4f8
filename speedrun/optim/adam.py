"""The record's Adam update for embeddings, gates and scalars (record recipe §4.1).

Plain bias-corrected Adam with fp32 state and *cautious* decoupled weight decay: decay is applied
only where the update and the weight have the same sign, with strength ``lr**2 * wd * wd_mul``
(note the square: ``lr`` already includes the parameter's ``lr_mul``).  The combined optimizer
(:class:`speedrun.optim.normuon.NorMuonAndAdam`) calls :func:`adam_update_` on each parameter's
own shard, only on odd steps, with the gradient summed over the two steps since the last update.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from speedrun.kernels.fused_adam import adam_update_fused_, fused_adam_supported

__all__ = ["adam_update_", "adam_update_auto_", "AdamState", "new_adam_state"]

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
    beta1, beta2 = betas
    state["step"] += 1
    t = state["step"]
    g = grad.float()
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step_size = lr * math.sqrt(1.0 - beta2**t) / (1.0 - beta1**t)
    # In-place chains keep the transient memory to ~two fp32 copies (the tables reach 1.1 GB).
    update = v.sqrt().add_(eps)
    torch.div(m, update, out=update).mul_(step_size)
    p32 = p if p.dtype == torch.float32 else p.float()
    # Cautious WD: only pull a weight toward zero where the update already pushes it that way.
    update.addcmul_(p32, (update * p32 > 0), value=lr * lr * weight_decay)
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
    fused = (p.is_cuda and fused_adam_supported(p, grad)) if use_triton is None else use_triton
    fn = adam_update_fused_ if fused else adam_update_
    return fn(p, grad, state, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
