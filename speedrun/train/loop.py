"""The training loop: untimed warmup, timed region, periodic validation, checkpoints, resume.

One function, :func:`train`, runs a :class:`~speedrun.config.RunConfig` from start to finish (or
continues one from its newest checkpoint) on one process or under torchrun: it builds the run
(:func:`speedrun.train.builder.build_run`), then :func:`warm_up_and_reset`, :func:`resume_from`
(when resuming) and :func:`timed_loop`, each step one :func:`run_step`.  The clock covers
data loading, forward, backward, communication and the optimizer step; it stops (after a device
synchronize) around validation and checkpointing.  Logged losses and step times are read a step
late, without a synchronisation (:mod:`speedrun.train.steplog`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from speedrun import distributed
from speedrun.config import RunConfig
from speedrun.errors import ConfigError
from speedrun.model.interface import ForwardArgs
from speedrun.train.builder import (  # noqa: F401  (the set-up helpers' old home re-exports them)
    MicroBatching,
    Run,
    build_run,
    compile_model,
    grad_accum_steps,
    kernel_options,
    micro_batching,
    resolve_data,
    resolve_dtype,
    tokens_per_rank,
    validation_batch_tokens,
)
from speedrun.train import faults, microbatch
from speedrun.train.checkpoint import load_latest, load_rank_state, save_checkpoint, save_rank_state
from speedrun.train.collector import freeze_long_lived, thaw
from speedrun.train.graphs import StepGraphs, graphs_enabled
from speedrun.train.runlog import RunLog, environment_lines, new_run_dir, step_line, val_line
from speedrun.train.steplog import StepLog


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
# Steps


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


STEP_PHASES = ("setup", "data", "forward", "backward", "after_backward", "fp8_step_end", "grad_reduce", "optimizer",
               "fp8_refresh")
# A replayed step's micro-batch phases instead of forward/backward/after_backward (see StepGraphs.run):
# the step key, the inputs copied in, the gradient buffers bound and the graph launched, then the
# host bookkeeping set back and the loss copied out
GRAPH_PHASES = ("graph_key", "graph_inputs", "graph_launch", "graph_after")


def run_step(model, recipe, loader, step: int, cfg: RunConfig, info, dtype,
             on_phase: Callable[[str], None] | None = None, graphs=None) -> torch.Tensor:
    """One optimizer step of ``recipe`` over the configured micro-batches.

    Returns this rank's mean training loss as a device scalar (reading it would synchronize).
    ``on_phase``: called with ``"start"`` first, then with each phase of :data:`STEP_PHASES` as
    the host finishes issuing it (the micro-batch phases once per micro-batch; when ``graphs``
    runs the loop, :data:`GRAPH_PHASES` once per step instead, or "forward" alone for a step it
    captures or runs eagerly); see :class:`speedrun.evidence.host.PhaseRecorder`.
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
    # a replayed step copies its batches from the host into its graph's buffers: no device copy
    # of them here (graphs.run moves them where a step runs eagerly)
    fetched = microbatch.micro_batches(loader, accum, on_batch=recipe.note_batch, on_host=graphs is not None)
    if graphs is None:
        total = microbatch.accumulate(model, fetched, args, unit / accum, info.device, dtype, mark)
        total = total if unit == 1 else total / unit
    else:
        batches = list(fetched)
        mark("data")
        total = graphs.run(batches, args, unit / accum, mark, divisor=unit)
    if graphs is None or not graphs.ends_step:
        # next step's FP8 activation scales from this step's amaxes, the same on every rank (an
        # all-reduce on several); it reads and writes no tensor the update below touches
        model.end_step()
    mark("fp8_step_end")
    model.flush_weight_grads()  # the MLP bank's, summed in place (model.mlp_weight_grad)
    # the embedding tables' gradients, accumulated in place (model.embedding_grad): their flush
    # is device work the update launches first (inside its CUDA graph when it has one)
    flush = model.prepare_embedding_flush() if recipe.embedding_grads_due(step) else None
    if not recipe.grads_reduced_by_optimizer:
        if flush is not None:
            flush.launch()
            flush.settle()
            flush = None
        distributed.all_reduce_mean_([p.grad for p in model.parameters() if p.grad is not None], info)
    mark("grad_reduce")
    recipe.optimizer_step(step, mark, before=flush)  # marks "optimizer", then "fp8_refresh"
    # the next step's batches are built from here on, while the caller waits for the device rather
    # than while this thread issues the step (see TrainLoader.build_ahead)
    loader.build_ahead()
    return total


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
                       bigram_mod=model.bigram_mod)
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
    model.after_evaluation()  # evaluation amaxes must not steer training's FP8 scales
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
    # (a checkpoint loaded with map_location=cuda holds its RNG states on the GPU too; the
    # generators take CPU byte tensors)
    torch.set_rng_state(state["cpu"].cpu())
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)


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
    info = distributed.setup(cfg.train.device)
    if resume and (run_dir is None or not (Path(run_dir) / "config.json").exists()):
        raise ConfigError(f"cannot resume: {run_dir} is not a run folder (no config.json)")
    run = build_run(cfg, info)  # bad config or data is refused before a run folder exists
    if cfg.train.val_tokens < run.val_batch * info.world_size:  # fail before training, not at the first validation
        raise ConfigError(f"train.val_tokens={cfg.train.val_tokens} is smaller than one validation batch "
                          f"({run.val_batch} tokens x {info.world_size} ranks)")
    if resume:
        faults.refuse_finished(Path(run_dir))  # its summary and log stay as they are
    made_here = not resume and run_dir is None  # a folder of our own, removed again if the start fails
    run_dir = _run_folder(cfg, info, run_dir, resume)
    log = RunLog(run_dir, enabled=info.is_main, console=console)
    start.folder(run_dir, created=made_here, log=log)
    if info.is_main and not resume:
        (run_dir / "config.json").write_text(cfg.to_json())
        _log_header(run, log)

    # Untimed warmup (also before a resume, so a resumed run does not compile inside its timed region).
    if cfg.train.warmup_steps > 0:
        warm_up_and_reset(run, log)
    if resume:
        progress = resume_from(run, run_dir, log)
    else:
        progress = Progress(0, 0.0, run.recipe.stage_index(0), run.make_loader(run.recipe.stage_index(0)))
    guard = faults.RunGuard(cfg, [s.start_step for s in run.stages], info, run_dir)
    start.began()
    stopped, last_val, step_ms, graphs = timed_loop(run, run_dir, log, progress, stop_after, guard)

    if cfg.train.compile or cfg.train.optimizer_compile:
        # Every shape should have been compiled in the warmup; a compile in the timed region costs
        # seconds and makes the run's time meaningless, so it is counted and reported.
        log.print(f"compilations during the timed region: {progress.recompiles}"
                  + ("" if progress.recompiles == 0
                     else " (WARNING: the warmup missed a shape; this run's time includes compiling)"))
        log.metric(event="recompiles", count=progress.recompiles)
    for line in stage_time_lines(step_ms, run.stages, cfg):
        log.print(line)
    if graphs is not None:
        summary = graphs.summary()
        log.print(f"cuda graphs: {summary['replayed_steps']} steps replayed, {summary['eager_steps']} eager, "
                  f"{summary['captures']} captured in {summary['capture_s']:.1f}s outside the clock (worst "
                  f"self-check relative error {summary['check_worst_rel_err']:.2g}, the eager loop's own "
                  f"{summary['check_eager_noise']:.2g})" + "".join(f"; {c}" for c in summary["key_changes"]))
        log.metric(event="cuda_graphs", **summary)
    sample = ""
    if not stopped and info.is_main:
        sample = _finish(run, run_dir, log, last_val, progress.train_ms, graphs)
    log.close()
    if teardown:
        distributed.teardown()
    return TrainResult(run_dir, cfg.train.steps, last_val, progress.train_ms, sample, stopped, info.rank,
                       guard.signal_name if stopped and guard.stop else "")


