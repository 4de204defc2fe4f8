"""Recipes: what changes from step to step, and which optimizer updates the weights.

The training loop is one code path; a recipe supplies the schedule around it:

- :class:`CoreRecipe` - AdamW with a trapezoid LR over ``TrainConfig.stages`` (or one stage made
  from the flat fields), gradients averaged across ranks by the loop.
- :class:`RecordRecipe` - the record's staged schedule (:class:`~speedrun.optim.schedule.RecordSchedule`:
  batch size, sequence cap, windows, YaRN, MTP and prefix weights, LR and momentum), NorMuon +
  Adam with its per-label table (the optimizer does its own sharded communication), tied
  embed/lm_head until the split step, the prefix-token table filled when the clock starts.

Interface used by the loop: ``stages``, ``stage_index(step)``, ``forward_args(step)``,
``eval_args(step, final)``, ``before_step(step)``, ``note_batch(batch)`` (host work on each
micro-batch as it is fetched, before its forward; never device work, and nothing that reads the
device: it runs outside the step's CUDA graph, once per micro-batch, eager or replayed),
``optimizer_step(step, mark=None, before=None)`` (``mark``: the loop's host phase tracer, called
with "optimizer" once the update is issued and "fp8_refresh" once the FP8 weight copies are;
``before``: device work the update must follow, the embedding tables' gradient flush, as a
:class:`~speedrun.kernels.device_work.DeviceWork` whose host half has run),
``use_update_graphs(graphs)`` (launch the updates through CUDA graphs:
:mod:`speedrun.train.update_graphs`), ``on_clock_start()``, ``sync_to(step)`` (after a reset or resume),
``embedding_grads_due(step)`` (whether the optimizer step reads the embedding tables' in-place
accumulated gradients, so the loop flushes them first), ``grads_reduced_by_optimizer``,
``loss_reduction`` ("mean": backward of each micro-batch's mean loss; "sum": of its sum over the
tokens of an unmerged micro-batch, as the record does, see :func:`speedrun.train.loop.run_step`).
"""

from __future__ import annotations

import dataclasses

import torch

from speedrun.config import RunConfig, Stage
from speedrun.errors import ConfigError
from speedrun.model.interface import ForwardArgs


def _stage_index(stages: list[Stage], step: int) -> int:
    index = 0
    for i, s in enumerate(stages):
        if s.start_step <= step:
            index = i
    return index


def _ramp(value, t: float) -> float:
    """A stage weight given as a number or an (start, end) pair, at fraction ``t`` of the stage."""
    if isinstance(value, (tuple, list)):
        a, b = value
        return a + (b - a) * t
    return float(value)


def stages_of(cfg: RunConfig) -> list[Stage]:
    """The run's stages (batch size, sequence cap, windows from each start step)."""
    t = cfg.train
    if t.schedule == "record":
        return record_schedule(cfg).to_config_stages()
    if t.stages:
        return sorted(t.stages, key=lambda s: s.start_step)
    window = t.window or None
    return [Stage(0, t.batch_tokens, t.max_seq_len, window, window)]


class CoreRecipe:
    grads_reduced_by_optimizer = False
    loss_reduction = "mean"

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, info, tokenizer=None):
        from speedrun.optim.core import CoreOptimizer

        t = cfg.train
        if t.optimizer != "adam":
            raise ConfigError(f"train.optimizer={t.optimizer!r} needs train.schedule=record; the trapezoid "
                              f"schedule uses adam")
        self.stages = stages_of(cfg)
        self.total = t.steps
        self.model = model
        self.optimizer = CoreOptimizer(model, t)

    def stage_index(self, step: int) -> int:
        return _stage_index(self.stages, step)

    def forward_args(self, step: int) -> ForwardArgs:
        i = self.stage_index(step)
        s = self.stages[i]
        end = self.stages[i + 1].start_step if i + 1 < len(self.stages) else self.total
        frac = (step - s.start_step) / max(1, end - s.start_step)
        return ForwardArgs(window_short=s.window_short, window_long=s.window_long,
                           mtp_weights=tuple(_ramp(w, frac) for w in s.mtp_weights),
                           prefix_weight=_ramp(s.prefix_weight, frac))

    def eval_args(self, step: int, final: bool) -> ForwardArgs:
        s = self.stages[self.stage_index(min(step, self.total - 1))]
        return ForwardArgs(window_short=s.window_short, window_long=s.window_long)

    def before_step(self, step: int) -> None:
        pass

    def embedding_grads_due(self, step: int) -> bool:
        return True

    def note_batch(self, batch) -> None:
        pass

    def optimizer_step(self, step: int, mark=None, before=None) -> None:
        if before is not None:
            before.launch()
            before.settle()
        self.optimizer.step(step)
        if mark is not None:
            mark("optimizer")

    def use_update_graphs(self, graphs) -> None:
        raise ConfigError("the trapezoid schedule's AdamW update is not captured in CUDA graphs")

    def on_clock_start(self) -> None:
        pass

    def sync_to(self, step: int) -> None:
        pass


