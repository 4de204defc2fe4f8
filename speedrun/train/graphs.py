"""CUDA graphs of a training step's micro-batches (``train.cuda_graphs``).

Issued op by op, a micro-batch is hundreds of kernel launches plus the Python of the fused
kernels' wrappers and the FP8 bookkeeping.  Where a micro-batch is small, that host work takes
longer than the GPU's, and the GPU waits.  Here the whole micro-batch loop of a step (forward and
backward of each micro-batch, gradients accumulated: :func:`speedrun.train.microbatch.accumulate`)
is captured once per *step key* into a ``torch.cuda.CUDAGraph`` and replayed: one launch per step.
What stays eager, between replays: the loader and the recipe's host work on each micro-batch
(``note_batch``: the rows of the sparse bigram exchange), the copy of each micro-batch into the
graph's static buffers, the step's loss weights written into a device buffer, and everything
after the loop (gradient flushes and reduction, the optimizer's host half, the FP8 weight
refresh).  On one rank the loop's graph also closes the step's FP8 activation scales
(``model.end_step()``: next step's scales from this step's amaxes) and divides the loss for the
log; on several ranks the step end all-reduces the amaxes, so it stays eager there.  The optimizer's kernels are replayed too, by :mod:`speedrun.train.update_graphs`, which
shares this module's capture stream, memory pool, counters and self-check.

The step key is everything that decides which kernels the loop launches and where they read and
write: the micro-batches' shapes (tokens, cu_seqlens slots, max_seqlen, bigram ids), their count
and loss scale, the attention windows, how many MTP weights there are and whether the prefix loss
runs, which parameters already hold a gradient when the step starts (the record's Adam gradients
wait across an even step), the model's ``graph_signature()`` (e.g. which FP8 scales are ready)
and an *address fingerprint*: the data pointer of every tensor reachable from the model (FP8
weight caches and scales, RoPE tables, accumulators; taken every step through an
:class:`~speedrun.train.addresses.AddressWatch`, which walks only when something changed).  A graph reads
and writes fixed addresses, so the code it captures keeps its state in tensors that are updated
in place; if one is replaced anyway, the fingerprint changes, and the step runs eagerly (and is
captured anew when seen again) instead of reading stale or freed memory.

Life of a key: the first time it is seen, the step runs eagerly (the unchanged eager path); the
second time (1) the loop runs eagerly on the capture stream from a snapshot of everything a
micro-batch changes (gradients, accumulators, FP8 amax sums: the tensors reachable from the
model, and the model's host-side bookkeeping), (2) the snapshot is put back, (3) the loop is
captured, (4) replayed, and (5) with ``train.cuda_graph_check`` the replay's loss and changed
tensors are compared with the eager run's (:class:`GraphMismatchError` names the key and the
first tensor outside the tolerance), and (6) the snapshot goes back once more.  Capture and
check run inside ``pause()`` (the training loop stops its clock there); the step itself is then
replayed outside it, on the clock, like every later step of the key: the timed region runs every
step once, and no step's work hides in a pause.

Gradients: every parameter that receives one gets one buffer for the whole run, allocated outside
the graphs' memory pool.  A graph whose key had no gradient for a parameter at the step's start
zeroes its buffer first; one whose key had it accumulates into the buffer (the current gradient
is copied in first if it lives elsewhere, e.g. after an eager step).  After a replay each such
parameter's ``.grad`` is its buffer, as after the eager loop, and the model's host-side
bookkeeping (``set_graph_host_state``) is what the captured loop left.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from speedrun.config import CUDA_GRAPHS_CHOICES
from speedrun.data.loader import batch_in, batch_to
from speedrun.errors import ConfigError, SpeedrunError
from speedrun.kernels.step_values import StepValues
from speedrun.model.interface import ForwardArgs
from speedrun.train import microbatch
from speedrun.train.addresses import AddressWatch, address_fingerprint, reachable_tensors

# A key is captured the second time it is seen: the first run is eager (it also fills every cache
# the capture then finds warm), and a key seen once only (a step whose FP8 scales are not ready
# yet) costs no capture.
CAPTURE_ON_SIGHT = 2
# Steps of one stage before all its keys replay: the first step (no FP8 scale ready yet), then an
# even and an odd step key, each eager once and captured at its second sight.
STEPS_UNTIL_REPLAY = 1 + 2 * CAPTURE_ON_SIGHT
# ... and before the optimizer's updates replay too (speedrun.train.update_graphs): an update's key
# holds its gradients' addresses, which settle when the loop is first captured (its gradients move
# into run-long buffers, two steps before the loop replays); its two keys then take two steps
# each, eager and captured.
STEPS_UNTIL_UPDATE_REPLAY = STEPS_UNTIL_REPLAY - 2 + 2 * CAPTURE_ON_SIGHT
# Relative Frobenius error always allowed between the eager run and the replay of the same
# micro-batches, and the multiple of the eager loop's own run-to-run difference allowed beyond it:
# atomic adds (the embedding accumulators, attention's backward, Inductor's split reductions) sum
# in another order each run, which moves small gradients with much cancellation (a gate's
# gradient summed over 131,072 tokens) by more than the floor.
CHECK_TOLERANCE = 2e-3
NOISE_FACTOR = 4.0
# A 0-d state tensor (an FP8 amax accumulator) is the maximum of one element over a whole
# gradient or activation: the relative noise of that one element is not the relative (Frobenius)
# noise of any tensor, and e5m2 rounding upstream turns a tiny change into a jump of that element
# (an amax can move by a percent where no tensor's eager noise comes near).  What an amax steers
# is a delayed scale: one within 2^-4 (relative) of the eager run's moves no quantised value by
# more than one step of e4m3, whose relative step is 2^-4 to 2^-3 (e5m2's is larger), as the
# eager noise already does.  A capture fault on such a scalar (unwritten, zeroed, another step's value, a
# stale address) is far outside.
SCALAR_STATE_TOLERANCE = 2.0 ** -4


class GraphMismatchError(SpeedrunError, RuntimeError):
    """A captured step's replay does not compute what the eager step computes."""