def _run_folder(cfg: RunConfig, info, run_dir: Path | None, resume: bool) -> Path:
    """The run's folder: created by rank 0, shared with the others (an existing one on resume)."""
    if resume:
        return Path(run_dir)
    if run_dir is None:
        name = [str(new_run_dir(cfg.out_dir, cfg.name)) if info.is_main else None]
        if info.enabled:
            torch.distributed.broadcast_object_list(name, src=0)
        return Path(name[0])
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _log_header(run: Run, log: RunLog) -> None:
    """The log's preamble: seed, config, environment, split of the step, data, parameter count."""
    cfg, info, plans = run.cfg, run.info, run.plans
    log.print(f"seed: {cfg.train.seed}", console=False)
    log.print("config: " + json.dumps(cfg.to_dict(), sort_keys=True), console=False)
    log.print("=" * 100, console=False)
    for line in environment_lines(info.device):
        log.print(line, console=False)
    log.print(f"world_size: {info.world_size} grad_accum: {grad_accum_steps(cfg, info.world_size)} dtype: {run.dtype}",
              console=False)
    if any(p.merge > 1 for p in plans):
        log.print("micro-batches per step by stage (train.min_micro_batch_tokens="
                  f"{cfg.train.min_micro_batch_tokens}): "
                  + ", ".join(f"{p.count} x {p.tokens}" for p in plans), console=False)
    log.print(f"train shards: {len(run.train_files)} ({run.train_files[0]} ...) val shards: {len(run.val_files)}",
              console=False)
    log.print(f"parameters: {sum(p.numel() for p in run.model.parameters()):,}", console=False)
    log.print(f"attention backend: {attention_backend_used(cfg, info.device)} "
              f"(model.attention_backend={cfg.model.attention_backend})", console=False)
    log.print("=" * 100, console=False)


