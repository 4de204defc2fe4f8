"""The training loop: untimed warmup, timed region, periodic validation, checkpoints, resume.

One function, :func:`train`, runs a :class:`~speedrun.config.RunConfig` from start to finish (or
continues one from its newest checkpoint) on one process or under torchrun.  The clock covers
data loading, forward, backward, communication and the optimizer step; it stops (after a device
synchronize) around validation, checkpointing and logging that needs host values.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from speedrun import distributed
from speedrun.compiling import allow_schedule_variants
from speedrun.config import (CE_GRAD_LAYOUT_CHOICES, CE_SIGMOID_CHOICES, MLP_GEMM_CHOICES, TRITON_LAUNCH_CHOICES,
                             RunConfig, Stage)
from speedrun.errors import ConfigError, DataError
from speedrun.model import build_model
from speedrun.model.interface import ForwardArgs
from speedrun.train import faults
from speedrun.train.checkpoint import load_latest, load_rank_state, save_checkpoint, save_rank_state
from speedrun.train import microbatch
from speedrun.train.collector import freeze_long_lived, thaw
from speedrun.train.graphs import StepGraphs, graphs_enabled
from speedrun.train.recipes import build_recipe
from speedrun.train.runlog import RunLog, environment_lines, new_run_dir, step_line, val_line


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_val_loss: float
    train_time_ms: float
    sample: str
    stopped_early: bool = False
    rank: int = 0
    signal: str = ""  # the signal that stopped the run early ("SIGINT", "SIGTERM"), if one did


# ----------------------------------------------------------------------------------------------
# Data


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


# ----------------------------------------------------------------------------------------------
# Steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


STEP_PHASES = ("setup", "data", "forward", "backward", "after_backward", "grad_reduce", "optimizer", "fp8_step_end")


def run_step(model, recipe, loader, step: int, cfg: RunConfig, info, dtype,
             on_phase: Callable[[str], None] | None = None, graphs=None) -> torch.Tensor:
    """One optimizer step of ``recipe`` over the configured micro-batches.

    Returns this rank's mean training loss as a device scalar (reading it would synchronize).
    ``on_phase``: called with ``"start"`` first, then with each phase of :data:`STEP_PHASES` as
    the host finishes issuing it (the micro-batch phases once per micro-batch, or once per step
    when ``graphs`` replays them); see :class:`speedrun.evidence.host.PhaseRecorder`.
    ``graphs``: a :class:`speedrun.train.graphs.StepGraphs` that captures and replays the
    micro-batch loop (None: the eager loop)."""
    from speedrun.kernels import opaque

    mark = on_phase or (lambda _: None)
    mark("start")
    opaque.clear_pending()  # state of fused-kernel forwards whose backward never ran (a dropped loss)
    recipe.before_step(step)
    args = recipe.forward_args(step)
    mb = micro_batching(recipe.stages[recipe.stage_index(step)], cfg, info.world_size)
    accum = mb.count
    # "sum" (the record): backward of the per-token losses summed over each unmerged micro-batch,
    # over the accumulation count (upstream's loss.sum() * grad_scale), i.e. each micro-batch's
    # mean times `unit` tokens; merged micro-batches give the same.
    unit = mb.chunk if recipe.loss_reduction == "sum" else 1
    mark("setup")
    if graphs is None:
        total = microbatch.accumulate(model, recipe, microbatch.micro_batches(loader, accum), args, unit / accum,
                                      info.device, dtype, mark)
    else:
        batches = list(microbatch.micro_batches(loader, accum))
        mark("data")
        total = graphs.run(batches, args, unit / accum)
        for phase in ("forward", "backward", "after_backward"):
            mark(phase)
    flush_weights = getattr(model, "flush_weight_grads", None)
    if flush_weights is not None:  # the MLP bank's, summed in place (model.mlp_weight_grad)
        flush_weights()
    flush = getattr(model, "flush_embedding_grads", None)
    if flush is not None and recipe.embedding_grads_due(step):  # accumulated in place (model.embedding_grad)
        flush()
    if not recipe.grads_reduced_by_optimizer:
        distributed.all_reduce_mean_([p.grad for p in model.parameters() if p.grad is not None], info)
    mark("grad_reduce")
    recipe.optimizer_step(step)
    mark("optimizer")
    end_fp8_step = getattr(model, "end_fp8_step", None)
    if end_fp8_step is not None:  # next step's FP8 activation scales, the same on every rank
        end_fp8_step()
    mark("fp8_step_end")
    return total if unit == 1 else total / unit


def validation_batch_tokens(cfg: RunConfig, plans: list[MicroBatching]) -> int:
    """Tokens of each rank's validation batch: ``train.val_batch_tokens / train.batch_divisor``,
    or with 0 the largest unmerged micro-batch of ``plans`` (so merging leaves the metric as it is)."""
    want = cfg.train.val_batch_tokens
    if isinstance(want, bool) or not isinstance(want, int) or want < 0:
        raise ConfigError(f"train.val_batch_tokens must be an int >= 0 (0 = the largest micro-batch), got {want!r}")
    if want == 0:
        return max(p.chunk for p in plans)
    return max(1, want // max(1, cfg.train.batch_divisor))


@torch.no_grad()
def evaluate(model, val_files, cfg: RunConfig, info, dtype, per_rank: int, args: ForwardArgs = ForwardArgs(),
             max_batches: int | None = None) -> float:
    """Mean next-token cross entropy (nats) over ``val_tokens`` tokens of the validation shards
    (over the first ``max_batches`` batches only when given: the warmup's compile pass)."""
    from speedrun.data import ValLoader

    num = (cfg.train.val_tokens // (per_rank * info.world_size)) * per_rank * info.world_size
    if num == 0:
        raise ConfigError(f"train.val_tokens={cfg.train.val_tokens} is smaller than one validation batch "
                          f"({per_rank} tokens x {info.world_size} ranks)")
    if max_batches is not None:
        num = min(num, max_batches * per_rank * info.world_size)
    loader = ValLoader(val_files, num, per_rank, rank=info.rank, world_size=info.world_size,
                       bos_id=cfg.data.bos_id, vocab_size=cfg.model.vocab_size, device=info.device,
                       bigram_mod=getattr(model, "bigram_mod", None))
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=info.device, dtype=torch.float64)
    count = 0
    for batch in loader:
        with microbatch.autocast(info.device, dtype):
            losses = model.per_token_loss(batch, args)
        loss_sum += losses.double().sum()
        count += losses.numel()
    model.train(was_training)
    discard = getattr(model, "discard_fp8_step", None)
    if discard is not None:  # evaluation amaxes must not steer training's FP8 scales
        discard()
    stats = torch.stack([loss_sum, torch.tensor(float(count), device=info.device, dtype=torch.float64)])
    if info.enabled:
        torch.distributed.all_reduce(stats)
    return (stats[0] / stats[1]).item()


def _validation_variants(recipe, total_steps: int, val_every: int) -> dict[int, list[ForwardArgs]]:
    """Stage index -> the distinct evaluation arguments of the validations a run makes while the
    model is in that stage's state (a validation at step v follows training step v - 1).

    Compiled evaluation specialises on the windows and on the YaRN state, so the warmup runs each
    of these once; otherwise a mid-run or final validation recompiles (tens of seconds on a GPU)."""
    steps = sorted({*range(0, total_steps, val_every), total_steps} if val_every > 0 else {total_steps})
    out: dict[int, list[ForwardArgs]] = {}
    for v in steps:
        si = recipe.stage_index(max(v - 1, 0))
        args = recipe.eval_args(v, final=v == total_steps)
        if args not in out.setdefault(si, []):
            out[si].append(args)
    return out


def configure_kernel_launch(cfg: RunConfig) -> None:
    """Apply the process-wide kernel routing: ``train.triton_launch`` (how our Triton kernels are
    launched), ``train.mlp_gemm`` (the ReLU² GEMMs' route), ``train.ce_sigmoid`` (how the CE
    kernel evaluates the softcap's sigmoid) and ``train.ce_grad_layout`` (whether the CE kernel
    writes the transposed logit gradient too).  Arms of one benchmark process re-apply it before each step."""
    import sys

    from speedrun.kernels import launch

    choices = TRITON_LAUNCH_CHOICES
    if cfg.train.triton_launch not in choices:
        raise ConfigError(f"train.triton_launch must be one of {', '.join(choices)}, got {cfg.train.triton_launch!r}")
    if cfg.train.mlp_gemm not in MLP_GEMM_CHOICES:
        raise ConfigError(f"train.mlp_gemm must be one of {', '.join(MLP_GEMM_CHOICES)}, got {cfg.train.mlp_gemm!r}")
    if cfg.train.ce_sigmoid not in CE_SIGMOID_CHOICES:
        raise ConfigError(f"train.ce_sigmoid must be one of {', '.join(CE_SIGMOID_CHOICES)}, "
                          f"got {cfg.train.ce_sigmoid!r}")
    if cfg.train.ce_grad_layout not in CE_GRAD_LAYOUT_CHOICES:
        raise ConfigError(f"train.ce_grad_layout must be one of {', '.join(CE_GRAD_LAYOUT_CHOICES)}, "
                          f"got {cfg.train.ce_grad_layout!r}")
    launch.set_enabled(cfg.train.triton_launch == "cached")
    if (cfg.train.ce_sigmoid != "exact" or cfg.train.ce_grad_layout != "transpose"
            or "speedrun.kernels.cross_entropy" in sys.modules):
        from speedrun.kernels import cross_entropy

        cross_entropy.SIGMOID = cfg.train.ce_sigmoid
        cross_entropy.GRAD_LAYOUT = cfg.train.ce_grad_layout
    # Not imported yet means nothing changed its default: no import (it needs Triton) for "auto".
    if cfg.train.mlp_gemm != "auto" or "speedrun.kernels.mlp" in sys.modules:
        from speedrun.kernels import mlp

        mlp.GEMM_IMPL = mlp.DEFAULT_GEMM_IMPL if cfg.train.mlp_gemm == "auto" else cfg.train.mlp_gemm


def compile_model(model, cfg: RunConfig):
    """``model`` with its network compiled when ``train.compile`` (returns the same object).

    ``torch.compile(model)`` would compile only ``forward``, while training calls ``loss`` and
    ``per_token_loss``; the models instead compile their body themselves (``compile_body``),
    shapes static (one graph per stage shape, made in the warmup).  ``train.compile_cpp_wrapper``
    adds Inductor's ``cpp_wrapper`` option."""
    if cfg.train.compile:
        if not hasattr(model, "compile_body"):
            raise ConfigError(f"{type(model).__name__} has no compile_body(); set train.compile=false")
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
    as ``int[]``, which Inductor's C++ wrapper cannot pass to a Python op (torch 2.11 on the H200,
    seventh device session: "arg type List[int] is not yet supported by custom_op_wrapper", after
    compiling for minutes)."""
    from speedrun.attention import resolve_backend

    param = next(iter(model.parameters()), None)
    device = param.device if param is not None else torch.device("cpu")
    if resolve_backend(cfg.model.attention_backend, device) == "varlen":
        raise ConfigError("train.compile_cpp_wrapper cannot run with the varlen attention backend (torch's "
                          "varlen_attn op takes an int[] window, which Inductor's C++ wrapper cannot pass); "
                          "set model.attention_backend=flex or drop train.compile_cpp_wrapper")


def _compile_count() -> int:
    """Graphs dynamo has compiled so far in this process (frames that produced a graph)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def _rng_state(device: torch.device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def _tensors_to_cpu(obj):
    """``obj`` (nested dicts/lists of tensors and plain values) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _tensors_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors_to_cpu(v) for v in obj)
    return obj


def _gather_objects(obj, info) -> list:
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    torch.distributed.all_gather_object(out, obj)
    return out


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


class Clock:
    """The timed region's host clock.  ``start()`` restarts it after a device sync; ``pause()``
    is a context that stops it (synchronised on both sides) for work that is not training, such
    as capturing a CUDA graph and checking it.  ``window_start``: when the current logging window
    began, moved by pauses like ``t0``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t0 = self.window_start = 0.0
        self.paused_s = 0.0

    def start(self) -> None:
        _sync(self.device)
        self.t0 = self.window_start = time.perf_counter()

    @contextlib.contextmanager
    def pause(self):
        _sync(self.device)
        began = time.perf_counter()
        try:
            yield
        finally:
            _sync(self.device)
            held = time.perf_counter() - began
            self.t0 += held
            self.window_start += held
            self.paused_s += held


# ----------------------------------------------------------------------------------------------
# The run


def train(cfg: RunConfig, *, run_dir: Path | None = None, resume: bool = False, console: bool = True,
          stop_after: int | None = None, teardown: bool = True) -> TrainResult:
    """Run ``cfg`` to completion; with ``resume``, continue ``run_dir`` from its newest checkpoint.

    ``stop_after`` ends the run right after the checkpoint of that step, as if the process had been
    killed there (used to test resumption).  ``teardown=False`` keeps the process group for a
    caller that trains again in the same processes (``speedrun compare``).  SIGINT/SIGTERM during
    training write a checkpoint and end the run early (``TrainResult.signal``); a run that fails
    before its first step removes the folder it made, a later failure is recorded in its log
    (:class:`speedrun.train.faults.RunStart`).
    """
    start = faults.RunStart()
    try:
        return _train(cfg, start, run_dir=run_dir, resume=resume, console=console, stop_after=stop_after,
                      teardown=teardown)
    except BaseException as e:
        start.failed(e)
        raise


def _train(cfg: RunConfig, start: faults.RunStart, *, run_dir: Path | None, resume: bool, console: bool,
           stop_after: int | None, teardown: bool) -> TrainResult:
    from speedrun.config_check import validate_config
    from speedrun.data import TrainLoader

    validate_config(cfg)
    info = distributed.setup(cfg.train.device)
    device = info.device
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(cfg.train.dtype)
    if dtype is None:
        if cfg.train.dtype != "auto":
            raise ConfigError(f"train.dtype must be bf16, fp32 or auto, got {cfg.train.dtype!r}")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    train_files, val_files, tokenizer = resolve_data(cfg)  # bad data is refused before a run folder exists

    # Run folder: created by rank 0, shared with the others.
    made_here = not resume and run_dir is None  # a folder of our own, removed again if the start fails
    if resume:
        if run_dir is None or not (Path(run_dir) / "config.json").exists():
            raise ConfigError(f"cannot resume: {run_dir} is not a run folder (no config.json)")
        run_dir = Path(run_dir)
        faults.refuse_finished(run_dir)  # its summary and log stay as they are
    elif run_dir is None:
        name = [str(new_run_dir(cfg.out_dir, cfg.name)) if info.is_main else None]
        if info.enabled:
            torch.distributed.broadcast_object_list(name, src=0)
        run_dir = Path(name[0])
    else:
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
    log = RunLog(run_dir, enabled=info.is_main, console=console)
    start.folder(run_dir, created=made_here, log=log)
    if info.is_main and not resume:
        (run_dir / "config.json").write_text(cfg.to_json())

    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model).to(device)
    if dtype == torch.bfloat16 and hasattr(model, "cast_to_record_dtypes"):
        model.cast_to_record_dtypes(torch.bfloat16)  # bf16 weights, fp32 scalars (NorMuon tracks mantissas)
    recipe = build_recipe(cfg, model, info, tokenizer)
    optimizer = recipe.optimizer
    stages = recipe.stages
    plans = [micro_batching(s, cfg, info.world_size) for s in stages]
    val_batch = validation_batch_tokens(cfg, plans)
    max_tokens = max(p.tokens for p in plans)  # the largest training micro-batch
    if cfg.train.val_tokens < val_batch * info.world_size:  # fail before training, not at the first validation
        raise ConfigError(f"train.val_tokens={cfg.train.val_tokens} is smaller than one validation batch "
                          f"({val_batch} tokens x {info.world_size} ranks)")
    if hasattr(model, "warm_tables"):  # RoPE tables must exist before compiling (validation's too)
        recipe.max_tokens = max(max_tokens, val_batch)
        model.warm_tables(recipe.max_tokens, device)
    configure_kernel_launch(cfg)
    run_model = compile_model(model, cfg)
    bigram_mod = getattr(model, "bigram_mod", None)

    def make_loader(stage_index: int):
        s, plan = stages[stage_index], plans[stage_index]
        return TrainLoader(train_files, plan.chunk, s.max_seq_len, rank=info.rank,
                           world_size=info.world_size, bos_id=cfg.data.bos_id, vocab_size=cfg.model.vocab_size,
                           max_docs=cfg.train.max_docs or None, device=device, bigram_mod=bigram_mod,
                           merge=plan.merge)

    def set_loader_shape(stage_index: int) -> None:
        plan = plans[stage_index]
        loader.set_shape(plan.chunk, stages[stage_index].max_seq_len, cfg.train.max_docs or None, plan.merge)

    if not resume:
        log.print(f"seed: {cfg.train.seed}", console=False)
        log.print("config: " + json.dumps(cfg.to_dict(), sort_keys=True), console=False)
        log.print("=" * 100, console=False)
        for line in environment_lines(device):
            log.print(line, console=False)
        log.print(f"world_size: {info.world_size} grad_accum: {grad_accum_steps(cfg, info.world_size)} dtype: {dtype}",
                  console=False)
        if any(p.merge > 1 for p in plans):
            log.print("micro-batches per step by stage (train.min_micro_batch_tokens="
                      f"{cfg.train.min_micro_batch_tokens}): "
                      + ", ".join(f"{p.count} x {p.tokens}" for p in plans), console=False)
        log.print(f"train shards: {len(train_files)} ({train_files[0]} ...) val shards: {len(val_files)}", console=False)
        log.print(f"parameters: {sum(p.numel() for p in model.parameters()):,}", console=False)
        log.print("=" * 100, console=False)

    # Untimed warmup: run every stage's shapes so compilation happens here, then undo everything
    # (also before a resume, so a resumed run does not compile inside its timed region).
    if cfg.train.warmup_steps > 0:
        log.print(f"Compiling model and warming up kernels ({cfg.train.warmup_steps} steps per stage)")
        warmup_t0 = time.perf_counter()
        model_state = copy.deepcopy(model.state_dict())
        opt_state = copy.deepcopy(optimizer.state_dict())
        eval_variants = _validation_variants(recipe, cfg.train.steps, cfg.train.val_every)
        for si, stage in enumerate(stages):
            loader = make_loader(si)
            recipe.sync_to(stage.start_step)
            # a stage shorter than the warmup (e.g. a 1-step extension) warms only the steps it has
            end = stages[si + 1].start_step if si + 1 < len(stages) else cfg.train.steps
            for step in range(stage.start_step, min(stage.start_step + cfg.train.warmup_steps, end)):
                run_step(run_model, recipe, loader, step, cfg, info, dtype)
            loader.close()
            # Every validation the run will make, with this stage's model state (YaRN), on one batch.
            for args in eval_variants.get(si, []):
                evaluate(run_model, val_files, cfg, info, dtype, val_batch, args, max_batches=1)
        model.load_state_dict(model_state)
        reset_fp8 = getattr(model, "reset_fp8_state", None)
        if reset_fp8 is not None:  # the warmup's FP8 scales belong to weights that are gone
            reset_fp8()
        optimizer.load_state_dict(opt_state)
        optimizer.zero_grad()
        for name in ("discard_embedding_grads", "discard_weight_grads"):
            discard = getattr(model, name, None)
            if discard is not None:  # gradients of a warmup step not yet flushed (an even step's embeddings)
                discard()
        recipe.sync_to(0)
        torch.manual_seed(cfg.train.seed)
        _sync(device)
        warmup_s = time.perf_counter() - warmup_t0
        log.print(f"warmup (compilation included): {warmup_s:.1f}s")
        log.metric(event="warmup", seconds=warmup_s)
        log.print("Resetting Model", console=False)

    total_steps = cfg.train.steps
    start_step, train_ms, last_val = 0, 0.0, float("nan")
    stage_index = recipe.stage_index(0)
    loader = make_loader(stage_index)
    if resume:
        ckpt = load_latest(run_dir, map_location=device, warn=log.print)
        model.load_state_dict(ckpt["model"])
        fp8_states = ckpt.get("fp8") or []
        if len(fp8_states) not in (0, info.world_size):
            raise ConfigError(f"checkpoint holds FP8 state of {len(fp8_states)} ranks; this run has "
                              f"{info.world_size}: resume with the world size it was saved with")
        if fp8_states and fp8_states[info.rank]:
            model.load_fp8_state_dict(fp8_states[info.rank])  # before sync_to's refresh, which replays it
        start_step, train_ms = ckpt["step"], ckpt["train_time_ms"]
        if ckpt["optimizer"] is None:  # sharded: every rank kept its own part
            rank_state = load_rank_state(run_dir, start_step, info.rank, device)
            optimizer.load_state_dict(rank_state["optimizer"])
            emb = rank_state.get("embedding_grads") or {}
        else:
            optimizer.load_state_dict(ckpt["optimizer"])
            emb = ckpt.get("embedding_grads") or {}
        if hasattr(model, "load_embedding_grad_state"):
            model.load_embedding_grad_state(emb)
        stage_index = recipe.stage_index(start_step)
        loader.close()
        loader = make_loader(stage_index)
        loader.load_state_dict(ckpt["loaders"][info.rank])
        # The saved state carries the shape of the step before the checkpoint; a checkpoint taken
        # at a stage boundary resumes into the next stage's shape.
        set_loader_shape(stage_index)
        _set_rng_state(ckpt["rng"], device)
        recipe.sync_to(max(start_step - 1, 0))
        log.print(f"Resumed from step {start_step} (train_time {train_ms:.0f}ms)")

    sharded_optimizer = recipe.grads_reduced_by_optimizer and info.enabled

    def checkpoint(step: int) -> Path | None:
        # After an even step the embedding tables' gradients wait in this rank's fp32 accumulators
        # (model.embedding_grad): saved beside the optimizer state, which holds the other pending ones.
        emb = model.embedding_grad_state() if hasattr(model, "embedding_grad_state") else {}
        loaders = _gather_objects(loader.state_dict(), info)
        # One FP8 state per rank, each restored by its own rank (the activation scales are
        # step-synchronous, so the ranks' copies agree).
        fp8_states = _gather_objects(_tensors_to_cpu(model.fp8_state_dict()) if hasattr(model, "fp8_state_dict")
                                     else {}, info)
        if sharded_optimizer:
            save_rank_state(run_dir, step, info.rank, {"optimizer": optimizer.state_dict(), "embedding_grads": emb})
            distributed.barrier(info)
        path = None
        if info.is_main:
            path = save_checkpoint(run_dir, step, {
                "step": step, "train_time_ms": train_ms, "model": model.state_dict(),
                "fp8": fp8_states,
                "optimizer": None if sharded_optimizer else optimizer.state_dict(), "loaders": loaders,
                "embedding_grads": None if sharded_optimizer else emb,
                "rng": _rng_state(device), "config": cfg.to_dict(),
            })
        distributed.barrier(info)
        return path

    def validate(step: int) -> float:
        args = recipe.eval_args(step, final=step == total_steps)
        loss = evaluate(run_model, val_files, cfg, info, dtype, val_batch, args)
        avg = train_ms / max(step, 1)
        log.print(val_line(step, total_steps, loss, train_ms, avg))
        log.metric(event="val", step=step, val_loss=loss, train_time_ms=train_ms)
        return loss

    stopped = False
    guard = faults.RunGuard(cfg, [s.start_step for s in stages], info, run_dir)
    start.began()
    if start_step == 0 and cfg.train.val_every > 0:
        last_val = validate(0)
    elif start_step >= total_steps:  # stopped after its final checkpoint, before its summary was written
        last_val = validate(total_steps)
    compiled = cfg.train.compile or cfg.train.optimizer_compile
    compiles_before = _compile_count() if compiled else 0
    frozen = freeze_long_lived() if cfg.train.gc_freeze else 0
    if frozen:
        log.print(f"gc: {frozen:,} objects frozen before the timed region (train.gc_freeze)", console=False)
    clock = Clock(device)
    graphs = None
    if graphs_enabled(cfg.train.cuda_graphs, device):
        graphs = StepGraphs(run_model, recipe, device, dtype, pause=clock.pause, check=cfg.train.cuda_graph_check)
    clock.start()
    recipe.on_clock_start()
    window_steps = 0
    loss_acc = torch.zeros((), device=device)
    step_ms: dict[int, list[float]] = {i: [] for i in range(len(stages))}
    try:  # the heap is thawed (and the signal handlers restored) however the loop ends
        guard.install()
        for step in range(start_step, total_steps):
            si = recipe.stage_index(step)
            if si != stage_index:
                stage_index = si
                set_loader_shape(si)
            loss_acc += run_step(run_model, recipe, loader, step, cfg, info, dtype, graphs=graphs)
            window_steps += 1
            done = step + 1
            is_last = done == total_steps
            want_log = done % cfg.train.log_every == 0 or is_last
            want_val = is_last or (cfg.train.val_every > 0 and done % cfg.train.val_every == 0)
            want_ckpt = is_last or guard.checkpoint_due(done, synced=want_log or want_val) or done == stop_after
            if want_log or want_val or want_ckpt:
                _sync(device)
                now = time.perf_counter()
                train_ms += (now - clock.t0) * 1000
                step_avg = train_ms / done
                if window_steps == 1:  # one step since the clock last started: its own time
                    step_ms[si].append((now - clock.t0) * 1000)
                if want_log:
                    mean_loss = loss_acc.item() / window_steps
                    guard.check_loss(mean_loss, done)
                    tok_s = window_steps * stages[si].batch_tokens / max(now - clock.window_start, 1e-9)
                    eta = (total_steps - done) * step_avg / 1000
                    log.print(step_line(done, total_steps, train_ms, step_avg), console=False)
                    log.metric(event="train", step=done, loss=mean_loss, train_time_ms=train_ms, tokens_per_s=tok_s)
                    if log.console:
                        print(f"step {done}/{total_steps}  loss {mean_loss:.4f}  {tok_s:,.0f} tok/s  "
                              f"step_avg {step_avg:.1f}ms  eta {_fmt_eta(eta)}", flush=True)
                    loss_acc.zero_()
                    window_steps = 0
                elif want_val or want_ckpt:  # no validation or checkpoint of a diverged state (synchronized here)
                    guard.check_loss(loss_acc.item() / window_steps, done)
                if want_val:
                    last_val = validate(done)
                    guard.check_loss(last_val, done, "validation loss")
                if want_ckpt:
                    guard.checkpoint_written(checkpoint(done), done)
                if (done == stop_after or guard.stop) and not is_last:
                    stopped = True
                    if guard.stop:
                        log.print(guard.stop_message(done))
                    break
                clock.start()
    finally:
        guard.restore()
        if frozen:
            thaw()
    loader.close()

    if compiled:
        # Every shape should have been compiled in the warmup; a compile in the timed region costs
        # seconds and makes the run's time meaningless, so it is counted and reported.
        recompiles = _compile_count() - compiles_before
        log.print(f"compilations during the timed region: {recompiles}"
                  + ("" if recompiles == 0 else " (WARNING: the warmup missed a shape; this run's time includes compiling)"))
        log.metric(event="recompiles", count=recompiles)
    for line in stage_time_lines(step_ms, stages, cfg):
        log.print(line)
    if graphs is not None:
        summary = graphs.summary()
        log.print(f"cuda graphs: {summary['replayed_steps']} steps replayed, {summary['eager_steps']} eager, "
                  f"{summary['captures']} captured in {summary['capture_s']:.1f}s outside the clock (worst "
                  f"self-check relative error {summary['check_worst_rel_err']:.2g})"
                  + "".join(f"; {c}" for c in summary["key_changes"]))
        log.metric(event="cuda_graphs", **summary)
    sample = ""
    if not stopped and info.is_main:
        if device.type == "cuda":
            # the self-checks' snapshots are not the run's memory: their peaks are left out
            peak = max(torch.cuda.max_memory_allocated(device),
                       graphs.stats.peak_allocated if graphs is not None else 0) // 2**20
            reserved = torch.cuda.max_memory_reserved(device) // 2**20
            log.print(f"peak memory allocated: {peak} MiB reserved: {reserved} MiB")
        sample = _sample(model, tokenizer, cfg, device, stages[-1].window_short)
        if sample:
            (run_dir / "sample.txt").write_text(sample, encoding="utf-8")
            log.print("sample: " + json.dumps(sample, ensure_ascii=False))
        summary = {"steps": total_steps, "final_val_loss": last_val, "train_time_ms": train_ms,
                   "seed": cfg.train.seed, "run_dir": str(run_dir)}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log.close()
    if teardown:
        distributed.teardown()
    return TrainResult(run_dir, total_steps, last_val, train_ms, sample, stopped, info.rank,
                       guard.signal_name if stopped and guard.stop else "")


