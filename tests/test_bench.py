"""speedrun bench step on the CPU: arm syntax, statistics, and two tiny arms end to end."""

import json
import math

import numpy as np
import torch
import pytest

from speedrun.cli import main
from speedrun.errors import ConfigError
from speedrun.evidence.arms import ArmSpec, parse_arm, parse_arms
from speedrun.evidence.bench import bootstrap_ratio_ci, describe_times


pytestmark = pytest.mark.usefixtures("use_builtin_cache", "one_thread")

SMALL = ["model.num_layers=1", "model.model_dim=64", "model.num_heads=2", "model.qk_head_dim=16",
         "model.v_head_dim=32", "train.batch_tokens=1024", "train.max_seq_len=128"]


def test_arm_syntax():
    a = parse_arm("cand=tiny:model.qk_head_dim=16,train.lr=1e-3")
    assert a == ArmSpec("cand", "tiny", ("model.qk_head_dim=16", "train.lr=1e-3"))
    assert parse_arm("tiny") == ArmSpec("tiny", "tiny", ())
    # JSON values keep their commas; top-level fields need no section.
    s = parse_arm('x=tiny:train.stages=[[0, 512, 64, 16, 16]],name=foo,train.steps=7')
    assert s.overrides == ("train.stages=[[0, 512, 64, 16, 16]]", "name=foo", "train.steps=7")
    cfg = parse_arm("c=tiny:model.qk_head_dim=16,train.lr=1e-3").config(["train.lr=5e-3", "train.steps=9"])
    assert cfg.model.qk_head_dim == 16 and cfg.train.lr == 1e-3 and cfg.train.steps == 9  # arm wins over common
    for bad in ("=tiny", "a b=tiny", "a=tiny:", "a=tiny:lr"):
        with pytest.raises(ConfigError):
            parse_arm(bad)
    with pytest.raises(ConfigError, match="repeated: a"):
        parse_arms(["a=tiny", "a=small"])
    with pytest.raises(ConfigError, match="unknown preset"):
        parse_arm("a=nosuch").config()
    with pytest.raises(ConfigError, match="unknown setting"):
        parse_arm("a=tiny:train.nosuch=1").config()


