"""``speedrun bench step``: time one optimizer step of several arms at one stage's shapes.

Each arm (a preset plus overrides, see :mod:`speedrun.evidence.arms`) gets its own model,
optimizer and loader, built once with the same pieces :func:`speedrun.train.loop.train` uses.
Every arm is warmed up first (compilation and autotuning happen there, untimed); then the arms
are timed interleaved, the order rotating each round (``A B C``, ``B C A``, ``C A B``, ...), so
slow drifts of the node (clocks, temperature) hit every arm alike and no arm always follows the
same one (a fixed order has confounded a difference of a few percent).  A step is
timed from an idle device: synchronize, record a CUDA event, run
:func:`~speedrun.train.loop.run_step` (all ``grad_accum`` micro-batches, the gradient
all-reduce and the optimizer update of the run's recipe), record a second event, synchronize.  On the CPU the step is
timed with ``time.perf_counter``.  ``--as-rank-of N`` (``simulate_world``) runs rank 0's share of an
N-rank step in this one process, collectives replaced by no-ops (:mod:`speedrun.optim.simcomms`),
to project an N-GPU step on one GPU.  ``chain`` K > 1 issues K steps back to back per sample and
reports their mean, the host free to run ahead into the next step as in a training run that does
not synchronize per step.  Under torchrun every rank times its steps and a step's time is
the maximum over ranks (the slowest rank sets the pace).

Reported per arm: median, quartiles and IQR of the step time (ms), global tokens per second at
the median and, on CUDA, the arm's memory: ``resident_mib`` (what building and warming it up left
allocated: weights, optimizer state, FP8 caches), ``step_peak_mib`` (the most a timed step
allocated above what was allocated when it started), ``graph_pool_mib`` (with CUDA graphs: what
the graphs' memory pool grew by while the arm captured its steps; the arms share one pool, so this
is the whole pool for the first arm with graphs and, for a later one, only what its steps need
beyond the arms before it: bench an arm first or alone for its own figure) and their sum
``peak_mib``, the arm's peak as if it ran alone (the arms share one process, so the device's
own peak mixes them); for each
arm after the first, the ratio of its median to the first arm's median with
a paired bootstrap 95% confidence interval (repetitions resampled with replacement, the same
indices for both arms, because repetition ``i`` of both arms ran back to back).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from speedrun import distributed
from speedrun.config import RunConfig, Stage
from speedrun.errors import ConfigError
from speedrun.evidence.arms import ArmSpec
from speedrun.train.collector import CollectionMeter, CollectionStats, freeze_long_lived, thaw

MIN_STEPS = 20  # the CLI's floor; fewer steps make the median and the bootstrap too coarse
# train fields that act on the whole process (the heap freeze, the Triton launch path): one value for all arms
PROCESS_WIDE = ("gc_freeze", "triton_launch")


# ----------------------------------------------------------------------------------------------
# A training session: the pieces of train() for one arm, at one stage's shapes


@dataclass
class Session:
    """One arm ready to step at one stage's shapes: model (and its compiled form), the training
    recipe (optimizer, schedule), a loader.  Steps cycle through the stage's own step indices so
    the schedule never leaves the stage."""

    name: str
    cfg: RunConfig
    stage: Stage
    stage_end: int
    model: torch.nn.Module
    run_model: Any
    recipe: Any
    loader: Any
    info: Any
    dtype: torch.dtype
    count: int = 0
    times_ms: dict[int, list[float]] = field(default_factory=dict)  # per chain length (see time_step)
    resident_bytes: int = 0  # allocated by building and warming up this arm (CUDA)
    step_peak_bytes: int = 0  # max over timed steps of (peak during the step - allocated at its start)
    pool_bytes: int = 0  # what the shared CUDA-graph pool grew by while this arm captured its steps
    host_steps: list = field(default_factory=list)  # speedrun.evidence.host.StepTrace per traced step
    syncs: list | None = None  # synchronising calls of one step (find_syncs), None when not scanned
    graphs: Any = None  # speedrun.train.graphs.StepGraphs with train.cuda_graphs, as train() runs
    losses: list = field(default_factory=list)  # every step's loss (device scalars, read after timing)
    # a simulated rank's collectives: bytes per timed step by kind (SimulatedComms.traffic), else None
    comm_bytes_per_step: dict | None = None

    @property
    def optimizer(self):
        return self.recipe.optimizer

    def comm_traffic(self) -> dict[str, int] | None:
        """Bytes the simulated rank's collectives would have moved so far, by kind
        (:attr:`speedrun.optim.simcomms.SimulatedComms.traffic`); None for a real rank."""
        traffic = getattr(getattr(getattr(self.recipe, "optimizer", None), "comms", None), "traffic", None)
        return None if traffic is None else dict(traffic)

    def step(self, on_phase=None) -> torch.Tensor:
        """One optimizer step (see :func:`speedrun.train.loop.run_step`, which calls ``on_phase``);
        returns the loss as a device scalar."""
        from speedrun.train.loop import run_step

        span = max(1, self.stage_end - self.stage.start_step)
        step = self.stage.start_step + self.count % span
        loss = run_step(self.run_model, self.recipe, self.loader, step, self.cfg, self.info, self.dtype,
                        on_phase=on_phase, graphs=self.graphs)
        self.count += 1
        self.losses.append(loss.detach())
        return loss

    def warmup_steps(self, requested: int) -> int:
        """How many untimed steps precede the measured ones: ``requested``, or more with CUDA
        graphs, so that every step key of the stage is captured and the measured steps replay
        (a capture's eager runs and self-check are no step's cost)."""
        return requested if self.graphs is None else max(requested, self.graphs.steps_until_replay)

    def close(self) -> None:
        self.loader.close()


def build_session(name: str, cfg: RunConfig, stage_index: int, info, simulate_world: int | None = None,
                  capturer=None) -> Session:
    """``cfg``'s run (:func:`speedrun.train.builder.build_run`, as :func:`speedrun.train.loop.train`
    builds it) with the schedule at ``stages_of(cfg)[stage_index]``'s first step and a loader at
    that stage's shapes.

    ``simulate_world`` N: build rank 0 of an N-rank run in this one process instead
    (:func:`speedrun.distributed.simulated_rank`): its micro-batches, its loader slice and its 1/N
    of the optimizer, collectives replaced by no-ops (:mod:`speedrun.optim.simcomms`).
    ``capturer``: the CUDA-graph stream and memory pool to share with other sessions
    (:class:`speedrun.train.graphs.StepGraphs`)."""
    from speedrun.train.builder import build_run, grad_accum_steps
    from speedrun.train.graphs import StepGraphs, graphs_enabled

    if simulate_world is not None:
        info = distributed.simulated_rank(info, simulate_world)
        grad_accum_steps(cfg, info.world_size)  # refuses a world the split cannot use before building
    run = build_run(cfg, info)
    stages = run.stages
    if not 0 <= stage_index < len(stages):
        raise ConfigError(f"arm {name!r}: --stage {stage_index} is out of range; the config has "
                          f"{len(stages)} stage(s) (0..{len(stages) - 1})")
    stage = stages[stage_index]
    run.recipe.sync_to(stage.start_step)
    run.recipe.on_clock_start()
    loader = run.make_loader(stage_index)
    graphs = None
    if graphs_enabled(cfg.train.cuda_graphs, info.device):
        graphs = StepGraphs(run.run_model, run.recipe, info.device, run.dtype, check=cfg.train.cuda_graph_check,
                            capture_updates=cfg.train.cuda_graph_optimizer, capturer=capturer,
                            ends_step=info.world_size == 1)
    return Session(name, cfg, stage, run.stage_end(stage_index), run.model, run.run_model, run.recipe, loader,
                   info, run.dtype, graphs=graphs)


class MemoryMeter:
    """Allocated-bytes bookkeeping on one CUDA device (every method is a no-op returning 0 on
    other devices).  The three torch calls are methods so tests can stand in for them."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device)) if self.cuda else 0

    def peak(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)


