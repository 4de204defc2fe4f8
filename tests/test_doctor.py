"""Doctor and node fingerprint on CPU (GPU branches are exercised on the H200 by the lead)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from speedrun.cli import main
from speedrun.evidence import doctor, fingerprint
from speedrun.evidence.doctor import run_doctor
from speedrun.evidence.fingerprint import measure_copy_tbps, measure_matmul_tflops, node_fingerprint


@pytest.fixture(autouse=True)
def _fast_backends(monkeypatch):
    """Replace the real attention probe (slow on CPU) with a fixed answer; tests may override it."""
    fake = types.ModuleType("speedrun.attention")
    fake.available_backends = lambda: {"reference": (True, "ok"), "fa3": (False, "kernels not installed")}
    monkeypatch.setitem(sys.modules, "speedrun.attention", fake)
    monkeypatch.delenv("SPEEDRUN_TOKENIZER_DIR", raising=False)
    monkeypatch.delenv("TIKTOKEN_CACHE_DIR", raising=False)
    return fake


pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_fingerprint_on_cpu():
    fp = node_fingerprint(measure=True)
    assert fp["hostname"] and fp["python"] and fp["torch"] == torch.__version__
    for k in ("gpu_name", "gpu_capability", "matmul_bf16_tflops", "copy_tbps"):
        assert fp[k] is None, k
    assert fp["gpu_count"] == 0 or fp["driver"] is not None  # nvidia-smi may exist without torch CUDA


def test_measurements_need_cuda():
    with pytest.raises(RuntimeError, match="CUDA"):
        measure_matmul_tflops(n=64)
    with pytest.raises(RuntimeError, match="CUDA"):
        measure_copy_tbps(nbytes=1024)


def test_fingerprint_reads_nvidia_smi(monkeypatch):
    rows = [["NVIDIA H200", "580.82.07", "1980", "3201", "1980"]] * 2
    monkeypatch.setattr(fingerprint, "_nvidia_smi", lambda query: rows)
    fp = node_fingerprint(measure=False)
    assert (fp["gpu_name"], fp["gpu_count"], fp["driver"]) == ("NVIDIA H200", 2, "580.82.07")
    assert (fp["clocks_sm_mhz"], fp["clocks_mem_mhz"], fp["clocks_max_sm_mhz"]) == (1980.0, 3201.0, 1980.0)


def test_doctor_cpu_report_only():
    rep = run_doctor()
    text = rep.render()
    assert "no CUDA device" in text and "attention:reference" in text
    assert rep.exit_code() == 0  # without --require-gpu nothing blocks
    assert not rep.blocking
    # the missing tokenizer is a problem with a fix, not a blocker
    assert any("tokenizer" in what for what, _ in rep.problems)
    assert "fix: export SPEEDRUN_TOKENIZER_DIR" in text


def test_doctor_require_gpu_blocks_on_cpu():
    rep = run_doctor(require_gpu=True)
    assert not rep.ok and rep.exit_code() == 1
    assert any("no CUDA GPU" in what for what, _ in rep.blocking)
    assert "(blocks a timed GPU run)" in rep.render()


def test_doctor_data_glob(tmp_path):
    pattern = str(tmp_path / "fineweb_*.bin")
    rep = run_doctor(data_glob=pattern)
    assert any("no data shards" in what for what, _ in rep.blocking)
    (tmp_path / "fineweb_val_000000.bin").write_bytes(b"\0" * 1024)
    rep = run_doctor(data_glob=pattern)
    assert ("data", "ok") in [(n, s) for n, s, _ in rep.checks]
    assert not any("data" in what for what, _ in rep.problems)


def test_doctor_tokenizer_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_TOKENIZER_DIR", str(tmp_path))
    rep = run_doctor()
    assert any("lacks encoder.json, vocab.bpe" in what for what, _ in rep.problems)
    (tmp_path / "encoder.json").write_text("{}")
    (tmp_path / "vocab.bpe").write_text("")
    rep = run_doctor()
    assert rep.ok, rep.problems


def test_doctor_no_working_attention_blocks(_fast_backends):
    _fast_backends.available_backends = lambda: {"reference": (False, "boom")}
    rep = run_doctor(require_gpu=True)
    assert any("no attention backend" in what for what, _ in rep.blocking)


def test_doctor_attention_probe_crash_is_reported(_fast_backends):
    def crash():
        raise RuntimeError("backend exploded")

    _fast_backends.available_backends = crash
    rep = run_doctor()
    assert any("probe crashed" in what for what, _ in rep.problems)
    assert "backend exploded" in rep.render()


def test_doctor_without_attention_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "speedrun.attention", types.ModuleType("speedrun.attention"))
    rep = run_doctor()
    assert ("attention", "info") in [(n, s) for n, s, _ in rep.checks]


def test_fp8_check_reports_missing_scaled_mm(monkeypatch):
    monkeypatch.delattr(torch, "_scaled_mm")
    ok, detail = doctor.fp8_scaled_mm_check(device="cpu")
    assert not ok and "_scaled_mm" in detail
    rep = run_doctor(require_gpu=True)
    assert any("_scaled_mm" in what for what, _ in rep.blocking)


def test_cli_doctor_exit_codes(capsys):
    assert main(["doctor", "--no-measure"]) == 0
    assert "speedrun doctor" in capsys.readouterr().out
    assert main(["doctor", "--require-gpu", "--no-measure"]) == 1


def test_doctor_adds_attention_timings_when_measuring(monkeypatch):
    """With a GPU and measurements on, each working backend's line carries its stage-3 time; a
    failing timing is an info line, never a problem."""
    from speedrun.evidence import attention_timing

    monkeypatch.setattr(attention_timing, "doctor_timings", lambda names: {n: "fwd+bwd 1.25 ms at stage 3" for n in names})
    rep = doctor.DoctorReport()
    doctor._check_attention(rep, timed=True)
    assert ("attention:reference", "ok", "ok; fwd+bwd 1.25 ms at stage 3") in rep.checks
    assert all("fwd+bwd" not in d for n, _, d in rep.checks if n == "attention:fa3")  # not working: not timed

    def broken(names):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(attention_timing, "doctor_timings", broken)
    rep = doctor.DoctorReport()
    doctor._check_attention(rep, timed=True)
    assert ("attention", "info", "stage-3 timing failed: RuntimeError: out of memory") in rep.checks and rep.ok