def test_statistics():
    d = describe_times([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (d["median_ms"], d["q1_ms"], d["q3_ms"], d["iqr_ms"]) == (3.0, 2.0, 4.0, 2.0)
    rng = np.random.default_rng(1)
    a = 10 + rng.random(30)
    exact = bootstrap_ratio_ci(a, 2 * a)
    assert exact["ratio"] == pytest.approx(2.0) and exact["ci_low"] == pytest.approx(2.0)
    assert exact["ci_high"] == pytest.approx(2.0)
    b = 11 + rng.random(30)
    r = bootstrap_ratio_ci(a, b, seed=3)
    assert r == bootstrap_ratio_ci(a, b, seed=3)  # seeded
    assert r["ci_low"] < r["ratio"] < r["ci_high"]
    assert r["ratio"] == pytest.approx(np.median(b) / np.median(a))
    with pytest.raises(ValueError):
        bootstrap_ratio_ci(a, b[:-1])


def test_unpaired_ratio_interval():
    from speedrun.evidence.bench import unpaired_ratio_ci

    rng = np.random.default_rng(1)
    base, cand = 100 + rng.normal(0, 1, 13), 95 + rng.normal(0, 1, 20)  # different lengths: two programs
    r = unpaired_ratio_ci(base, cand, seed=3)
    assert r["ratio"] == pytest.approx(np.median(cand) / np.median(base))
    assert r["ci_low"] < r["ratio"] < r["ci_high"] < 1.0 and r == unpaired_ratio_ci(base, cand, seed=3)
    wide = unpaired_ratio_ci(100 + rng.normal(0, 10, 13), 95 + rng.normal(0, 10, 20), seed=3)
    assert wide["ci_high"] - wide["ci_low"] > 3 * (r["ci_high"] - r["ci_low"])
    with pytest.raises(ValueError, match=">= 2 times"):
        unpaired_ratio_ci([1.0], [1.0, 2.0])


def test_bench_step_two_arms_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "step", "--arm", "base=tiny", "--arm", "cand=tiny:model.qk_head_dim=32,model.mlp_ratio=2",
            "--steps", "20", "--warmup", "1", "--json", str(out)]
    for s in SMALL:
        args += ["--set", s]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "base" in text and "cand" in text and "1 (baseline)" in text and "[" in text
    res = json.loads(out.read_text())
    assert [a["name"] for a in res["arms"]] == ["base", "cand"] and res["steps"] == 20
    base, cand = res["arms"]
    assert len(base["times_ms"]) == len(cand["times_ms"]) == 20
    assert all(t > 0 for t in base["times_ms"] + cand["times_ms"])
    assert base["median_ms"] == pytest.approx(float(np.median(base["times_ms"])))
    assert base["tokens_per_s"] == pytest.approx(1024 / (base["median_ms"] / 1000))
    assert base["config"]["model"]["qk_head_dim"] == 16 and cand["config"]["model"]["qk_head_dim"] == 32
    r = cand["vs_base"]
    assert r["ci_low"] <= r["ratio"] <= r["ci_high"]
    assert r["ratio"] == pytest.approx(cand["median_ms"] / base["median_ms"])
    assert base["peak_mib"] is None and "peak MiB" in text  # memory is measured on CUDA only
    # the attention kernel each arm ran: auto resolved (on a CPU, the reference) or as named
    assert base["attention_backend"] == "reference" and "attention backend: base reference, cand reference" in text
    assert "comm_bytes_per_step" not in base  # counted for a simulated rank only (--as-rank-of)
    # the bench's own wall time by phase, for planning one into a time-limited call
    wall = res["wall_s"]
    assert set(wall["build"]) == set(wall["warmup"]) == {"base", "cand"}
    assert all(t > 0 for t in [*wall["build"].values(), *wall["warmup"].values(), wall["timed"]]) and wall["host"] >= 0
    # 20 rounds of two arms' steps: at least the sum of their timed samples
    assert wall["timed"] >= (sum(base["times_ms"]) + sum(cand["times_ms"])) / 1000
    assert "bench wall time, s: build base " in text and "; timed rounds " in text


def test_arms_report_every_step_loss_and_one_preset_trains_alike():
    """Arms of one config start from the same weights and batches: equal losses, step by step; a
    changed switch shows up in them."""
    from speedrun.evidence import bench

    res = bench.bench_step(parse_arms(["a=tiny", "b=tiny", "c=tiny:model.mlp_ratio=2"]), steps=20, warmup=1,
                           common=SMALL)
    a, b, c = (arm["losses"] for arm in res["arms"])
    assert len(a) == len(b) == len(c) == 21 and all(math.isfinite(x) for x in a)
    assert a == b and a[0] != c[0]
    table = bench.render_table(res)
    assert "training loss, b against a (same preset, same start): largest relative difference 0 over 21 steps" in table
    assert "training loss, c against a" in table


def test_step_memory_accounting_with_a_stand_in_meter(monkeypatch):
    """time_step's peak bookkeeping: the largest (peak during a step - allocated at its start)."""
    from types import SimpleNamespace

    from speedrun.evidence import bench

    class FakeMeter:
        def __init__(self):
            self.alloc, self.high = 100, 100

        def allocated(self):
            return self.alloc

        def peak(self):
            return self.high

        def reset_peak(self):
            self.high = self.alloc

    meter = FakeMeter()
    transient = iter([50, 80, 30])

    class FakeEvent:
        def __init__(self, **kw):
            pass

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 1.0

    def step():
        meter.high = max(meter.high, meter.alloc + next(transient))
        meter.alloc += 1  # something kept across steps (it is not transient)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    sess = SimpleNamespace(info=SimpleNamespace(device=torch.device("cuda")), step=step, step_peak_bytes=0)
    for _ in range(3):
        assert bench.time_step(sess, meter) == 1.0
    assert sess.step_peak_bytes == 80
    assert bench._memory_fields(SimpleNamespace(resident_bytes=2**20, step_peak_bytes=2**21, pool_bytes=2**22),
                                SimpleNamespace(device=torch.device("cuda"), enabled=False)) == \
        {"resident_mib": 1.0, "step_peak_mib": 2.0, "graph_pool_mib": 4.0, "peak_mib": 7.0}


def test_chained_samples_time_k_steps_back_to_back(monkeypatch):
    """--chain K: one sample = K steps issued without a full sync between them, reported as their
    mean; the device is synchronised once per sample (before it), and after issuing each step the
    host waits only for the step before it, as the training loop does (StepLog keep=1)."""
    from types import SimpleNamespace

    from speedrun.evidence import bench

    log = []

    class FakeEvent:
        made = 0

        def __init__(self, **kw):
            FakeEvent.made += 1
            self.n = FakeEvent.made

        def record(self):
            log.append(f"record {self.n}")

        def synchronize(self):
            log.append(f"wait {self.n}")

        def elapsed_time(self, other):
            return 12.0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("sync"))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    sess = SimpleNamespace(info=SimpleNamespace(device=torch.device("cuda")), step=lambda: log.append("step"),
                           step_peak_bytes=0)
    assert bench.time_step(sess, chain=3) == 4.0
    # events 1 and 2: the sample's start and end; 3, 4, 5: each step issued
    assert log == ["sync", "record 1", "step", "record 3", "step", "record 4", "wait 3", "step", "record 5",
                   "wait 4", "record 2", "wait 2"]
    log.clear()
    assert bench.time_step(sess) == 12.0 and log.count("step") == 1
    cpu = SimpleNamespace(info=SimpleNamespace(device=torch.device("cpu")), step=lambda: log.append("cpu"))
    log.clear()
    bench.time_step(cpu, chain=4)
    assert log == ["cpu"] * 4