def time_step(session: Session, meter: MemoryMeter | None = None, chain: int = 1) -> float:
    """Milliseconds per optimizer step of ``session``: ``chain`` steps issued back to back from an
    idle device, their total time divided by ``chain``; with a ``meter``, also updates
    ``session.step_peak_bytes``.

    ``chain`` 1 times a step alone: it includes the bubble at the step's start, while the GPU
    waits for the host to issue the first kernels.  With ``chain`` > 1 the host issues step
    i + 1 while the GPU still runs step i, as in a training run that logs without synchronizing
    (upstream's per-step ``train_time`` is measured that way), so only the first step's bubble
    is in the sample, shared by ``chain`` steps.  Between them the host waits for the step before
    the one it just issued, as the training loop does when it reads that step's time and loss
    (:class:`speedrun.train.steplog.StepLog`): the time the loader builds the next batches in."""
    device = session.info.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if meter is not None:
            at_start = meter.allocated()
            meter.reset_peak()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        before = None
        for _ in range(chain):
            session.step()
            issued = torch.cuda.Event()
            issued.record()
            if before is not None:
                before.synchronize()
            before = issued
        end.record()
        end.synchronize()
        if meter is not None:
            session.step_peak_bytes = max(session.step_peak_bytes, meter.peak() - at_start)
        return float(start.elapsed_time(end)) / chain
    t0 = time.perf_counter()
    for _ in range(chain):
        session.step()
    return (time.perf_counter() - t0) * 1000.0 / chain


