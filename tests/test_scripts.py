"""The device scripts in tools/ at least parse (they only run on the GPU machines)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "tools").glob("*.sh"))


def _load_script(path: Path):
    """A benchmark or tool script (benchmarks/ and tools/ are not packages) as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load_bench(name: str):
    return _load_script([s for s in PY_BENCHES if s.name == name + ".py"][0])


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_shell_script_parses(script):
    bash = shutil.which("bash") or pytest.skip("no bash")
    out = subprocess.run([bash, "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_multigpu_script_refuses_unknown_parts(tmp_path):
    bash = shutil.which("bash") or pytest.skip("no bash")
    script = [s for s in SCRIPTS if s.name == "multigpu_run.sh"][0]
    env = {"PATH": "/usr/bin:/bin", "DEVICE": "cpu", "OUT": str(tmp_path / "out"), "WORK": str(tmp_path / "w"),
           "SPEEDRUN_TEST_DATA": str(tmp_path)}
    out = subprocess.run([bash, str(script), "nonsense"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 2 and "unknown part nonsense" in out.stderr


@pytest.mark.parametrize("name, part, env, says", [
    ("upstream_session.sh", "d", {}, "usage"),
    ("upstream_session.sh", "a", {"UPSTREAM": "pr999"}, "UPSTREAM must be pr344 or f411b3d"),
    ("upstream_session.sh", "b", {"BACKEND": "fa3"}, "BACKEND must be varlen, cudnn or fa4"),
    ("upstream_session.sh", "c", {"C_PRESETS": "candidate upstream"}, "C_PRESETS hold candidate and/or record"),
    ("upstream_session.sh", "b", {"B_PRESETS": "recrod"}, "not recrod"),
    ("upstream_session.sh", "a", {"A_WARM_PRESETS": "cand"}, "not cand"),
    ("fa4_session.sh", "5", {}, "usage"),
])
def test_session_script_refuses_unknown_parts(tmp_path, name, part, env, says):
    bash = shutil.which("bash") or pytest.skip("no bash")
    script = [s for s in SCRIPTS if s.name == name][0]
    out = subprocess.run([bash, str(script), part], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), **env}, cwd=tmp_path)
    assert out.returncode == 2 and says in out.stderr
    assert not (tmp_path / "out").exists()  # refused before it made or ran anything


def test_session_part_b_leaves_the_benches_to_another_call_when_too_little_time_is_left(tmp_path):
    """Part b benches in the call that saw upstream finish only if B_MIN_S of its budget is left:
    a bench cut by the call's limit brings back nothing worth having."""
    bash = shutil.which("bash") or pytest.skip("no bash")
    script = [s for s in SCRIPTS if s.name == "upstream_session.sh"][0]
    up = tmp_path / "up"
    up.mkdir()
    (up / "rc").write_text("0\n")  # upstream's run finished
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "UP_SESSION_UP_DIR": str(up),
           "BUDGET_S": "100", "B_MIN_S": "240"}
    out = subprocess.run([bash, str(script), "b"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 1 and "run part b again for the benches" in out.stderr, out.stderr
    assert not (tmp_path / "out" / "bench_step_stage0.json").exists()


def test_fa4_carry_refuses_what_it_cannot_do_and_checks_the_joined_parts(tmp_path):
    """Unknown commands, a stage without the prepared part, an install without the staged one,
    and parts of two different prepares (the checksum) each stop with a message before pip runs."""
    bash = shutil.which("bash") or pytest.skip("no bash")
    script = [s for s in SCRIPTS if s.name == "fa4_carry.sh"][0]
    env = {"PATH": "/usr/bin:/bin", "FA4_PARTS": str(tmp_path / "parts")}

    def run(what):
        return subprocess.run([bash, str(script), what], capture_output=True, text=True, env=env, cwd=tmp_path)

    out = run("nonsense")
    assert out.returncode == 2 and "usage" in out.stderr
    out = run("stage")
    assert out.returncode == 2 and "run prepare here and carry .fa4a" in out.stderr
    out = run("install")
    assert out.returncode == 2 and "run 'stage' with .fa4a carried" in out.stderr
    (tmp_path / ".fa4a").mkdir()
    (tmp_path / ".fa4b").mkdir()
    (tmp_path / ".fa4a" / "cu13.tar.xz.part00").write_bytes(b"first half")
    (tmp_path / ".fa4b" / "cu13.tar.xz.part01").write_bytes(b"second half")
    digest = subprocess.run(["sha256sum"], input=b"first halfsecond half", capture_output=True).stdout.split()[0]
    (tmp_path / ".fa4b" / "cu13.tar.xz.sha256").write_text(f"{digest.decode()[::-1]}  cu13.tar.xz\n")  # not it
    assert run("stage").returncode == 0 and (tmp_path / "parts" / "cu13.tar.xz.part00").is_file()
    out = run("install")
    assert out.returncode == 3 and "differ from what prepare split" in out.stderr
    assert (tmp_path / "parts" / "cu13.tar.xz").read_bytes() == b"first halfsecond half"


PY_BENCHES = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("bench_*.py"))


@pytest.mark.parametrize("script", PY_BENCHES, ids=[s.name for s in PY_BENCHES])
def test_python_benchmark_compiles(script):
    compile(script.read_text(), str(script), "exec")


def test_host_bench_without_a_gpu_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    mod = _load_bench("bench_host")
    assert mod.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_graph_launch_bench_checks_its_arguments_and_fits_a_line(capsys, monkeypatch):
    """bench_graph_launch refuses bad arguments and a machine without a GPU with a message, and
    its fit recovers a known line (fixed cost + cost per node) and refuses a single node count."""
    import torch

    mod = _load_bench("bench_graph_launch")
    assert mod.main(["--nodes", "0", "10"]) == 2
    assert mod.main(["--nodes", "10", "10"]) == 2
    assert mod.main(["--reps", "3"]) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    fixed, slope = mod.fit_line([1, 10, 100, 1000], [3.0 + 0.25 * n for n in (1, 10, 100, 1000)])
    assert fixed == pytest.approx(3.0) and slope == pytest.approx(0.25)
    with pytest.raises(ValueError):
        mod.fit_line([5, 5], [1.0, 2.0])


def test_replay_host_bench_traces_replayed_steps_without_a_walk(capsys, use_builtin_cache, kernels_use_references):
    """bench_replay_host runs a preset's steps through StepGraphs with a replay that launches
    nothing, and reports per-micro-batch host time from replayed steps only (it refuses to report
    otherwise), with the key's watch settled: no walk over the traced steps."""
    mod = _load_bench("bench_replay_host")
    assert mod.main(["--arms", "record", "--world", "8", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "us per micro-batch (1 per step)" in out and "graph_key" in out and "key walks while traced 0" in out
    assert mod.main(["--steps", "2"]) == 2


@pytest.mark.parametrize("kind", ["plain", "paired", "long_key_offset", "value_residual"])
def test_rotary_bench_arms_compute_the_same(kind):
    """bench_rotary's arms (the record's old sliced RoPE path, the elementwise one on sliced and on
    split q/k/v, and upstream's chunked formulation with fp32 tables here) give the same q, k, v and
    gradients on every layer kind it times (the first three bit for bit)."""
    import functools

    import torch

    from speedrun.model.yarn import Yarn

    mod = _load_bench("bench_rotary")
    T, H, D = 24, 4, 16
    y = Yarn(D, 0.5, 1024.0)
    cos, sin = y.tables(2 * T, "cpu")
    g = torch.Generator().manual_seed(1)
    qkv0, aux0 = torch.randn(T, 3 * H * D, generator=g), torch.randn(T, H * D, generator=g)
    grads = [torch.randn(T, H, D, generator=g) for _ in range(3)]
    res = []
    f_cos, f_sin = y.factors(2 * T, "cpu")
    arms = ((mod.sliced_prep, (cos, sin)), (mod.elementwise_prep, (y,)),
            (functools.partial(mod.elementwise_prep, split=True), (y,)), (mod.chunked_prep, (f_cos, f_sin)))
    for fn, tables in arms:
        qkv, aux = qkv0.clone().requires_grad_(), aux0.clone().requires_grad_()
        outs = fn(qkv, aux, *tables, kind=kind, H=H, D=D, rope_dims=y.rope_dims)
        torch.autograd.backward(outs, grads)
        res.append((*outs, qkv.grad, aux.grad))
    for other in res[1:]:
        for a, b in zip(res[0], other):
            if a is None:
                assert b is None
                continue
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    for other in res[1:3]:  # the sliced and both elementwise arms: bit for bit
        assert all(torch.equal(a, b) for a, b in zip(res[0], other) if a is not None)


def test_inductor_sources_extracts_the_slowest_kernels(tmp_path):
    """inductor_sources.py finds a profiled kernel's Triton source in a generated wrapper module (a
    kernel inside ``async_compile.triton('''...''')``) and in a standalone kernel file, writes the
    slowest first, and reports a kernel it cannot find."""
    mod = _load_script(SCRIPTS[0].parent / "inductor_sources.py")
    cache = tmp_path / "cache" / "ab"
    cache.mkdir(parents=True)
    (cache / "wrapper.py").write_text(
        "from torch._inductor.async_compile import AsyncCompile\n"
        "triton_poi_fused_add_7 = async_compile.triton('triton_poi_fused_add_7', '''\n"
        "import triton\n@triton.jit\ndef triton_poi_fused_add_7(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):\n"
        "    x0 = tl.load(in_ptr0)\n    tl.store(out_ptr0, x0 + 1)\n''', device_str='cuda')\n"
        "def call(args):\n    triton_poi_fused_add_7.run()\n")
    (cache / "kernel.py").write_text(
        "import triton\n\n@triton_heuristics.reduction(\n    size_hints={'x': 64},\n)\n@triton.jit\ndef triton_red_fused_sum_3(in_ptr0, out_ptr0):\n"
        "    pass\n\n@triton.jit\ndef other_kernel():\n    pass\n")
    profile = {"steps": 2, "kernels": [
        {"kernel": "triton_red_fused_sum_3", "calls": 4, "time_us": 3000.0},
        {"kernel": "triton_poi_fused_add_7", "calls": 8, "time_us": 9000.0},
        {"kernel": "_relu2_gemm_tma_kernel", "calls": 8, "time_us": 90000.0},  # ours, not Inductor's
        {"kernel": "triton_poi_fused_missing_9", "calls": 2, "time_us": 1000.0}]}
    (tmp_path / "profile.json").write_text(json.dumps(profile))
    assert [k["kernel"] for k in mod.slowest_inductor_kernels(profile, 2)] == [
        "triton_poi_fused_add_7", "triton_red_fused_sum_3"]
    out = tmp_path / "out"
    assert mod.main([str(tmp_path / "profile.json"), "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]) == 0
    poi = (out / "triton_poi_fused_add_7.py").read_text()
    assert poi.startswith("# triton_poi_fused_add_7\n# 4 launches, 4.500 ms per step")
    assert "@triton.jit\ndef triton_poi_fused_add_7(" in poi and "x0 + 1" in poi
    assert "device_str" not in poi and "def call" not in poi
    red = (out / "triton_red_fused_sum_3.py").read_text()
    assert "\n@triton_heuristics.reduction(\n    size_hints={'x': 64},\n)\n@triton.jit\ndef triton_red_fused_sum_3(" in red and "other_kernel" not in red
    assert not (out / "triton_poi_fused_missing_9.py").exists()


def test_opaque_host_bench_runs_on_the_cpu(capsys):
    """bench_opaque.py compiles both chains and reports per-op host time and the opaque overhead."""
    mod = _load_bench("bench_opaque")
    assert mod.main(["--ops", "2", "--reps", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "opaque  forward" in out and "plain   forward" in out and "opaque over plain" in out


@pytest.mark.usefixtures("use_builtin_cache", "one_thread")
def test_host_profile_script_profiles_a_tiny_arm(tmp_path, capsys):
    """host_profile.py builds the arm, warms it up and writes cProfile tables naming run_step."""
    mod = _load_script(SCRIPTS[0].parent / "host_profile.py")
    small = ["model.num_layers=1", "model.model_dim=64", "model.num_heads=2", "model.qk_head_dim=16",
             "model.v_head_dim=32", "train.batch_tokens=1024", "train.max_seq_len=128"]
    args = ["--arm", "t=tiny", "--warmup", "1", "--steps", "1", "--top", "10", "--out", str(tmp_path)]
    for s in small:
        args += ["--set", s]
    assert mod.main(args) == 0
    text = (tmp_path / "host_profile_t.txt").read_text()
    assert "by own time" in text and "by cumulative time" in text and "run_step" in text
    assert "written:" in capsys.readouterr().out


@pytest.mark.usefixtures("use_builtin_cache", "one_thread")
def test_host_profile_script_profiles_a_simulated_rank(tmp_path, capsys):
    """--as-rank-of N profiles rank 0's share of an N-rank step (the record recipe's optimizer
    sharded over N, collectives as no-ops) and says so in its header."""
    mod = _load_script(SCRIPTS[0].parent / "host_profile.py")
    small = ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12",
             "train.batch_divisor=1024", "train.steps=24", "train.num_extension=3"]
    args = ["--arm", "r=tiny-record", "--warmup", "1", "--steps", "1", "--top", "400", "--out", str(tmp_path),
            "--as-rank-of", "2"]
    for s in small:
        args += ["--set", s]
    assert mod.main(args) == 0
    text = (tmp_path / "host_profile_r.txt").read_text()
    assert "rank 0 of 2 simulated" in text and "run_step" in text and "simcomms.py" in text  # its no-op collectives ran
    capsys.readouterr()
    assert mod.main(args[:-len(small) * 2 - 2] + ["--as-rank-of", "3"] + args[-len(small) * 2:]) == 2
    assert "host_profile: " in capsys.readouterr().err  # a world the record's split cannot use


def test_device_run_packs_more_than_eight_outputs(tmp_path):
    """The device tool brings back at most 8 files: device_run.sh archives the outputs beyond that."""
    import tarfile

    bash = shutil.which("bash") or pytest.skip("no bash")
    script = [s for s in SCRIPTS if s.name == "device_run.sh"][0]
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    for i in range(9):
        (out / ("sub" if i == 8 else ".") / f"f{i}.txt").write_text(str(i))
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "BUDGET_S": "30"}
    res = subprocess.run([bash, str(script), "no_such_part"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "outputs packed into all_outputs.tgz" in res.stdout, res.stdout + res.stderr
    assert sorted(p.name for p in out.iterdir()) == ["all_outputs.tgz"]
    with tarfile.open(out / "all_outputs.tgz") as tar:
        names = {n.lstrip("./") for n in tar.getnames()}
    assert {"gpu.txt", "sub/f8.txt"} | {f"f{i}.txt" for i in range(8)} <= names
    few = tmp_path / "few"
    few.mkdir()
    res = subprocess.run([bash, str(script), "no_such_part"], capture_output=True, text=True,
                         env={**env, "OUT": str(few)}, cwd=tmp_path)
    assert "packed" not in res.stdout and (few / "gpu.txt").exists()


def _device_run_with_recording_python(tmp_path):
    """(bash, device_run.sh, a bin folder whose python3 records its arguments in calls.txt instead
    of running, calls.txt): put the folder first on PATH."""
    bash = shutil.which("bash") or pytest.skip("no bash")
    script = [s for s in SCRIPTS if s.name == "device_run.sh"][0]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    stub = bin_dir / "python3"
    stub.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    stub.chmod(0o755)
    return bash, script, bin_dir, calls


def test_device_run_short_run_passes_short_set_overrides(tmp_path):
    """recordrun's training gets the shortened schedule and every SHORT_SET override as --set."""
    bash, script, bin_dir, calls = _device_run_with_recording_python(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "BUDGET_S": "30",
           "SPEEDRUN_TEST_DATA": str(tmp_path), "SHORT_STEPS": "47", "SHORT_EXT": "2",
           "SHORT_SET": "model.mlp_input_quant=graph  model.embedding_grad=atomic_graph data.val_files=*.bin"}
    (tmp_path / "data.val_files=a.bin").touch()  # an unquoted override would expand to this name
    res = subprocess.run([bash, str(script), "recordrun"], capture_output=True, text=True, env=env, cwd=tmp_path)
    train = [line for line in calls.read_text().splitlines() if "speedrun train" in line]
    assert len(train) == 1, res.stdout + res.stderr
    args = train[0].split()
    assert args[args.index("--steps") + 1] == "47" and "train.num_extension=2" in args
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert sets[-3:] == ["model.mlp_input_quant=graph", "model.embedding_grad=atomic_graph", "data.val_files=*.bin"], sets


def test_device_run_projects_with_upstream_as_the_baseline(tmp_path):
    """The record part's projection takes upstream's run of this machine (UP_DIR) as its first arm,
    on UP_PRESET's schedule, and leaves it out for a simulated rank."""
    bash, script, bin_dir, calls = _device_run_with_recording_python(tmp_path)
    up = tmp_path / "up"
    (up / "logs").mkdir(parents=True)
    (up / "logs" / "run.txt").write_text("step:1/2 train_time:1ms\n")
    for name, rank in (("out", ""), ("out8", "_rank8")):
        out = tmp_path / name
        out.mkdir()
        for s in range(3):
            (out / f"bench_step{rank}_stage{s}.json").write_text("{}")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "BUDGET_S": "30",
           "SPEEDRUN_TEST_DATA": str(tmp_path), "UP_DIR": str(up), "UP_NAME": "pr344", "UP_PRESET": "candidate"}
    res = subprocess.run([bash, str(script), "record"], capture_output=True, text=True, env=env, cwd=tmp_path)
    project = [line for line in calls.read_text().splitlines() if "bench project" in line]
    assert len(project) == 1, res.stdout + res.stderr
    assert f"--upstream pr344={tmp_path / 'out'}/upstream_steps.json:candidate" in project[0]
    calls.unlink()
    res = subprocess.run([bash, str(script), "record"], capture_output=True, text=True, cwd=tmp_path,
                         env={**env, "OUT": str(tmp_path / "out8"), "AS_RANK_OF": "8", "LINK_GBPS": "450"})
    project = [line for line in calls.read_text().splitlines() if "bench project" in line]
    assert len(project) == 1 and "--upstream" not in project[0], res.stdout + res.stderr
    assert "--link-gbps 450" in project[0]  # the simulated rank's collectives at the given bus bandwidth


def test_gpu_clocks_summarizes_each_phase_from_busy_samples(tmp_path, capsys, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_clocks", Path(__file__).resolve().parents[1] / "tools" / "gpu_clocks.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_clocks", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    # 2026/12/04 21:00:00 UTC = 1796418000
    rows = ["2026/12/04 21:00:00.000, 1980 MHz, 650.00 W, 50",
            "2026/12/04 21:00:00.250, 1755 MHz, 120.00 W, 51",   # idle: counted, not in the medians
            "2026/12/04 21:00:01.000, 1900 MHz, 600.00 W, 55",
            "garbage, [N/A], [N/A], [N/A]",
            "2026/12/04 21:00:02.000, 1500 MHz, 700.00 W, 70",
            "2026/12/04 21:00:02.500, 1600 MHz, 690.00 W, 71",
            "2026/12/04 21:00:03.0"]                             # cut off by the kill
    (tmp_path / "c.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "p.txt").write_text("ours 1796418002\nupstream 1796418000\n")
    out = mod.summarize(mod.parse_log((tmp_path / "c.csv").read_text()),
                        mod.parse_phases((tmp_path / "p.txt").read_text()), busy_w=300)
    assert [r.phase for r in out] == ["upstream", "ours"]
    assert (out[0].samples, out[0].busy, out[0].sm_mhz_median, out[0].temp_c_max) == (3, 2, 1940, 55)
    assert (out[1].samples, out[1].busy, out[1].sm_mhz_median, out[1].power_w_median) == (2, 2, 1550, 695)
    assert mod.main([str(tmp_path / "c.csv"), "--phases", str(tmp_path / "p.txt")]) == 0
    assert "upstream" in capsys.readouterr().out
    (tmp_path / "empty.csv").write_text("timestamp, clocks.sm\n")
    assert mod.main([str(tmp_path / "empty.csv")]) == 2
    assert "no nvidia-smi rows" in capsys.readouterr().err


def test_device_run_profiles_each_arm_under_its_name_and_diffs_the_later_ones(tmp_path):
    """The profile part names each arm's files by the arm's name (an arm spec holds '=' and ':'),
    and diffs every later arm against the first."""
    bash, script, bin_dir, calls = _device_run_with_recording_python(tmp_path)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "BUDGET_S": "30",
           "SPEEDRUN_TEST_DATA": str(tmp_path), "PROFILE_DEVICE_ONLY": "1",
           "PROFILE_ARMS": "e=record:train.cuda_graphs=off g=record"}
    res = subprocess.run([bash, str(script), "profile"], capture_output=True, text=True, env=env, cwd=tmp_path)
    lines = calls.read_text().splitlines()
    runs = [line for line in lines if line.startswith("-m speedrun profile --arm")]
    assert len(runs) == 2, res.stdout + res.stderr
    assert "--out /tmp/prof_e " in runs[0] and "--arm e=record:train.cuda_graphs=off" in runs[0]
    assert "--device-only" in runs[0] and "--out /tmp/prof_g " in runs[1]
    diffs = [line for line in lines if "profile --diff" in line]
    assert diffs == [f"-m speedrun profile --diff /tmp/prof_e /tmp/prof_g --top 40 --json {tmp_path}/out/profile_diff_g_vs_e.json"]


def test_comm_traffic_counts_what_the_collectives_move(tmp_path, capsys):
    """comm_traffic.py at toy size: the even step moves only the NorMuon banks (reduce-scattered
    and gathered whole), the odd step the Adam tables too; the mean's time follows comm_ms."""
    from speedrun.evidence.projection import comm_ms

    mod = _load_script(SCRIPTS[0].parent / "comm_traffic.py")
    small = ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12"]
    out = tmp_path / "t.json"
    args = ["--preset", "tiny-record", "--world", "4", "--gbps", "100", "--json", str(out)]
    for s in small:
        args += ["--set", s]
    assert mod.main(args) == 0
    res = json.loads(out.read_text())
    even, odd = res["steps"]["100"], res["steps"]["101"]
    assert even["reduce_scatter"] == even["all_gather"] > 0 and odd["reduce_scatter"] > even["reduce_scatter"]
    assert res["ms_per_step"]["100.0"] == pytest.approx(comm_ms(res["mean"], 4, 100.0))
    assert "at 100 GB/s bus bandwidth, none overlapped" in capsys.readouterr().out
    assert mod.main(["--preset", "no-such-preset"]) == 2
    assert capsys.readouterr().err.startswith("comm_traffic: ")
    assert mod.main(["--preset", "tiny-record", "--world", "0"]) == 2
    assert "ranks >= 1" in capsys.readouterr().err


def test_compile_cache_round_trip_and_refusals(tmp_path, capsys):
    """save packs a cache folder when it fits the size limit (else says so and writes nothing);
    restore unpacks it byte for byte, says so when there is none, and refuses a broken archive."""
    cc = _load_script(Path(__file__).resolve().parents[1] / "tools" / "compile_cache.py")
    cache = tmp_path / "inductor"
    (cache / "triton" / "0").mkdir(parents=True)
    (cache / "fxgraph.txt").write_text("graph\n" * 1000)
    kernel = os.urandom(3 * 2**20)  # incompressible: 3 MiB packed
    (cache / "triton" / "0" / "k.cubin").write_bytes(kernel)
    archive = tmp_path / "carry" / "up.compile_cache.tar.gz"
    assert cc.main(["save", str(cache), str(archive), "--max-mib", "2"]) == 0
    assert "over 2 MiB, not saved" in capsys.readouterr().out and not archive.exists()
    assert cc.main(["save", str(cache), str(archive)]) == 0
    assert "saved as" in capsys.readouterr().out and archive.is_file()
    restored = tmp_path / "restored"
    assert cc.main(["restore", str(archive), str(restored)]) == 0
    assert "2 files" in capsys.readouterr().out
    assert (restored / "triton" / "0" / "k.cubin").read_bytes() == kernel
    assert (restored / "fxgraph.txt").read_text() == "graph\n" * 1000
    assert cc.main(["restore", str(tmp_path / "absent.tar.gz"), str(tmp_path / "cold")]) == 0
    assert "none at" in capsys.readouterr().out and not (tmp_path / "cold").exists()
    (tmp_path / "broken.tar.gz").write_bytes(b"not an archive")
    with pytest.raises(SystemExit, match="does not unpack"):
        cc.main(["restore", str(tmp_path / "broken.tar.gz"), str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="no folder"):
        cc.main(["save", str(tmp_path / "nowhere"), str(archive)])
    with pytest.raises(SystemExit):
        cc.main(["save", str(cache), str(archive), "--max-mib", "0"])


def test_upstream_script_returns_while_its_run_goes_on(tmp_path):
    """upstream_f411b3d.sh starts upstream's training in a session of its own and returns after
    WAIT_S, also when its output is read through a pipe (upstream_session.sh's `| tail`): nothing
    left running may hold that pipe.  Upstream's patcher and torchrun are stood in for by stubs
    (the stub training sleeps 30 s); the script must be back in well under that."""
    bash = shutil.which("bash") or pytest.skip("no bash")
    import lzma

    root = Path(__file__).resolve().parents[1]
    repo = tmp_path / "repo"
    (repo / ".carry").mkdir(parents=True)
    (repo / "tools").symlink_to(root / "tools")
    (repo / ".carry" / "webmix_train_000000.bin.xz").write_bytes(lzma.compress(b"\0" * 1024))
    (tmp_path / "tiktoken").mkdir()
    (tmp_path / "tiktoken" / "gpt2").write_text("stand-in")
    patcher = tmp_path / "patcher.py"
    patcher.write_text("import sys, pathlib\nout = pathlib.Path(sys.argv[sys.argv.index('--out') + 1])\n"
                       "out.mkdir(parents=True)\n(out / 'train_gpt.py').write_text('')\nprint('patched (stub)')\n")
    stubs = tmp_path / "bin"
    stubs.mkdir()
    marker = f"stub-training-{os.getpid()}"
    (stubs / "python3").write_text(  # the marker names the stub training's process, to end it below
        f'#!/bin/sh\nif [ "$1 $2" = "-m torch.distributed.run" ]; then\n'
        f'  exec {sys.executable} -c "import time; time.sleep(30)" {marker}\nfi\nexec {sys.executable} "$@"\n')
    (stubs / "python3").chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), "UP_DIR": str(tmp_path / "up"),
           "DATA_DIR": str(tmp_path / "data"), "WAIT_S": "1", "PATCHER": str(patcher),
           "UP_SRC": str(tmp_path), "TIKTOKEN_DIR": str(tmp_path / "tiktoken"), "PYTHONPATH": str(root)}
    try:
        out = subprocess.run([bash, "-c", f"bash {root}/tools/upstream_f411b3d.sh | tail -3"], cwd=repo, env=env,
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        assert "upstream still running after 1s" in out.stdout, out.stdout
        assert (tmp_path / "up" / "started").exists() and not (tmp_path / "up" / "rc").exists()
    finally:
        if shutil.which("pkill"):
            subprocess.run(["pkill", "-f", marker], capture_output=True)


def test_carry_prepare_fills_the_carried_folders_from_shared_and_upstream_commits(tmp_path):
    """tools/carry_prepare.sh: the shards, tokenizer files and the two upstream commits' three files
    land where the device scripts read them; a missing commit or shared folder stops it with a
    message before it writes anything."""
    bash = shutil.which("bash") or pytest.skip("no bash")
    git = shutil.which("git") or pytest.skip("no git")
    script = [s for s in SCRIPTS if s.name == "carry_prepare.sh"][0]
    up = tmp_path / "modded-nanogpt"
    up.mkdir()
    genv = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
            "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}

    def commit(tag):
        for f in ("train_gpt.py", "triton_kernels.py", "dc_triton_kernels.py"):
            (up / f).write_text(f"# {f} at {tag}\n")
        subprocess.run([git, "add", "."], cwd=up, check=True, env=genv)
        subprocess.run([git, "commit", "-qm", tag], cwd=up, check=True, env=genv)
        return subprocess.run([git, "rev-parse", "HEAD"], cwd=up, check=True, env=genv, capture_output=True,
                              text=True).stdout.strip()

    subprocess.run([git, "init", "-q"], cwd=up, check=True, env=genv)
    first, second = commit("record"), commit("pr")
    shared = tmp_path / "shared"
    (shared / "data").mkdir(parents=True)
    for name in ("webmix_train_000000.bin.xz", "webmix_val_000000.bin.xz"):
        (shared / "data" / name).write_bytes(b"xz stand-in")
    for sub, name in (("gpt2", "vocab.bpe"), ("tiktoken_cache", "0ea1e9")):
        (shared / "tokenizer" / sub).mkdir(parents=True)
        (shared / "tokenizer" / sub / name).write_text("stand-in")
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**genv, "SHARED": str(shared), "WHEELS": "0", "UPSTREAM_COMMIT": first, "PR344_COMMIT": second}

    out = subprocess.run([bash, str(script), str(up)], capture_output=True, text=True, env=env, cwd=repo)
    assert out.returncode == 0, out.stderr
    carry = repo / ".carry"
    assert (carry / "upstream" / "train_gpt.py").read_text() == "# train_gpt.py at record\n"
    assert (carry / "pr344" / "dc_triton_kernels.py").read_text() == "# dc_triton_kernels.py at pr\n"
    assert (carry / "webmix_val_000000.bin.xz").read_bytes() == b"xz stand-in"
    assert (carry / "gpt2" / "vocab.bpe").exists() and (carry / "upstream" / "tiktoken_cache" / "0ea1e9").exists()
    assert not (repo / ".whl").exists()

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    out = subprocess.run([bash, str(script), str(up)], capture_output=True, text=True,
                         env={**env, "PR344_COMMIT": "0" * 40}, cwd=fresh)
    assert out.returncode == 2 and "has no commit" in out.stderr
    out = subprocess.run([bash, str(script), str(up)], capture_output=True, text=True,
                         env={**env, "SHARED": str(tmp_path / "nowhere")}, cwd=fresh)
    assert out.returncode == 2 and "webmix" in out.stderr
    assert not (fresh / ".carry").exists()
