"""The DC correction (record_parts.dc_postonly_correction) compiled on a CUDA GPU at the record's
window and block (112, 128), for the record's and the candidate's q/k widths, against the same
function in float64 on the CPU (itself checked against the per-query definition by the CPU tests):
forward and every input's gradient, with documents shorter than the window and a ragged tail block.

Run on the H200: ``python -m pytest -m gpu tests/gpu/test_dc_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.model.record_parts import dc_gate_weights, dc_postonly_correction

pytestmark = pytest.mark.gpu

T, H, DV, W, B = 4000, 6, 128, 112, 128  # T not a multiple of B: a padded last block


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dqk", [128, 96])
def test_compiled_dc_on_gpu_matches_float64_on_cpu(dqk, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # fp32 GEMMs, fp32 bounds
    g = torch.Generator().manual_seed(dqk)
    q, k = (torch.randn(T, H, dqk, generator=g) for _ in range(2))
    v, base = (torch.randn(T, H, DV, generator=g) for _ in range(2))
    w1, w2 = dc_gate_weights(torch.randn(T, H, generator=g), torch.randn(T, H, generator=g))
    cu = torch.tensor([0, 5, 60, 60, 1500, 1613, T], dtype=torch.int32)  # short, empty and long documents
    grad_out = torch.randn(T, H, DV, generator=g)
    inputs = (base, q, k, v, w1, w2)

    def run(fn, device, dtype):
        xs = [t.to(device, dtype).requires_grad_() for t in inputs]
        out = fn(*xs, cu.to(device), scale=0.1, window=W, block=B)
        grads = torch.autograd.grad(out, xs, grad_out.to(device, dtype))
        return out, grads

    want, want_grads = run(dc_postonly_correction, "cpu", torch.float64)
    torch._dynamo.reset()
    got, got_grads = run(torch.compile(dc_postonly_correction, dynamic=False), "cuda", torch.float32)
    assert torch.isfinite(got).all()
    assert rel(got - base.cuda(), want - base.double()) < 1e-5
    for name, a, b in zip(("base", "q", "k", "v", "w1", "w2"), got_grads, want_grads):
        assert torch.isfinite(a).all(), name
        assert rel(a, b) < 1e-4, name
