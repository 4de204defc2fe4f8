"""CPU tests of the upstream-benchmark tooling in tools/: patcher, FA3 shim, step-time parser.

The real upstream files are never stored here; set SPEEDRUN_UPSTREAM_SRC to a folder holding
modded-nanogpt's train_gpt.py, triton_kernels.py and dc_triton_kernels.py at f411b3d (or their
``upstream_*`` copies) to also patch those.
"""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


up = _load("upstream_f411b3d")
shim = _load("fa3_shim")
steps = _load("upstream_step_times")


# ---- patcher -------------------------------------------------------------------------------

def _anchor_text(opts) -> str:
    """A stand-in file holding each anchor once (not runnable; apply_patches only needs the text)."""
    return "\n".join(p.anchor.rstrip("\n") for p in up.train_patches(opts)) + "\n"


def test_missing_anchor_names_it():
    opts = up.BenchOptions()
    text = _anchor_text(opts).replace("TRAIN_MAX_NUM_DOCS = {16384: 64", "TRAIN_MAX_NUM_DOCS = {16384: 65")
    with pytest.raises(up.PatchError, match=r"differs from f411b3d at train_gpt.py \[max-docs\]: anchor not found"):
        up.apply_patches(text, up.train_patches(opts), "train_gpt.py")


def test_duplicated_anchor_is_refused():
    opts = up.BenchOptions()
    text = _anchor_text(opts) + "val_loss_every: int = 250\n"
    with pytest.raises(up.PatchError, match=r"\[val-every\]: anchor found 2 times"):
        up.apply_patches(text, up.train_patches(opts), "train_gpt.py")


def test_patches_apply_to_their_anchors():
    opts = up.BenchOptions(scheduled=60, extension=10, train_files="/d/webmix_train_*.bin")
    out = up.apply_patches(_anchor_text(opts), up.train_patches(opts), "train_gpt.py")
    assert "num_scheduled_iterations: int = 60" in out and "num_extension_iterations: int = 10" in out
    assert "train_files: str = '/d/webmix_train_*.bin'" in out
    assert "TRAIN_MAX_NUM_DOCS = {16384: 256, 32768: 256, 49152: 256}" in out
    assert "itertools.cycle(files)" in out and "get_kernel" not in out


def test_kernel_patch_copies_the_down_projection_scales():
    text = "x3 = torch._scaled_mm(\n    post_f8,\n" + "".join(p.anchor for p in up.kernel_patches()) + ")\n"
    out, patches = up.patch_kernels(text)
    assert f"scale_a={up.aligned_copy('activation_scale')}," in out
    assert f"scale_b={up.aligned_copy('W2_scale')}," in out
    assert [p.name for p in patches] == ["aligned-act-scale", "aligned-w2-scale"]
    with pytest.raises(up.PatchError, match=r"triton_kernels.py \[aligned-act-scale\]: anchor not found"):
        up.patch_kernels(text.replace("scale_a=activation_scale", "scale_a=s"))


def _scale_args_of_compiled_scaled_mm(copy_expr: str) -> str:
    """The ``_scaled_mm`` call Inductor generates when both scales are offset views into one
    buffer (upstream's ``scales[i:i+1]``), each passed through ``copy_expr`` (source with ``s``)."""
    from torch._inductor.utils import run_and_get_code

    copy = eval(f"lambda s: {copy_expr}", {"torch": torch})

    def down_proj(a, b, scales):
        return torch._scaled_mm(a, b, scale_a=copy(scales[3:4]), scale_b=copy(scales[5:6]),
                                out_dtype=torch.bfloat16)

    a = torch.randn(32, 64).to(torch.float8_e4m3fn)
    b = torch.randn(32, 64).to(torch.float8_e4m3fn).t()
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(down_proj, backend="inductor"), a, b, torch.ones(11))
    calls = [ln.strip() for ln in code[0].splitlines() if "extern_kernels._scaled_mm(" in ln]
    assert len(calls) == 1, code[0]
    return calls[0]