def _no_mark(_: str) -> None:
    pass


def graphs_enabled(setting: str, device: torch.device) -> bool:
    """Whether ``train.cuda_graphs`` turns graphs on for ``device``."""
    if setting not in CUDA_GRAPHS_CHOICES:
        raise ConfigError(f"train.cuda_graphs must be one of {', '.join(CUDA_GRAPHS_CHOICES)}, got {setting!r}")
    if setting == "on" and device.type != "cuda":
        raise ConfigError(f"train.cuda_graphs=on needs a CUDA device, this run uses {device.type}; "
                          "use train.cuda_graphs=auto or off")
    return setting != "off" and device.type == "cuda"


# ------------------------------------------------------------------------------------------------
# What a graph bakes in


@dataclass(frozen=True)
class StepKey:
    """See the module docstring: what a captured step depends on besides the tensors' values."""

    shapes: tuple  # per field: (shape, dtype) of the micro-batch tensors, and max_seqlen
    count: int  # micro-batches per step
    scale: float  # each micro-batch's loss factor
    divisor: float  # the summed loss is divided by it for the log
    windows: tuple
    mtp_count: int
    prefix: bool
    present: frozenset  # parameter names holding a gradient at the step's start
    signature: Any
    fingerprint: tuple


def step_key(model, batches: Sequence, args: ForwardArgs, scale: float, divisor: float = 1.0, *,
             fingerprint: tuple | None = None, params: Sequence[tuple[str, torch.nn.Parameter]] | None = None
             ) -> StepKey:
    """The :class:`StepKey` of a step about to run ``batches`` with ``args``: the model as it is
    now (gradients held, FP8 readiness, addresses).  ``fingerprint``: :func:`address_fingerprint`
    of :func:`_roots` (``model``), ``params``: ``model``'s named parameters, both kept by a caller
    that takes a key every step (:class:`StepGraphs`); else made here."""
    shape = _batch_shape(batches[0])
    if any(_batch_shape(b) != shape for b in batches[1:]):
        raise ValueError("step_key: the micro-batches of one step must share their shapes")
    signature = model.graph_signature()
    params = model.named_parameters() if params is None else params
    return StepKey(
        shapes=shape, count=len(batches), scale=float(scale), divisor=float(divisor),
        windows=(args.window_short, args.window_long),
        mtp_count=len(args.mtp_weights), prefix=not _is_zero(args.prefix_weight),
        present=frozenset(n for n, p in params if p.grad is not None), signature=signature,
        fingerprint=address_fingerprint(_roots(model)) if fingerprint is None else fingerprint,
    )


def _roots(model) -> list[tuple[str, Any]]:
    """Where the fingerprint looks: the model, which holds everything the loop reads and writes
    (the optimizer's tensors are the update graphs' concern: :mod:`speedrun.train.update_graphs`)."""
    return [("model", model)]


