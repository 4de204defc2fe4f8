"""MLP kernels and the FP8 weight cache at record shapes on a CUDA GPU (sm89+ for FP8).

Run on the H200: ``python -m pytest -q -m gpu tests/gpu/test_mlp_gpu.py``.
"""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
if torch.cuda.get_device_capability() < (8, 9):
    pytest.skip("FP8 needs sm89 or newer", allow_module_level=True)

from speedrun.kernels.fp8_cache import (  # noqa: E402
    E4M3,
    E5M2,
    FP8WeightCache,
    end_fp8_step,
    StaleFP8CacheError,
    quantize_dual_layout,
    quantize_dual_layout_reference,
)
import speedrun.kernels.mlp as mlp_module  # noqa: E402
from speedrun.kernels.mlp import (  # noqa: E402
    MLPScaleState,
    relu2_gemm,
    relu2_gemm_reference,
    relu2_mlp,
    relu2_mlp_reference,
)

T, D, H = 8192, 768, 3072
DEV = "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture(params=["tma", "pointer", "split", "per-case"])
def kernel_kind(request):
    """Run a test with the TMA persistent GEMM, the pointer GEMM, the split path (cuBLAS GEMM,
    then the epilogue pass) and the module's per-case default (split for the FP8 dpre only)."""
    old = mlp_module.USE_TMA, mlp_module.DEFAULT_GEMM_IMPL
    mlp_module.USE_TMA = request.param in ("tma", "per-case")
    if request.param != "per-case":  # the route relu2_gemm takes when called without impl
        mlp_module.DEFAULT_GEMM_IMPL = dict.fromkeys(old[1], "split" if request.param == "split" else "fused")
    yield request.param
    mlp_module.USE_TMA, mlp_module.DEFAULT_GEMM_IMPL = old


def _poison(*shape, dtype):
    return torch.full(shape, float("nan"), device=DEV).to(dtype)


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_dual_layout_bit_exact(fp8_dtype):
    g = torch.Generator(device=DEV).manual_seed(1)
    bank = torch.randn(5, 2, H, D, device=DEV, generator=g).bfloat16() * 0.02
    w = bank[:, 1]  # strided batch, like one half of the MLP bank
    scale = torch.rand(5, device=DEV, generator=g) * 1e-4 + 2e-5  # some values saturate
    out, out_t = _poison(5, H, D, dtype=fp8_dtype), _poison(5, D, H, dtype=fp8_dtype)
    q, qt, amax = quantize_dual_layout(w, scale, fp8_dtype=fp8_dtype, out=out, out_t=out_t)
    rq, rqt, ramax = quantize_dual_layout_reference(w, scale, fp8_dtype=fp8_dtype)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).contiguous().view(torch.uint8))
    assert torch.equal(amax, ramax)


