"""Packed FP8 QKV weight and GEMM at record shapes on a CUDA GPU (sm89+ for ``torch._scaled_mm``).

Record: H = 6, Dqk = 96, Dv = 128, D = 768 -> N = 1920; T = 8192 tokens.
Run on the H200: ``python -m pytest -q -m gpu tests/gpu/test_qkv_pack_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 needs sm89 or newer", allow_module_level=True)

from speedrun.kernels.fp8_cache import E4M3, E5M2, quantize_current, quantize_current_reference  # noqa: E402
from speedrun.kernels.fp8_ops import scaled_mm  # noqa: E402
from speedrun.kernels.qkv_pack import (  # noqa: E402
    delayed_scale,
    pack_qkv_fp8,
    pack_qkv_fp8_reference,
    packed_qkv_linear,
    packed_qkv_linear_reference,
    packed_weight_reference,
    repack_qkv_fp8,
)

H, DQK, DV, D, T = 6, 96, 128, 768, 8192
N = H * (2 * DQK + DV)
DEV = "cuda"


def rel(a, b):
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _banks(seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    bound = 3**0.5 * 0.5 * D**-0.5  # the record's uniform init
    qk = ((torch.rand(10 * H, 2 * DQK, D, device=DEV, generator=g) * 2 - 1) * bound).bfloat16()
    vo = ((torch.rand(20, D, D, device=DEV, generator=g) * 2 - 1) * bound).bfloat16()
    sc = torch.tensor([0.5, 1.0] * 11, device=DEV)
    sc[6] = -0.4
    return qk, vo, sc


@pytest.mark.parametrize("sa", [0.5, -0.4])
def test_pack_bit_exact_record_shape(sa):
    qk, vo, _ = _banks(1)
    j = 3
    nan = lambda *s: torch.full(s, float("nan"), device=DEV).to(E4M3)  # noqa: E731
    sa_t = torch.tensor(sa, device=DEV)
    for scale in (None, torch.tensor(1e-5, device=DEV)):  # current, and a saturating delayed scale
        p = pack_qkv_fp8(qk[j * H : (j + 1) * H], vo[2 * j], sa_t, scale=scale, out=(nan(N, D), nan(D, N)))
        r = pack_qkv_fp8_reference(qk[j * H : (j + 1) * H], vo[2 * j], sa_t, scale=scale)
        assert torch.equal(p.data.view(torch.uint8), r.data.view(torch.uint8))
        assert torch.equal(p.data_t.view(torch.uint8), r.data_t.view(torch.uint8))
        assert torch.equal(p.amax, r.amax)
    assert torch.allclose(delayed_scale(p.amax), r.amax * 1.12 / 448)


@pytest.mark.parametrize("dw_fp8", [False, True])
def test_packed_linear_record_shape(dw_fp8):
    qk, vo, sc = _banks(2)
    j = 3  # sa < 0
    g = torch.Generator(device=DEV).manual_seed(20)
    x0 = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    dy = (torch.randn(T, N, device=DEV, generator=g) * 1e-3).bfloat16()

    def run(fn, packed):
        qkb, vob, scb = (t.clone().requires_grad_() for t in (qk, vo, sc))
        x = x0.clone().requires_grad_()
        y = fn(x, packed, qkb[j * H : (j + 1) * H], vob[2 * j], scb[2 * j], dw_fp8=dw_fp8)
        y.backward(dy)
        return y, x.grad, qkb.grad[j * H : (j + 1) * H], vob.grad[2 * j], scb.grad[2 * j]

    packed = pack_qkv_fp8(qk[j * H : (j + 1) * H], vo[2 * j], sc[2 * j])
    y, dx, dqk, dv, dsa = run(packed_qkv_linear, packed)
    yr, dxr, dqkr, dvr, dsar = run(packed_qkv_linear_reference, None)
    # Our part of the forward is the quantisation of x.  The GEMM is cuBLAS, whose algorithm (and
    # so the rounding of the fast-accumulation path, which on Hopper keeps only ~14 accumulator
    # bits) can differ between two calls on equal inputs (two fast-accumulation calls have
    # differed by ~1% per element).  So: with exact accumulation, y must match the GEMM of
    # the reference's quantised x to fp32 summation order (a different quantisation of x moves y
    # by ~1e-2); with fast accumulation (the forward's setting) it is bounded against the
    # dequantised fp32 product.
    # Should the exact-accumulation check below fail at the size of a different quantisation
    # (rel ~1e-2), the bit-for-bit check of x's quantisation (both input dtypes) first says which
    # part differs.
    xq, _, xs = quantize_current_reference(x0, fp8_dtype=E4M3, transposed=False)
    for x_in in (x0, x0.float()):
        q_ours, _, s_ours = quantize_current(x_in, fp8_dtype=E4M3, transposed=False)
        differ = (q_ours.view(torch.uint8) != xq.view(torch.uint8)).sum().item()
        assert torch.equal(s_ours, xs) and differ == 0, (
            f"{x_in.dtype} x: scale {s_ours.item()!r} vs reference {xs.item()!r}, {differ} of {xq.numel()} bytes differ")
    # (fp32 in and out, so bf16 rounding of the output cannot hide or fake a difference)
    y_exact = packed_qkv_linear(x0.float(), packed, qk[j * H : (j + 1) * H], vo[2 * j], sc[2 * j], use_fast_accum=False)
    exact = scaled_mm(xq, packed.data.t(), xs, packed.scale, out_dtype=torch.float32, use_fast_accum=False)
    again = scaled_mm(xq, packed.data.t(), xs, packed.scale, out_dtype=torch.float32, use_fast_accum=False)
    assert y_exact.dtype == torch.float32 and rel(y_exact, exact) < 1e-4, (
        f"rel(ours, reference GEMM) {rel(y_exact, exact):.3e}; the reference GEMM twice: {rel(again, exact):.3e}")
    xd = xq.float() * xs
    wd = packed.data.float() * packed.scale
    assert rel(exact, xd @ wd.t()) < 1e-2
    assert rel(y, xd @ wd.t()) < 3e-2
    assert rel(y, yr) < 6e-2
    gs = dy.float().abs().amax() / 57344
    dyd = (dy.float() / gs).to(E5M2).float() * gs
    assert rel(dx, dyd @ wd) < 1e-2
    assert rel(dx, dxr) < 9e-2
    bound = 9e-2 if dw_fp8 else 1e-2
    assert rel(dqk, dqkr) < bound and rel(dv, dvr) < bound
    if dw_fp8:  # dsa = sum(dW_eff * W_packed) with dW_eff the e5m2 x e4m3 product (random data cancels a lot)
        w_packed = packed_weight_reference(qk[j * H : (j + 1) * H], vo[2 * j]).float()
        want = ((dyd.t() @ xd) * w_packed).sum()
        assert abs(dsa - want).item() / abs(want).item() < 1e-2
    else:
        assert abs(dsa - dsar).item() / abs(dsar).item() < 2e-2


@pytest.mark.parametrize("dw_fp8", [False, True])
def test_packed_linear_delayed_input_scaling_record_shape(dw_fp8):
    """x and dy with delayed scaling (model.fp8_input_scaling=delayed): after the calibrating call
    the same bounds as current scaling, and the amax the quantise kernel measured is exact."""
    from speedrun.kernels.fp8_cache import InputScaling, end_fp8_step

    qk, vo, sc = _banks(3)
    j = 3
    g = torch.Generator(device=DEV).manual_seed(21)
    x0 = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    dy = (torch.randn(T, N, device=DEV, generator=g) * 1e-3).bfloat16()
    packed = pack_qkv_fp8(qk[j * H : (j + 1) * H], vo[2 * j], sc[2 * j])

    def run(fn, **kw):
        x, w = x0.clone().requires_grad_(), qk[j * H : (j + 1) * H].clone().requires_grad_()
        y = fn(x, packed if kw else None, w, vo[2 * j], sc[2 * j], **kw)
        y.backward(dy)
        return y, x.grad, w.grad

    want = run(packed_qkv_linear_reference)
    st = InputScaling(input_scaling="delayed")
    for _ in range(3):
        got = run(packed_qkv_linear, dw_fp8=dw_fp8, inputs=st)
        end_fp8_step([st])
        for a, b, bound in zip(got, want, (6e-2, 9e-2, 9e-2 if dw_fp8 else 1e-2)):
            assert rel(a, b) < bound
        assert st.x_amax == x0.float().abs().max() and st.g_amax == dy.float().abs().max()


def test_repack_of_ten_layers_equals_each_layer_packed_at_record_shape():
    """repack_qkv_fp8 over the record's ten attention layers: each layer's bits, scales and amax
    equal pack_qkv_fp8 with its delayed scale, in the layer's own tensors (one negative sa)."""
    qk, vo, sc = _banks(3)
    src = [(qk[j * H:(j + 1) * H], vo[2 * j], sc[2 * j]) for j in range(10)]
    packs = [pack_qkv_fp8(*s, num_heads=H) for s in src]
    with torch.no_grad():
        qk.mul_(1.1)
        vo.mul_(0.95)
    want = [pack_qkv_fp8(*s, num_heads=H, scale=delayed_scale(p.amax)) for s, p in zip(src, packs)]
    ptrs = [p.data.data_ptr() for p in packs]
    repack_qkv_fp8(packs, src)
    assert ptrs == [p.data.data_ptr() for p in packs]
    for j, (p, w) in enumerate(zip(packs, want)):
        assert torch.equal(p.data.view(torch.uint8), w.data.view(torch.uint8)), j
        assert torch.equal(p.data_t.view(torch.uint8), w.data_t.view(torch.uint8)), j
        for name in ("scale", "raw_scale", "amax"):
            assert torch.equal(getattr(p, name), getattr(w, name)), (j, name)