def _batch_shape(batch) -> tuple:
    fields = ("inputs", "targets", "cu_seqlens", "bigram")
    return tuple(None if getattr(batch, f, None) is None else (tuple(getattr(batch, f).shape), getattr(batch, f).dtype)
                 for f in fields) + (int(batch.max_seqlen),)


@dataclass
class CapturedStep:
    key: StepKey
    graph: Any  # torch.cuda.CUDAGraph (anything with .replay())
    inputs: list  # static micro-batches the graph reads
    grads: list[tuple[torch.nn.Parameter, torch.Tensor]]  # parameters whose .grad the graph writes
    carried: list[tuple[torch.nn.Parameter, torch.Tensor]]  # ... of those, the ones it accumulates into
    host_after: Any  # the model's host-side bookkeeping after the loop
    replays: int = 0
    check: dict = field(default_factory=dict)  # the capture's self-check: worst errors


@dataclass
class GraphStats:
    eager_steps: int = 0
    replayed_steps: int = 0
    captures: int = 0
    capture_s: float = 0.0
    check_worst: float = 0.0  # largest relative error any self-check saw
    check_noise: float = 0.0  # largest run-to-run difference of the eager loop the checks saw
    peak_allocated: int = 0  # the device's peak allocation before the self-checks' snapshots (bytes)
    key_changes: list[str] = field(default_factory=list)  # why a known key was missed (first few)
    # the optimizer's update (speedrun.train.update_graphs), counted apart from the micro-batch loop
    eager_updates: int = 0
    replayed_updates: int = 0
    update_captures: int = 0