def attention_backend_used(cfg: RunConfig, device: torch.device) -> str:
    """The attention backend the model runs on ``device``: ``model.attention_backend`` with
    ``auto`` resolved (the preference order and self-checks of :mod:`speedrun.attention`)."""
    from speedrun.attention import resolve_backend

    return resolve_backend(cfg.model.attention_backend, device)


def warm_up_and_reset(run: Run, log: RunLog) -> None:
    """Run ``train.warmup_steps`` steps of every stage's shapes and one batch of every validation
    the run will make (compilation and autotuning happen here), then undo everything: weights,
    optimizer state, FP8 scales, pending gradients, schedule state and the random seed."""
    cfg, model, optimizer, recipe, stages = run.cfg, run.model, run.optimizer, run.recipe, run.stages
    log.print(f"Compiling model and warming up kernels ({cfg.train.warmup_steps} steps per stage)")
    warmup_t0 = time.perf_counter()
    model_state = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(optimizer.state_dict())
    eval_variants = _validation_variants(recipe, cfg.train.steps, cfg.train.val_every)
    for si, stage in enumerate(stages):
        loader = run.make_loader(si)
        recipe.sync_to(stage.start_step)
        # a stage shorter than the warmup (e.g. a 1-step extension) warms only the steps it has
        for step in range(stage.start_step, min(stage.start_step + cfg.train.warmup_steps, run.stage_end(si))):
            run_step(run.run_model, recipe, loader, step, cfg, run.info, run.dtype)
        loader.close()
        # Every validation the run will make, with this stage's model state (YaRN), on one batch.
        for args in eval_variants.get(si, []):
            evaluate(run.run_model, run.val_files, cfg, run.info, run.dtype, run.val_batch, args, max_batches=1)
    model.load_state_dict(model_state)
    optimizer.load_state_dict(opt_state)
    optimizer.zero_grad()
    model.reset_after_warmup()
    recipe.sync_to(0)
    torch.manual_seed(cfg.train.seed)
    _sync(run.device)
    warmup_s = time.perf_counter() - warmup_t0
    log.print(f"warmup (compilation included): {warmup_s:.1f}s")
    log.metric(event="warmup", seconds=warmup_s)
    log.print("Resetting Model", console=False)


