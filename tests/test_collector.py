"""train.gc_freeze and the collection meter: the heap is frozen while timed steps run (bench and
train), thawed afterwards, and collections are filed under the arm whose step ran."""

import gc
import sys

import pytest

from speedrun.errors import ConfigError
from speedrun.evidence.arms import parse_arms
from speedrun.train.collector import CollectionMeter, freeze_long_lived, thaw

pytestmark = pytest.mark.usefixtures("use_builtin_cache", "one_thread")

SMALL = ["model.num_layers=1", "model.model_dim=64", "model.num_heads=2", "model.qk_head_dim=16",
         "model.v_head_dim=32", "train.batch_tokens=1024", "train.max_seq_len=128"]


class _Cycle:
    def __init__(self):
        self.me = self


def test_freeze_and_thaw():
    # No other thread may run between the freeze and the count: under pytest-xdist, execnet's
    # I/O thread frees objects now and then, and a frozen object freed leaves the frozen count
    # (seen: 525966 frozen, 525964 counted a moment later).  Without forced switches the test's
    # thread keeps the interpreter through both reads.
    interval = sys.getswitchinterval()
    try:
        sys.setswitchinterval(1000.0)
        try:
            frozen, counted = freeze_long_lived(), gc.get_freeze_count()
        finally:
            sys.setswitchinterval(interval)
        assert frozen == counted > 0
        survivor = _Cycle()  # made after the freeze: still collectable
        del survivor
        assert gc.collect() > 0
    finally:
        thaw()
    assert gc.get_freeze_count() == 0


def test_meter_files_collections_under_the_current_label():
    meter = CollectionMeter()
    with meter:
        meter.label = "a"
        gc.collect(2)
        gc.collect(0)
        meter.label = None
        gc.collect(1)  # no label: not counted
        meter.label = "b"
        gc.collect(1)
    assert meter._callback not in gc.callbacks
    s = meter.summary()
    assert set(s) == {"a", "b"}
    assert s["a"]["count_by_generation"] == [1, 0, 1] and s["b"]["count_by_generation"] == [0, 1, 0]
    assert s["a"]["total_ms"] >= s["a"]["longest_ms"] > 0


def test_bench_times_steps_with_the_heap_frozen_and_reports_collections(monkeypatch):
    from speedrun.evidence import bench

    seen = []

    def step(s, meter=None, chain=1):
        seen.append((s.name, gc.get_freeze_count()))
        if s.name == "b" and len(seen) < 4:
            gc.collect(2)  # a full collection inside b's timed step
        return 1.0

    monkeypatch.setattr(bench, "time_step", step)
    res = bench.bench_step(parse_arms(["a=tiny", "b=tiny"]), steps=20, warmup=0, common=SMALL)
    assert len(seen) == 40 and all(n > 0 for _, n in seen)
    assert gc.get_freeze_count() == 0  # thawed when the bench ends
    # the count frozen, as the first timed step saw it; a frozen object freed in between (under
    # pytest-xdist, by execnet's I/O thread) leaves the count, which never grows until a refreeze
    assert 0 <= res["gc"]["frozen_objects"] - seen[0][1] <= 1000, (res["gc"]["frozen_objects"], seen[0][1])
    per_arm = res["gc"]["per_arm"]
    assert per_arm["a"]["count_by_generation"][2] == 0 and per_arm["b"]["count_by_generation"][2] >= 1
    assert "Python garbage collection during each arm's timed steps" in bench.render_table(res)

    seen.clear()
    res = bench.bench_step(parse_arms(["a=tiny:train.gc_freeze=false"]), steps=2, warmup=0, common=SMALL)
    assert all(n == 0 for _, n in seen) and res["gc"]["frozen_objects"] == 0


def test_bench_refuses_arms_that_disagree_on_the_process_wide_switch():
    from speedrun.evidence import bench

    with pytest.raises(ConfigError, match="gc_freeze is process-wide"):
        bench.bench_step(parse_arms(["a=tiny", "b=tiny:train.gc_freeze=false"]), steps=2, warmup=0, common=SMALL)


def test_train_runs_its_timed_steps_frozen(tmp_path, monkeypatch):
    from speedrun.config import preset
    from speedrun.train import loop

    counts = []
    real = loop.run_step
    monkeypatch.setattr(loop, "run_step", lambda *a, **k: counts.append(gc.get_freeze_count()) or real(*a, **k))
    cfg = preset("tiny")
    cfg.train.steps, cfg.train.val_every, cfg.train.warmup_steps = 3, 0, 1
    cfg.train.val_tokens = 4096
    cfg.out_dir = str(tmp_path)
    res = loop.train(cfg, console=False)
    assert counts[0] == 0 and all(n > 0 for n in counts[1:]) and len(counts) == 4  # warmup step unfrozen
    assert gc.get_freeze_count() == 0
    assert "objects frozen before the timed region" in (res.run_dir / "log.txt").read_text()


def test_profile_records_its_steps_with_the_heap_frozen(monkeypatch):
    from speedrun.evidence import bench
    from speedrun.evidence.profile import profile_steps

    counts = []
    real = bench.Session.step
    monkeypatch.setattr(bench.Session, "step", lambda self, *a, **k: counts.append(gc.get_freeze_count()) or real(self, *a, **k))
    profile_steps("t=tiny", common=SMALL, steps=2, warmup=1, measure=False)
    assert counts[0] == 0 and all(n > 0 for n in counts[1:]) and len(counts) == 3
    assert gc.get_freeze_count() == 0


def test_train_thaws_the_heap_when_a_timed_step_fails(tmp_path, monkeypatch):
    from speedrun.config import preset
    from speedrun.train import loop

    real = loop.run_step

    def failing(*a, **k):  # the warmup step runs, the first timed step fails
        if gc.get_freeze_count():
            raise RuntimeError("step failed")
        return real(*a, **k)

    monkeypatch.setattr(loop, "run_step", failing)
    cfg = preset("tiny")
    cfg.train.steps, cfg.train.val_every, cfg.train.warmup_steps = 3, 0, 1
    cfg.train.val_tokens = 4096
    cfg.out_dir = str(tmp_path)
    with pytest.raises(RuntimeError, match="step failed"):
        loop.train(cfg, console=False)
    assert gc.get_freeze_count() == 0
