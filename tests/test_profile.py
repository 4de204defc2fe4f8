"""speedrun profile: the shape -> FLOPs/bytes model, ncu parsing, and a CPU profile end to end."""

import json

import pytest
import torch

from speedrun.cli import main
from speedrun.errors import ConfigError, EnvironmentProblem
from speedrun.evidence import profile as prof
from speedrun.evidence.profile import Ceilings, OpCost, dtype_bytes, kernel_key, op_cost, parse_ncu_csv


pytestmark = pytest.mark.usefixtures("use_builtin_cache", "one_thread")

SMALL = ["model.num_layers=1", "model.model_dim=64", "model.num_heads=2", "model.qk_head_dim=16",
         "model.v_head_dim=32", "train.batch_tokens=1024", "train.max_seq_len=128"]


def test_dtype_names():
    assert dtype_bytes("c10::BFloat16") == 2 and dtype_bytes("float") == 4 and dtype_bytes("long int") == 8
    assert dtype_bytes("c10::Float8_e4m3fn") == 1 and dtype_bytes("torch.bfloat16") == 2
    assert dtype_bytes("Scalar") is None and dtype_bytes("TensorList") is None
    assert dtype_bytes("mystery", 4) == 4


def test_gemm_model():
    M, K, N = 96, 64, 48
    assert op_cost("aten::mm", [[M, K], [K, N]], ["c10::BFloat16"] * 2) == \
        OpCost("gemm", 2 * M * N * K, (M * K + K * N + M * N) * 2)
    assert op_cost("aten::mm", [[M, K], [K, N]], ["float", "float"]).bytes == (M * K + K * N + M * N) * 4
    # addmm: bias read as well; scalars (beta, alpha) ignored.
    c = op_cost("aten::addmm", [[N], [M, K], [K, N], [], []], ["float", "float", "float", "Scalar", "Scalar"])
    assert c == OpCost("gemm", 2 * M * N * K, (N + M * K + K * N + M * N) * 4)
    B = 3
    c = op_cost("aten::bmm", [[B, M, K], [B, K, N]], ["c10::BFloat16"] * 2)
    assert c == OpCost("gemm", 2 * B * M * N * K, B * (M * K + K * N + M * N) * 2)
    # FP8 operands, bf16 output; scales are 0-d tensors (4 bytes each, counted as inputs are not)
    c = op_cost("aten::_scaled_mm", [[M, K], [K, N], [], []], ["c10::Float8_e4m3fn"] * 2 + ["float", "float"])
    assert c == OpCost("gemm", 2 * M * N * K, M * K + K * N + M * N * 2)
    with pytest.raises(ValueError, match=r"\(M,K\) x \(K,N\)"):
        op_cost("aten::mm", [[M, K], [K + 1, N]], None)
    # Without dtypes the default applies.
    assert op_cost("aten::mm", [[M, K], [K, N]], None, default_dtype="bfloat16").bytes == (M * K + K * N + M * N) * 2


def test_memory_op_models():
    n = 1024 * 768
    assert op_cost("aten::copy_", [[1024, 768], [1024, 768], []], ["c10::BFloat16", "float", "Scalar"]) == \
        OpCost("copy", 0.0, n * (2 + 4))
    # broadcast multiply: read both inputs, write the full-size output
    c = op_cost("aten::mul", [[1024, 768], [768]], ["float", "float"])
    assert c == OpCost("elementwise", n, (n + 768 + n) * 4)
    # in-place add with a scalar: read and write the tensor
    assert op_cost("aten::add_", [[1024, 768], [], []], ["c10::BFloat16", "Scalar", "Scalar"]).bytes == 2 * n * 2
    c = op_cost("aten::native_layer_norm", [[1024, 768], [], [768], [768], []],
                ["c10::BFloat16", "ScalarList", "c10::BFloat16", "c10::BFloat16", "Scalar"])
    assert c.kind == "norm" and c.bytes == 2 * n * 2 + 2 * 768 * 2
    assert op_cost("aten::_log_softmax", [[1024, 768], [], []], ["float", "Scalar", "Scalar"]).bytes == 2 * n * 4
    assert op_cost("aten::sum", [[1024, 768], []], ["float", ""]).bytes == n * 4
    assert op_cost("aten::embedding", [[50304, 768], [8, 1024]], ["float", "long int"]) is None


