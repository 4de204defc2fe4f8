"""Rotary position embeddings (RoPE) with a stationary part ("half-truncated RoPE").

For a q/k head of width ``head_dim``, the first ``rope_dims`` dims rotate in interleaved pairs
``(x[2i], x[2i+1])`` with angular frequency ``freq[i] = (1/base) ** (i / (n - 1))`` for
``i < n = rope_dims // 2``; the remaining ``head_dim - rope_dims`` dims are not rotated, so they
carry position-independent content (the record uses half of the width: 64 of 128).

Positions are indices in the flat (packed) token sequence; RoPE only sees differences of
positions inside a document, so packing several documents into one sequence is harmless.
"""

from __future__ import annotations

import torch


def rope_dims_for(head_dim: int, rope_fraction: float) -> int:
    """Number of rotating dims: ``head_dim * rope_fraction`` rounded down to an even number."""
    dims = int(head_dim * rope_fraction) // 2 * 2
    return dims


def rope_frequencies(rope_dims: int, base: float) -> torch.Tensor:
    """Angular frequencies (rope_dims // 2,) float32, from 1 down to 1/base (radians per position)."""
    n = rope_dims // 2
    if n == 0:
        return torch.zeros(0)
    return (1.0 / base) ** torch.linspace(0, 1, n, dtype=torch.float32)


def rope_tables(positions: int, freqs: torch.Tensor, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each (positions, len(freqs)) float32."""
    t = torch.arange(positions, dtype=torch.float32, device=device)
    angles = torch.outer(t, freqs.to(device=device, dtype=torch.float32))
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the leading ``2 * cos.shape[-1]`` dims of ``x`` in interleaved pairs.

    x: (T, H, D) any float dtype; cos, sin: (T, n) float32 with 2n <= D.  Returns x's dtype.
    The math runs in float32 and the stationary dims pass through unchanged.
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


class Rotary(torch.nn.Module):
    """Caches cos/sin tables for up to ``max_positions`` positions (grown on demand)."""

    def __init__(self, head_dim: int, rope_fraction: float = 0.5, base: float = 1024.0, max_positions: int = 4096):
        super().__init__()
        self.head_dim = head_dim
        self.rope_dims = rope_dims_for(head_dim, rope_fraction)
        self.base = base
        freqs = rope_frequencies(self.rope_dims, base)
        cos, sin = rope_tables(max_positions, freqs)
        self.register_buffer("freqs", freqs, persistent=False)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H, head_dim) -> same shape and dtype, rotated by position 0..T-1."""
        T = x.shape[0]
        if T > self.cos.shape[0]:
            self.cos, self.sin = rope_tables(max(T, 2 * self.cos.shape[0]), self.freqs, device=x.device)
        return apply_rotary(x, self.cos, self.sin)
