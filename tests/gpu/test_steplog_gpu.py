"""The step log on a CUDA GPU: reading a step's loss and time never waits for the step queued
after it (the point of :mod:`speedrun.train.steplog`), and the times are the device's."""

from __future__ import annotations

import pytest
import torch

from speedrun.train.steplog import StepLog

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")
SLEEP_CYCLES = 2_000_000_000  # ~1 s of a spinning kernel at ~2 GHz


class _Clock:
    generation = 1


def test_reading_a_step_does_not_wait_for_the_next_one():
    log = StepLog(DEV, _Clock())
    x = torch.ones((), device=DEV)
    torch.cuda.synchronize()
    log.start_window()
    log.record(1, 0, x * 3, 1)           # step 1: a tiny kernel
    torch.cuda._sleep(SLEEP_CYCLES)       # step 2: a long one
    log.record(2, 0, x * 5, 1)
    (first,) = log.finished(keep=1)
    still_running = not torch.cuda.current_stream().query()
    assert first.step == 1 and first.loss == 3.0 and first.step_ms is not None
    assert still_running, "reading step 1 waited for step 2"
    (second,) = log.finished(keep=0)
    assert second.step == 2 and second.loss == 5.0
    assert second.step_ms > 100.0, second.step_ms  # the long kernel is in step 2's time, on the device


def test_the_loop_logs_every_step_without_a_sync_per_step(tmp_path):
    """A GPU run with log_every=1: every step's line is written, in order, and the stage lines come
    from every step's device time (not only from synchronised steps)."""
    from speedrun.config import apply_overrides, preset
    from speedrun.train.loop import train

    cfg = preset("tiny-record")
    apply_overrides(cfg, ["train.steps=12", "train.num_extension=2", "train.val_every=0", "train.log_every=1",
                          f"out_dir={tmp_path}", "train.dtype=bf16", "train.device=cuda"])
    result = train(cfg, console=False)
    text = (result.run_dir / "log.txt").read_text()
    steps = [int(line.split(":")[1].split("/")[0]) for line in text.splitlines() if line.startswith("step:")
             and "train_time" in line and "val_loss" not in line]
    assert steps == list(range(1, 13)), steps
    assert "timed steps, median" in text