def test_aligned_copy_survives_inductor():
    """The scale copy must reach cuBLAS as its own buffer: Inductor turns ``.clone()`` back into
    the unaligned view (what failed on the H200), while :func:`aligned_copy` keeps offset 0."""
    assert ", 3)" in _scale_args_of_compiled_scaled_mm("s.clone()")  # the failure mode, reproduced
    call = _scale_args_of_compiled_scaled_mm(up.aligned_copy("s"))
    assert ", 3)" not in call and ", 5)" not in call, call


@pytest.mark.parametrize("device_only", [False, True])
def test_profile_patch_writes_a_kernel_table(tmp_path, monkeypatch, device_only):
    """--profile START:COUNT wraps exactly those steps in torch.profiler and rank 0 writes the
    kernel table (run here on a stand-in loop with both anchors; no CUDA, so no kernels);
    --profile-device-only records CUDA activity alone and adds the timeline."""
    from types import SimpleNamespace

    opts = up.BenchOptions(profile_start=2, profile_steps=2, profile_device_only=device_only)
    patches = [p for p in up.train_patches(opts) if p.name.startswith("profile-")]
    assert [p.name for p in patches] == ["profile-start", "profile-stop"]
    loop = ("for step in range(6):\n"
            "    # --------------- TRAINING SECTION -----------------\n"
            "    ran.append((step, torch.profiler.profile is not None))\n"
            "    model.quantize_mlp_fp8(bootstrap_down=(step < 16))\n")
    code = up.apply_patches(loop, patches, "train_gpt.py")
    fake_torch = SimpleNamespace(cuda=SimpleNamespace(synchronize=lambda: None), profiler=torch.profiler,
                                 autograd=torch.autograd)
    entered = []
    real_profile = torch.profiler.profile

    def spy_profile(**kw):
        entered.append(kw)
        return real_profile(activities=[torch.profiler.ProfilerActivity.CPU])

    monkeypatch.setattr(torch.profiler, "profile", spy_profile)
    monkeypatch.chdir(tmp_path)
    ns = {"torch": fake_torch, "ran": [], "master_process": True,
          "model": SimpleNamespace(quantize_mlp_fp8=lambda bootstrap_down: None)}
    exec(compile(code, "train_gpt.py", "exec"), ns)
    assert len(entered) == 1 and len(ns["ran"]) == 6
    cuda = torch.profiler.ProfilerActivity.CUDA
    assert entered[0]["activities"] == ([cuda] if device_only else [torch.profiler.ProfilerActivity.CPU, cuda])
    got = json.loads((tmp_path / up.PROFILE_FILE).read_text())
    assert got["steps"] == 2 and got["first_step"] == 2 and got["kernels"] == []
    assert got["device_only"] is device_only and ("timeline" in got) is device_only
    with pytest.raises(up.PatchError, match="--profile"):
        up.validate(up.BenchOptions(profile_start=134, profile_steps=2))
    assert up.parse_profile("130:2") == (130, 2)
    with pytest.raises(up.PatchError, match="needs --profile"):
        up.validate(up.BenchOptions(profile_device_only=True))


def test_bad_options_fail_before_any_gpu_time():
    for bad in (dict(val_tokens=1_000_000), dict(extension=1), dict(scheduled=6), dict(max_docs={16384: 256})):
        with pytest.raises(up.PatchError):
            up.validate(up.BenchOptions(**bad))
    assert up.parse_max_docs("192") == {16384: 192, 32768: 192, 49152: 192}
    assert up.parse_max_docs("16384:128,32768:192,49152:256")[32768] == 192


def test_unshimmed_fa3_function_is_refused():
    with pytest.raises(up.PatchError, match="flash_attn_func"):
        up.check_attention_uses("y = flash_attn_interface.flash_attn_func(q, k, v)\n")