def test_several_chain_lengths_are_timed_as_paired_series(tmp_path, capsys):
    """--chain 1,2: every arm timed both ways in the same rounds, as ARM and ARM@2, each with its
    ratio to the baseline series (the first arm, first length)."""
    out = tmp_path / "b.json"
    args = ["bench", "step", "--arm", "base=tiny", "--arm", "cand=tiny:model.mlp_ratio=2", "--steps", "20",
            "--warmup", "0", "--chain", "1,2", "--json", str(out)]
    args += [x for s in SMALL for x in ("--set", s)]
    assert main(args) == 0
    text = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert [a["name"] for a in res["arms"]] == ["base", "base@2", "cand", "cand@2"]
    assert [a["chain"] for a in res["arms"]] == [1, 2, 1, 2] and res["chain"] == [1, 2]
    assert all(len(a["times_ms"]) == 20 for a in res["arms"])
    assert all("vs_base" in a for a in res["arms"][1:]) and "vs_base" not in res["arms"][0]
    assert "samples of 1 and 2 steps back to back" in res["timing"] and "base@2" in text
    assert res["order"].startswith("interleaved, rotated each round: base base@2 cand cand@2 / cand cand@2 base base@2")


def test_arm_order_rotates_each_round(monkeypatch):
    """Round r starts with arm r mod n, so no arm always runs right after the same one."""
    from speedrun.evidence import bench

    calls = []
    monkeypatch.setattr(bench, "time_step", lambda s, meter=None, chain=1: calls.append(s.name) or 1.0)
    res = bench.bench_step(parse_arms(["a=tiny", "b=tiny", "c=tiny"]), steps=20, warmup=0, common=SMALL)
    assert calls[:9] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert len(calls) == 60 and all(calls.count(x) == 20 for x in "abc")
    assert res["order"] == "interleaved, rotated each round: a b c / b c a / ..."