def test_registered_model_for_a_custom_op(monkeypatch):
    monkeypatch.setattr(prof, "OP_MODELS", {})
    assert op_cost("speedrun::ce", [[8, 16]], ["float"]) is None
    prof.register_op_model("speedrun::ce", lambda shapes, dtypes: OpCost("ce", 0.0, 4.0 * shapes[0][0] * shapes[0][1]))
    assert op_cost("speedrun::ce", [[8, 16]], ["float"]) == OpCost("ce", 0.0, 512.0)


def test_floor_uses_the_binding_ceiling():
    c = Ceilings(tflops=100.0, tbps=2.0)
    big = OpCost("gemm", 2e12, 1e9)  # compute bound: 2e12 / 1e14 = 20 ms
    assert c.floor_us(big, "aten::mm") == pytest.approx(20_000)
    assert c.floor_us(big, "aten::_scaled_mm") == pytest.approx(10_000)  # FP8 at twice the bf16 rate
    thin = OpCost("gemm", 2e6, 4e9)  # memory bound: 4e9 / 2e12 = 2 ms
    assert c.floor_us(thin, "aten::mm") == pytest.approx(2_000)
    assert c.floor_us(OpCost("elementwise", 1e12, 2e9)) == pytest.approx(1_000)  # vector FLOPs ignored
    assert Ceilings().floor_us(big) is None


def test_profiler_grouping_counts_each_call_once():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as p:
        for _ in range(3):
            torch.mm(a, b)
        torch.nn.functional.linear(a, b.t())  # composite: its inner mm is the 4th call
    groups = prof.group_events(p.events(), "cpu", "float32", Ceilings(1.0, 1.0))
    mm = [g for g in groups if g.name == "aten::mm" and g.shapes == [[64, 32], [32, 16]]]
    assert len(mm) == 1 and mm[0].calls == 4
    assert all(g.cost is None for g in groups if g.name in ("aten::linear", "aten::matmul"))
    assert mm[0].cost == OpCost("gemm", 2 * 64 * 32 * 16, (64 * 32 + 32 * 16 + 64 * 16) * 4)
    # 1 TFLOP/s and 1 TB/s: compute-bound (65536 FLOPs > 14336 bytes per call)
    assert mm[0].floor_us == pytest.approx(4 * 2 * 64 * 32 * 16 / 1e12 * 1e6)
    assert all(g.recoverable_us is None or g.recoverable_us >= 0 for g in groups)
    assert not any(g.name.startswith("ProfilerStep") for g in groups)



def _fake_op(name, shapes, dtypes, kernels):
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Kernel

    return SimpleNamespace(name=name, input_shapes=shapes, input_dtypes=dtypes, device_type=DeviceType.CPU,
                           is_async=False, is_user_annotation=False, self_cpu_time_total=1.0,
                           kernels=[Kernel(k, 0, us) for k, us in kernels])


def _fake_kernel(name, us):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=SimpleNamespace(elapsed_us=lambda: us))