def test_cli_reports_missing_files(tmp_path, capsys):
    assert up.main(["--src", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no train_gpt.py" in capsys.readouterr().err


@pytest.fixture
def upstream_src() -> Path:
    d = os.environ.get("SPEEDRUN_UPSTREAM_SRC")
    if not d or not Path(d).is_dir():
        pytest.skip("SPEEDRUN_UPSTREAM_SRC not set to a folder with upstream's three files")
    return Path(d)


def test_real_upstream_patches_cleanly(upstream_src, tmp_path):
    out = tmp_path / "up"
    rc = up.main(["--src", str(upstream_src), "--out", str(out), "--train-files", "/x/webmix_train_*.bin",
                  "--val-files", "/x/webmix_val_*.bin", "--profile", "130:2", "--profile-device-only"])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([*up.UPSTREAM_FILES, "fa3_shim.py", "bench_config.json"])
    py_compile.compile(str(out / "train_gpt.py"), doraise=True)
    text = (out / "train_gpt.py").read_text()
    assert "import fa3_shim" in text and "flash_attn_interface = fa3_shim" in text
    assert "if step == 130:" in text and "if step == 131:" in text and up.PROFILE_FILE in text
    assert "activities=[torch.profiler.ProfilerActivity.CUDA])" in text and "gpu_timeline(" in text
    assert json.loads((out / "bench_config.json").read_text())["profile_device_only"] is True
    assert f"scale_a={up.aligned_copy('activation_scale')}" in (out / "triton_kernels.py").read_text()


# ---- FA3 shim ------------------------------------------------------------------------------

class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kw):
        self.calls.append((args, kw))
        return args[0]


@pytest.fixture
def recorded(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(shim, "_VARLEN", rec)
    monkeypatch.setattr(shim, "_require_cuda", lambda q: None)
    return rec


def _qkv(t=32, h=2, d=16):
    q = torch.randn(t, h, d)
    return q, q.clone(), q.clone(), torch.tensor([0, 20, t, t], dtype=torch.int64)


def test_shim_maps_fa3_arguments(recorded, monkeypatch):
    monkeypatch.setattr(shim, "_PARAMS", frozenset({"scale", "window_size"}))
    q, k, v, cu = _qkv()
    shim.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=896, max_seqlen_k=896,
                                causal=True, softmax_scale=0.12, window_size=(384, 0))
    (args, kw), = recorded.calls
    assert args[3].dtype == torch.int32 and args[3].tolist() == [0, 20, 32, 32]
    assert args[5:] == (896, 896) and kw == {"scale": 0.12, "window_size": (384, 0)}
    shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64)  # FA defaults: causal, no window
    assert recorded.calls[-1][1] == {"window_size": (-1, 0)}


def test_shim_on_a_torch_without_window_size(recorded, monkeypatch):
    monkeypatch.setattr(shim, "_PARAMS", frozenset({"is_causal"}))
    q, k, v, cu = _qkv()
    shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64)
    assert recorded.calls[-1][1] == {"is_causal": True}
    with pytest.raises(NotImplementedError, match="no window_size"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, window_size=(128, 0))


def test_shim_refuses_what_it_cannot_do(recorded):
    q, k, v, cu = _qkv()
    with pytest.raises(NotImplementedError, match="causal"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, causal=False)
    with pytest.raises(NotImplementedError, match="softcap"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, softcap=30.0)
    with pytest.raises(TypeError, match="unsupported FA3 argument"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, bogus=1)
    shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, seqused_k=None, num_splits=1)  # neutral: accepted