def stage_time_lines(step_ms: dict[int, list[float]], stages, cfg: RunConfig, skip: int = 2) -> list[str]:
    """One line per stage: median and IQR of the single-step times (ms, host clock around a
    synchronized step, so only steps timed alone count: ``log_every=1`` times every step) and
    global tokens/s at the median.  The first ``skip`` steps of a stage (loader reshaping, first
    use of a shape after the warmup) are left out when the stage has enough others."""
    import numpy as np

    lines = []
    for si, times in step_ms.items():
        if len(times) > skip + 3:
            times = times[skip:]
        if not times:
            continue
        q1, med, q3 = np.percentile(times, [25, 50, 75])
        tok_s = stages[si].batch_tokens / (med / 1000)
        lines.append(f"stage {si}: {len(times)} timed steps, median {med:.1f}ms/step (IQR {q1:.1f}-{q3:.1f}), "
                     f"{tok_s:,.0f} tokens/s, batch {stages[si].batch_tokens} tokens, seq {stages[si].max_seq_len}")
    return lines


def _sample(model, tokenizer, cfg: RunConfig, device, window: int | None) -> str:
    if tokenizer is None or cfg.train.sample_tokens <= 0 or not hasattr(model, "generate"):
        return ""
    g = torch.Generator(device=device).manual_seed(cfg.train.seed)
    prompt = [tokenizer.bos_id] + tokenizer.encode(cfg.train.sample_prompt)
    was_training = model.training
    model.eval()
    with microbatch.autocast(device, torch.bfloat16 if device.type == "cuda" else torch.float32):
        ids = model.generate(prompt, cfg.train.sample_tokens, generator=g, window=window)
    model.train(was_training)
    return cfg.train.sample_prompt + tokenizer.decode(ids)


def config_with(cfg: RunConfig, **train_fields) -> RunConfig:
    """A copy of ``cfg`` with some train fields replaced (helper for tests and tools)."""
    new = copy.deepcopy(cfg)
    new.train = dataclasses.replace(new.train, **train_fields)
    return new
