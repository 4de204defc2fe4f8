"""The timed region's step log (:mod:`speedrun.train.steplog`) on the CPU: steps handed out once,
oldest first, all but the newest ``keep``; losses read back; a step timed only against an end in
its own clock window.  The device half (events, pinned copies, no wait for the newest step) is
``tests/gpu/test_steplog_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from speedrun.train.steplog import StepLog


class _Clock:
    generation = 0


def test_steps_are_handed_out_once_oldest_first_keeping_the_newest():
    clock = _Clock()
    log = StepLog(torch.device("cpu"), clock)
    log.start_window()
    loss = torch.tensor(2.5)
    log.record(1, 0, loss, 1)
    loss.add_(1.0)  # the caller reuses its tensor: the recorded value stays
    log.record(2, 0)
    assert [f.step for f in log.finished(keep=1)] == [1] and log.pending() == 1
    assert log.finished(keep=1) == []
    log.record(3, 1, torch.tensor(4.0), 2)
    got = log.finished(keep=0)
    assert [(f.step, f.stage, f.loss, f.steps_logged) for f in got] == [(2, 0, None, 0), (3, 1, 4.0, 2)]
    assert log.pending() == 0


def test_a_step_is_timed_only_within_its_clock_window(monkeypatch):
    import speedrun.train.steplog as steplog

    now = iter([10.0, 10.5, 11.25, 20.0, 30.0, 30.5, 31.0])
    monkeypatch.setattr(steplog.time, "perf_counter", lambda: next(now))
    clock = _Clock()
    log = StepLog(torch.device("cpu"), clock)
    log.start_window()          # 10.0
    log.record(1, 0)            # 10.5: 500 ms from the window's start
    log.record(2, 0)            # 11.25: 750 ms
    clock.generation += 1       # a pause (a CUDA-graph capture) inside step 3
    log.record(3, 0)            # 20.0: not timed
    log.record(4, 0)            # 30.0: 10 s after step 3, same window
    clock.generation += 1       # the clock stopped and started again (validation)
    log.start_window()          # 30.5
    log.record(5, 1)            # 31.0: 500 ms from the new window's start
    got = {f.step: f.step_ms for f in log.finished()}
    assert got == {1: pytest.approx(500.0), 2: pytest.approx(750.0), 3: None, 4: pytest.approx(10000.0),
                   5: pytest.approx(500.0)}