def test_bench_stage_selection_and_errors(tmp_path, capsys):
    out = tmp_path / "b.json"
    stages = "train.stages=[[0, 512, 64, 32, 32], [5, 1024, 128, 64, 64]]"
    args = ["bench", "step", "--arm", "a=tiny", "--stage", "1", "--steps", "20", "--warmup", "0",
            "--json", str(out), "--set", stages, "--set", "train.grad_accum=2"]
    args += [x for s in SMALL for x in ("--set", s)]
    assert main(args + ["--arm", "m=tiny:train.min_micro_batch_tokens=1024"]) == 0
    arm, merged = json.loads(out.read_text())["arms"]
    assert arm["stage"]["max_seq_len"] == 128 and arm["stage"]["batch_tokens"] == 1024 and arm["grad_accum"] == 2
    assert arm["micro_batch_tokens"] == 512
    assert (merged["grad_accum"], merged["micro_batch_tokens"]) == (1, 1024)  # both chunks in one micro-batch
    assert "micro-batches per step: a 2 x 512, m 1 x 1024" in capsys.readouterr().out
    capsys.readouterr()
    assert main(args[:4] + ["--stage", "2"] + args[6:]) == 2
    assert "out of range" in capsys.readouterr().err
    assert main(["bench", "step", "--arm", "a=tiny", "--steps", "5"]) == 2
    assert ">= 20" in capsys.readouterr().err
    assert main(args + ["--chain", "0"]) == 2
    assert "--chain must be distinct step counts >= 1, got 0" in capsys.readouterr().err
    assert main(args + ["--chain", "1,1"]) == 2
    assert "--chain must be distinct" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args + ["--chain", "two"])
    assert "expected step counts like 1 or 1,3" in capsys.readouterr().err
    assert main(args[:4] + ["--stage", "0"] + args[6:] + ["--set", "train.triton_launch=fast"]) == 2
    assert "train.triton_launch='fast' is not allowed: must be one of cached, plain" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("compile_", [False, True])
def test_bench_step_on_gpu(tmp_path, compile_):
    """On a GPU: CUDA-event timing, bf16, optionally torch.compile (compiled in the untimed warmup)."""
    from speedrun.evidence.bench import bench_step

    common = SMALL + ["train.device=cuda", f"train.compile={str(compile_).lower()}"]
    res = bench_step(parse_arms(["base=tiny", "wide=tiny:model.mlp_ratio=8"]), steps=20, warmup=3, common=common)
    assert res["timing"].startswith("cuda events") and res["device"].startswith("cuda")
    base, wide = res["arms"]
    assert base["dtype"] == "bfloat16" and base["compile"] is compile_
    assert all(0 < t < 1000 for t in base["times_ms"] + wide["times_ms"])
    r = wide["vs_base"]
    assert r["ci_low"] <= r["ratio"] <= r["ci_high"]
    assert res["fingerprint"]["gpu_name"]
    # Memory per arm: a step allocates activations above what it starts with; the wider MLP more.
    assert 0 < base["resident_mib"] and 0 < base["step_peak_mib"] < wide["step_peak_mib"]
    assert base["peak_mib"] == pytest.approx(base["resident_mib"] + base["step_peak_mib"])
    # NVML (nvidia-ml-py is on the device image): clocks sampled while the arms' steps ran
    clocks = res["clocks"]
    assert clocks["note"].startswith("NVML every"), clocks["note"]
    assert sum(c["samples"] for c in clocks["per_arm"].values()) > 0
    assert all(300 < c["sm_mhz_median"] <= 3000 and c["power_w_median"] > 0 for c in clocks["per_arm"].values())