def test_gpu_attribution_and_report_from_fake_events(tmp_path):
    """The GPU branch (kernel time per op, host copies, needed bytes per kernel, ncu table) on
    hand-made profiler events, so it is checked without a GPU."""
    bf = "c10::BFloat16"
    gemm = "void cutlass::Kernel2<cutlass_80_gemm_bf16>(Params)"
    ev = [
        _fake_op("aten::mm", [[4096, 768], [768, 3072]], [bf, bf], [(gemm, 30.0)]),
        _fake_op("aten::mm", [[4096, 768], [768, 3072]], [bf, bf], [(gemm, 34.0)]),
        _fake_op("aten::add", [[4096, 768], [4096, 768]], [bf, bf], [("void at::native::ew<4>(int)", 10.0)]),
        _fake_op("aten::copy_", [[4096, 768], [4096, 768], []], [bf, bf, "Scalar"],
                 [("Memcpy HtoD (Pinned -> Device)", 50.0)]),
        _fake_op("aten::linear", [[4096, 768], [3072, 768]], [bf, bf], []),  # composite: no own kernels
        _fake_op("ProfilerStep#3", [], [], [("x", 1.0)]),
    ]
    ceil = Ceilings(tflops=800.0, tbps=4.0, source="given")
    groups = prof.group_events(ev, "cuda", "bfloat16", ceil)
    by = {g.name: g for g in groups}
    assert set(by) == {"aten::mm", "aten::add", "aten::copy_ (host copy)"}
    mm = by["aten::mm"]
    assert mm.calls == 2 and mm.time_us == 64.0 and mm.kernels == {gemm: 64.0}
    flops = 2 * 4096 * 768 * 3072
    assert mm.floor_us == pytest.approx(2 * flops / 800e12 * 1e6)  # compute bound
    assert mm.recoverable_us == pytest.approx(64.0 - mm.floor_us)
    assert by["aten::copy_ (host copy)"].cost is None  # PCIe, not HBM: no floor
    need = prof.kernel_needed_bytes(groups)
    assert need[gemm] == pytest.approx(2 * (4096 * 768 + 768 * 3072 + 4096 * 3072) * 2)
    # Inductor's range around a compiled graph shows on the device timeline too: not a kernel.
    graph_range = _fake_kernel("## Call CompiledFxGraph fb5wfzvugwjb ##", 500.0)
    graph_range.is_user_annotation = False
    kernels = prof.kernel_table(ev + [_fake_kernel(gemm, 30.0), _fake_kernel(gemm, 34.0),
                                      _fake_kernel("triton_red_fused_0", 5.0), graph_range])
    assert kernels[0] == {"kernel": gemm, "calls": 2, "time_us": 64.0}
    assert not any(k["kernel"].startswith("## ") for k in kernels)
    for k in kernels:
        k["needed_bytes"] = need.get(k["kernel"])
    report = prof.ProfileReport("t", "cuda:0", 2, ceil, groups, kernels, total_us=69.0)
    report.ncu = {"cutlass::Kernel2": {"kernel": "cutlass::Kernel2", "launches": 2,
                                       "dram_read_bytes": 3.0 * need[gemm], "dram_write_bytes": 0.0}}
    paths = prof.write_profile(report, tmp_path / "p")
    md = paths["markdown"].read_text()
    assert "## Kernels, by time" in md and "triton_red_fused_0" in md
    assert "| `cutlass::Kernel2` | 1 |" in md and "| 3.00 |" in md  # measured / needed
    assert (tmp_path / "p" / "roofline.png").stat().st_size > 1000


def _timed_kernel(name, start, end, annotation=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, is_user_annotation=annotation,
                           time_range=SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start))


def test_gpu_timeline_busy_idle_and_gap_sites(tmp_path):
    """Union over streams, gaps charged to (kernel ending last, next kernel) by base name."""
    ev = [
        _timed_kernel("void gemm<1>(int)", 0.0, 10.0),
        _timed_kernel("elementwise", 5.0, 12.0),        # overlaps (another stream)
        _timed_kernel("_relu2_gemm_tma_kernel", 20.0, 30.0),  # gap 8 after elementwise
        _timed_kernel("void gemm<2>(int)", 30.0, 31.0),  # back to back: no gap
        _timed_kernel("ProfilerStep#1", 0.0, 100.0, annotation=True),  # not work
        _timed_kernel("elementwise", 41.0, 50.0),        # gap 10 after gemm
        _timed_kernel("_relu2_gemm_tma_kernel", 58.0, 60.0),  # gap 8 after elementwise again
    ]
    t = prof.gpu_timeline(ev)
    assert t["span_us"] == 60.0 and t["busy_us"] == 12.0 + 11.0 + 9.0 + 2.0 and t["idle_us"] == 26.0
    assert t["gaps"] == 3
    top = t["top_gaps"][0]
    assert (top["before"], top["after"], top["idle_us"], top["count"]) == ("elementwise", "_relu2_gemm_tma_kernel", 16.0, 2)
    assert t["top_gaps"][1]["before"] == "gemm" and t["top_gaps"][1]["idle_us"] == 10.0
    assert prof.gpu_timeline([]) is None
    report = prof.ProfileReport("t", "cuda:0", 2, Ceilings(), [], [], total_us=34.0, timeline=t)
    md = prof.render_markdown(report)
    assert "## GPU timeline: busy and idle" in md and "idle 0.013 ms/step in 1.5 gaps/step" in md
    assert "| `elementwise` | `_relu2_gemm_tma_kernel` | 1 | 0.0080 |" in md
    # gaps of 8, 10 and 8 µs all fall in the 5-20 µs bucket; the others stay empty
    assert [(b["count"], b["idle_us"]) for b in t["by_length"]] == [(0, 0.0), (3, 26.0), (0, 0.0), (0, 0.0), (0, 0.0)]
    assert "| 5-20 us | 1.5 | 0.0130 |" in md and "| >= 1000 us | 0 | 0.0000 |" in md


