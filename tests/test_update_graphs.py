"""The optimizer's update through CUDA-graph bookkeeping (speedrun.train.update_graphs), on the CPU:
the capture stood in by re-running the update (RerunCapture), so keys, sightings, the snapshot and
restore of the self-check and the host half around each replay are exercised; what a GPU replay
computes is compared with eager in tests/gpu/test_graphs_gpu.py.

Gradients live in buffers kept across steps here, as the training step's graphs keep them (a
gradient at a new address is a new key)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_normuon import HYPER, TABLE, WORK, make_grads, make_params  # noqa: E402

from speedrun.optim.normuon import NorMuonAndAdam  # noqa: E402
from speedrun.train.graphs import GraphMismatchError, GraphStats, RerunCapture  # noqa: E402
from speedrun.train.update_graphs import UpdateGraphs, update_capturable  # noqa: E402

UNTIE_AT = 5


class Schedule:
    """lr and momentum moving every step, Adam on odd steps, untie after step UNTIE_AT."""

    def at(self, step: int):
        return SimpleNamespace(lr_mult=1.0 - 0.03 * step, muon_momentum=0.85 + 0.01 * step,
                               adam_step=step % 2 == 1, untie=step == UNTIE_AT)


def _run(steps: int, graphs: bool, capturer=lambda params: RerunCapture(torch.device("cpu"))):
    """``steps`` updates of the test optimizer, eager or through UpdateGraphs with
    ``capturer(params)`` standing in for the capture."""
    params = make_params()
    opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER, schedule=Schedule(),
                         tied=("lm_head", "embed"))
    stats = GraphStats()
    updates = UpdateGraphs(opt, lambda: capturer(params), stats=stats) if graphs else None
    buffers = {k: torch.zeros_like(p) for k, p in params.items()}
    for step in range(steps):
        for k, p in params.items():  # the step's gradients, added to what an even step left
            g = make_grads(0, step)[k]
            if p.grad is None:
                buffers[k].copy_(g)
                p.grad = buffers[k]
            else:
                p.grad.add_(g)
        plan = opt.prepare(step)
        if updates is None:
            opt.launch(plan)
        else:
            updates.launch(plan)
    return params, opt, stats


def test_replayed_updates_equal_the_eager_ones_bit_for_bit():
    eager, eager_opt, _ = _run(12, graphs=False)
    replayed, opt, stats = _run(12, graphs=True)
    for k in eager:
        assert torch.equal(eager[k].data, replayed[k].data), k
        assert (eager[k].grad is None) == (replayed[k].grad is None), k
    for label, e in eager_opt.entries.items():
        for name, t in e.state.items():
            got = opt.entries[label].state[name]
            assert (torch.equal(t, got) if isinstance(t, torch.Tensor) else t == got), (label, name)
    # tied steps 0-5 (step 5 unties: always eager), then split ones: two structures each, every
    # one eager at its first sight, captured at its second, replayed after
    assert stats.update_captures == 4 and stats.check_worst == 0.0
    assert stats.eager_updates == 5 and stats.replayed_updates == 12 - 5 - 4
    assert opt.split_embed and eager_opt.split_embed


def test_a_replay_that_computes_something_else_stops_the_run():
    class Poisoned(RerunCapture):
        def __init__(self, params):
            super().__init__(torch.device("cpu"))
            self.params = params

        def capture(self, fn):
            def poisoned():
                fn()
                self.params["table"].data.add_(1.0)  # the graph writes a wrong weight

            return super().capture(poisoned)

    with pytest.raises(GraphMismatchError, match=r"optimizer update of step 3 \(with Adam.*in table "):
        _run(4, graphs=True, capturer=Poisoned)


def test_only_a_one_rank_normuon_optimizer_is_captured():
    from speedrun.optim.simcomms import SimulatedComms

    params = make_params()
    assert update_capturable(NorMuonAndAdam(params, TABLE, hyper=HYPER))
    assert not update_capturable(NorMuonAndAdam(params, TABLE, hyper=HYPER, comms=SimulatedComms(2)))
    assert not update_capturable(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    with pytest.raises(ValueError, match="one rank"):
        UpdateGraphs(NorMuonAndAdam(params, TABLE, hyper=HYPER, comms=SimulatedComms(2)), lambda: None,
                     stats=GraphStats())


def test_a_replayed_step_reads_this_steps_values_from_the_device_buffer():
    """prepare writes the step's values; the same captured update then applies them: a step
    replayed with a learning rate of 0 leaves NorMuon's weights as they were."""
    params = make_params()
    opt = NorMuonAndAdam(params, TABLE, work_order=WORK, hyper=HYPER)
    updates = UpdateGraphs(opt, lambda: RerunCapture(torch.device("cpu")), stats=GraphStats())
    buf = {k: torch.zeros_like(p) for k, p in params.items()}
    for step in range(2):  # one key (no Adam step): eager, then captured
        for k, p in params.items():
            buf[k].copy_(make_grads(0, step)[k])
            p.grad = buf[k]
        updates.launch(opt.prepare(step, lr_mult=1.0, muon_momentum=0.9, do_adam=False))
    assert updates.stats.update_captures == 1
    before = params["bank"].detach().clone()
    for k, p in params.items():
        buf[k].copy_(make_grads(0, 9)[k])
        p.grad = buf[k]
    updates.launch(opt.prepare(4, lr_mult=0.0, muon_momentum=0.9, do_adam=False))
    assert updates.stats.replayed_updates == 1
    torch.testing.assert_close(params["bank"].detach(), before, rtol=0, atol=0)
