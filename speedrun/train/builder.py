"""The one way to get a run: :func:`build_run` turns a config into a :class:`Run`.

``train()``, ``speedrun bench step`` (:func:`speedrun.evidence.bench.build_session`),
``speedrun profile`` and ``speedrun compare`` all build through here, so a benchmark times the
model, recipe, dtype, kernel options and loaders a training run uses.  Order of the build
(it fixes the random stream the weights come from): validate the config, pick the dtype, resolve
the data, seed, build and cast the model, build the recipe (optimizer, schedule), plan the
micro-batches, warm the position tables, compile.  The kernel options
(:class:`~speedrun.kernels.options.KernelOptions`) are checked first and handed to the model's
fused kernels right after it is built.
"""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import torch

from speedrun.compiling import allow_schedule_variants
from speedrun.config import RunConfig, Stage
from speedrun.errors import ConfigError, DataError
from speedrun.kernels.options import KernelOptions
from speedrun.model import build_model
from speedrun.model.interface import TrainableModel
from speedrun.train.recipes import build_recipe


# ----------------------------------------------------------------------------------------------
# Data and micro-batches


def _expand(pattern: str, what: str) -> list[Path]:
    if not pattern:
        raise DataError(f"no {what} files given (data.{what}_files is empty)")
    paths = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
    if not paths and Path(pattern).is_dir():
        paths = sorted(Path(pattern).glob("*.bin"))
    if not paths:
        raise DataError(f"no {what} shard matches {pattern!r}; pass --data/--val-data with a glob of .bin shards "
                        f"(see 'speedrun data fineweb --help' and 'speedrun data tokenize --help')")
    return paths


def resolve_data(cfg: RunConfig):
    """(train_files, val_files, tokenizer) for the run's data source; checks the vocabulary fits."""
    from speedrun.data import builtin_corpus_shards, get_tokenizer
    from speedrun.data.splits import refuse_overlap

    d = cfg.data
    if d.source == "builtin":
        train_files, val_files = builtin_corpus_shards(d.cache_dir or None)
        tokenizer = get_tokenizer("bytes")
    elif d.source == "shards":
        train_files = _expand(d.train_files, "train")
        val_files = _expand(d.val_files, "val") if d.val_files else None
        if val_files is None:
            raise DataError("no validation shards: pass --val-data (a glob of *_val_*.bin shards)")
        refuse_overlap(train_files, val_files, d.allow_val_overlap)
        try:
            tokenizer = get_tokenizer(d.tokenizer, d.tokenizer_dir or None)
        except DataError:
            tokenizer = None  # sampling is skipped; training needs only token ids
    else:
        raise ConfigError(f"unknown data.source {d.source!r}; known: builtin, shards")
    # Equal, not just large enough: a larger model vocabulary means the shards were made with
    # another tokenizer (their ids would pass the shard check and the BOS split would be wrong).
    if tokenizer is not None and tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"tokenizer {tokenizer.name} has {tokenizer.vocab_size} ids but model.vocab_size is "
                          f"{cfg.model.vocab_size}: set model.vocab_size={tokenizer.vocab_size}, or "
                          f"data.tokenizer (and data.bos_id) to the tokenizer the shards were made with")
    if tokenizer is not None and tokenizer.bos_id != d.bos_id:
        raise ConfigError(f"data.bos_id={d.bos_id} but tokenizer {tokenizer.name} uses BOS {tokenizer.bos_id}")
    return train_files, val_files, tokenizer


def grad_accum_steps(cfg: RunConfig, world: int) -> int:
    """Micro-batches per step per rank; 0 in the config means the record's 8 // world_size."""
    if cfg.train.grad_accum > 0:
        return cfg.train.grad_accum
    if 8 % world:
        raise ConfigError(f"train.grad_accum=0 (auto) needs a world size dividing 8, got {world}")
    return 8 // world


def tokens_per_rank(stage: Stage, cfg: RunConfig, world: int) -> int:
    """Input tokens of one unmerged micro-batch (a loader *chunk*): the stage's batch over the
    ranks and :func:`grad_accum_steps`."""
    accum = grad_accum_steps(cfg, world)
    parts = world * accum
    if stage.batch_tokens % parts:
        raise ConfigError(f"batch of {stage.batch_tokens} tokens does not split over {world} ranks x "
                          f"{accum} accumulation steps")
    return stage.batch_tokens // parts