def test_gpu_timeline_sorts_gaps_by_length():
    """Each gap lands in exactly one bucket: a 1 µs launch gap, a 50 µs stall and a 3 ms wait."""
    ev = [_timed_kernel("a", 0.0, 10.0), _timed_kernel("b", 11.0, 20.0), _timed_kernel("c", 70.0, 80.0),
          _timed_kernel("d", 3080.0, 3090.0), _timed_kernel("e", 3095.0, 3100.0)]
    t = prof.gpu_timeline(ev)
    got = {b["min_us"]: (b["count"], b["idle_us"]) for b in t["by_length"]}
    assert got == {0.0: (1, 1.0), 5.0: (1, 5.0), 20.0: (1, 50.0), 100.0: (0, 0.0), 1000.0: (1, 3000.0)}
    assert sum(c for c, _ in got.values()) == t["gaps"] and sum(u for _, u in got.values()) == t["idle_us"]


NCU_CSV = """==PROF== Connected to process 123
==PROF== Profiling "kern": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python","h","void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>(int, T1)","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","1,048,576"
"0","123","python","h","void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>(int, T1)","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","524,288"
"1","123","python","h","void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float>>(int, T1)","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","Kbyte","2"
"1","123","python","h","void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor<float>>(int, T1)","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_write.sum","byte","0"
"2","123","python","h","_ce_fwd_bwd_kernel","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes_read.sum","byte","100"
"2","123","python","h","_ce_fwd_bwd_kernel","1","7","(128, 1, 1)","(10, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","5"
"""


def test_ncu_csv_parsing_and_command(monkeypatch, tmp_path):
    assert kernel_key("void at::native::f<4, float>(int, float*)") == "at::native::f"
    assert kernel_key("triton_poi_fused_add_0") == "triton_poi_fused_add_0"
    got = parse_ncu_csv(NCU_CSV)
    ew = got["at::native::vectorized_elementwise_kernel"]
    assert ew["launches"] == 2
    assert ew["dram_read_bytes"] == 1_048_576 + 2000 and ew["dram_write_bytes"] == 524_288
    assert got["_ce_fwd_bwd_kernel"] == {"kernel": "_ce_fwd_bwd_kernel", "launches": 1,
                                         "dram_read_bytes": 100.0, "dram_write_bytes": 0.0}
    with pytest.raises(ValueError, match="header"):
        parse_ncu_csv("==PROF== nothing profiled\n")
    cmd = prof.ncu_command("/x/ncu", tmp_path / "o.csv", ["python", "-m", "m"])
    assert cmd[:3] == ["/x/ncu", "--clock-control", "none"]
    assert "dram__bytes_read.sum,dram__bytes_write.sum" in cmd and "--profile-from-start" in cmd
    assert cmd[-3:] == ["python", "-m", "m"]
    assert "--kernel-name" not in cmd and "--launch-count" not in cmd
    cmd = prof.ncu_command("/x/ncu", tmp_path / "o.csv", ["python"], prof.NcuOptions("_relu2|_ce_", 40))
    i, j = cmd.index("--kernel-name"), cmd.index("--launch-count")
    assert cmd[i + 1] == "regex:_relu2|_ce_" and cmd[j + 1] == "40" and cmd[-1] == "python"
    monkeypatch.setattr(prof.shutil, "which", lambda name: None)
    with pytest.raises(EnvironmentProblem, match="ncu"):
        prof.find_ncu()


def test_ncu_timeout_is_a_clear_error(monkeypatch):
    """A child that outlives --ncu-timeout is killed and the error says how to profile fewer kernels."""
    import subprocess

    def slow(cmd, **kw):
        assert kw["timeout"] == 5
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(prof, "find_ncu", lambda: "/x/ncu")
    monkeypatch.setattr(prof.subprocess, "run", slow)
    with pytest.raises(EnvironmentProblem, match="5 s.*--ncu-kernels"):
        prof.run_ncu("t=tiny", [], 0, 1, 0, prof.NcuOptions(timeout_s=5))