@dataclass
class Progress:
    """Where the timed run stands: the next step, the training time so far (ms), the stage the
    loader is shaped for, the loader, and the compilations seen in the timed region."""

    step: int
    train_ms: float
    stage_index: int
    loader: object
    recompiles: int = 0


def resume_from(run: Run, run_dir: Path, log: RunLog) -> Progress:
    """Restore the newest checkpoint of ``run_dir`` into ``run``: weights, the model's extra state
    (FP8 scales, pending embedding gradients), optimizer, loader position, random state and
    schedule state."""
    info, device, model, optimizer = run.info, run.device, run.model, run.optimizer
    ckpt = load_latest(run_dir, map_location=device, warn=log.print)
    model.load_state_dict(ckpt["model"])
    fp8_states = ckpt.get("fp8") or []
    if len(fp8_states) not in (0, info.world_size):
        raise ConfigError(f"checkpoint holds FP8 state of {len(fp8_states)} ranks; this run has "
                          f"{info.world_size}: resume with the world size it was saved with")
    start_step, train_ms = ckpt["step"], ckpt["train_time_ms"]
    if ckpt["optimizer"] is None:  # sharded: every rank kept its own part
        rank_state = load_rank_state(run_dir, start_step, info.rank, device)
        optimizer.load_state_dict(rank_state["optimizer"])
        emb = rank_state.get("embedding_grads") or {}
    else:
        optimizer.load_state_dict(ckpt["optimizer"])
        emb = ckpt.get("embedding_grads") or {}
    # before sync_to's FP8 refresh, which replays the saved scales
    model.load_extra_state({"fp8": fp8_states[info.rank] if fp8_states else {}, "embedding_grads": emb})
    stage_index = run.recipe.stage_index(start_step)
    loader = run.make_loader(stage_index)
    loader.load_state_dict(ckpt["loaders"][info.rank])
    # The saved state carries the shape of the step before the checkpoint; a checkpoint taken
    # at a stage boundary resumes into the next stage's shape.
    run.set_loader_shape(loader, stage_index)
    _set_rng_state(ckpt["rng"], device)
    run.recipe.sync_to(max(start_step - 1, 0))
    log.print(f"Resumed from step {start_step} (train_time {train_ms:.0f}ms)")
    return Progress(start_step, train_ms, stage_index, loader)


def save_run_checkpoint(run: Run, run_dir: Path, step: int, progress: Progress) -> Path | None:
    """Checkpoint after ``step``: weights, optimizer (sharded: one file per rank), the model's extra
    state (FP8 scales: one per rank, each restored by its own rank; pending embedding gradients,
    saved beside the optimizer state, which holds the other pending ones), loaders, random state.
    Returns the checkpoint's path on rank 0 (None elsewhere)."""
    info, model, optimizer = run.info, run.model, run.optimizer
    sharded_optimizer = run.recipe.grads_reduced_by_optimizer and info.enabled
    extra = model.extra_state()
    emb = extra["embedding_grads"]
    loaders = _gather_objects(progress.loader.state_dict(), info)
    fp8_states = _gather_objects(_tensors_to_cpu(extra["fp8"]), info)
    if sharded_optimizer:
        save_rank_state(run_dir, step, info.rank, {"optimizer": optimizer.state_dict(), "embedding_grads": emb})
        distributed.barrier(info)
    path = None
    if info.is_main:
        path = save_checkpoint(run_dir, step, {
            "step": step, "train_time_ms": progress.train_ms, "model": model.state_dict(),
            "fp8": fp8_states,
            "optimizer": None if sharded_optimizer else optimizer.state_dict(), "loaders": loaders,
            "embedding_grads": None if sharded_optimizer else emb,
            "rng": _rng_state(run.device), "config": run.cfg.to_dict(),
        })
    distributed.barrier(info)
    return path


