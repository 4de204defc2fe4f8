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

from speedrun.kernels.rotary import apply_rotary  # noqa: F401  (the plain rotation lives beside its kernels)


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


def rotary_factors(cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-width factor tables for :func:`rotate_with_factors`.

    cos, sin: (rows, n) float32 with ``2n <= head_dim``, head_dim even.  Returns ``(f_cos, f_sin)``,
    each (rows, head_dim) float32: ``f_cos = (c0, c0, c1, c1, ..., 1, ..., 1)`` and
    ``f_sin = (-s0, s0, -s1, s1, ..., 0, ..., 0)`` (ones and zeros on the stationary dims)."""
    rows, n = cos.shape
    if head_dim % 2 or 2 * n > head_dim:
        raise ValueError(f"rotary_factors: need an even head_dim >= 2 * {n} rotating pairs, got {head_dim}")
    stationary = head_dim - 2 * n
    f_cos = torch.cat((cos.float().repeat_interleave(2, dim=-1), cos.new_ones(rows, stationary, dtype=torch.float32)), -1)
    f_sin = torch.cat((torch.stack((-sin.float(), sin.float()), dim=-1).flatten(-2),
                       sin.new_zeros(rows, stationary, dtype=torch.float32)), -1)
    return f_cos, f_sin


def swap_pairs(x: torch.Tensor) -> torch.Tensor:
    """``(x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...)`` along the last dim (even width): a view
    plus ``flip``, which ``torch.compile`` turns into an index expression, not a copy."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).flip(-1).flatten(-2)


def rotate_with_factors(x: torch.Tensor, f_cos: torch.Tensor, f_sin: torch.Tensor) -> torch.Tensor:
    """RoPE as one elementwise expression: ``x * f_cos + swap_pairs(x) * f_sin`` in float32, cast
    back to x's dtype.

    x: (..., D) any float dtype, D even; f_cos, f_sin: :func:`rotary_factors` tables (or views of
    them) broadcastable to x.  Gives :func:`apply_rotary`'s values (the same fp32 products and
    sums; stationary dims are ``x * 1 + y * 0 = x`` exactly) without its slices, ``stack`` and
    ``cat``.  (The slow backward kernels once blamed on those slices were the summed
    ``slice_backward``s of the q/k/v slicing around it; the record now splits qkv.  ``benchmarks/bench_rotary.py`` times the formulations.)"""
    xf = x.float()
    return (xf * f_cos + swap_pairs(xf) * f_sin).to(x.dtype)


def shift_stationary_keys(k: torch.Tensor, rope_dims: int) -> torch.Tensor:
    """The key offset of the long-window layers: token t's stationary dims (``rope_dims:``) take
    token t-1's values (token 0 keeps its own).  k: (T, H, D) -> same shape and dtype.

    Written as ``where(stationary, previous row, k)`` (one pointwise kernel each way under
    ``torch.compile``) rather than as two ``cat``s of column slices."""
    if k.shape[0] < 2:
        return k
    previous = torch.cat((k[:1], k[:-1]))
    stationary = torch.arange(k.shape[-1], device=k.device) >= rope_dims
    return torch.where(stationary, previous, k)


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