# ----------------------------------------------------------------------------------------------
# Statistics (pure)


def describe_times(times_ms: Sequence[float]) -> dict[str, float]:
    """median, q1, q3, iqr, mean, min, max (all ms) of step times."""
    t = np.asarray(times_ms, dtype=np.float64)
    if t.size == 0:
        raise ValueError("no step times")
    q1, med, q3 = np.percentile(t, [25, 50, 75])
    return {"n": int(t.size), "median_ms": float(med), "q1_ms": float(q1), "q3_ms": float(q3),
            "iqr_ms": float(q3 - q1), "mean_ms": float(t.mean()), "min_ms": float(t.min()), "max_ms": float(t.max())}


def bootstrap_ratio_ci(base_ms: Sequence[float], cand_ms: Sequence[float], *, n_boot: int = 2000,
                       level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """Ratio median(cand) / median(base) with a paired percentile-bootstrap CI.

    ``base_ms[i]`` and ``cand_ms[i]`` are repetition ``i`` of the two arms (run back to back), so
    repetitions are resampled as pairs.  Returns ``ratio``, ``ci_low``, ``ci_high``, ``level``,
    ``n_boot``.  Deterministic for a given ``seed``.
    """
    a = np.asarray(base_ms, dtype=np.float64)
    b = np.asarray(cand_ms, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or a.size < 2:
        raise ValueError(f"need two equally long series of >= 2 times, got {a.shape} and {b.shape}")
    _check_level(level)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, a.size, size=(n_boot, a.size))
    return _ratio_interval(a, b, np.median(b[idx], axis=1) / np.median(a[idx], axis=1), level, n_boot)


def unpaired_ratio_ci(base_ms: Sequence[float], cand_ms: Sequence[float], *, n_boot: int = 5000,
                      level: float = 0.95, seed: int = 0) -> dict[str, float]:
    """Ratio median(cand) / median(base) with an unpaired percentile-bootstrap CI: for two
    programs that cannot be interleaved (ours against upstream's log), each series is resampled
    on its own.  Same keys as :func:`bootstrap_ratio_ci`; the series may differ in length."""
    a = np.asarray(base_ms, dtype=np.float64)
    b = np.asarray(cand_ms, dtype=np.float64)
    if a.ndim != 1 or b.ndim != 1 or a.size < 2 or b.size < 2:
        raise ValueError(f"need two series of >= 2 times, got {a.shape} and {b.shape}")
    _check_level(level)
    rng = np.random.default_rng(seed)
    ra = np.median(a[rng.integers(0, a.size, size=(n_boot, a.size))], axis=1)
    rb = np.median(b[rng.integers(0, b.size, size=(n_boot, b.size))], axis=1)
    return _ratio_interval(a, b, rb / ra, level, n_boot)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")


def _ratio_interval(a: np.ndarray, b: np.ndarray, ratios: np.ndarray, level: float, n_boot: int) -> dict[str, float]:
    """The bootstraps' common result: the ratio of the medians and the percentile interval of ``ratios``."""
    alpha = (1 - level) / 2
    lo, hi = np.quantile(ratios, [alpha, 1 - alpha])
    return {"ratio": float(np.median(b) / np.median(a)), "ci_low": float(lo), "ci_high": float(hi),
            "level": level, "n_boot": n_boot}


# ----------------------------------------------------------------------------------------------
# The benchmark


def _as_configs(arms: Sequence[ArmSpec | tuple[str, RunConfig]],
                common: Sequence[str]) -> list[tuple[str, RunConfig, dict]]:
    out = []
    for a in arms:
        if isinstance(a, ArmSpec):
            out.append((a.name, a.config(common), a.to_dict()))
        else:
            name, cfg = a
            out.append((name, cfg, {"name": name, "preset": cfg.name, "overrides": []}))
    names = [n for n, _, _ in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"arm names must differ, got {names}")
    return out


def _gather_max(times: list[float], info) -> list[float]:
    if not info.enabled:
        return times
    gathered: list = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, times)
    return [max(col) for col in zip(*gathered)]


