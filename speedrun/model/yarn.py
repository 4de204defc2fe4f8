"""YaRN-adjusted half-truncated RoPE tables for the record model, plain and paired-head.

Frequencies and layout follow :mod:`speedrun.model.rotary`: of a q/k head of width ``head_dim``
the leading ``rope_dims = rope_dims_for(head_dim, rope_fraction)`` dims rotate in interleaved
pairs ``(x[2i], x[2i+1])`` with angular frequency ``freq[i] = (1/base) ** (i / (n - 1))``,
``n = rope_dims // 2``; the trailing ``head_dim - rope_dims`` dims are stationary.  At the record
width (128, fraction 1/2, base 1024) that is 32 frequencies on 64 rotating dims plus 64
stationary dims, as in the record (recipe §2.4).

Reduced-width Q/K (``qk_head_dim = 96``): the same rule gives 48 rotating dims (24 frequencies,
spanning the same range 1 .. 1/1024 rad/position) and 48 stationary dims.  The key offset of the
long-window layers shifts exactly the stationary dims (``rope_dims:``), so at 96 it moves 48 dims.

YaRN (:meth:`Yarn.apply`), when the long window grows from ``old`` to ``new`` tokens:

* ``r_i = old * freq_i / (2 pi)`` (rotations over the old window);
* ``w_i = clamp((r_i - alpha) / (beta - alpha), 0, 1)`` with alpha=1, beta=32;
* ``freq_i *= s + w_i (1 - s)``, ``s = old / new``: slow frequencies (few rotations) are
  interpolated by ``s``, fast ones are left alone;
* the softmax scale is multiplied by ``0.2 ln(new/old) + 1``; it starts at 0.1.

Positions are indices in the flat packed sequence (RoPE only sees differences).  The paired-head
variant rotates head ``h`` of token ``t`` as position ``2t + (h mod 2)``: the record views q/k of
shape (T, H, D) as (T, H/2, 2D) and rotates the first D dims at 2t and the second at 2t+1.  One
:class:`Yarn` serves both variants: they share frequencies and scale, and the paired tables are the
plain ones over twice as many positions.

The rotation direction is rotary.py's (``x0 c - x1 s, x0 s + x1 c``); the record rotates the
other way, which is the same model up to a sign flip of one dim in each pair.
"""

from __future__ import annotations

import math

import torch

from speedrun.model.rotary import rope_dims_for, rope_frequencies, rotary_factors, rotate_with_factors


