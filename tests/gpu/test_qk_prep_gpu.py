"""Fused QK-prep at record shapes on a CUDA GPU (T = 8192 and 49152, H = 6, Dqk = 96, Dv = 128).

Run on the H200: ``python -m pytest -q -m gpu tests/gpu/test_qk_prep_gpu.py``.
Bounds as in tests/test_qk_prep.py: bf16 forward rel < 2e-3 (the kernel reproduces the record's
two roundings), bf16 backward rel < 1e-2 against autograd of the reference.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from speedrun.kernels.qk_prep import DEFAULT_EPS, _check, _launch_bwd, _launch_fwd, qk_prep, qk_prep_reference  # noqa: E402
from speedrun.model.yarn import Yarn  # noqa: E402

H, DQK, DV = 6, 96, 128
DEV = "cuda"
VARIANTS = {  # (paired, key_offset, pad_to, aux): the record's layer kinds
    "plain": (False, False, None, False),
    "paired_aux": (True, False, None, True),
    "long_key_offset_aux": (False, True, None, True),
    "pad128": (False, True, 128, False),
    "paired_aux_pad128": (True, False, 128, True),
}


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def _setup(T, aux, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    qkv = (torch.randn(T, H * (2 * DQK + DV), device=DEV, generator=g) * 2).bfloat16()
    a = torch.randn(T, H * DV, device=DEV, generator=g).bfloat16() if aux else None
    yarn = Yarn(DQK, 0.5, 1024.0)
    yarn.apply(896, 2048)
    cos, sin = yarn.tables(2 * T, DEV)
    return qkv, a, cos, sin


@pytest.mark.parametrize("T", [8192, 49152])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_record_shape_forward_backward(variant, T):
    paired, key_offset, pad_to, aux = VARIANTS[variant]
    qkv, a, cos, sin = _setup(T, aux, seed=len(variant) + T)
    kw = dict(num_heads=H, qk_dim=DQK, v_dim=DV, paired=paired, key_offset=key_offset, pad_to=pad_to)
    _, _, dqk, dv, n, dout = _check(qkv, cos, sin, H, DQK, DV, paired, key_offset, pad_to, a, None, "t")
    nan = lambda *s: torch.full(s, float("nan"), device=DEV, dtype=torch.bfloat16)  # noqa: E731
    q, k, v = nan(T, H, dout), nan(T, H, dout), nan(T, H, dv)
    _launch_fwd(qkv, cos, sin, a, T, H, dqk, dv, n, dout, paired, key_offset, DEFAULT_EPS, q, k, v)
    ref = qk_prep_reference(qkv, cos, sin, aux_v=a, **kw)
    for got, want in zip((q, k, v), ref):
        assert torch.isfinite(got).all()
        assert rel(got.reshape(want.shape), want) < 2e-3
    grads = [torch.randn_like(t) for t in ref]
    x = qkv.clone().requires_grad_()
    want = torch.autograd.grad(qk_prep_reference(x, cos, sin, aux_v=a, **kw), x, grads)[0]
    thd = lambda t: t.reshape(T, H, t.shape[-1])  # noqa: E731
    dx = nan(*qkv.shape)
    _launch_bwd(qkv, cos, sin, *(thd(g) for g in grads), T, H, dqk, dv, n, paired, key_offset, DEFAULT_EPS, out=dx)
    assert torch.isfinite(dx).all()
    assert rel(dx, want) < 1e-2
    x2 = qkv.clone().requires_grad_()
    got = torch.autograd.grad(qk_prep(x2, cos, sin, aux_v=a, **kw), x2, grads)[0]
    assert rel(got, want) < 1e-2


def test_inside_torch_compile():
    """The autograd Function runs inside a compiled region (as a graph break or traced op)."""
    T = 8192
    qkv, _, cos, sin = _setup(T, False, seed=3)
    kw = dict(num_heads=H, qk_dim=DQK, v_dim=DV, key_offset=True)

    def f(x):
        q, k, v = qk_prep(x, cos, sin, **kw)
        return (q.float().square().sum() + k.float().sum() + v.float().sum())

    x1 = qkv.clone().requires_grad_()
    x2 = qkv.clone().requires_grad_()
    out1 = torch.compile(f)(x1)
    out1.backward()
    out2 = f(x2)
    out2.backward()
    assert rel(out1, out2) < 1e-5 and rel(x1.grad, x2.grad) < 1e-5