class Clock:
    """The timed region's host clock.  ``start()`` restarts it after a device sync; ``pause()``
    is a context that stops it (synchronised on both sides) for work that is not training, such
    as capturing a CUDA graph and checking it.  ``generation`` changes at every start and at the
    end of every pause: step ends of one generation lie in one uninterrupted window
    (:class:`speedrun.train.steplog.StepLog`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t0 = 0.0
        self.paused_s = 0.0
        self.generation = 0

    def start(self) -> None:
        _sync(self.device)
        self.t0 = time.perf_counter()
        self.generation += 1

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
            self.paused_s += held
            self.generation += 1


def timed_loop(run: Run, run_dir: Path, log: RunLog, progress: Progress, stop_after: int | None,
               guard: faults.RunGuard) -> tuple[bool, float, dict[int, list[float]], StepGraphs | None]:
    """The timed region from ``progress.step`` to the end (or to ``stop_after``, or a signal),
    validating, logging and checkpointing on the way with the clock stopped.  Returns (stopped
    early, the last validation loss, single-step times in ms by stage, the CUDA-graph steps or
    None); ``progress`` is advanced in place."""
    cfg, info, recipe, stages, device = run.cfg, run.info, run.recipe, run.stages, run.device
    total_steps = cfg.train.steps
    last_val = float("nan")

    def validate(step: int) -> float:
        args = recipe.eval_args(step, final=step == total_steps)
        loss = evaluate(run.run_model, run.val_files, cfg, info, run.dtype, run.val_batch, args)
        avg = progress.train_ms / max(step, 1)
        log.print(val_line(step, total_steps, loss, progress.train_ms, avg))
        log.metric(event="val", step=step, val_loss=loss, train_time_ms=progress.train_ms)
        return loss

    stopped = False
    if progress.step == 0 and cfg.train.val_every > 0:
        last_val = validate(0)
    elif progress.step >= total_steps:  # stopped after its final checkpoint, before its summary was written
        last_val = validate(total_steps)
    compiled = cfg.train.compile or cfg.train.optimizer_compile
    compiles_before = _compile_count() if compiled else 0
    frozen = freeze_long_lived() if cfg.train.gc_freeze else 0
    if frozen:
        log.print(f"gc: {frozen:,} objects frozen before the timed region (train.gc_freeze)", console=False)
    clock = Clock(device)
    graphs = None
    if graphs_enabled(cfg.train.cuda_graphs, device):
        graphs = StepGraphs(run.run_model, recipe, device, run.dtype, pause=clock.pause,
                            check=cfg.train.cuda_graph_check, capture_updates=cfg.train.cuda_graph_optimizer,
                            ends_step=run.info.world_size == 1)
    clock.start()
    recipe.on_clock_start()
    steplog = StepLog(device, clock)
    steplog.start_window()
    window_steps = 0
    last_line_ms = progress.train_ms  # training time at the last logged line (for its tokens/s)
    loss_acc = torch.zeros((), device=device)
    step_ms: dict[int, list[float]] = {i: [] for i in range(len(stages))}
    try:  # the heap is thawed (and the signal handlers restored) however the loop ends
        guard.install()
        for step in range(progress.step, total_steps):
            si = recipe.stage_index(step)
            if si != progress.stage_index:
                progress.stage_index = si
                run.set_loader_shape(progress.loader, si)
            loss_acc += run_step(run.run_model, recipe, progress.loader, step, cfg, info, run.dtype, graphs=graphs)
            window_steps += 1
            done = step + 1
            progress.step = done
            is_last = done == total_steps
            want_log = done % cfg.train.log_every == 0 or is_last
            want_val = is_last or (cfg.train.val_every > 0 and done % cfg.train.val_every == 0)
            want_ckpt = is_last or guard.checkpoint_due(done, agree=want_log or want_val) or done == stop_after
            if want_log:
                steplog.record(done, si, loss_acc / window_steps, window_steps)
                loss_acc.zero_()
                window_steps = 0
            else:
                steplog.record(done, si)
            # Read what the device has finished: at a stop (validation, checkpoint) everything;
            # else all but this step, which keeps the GPU busy while the host reads and logs.
            stop_here = want_val or want_ckpt
            for fin in steplog.finished(keep=0 if stop_here else 1):
                if fin.step_ms is not None:
                    step_ms[fin.stage].append(fin.step_ms)
                if fin.loss is None:
                    continue
                guard.check_loss(fin.loss, fin.step)
                line_ms = progress.train_ms + (time.perf_counter() - clock.t0) * 1000
                tok_s = fin.steps_logged * stages[fin.stage].batch_tokens / max(line_ms - last_line_ms, 1e-6) * 1000
                last_line_ms = line_ms
                log.print(step_line(fin.step, total_steps, line_ms, line_ms / fin.step), console=False)
                log.metric(event="train", step=fin.step, loss=fin.loss, train_time_ms=line_ms, tokens_per_s=tok_s)
                if log.console:
                    eta = (total_steps - fin.step) * line_ms / fin.step / 1000
                    print(f"step {fin.step}/{total_steps}  loss {fin.loss:.4f}  {tok_s:,.0f} tok/s  "
                          f"step_avg {line_ms / fin.step:.1f}ms  eta {_fmt_eta(eta)}", flush=True)
            if not stop_here:
                continue
            _sync(device)
            progress.train_ms += (time.perf_counter() - clock.t0) * 1000
            if window_steps:  # no validation or checkpoint of a diverged state (synchronized here)
                guard.check_loss(loss_acc.item() / window_steps, done)
            if want_val:
                last_val = validate(done)
                guard.check_loss(last_val, done, "validation loss")
            if want_ckpt:
                guard.checkpoint_written(save_run_checkpoint(run, run_dir, done, progress), done)
            if (done == stop_after or guard.stop) and not is_last:
                stopped = True
                if guard.stop:
                    log.print(guard.stop_message(done))
                break
            clock.start()
            steplog.start_window()
    finally:
        guard.restore()
        if frozen:
            thaw()
    progress.loader.close()
    if compiled:
        progress.recompiles = _compile_count() - compiles_before
    return stopped, last_val, step_ms, graphs


def _finish(run: Run, run_dir: Path, log: RunLog, last_val: float, train_ms: float,
            graphs: StepGraphs | None = None) -> str:
    """Rank 0 after a completed run: peak memory, the closing sample, summary.json; returns the sample."""
    cfg, device = run.cfg, run.device
    if device.type == "cuda":
        # the graph self-checks' snapshots are not the run's memory: their peaks are left out
        peak = max(torch.cuda.max_memory_allocated(device), graphs.stats.peak_allocated if graphs else 0) // 2**20
        reserved = torch.cuda.max_memory_reserved(device) // 2**20
        # a graph pool's free blocks are reserved, not allocated: its size is the graphs' share
        pool = f" (CUDA graph pool: {graphs.pool_bytes() // 2**20} MiB)" if graphs else ""
        log.print(f"peak memory allocated: {peak} MiB reserved: {reserved} MiB{pool}")
    sample = _sample(run.model, run.tokenizer, cfg, device, run.stages[-1].window_short)
    if sample:
        (run_dir / "sample.txt").write_text(sample, encoding="utf-8")
        log.print("sample: " + json.dumps(sample, ensure_ascii=False))
    summary = {"steps": cfg.train.steps, "final_val_loss": last_val, "train_time_ms": train_ms,
               "seed": cfg.train.seed, "run_dir": str(run_dir)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return sample



def stage_time_lines(step_ms: dict[int, list[float]], stages, cfg: RunConfig, skip: int = 2) -> list[str]:
    """One line per stage: median and IQR of the step times (ms: from the previous step's end to
    this one's on the device, :class:`speedrun.train.steplog.StepLog`; steps that held a pause,
    such as a CUDA-graph capture, left out) and global tokens/s at the median.  The first ``skip``
    steps of a stage (loader reshaping, first use of a shape after the warmup) are left out when
    the stage has enough others."""
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
    if tokenizer is None or cfg.train.sample_tokens <= 0 or not model.generates_text:
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