def record_stages_scaled(batch_divisor: int, seq_divisor: int):
    """The record's stage table with batch sizes and sequence caps divided (for shrunken runs)."""
    from speedrun.optim.schedule import RECORD_STAGES

    if batch_divisor < 1 or seq_divisor < 1:
        raise ConfigError("train.batch_divisor and train.seq_divisor must be >= 1")
    return tuple(dataclasses.replace(s, batch_tokens=s.batch_tokens // batch_divisor,
                                     max_seq_len=s.max_seq_len // seq_divisor) for s in RECORD_STAGES)


def record_schedule(cfg: RunConfig):
    """The RecordSchedule of ``cfg.train`` (steps = scheduled + extension; scaled stages)."""
    from speedrun.optim.schedule import RecordSchedule

    t = cfg.train
    try:
        return RecordSchedule(t.steps - t.num_extension, t.num_extension,
                              stages=record_stages_scaled(t.batch_divisor, t.seq_divisor), block_size=t.window_block)
    except ValueError as e:
        raise ConfigError(f"train.steps={t.steps} with train.num_extension={t.num_extension}: {e}") from None


class RecordRecipe:
    """See the module docstring.  ``cfg.train.steps`` = scheduled + ``cfg.train.num_extension``."""

    grads_reduced_by_optimizer = True
    # Upstream backpropagates ``loss.sum() * grad_scale``: gradients grow with the micro-batch's
    # tokens, which sets how a stage's first gradients weigh against the NorMuon and Adam moments
    # of the last, and how large Adam's eps and Polar Express's 1e-6 are against them.
    loss_reduction = "sum"

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, info, tokenizer=None):
        from speedrun.optim.normuon import NorMuonAndAdam, OptimizerHyper, record_param_table
        from speedrun.optim.simcomms import comms_for

        t = cfg.train
        if cfg.model.architecture != "record":
            raise ConfigError("train.schedule=record needs model.architecture=record")
        if t.optimizer != "normuon":
            raise ConfigError(f"train.schedule=record uses train.optimizer=normuon, got {t.optimizer!r}")
        self.schedule = record_schedule(cfg)
        self.stages = self.schedule.to_config_stages()
        self.model = model
        self.tokenizer = tokenizer
        self.cfg = cfg
        model.sync_embed_from_lm_head()
        hyper = OptimizerHyper(adam_lr=t.lr, muon_lr=t.muon_lr)
        kernels = {"auto": None, "triton": True, "reference": False}
        on_cpu = info is not None and info.device.type == "cpu"
        if t.optimizer_compile and on_cpu and t.dtype == "bf16" and not cpu_inductor_compiles_bf16_normuon():
            raise ConfigError(f"train.optimizer_compile=true with train.dtype=bf16 on the CPU needs torch >= 2.13: "
                              f"torch {torch.__version__}'s Inductor CPU backend fails on NorMuon's momentum step "
                              "with bf16 gradients (InductorError KeyError 'buf1'); use train.dtype=fp32 (the CPU "
                              "default), leave optimizer_compile off, or upgrade torch.  CUDA is not affected.")
        if t.optimizer_kernels not in kernels:
            raise ConfigError(f"train.optimizer_kernels must be one of {', '.join(kernels)}, got {t.optimizer_kernels!r}")
        self.optimizer = NorMuonAndAdam(model.parameter_groups(), record_param_table(), hyper=hyper,
                                        schedule=self.schedule, tied=("lm_head", "embed"),
                                        use_triton=kernels[t.optimizer_kernels],
                                        compile_backend="inductor" if t.optimizer_compile else None,
                                        host_group=getattr(info, "host_group", None),
                                        comms=comms_for(info))  # a simulated rank's no-op collectives
        adam = {id(e.param) for e in self.optimizer.entries.values() if e.spec.optim == "adam"}
        self._embeddings_adam_only = all(id(p) in adam for p in model.embedding_grad_params().values())
        self._long_window = None
        self.update_graphs = None  # speedrun.train.update_graphs.UpdateGraphs, set by use_update_graphs
        self.max_tokens = 0  # set by the loop: the largest batch (training or validation), for the RoPE tables
        self.fp8_refreshes = 0
        self._refresh_fp8()

    def stage_index(self, step: int) -> int:
        return self.schedule.at(min(step, self.schedule.total_steps - 1)).stage_index

    def forward_args(self, step: int) -> ForwardArgs:
        s = self.schedule.at(step)
        return ForwardArgs(window_short=s.window_short, window_long=s.window_long,
                           mtp_weights=tuple(s.mtp_weights), prefix_weight=float(s.prefix_weight))

    def eval_args(self, step: int, final: bool) -> ForwardArgs:
        s = self.schedule.at(min(step, self.schedule.total_steps - 1))
        if final:  # the record widens the long window for the last evaluation without a YaRN update
            short, long = self.schedule.final_eval_windows()
            return ForwardArgs(window_short=short, window_long=long)
        return ForwardArgs(window_short=s.window_short, window_long=s.window_long)

    def _set_long_window(self, window: int) -> None:
        if self._long_window is not None and window != self._long_window:
            self.model.apply_yarn(self._long_window, window)
            if self.max_tokens:
                self.model.warm_tables(self.max_tokens, self.model.lm_head.device)
        self._long_window = window

    def before_step(self, step: int) -> None:
        self._set_long_window(self.schedule.at(step).window_long)

    def embedding_grads_due(self, step: int) -> bool:
        """Adam, which updates every embedding table, steps on odd steps only: an even step's
        table gradients stay in the fp32 accumulators, summed with the next step's."""
        return self.schedule.at(step).adam_step or not self._embeddings_adam_only

    def sync_to(self, step: int) -> None:
        """Put YaRN in the state it has at ``step`` (after a reset, a warmup or a resume)."""
        self._refresh_fp8()  # weights were (re)loaded
        self.model.reset_yarn()
        if self.max_tokens:
            self.model.warm_tables(self.max_tokens, self.model.lm_head.device)
        self._long_window = None
        for s in range(0, step + 1):
            w = self.schedule.at(min(s, self.schedule.total_steps - 1)).window_long
            self._set_long_window(w)

    def note_batch(self, batch) -> None:
        """Mark the bigram rows the micro-batch looks up, from the loader's host mask of them
        (``Batch.bigram_rows``, built on the loader's thread), for the optimizer's sparse exchange
        (a no-op on one rank, whose loader builds no mask)."""
        if getattr(batch, "bigram_rows", None) is not None:
            self.optimizer.mark_rows("bigram_embed", batch.bigram_rows)

    def optimizer_step(self, step: int, mark=None, before=None) -> None:
        """The update, with ``before`` (device work, e.g. the embedding flush) ahead of it and the
        FP8 weight copies' refresh after it: all three captured and replayed together when the
        update runs through CUDA graphs (:meth:`use_update_graphs`)."""
        mark = mark or (lambda _: None)
        plan = self.optimizer.prepare(step)
        after = self._prepare_fp8_refresh()
        if self.update_graphs is not None:
            self.update_graphs.launch(plan, before=before, after=after)
            mark("optimizer")
        else:
            if before is not None:
                before.launch()
            self.optimizer.launch(plan)
            mark("optimizer")
            if after is not None:
                after.launch()
        for work in (before, after):
            if work is not None:
                work.settle()
        mark("fp8_refresh")

    def use_update_graphs(self, graphs) -> None:
        """Launch every optimizer update through ``graphs``
        (:class:`speedrun.train.update_graphs.UpdateGraphs`: captured and replayed)."""
        self.update_graphs = graphs

    def _refresh_fp8(self) -> None:
        """FP8 weight copies follow every change of the weights, and only those."""
        work = self._prepare_fp8_refresh()
        if work is not None:
            work.launch()
            work.settle()

    def _prepare_fp8_refresh(self):
        if self.model.uses_fp8_weights:
            self.fp8_refreshes += 1
        return self.model.prepare_after_optimizer_step()

    def on_clock_start(self) -> None:
        """The record builds the prefix table inside the timed region."""
        from speedrun.model.prefix_table import build_prefix_table

        if self.tokenizer is None:
            return
        table = build_prefix_table(self.tokenizer, self.model.vocab)
        self.model.set_prefix_table(table)


def cpu_inductor_compiles_bf16_normuon() -> bool:
    """False on torch < 2.13, whose Inductor CPU backend cannot compile NorMuon's momentum step on
    bf16 gradients (an in-place lerp, a lerp reading its result, a norm and a bf16 cast: KeyError
    'buf1' in codegen, seen with 2.11; fp32 gradients compile); 2.13 compiles both, and CUDA
    builds of 2.11 do."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 13)


def build_recipe(cfg: RunConfig, model, info, tokenizer=None):
    if cfg.train.schedule == "trapezoid":
        return CoreRecipe(cfg, model, info, tokenizer)
    if cfg.train.schedule == "record":
        return RecordRecipe(cfg, model, info, tokenizer)
    raise ConfigError(f"unknown train.schedule {cfg.train.schedule!r}; known: trapezoid, record")