def _mlp_inputs(seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    w1 = (torch.randn(H, D, device=DEV, generator=g) / D**0.5).bfloat16()
    w2 = (torch.randn(D, H, device=DEV, generator=g) / H**0.5).bfloat16()
    gy = torch.randn(T, D, device=DEV, generator=g).bfloat16()
    return x, w1, w2, gy


def test_relu2_gemm_forward_bf16_and_fp8(kernel_kind):
    x, w1, _, _ = _mlp_inputs(2)
    out = _poison(T, H, dtype=torch.bfloat16)
    r = relu2_gemm(x, w1, out=out)
    ref = relu2_gemm_reference(x, w1)
    assert rel(r.out, ref.out) < 1e-2
    # FP8 operands, bf16 + e4m3 (both layouts) outputs.
    xs = x.float().abs().amax() / 448
    ws = w1.float().abs().amax() / 448
    xq, _, _ = quantize_dual_layout(x, xs)
    wq, _, _ = quantize_dual_layout(w1, ws)
    qs = ref.out.float().abs().amax() * 1.5 / 448
    kw = dict(a_scale=xs, b_scale=ws, q_dtype=E4M3, q_scale=qs, emit_transposed=True)
    r = relu2_gemm(
        xq, wq, out=_poison(T, H, dtype=torch.bfloat16), out_q=_poison(T, H, dtype=E4M3),
        out_qt=_poison(H, T, dtype=E4M3), amax=torch.zeros((), device=DEV), **kw,
    )
    rr = relu2_gemm_reference(xq, wq, amax=torch.zeros((), device=DEV), **kw)
    assert rel(r.out, rr.out) < 1e-2
    assert rel(r.q.float(), rr.q.float()) < 2e-2  # a few near-ties round to the other neighbour
    assert torch.equal(r.qt.view(torch.uint8), r.q.t().contiguous().view(torch.uint8))
    assert abs(r.amax.item() - rr.amax.item()) / rr.amax.item() < 1e-2


def test_relu2_gemm_backward_fp8_aux(kernel_kind):
    x, w1, w2, gy = _mlp_inputs(3)
    post = relu2_gemm_reference(x, w1).out
    ref = relu2_gemm_reference(gy, w2.t(), aux=post)
    r = relu2_gemm(gy, w2.t(), aux=post, out=_poison(T, H, dtype=torch.bfloat16))
    assert rel(r.out, ref.out) < 1e-2
    ps = post.float().amax() / 448
    pq, _, _ = quantize_dual_layout(post, ps)
    gs = gy.float().abs().amax() / 57344
    gq, _, _ = quantize_dual_layout(gy, gs, fp8_dtype=E5M2)
    w2s = w2.float().abs().amax() / 448
    _, w2qt, _ = quantize_dual_layout(w2, w2s)
    ds = ref.out.float().abs().amax() * 2 / 57344
    kw = dict(aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, q_dtype=E5M2, q_scale=ds, emit_transposed=True)
    r = relu2_gemm(gq, w2qt, store_out=False, out_q=_poison(T, H, dtype=E5M2), out_qt=_poison(H, T, dtype=E5M2), **kw)
    rr = relu2_gemm_reference(gq, w2qt, store_out=False, **kw)
    assert rel(r.q.float(), rr.q.float()) < 3e-2
    assert torch.equal(r.qt.view(torch.uint8), r.q.t().contiguous().view(torch.uint8))
    assert rel(r.q.float() * ds, ref.out) < 0.12  # e5m2 (2 mantissa bits) of g and dpre, e4m3 post/w2


@pytest.mark.parametrize("t", [T, 49152, T + 40])  # record stage-3 micro-batch; a ragged last M tile
def test_tma_epilogue_at_record_shapes(t, monkeypatch):
    """impl="tma" (persistent, epilogue through TMA in half tiles) on the record's uses (the FP8
    forward: bf16 + e4m3 post, amax; the bf16 dpre with the bank's K-major (H, D) w2) and the
    candidate's (e4m3 post and e5m2 dpre in both layouts; the FP8 dpre row-major): every output
    written (poisoned), against the fp32 reference and against the pointer epilogue, the two FP8
    layouts transposes of each other; and the TMA kernel must actually have run."""
    calls = []
    real = mlp_module._launch_tma_store
    monkeypatch.setattr(mlp_module, "_launch_tma_store", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    g = torch.Generator(device=DEV).manual_seed(7)
    x = torch.randn(t, D, device=DEV, generator=g).bfloat16()
    w1 = (torch.randn(H, D, device=DEV, generator=g) / D**0.5).bfloat16()
    w2_hd = (torch.randn(H, D, device=DEV, generator=g) / H**0.5).bfloat16()
    gy = torch.randn(t, D, device=DEV, generator=g).bfloat16()
    if t % 16 == 0:
        xs, ws = x.float().abs().amax() / 448, w1.float().abs().amax() / 448
        xq, _, _ = quantize_dual_layout(x, xs)
        wq, _, _ = quantize_dual_layout(w1, ws)
        ref = relu2_gemm_reference(xq, wq, a_scale=xs, b_scale=ws)
        qs = ref.out.float().amax() * 0.8 / 448  # the top values saturate
        kw = dict(a_scale=xs, b_scale=ws, q_dtype=E4M3, q_scale=qs)
        r = relu2_gemm(xq, wq, out=_poison(t, H, dtype=torch.bfloat16), out_q=_poison(t, H, dtype=E4M3),
                       amax=torch.zeros((), device=DEV), impl="tma", **kw)
        rf = relu2_gemm(xq, wq, amax=torch.zeros((), device=DEV), impl="fused", **kw)
        rr = relu2_gemm_reference(xq, wq, amax=torch.zeros((), device=DEV), **kw)
        assert rel(r.out, rr.out) < 1e-2 and rel(r.out, rf.out) < 1e-2
        assert rel(r.q.float(), rr.q.float()) < 2e-2 and r.q.float().max() == 448
        assert abs(r.amax.item() - rr.amax.item()) / rr.amax.item() < 1e-2
        post, pq = r.out, r.q
    else:
        post = relu2_gemm_reference(x, w1).out
        r = relu2_gemm(x, w1, out=_poison(t, H, dtype=torch.bfloat16), impl="tma")
        assert rel(r.out, post) < 1e-2
    ref_d = relu2_gemm_reference(gy, w2_hd, aux=post)
    d = relu2_gemm(gy, w2_hd, aux=post, out=_poison(t, H, dtype=torch.bfloat16), impl="tma")
    assert rel(d.out, ref_d.out) < 1e-2
    assert rel(d.out, relu2_gemm(gy, w2_hd, aux=post, impl="fused").out) < 1e-2
    if t % 16 == 0:
        gs = gy.float().abs().amax() / 57344
        gq, _, _ = quantize_dual_layout(gy, gs, fp8_dtype=E5M2)
        w2s = w2_hd.float().abs().amax() / 448
        w2q, _, _ = quantize_dual_layout(w2_hd, w2s)
        ds = ref_d.out.float().abs().amax() * 2 / 57344
        kw = dict(aux=pq, aux_scale=qs, a_scale=gs, b_scale=w2s, q_dtype=E5M2, q_scale=ds, store_out=False)
        r = relu2_gemm(gq, w2q, out_q=_poison(t, H, dtype=E5M2), amax=torch.zeros((), device=DEV), impl="tma", **kw)
        rr = relu2_gemm_reference(gq, w2q, amax=torch.zeros((), device=DEV), **kw)
        assert rel(r.q.float(), rr.q.float()) < 3e-2
        assert abs(r.amax.item() - rr.amax.item()) / rr.amax.item() < 1e-2
        # fp8_full: both layouts from one tile (the transposed half boxes through TMA)
        r = relu2_gemm(gq, w2q, out_q=_poison(t, H, dtype=E5M2), out_qt=_poison(H, t, dtype=E5M2), emit_transposed=True,
                       amax=torch.zeros((), device=DEV), impl="tma", **kw)
        assert rel(r.q.float(), rr.q.float()) < 3e-2
        assert torch.equal(r.qt.view(torch.uint8), r.q.t().contiguous().view(torch.uint8))
        kw = dict(a_scale=xs, b_scale=ws, q_dtype=E4M3, q_scale=qs, store_out=False, emit_transposed=True)
        r = relu2_gemm(xq, wq, out_q=_poison(t, H, dtype=E4M3), out_qt=_poison(H, t, dtype=E4M3),
                       amax=torch.zeros((), device=DEV), impl="tma", **kw)
        rr = relu2_gemm_reference(xq, wq, amax=torch.zeros((), device=DEV), **kw)
        assert rel(r.q.float(), rr.q.float()) < 2e-2
        assert torch.equal(r.qt.view(torch.uint8), r.q.t().contiguous().view(torch.uint8))
        assert abs(r.amax.item() - rr.amax.item()) / rr.amax.item() < 1e-2
    assert len(calls) == (5 if t % 16 == 0 else 2)


@pytest.mark.parametrize("mode,bound_y,bound_g", [("bf16", 1e-2, 1e-2), ("fp8_fwd", 8e-2, 8e-2), ("fp8_full", 8e-2, 0.12)])
def test_relu2_mlp_modes_record_shape(mode, bound_y, bound_g, kernel_kind):
    x, w1, w2, gy = _mlp_inputs(4)
    xs, w1s, w2s = (t.clone().requires_grad_() for t in (x, w1, w2))
    y_ref = relu2_mlp_reference(xs, w1s, w2s)
    y_ref.backward(gy)
    cache = None
    if mode != "bf16":
        c = FP8WeightCache()
        c.refresh({"w1": w1, "w2": w2})
        cache = (c.get("w1"), c.get("w2"))
    state = MLPScaleState.create(DEV)
    xk, w1k, w2k = (t.clone().requires_grad_() for t in (x, w1, w2))
    for _ in range(2):  # second call uses the delayed scales measured by the first
        xk.grad = w1k.grad = w2k.grad = None
        y = relu2_mlp(xk, w1k, w2k, mode=mode, cache=cache, scales=state)
        y.backward(gy)
        end_fp8_step([state])
    assert torch.isfinite(y).all()
    assert rel(y, y_ref) < bound_y
    assert rel(xk.grad, xs.grad) < bound_g
    assert rel(w1k.grad, w1s.grad) < bound_g
    assert rel(w2k.grad, w2s.grad) < bound_g


def test_weight_cache_update_cycle():
    g = torch.Generator(device=DEV).manual_seed(5)
    bank = torch.nn.Parameter((torch.randn(11, 2, H, D, device=DEV, generator=g) * 0.02).bfloat16())
    cache = FP8WeightCache(bootstrap_refreshes=1)
    cache.refresh({"w1": bank[:, 0], "w2": bank[:, 1]})
    e = cache.get("w1")
    assert tuple(e.data.shape) == (11, H, D) and tuple(e.data_t.shape) == (11, D, H)
    with torch.no_grad():
        bank.mul_(1.01)  # an "optimizer update"
    with pytest.raises(StaleFP8CacheError):
        cache.get("w1")
    cache.refresh({"w1": bank[:, 0], "w2": bank[:, 1]})  # delayed scale: previous amax x 1.12
    e = cache.get("w2")
    deq = e.data.float() * e.scale[:, None, None]
    assert rel(deq, bank[:, 1].detach()) < 4e-2
    assert not cache.saturated("w2").any()


def test_mlp_uses_per_layer_views_of_a_cached_bank():
    """Per-matrix scales come out as 0-d views; _scaled_mm must accept them (alignment)."""
    g = torch.Generator(device=DEV).manual_seed(6)
    bank = (torch.randn(4, 2, H, D, device=DEV, generator=g) / D**0.5).bfloat16()  # W2 stored (H, D)
    cache = FP8WeightCache()
    cache.refresh({"w1": bank[:, 0], "w2": bank[:, 1]})
    x, _, _, gy = _mlp_inputs(7)
    layer = 2
    w1, w2 = bank[layer, 0], bank[layer, 1].t()
    pair = (cache.get("w1")[layer], cache.get("w2")[layer].t())
    xs, w1s, w2s = (t.clone().requires_grad_() for t in (x, w1, w2))
    relu2_mlp_reference(xs, w1s, w2s).backward(gy)
    xk, w1k, w2k = (t.clone().requires_grad_() for t in (x, w1, w2))
    y = relu2_mlp(xk, w1k, w2k, mode="fp8_full", cache=pair)
    y.backward(gy)
    assert rel(y, relu2_mlp_reference(x, w1, w2)) < 8e-2
    for got, want in ((xk.grad, xs.grad), (w1k.grad, w1s.grad), (w2k.grad, w2s.grad)):
        assert rel(got, want) < 0.12


@pytest.mark.parametrize("shape", [(49152, 768), (49152, 1920), (1000, 17)])
def test_abs_max_exact_at_record_shapes(shape):
    from speedrun.kernels.fp8_cache import abs_max, abs_max_reference

    g = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(shape, device=DEV, generator=g).bfloat16()
    x.view(-1)[x.numel() // 3] = -40.0
    out = abs_max(x)
    assert torch.equal(out, abs_max_reference(x)) and out == 40.0
    x.view(-1)[7] = float("nan")
    assert abs_max(x).isnan()


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("shape", [(49152, 768), (49152, 3072)])
def test_quantize_current_bitwise_at_record_shapes(shape, fp8_dtype):
    """Current scaling with the scale derived inside the quantise kernel (the MLP's x and g, the
    packed QKV's x and dy): same bits as the PyTorch reference, both layouts."""
    from speedrun.kernels.fp8_cache import quantize_current, quantize_current_reference

    g = torch.Generator(device=DEV).manual_seed(sum(shape))
    x = (torch.randn(shape, device=DEV, generator=g) * 3e-3).bfloat16()
    q, qt, s = quantize_current(x, fp8_dtype=fp8_dtype)
    rq, rqt, rs = quantize_current_reference(x, fp8_dtype=fp8_dtype)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(qt.view(torch.uint8), rqt.view(torch.uint8))


def test_quantize_current_reduces_every_programs_partial_at_record_shape():
    """The abs-max pass leaves one maximum per program (528 on an H200) for the quantise kernel to
    reduce: a maximum in the last program's range and a NaN in a middle one both reach the scale."""
    from speedrun.kernels.fp8_cache import abs_max_partials, quantize_current, quantize_current_reference

    x = (torch.randn(49152, 768, device=DEV, generator=torch.Generator(device=DEV).manual_seed(5)) * 0.1).bfloat16()
    parts = abs_max_partials(x)
    assert parts.numel() > 100 and torch.isfinite(parts).all()
    x.view(-1)[-1] = -75.0
    q, _, s = quantize_current(x)
    rq, _, rs = quantize_current_reference(x)
    assert torch.equal(s, rs) and s.item() == pytest.approx(75.0 / 448)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    x.view(-1)[x.numel() // 2] = float("nan")
    assert quantize_current(x)[2].isnan()


def test_quantize_current_graph_fuses_into_the_norm_at_record_shape():
    """model.mlp_input_quant=graph as Inductor compiles it on the GPU: the amax joins the RMS
    norm's kernel (no separate pass over the normed tensor), and the bytes follow the reference's
    on the compiled norm output to within one e4m3 step.  Not bit for bit: Inductor divides
    approximately (div.full.f32), and inside one kernel it may quantise the norm's fp32 value
    without first rounding it to the bf16 it stores (``emulate_precision_casts`` is off), which
    moves the amax by up to 2**-9 and flips bytes near e4m3 rounding boundaries (~1 in 16)."""
    from torch._inductor.utils import run_and_get_code

    from speedrun.kernels.fp8_cache import quantize_current_graph, quantize_current_reference

    torch._dynamo.reset()

    def norm_then_quantise(x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],))
        q, _, s = quantize_current_graph(h, transposed=False)
        return h, q, s

    g = torch.Generator(device=DEV).manual_seed(17)
    x = (torch.randn(49152, 768, device=DEV, generator=g) * (1 + 4 * torch.rand(49152, 1, device=DEV, generator=g))).bfloat16()
    (h, q, s), code = run_and_get_code(torch.compile(norm_then_quantise, fullgraph=True), x)
    rq, _, rs = quantize_current_reference(h, transposed=False)
    assert abs(s.item() / rs.item() - 1) < 2**-8, (s.item(), rs.item())
    same = (q.view(torch.uint8) == rq.view(torch.uint8)).float().mean().item()
    assert same > 0.85, same
    # one e4m3 step at most (relative 2**-3 among normals, 2**-9 units among subnormals)
    assert ((q.float() - rq.float()).abs() <= rq.float().abs() * 0.126 + 2**-9).all()
    kernels = re.findall(r"async_compile\.triton\('(\w+)', '''(.*?)'''", "\n".join(code), re.S)
    assert kernels, "no Triton kernel found in Inductor's output:\n" + "\n".join(code)[:2000]
    fused = [name for name, src in kernels if "rsqrt" in src and "abs" in src]
    assert fused, f"amax not fused into the norm: {[name for name, _ in kernels]}"


@pytest.mark.parametrize("mode", ["fp8_fwd", "fp8_full"])
def test_mlp_delayed_input_scaling_at_record_shapes(mode):
    """x and g quantised with the previous call's amax (no amax pass): the same bounds as current
    scaling after the calibrating first call, and the measured amax is exact."""
    from speedrun.kernels.mlp import MLPScaleState

    x, w1, w2, gy = _mlp_inputs(11)
    cache = FP8WeightCache()
    cache.refresh({"w1": w1, "w2": w2})
    pair = (cache.get("w1"), cache.get("w2"))
    xs, w1s, w2s = (t.clone().requires_grad_() for t in (x, w1, w2))
    relu2_mlp_reference(xs, w1s, w2s).backward(gy)
    state = MLPScaleState.create(DEV, input_scaling="delayed")
    for _ in range(3):
        xk, w1k, w2k = (t.clone().requires_grad_() for t in (x, w1, w2))
        y = relu2_mlp(xk, w1k, w2k, mode=mode, cache=pair, scales=state)
        y.backward(gy)
        end_fp8_step([state])
        assert rel(y, relu2_mlp_reference(x, w1, w2)) < 8e-2
        for got, want in ((xk.grad, xs.grad), (w1k.grad, w1s.grad), (w2k.grad, w2s.grad)):
            assert rel(got, want) < (0.12 if mode == "fp8_full" else 8e-2)
        assert state.x_amax == x.float().abs().max()


def test_bank_gradient_accumulates_in_the_gemm_at_record_shapes():
    """model.mlp_weight_grad=accumulate's GEMMs at a record layer's slot ((3072, 768) from T = 8192
    tokens, bf16): the first product overwrites a NaN-poisoned slot (beta = 0 never reads it), the
    next three add inside the GEMM (beta = 1), and the sum is within bf16 of the fp32 sum."""
    from speedrun.model.bank_grad import MLPBankGradAccumulator

    g = torch.Generator(device=DEV).manual_seed(0)
    bank = torch.nn.Parameter(torch.zeros(2, 2, H, D, device=DEV, dtype=torch.bfloat16))
    acc = MLPBankGradAccumulator(bank)
    acc._buffer().fill_(float("nan"))
    ops = [(torch.randn(T, H, device=DEV, generator=g).bfloat16().t(),
            torch.randn(T, D, device=DEV, generator=g).bfloat16()) for _ in range(4)]
    for a, b in ops:
        acc.add_product(1, 0, a, b)
    acc.buffer[0].zero_()
    acc.buffer[1, 1].zero_()
    acc.flush()
    exact = sum(a.float() @ b.float() for a, b in ops)
    got = bank.grad[1, 0].float()
    assert torch.isfinite(got).all()
    rel = (got - exact).norm() / exact.norm()
    assert rel < 1e-2, rel.item()
