"""speedrun.evidence.host on the CPU: phase timings from the recorder, summaries, the sync-warning
collector, and ``bench step --host-steps --sync-scan`` end to end on tiny arms.  The CUDA half
(events, leads, torch's sync debug mode) is tested in tests/gpu/test_host_gpu.py."""

import json
import warnings

import pytest
import torch

from speedrun.cli import main
from speedrun.evidence.host import (SYNC_WARNING, sync_site, PhaseRecorder, PhaseTiming, StepTrace, collect_sync_warnings,
                                    summarize_traces, trace_step)
from speedrun.train.loop import STEP_PHASES

pytestmark = pytest.mark.usefixtures("use_builtin_cache", "one_thread")

SMALL = ["model.num_layers=1", "model.model_dim=64", "model.num_heads=2", "model.qk_head_dim=16",
         "model.v_head_dim=32", "train.batch_tokens=1024", "train.max_seq_len=128"]
CPU = torch.device("cpu")


def test_recorder_sums_repeated_phases_and_refuses_disorder():
    rec = PhaseRecorder(CPU)
    rec.names = ["start", "setup", "data", "forward", "data", "forward", "optimizer"]
    rec.host_s = [1.0, 1.001, 1.003, 1.010, 1.012, 1.020, 1.050]
    t = rec.timings()
    assert list(t) == ["setup", "data", "forward", "optimizer"]
    assert {k: v.host_ms for k, v in t.items()} == pytest.approx({"setup": 1.0, "data": 4.0, "forward": 15.0,
                                                                  "optimizer": 30.0})
    assert t["data"].count == 2 and t["forward"].gpu_ms is None and t["forward"].lead_min_ms is None
    one = PhaseRecorder(CPU)
    one("start")
    assert one.timings() == {}
    bad = PhaseRecorder(CPU)
    bad.names, bad.host_s = ["start", "setup"], [2.0, 1.0]
    with pytest.raises(ValueError, match="out of time order"):
        bad.timings()


def test_summary_takes_medians_per_phase():
    traces = [StepTrace(10.0, {"forward": PhaseTiming(6.0, 8.0, 0.5)}),
              StepTrace(12.0, {"forward": PhaseTiming(7.0, 9.0, 1.5), "data": PhaseTiming(1.0)}),
              StepTrace(30.0, {"forward": PhaseTiming(20.0, 10.0, 0.0)})]
    s = summarize_traces(traces)
    assert s["steps"] == 3 and s["host_ms"] == pytest.approx(12.0)
    assert s["phases"]["forward"] == pytest.approx({"host_ms": 7.0, "gpu_ms": 9.0, "lead_min_ms": 0.5})
    assert s["phases"]["data"] == {"host_ms": 1.0, "gpu_ms": None, "lead_min_ms": None}
    assert "micro_batch_host_ms" not in s
    with pytest.raises(ValueError):
        summarize_traces([])


def test_summary_gives_the_host_time_per_micro_batch():
    """The micro-batch phases of each step (eager or replayed), summed, median over steps, over
    the step's micro-batch count; the once-per-step phases are not in it."""
    eager = StepTrace(40.0, {"setup": PhaseTiming(3.0), "data": PhaseTiming(2.0, count=4),
                             "forward": PhaseTiming(10.0, count=4), "backward": PhaseTiming(6.0, count=4),
                             "after_backward": PhaseTiming(2.0, count=4), "optimizer": PhaseTiming(9.0)})
    replayed = StepTrace(20.0, {"setup": PhaseTiming(3.0), "data": PhaseTiming(1.0), "graph_key": PhaseTiming(0.5),
                                "graph_inputs": PhaseTiming(0.25), "graph_launch": PhaseTiming(0.125),
                                "graph_after": PhaseTiming(0.125), "fp8_refresh": PhaseTiming(5.0)})
    assert summarize_traces([eager], micro_batches=4)["micro_batch_host_ms"] == pytest.approx(20.0 / 4)
    s = summarize_traces([replayed, replayed, eager], micro_batches=4)
    assert s["micro_batch_host_ms"] == pytest.approx(2.0 / 4) and s["micro_batches"] == 4
    # without the launch (which may wait for queue space): median over the same steps
    assert s["micro_batch_host_ms_no_launch"] == pytest.approx(1.875 / 4)
    assert "micro_batch_host_ms_no_launch" not in summarize_traces([eager], micro_batches=4)
    with pytest.raises(ValueError, match="micro_batches"):
        summarize_traces([eager], micro_batches=0)