def bench_step(arms: Sequence[ArmSpec | tuple[str, RunConfig]], *, stage: int = 0, steps: int = MIN_STEPS,
               warmup: int = 3, common: Sequence[str] = (), seed: int = 0, n_boot: int = 2000,
               progress: bool = False, host_steps: int = 0, sync_scan: bool = False,
               chain: int | Sequence[int] = 1, clocks: bool = True,
               simulate_world: int | None = None) -> dict[str, Any]:
    """Time ``steps`` optimizer steps per arm, interleaved, after ``warmup`` untimed steps each.

    ``chain``: steps issued back to back per timed sample (see :func:`time_step`); a sample is
    their mean, so each arm runs ``steps x chain`` timed steps.  Several lengths (e.g. ``(1, 3)``)
    time each arm both ways in the same rounds (``arm``, ``arm@3``: paired like two arms).

    ``arms``: ArmSpecs (``common`` overrides are applied to each before its own) or
    ``(name, RunConfig)`` pairs; the first arm is the baseline of the ratios.  ``stage`` indexes
    ``stages_of(cfg)``.  Returns a JSON-able dict (see :func:`render_table`); every rank returns
    the same numbers.

    ``simulate_world`` N: every arm runs rank 0's share of an N-rank step in this one process
    (see :func:`build_session`; one micro-batch of the per-rank size under the record's
    ``grad_accum=0`` at N = 8), so one GPU times what each GPU of an N-GPU run computes, without
    the collectives' time.  The result says so (``simulated_world``, ``simulation``).

    Host side (see :mod:`speedrun.evidence.host`; rank 0's numbers): ``host_steps`` more steps
    per arm, interleaved, traced phase by phase (host issue time, GPU time, how far the GPU trails
    the host); ``sync_scan``: one more step per arm under torch's sync debug mode, listing the
    calls that synchronise.  Both run after the timed steps.

    ``clocks`` (CUDA with NVML): SM clock, power and temperature sampled during each arm's timed
    steps (:mod:`speedrun.evidence.gpuclock`; rank 0's GPU), so a ratio can be read against the
    clocks each arm ran at; where NVML is missing the result says why.
    """
    if not arms:
        raise ConfigError("bench step needs at least one arm")
    if steps < 2 or warmup < 0:
        raise ConfigError(f"--steps must be >= 2 and --warmup >= 0, got {steps} and {warmup}")
    if host_steps < 0:
        raise ConfigError(f"--host-steps must be >= 0, got {host_steps}")
    chains = (chain,) if isinstance(chain, int) else tuple(chain)
    if not chains or min(chains) < 1 or len(set(chains)) != len(chains):
        raise ConfigError(f"--chain must be distinct step counts >= 1, got {','.join(map(str, chains)) or 'none'}")
    configs = _as_configs(arms, common)
    devices = {cfg.train.device for _, cfg, _ in configs}
    if len(devices) > 1:
        raise ConfigError(f"all arms must use one train.device, got {sorted(devices)}")
    for field in PROCESS_WIDE:
        values = {getattr(cfg.train, field) for _, cfg, _ in configs}
        if len(values) > 1:
            raise ConfigError(f"train.{field} is process-wide: every arm of one bench must use the same value, got "
                              + ", ".join(f"{n}={getattr(cfg.train, field)}" for n, cfg, _ in configs))
    from speedrun.train.graphs import CudaCapture

    info = distributed.setup(configs[0][1].train.device)
    meter = MemoryMeter(info.device)
    collections, frozen = CollectionMeter(), 0
    sessions: list[Session] = []
    sampler, clocks_note = _clock_sampler(info) if clocks else (None, "not sampled (--no-clocks)")
    # One CUDA-graph stream and memory pool for every arm: the arms' steps never overlap, so the
    # pool holds the largest arm's working set, not their sum (which does not fit one GPU at the
    # record's stage-3 shapes).
    capturer = CudaCapture(info.device) if info.device.type == "cuda" else None
    # Wall seconds of each phase (for planning a bench into a time-limited call): per arm for the
    # build and the warmup (compilation, CUDA-graph capture and its self-check), all arms together
    # for the timed rounds and the host traces.
    wall: dict[str, Any] = {"build": {}, "warmup": {}}
    try:
        for name, cfg, _ in configs:
            before, t0 = meter.allocated(), time.perf_counter()
            sessions.append(build_session(name, cfg, stage, info, simulate_world, capturer=capturer))
            sessions[-1].resident_bytes = meter.allocated() - before
            wall["build"][name] = time.perf_counter() - t0
        for s in sessions:
            before, t0 = meter.allocated(), time.perf_counter()
            pool_before = s.graphs.pool_bytes() if s.graphs is not None else 0
            for _ in range(s.warmup_steps(warmup)):
                s.step()
            distributed.barrier(info)
            wall["warmup"][s.name] = time.perf_counter() - t0
            s.resident_bytes += meter.allocated() - before  # optimizer state, FP8 caches, grads kept
            if s.graphs is not None:
                s.pool_bytes = s.graphs.pool_bytes() - pool_before
        frozen = freeze_long_lived() if configs[0][1].train.gc_freeze else 0
        collections.__enter__()
        if sampler is not None:
            sampler.__enter__()
        traffic_before = [s.comm_traffic() for s in sessions]
        t0 = time.perf_counter()
        for rep in range(steps):
            k = rep % len(sessions)
            for s in sessions[k:] + sessions[:k]:
                for c in chains:
                    collections.label = series_name(s.name, c, chains)
                    if sampler is not None:
                        sampler.label = collections.label
                    s.times_ms.setdefault(c, []).append(time_step(s, meter, c))
                    collections.label = None
                    if sampler is not None:
                        sampler.label = None
            if progress and info.is_main and (rep + 1) % 10 == 0:
                print(f"  {rep + 1}/{steps} repetitions", flush=True)
        wall["timed"] = time.perf_counter() - t0
        times = {series_name(s.name, c, chains): _gather_max(s.times_ms[c], info) for s in sessions for c in chains}
        for s, before in zip(sessions, traffic_before):
            if before is not None:  # every timed step, both parities of the optimizer's update
                timed = steps * sum(chains)
                s.comm_bytes_per_step = {k: (v - before[k]) / timed for k, v in s.comm_traffic().items()}
        t0 = time.perf_counter()
        _host_side(sessions, info, host_steps, sync_scan)
        wall["host"] = time.perf_counter() - t0
    finally:
        collections.__exit__(None, None, None)
        if frozen:
            thaw()
        if sampler is not None:
            sampler.__exit__(None, None, None)
        for s in sessions:
            s.close()
    distributed.teardown()
    result = _summarize(configs, sessions, times, stage, steps, warmup, seed, n_boot, info, chains)
    result["simulated_world"] = simulate_world
    result["simulation"] = simulation_note(simulate_world)
    result["wall_s"] = wall
    result["clocks"] = {"per_arm": sampler.summary() if sampler is not None else {}, "note": clocks_note}
    result["gc"] = {"frozen_objects": frozen,
                    "per_arm": {a["name"]: collections.summary().get(a["name"], CollectionStats().as_dict())
                                for a in result["arms"]}}
    del sessions
    if info.device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def simulation_note(simulate_world: int | None) -> str | None:
    """How a simulated-rank bench was run (None for a real one)."""
    if simulate_world is None:
        return None
    return f"rank 0 of {simulate_world} simulated (collectives replaced by no-ops)"