class CudaCapture:
    """How :class:`StepGraphs` captures: CUDA graphs on one side stream, one memory pool shared by
    all of a run's graphs (they never run concurrently, and nothing a graph leaves for later lives
    in the pool)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def on_side_stream(self):
        """Run eagerly on the capture stream (warming it as the capture will use it)."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def capture(self, fn: Callable[[], None]):
        """A graph of what ``fn`` launches (``fn`` runs once, its kernels are recorded, not run);
        ``.replay()`` runs them.  Thread-local capture mode: the loader's threads may pin memory
        meanwhile."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            fn()
        return graph

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def pool_bytes(self) -> int:
        """Bytes the graphs' memory pool holds (its segments, free blocks included: the allocator's
        ``memory_allocated`` counts only the tensors alive in it, while the pool keeps the whole
        working set of every captured step reserved for its replays)."""
        pool = tuple(self.pool)
        index = torch.cuda.current_device() if self.device.index is None else self.device.index
        return sum(seg.get("total_size", 0) for seg in torch.cuda.memory_snapshot()
                   if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) == pool)


class RerunCapture:
    """A stand-in for :class:`CudaCapture` off the GPU (tests): capturing runs the function once
    (standing for the capture and the replay that follows it), a later replay runs it again, so
    every piece of :class:`StepGraphs`' bookkeeping (keys, gradient buffers, host state, the
    self-check) runs on the CPU; only the recording of kernels is not exercised."""

    def __init__(self, device: torch.device):
        self.device = device

    def synchronize(self) -> None:
        pass

    def on_side_stream(self):
        return contextlib.nullcontext()

    def capture(self, fn: Callable[[], None]):
        fn()
        return _Rerun(fn)

    def peak_allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass

    def pool_bytes(self) -> int:
        return 0


class _Rerun:
    def __init__(self, fn: Callable[[], None]):
        self.fn, self.captured = fn, True

    def replay(self) -> None:
        if self.captured:  # the capture already ran it: this is the replay right after capture
            self.captured = False
            return
        self.fn()


class StepGraphs:
    """Capture and replay of a step's micro-batches (see the module docstring).

    model, recipe: the run's (the recipe's optimizer gets update graphs where it can be captured,
    see ``capture_updates``).  pause: a context manager factory the capture and its check run
    inside (the training loop stops its clock there).  check: compare each graph's first replay
    with the eager loop.  capturer: a :class:`CudaCapture` (stream and memory pool) shared with
    other runs of this process whose steps never run concurrently with these (the arms of one
    bench): their pool then holds the largest step's working set instead of each run's own.
    ends_step: the loop also runs ``model.end_step()`` (captured with it); only where the step end
    issues no collective (one rank: the run's ``world_size`` is 1), since collectives stay eager."""

    def __init__(self, model, recipe, device: torch.device, dtype: torch.dtype, *,
                 pause: Callable[[], contextlib.AbstractContextManager] | None = None, check: bool = True,
                 capture_with: Callable[[torch.device], Any] | None = None, capture_updates: bool = True,
                 capturer=None, ends_step: bool = False):
        if capture_with is None:
            if device.type != "cuda":
                raise ConfigError(f"CUDA graphs need a CUDA device, got {device}")
            capture_with = CudaCapture
        self.model, self.device, self.dtype = model, device, dtype
        self._capture_with = capture_with
        self._capturer = capturer
        self.pause = pause or contextlib.nullcontext
        self.check = check
        self.ends_step = ends_step
        self.stats = GraphStats()
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._watch = AddressWatch(_roots(model))  # the step key's fingerprint, every step
        self._named_params: list = []  # ... and its parameters, listed again whenever the watch walks
        self._named_at = -1
        self._steps: dict[StepKey, CapturedStep] = {}
        self._sightings: dict[StepKey, int] = {}
        self._grad_buffers: dict[int, torch.Tensor] = {}  # id(param) -> its gradient buffer
        self._inputs: dict[tuple, list] = {}  # (batch shape, count) -> static micro-batches
        self._values: StepValues | None = None
        # views of the step-values buffer by (MTP weights, prefix loss on): the same every step
        self._value_views: dict[tuple[int, bool], tuple] = {}
        self._loss: torch.Tensor | None = None
        # the optimizer's update too, where it can be captured (train.cuda_graph_optimizer)
        self.updates = None
        if capture_updates:
            from speedrun.train.update_graphs import UpdateGraphs, update_capturable

            if update_capturable(recipe.optimizer):
                self.updates = UpdateGraphs(recipe.optimizer, self._capture_device, stats=self.stats,
                                            pause=self.pause, check=check)
                recipe.use_update_graphs(self.updates)

    # -- the step ------------------------------------------------------------------------------

    def run(self, batches: list, args: ForwardArgs, scale: float,
            mark: Callable[[str], None] | None = None, divisor: float = 1.0) -> torch.Tensor:
        """The loop over ``batches``: replayed, captured or eager, and with ``ends_step`` the step's
        end.  ``batches`` may be on the host (pinned, :meth:`TrainLoader.next_batch` with
        ``on_host``): a replay then copies each into its graph's buffers, one copy per batch and
        nothing else on the host, and only a step run eagerly moves them to the device first.
        Returns the scaled losses' sum over ``divisor`` (0-d fp32, a fresh tensor).  ``mark``: the
        host phase tracer (:func:`speedrun.train.loop.run_step`'s ``on_phase``), called with
        "graph_key", "graph_inputs", "graph_launch" and "graph_after" as a replayed step issues
        each (:data:`speedrun.train.loop.GRAPH_PHASES`), or with
        "forward" once when the step is captured or runs eagerly."""
        mark = mark or _no_mark
        key = self._key(batches, args, scale, divisor)
        step = self._steps.get(key)
        if step is not None:
            mark("graph_key")
            return self._replay(step, batches, args, mark)
        if len(self._sightings) >= 256:  # keys that never came back (e.g. the first step of each stage)
            self._sightings.clear()
        seen = self._sightings[key] = self._sightings.get(key, 0) + 1
        if seen < CAPTURE_ON_SIGHT:
            self._note_missed(key)
            self.stats.eager_steps += 1
            total = self._loop([batch_to(b, self.device) for b in batches], args, scale, divisor)
            mark("forward")
            return total
        with self.pause():
            t0 = time.perf_counter()
            step = self._capture(key, batches, args, scale)
            self.stats.capture_s += time.perf_counter() - t0
        self._sightings.pop(key, None)
        # the capture left the model as it found it (its inputs and step values still in place):
        # the step itself runs on the clock
        self._replay_captured(step)
        total = self._loss.clone()
        mark("forward")
        return total

    @property
    def steps_until_replay(self) -> int:
        """Steps of one stage before every step of it replays: the loop's keys, and the update's
        too where it is captured (see :data:`STEPS_UNTIL_REPLAY`)."""
        return STEPS_UNTIL_REPLAY if self.updates is None else STEPS_UNTIL_UPDATE_REPLAY

    def summary(self) -> dict:
        """Counts for the run log: steps replayed and eager, captures, their time and checks (the
        optimizer's update graphs counted apart: ``update_*``, absent when it runs eagerly)."""
        s = self.stats
        out = {"graphs": len(self._steps), "replayed_steps": s.replayed_steps, "eager_steps": s.eager_steps,
               "captures": s.captures, "capture_s": round(s.capture_s, 3), "check_worst_rel_err": s.check_worst,
               "check_eager_noise": s.check_noise,
               "key_changes": list(s.key_changes),
               "pool_mib": round(self.pool_bytes() / 2**20, 1)}
        if self.updates is not None:
            out.update(self.updates.summary(), replayed_updates=s.replayed_updates, eager_updates=s.eager_updates,
                       update_captures=s.update_captures)
        return out

    def pool_bytes(self) -> int:
        """Bytes held by the graphs' memory pool (0 before the first capture; shared with the
        other users of a shared ``capturer``)."""
        return 0 if self._capturer is None else self._capturer.pool_bytes()

    def _capture_device(self):
        """The capturer both kinds of graph use (one stream, one memory pool), made on first use."""
        if self._capturer is None:
            self._capturer = self._capture_with(self.device)
        return self._capturer

    # -- keys ----------------------------------------------------------------------------------

    def _roots(self) -> list[tuple[str, Any]]:
        return _roots(self.model)

    def _key(self, batches: list, args: ForwardArgs, scale: float, divisor: float) -> StepKey:
        fingerprint = self._watch.fingerprint()
        if self._watch.walks != self._named_at:  # the model's structure may have changed
            self._named_params, self._named_at = list(self.model.named_parameters()), self._watch.walks
        return step_key(self.model, batches, args, scale, divisor, fingerprint=fingerprint, params=self._named_params)

    def _note_missed(self, key: StepKey) -> None:
        """Record (the first few times) why a step that resembles a captured one is not it."""
        if len(self.stats.key_changes) >= 8:
            return
        for known in self._steps:
            if (known.shapes, known.count, known.windows, known.present) != (key.shapes, key.count, key.windows,
                                                                            key.present):
                continue
            if known.signature != key.signature:
                self.stats.key_changes.append(f"signature {known.signature} -> {key.signature}")
            elif known.fingerprint != key.fingerprint:
                named = reachable_tensors(self._roots(), paths=True)
                changed = [name for (name, t), old in zip(named, known.fingerprint) if t.data_ptr() != old]
                if len(known.fingerprint) != len(named):
                    changed.append(f"(tensor count {len(known.fingerprint)} -> {len(named)})")
                self.stats.key_changes.append("addresses moved: " + ", ".join(changed[:4]))
            return

    # -- inputs --------------------------------------------------------------------------------

    def _static_inputs(self, batches: list, key: StepKey) -> list:
        """``batches`` copied into the static micro-batches of ``key``'s shapes (made on first use)."""
        slot = (key.shapes, key.count)
        static = self._inputs.get(slot)
        if static is None:
            static = self._inputs[slot] = [_empty_like_batch(b, self.device) for b in batches]
        for dst, src in zip(static, batches):
            packed, into = getattr(src, "packed", None), getattr(dst, "packed", None)
            if packed is not None and into is not None and packed.shape == into.shape:
                # the loader's batches: one buffer, same layout; from the host (pinned) straight
                # into the graph's buffer when the batch was fetched on the host
                into.copy_(packed, non_blocking=True)
                continue
            for f in ("inputs", "targets", "cu_seqlens", "bigram"):
                t = getattr(src, f, None)
                if t is not None:
                    getattr(dst, f).copy_(t, non_blocking=True)
        return static

    def _graph_args(self, args: ForwardArgs) -> ForwardArgs:
        """``args`` with the loss weights read from the step-values buffer (written now)."""
        weights = [float(w) for w in args.mtp_weights]
        prefix = not _is_zero(args.prefix_weight)
        values = weights + ([float(args.prefix_weight)] if prefix else [])
        if self._values is None:
            self._values = StepValues(self.device, max(8, len(values)))
        buf = self._values.write(values)
        k = len(weights)
        views = self._value_views.get((k, prefix))
        if views is None:
            views = self._value_views[(k, prefix)] = (buf[:k], buf[k] if prefix else 0.0)
        return ForwardArgs(window_short=args.window_short, window_long=args.window_long, mtp_weights=views[0],
                           prefix_weight=views[1])

    # -- replay --------------------------------------------------------------------------------

    def _replay(self, step: CapturedStep, batches: list, args: ForwardArgs,
                mark: Callable[[str], None]) -> torch.Tensor:
        self._static_inputs(batches, step.key)
        self._graph_args(args)
        mark("graph_inputs")
        self._replay_captured(step, mark)
        step.replays += 1
        self.stats.replayed_steps += 1
        total = self._loss.clone()
        mark("graph_after")
        return total

    def _replay_captured(self, step: CapturedStep, mark: Callable[[str], None] = _no_mark) -> None:
        """The graph's gradient buffers bound, its launch (``mark("graph_launch")`` right after
        it), then the model's host bookkeeping set to what the captured loop left."""
        for p, buf in step.carried:
            if p.grad is not buf:  # made by an eager step: carry it into the graph's buffer
                buf.copy_(p.grad)
        for p, buf in step.grads:
            p.grad = buf
        step.graph.replay()
        mark("graph_launch")
        if step.host_after is not None:
            self.model.set_graph_host_state(step.host_after)

    # -- capture -------------------------------------------------------------------------------

    def _loop(self, batches: list, args: ForwardArgs, scale: float, divisor: float) -> torch.Tensor:
        """What a graph holds, run eagerly: the micro-batch loop, the step end where it is
        captured too, the loss over ``divisor``."""
        total = microbatch.accumulate(self.model, batches, args, scale, self.device, self.dtype)
        if self.ends_step:
            self.model.end_step()
        return total if divisor == 1 else total / divisor

    def _capture(self, key: StepKey, batches: list, args: ForwardArgs, scale: float) -> CapturedStep:
        model, device = self.model, self.device
        if self._loss is None:
            self._loss = torch.zeros((), dtype=torch.float32, device=device)
        cap = self._capture_device()
        static = self._static_inputs(batches, key)
        gargs = self._graph_args(args)
        host = model.graph_host_state()
        cap.synchronize()
        self.stats.peak_allocated = max(self.stats.peak_allocated, cap.peak_allocated())

        # (1) the eager loop on the capture stream, from a snapshot of what it changes
        # (tensors that require grad are parameters or views of them: the loop does not write them)
        state = [(n, t) for n, t in reachable_tensors([("model", model)], paths=True, skip_parameters=True)
                 if not t.requires_grad]
        before = [t.detach().clone() for _, t in state]
        grads_before = {id(p): (p.grad, None if p.grad is None else p.grad.detach().clone()) for _, p in self._params}
        with cap.on_side_stream():
            eager_loss = self._loop(static, gargs, scale, key.divisor)
        cap.synchronize()
        if model.graph_signature() != key.signature:  # the host state a replay restores would not be whole
            raise SpeedrunError(f"CUDA graphs: the eager loop changed the model's graph signature "
                                f"({key.signature} -> {model.graph_signature()}); a key that does so "
                                "cannot be captured (the capture plan missed a state)")
        received = [(n, p) for n, p in self._params if p.grad is not None]
        names = ["loss"] + [f"{n}.grad" for n, _ in received] + [n for n, _ in state]

        def outputs(loss: torch.Tensor) -> list[torch.Tensor]:
            return [loss] + [p.grad for _, p in received] + [t for _, t in state]

        eager = [t.detach().clone() for t in outputs(eager_loss)] if self.check else []
        noise = [0.0] * len(names)
        if self.check:  # the eager loop again from the same snapshot: its own run-to-run noise
            self._restore(state, before, host, grads_before)
            with cap.on_side_stream():
                again = self._loop(static, gargs, scale, key.divisor)
            cap.synchronize()
            noise = [_relative_error(a, b) for a, b in zip(outputs(again), eager)]

        # (2) put the snapshot back, gradients into their run-long buffers
        self._restore(state, before, host, grads_before)
        grads, carried, fresh = [], [], []
        for _, p in received:
            buf = self._grad_buffers.get(id(p))
            if buf is None:
                buf = self._grad_buffers[id(p)] = torch.zeros_like(p, memory_format=torch.contiguous_format)
            old, saved = grads_before[id(p)]
            if old is None:
                fresh.append(buf)
            else:
                buf.copy_(saved)
                carried.append((p, buf))
            p.grad = buf
            grads.append((p, buf))
        cap.synchronize()

        # (3) capture, (4) replay
        def loop() -> None:
            if fresh:
                torch._foreach_zero_(fresh)
            self._loss.copy_(self._loop(static, gargs, scale, key.divisor))

        graph = cap.capture(loop)
        host_after = model.graph_host_state()
        step = CapturedStep(key, graph, static, grads, carried, host_after)
        self._replay_captured(step)
        cap.synchronize()

        # (5) the replay against the eager loop
        if self.check:
            what = (f"the step with {key.count} micro-batch(es) of shapes {key.shapes}, windows {key.windows}")
            step.check = compare_replay(what, names, outputs(self._loss), eager, noise,
                                        scalar_state_from=1 + len(received))
            self.stats.check_worst = max(self.stats.check_worst, step.check["worst_rel_err"])
            self.stats.check_noise = max(self.stats.check_noise, step.check["worst_eager_noise"])
        # (6) undo the replay: the caller runs the step, timed, like any replayed one (the work of
        # capturing is not training; the step is)
        self._restore(state, before, host, grads_before)
        cap.synchronize()
        del eager, state, before, grads_before
        cap.reset_peak()  # the snapshots above are not the run's memory
        self._steps[key] = step
        self.stats.captures += 1
        return step

    def _restore(self, state: list, before: list, host, grads_before: dict) -> None:
        """Put back the snapshot taken before the eager loop: the model's tensors, its host-side
        bookkeeping and every gradient (None where there was none)."""
        for (_, t), saved in zip(state, before):
            t.copy_(saved)
        if host is not None:
            self.model.set_graph_host_state(host)
        for _, p in self._params:
            old, saved = grads_before[id(p)]
            if old is not None:
                old.copy_(saved)
            p.grad = old


def compare_replay(what: str, names: list[str], got: list[torch.Tensor], want: list[torch.Tensor],
                   noise: list[float], scalar_state_from: int | None = None) -> dict:
    """Each replayed output against the eager run's: within ``CHECK_TOLERANCE`` or
    ``NOISE_FACTOR`` times the eager run's own run-to-run difference (NaN never passes);
    :class:`GraphMismatchError` names ``what`` (the captured work) and the first tensor outside.

    ``scalar_state_from`` i: ``got[i:]`` are state tensors, and a 0-d one among them is allowed
    ``SCALAR_STATE_TOLERANCE`` (see there)."""
    worst = worst_noise = 0.0
    exact = 0
    for i, (name, g, w, n) in enumerate(zip(names, got, want, noise)):
        err = _relative_error(g, w)
        bound = max(CHECK_TOLERANCE, NOISE_FACTOR * n)
        if scalar_state_from is not None and i >= scalar_state_from and g.dim() == 0:
            bound = max(bound, SCALAR_STATE_TOLERANCE)
        if not err <= bound:
            raise GraphMismatchError(
                f"CUDA graph of {what}: its replay differs from the eager run in {name} (relative error {err:.3g}; "
                f"allowed {bound:.3g}, the eager run's own run-to-run difference there is {n:.3g}); run "
                "with train.cuda_graphs=off and report this")
        worst, worst_noise = max(worst, err), max(worst_noise, n)
        exact += bool(torch.equal(g, w))
    return {"compared": len(names), "bitwise_equal": exact, "worst_rel_err": worst,
            "worst_eager_noise": worst_noise}


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    g, w = got.detach().double(), want.detach().double()
    if bool(torch.isnan(g).ne(torch.isnan(w)).any()):
        return float("nan")
    g, w = torch.nan_to_num(g, nan=0.0), torch.nan_to_num(w, nan=0.0)
    diff = float((g - w).norm())
    if diff == 0.0:
        return 0.0
    return diff / max(float(w.norm()), 1e-30)


def _is_zero(value) -> bool:
    return isinstance(value, (int, float)) and value == 0


def _empty_like_batch(batch, device: torch.device):
    """A static micro-batch shaped like ``batch`` (on the host or a device): fresh buffers on
    ``device``, which the graph reads; no bigram row mask (the rows were marked when the batch was
    fetched, and a mask here would be the first batch's forever)."""
    import dataclasses

    if getattr(batch, "packed", None) is not None:
        return batch_in(torch.empty_like(batch.packed, device=device), batch)
    fields = {f: (None if getattr(batch, f, None) is None else torch.empty_like(getattr(batch, f), device=device))
              for f in ("inputs", "targets", "cu_seqlens", "bigram")}
    if hasattr(batch, "bigram_rows"):
        fields["bigram_rows"] = None
    return dataclasses.replace(batch, **fields)