def test_bench_step_under_torchrun_two_ranks(tmp_path, builtin_cache):
    """Two gloo ranks on the CPU: each step is timed on every rank and the slowest rank counts;
    rank 0 alone writes the table and the JSON, which records the world size."""
    import os
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    out = tmp_path / "bench.json"
    args = ["bench", "step", "--arm", "base=tiny", "--arm", "cand=tiny:model.mlp_ratio=2",
            "--steps", "20", "--warmup", "1", "--json", str(out)]
    for s in SMALL:
        args += ["--set", s]
    env = dict(os.environ, OMP_NUM_THREADS="1", SPEEDRUN_CACHE_DIR=str(builtin_cache))
    run = subprocess.run([torchrun, "--standalone", "--nproc_per_node=2", "-m", "speedrun", *args],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and [a["name"] for a in res["arms"]] == ["base", "cand"]
    assert all(len(a["times_ms"]) == 20 and min(a["times_ms"]) > 0 for a in res["arms"])
    assert run.stdout.count("1 (baseline)") == 1, run.stdout  # one table, from rank 0


def test_clock_samples_are_filed_under_the_arm_whose_step_runs(monkeypatch):
    """With a GPU clock reader (a stand-in here), every sample taken during an arm's timed step is
    filed under that arm, none between steps, and the table prints the per-arm medians; on the CPU
    the result says why there are none."""
    import time

    from speedrun.evidence import bench
    from speedrun.evidence.gpuclock import ClockSampler

    fake = {"a": (1980.0, 300.0, 40.0), "b": (1700.0, 690.0, 60.0)}
    current = {"arm": None}
    sampler = ClockSampler(lambda: fake[current["arm"]] if current["arm"] else (0.0, 0.0, 0.0), interval_s=0.001)

    def step(s, meter=None, chain=1):
        current["arm"] = s.name
        time.sleep(0.02)  # the sampler thread runs while the "step" does
        current["arm"] = None
        return 1.0

    monkeypatch.setattr(bench, "time_step", step)
    monkeypatch.setattr(bench, "_clock_sampler", lambda info: (sampler, "stand-in reader"))
    res = bench.bench_step(parse_arms(["a=tiny", "b=tiny"]), steps=20, warmup=0, common=SMALL)
    per_arm = res["clocks"]["per_arm"]
    assert set(per_arm) == {"a", "b"} and all(v["samples"] >= 20 for v in per_arm.values())
    assert (per_arm["a"]["sm_mhz_median"], per_arm["a"]["power_w_median"]) == (1980.0, 300.0)
    assert (per_arm["b"]["sm_mhz_p10"], per_arm["b"]["temp_c_max"]) == (1700.0, 60.0)
    assert sampler.label is None and not sampler._thread.is_alive()
    text = bench.render_table(res)
    assert "GPU clocks while each arm ran (stand-in reader)" in text and "1700" in text

    monkeypatch.undo()
    monkeypatch.setattr(bench, "time_step", lambda s, meter=None, chain=1: 1.0)
    res = bench.bench_step(parse_arms(["a=tiny"]), steps=2, warmup=0, common=SMALL)
    assert res["clocks"] == {"per_arm": {}, "note": "no GPU clocks on a cpu device"}
    assert "GPU clocks: no GPU clocks on a cpu device" in bench.render_table(res)
    res = bench.bench_step(parse_arms(["a=tiny"]), steps=2, warmup=0, common=SMALL, clocks=False)
    assert res["clocks"]["note"] == "not sampled (--no-clocks)"


def test_clock_sampler_survives_failed_reads_and_checks_its_interval():
    import time

    from speedrun.evidence.gpuclock import ClockSampler

    reads = iter([RuntimeError("nvml hiccup")] + [(1800.0, 650.0, 55.0)] * 1000)

    def read():
        r = next(reads)
        if isinstance(r, Exception):
            raise r
        return r

    with ClockSampler(read, interval_s=0.001) as s:
        s.label = "x"
        time.sleep(0.05)
    assert s.errors == 1 and s.summary()["x"]["sm_mhz_median"] == 1800.0
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        ClockSampler(read, interval_s=0)


def test_bench_data_needs_no_validation_shards(tmp_path):
    """bench and profile never validate: a training glob whose named validation shards do not
    exist still runs (the training shards stand in, overlap allowed); when they exist they are used."""
    from speedrun.evidence.arms import data_overrides

    train = str(tmp_path / "x_train_*.bin")
    assert data_overrides(train, validates=False) == [
        "data.source=shards", f"data.train_files={train}", f"data.val_files={train}", "data.allow_val_overlap=true"]
    (tmp_path / "x_val_000000.bin").write_bytes(b"")
    assert data_overrides(train, validates=False)[2] == f"data.val_files={tmp_path / 'x_val_*.bin'}"
    assert data_overrides(train)[2] == f"data.val_files={tmp_path / 'x_val_*.bin'}"  # training names them always
