"""CUDA graphs of the optimizer's update (``train.cuda_graph_optimizer``, one rank).

Issued eagerly, the record's NorMuon + Adam update is some hundreds of kernel launches (momentum,
Polar Express and the NorMuon step per matrix bank, one Adam pass per table) and their Python:
tens of milliseconds of host time against a few of GPU time.  Here the update's kernels
(:meth:`~speedrun.optim.normuon.NorMuonAndAdam.launch_kernels`) are captured once per *update
key* and replayed.  The host half stays eager and runs every step:
:meth:`~speedrun.optim.normuon.NorMuonAndAdam.prepare` decides which labels update, advances
Adam's step counts and writes the step's learning rates, momentum and bias corrections into the
optimizer's device buffer, which the kernels read when they run; after a replay
:meth:`~speedrun.optim.normuon.NorMuonAndAdam.release_grads` drops the consumed gradients as the
eager update does.

The update key is the plan's structure (Adam step or not, which labels update, whether embed's
gradient folds into lm_head's, tied or split) plus the address of every gradient the update reads
and of every tensor reachable from the optimizer (weights, moments, mantissas, the step-values
buffer).  A gradient or a state tensor at a new address makes a new key, which runs eagerly and
is captured at its second sight, as step keys are (:mod:`speedrun.train.graphs`).
The untie step (a one-off change of the optimizer's layout) always runs eagerly.

The device work the recipe puts around the update is captured with it, so a replayed step
launches nothing outside its two graphs: before it, on Adam steps, the flush of the embedding
tables' accumulated gradients into their ``.grad``; after it, the refresh of the FP8 weight copies.
Each comes as a :class:`~speedrun.kernels.device_work.DeviceWork` whose host half (which scaling
rule, which buffer becomes ``.grad``, counters) has run; its key and the addresses it writes join
the update key, and a piece that must run eagerly (a first refresh allocating its copies, a
resume's saved scales) makes the whole update eager that step.

Capture and self-check mirror the step graphs': the eager update runs twice from a snapshot of
everything it writes (weights, optimizer state, the gradients it modifies), to measure its own
run-to-run difference; the snapshot goes back, the update is captured and replayed, and the
replay must match the eager update within the same tolerance
(:func:`speedrun.train.graphs.compare_replay`); then the snapshot goes back again and the update
itself is replayed on the clock, after the pause.

Only an optimizer whose collectives are all local (one rank) is captured: on several ranks the
sparse bigram exchange sizes its messages on the host, which a graph cannot do.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from speedrun.train.addresses import AddressWatch
from speedrun.train.graphs import CAPTURE_ON_SIGHT, GraphStats, _relative_error, compare_replay

__all__ = ["UpdateGraphs", "update_capturable"]


def update_capturable(optimizer) -> bool:
    """Whether :class:`UpdateGraphs` can capture ``optimizer``'s update: a NorMuonAndAdam on one
    rank (no collective to issue)."""
    from speedrun.optim.normuon import NorMuonAndAdam

    return isinstance(optimizer, NorMuonAndAdam) and optimizer.comms.world == 1


@dataclass
class CapturedUpdate:
    graph: Any  # torch.cuda.CUDAGraph (anything with .replay())
    reads: list  # the gradients the graph reads (kept alive with it)
    replays: int = 0
    check: dict = field(default_factory=dict)


class UpdateGraphs:
    """Capture and replay of the optimizer's update (see the module docstring).

    optimizer: the run's :class:`~speedrun.optim.normuon.NorMuonAndAdam` (one rank).
    capturer: returns the :class:`~speedrun.train.graphs.CudaCapture` (or stand-in) to capture
    with, shared with the step graphs (one memory pool).  pause: the context the capture and its
    check run in (the training loop stops its clock there).  stats: the step graphs' counters,
    which this adds its own to.  check: compare each capture's first replay with the eager update.
    """

    def __init__(self, optimizer, capturer: Callable[[], Any], *, stats: GraphStats,
                 pause: Callable[[], contextlib.AbstractContextManager] | None = None, check: bool = True):
        if not update_capturable(optimizer):
            raise ValueError("UpdateGraphs: only a NorMuonAndAdam on one rank can be captured")
        self.optimizer = optimizer
        self._capturer = capturer
        self.pause = pause or contextlib.nullcontext
        self.check = check
        self.stats = stats
        self._updates: dict[tuple, CapturedUpdate] = {}
        self._watch = AddressWatch([("optimizer", optimizer)])  # the update key's fingerprint
        self._sightings: dict[tuple, int] = {}

    def launch(self, plan, before=None, after=None) -> None:
        """The update ``plan`` (from ``optimizer.prepare``) with the device work ``before`` and
        ``after`` it (:class:`~speedrun.kernels.device_work.DeviceWork` whose host halves have
        run: the embedding tables' gradient flush, the FP8 weight copies' refresh): replayed,
        captured or eager, all three together.  Settling the work is the caller's."""
        opt = self.optimizer
        key = self._key(plan, before, after)
        if key is None:
            self.stats.eager_updates += 1
            self._launch_eagerly(plan, before, after)
            return
        captured = self._updates.get(key)
        if captured is None:
            if len(self._sightings) >= 256:
                self._sightings.clear()
            seen = self._sightings[key] = self._sightings.get(key, 0) + 1
            if seen < CAPTURE_ON_SIGHT:
                self.stats.eager_updates += 1
                self._launch_eagerly(plan, before, after)
                return
            with self.pause():
                t0 = time.perf_counter()
                captured = self._capture(key, plan, before, after)
                self.stats.capture_s += time.perf_counter() - t0
            self._sightings.pop(key, None)
            captured.graph.replay()  # the capture undid its own replay: the update itself, on the clock
        else:
            captured.graph.replay()
            captured.replays += 1
            self.stats.replayed_updates += 1
        opt.release_grads(plan)

    def _launch_eagerly(self, plan, before, after) -> None:
        if before is not None:
            before.launch()
        self.optimizer.launch(plan)
        if after is not None:
            after.launch()

    def _launch_kernels(self, plan, before, after) -> None:
        """What a capture holds: the kernels of ``before``, the update and ``after``, in order."""
        if before is not None:
            before.launch()
        self.optimizer.launch_kernels(plan)
        if after is not None:
            after.launch()

    # -- keys --------------------------------------------------------------------------------------

    def _reads(self, plan) -> list[torch.Tensor]:
        """The gradients the update reads: each updating label's, and embed's when it folds into
        lm_head's."""
        entries = self.optimizer.entries
        grads = [entries[label].param.grad for label in plan.stepping]
        if plan.fold_embed:
            grads.append(entries[self.optimizer.tied[1]].param.grad)
        return grads

    def _key(self, plan, before=None, after=None) -> tuple | None:
        if plan.untie:
            return None
        around = []
        for work in (before, after):
            if work is None:
                around.append(None)
            elif work.key is None:
                return None  # it must run eagerly, and the update with it
            else:
                around.append((work.key, tuple(t.data_ptr() for _, t in work.written())))
        return (plan.structure, tuple(g.data_ptr() for g in self._reads(plan)), self._watch.fingerprint(),
                tuple(around))

    # -- capture -----------------------------------------------------------------------------------

    def _written(self, plan) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of everything the update writes: the updating labels' weights (embed's
        too while it copies lm_head) and optimizer state, and the gradients it modifies (lm_head's
        when embed's folds in).  (The sparse row marks live on the host and exist on several
        ranks only, which are not captured.)"""
        opt = self.optimizer
        out: list[tuple[str, torch.Tensor]] = []
        labels = list(plan.stepping)
        tied = opt.tied is not None and not plan.split_embed
        if tied and opt.tied[0] in plan.stepping:
            labels.append(opt.tied[1])
        for label in labels:
            e = opt.entries[label]
            out.append((label, e.param.data))
            if label in plan.stepping:
                out += [(f"{label}.{k}", t) for k, t in e.state.items() if isinstance(t, torch.Tensor)]
        if plan.fold_embed:
            out.append((f"{opt.tied[0]}.grad", opt.entries[opt.tied[0]].param.grad))
        return out

    def _compared(self, plan) -> list[tuple[str, torch.Tensor]]:
        """What the self-check compares: :meth:`_written`, with a bf16 weight and its mantissa
        buffer joined into the fp32 master they hold (a last-bit difference of the master moves
        the mantissa's integer bits by any amount)."""
        from speedrun.optim.normuon import join_bf16

        opt = self.optimizer
        masters = {}
        for label in plan.stepping:
            m = opt.entries[label].state.get("mantissa")
            if m is not None:
                masters[label] = join_bf16(opt.entries[label].param.data.reshape(m.shape), m)
        out = []
        for name, t in self._written(plan):
            label = name.split(".")[0]
            if name in masters:
                out.append((f"{name} (fp32 master)", masters[name]))
            elif not (label in masters and name == f"{label}.mantissa"):
                out.append((name, t))
        return out

    def _capture(self, key: tuple, plan, before=None, after=None) -> CapturedUpdate:
        opt, cap = self.optimizer, self._capturer()
        around = [(f"{where}: {name}", t) for where, work in (("before", before), ("after", after))
                  if work is not None for name, t in work.written()]
        written = self._written(plan) + around
        cap.synchronize()
        before_state = [t.detach().clone() for _, t in written]

        def restore() -> None:
            for (_, t), saved in zip(written, before_state):
                t.copy_(saved)

        def compared() -> list[tuple[str, torch.Tensor]]:
            return self._compared(plan) + around

        def run() -> None:
            self._launch_kernels(plan, before, after)

        with cap.on_side_stream():
            run()
        cap.synchronize()
        eager = [t.detach().clone() for _, t in compared()] if self.check else []
        noise = [0.0] * len(eager)
        if self.check:  # its own run-to-run difference
            restore()
            with cap.on_side_stream():
                run()
            cap.synchronize()
            noise = [_relative_error(t, e) for (_, t), e in zip(compared(), eager)]
        restore()
        cap.synchronize()
        graph = cap.capture(run)
        graph.replay()
        cap.synchronize()
        captured = CapturedUpdate(graph, self._reads(plan))
        if self.check:
            labels = ", ".join(plan.stepping)
            what = f"the optimizer update of step {plan.step_index} ({'with' if plan.do_adam else 'without'} Adam: {labels})"
            if around:
                what += " with the device work around it"
            items = compared()
            captured.check = compare_replay(what, [n for n, _ in items], [t for _, t in items], eager, noise)
            self.stats.check_worst = max(self.stats.check_worst, captured.check["worst_rel_err"])
            self.stats.check_noise = max(self.stats.check_noise, captured.check["worst_eager_noise"])
        restore()  # the caller replays the update on the clock
        cap.synchronize()
        del before_state, eager
        cap.reset_peak()
        self._updates[key] = captured
        self.stats.update_captures += 1
        return captured

    def summary(self) -> dict:
        return {"update_graphs": len(self._updates)}
