"""The device scripts in benchmarks/ at least parse (they only run on the GPU machines)."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("*.sh"))


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


PY_BENCHES = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("bench_*.py"))


@pytest.mark.parametrize("script", PY_BENCHES, ids=[s.name for s in PY_BENCHES])
def test_python_benchmark_compiles(script):
    compile(script.read_text(), str(script), "exec")


def test_host_bench_without_a_gpu_says_so(capsys, monkeypatch):
    import importlib.util

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = importlib.util.spec_from_file_location("bench_host", [s for s in PY_BENCHES if s.name == "bench_host.py"][0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["plain", "paired", "long_key_offset", "value_residual"])
def test_rotary_bench_arms_compute_the_same(kind):
    """bench_rotary's two arms (the record's old sliced RoPE path and the elementwise one) give the
    same q, k, v bit for bit and the same gradients, on every layer kind it times."""
    import importlib.util

    import torch

    from speedrun.model.yarn import Yarn

    spec = importlib.util.spec_from_file_location("bench_rotary", [s for s in PY_BENCHES if s.name == "bench_rotary.py"][0])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    T, H, D = 24, 4, 16
    y = Yarn(D, 0.5, 1024.0)
    cos, sin = y.tables(2 * T, "cpu")
    g = torch.Generator().manual_seed(1)
    qkv0, aux0 = torch.randn(T, 3 * H * D, generator=g), torch.randn(T, H * D, generator=g)
    grads = [torch.randn(T, H, D, generator=g) for _ in range(3)]
    res = []
    for fn, tables in ((mod.sliced_prep, (cos, sin)), (mod.elementwise_prep, (y,))):
        qkv, aux = qkv0.clone().requires_grad_(), aux0.clone().requires_grad_()
        outs = fn(qkv, aux, *tables, kind=kind, H=H, D=D, rope_dims=y.rope_dims)
        torch.autograd.backward(outs, grads)
        res.append((*outs, qkv.grad, aux.grad))
    for a, b in zip(*res):
        if a is None:
            assert b is None
            continue
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])
