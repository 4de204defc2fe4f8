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


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_backward_e5m2_epilogue_at_record_shape(variant):
    """model.qk_prep_fp8_grad on sm90 (49,152 tokens): the epilogue's e5m2 bytes (hardware cvt) are
    exactly quantize_delayed's from the d qkv the same launch stored, and the amax is exact.

    The stored d qkv is not bit-equal to the plain backward's on the GPU, and need not be: the
    1-byte stores make the compiler pick another register layout for the whole tile (the sm90
    build in tests/test_qk_prep.py shows it), which reorders the fp32 sums of the RMS-norm
    backward, so an element near a bf16 rounding boundary can round the other way.  The bound
    below allows such one-ulp flips and nothing more (a wrong tile or a skipped rounding is
    orders of magnitude above it)."""
    from speedrun.kernels.fp8_cache import E5M2, abs_max, quantize_delayed

    T = 49152
    paired, key_offset, pad_to, aux = VARIANTS[variant]
    qkv, a, cos, sin = _setup(T, aux, seed=21)
    _, _, dqk, dv, n, dout = _check(qkv, cos, sin, H, DQK, DV, paired, key_offset, pad_to, a, None, "t")
    g = torch.Generator(device=DEV).manual_seed(22)
    gq, gk = (torch.randn(T, H, dout, device=DEV, generator=g).bfloat16() for _ in range(2))
    gv = torch.randn(T, H, dv, device=DEV, generator=g).bfloat16()
    args = (qkv, cos, sin, gq, gk, gv, T, H, dqk, dv, n, paired, key_offset, DEFAULT_EPS)
    plain = _launch_bwd(*args)
    scale = (abs_max(plain) * 1.5 / 57344).reshape(())
    q8 = torch.full(tuple(qkv.shape), 0x7F, dtype=torch.uint8, device=DEV).view(E5M2)
    acc = torch.zeros((), device=DEV)
    dx = _launch_bwd(*args, out=torch.full_like(plain, float("nan")), fp8_out=(q8, scale, acc))
    assert torch.isfinite(dx).all()
    differ = (dx != plain).float().mean().item()
    assert rel(dx, plain) < 2e-4 and differ < 1e-3, (rel(dx, plain), differ)
    want_acc = torch.zeros((), device=DEV)
    want_q, _ = quantize_delayed(dx, scale, want_acc, fp8_dtype=E5M2, transposed=False)
    assert torch.equal(q8.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(acc, want_acc) and torch.equal(acc, abs_max(dx))


def test_compiled_candidate_hands_every_layer_its_e5m2_gradient():
    """Under torch.compile (Inductor passes d qkv from one opaque backward to the next) the packed
    QKV GEMM's backward finds QK-prep's e5m2 gradient in every attention layer once the delayed
    scales are ready, and the losses follow the switch-off model's."""
    from types import SimpleNamespace

    from speedrun.config import ModelConfig
    from speedrun.model.interface import ForwardArgs
    from speedrun.model.record import RecordGPT

    base = dict(vocab_size=257, num_layers=6, model_dim=128, num_heads=4, qk_head_dim=24, v_head_dim=32,
                architecture="record", qkv_path="fused_fp8", kernels="fp8_full", fp8_input_scaling="delayed")
    models = {}
    for name, on in (("off", False), ("on", True)):
        torch.manual_seed(0)
        m = RecordGPT(ModelConfig(**base, qk_prep_fp8_grad=on)).cuda().bfloat16()
        m.compile_body(dynamic=False)
        models[name] = m
    args = ForwardArgs(window_short=128, window_long=256, mtp_weights=(1.0, 0.5), prefix_weight=0.0)
    g = torch.Generator().manual_seed(3)
    T = 512
    batch = SimpleNamespace(inputs=torch.randint(0, 257, (T,), generator=g, dtype=torch.int32).cuda(),
                            targets=torch.randint(0, 257, (T,), generator=g).cuda(),
                            cu_seqlens=torch.tensor([0, 200, T], dtype=torch.int32).cuda(), max_seqlen=T, bigram=None)
    losses = {k: [] for k in models}
    for step in range(3):
        for name, m in models.items():
            loss = m.loss(batch, args)
            loss.backward()
            losses[name].append(loss.item())
            m.end_fp8_step()
            m.zero_grad()
    taken = [st.handoffs_taken for st in models["on"]._qkv_inputs.values()]
    assert taken and all(t == 2 for t in taken), taken  # steps 2 and 3, every layer
    for lo, ln in zip(losses["off"], losses["on"]):
        assert abs(lo - ln) <= 1e-3 * abs(lo), (losses)