def test_profile_cli_on_cpu_writes_markdown_png_json(tmp_path, capsys):
    out = tmp_path / "prof"
    args = ["profile", "--arm", "t=tiny", "--steps", "2", "--warmup", "1", "--out", str(out),
            "--peak-tflops", "0.2", "--peak-tbps", "0.05"] + [x for s in SMALL for x in ("--set", s)]
    assert main(args) == 0
    screen = capsys.readouterr().out
    assert "Known ops, ranked by recoverable time" in screen
    md = (out / "profile.md").read_text()
    assert "aten::mm" in md and "![roofline](roofline.png)" in md
    assert (out / "roofline.png").stat().st_size > 1000
    rep = json.loads((out / "profile.json").read_text())
    assert rep["steps"] == 2 and rep["ceilings"]["source"] == "given"
    mms = [r for r in rep["ops"] if r["op"] == "aten::mm"]
    assert mms and all(r["flops"] > 0 and r["floor_us"] > 0 for r in mms)
    for r in rep["ops"]:
        if r["recoverable_us"] is not None:
            assert r["recoverable_us"] == pytest.approx(max(0.0, r["time_us"] - r["floor_us"]))
    # One model: the head GEMM (tokens x dim) @ (dim x padded vocab) appears with its exact FLOPs.
    head = [r for r in mms if r["shapes"][:2] == [[1024, 64], [64, 384]]]
    assert head and head[0]["flops"] == head[0]["calls"] * 2 * 1024 * 64 * 384
    capsys.readouterr()
    assert main(args + ["--ncu"]) == 2  # no ncu / no GPU here: a clear error, never a crash
    err = capsys.readouterr().err
    assert "ncu" in err or "CUDA" in err


@pytest.mark.gpu
def test_profile_on_gpu_attributes_kernels_and_measures_ceilings(tmp_path):
    """On a GPU: kernels are attributed to the ops that launched them, ceilings are measured."""
    report = prof.profile_steps("t=tiny", common=SMALL + ["train.device=cuda"], steps=2, warmup=2)
    assert report.ceilings.source == "measured" and report.ceilings.tflops > 50 and report.ceilings.tbps > 0.5
    assert report.kernels and all(k["time_us"] > 0 for k in report.kernels)
    mms = [g for g in report.groups if g.name in ("aten::mm", "aten::addmm") and g.cost is not None]
    assert mms and all(g.kernels for g in mms)
    assert all(g.cost.flops > 0 and g.floor_us > 0 for g in mms)
    assert sum(g.time_us for g in report.groups) <= report.total_us * 1.01  # no kernel counted twice
    assert any(k.get("needed_bytes") for k in report.kernels)
    t = report.timeline  # a tiny eager model on a big GPU: launch-bound, so it idles
    assert t and 0 < t["busy_us"] < t["span_us"] and t["gaps"] > 0 and t["top_gaps"]
    assert t["busy_us"] >= report.total_us / 2  # kernels on one stream: busy ~ sum of kernel times
    paths = prof.write_profile(report, tmp_path / "p")
    assert "## Kernels, by time" in paths["markdown"].read_text()
    assert "## GPU timeline: busy and idle" in paths["markdown"].read_text()


@pytest.mark.gpu
def test_profile_device_only_on_gpu(tmp_path):
    """Device activity alone: kernels and the timeline without op rows; its gaps sum to its idle."""
    report = prof.profile_steps("t=tiny", common=SMALL + ["train.device=cuda"], steps=2, warmup=2,
                                device_only=True, measure=False)
    assert report.device_only and not report.groups and report.kernels
    t = report.timeline
    assert t and 0 < t["busy_us"] < t["span_us"] and sum(b["count"] for b in t["by_length"]) == t["gaps"]
    assert sum(b["idle_us"] for b in t["by_length"]) == pytest.approx(t["idle_us"])
    assert report.wall_us >= t["span_us"] * 0.99  # the device's span lies inside the host's clock
    assert "device activity only recorded" in prof.render_markdown(report)