@pytest.mark.parametrize("backend", ["cudnn", "fa4"])
def test_shim_routes_to_a_speedrun_backend_when_asked(monkeypatch, backend):
    """SPEEDRUN_SHIM_BACKEND=cudnn or fa4: FA3's arguments become that speedrun backend's (the left
    window in tokens as its window, -1 as none; the softmax scale), one cu_seqlens for both."""
    fn, problem = shim._load_fused(backend)  # the real import path (speedrun is importable here)
    assert problem is None and fn.__name__ == f"{backend}_varlen_attention"
    calls = []

    def fake_cudnn(q, k, v, cu, max_seqlen, *, window=None, scale=None):
        calls.append((cu, max_seqlen, window, scale))
        return v

    monkeypatch.setattr(shim, "BACKEND", backend)
    monkeypatch.setattr(shim, "_FUSED_FN", fake_cudnn)
    monkeypatch.setattr(shim, "_FUSED_PROBLEM", None)
    monkeypatch.setattr(shim, "_VARLEN", None)  # never reached
    q, k, v, cu = _qkv()
    out = shim.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=896, max_seqlen_k=896,
                                      causal=True, softmax_scale=0.12, window_size=(384, 0))
    assert out is v and calls[-1] == (cu, 896, 384, 0.12)
    shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64)
    assert calls[-1] == (cu, 64, None, None)
    with pytest.raises(NotImplementedError, match="cu_seqlens_k must be cu_seqlens_q"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu.clone(), 64, 64)
    with pytest.raises(NotImplementedError, match="softcap"):  # the same refusals as on varlen
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64, softcap=30.0)
    monkeypatch.setattr(shim, "_FUSED_FN", None)
    monkeypatch.setattr(shim, "_FUSED_PROBLEM", f"SPEEDRUN_SHIM_BACKEND={backend} needs the speedrun package on PYTHONPATH")
    with pytest.raises(RuntimeError, match="PYTHONPATH"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64)
    monkeypatch.setattr(shim, "BACKEND", "fa5")
    assert "known backends are varlen, cudnn, fa4" in shim.varlen_problem()
    with pytest.raises(RuntimeError, match="known backends"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_shim_on_cpu_says_cuda_only():
    q, k, v, cu = _qkv()
    with pytest.raises(RuntimeError, match="CUDA only"):
        shim.flash_attn_varlen_func(q, k, v, cu, cu, 64, 64)
    assert "CUDA" in shim.varlen_problem()


# ---- step-time parser ----------------------------------------------------------------------

def _log(tmp_path, per_stage_ms=(100, 200, 300, 310), starts=(0, 4, 8, 12), total=16):
    lines = [f"Sampling steps {[0, 1] + [s + o for s in starts[1:] for o in (-2, -1, 0, 1)]} for warmup"]
    t = 0.0
    for step in range(total):
        stage = sum(step >= s for s in starts) - 1
        t += per_stage_ms[stage] + (500 if step == starts[stage] else 0)  # a slow first step per stage
        lines.append(f"step:{step + 1}/{total} train_time:{t:.0f}ms step_avg:{t / (step + 1):.2f}ms")
    lines.append(f"step:{total}/{total} val_loss:4.0000 train_time:{t:.0f}ms step_avg:{t / total:.2f}ms")
    p = tmp_path / "log.txt"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_step_times_per_stage(tmp_path):
    res = steps.summarize(_log(tmp_path), None, skip=2)
    assert res["stage_starts"] == [0, 4, 8, 12]
    assert [s["median_ms"] for s in res["stages"]] == [100, 200, 300, 310]
    assert [s["measured"] for s in res["stages"]] == [2, 2, 2, 2]
    assert res["final_train_time_ms"] == 4 * (100 + 200 + 300 + 310) + 4 * 500
    # the projection's own error on this run: it leaves out the four slow first steps (500 ms each)
    assert res["projected_ms"] == 4 * (100 + 200 + 300 + 310)
    assert res["projected_over_final"] == pytest.approx(3640 / 5640)
    # a stage without timed steps is projected at the stage before it (as bench project does)
    res = steps.summarize(_log(tmp_path, starts=(0, 4, 8, 14)), None, skip=2)
    assert res["stages"][3]["measured"] == 0 and res["projected_ms"] == 4 * 100 + 4 * 200 + 6 * 300 + 2 * 300


def test_projection_reproduces_real_full_runs(upstream_logs_dir):
    """The projection method (steps x median per stage) against 26 real full-length upstream runs
    (8xH100, two arms of 13): each within 1.5% of its logged training time (the logs' step times
    have 1 ms resolution, 1.7% of a 30 ms step), and the ratio of the arms' mean projected times
    within 0.002 of the ratio of their mean logged times
    (docs/results/2026-12-07-projection-vs-full-runs/)."""
    folder = upstream_logs_dir / "2026-07-17_FP8DownProjection"
    if not folder.is_dir():
        pytest.skip(f"{folder} absent")
    arms = {}
    for arm in ("baseline", "this_pr"):
        runs = [steps.summarize(p, None, skip=2) for p in sorted((folder / arm).glob("*.txt"))]
        assert len(runs) == 13 and all(r["final_train_time_ms"] for r in runs)
        ratios = [r["projected_over_final"] for r in runs]
        assert all(0.985 < x < 1.015 for x in ratios), (arm, ratios)
        arms[arm] = (sum(r["final_train_time_ms"] for r in runs), sum(r["projected_ms"] for r in runs))
    logged = arms["this_pr"][0] / arms["baseline"][0]
    projected = arms["this_pr"][1] / arms["baseline"][1]
    assert abs(projected - logged) < 0.002, (projected, logged)


def test_step_times_against_our_bench(tmp_path, capsys):
    """--ours: each arm of our bench JSON against upstream's stage of the same index, as the ratio of
    medians with an unpaired bootstrap interval; a stage the log does not have is a clear error."""
    log = _log(tmp_path, per_stage_ms=(100, 200, 300, 310), starts=(0, 6, 12, 18), total=20)
    bench = {"stage": 2, "arms": [{"name": "base", "median_ms": 303.0, "times_ms": [302.0, 303.0, 304.0, 303.0]},
                                  {"name": "base@3", "chain": 3, "median_ms": 297.0, "times_ms": [296.0, 297.0, 298.0]}]}
    ours = tmp_path / "bench.json"
    ours.write_text(json.dumps(bench))
    out = tmp_path / "steps.json"
    assert steps.main([str(log), "--ours", str(ours), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["against_ours"]
    assert [r["arm"] for r in rows] == ["base", "base@3"] and rows[1]["chain"] == 3
    assert all(r["stage"] == "stage3" and r["upstream_ms"] == 300 and r["upstream_n"] == 4 for r in rows)
    assert rows[0]["ratio"] == pytest.approx(303 / 300) and rows[1]["ratio"] == pytest.approx(297 / 300)
    assert all(r["ci_low"] <= r["ratio"] <= r["ci_high"] for r in rows)
    assert "ours / upstream" in capsys.readouterr().out
    ours.write_text(json.dumps({**bench, "stage": 3}))
    assert steps.main([str(log), "--ours", str(ours)]) == 2
    assert "stage index 3" in capsys.readouterr().err
    # our own training log of the same schedule: stage by stage, with upstream's stage starts
    (tmp_path / "mine").mkdir()
    mine = _log(tmp_path / "mine", per_stage_ms=(110, 190, 303, 310), starts=(0, 6, 12, 18), total=20)
    assert steps.main([str(log), "--ours", str(mine), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["against_ours"]
    assert [r["stage"] for r in rows] == ["stage1", "stage2", "stage3"]  # the extension: 2 steps, both skipped
    assert [round(r["ratio"], 4) for r in rows] == [1.1, 0.95, 1.01]


def test_step_time_stage_starts_from_options():
    assert steps.starts_from_scheduled(105) == [0, 35, 70, 105]
    with pytest.raises(Exception, match="3 transitions"):
        steps.starts_from_warmup("Sampling steps [0, 1, 2, 3] for warmup")


def test_shim_traces_without_graph_breaks(monkeypatch):
    """Upstream compiles its model with fullgraph=True: the shim's own Python must trace cleanly."""
    monkeypatch.setattr(shim, "_VARLEN", lambda q, k, v, cq, ck, mq, mk, **kw: q * kw["scale"] + cq[-1])
    monkeypatch.setattr(shim, "_PARAMS", frozenset({"scale", "window_size"}))
    monkeypatch.setattr(shim, "_require_cuda", lambda q: None)

    def attn(q, k, v, cu):
        return shim.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=2048,
                                           max_seqlen_k=2048, causal=True, softmax_scale=0.1, window_size=(384, 0))

    q, k, v, cu = _qkv()
    torch._dynamo.reset()
    out = torch.compile(attn, backend="eager", fullgraph=True)(q, k, v, cu.to(torch.int32))
    assert torch.allclose(out, q * 0.1 + 32)


# ---- kernel inventories side by side -------------------------------------------------------

def test_compare_kernels_per_step_and_by_family(tmp_path, capsys):
    cmp = _load("compare_kernels")
    ours = {"steps": 2, "kernels": [{"kernel": "nvjet_sm90_tst_256x128", "calls": 4, "time_us": 4000.0},
                                    {"kernel": "_relu2_gemm_tma_kernel", "calls": 2, "time_us": 3000.0},
                                    {"kernel": "triton_poi_fused_add_0", "calls": 2, "time_us": 200.0}]}
    theirs = {"steps": 1, "kernels": [
        {"kernel": "nvjet_sm90_tst_256x128", "calls": 2, "time_us": 1500.0},
        # real names from a profile of upstream: flash kernels name cutlass types, upstream's own Triton
        # kernels have no leading underscore
        {"kernel": "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
                   "cutlass::bfloat16_t>>", "calls": 1, "time_us": 700.0},
        {"kernel": "linear_relu_square_kernel", "calls": 1, "time_us": 300.0},
        {"kernel": "void cublasLt::splitKreduce_kernel<32, 16, int, float>", "calls": 1, "time_us": 10.0}]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(ours))
    b.write_text(json.dumps(theirs))
    res = cmp.compare(cmp.load(a), cmp.load(b))
    assert res["total_ms"] == {"ours": 3.6, "theirs": 2.51}
    assert res["families"]["gemm (cuBLAS/CUTLASS)"] == {"ours_ms": 2.0, "theirs_ms": 1.51}
    assert res["families"]["own triton"] == {"ours_ms": 1.5, "theirs_ms": 0.3}
    assert res["families"]["attention"]["theirs_ms"] == 0.7
    assert res["kernels"][0]["kernel"] == "_relu2_gemm_tma_kernel" and res["kernels"][0]["ours_calls"] == 1
    # only the GEMM is launched by both: 2.0 vs 1.5 ms; the rest 1.6 vs 1.01
    assert res["same_name_kernels"] == 1
    assert res["split"]["ours"] == {"same_name_ms": 2.0, "own_ms": 1.6}
    assert res["split"]["theirs"]["same_name_ms"] == 1.5 and abs(res["split"]["theirs"]["own_ms"] - 1.01) < 1e-9
    assert cmp.main([str(a), str(b), "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "difference +1.09 ms" in out
    assert "1 kernels launched by both (same name, as often): ours 2.00 ms, theirs 1.50 ms (x1.3333)" in out
    # one family's kernels, all of them, largest first (where a family's difference comes from)
    assert cmp.main([str(a), str(b), "--family", "gemm"]) == 0
    out = capsys.readouterr().out
    assert "kernels of gemm (cuBLAS/CUTLASS), largest first" in out
    listed = [line.split()[0] for line in out.splitlines()[out.splitlines().index(
        next(x for x in out.splitlines() if x.startswith("kernels of"))) + 1:]]
    assert listed == ["nvjet_sm90_tst_256x128", "void"]  # 2.0 ms, then splitKreduce's 0.01
    assert cmp.main([str(a), str(b), "--family", "o"]) == 2 and "matches 2 families" in capsys.readouterr().err
    a.write_text("{}")
    assert cmp.main([str(a), str(b)]) == 2 and "needs 'steps'" in capsys.readouterr().err


def test_compare_kernels_prints_both_timelines(tmp_path, capsys):
    """Device-only profiles carry the GPU timeline (µs over all profiled steps): compared per step."""
    cmp = _load("compare_kernels")
    k = [{"kernel": "nvjet_sm90_tst_256x128", "calls": 2, "time_us": 1000.0}]
    ours = {"steps": 2, "kernels": k, "timeline": {"span_us": 1_400_000.0, "busy_us": 1_300_000.0, "gaps": 12000}}
    theirs = {"steps": 1, "kernels": k, "timeline": {"span_us": 640_000.0, "busy_us": 630_000.0, "gaps": 4000}}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(ours))
    b.write_text(json.dumps(theirs))
    assert cmp.main([str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "ours busy 650.00 of 700.00 ms (6000 gaps), theirs busy 630.00 of 640.00 ms (4000 gaps)" in out
    assert "busy difference +20.00 ms" in out
    del theirs["timeline"]
    b.write_text(json.dumps(theirs))
    assert cmp.main([str(a), str(b)]) == 0 and "only one side is a device-only profile" in capsys.readouterr().out


def test_compare_kernels_same_name_means_as_often_too(tmp_path):
    """A kernel both sides launch by name but a different number of times per step (e.g. a
    gradient accumulation one side does less often) is not like for like: it counts as each side's own."""
    cmp = _load("compare_kernels")
    ours = {"steps": 1, "kernels": [{"kernel": "gemm_a", "calls": 8, "time_us": 1000.0},
                                    {"kernel": "add_bf16", "calls": 90, "time_us": 1200.0}]}
    theirs = {"steps": 1, "kernels": [{"kernel": "gemm_a", "calls": 8, "time_us": 900.0},
                                      {"kernel": "add_bf16", "calls": 109, "time_us": 6500.0}]}
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(ours))
    b.write_text(json.dumps(theirs))
    res = cmp.compare(cmp.load(a), cmp.load(b))
    assert res["same_name_kernels"] == 1
    assert res["split"] == {"ours": {"same_name_ms": 1.0, "own_ms": 1.2}, "theirs": {"same_name_ms": 0.9, "own_ms": 6.5}}


def test_stage_marks_patch_writes_the_phases_gpu_clocks_reads(tmp_path, monkeypatch):
    """Rank 0 marks each stage start, the extension and the final validation with wall-clock
    seconds, in the 'NAME EPOCH' lines tools/gpu_clocks.py splits a clock log by."""
    import time

    opts = up.BenchOptions(scheduled=6, extension=2)
    patch = up.stage_marks_patch(opts)
    assert patch in up.train_patches(opts)
    loop = ("train_steps = 8\n"
            "for step in range(train_steps + 1):\n"
            "    last_step = (step == train_steps)\n")
    code = up.apply_patches(loop, [patch], "train_gpt.py")
    monkeypatch.chdir(tmp_path)
    before = time.time()
    for master in (True, False):  # other ranks write nothing
        exec(compile(code, "train_gpt.py", "exec"), {"time": time, "master_process": master})
    clocks = _load("gpu_clocks")
    phases = clocks.parse_phases((tmp_path / up.MARKS_FILE).read_text())
    assert [name for name, _ in phases] == ["upstream_stage1", "upstream_stage2", "upstream_stage3",
                                           "upstream_extension", "upstream_validation"]
    assert all(before - 1 <= t <= time.time() + 1 for _, t in phases)