class Yarn:
    """RoPE frequencies with YaRN updates, plus the shared softmax scale.

    A plain object, not an ``nn.Module`` (``nn.Module.apply`` is taken): tables are built lazily
    on the device of the tensor being rotated and rebuilt after :meth:`apply`/:meth:`reset`.  Its
    state is not in the model's ``state_dict``; like the record, the training loop replays the
    schedule (``reset`` then ``apply`` per long-window change).

    Args:
        head_dim: q/k width per head (multiple of 4).
        rope_fraction: share of ``head_dim`` that rotates (record: 0.5).
        base: frequency range 1 .. 1/base rad per position (record: 1024).
        attn_scale: starting softmax scale (record: 0.1).
        max_positions: table rows built on first use (grown on demand; a paired layer of T tokens
            needs 2T rows).

    Attributes: ``freqs`` (n,) float32 on the CPU, ``attn_scale`` (Python float), ``rope_dims``.
    """

    def __init__(self, head_dim: int, rope_fraction: float = 0.5, base: float = 1024.0, *,
                 attn_scale: float = 0.1, max_positions: int = 4096):
        if head_dim % 4 != 0:
            raise ValueError(f"Yarn: head_dim must be a multiple of 4, got {head_dim}")
        self.head_dim = head_dim
        self.rope_fraction = rope_fraction
        self.rope_dims = rope_dims_for(head_dim, rope_fraction)
        self.base = base
        self.initial_attn_scale = float(attn_scale)
        self.min_positions = int(max_positions)
        self.reset()

    # ------------------------------------------------------------------------------------------
    # State

    def reset(self) -> None:
        """Back to the un-extended frequencies and the starting scale (the record does this at its
        post-warmup state reset)."""
        self.attn_scale = self.initial_attn_scale
        with torch.device("cpu"):  # a plain CPU table even when the model is built on "meta"
            self.freqs = rope_frequencies(self.rope_dims, self.base).float()
        self._cache: dict[torch.device, tuple[torch.Tensor, ...]] = {}  # cos, sin, f_cos, f_sin

    def apply(self, old_window: int, new_window: int, alpha: float = 1.0, beta: float = 32.0) -> None:
        """YaRN extension from ``old_window`` to ``new_window`` tokens (see the module docstring).

        The record calls this only when the long window changes between stages, never for the
        final-evaluation window extension.
        """
        if old_window <= 0 or new_window <= 0:
            raise ValueError(f"Yarn.apply: windows must be positive, got {old_window} -> {new_window}")
        rotations = old_window * self.freqs / (2 * math.pi)
        s = old_window / new_window
        w = torch.clamp((rotations - alpha) / (beta - alpha), 0.0, 1.0)
        self.freqs = self.freqs * (s + w * (1 - s))
        self._cache = {}
        self.attn_scale *= 0.2 * math.log(new_window / old_window) + 1

    def tables(self, positions: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: (>= positions, n) float32 on ``device``."""
        return self._tables(positions, device)[:2]

    def factors(self, positions: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The same rows as full-width factor tables (:func:`~speedrun.model.rotary.rotary_factors`):
        f_cos, f_sin (>= positions, head_dim) float32 on ``device``."""
        return self._tables(positions, device)[2:]

    def _tables(self, positions: int, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        device = torch.device(device)
        cached = self._cache.get(device)
        if cached is None or cached[0].shape[0] < positions:
            rows = max(positions, self.min_positions, 2 * cached[0].shape[0] if cached else 0)
            t = torch.arange(rows, dtype=torch.float32, device=device)
            angles = torch.outer(t, self.freqs.to(device))
            cos, sin = angles.cos(), angles.sin()
            cached = (cos, sin, *rotary_factors(cos, sin, self.head_dim))
            self._cache[device] = cached
        return cached

    # ------------------------------------------------------------------------------------------
    # Rotation

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H, head_dim) -> same shape/dtype, token t rotated as position t."""
        self._check_width(x, "rotate")
        f_cos, f_sin = self.factors(x.shape[0], x.device)
        T = x.shape[0]
        return rotate_with_factors(x, f_cos[:T, None, :], f_sin[:T, None, :])

    def rotate_paired(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, H, head_dim), H even -> same shape/dtype; head h of token t at position 2t + h%2.

        Viewed as (T, H/2, 2, D), entry [t, i, p] is head 2i+p, rotated at position 2t+p: the
        factor rows 0..2T-1 viewed as (T, 1, 2, D) line up with it, so the paired rotation is the
        plain elementwise one on a view (no strided head selects, no ``stack``)."""
        T, H, D = x.shape
        if H % 2:
            raise ValueError(f"Yarn.rotate_paired: needs an even number of heads, got x{tuple(x.shape)}")
        self._check_width(x, "rotate_paired")
        f_cos, f_sin = self.factors(2 * T, x.device)
        xv = x.reshape(T, H // 2, 2, D)
        y = rotate_with_factors(xv, f_cos[: 2 * T].view(T, 1, 2, D), f_sin[: 2 * T].view(T, 1, 2, D))
        return y.view(T, H, D)

    def _check_width(self, x: torch.Tensor, name: str) -> None:
        if x.dim() != 3 or x.shape[-1] != self.head_dim:
            raise ValueError(f"Yarn.{name}: expected x (T, H, {self.head_dim}), got {tuple(x.shape)}")