def test_device_only_needs_a_gpu():
    with pytest.raises(ConfigError, match="--device-only"):
        prof.profile_steps("t=tiny", common=SMALL + ["train.device=cpu"], steps=1, warmup=0, device_only=True)


@pytest.mark.gpu
def test_profile_ncu_on_gpu(tmp_path):
    """With Nsight Compute on PATH: measured DRAM bytes per kernel next to the bytes needed."""
    import shutil

    if shutil.which("ncu") is None:
        pytest.skip("ncu not on PATH")
    report = prof.profile_steps("t=tiny", common=SMALL + ["train.device=cuda"], steps=1, warmup=1, ncu=True)
    assert report.ncu and any(r["dram_read_bytes"] > 0 for r in report.ncu.values())
    md = prof.render_markdown(report)
    assert "measured vs needed" in md


def test_call_site_names_our_line_or_the_compiled_graph():
    from speedrun.evidence.profile import call_site

    stack = ["/usr/lib/python3/site-packages/torch/nn/functional.py(2100): linear",
             "/work/x/speedrun/model/record.py(624): _attend", "/work/x/speedrun/train/loop.py(133): run_step"]
    assert call_site(stack) == "speedrun/model/record.py:624 _attend"
    assert call_site(["/tmp/torchinductor_root/ab/cabc.py(88): call", "/work/x/speedrun/model/record.py(9): f"]) \
        == "<compiled graph> cabc.py:88 call"
    assert call_site(["/usr/lib/python3/threading.py(1): run"]) is None and call_site(None) is None


def test_profile_stacks_name_the_calling_line(tmp_path, capsys):
    out = tmp_path / "prof"
    args = ["profile", "--arm", "t=tiny", "--steps", "1", "--warmup", "1", "--out", str(out), "--stacks",
            "--peak-tflops", "0.2", "--peak-tbps", "0.05"] + [x for s in SMALL for x in ("--set", s)]
    assert main(args) == 0
    assert "Called from" in (out / "profile.md").read_text()
    rep = json.loads((out / "profile.json").read_text())
    sites = {site for r in rep["ops"] if r["op"] == "aten::mm" for site in r["sources"]}
    assert any(site.startswith("speedrun/") for site in sites), sites


