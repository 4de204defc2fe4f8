"""What the training loop hands a model besides the batch, and what it may call on a model.

Every network exposes ``loss(batch, args) -> scalar`` for training (mean loss over the batch's
tokens, the value to call ``backward`` on) and ``per_token_loss(batch, args) -> (T,) float32``
for validation (plain next-token cross entropy).  ``args`` carries the per-step schedule values
that change shapes or weights of the computation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from speedrun.errors import ConfigError


@dataclass(frozen=True)
class ForwardArgs:
    """Per-step settings.  Windows are in tokens (``None``: whole document)."""

    window_short: int | None = None
    window_long: int | None = None
    mtp_weights: tuple[float, ...] = (1.0,)
    prefix_weight: float = 0.0


class TrainableModel(nn.Module):
    """The contract between a network and the code that trains, benchmarks and checkpoints it.

    The training step, the warmup reset, validation, checkpoints and the builder call these hooks
    on every model; a network overrides the ones it needs (the defaults do nothing), so no caller
    probes a model for attributes.  Subclasses implement ``loss(batch, args) -> ()`` (the value to
    backpropagate) and ``per_token_loss(batch, args) -> (T,) float32`` (validation).

    Hook order within one optimizer step (:func:`speedrun.train.loop.run_step`): micro-batch
    forward/backward ..., :meth:`flush_weight_grads`, :meth:`flush_embedding_grads` (when the
    recipe's optimizer step reads the tables), the optimizer step, :meth:`after_optimizer_step`
    (from the recipe, also after any load of weights), :meth:`end_step`.
    """

    #: True where :meth:`generate` samples text (the run's closing sample)
    generates_text: bool = False

    # -- building ----------------------------------------------------------------------------

    def cast_for_training(self, dtype: torch.dtype) -> "TrainableModel":
        """Cast the parameters for training under autocast ``dtype`` (called once by the builder
        when the run trains in bf16; the default keeps fp32 weights)."""
        return self

    def set_kernel_options(self, options) -> None:
        """Hand the run's :class:`speedrun.kernels.options.KernelOptions` to the fused kernels this
        model runs (called once by the builder; a model without fused kernels ignores them)."""

    def warm_tables(self, max_tokens: int, device: torch.device | str) -> None:
        """Build position tables for micro-batches of up to ``max_tokens`` tokens before compiling."""

    @property
    def bigram_mod(self) -> int | None:
        """The modulus loaders hash bigrams with (``speedrun.data.loader.bigram_hash``); None: the
        model reads no bigram ids."""
        return None

    def compile_body(self, **compile_kwargs) -> None:
        """Compile the network's body with ``torch.compile(**compile_kwargs)``; refused by default."""
        raise ConfigError(f"{type(self).__name__} has no compile_body(); set train.compile=false")

    # -- one training step -------------------------------------------------------------------

    def flush_weight_grads(self) -> None:
        """Hand weight gradients summed in place over the step's micro-batches to ``.grad``."""

    def flush_embedding_grads(self) -> None:
        """Hand embedding-table gradients accumulated in place to ``.grad`` (before an optimizer
        step that reads them)."""
        work = self.prepare_embedding_flush()
        if work is not None:
            work.launch()
            work.settle()

    def prepare_embedding_flush(self):
        """The host half of :meth:`flush_embedding_grads` (each table's ``.grad`` made to point at
        the buffer the flush writes), returning its kernels as a
        :class:`~speedrun.kernels.device_work.DeviceWork` to launch before the optimizer step, or
        None when there is nothing to flush."""
        return None

    @property
    def uses_fp8_weights(self) -> bool:
        """Whether :meth:`after_optimizer_step` re-quantises weight copies."""
        return False

    def after_optimizer_step(self) -> None:
        """The weights changed (an optimizer step, a load, a reset): rebuild what derives from them
        (FP8 weight copies)."""
        work = self.prepare_after_optimizer_step()
        if work is not None:
            work.launch()
            work.settle()

    def prepare_after_optimizer_step(self):
        """The host half of :meth:`after_optimizer_step`, returning its kernels as a
        :class:`~speedrun.kernels.device_work.DeviceWork` (None: nothing to rebuild)."""
        return None

    def end_step(self) -> None:
        """Close an optimizer step (step-synchronous FP8 activation scales)."""

    def after_evaluation(self) -> None:
        """Forget what an evaluation left behind that must not steer training (FP8 amaxes)."""

    # -- CUDA-graph capture (speedrun.train.graphs) -------------------------------------------

    def graph_signature(self):
        """What decides which kernels a training micro-batch launches besides its shapes and
        arguments (hashable); a captured step is replayed only while it is unchanged."""
        return (self.training,)

    def graph_host_state(self):
        """The Python-side bookkeeping a training micro-batch changes, as a copy (None: none)."""
        return None

    def set_graph_host_state(self, state) -> None:
        """Restore :meth:`graph_host_state` (after replaying a captured step, whose Python never runs)."""

    # -- warmup and checkpoints --------------------------------------------------------------

    def reset_after_warmup(self) -> None:
        """After the untimed warmup restored the weights: drop every state the warmup's steps left
        (FP8 scales, gradients accumulated but not flushed), so the timed run starts as a fresh one."""

    def extra_state(self) -> dict:
        """State beyond ``state_dict()`` an exact resume needs, by section: ``"fp8"`` (delayed FP8
        scales, per rank) and ``"embedding_grads"`` (gradients pending in accumulators).  Empty
        sections are ``{}``; tensors stay on the model's device."""
        return {"fp8": {}, "embedding_grads": {}}

    def load_extra_state(self, state: dict) -> None:
        """Restore :meth:`extra_state` sections (after the weights); a non-empty section this model
        does not keep is an error."""
        for name, section in state.items():
            if section:
                raise ValueError(f"checkpoint holds {name!r} state, which {type(self).__name__} does not keep")
