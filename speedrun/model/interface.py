"""What the training loop hands a model besides the batch.

Every network exposes ``loss(batch, args) -> scalar`` for training (mean loss over the batch's
tokens, the value to call ``backward`` on) and ``per_token_loss(batch, args) -> (T,) float32``
for validation (plain next-token cross entropy).  ``args`` carries the per-step schedule values
that change shapes or weights of the computation.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardArgs:
    """Per-step settings.  Windows are in tokens (``None``: whole document)."""

    window_short: int | None = None
    window_long: int | None = None
    mtp_weights: tuple[float, ...] = (1.0,)
    prefix_weight: float = 0.0