def test_launch_notes_name_bytes_only_while_profiling():
    """A launch note is free without a profiler; under one it is a range whose name carries the
    launch's compulsory bytes (every read and written tensor once, plus extra) and FLOPs, and FP8
    operands mark the GEMM as FP8."""
    import contextlib

    import torch

    from speedrun.kernels.launch_notes import launch_note, parse_launch_note

    x = torch.zeros(64, 32, dtype=torch.bfloat16)
    q = torch.zeros(64, 32, dtype=torch.uint8)
    assert isinstance(launch_note("_k", reads=(x,), writes=(q,)), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        with launch_note("_quant_kernel", reads=(x, None), writes=(q,), extra_bytes=10):
            x.add_(1)
        with launch_note("_gemm_kernel", reads=(q.view(torch.float8_e4m3fn), x), writes=(x,), flops=2 * 64 * 32 * 32):
            x.add_(1)
    notes = [parse_launch_note(e.name) for e in p.events() if parse_launch_note(e.name)]
    assert [(n.kernel, n.kind, n.nbytes, n.flops) for n in notes] == [
        ("_quant_kernel", "memory", 64 * 32 * 2 + 64 * 32 + 10, 0),
        ("_gemm_kernel", "gemm_fp8", 64 * 32 * (1 + 2 + 2), 2 * 64 * 32 * 32)]
    assert parse_launch_note("speedrun.kernel:memory:_k:bytes=12") is None  # no flops field
    assert parse_launch_note("aten::mm") is None


def test_noted_kernels_belong_to_their_notes(tmp_path):
    """Our Triton kernel linked by the profiler to the opaque op around its launch is moved to
    its launch note (split by calls over the note's shapes), which gives it a floor and the
    needed bytes the ncu table compares with; the opaque op keeps its other kernels."""
    from speedrun.kernels.launch_notes import PREFIX

    small = f"{PREFIX}:memory:_abs_max_kernel:bytes=1000:flops=0"
    big = f"{PREFIX}:memory:_abs_max_kernel:bytes=4000:flops=0"
    gemm = f"{PREFIX}:gemm_fp8:_relu2_gemm_tma_kernel:bytes=3000:flops=6000000"
    ev = [
        _fake_op("speedrun::opaque_fwd", [[[8, 8]]], [], [("_abs_max_kernel", 9.0), ("_relu2_gemm_tma_kernel", 20.0),
                                                           ("void at::native::fill<4>(int)", 1.0)]),
        _fake_op(small, [], [], []),
        _fake_op(small, [], [], []),
        _fake_op(big, [], [], []),
        _fake_op(gemm, [], [], [("_relu2_gemm_tma_kernel", 0.0)]),  # linked to the note itself
    ]
    ceil = Ceilings(tflops=1000.0, tbps=4.0, source="given")
    by = {g.name: g for g in prof.group_events(ev, "cuda", "bfloat16", ceil)}
    assert by["speedrun::opaque_fwd"].time_us == pytest.approx(1.0)
    assert by["speedrun::opaque_fwd"].kernels == {"void at::native::fill<4>(int)": 1.0}
    assert by[small].calls == 2 and by[small].time_us == pytest.approx(6.0) and by[big].time_us == pytest.approx(3.0)
    assert by[gemm].time_us == pytest.approx(20.0)
    assert by[small].floor_us == pytest.approx(2 * 1000 / 4e12 * 1e6)
    assert by[gemm].floor_us == pytest.approx(6e6 / 2000e12 * 1e6)  # FP8: twice the bf16 rate
    need = prof.kernel_needed_bytes(list(by.values()))
    assert need["_abs_max_kernel"] == 2 * 1000 + 4000 and need["_relu2_gemm_tma_kernel"] == 3000


def test_our_launchers_note_their_compulsory_bytes():
    """The real launchers (under the Triton interpreter) note what they must move: abs_max reads
    x; the quantise pass reads x and writes both FP8 layouts; the fused relu2 GEMM reads a and b
    and writes post in bf16 and e4m3, with 2MNK FLOPs."""
    import torch

    from speedrun.kernels.fp8_cache import E4M3, interpreting, quantize_current
    from speedrun.kernels.launch_notes import parse_launch_note
    from speedrun.kernels.mlp import relu2_gemm

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (the launchers fall back to references otherwise)")
    M, K, N = 32, 64, 48
    g = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = torch.randn(N, K, generator=g).bfloat16()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        quantize_current(x, fp8_dtype=E4M3, transposed=True)
        relu2_gemm(x, w, q_dtype=E4M3, q_scale=torch.tensor(1.0), impl="fused")
    notes = [n for n in (parse_launch_note(e.name) for e in p.events()) if n is not None]
    partials = 2  # the interpreter's abs-max pass: 1024 elements per program
    assert [(n.kernel, n.kind, n.nbytes, n.flops) for n in notes] == [
        ("_abs_max_kernel", "memory", M * K * 2 + 4 * partials, 0),
        ("_dual_layout_kernel", "memory", M * K * (2 + 1 + 1) + 4 * partials, 0),
        ("_relu2_gemm_kernel", "gemm", (M * K + N * K) * 2 + M * N * (2 + 1), 2 * M * N * K)]


def _written_profile(folder, arm, device, steps, kernels, device_only=True):
    """A profile.json as ``speedrun profile`` writes it, from hand-made device kernels
    ``[(name, start_us, end_us)]`` (its kernel table and timeline computed by the real code)."""
    ev = [_timed_kernel(n, s, e) for n, s, e in kernels]
    report = prof.ProfileReport(arm, device, steps, Ceilings(), [], prof.kernel_table(ev),
                                total_us=sum(e - s for _, s, e in kernels), timeline=prof.gpu_timeline(ev),
                                device_only=device_only)
    return prof.write_profile(report, folder)["json"]


def test_profile_diff_per_step_by_kernel_and_timeline(tmp_path, capsys):
    """Two profiles of the same step: per-step times (each over its own step count), kernels of
    two instantiations merged by base name, kernels of one side only, the timeline's busy and
    idle, ranked by the size of the difference; the CLI prints it and writes the JSON."""
    from speedrun.evidence.profile_diff import diff_profiles, load_profile, render_diff

    h100 = "NVIDIA H100 80GB HBM3"
    # eager: 2 steps; each: gemm<1> 10 us, gemm<2> 10 us, memset 2 us, then an idle gap of 8 us
    eager = [k for t0 in (0.0, 40.0) for k in (("void gemm<1>(int)", t0, t0 + 10), ("void gemm<2>(int)", t0 + 10, t0 + 20),
                                                ("elementwise", t0 + 20, t0 + 22))]
    # graphs: 1 step; the gemms slower (24 us together), no elementwise, a zeroing kernel of 3 us, no gap
    graph = [("void gemm<1>(int)", 0.0, 12.0), ("void gemm<2>(int)", 12.0, 24.0), ("zero_grads", 24.0, 27.0)]
    a = _written_profile(tmp_path / "e", "e", h100, 2, eager)
    b = _written_profile(tmp_path / "g", "g", h100, 1, graph)
    res = diff_profiles(load_profile(tmp_path / "e"), load_profile(b))  # a folder or the file
    rows = {r["kernel"]: r for r in res["rows"]}
    assert set(rows) == {"gemm", "elementwise", "zero_grads"}
    assert rows["gemm"]["base_calls"] == 2.0 and rows["gemm"]["other_calls"] == 2.0
    assert rows["gemm"]["base_us"] == 20.0 and rows["gemm"]["other_us"] == 24.0 and rows["gemm"]["delta_us"] == 4.0
    assert rows["zero_grads"]["base_calls"] == 0.0 and rows["zero_grads"]["delta_us"] == 3.0
    assert rows["elementwise"]["delta_us"] == -2.0
    assert [r["kernel"] for r in res["rows"]] == ["gemm", "zero_grads", "elementwise"]  # by |delta|
    assert res["kernel_us"] == {"base": 22.0, "other": 27.0, "delta": 5.0}
    # eager's timeline: span 62 over 2 steps, one 18 us gap between the steps
    assert res["timeline"]["span_us"] == {"base": 31.0, "other": 27.0, "delta": -4.0}
    assert res["timeline"]["idle_us"]["base"] == 9.0 and res["timeline"]["idle_us"]["other"] == 0.0
    assert not res["warnings"]
    md = render_diff(res)
    assert "| device idle | 0.009 | 0.000 | -0.009 |" in md and "| `gemm` | 2.0 | 2.0 | 0.020 | 0.024 | +0.004 |" in md

    out = tmp_path / "diff.json"
    assert main(["profile", "--diff", str(a), str(tmp_path / "g"), "--json", str(out)]) == 0
    assert "# Profile diff: g against e (per step)" in capsys.readouterr().out
    assert json.loads(out.read_text())["kernel_us"]["delta"] == 5.0

    # unlike profiles say so; bad files are one clear line
    c = _written_profile(tmp_path / "h200", "g", "NVIDIA H200", 1, graph, device_only=False)
    res = diff_profiles(load_profile(a), load_profile(c))
    assert any("different devices" in w for w in res["warnings"]) and any("device activity only" in w for w in res["warnings"])
    # a profile that ran the heavy kernels twice per step (a capture among its steps) is flagged
    twice = [k for t0 in (0.0, 30.0) for k in (("void gemm<1>(int)", t0, t0 + 12), ("void gemm<2>(int)", t0 + 12, t0 + 24))]
    d = _written_profile(tmp_path / "twice", "g", h100, 1, twice)
    res = diff_profiles(load_profile(a), load_profile(d))
    assert [w for w in res["warnings"] if "different work per step" in w and "`gemm`" in w], res["warnings"]
    assert "different work per step" in render_diff(res)
    (tmp_path / "bad.json").write_text(json.dumps({"kernels": [{"kernel": "x"}], "steps": 1}))
    (tmp_path / "notjson.json").write_text("{")
    for bad, needle in ((tmp_path / "missing", "no such profile"), (tmp_path / "bad.json", "lacks kernel/calls/time_us"),
                        (tmp_path / "notjson.json", "not a readable JSON"), (tmp_path / "diff.json", "not a 'speedrun profile' JSON")):
        assert main(["profile", "--diff", str(a), str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("speedrun profile --diff: ") and needle in err and len(err.splitlines()) == 1, err
    assert main(["profile", "--json", str(out)]) == 2
    assert "--json goes with --diff" in capsys.readouterr().err
