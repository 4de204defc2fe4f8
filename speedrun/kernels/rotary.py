"""The plain RoPE rotation: the reference the QK-prep kernel (:mod:`speedrun.kernels.qk_prep`) and
the record network (:mod:`speedrun.model.rotary`, which re-exports it) share.

Rotating dims come first, in interleaved pairs ``(x[2i], x[2i+1])``; the rest of the head is
stationary (see :mod:`speedrun.model.rotary` for the frequencies and tables).
"""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``2 * cos.shape[-1]`` dims of ``x`` in interleaved pairs.

    x: (T, H, D) any float dtype; cos, sin: (T, n) float32 with 2n <= D.  Returns x's dtype.
    The math runs in float32 and the stationary dims pass through unchanged.  The plain reference
    of :func:`rotate_with_factors` (the record network's path), which gives the same bits.
    """
    n = cos.shape[-1]
    if n == 0:
        return x
    T = x.shape[0]
    rot = x[..., : 2 * n].float().unflatten(-1, (n, 2))
    x0, x1 = rot[..., 0], rot[..., 1]
    c = cos[:T, None, :]
    s = sin[:T, None, :]
    y = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return torch.cat((y.to(x.dtype), x[..., 2 * n :]), dim=-1)
