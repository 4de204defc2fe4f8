"""The record MLP's weight gradients written straight into the bank's gradient (beta = 1 GEMMs).

Autograd's route for the MLP bank ``(L_pad, 2, H, D)``: each layer's MLP returns its dW1 and dW2
(2 x (H, D)), the backward of the bank's ``unbind`` stacks them into a bank-sized tensor, and
from the second micro-batch of a step on ``AccumulateGrad`` adds that into ``.grad``.  At the
record's shapes the bank holds 104 MB of bf16, so a stage-3 step (8 micro-batches) moves the bank
8 x 2 times for the stacks and 7 x 3 times for the adds: ~3.8 GB, ~0.9 ms at 4.2 TB/s.

Here (``model.mlp_weight_grad="accumulate"``) the MLP's backward writes each dW GEMM into its
slot of one persistent bank-shaped buffer: the first micro-batch of a step overwrites the slot
(beta = 0), later ones add into it inside the GEMM (``addmm_``, beta = 1: the GEMM reads the old
slot once and writes the sum).  :meth:`MLPBankGradAccumulator.flush` hands the buffer to the
bank's ``.grad`` once per step.  Beyond the dW GEMMs' own writes (the same on both routes), a
record stage-3 step then moves 7 x 104 MB (the beta = 1 reads) instead of ~3.8 GB of stacks and
adds.  The MLP returns no gradient
for its weights, so autograd's stack and adds disappear.  The sum over micro-batches is rounded
to the bank's dtype once per GEMM (the fp32 product plus the old slot, rounded), where autograd
rounds the product and then the sum.

The price, as with :mod:`speedrun.model.embedding_grad`: until :meth:`flush` runs, the bank's
``.grad`` lacks the step's MLP gradients (the training step flushes after its micro-batches,
before the gradient reduction and the optimizer).
"""

from __future__ import annotations

import torch


class MLPBankGradAccumulator:
    """dW accumulation into a persistent buffer shaped like ``bank`` ((L_pad, 2, H, D): per layer
    c_fc then c_proj, each (H, D)).  Slots never written stay zero (the bank's padding rows)."""

    def __init__(self, bank: torch.nn.Parameter):
        self.bank = bank
        self.buffer: torch.Tensor | None = None
        self._written: set[tuple[int, int]] = set()  # slots written since the last flush
        self._ever: set[tuple[int, int]] = set()  # slots written by any step since the buffer was made

    def add_product(self, layer: int, which: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Add ``a @ b`` ((H, T) @ (T, D)) into slot ``(layer, which)`` (0: c_fc, 1: c_proj)."""
        buf = self._buffer()
        out = buf[layer, which]
        if a.shape[0] != out.shape[0] or b.shape[1] != out.shape[1]:
            raise ValueError(f"MLPBankGradAccumulator: product ({a.shape[0]}, {b.shape[1]}) does not fit slot "
                             f"({layer}, {which}) of shape {tuple(out.shape)}")
        key = (layer, which)
        first = key not in self._written
        if a.dtype == out.dtype:
            if first:
                torch.mm(a, b, out=out)
            else:
                out.addmm_(a, b)
        else:  # an fp32 bank fed bf16 products (CPU runs): autograd's route, cast then add
            prod = (a @ b).to(out.dtype)
            if first:
                out.copy_(prod)
            else:
                out.add_(prod)
        self._written.add(key)
        self._ever.add(key)

    def pending(self) -> bool:
        return bool(self._written)

    def host_state(self) -> tuple[frozenset, frozenset]:
        """The slots written since the last flush and ever (a copy; see :mod:`speedrun.train.graphs`)."""
        return frozenset(self._written), frozenset(self._ever)

    def set_host_state(self, state: tuple[frozenset, frozenset]) -> None:
        self._written, self._ever = set(state[0]), set(state[1])

    def flush(self) -> None:
        """Hand the step's sums to ``bank.grad`` and start a new step.  A slot written by an
        earlier step but not by this one is zeroed first (its old sum is no gradient of this step)."""
        if not self._written:
            return
        buf = self._buffer()
        for layer, which in self._ever - self._written:
            buf[layer, which].zero_()
        self._ever = set(self._written)
        self._written.clear()
        g = self.bank.grad
        if g is None:
            self.bank.grad = buf
        elif g is not buf:  # something else also produced a gradient: add ours
            g.add_(buf)

    def discard(self) -> None:
        """Forget what was accumulated since the last flush (a step that is thrown away)."""
        self._ever |= self._written
        self._written.clear()

    def _buffer(self) -> torch.Tensor:
        bank = self.bank
        if self.buffer is None or self.buffer.shape != bank.shape or self.buffer.device != bank.device \
                or self.buffer.dtype != bank.dtype:
            self.buffer = torch.zeros_like(bank, memory_format=torch.contiguous_format)
            self._written.clear()
            self._ever.clear()
        return self.buffer