def _sync_here():
    warnings.warn(f"called a {SYNC_WARNING}", UserWarning)


def test_sync_collector_groups_by_call_site_and_passes_other_warnings():
    def run():
        for _ in range(3):
            _sync_here()
        _sync_here()
        warnings.warn("something else", UserWarning)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = collect_sync_warnings(run)
    assert [e["count"] for e in found] == [4]  # one line, called from two places: one site (innermost frame)
    assert found[0]["site"].startswith("test_host.py:") and found[0]["site"].endswith("_sync_here")
    assert SYNC_WARNING in found[0]["message"]
    assert [str(w.message) for w in seen] == ["something else"]
    assert collect_sync_warnings(lambda: None) == []


def test_sync_site_counts_only_the_package_as_ours_whatever_the_clone_is_called():
    """A clone in a folder named ``speedrun`` puts "/speedrun/" in the tests' paths too: only
    files under the package itself are ours (the innermost other frame names a test)."""
    import traceback

    import speedrun.train.loop as loop_module

    clone_test = traceback.FrameSummary("/home/me/speedrun/tests/test_x.py", 7, "helper")
    ours = traceback.FrameSummary(loop_module.__file__, 170, "run_step")
    assert sync_site([clone_test]) == "test_x.py:7 helper"
    assert sync_site([clone_test, ours]) == "speedrun/train/loop.py:170 run_step"


def test_trace_step_on_cpu_times_the_phases():
    def step(on_phase):
        on_phase("start")
        on_phase("forward")
        on_phase("optimizer")

    r = trace_step(step, CPU)
    assert set(r.phases) == {"forward", "optimizer"} and r.host_ms >= 0
    assert all(p.host_ms >= 0 and p.gpu_ms is None for p in r.phases.values())


def test_bench_step_host_side_on_tiny_arms(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "step", "--arm", "base=tiny", "--arm", "b2=tiny:model.mlp_ratio=2", "--steps", "20",
            "--warmup", "1", "--host-steps", "2", "--sync-scan", "--json", str(out)]
    for s in SMALL:
        args += ["--set", s]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "host side" in text and "forward" in text and "(whole step)" in text and "(per micro-b.)" in text
    res = json.loads(out.read_text())
    for arm in res["arms"]:
        h = arm["host"]
        assert h["steps"] == 2 and set(h["phases"]) <= set(STEP_PHASES)
        assert h["micro_batches"] >= 1 and 0 < h["micro_batch_host_ms"] * h["micro_batches"] <= h["host_ms"]
        assert {"setup", "data", "forward", "backward", "optimizer"} <= set(h["phases"])
        assert all(p["gpu_ms"] is None and p["host_ms"] >= 0 for p in h["phases"].values())  # no GPU
        assert 0 < sum(p["host_ms"] for p in h["phases"].values()) <= h["host_ms"] + 1e-6
        assert "syncs" not in arm  # the scan needs CUDA
    assert main(args[:-2] + ["--host-steps", "-1"]) == 2
    assert "--host-steps must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("lead_ms, shown", [(177.0, True), (0.2, False), (None, False)])
def test_host_table_adds_the_micro_batch_time_without_a_launch_that_waits(lead_ms, shown):
    """Where the GPU trails a graph's launch far behind (a filling launch queue), the host table
    adds the per-micro-batch host time without the launch, whose time is then a wait."""
    from speedrun.evidence.bench import _render_host

    replayed = StepTrace(30.0, {"data": PhaseTiming(0.5), "graph_key": PhaseTiming(0.5),
                                "graph_launch": PhaseTiming(28.0, 200.0, lead_ms), "graph_after": PhaseTiming(1.0)})
    host = summarize_traces([replayed], micro_batches=8)
    text = "\n".join(_render_host({"arms": [{"name": "candg", "median_ms": 212.0, "host": host}]}))
    assert "(per micro-b.)       3.75" in text
    assert ("(w/o launch)         0.25" in text) is shown, text
    assert ("trails the launch by 177 ms" in text) is shown