def series_name(arm: str, chain: int, chains: Sequence[int]) -> str:
    """A timed series' name: the arm's, with ``@K`` for chain lengths after the first."""
    return arm if chain == chains[0] else f"{arm}@{chain}"


def _host_side(sessions: Sequence[Session], info, host_steps: int, sync_scan: bool) -> None:
    """Fill each session's ``host_steps`` (traced steps) and ``syncs`` (see :func:`bench_step`)."""
    from speedrun.evidence.host import find_syncs, trace_step

    for _ in range(host_steps):
        for s in sessions:
            s.host_steps.append(trace_step(s.step, info.device))
    if sync_scan:
        for s in sessions:
            s.syncs = find_syncs(s.step, info.device)


def _summarize(configs, sessions, times, stage, steps, warmup, seed, n_boot, info, chains=(1,)) -> dict[str, Any]:
    from speedrun.evidence.fingerprint import node_fingerprint
    from speedrun.train.loop import attention_backend_used, micro_batching

    base = series_name(sessions[0].name, chains[0], chains)
    out_arms = []
    for (arm, cfg, spec), s in zip(configs, sessions):
        st = s.stage
        mb = micro_batching(st, cfg, s.info.world_size)  # a simulated rank's world, else the real one
        for c in chains:
            name = series_name(arm, c, chains)
            d = describe_times(times[name])
            entry = {
                **spec,
                "name": name,
                "chain": c,
                "stage": {"index": stage, "batch_tokens": st.batch_tokens, "max_seq_len": st.max_seq_len,
                          "window_short": st.window_short, "window_long": st.window_long},
                # micro-batches per step and their tokens (after train.min_micro_batch_tokens)
                "grad_accum": mb.count,
                "micro_batch_tokens": mb.tokens,
                "compile": cfg.train.compile,
                # the backend that ran (model.attention_backend with auto resolved), so a figure
                # says which attention kernel it timed
                "attention_backend": attention_backend_used(cfg, s.info.device),
                "dtype": str(s.dtype).replace("torch.", ""),
                "parameters": sum(p.numel() for p in s.model.parameters()),
                **d,
                "tokens_per_s": st.batch_tokens / (d["median_ms"] / 1000.0),
                **_memory_fields(s, info),
                "times_ms": times[name],
                # every step this arm ran, warmup first, in order: arms of one preset start from the
                # same weights and batches, so their losses show whether a switch changed training
                "losses": [float(x) for x in s.losses],
                "config": cfg.to_dict(),
            }
            if s.comm_bytes_per_step is not None:  # what its collectives would move (--as-rank-of)
                entry["comm_bytes_per_step"] = s.comm_bytes_per_step
            if c == chains[0]:  # the arm's host-side extras, once
                if s.host_steps:
                    from speedrun.evidence.host import summarize_traces
                    from speedrun.train.loop import micro_batching

                    count = micro_batching(s.stage, s.cfg, s.info.world_size).count
                    entry["host"] = summarize_traces(s.host_steps, micro_batches=count)
                if s.syncs is not None:
                    entry["syncs"] = s.syncs
                if s.graphs is not None:  # captures, replays and self-check errors (train.cuda_graphs)
                    entry["cuda_graphs"] = s.graphs.summary()
            if name != base:
                entry["vs_" + base] = bootstrap_ratio_ci(times[base], times[name], n_boot=n_boot, seed=seed)
            out_arms.append(entry)
    warnings = []
    if steps < MIN_STEPS:
        warnings.append(f"only {steps} timed steps per arm (>= {MIN_STEPS} recommended)")
    clock = "cuda events" if info.device.type == "cuda" else "perf_counter"
    if chains == (1,):
        timing = f"{clock}, synchronized per step"
    else:
        lengths = " and ".join(map(str, chains))
        timing = (f"{clock}, samples of {lengths} steps back to back (mean per step; 'arm@K': K steps), "
                  "synchronized between samples")
    return {
        "baseline": base,
        "stage": stage,
        "steps": steps,
        "warmup": warmup,
        "device": str(info.device),
        "world_size": info.world_size,
        "chain": list(chains),
        "timing": timing,
        "order": "interleaved, rotated each round: " + " ".join(series_name(s.name, c, chains) for s in sessions for c in chains)
                 + (" / " + " ".join(series_name(s.name, c, chains) for s in sessions[1:] + sessions[:1] for c in chains)
                    if len(sessions) > 1 else "") + " / ...",
        "arms": out_arms,
        "warnings": warnings,
        "fingerprint": node_fingerprint(measure=False) if info.is_main else None,
    }