@dataclass(frozen=True)
class MicroBatching:
    """How one rank splits a stage's optimizer step.

    chunk: tokens of an unmerged micro-batch (:func:`tokens_per_rank`); merge: chunks per
    micro-batch; count: micro-batches per step.  ``count * merge`` is always
    :func:`grad_accum_steps`, so every arrangement sees the same tokens per step."""

    chunk: int
    merge: int
    count: int

    @property
    def tokens(self) -> int:
        """Input tokens per micro-batch."""
        return self.chunk * self.merge


def micro_batching(stage: Stage, cfg: RunConfig, world: int) -> MicroBatching:
    """The stage's micro-batches per rank under ``train.min_micro_batch_tokens``.

    0 (the presets) keeps the record's split: :func:`grad_accum_steps` micro-batches of one chunk.
    A positive value merges consecutive chunks, by the smallest factor dividing the accumulation
    count that gives at least that many tokens per micro-batch (all of them if none does): fewer,
    larger micro-batches with the same tokens per step (see :mod:`speedrun.data.loader`), for a
    step that waits on the host's per-micro-batch work (the record's stage 1 on one GPU)."""
    chunk = tokens_per_rank(stage, cfg, world)
    accum = grad_accum_steps(cfg, world)
    want = cfg.train.min_micro_batch_tokens
    if isinstance(want, bool) or not isinstance(want, int) or want < 0:
        raise ConfigError(f"train.min_micro_batch_tokens must be an int >= 0 (0 = no merging), got {want!r}")
    merge = next((m for m in range(1, accum + 1) if accum % m == 0 and m * chunk >= want), accum)
    return MicroBatching(chunk, merge, accum // merge)

def validation_batch_tokens(cfg: RunConfig, plans: list[MicroBatching]) -> int:
    """Tokens of each rank's validation batch: ``train.val_batch_tokens / train.batch_divisor``,
    or with 0 the largest unmerged micro-batch of ``plans`` (so merging leaves the metric as it is)."""
    want = cfg.train.val_batch_tokens
    if isinstance(want, bool) or not isinstance(want, int) or want < 0:
        raise ConfigError(f"train.val_batch_tokens must be an int >= 0 (0 = the largest micro-batch), got {want!r}")
    if want == 0:
        return max(p.chunk for p in plans)
    return max(1, want // max(1, cfg.train.batch_divisor))


def kernel_options(cfg: RunConfig) -> KernelOptions:
    """The run's :class:`~speedrun.kernels.options.KernelOptions` (checked), with the launch path
    of our Triton kernels applied: that one is process-wide (``train.triton_launch``)."""
    from speedrun.kernels import _triton

    options = KernelOptions.from_config(cfg.train)
    _triton.set_enabled(options.triton_launch == "cached")
    return options


def compile_model(model, cfg: RunConfig):
    """``model`` with its network compiled when ``train.compile`` (returns the same object).

    ``torch.compile(model)`` would compile only ``forward``, while training calls ``loss`` and
    ``per_token_loss``; the models instead compile their body themselves (``compile_body``),
    shapes static (one graph per stage shape, made in the warmup).  ``train.compile_cpp_wrapper``
    adds Inductor's ``cpp_wrapper`` option."""
    if cfg.train.compile:
        if type(model).compile_body is TrainableModel.compile_body:  # refuses before any set-up
            model.compile_body()
        allow_schedule_variants()
        extra = {}
        if cfg.train.compile_cpp_wrapper:
            _check_cpp_wrapper_backend(model, cfg)
            extra = {"options": {"cpp_wrapper": True}}
        model.compile_body(dynamic=False, **extra)
    elif cfg.train.compile_cpp_wrapper:
        raise ConfigError("train.compile_cpp_wrapper needs train.compile=true")
    return model


def _check_cpp_wrapper_backend(model, cfg: RunConfig) -> None:
    """Refuse the C++ wrapper with torch's varlen attention: its custom op takes ``window_size``
    as ``int[]``, which Inductor's C++ wrapper cannot pass to a Python op (torch 2.11 fails with
    "arg type List[int] is not yet supported by custom_op_wrapper", and only after a long compile)."""
    from speedrun.attention import resolve_backend

    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    if resolve_backend(cfg.model.attention_backend, device) == "varlen":
        raise ConfigError("train.compile_cpp_wrapper cannot run with the varlen attention backend (torch's "
                          "varlen_attn op takes an int[] window, which Inductor's C++ wrapper cannot pass); "
                          "set model.attention_backend=flex or drop train.compile_cpp_wrapper")


def resolve_dtype(cfg: RunConfig, device: torch.device) -> torch.dtype:
    """The autocast dtype of a run: ``train.dtype`` (bf16/fp32), or bf16 on CUDA / fp32 elsewhere."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(cfg.train.dtype)
    if dtype is None:
        if cfg.train.dtype != "auto":
            raise ConfigError(f"train.dtype must be bf16, fp32 or auto, got {cfg.train.dtype!r}")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype


# ----------------------------------------------------------------------------------------------
# The run


@dataclass
class Run:
    """A built run, ready to step: what :func:`speedrun.train.loop.run_step` and
    :func:`speedrun.train.loop.evaluate` take.

    ``model`` is the network (its state dict, hooks); ``run_model`` the object the steps call (the
    same model with its body compiled under ``train.compile``).  ``plans[i]`` is stage ``i``'s
    micro-batching; ``val_batch`` each rank's validation batch (tokens)."""

    cfg: RunConfig
    info: object  # speedrun.distributed.DistInfo
    dtype: torch.dtype
    model: TrainableModel
    run_model: TrainableModel
    recipe: object  # speedrun.train.recipes.CoreRecipe or RecordRecipe
    plans: list[MicroBatching]
    val_batch: int
    train_files: list[Path]
    val_files: list[Path] | None
    tokenizer: object | None
    kernel_options: KernelOptions

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def optimizer(self):
        return self.recipe.optimizer

    @property
    def stages(self) -> list[Stage]:
        return self.recipe.stages

    def stage_end(self, stage_index: int) -> int:
        """The first step after stage ``stage_index`` (the run's length for the last stage)."""
        stages = self.stages
        return stages[stage_index + 1].start_step if stage_index + 1 < len(stages) else self.cfg.train.steps

    def make_loader(self, stage_index: int):
        """A :class:`speedrun.data.TrainLoader` at stage ``stage_index``'s shapes, from the start of the data."""
        from speedrun.data import TrainLoader

        cfg, info = self.cfg, self.info
        s, plan = self.stages[stage_index], self.plans[stage_index]
        return TrainLoader(self.train_files, plan.chunk, s.max_seq_len, rank=info.rank,
                           world_size=info.world_size, bos_id=cfg.data.bos_id, vocab_size=cfg.model.vocab_size,
                           max_docs=cfg.train.max_docs or None, device=info.device,
                           bigram_mod=self.model.bigram_mod, merge=plan.merge,
                           prefetch_batches=max(p.count for p in self.plans),
                           # several ranks exchange the bigram table's touched rows (its optimizer's
                           # sparse exchange), marked from each batch's mask of them
                           bigram_rows=self.model.bigram_mod is not None and info.world_size > 1)

    def set_loader_shape(self, loader, stage_index: int) -> None:
        """Switch ``loader`` to stage ``stage_index``'s shapes, where it is in the data."""
        plan = self.plans[stage_index]
        loader.set_shape(plan.chunk, self.stages[stage_index].max_seq_len, self.cfg.train.max_docs or None, plan.merge)


def build_run(cfg: RunConfig, info) -> Run:
    """Build ``cfg``'s run on ``info.device`` (``info``: :func:`speedrun.distributed.setup`'s).

    Bad config or data is refused here, before anything is trained.  The position tables are
    built for the largest micro-batch of any stage and the validation batch, before compiling."""
    from speedrun.config_check import validate_config

    validate_config(cfg)
    options = kernel_options(cfg)  # refuses bad values before anything is built
    device = info.device
    dtype = resolve_dtype(cfg, device)
    train_files, val_files, tokenizer = resolve_data(cfg)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model).to(device)
    if dtype == torch.bfloat16:
        model.cast_for_training(torch.bfloat16)
    model.set_kernel_options(options)
    recipe = build_recipe(cfg, model, info, tokenizer)
    plans = [micro_batching(s, cfg, info.world_size) for s in recipe.stages]
    val_batch = validation_batch_tokens(cfg, plans)
    # RoPE tables must exist before compiling (validation's too); the recipe rebuilds them at YaRN changes
    recipe.max_tokens = max(max(p.tokens for p in plans), val_batch)
    model.warm_tables(recipe.max_tokens, device)
    run_model = compile_model(model, cfg)
    return Run(cfg, info, dtype, model, run_model, recipe, plans, val_batch, train_files, val_files, tokenizer,
               options)