def _clock_sampler(info):
    """(ClockSampler or None, a note): rank 0 samples its GPU; other ranks and devices do not."""
    from speedrun.evidence.gpuclock import ClockSampler, nvml_reader

    if not info.is_main:
        return None, "rank 0's GPU only"
    read, why = nvml_reader(info.device)
    if read is None:
        return None, why
    sampler = ClockSampler(read)
    return sampler, f"NVML every {sampler.interval_s * 1000:.0f} ms during timed steps, rank 0's GPU"


def _memory_fields(s: Session, info) -> dict[str, float | None]:
    """The arm's memory in MiB (CUDA; None elsewhere), the maximum over ranks."""
    if info.device.type != "cuda":
        return {"resident_mib": None, "step_peak_mib": None, "graph_pool_mib": None, "peak_mib": None}
    vals = [s.resident_bytes, s.step_peak_bytes, s.pool_bytes]
    if info.enabled:
        gathered: list = [None] * info.world_size
        torch.distributed.all_gather_object(gathered, vals)
        vals = [max(col) for col in zip(*gathered)]
    mib = [v / 2**20 for v in vals]
    return {"resident_mib": mib[0], "step_peak_mib": mib[1], "graph_pool_mib": mib[2], "peak_mib": sum(mib)}


def render_table(result: dict[str, Any]) -> str:
    """A plain-text table of a :func:`bench_step` result."""
    base = result["baseline"]
    head = (f"{'arm':<16} {'median ms':>10} {'q1':>9} {'q3':>9} {'IQR':>8} {'tokens/s':>13} {'peak MiB':>9}"
            f"  ratio vs {base} [95% CI]")
    lines = [f"bench step: stage {result['stage']}, {result['steps']} steps per arm after {result['warmup']} "
             f"warmup, {result['device']} x{result['world_size']}, {result['timing']}"]
    if result.get("simulation"):  # tokens/s: the N-rank run's, as if its collectives took no time
        lines.append(f"{result['simulation']}: each arm runs one rank's share of a step of "
                     f"{result['simulated_world']} ranks; tokens/s is the whole run's")
    lines += [head, "-" * len(head)]
    for a in result["arms"]:
        r = a.get("vs_" + base)
        ratio = f"{r['ratio']:.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}]" if r else "1 (baseline)"
        peak = a.get("peak_mib")
        peak_s = f"{peak:>9,.0f}" if peak is not None else f"{'-':>9}"
        lines.append(f"{a['name']:<16} {a['median_ms']:>10.3f} {a['q1_ms']:>9.3f} {a['q3_ms']:>9.3f} "
                     f"{a['iqr_ms']:>8.3f} {a['tokens_per_s']:>13,.0f} {peak_s}  {ratio}")
    splits = {(a.get("grad_accum"), a.get("micro_batch_tokens")) for a in result["arms"]}
    # arms that split the step differently (train.min_micro_batch_tokens), or a simulated rank's split
    if len(splits) > 1 or result.get("simulation"):
        lines.append(("micro-batches per step of the simulated rank: " if result.get("simulation")
                      else "micro-batches per step: ") + ", ".join(
            f"{a['name']} {a.get('grad_accum')} x {a.get('micro_batch_tokens')}" for a in result["arms"]))
    moved = [a for a in result["arms"] if a.get("comm_bytes_per_step")]
    if moved:  # a simulated rank: what its collectives would move, which its step time leaves out
        lines.append("collectives per step, not timed (MB by kind): " + "; ".join(
            f"{a['name']} " + ", ".join(f"{k} {v / 1e6:.1f}" for k, v in a["comm_bytes_per_step"].items() if v)
            for a in moved))
    if any("attention_backend" in a for a in result["arms"]):  # files of older versions lack it
        lines.append("attention backend: " + ", ".join(f"{a['name']} {a.get('attention_backend', '?')}"
                                                       for a in result["arms"]))
    lines += _render_clocks(result)
    lines += _render_collections(result)
    lines += _render_host(result)
    lines += _render_losses(result)
    for a in result["arms"]:
        g = a.get("cuda_graphs")
        if g:
            updates = (f"; optimizer updates: {g['replayed_updates']} replayed, {g['eager_updates']} eager, "
                       f"{g['update_captures']} captured" if "update_captures" in g else "")
            lines.append(f"cuda graphs, {a['name']}: {g['replayed_steps']} steps replayed, {g['eager_steps']} eager, "
                         f"{g['captures']} captured{updates}, worst self-check relative error "
                         f"{g['check_worst_rel_err']:.2g}"
                         + (f"; graph pool grew {a['graph_pool_mib']:,.0f} MiB" if a.get("graph_pool_mib") is not None
                            else "")
                         + "".join(f"; {c}" for c in g["key_changes"]))
    wall = result.get("wall_s")
    if wall:  # files of older versions lack it
        lines.append("bench wall time, s: build " + ", ".join(f"{n} {t:.1f}" for n, t in wall["build"].items())
                     + "; warmup (compile, capture, checks) " + ", ".join(f"{n} {t:.1f}" for n, t in wall["warmup"].items())
                     + f"; timed rounds {wall['timed']:.1f}; host traces {wall['host']:.1f}")
    for w in result["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines) + "\n"


def _render_losses(result: dict[str, Any]) -> list[str]:
    """Each arm's training losses against the first arm of its preset (arms of one preset start
    from the same weights and batches): the largest relative difference over their common steps."""
    first: dict[str, dict] = {}
    lines = []
    for a in result["arms"]:
        if a.get("chain", 1) != result["chain"][0]:  # another chain length of an arm listed already
            continue
        ref = first.setdefault(a.get("preset"), a)
        if ref is a or not a.get("losses") or not ref.get("losses"):
            continue
        pairs = list(zip(a["losses"], ref["losses"]))
        worst = max(abs(x - y) / max(abs(y), 1e-30) for x, y in pairs)
        lines.append(f"training loss, {a['name']} against {ref['name']} (same preset, same start): largest relative "
                     f"difference {worst:.2g} over {len(pairs)} steps; last {a['losses'][-1]:.4f} vs {ref['losses'][-1]:.4f}")
    return lines


def _render_clocks(result: dict[str, Any]) -> list[str]:
    clocks = result.get("clocks") or {}
    per_arm = clocks.get("per_arm") or {}
    if not per_arm:
        return [f"GPU clocks: {clocks['note']}"] if clocks.get("note") else []
    lines = ["", f"GPU clocks while each arm ran ({clocks['note']}):",
             f"{'arm':<16} {'samples':>7} {'SM MHz':>7} {'p10':>6} {'power W':>8} {'max C':>6}"]
    for name, c in per_arm.items():
        lines.append(f"{name:<16} {c['samples']:>7} {c['sm_mhz_median']:>7.0f} {c['sm_mhz_p10']:>6.0f} "
                     f"{c['power_w_median']:>8.0f} {c['temp_c_max']:>6.0f}")
    return lines


def _render_collections(result: dict[str, Any]) -> list[str]:
    gcr = result.get("gc") or {}
    per_arm = gcr.get("per_arm") or {}
    if not per_arm:
        return []
    steps = max(1, result["steps"])
    lines = ["", f"Python garbage collection during each arm's timed steps ({gcr.get('frozen_objects', 0):,} objects "
                 "frozen after the warmups; train.gc_freeze):",
             f"{'arm':<16} {'gen0':>6} {'gen1':>6} {'gen2':>6} {'ms/step':>8} {'longest ms':>11}"]
    for name, c in per_arm.items():
        n = c["count_by_generation"]
        lines.append(f"{name:<16} {n[0]:>6} {n[1]:>6} {n[2]:>6} {c['total_ms'] / steps:>8.2f} {c['longest_ms']:>11.2f}")
    return lines


# How far the GPU must trail a graph's launch for the host table to add the per-micro-batch host
# time without the launch: well above a launch's own cost, so only a queue that is filling.
LAUNCH_QUEUE_LEAD_MS = 5.0


def _render_host(result: dict[str, Any]) -> list[str]:
    arms = [a for a in result["arms"] if "host" in a]
    lines: list[str] = []
    if arms:
        n = arms[0]["host"]["steps"]
        lines += ["", f"host side: {n} traced steps per arm (medians; micro-batch phases summed over micro-batches; "
                      "rank 0).  lead: how long after the host issued a phase's end the GPU reached it, the least "
                      "over micro-batches; near 0 = the GPU waits for the host there"]
        head = f"{'arm':<16} {'phase':<15} {'host ms':>9} {'GPU ms':>9} {'lead ms':>9}"
        lines += [head, "-" * len(head)]
        fmt = lambda v: f"{v:>9.2f}" if v is not None else f"{'-':>9}"  # noqa: E731
        for a in arms:
            h = a["host"]
            for phase, t in h["phases"].items():
                lines.append(f"{a['name']:<16} {phase:<15} {fmt(t['host_ms'])} {fmt(t['gpu_ms'])} {fmt(t['lead_min_ms'])}")
            lines.append(f"{a['name']:<16} {'(whole step)':<15} {fmt(h['host_ms'])} {fmt(a['median_ms'])} {'':>9}")
            if "micro_batch_host_ms" in h:  # data and the loop's phases over the step's micro-batches
                lines.append(f"{a['name']:<16} {'(per micro-b.)':<15} {fmt(h['micro_batch_host_ms'])} {'':>9} {'':>9}"
                             f"  ({h['micro_batches']} per step)")
                launch = h["phases"].get("graph_launch", {}).get("lead_min_ms")
                if launch is not None and launch >= LAUNCH_QUEUE_LEAD_MS and "micro_batch_host_ms_no_launch" in h:
                    lines.append(f"{a['name']:<16} {'(w/o launch)':<15} {fmt(h['micro_batch_host_ms_no_launch'])} "
                                 f"{'':>9} {'':>9}  (the GPU trails the launch by {launch:.0f} ms: its host time "
                                 "may be a wait for queue space)")
    scanned = [a for a in result["arms"] if "syncs" in a]
    if scanned:
        lines += ["", "synchronising calls in one step (torch.cuda sync debug mode):"]
        for a in scanned:
            if not a["syncs"]:
                lines.append(f"  {a['name']}: none")
            for e in a["syncs"]:
                lines.append(f"  {a['name']}: {e['count']} x {e['site']}")
    return lines


def write_json(result: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return p


def cli_bench_step(args) -> int:
    """``speedrun bench step`` (arguments from speedrun.cli.evidence)."""
    from speedrun.evidence.arms import data_overrides, parse_arms

    if args.steps < MIN_STEPS:
        raise ConfigError(f"--steps must be >= {MIN_STEPS} (the median and its confidence interval need them), "
                          f"got {args.steps}")
    arms = parse_arms(args.arm)
    common = data_overrides(args.data, args.val_data, validates=False) + (["train.device=" + args.device] if args.device else []) \
        + list(args.overrides)
    result = bench_step(arms, stage=args.stage, steps=args.steps, warmup=args.warmup, common=common,
                        seed=args.seed, progress=True, host_steps=args.host_steps, sync_scan=args.sync_scan,
                        chain=args.chain, clocks=getattr(args, "clocks", True),
                        simulate_world=getattr(args, "as_rank_of", None))
    if result["fingerprint"] is None:  # not rank 0
        return 0
    print(render_table(result), end="")
    if args.json:
        print(f"written: {write_json(result, args.json)}")
    return 0
