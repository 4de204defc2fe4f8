"""The fused ReLU² GEMM kernels (Triton, CPU interpreter) and the relu2_mlp autograd function.

Shapes are small (T=64, D=64, H=256) so the interpreter stays fast.  Kernel tests need
``TRITON_INTERPRET=1`` (set by .ci/run) or CUDA; without either the code falls back to its
references and the kernel comparisons would be vacuous, so they skip.

Documented error bounds (relative Frobenius error vs the fp32-math reference):
  bf16 kernels and the bf16 MLP: < 1e-2.
  fp8_fwd: output < 8e-2 (x, w1, w2, post each e4m3: ~2-3% rms each), gradients < 8e-2 (bf16
           backward of a post that carries the forward's FP8 error).
  fp8_full: output < 8e-2, gradients < 0.12: g and dpre are e5m2 (2 mantissa bits, ~4-5% rms
           rounding each), and dx/dW1 multiply two such factors.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.fp8_cache import E4M3, E5M2, FP8WeightCache, end_fp8_step, interpreting, quantize_current
from speedrun.kernels.mlp import (
    MLPScaleState,
    relu2_gemm,
    relu2_gemm_reference,
    relu2_mlp,
    relu2_mlp_reference,
)

needs_kernel = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or CUDA to run the Triton kernels"
)
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
T, D, H = 64, 64, 256


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def nan_like(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV).to(dtype)


def inputs(seed, t=T, d=D, h=H):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g).bfloat16().to(DEV)
    w1 = (torch.randn(h, d, generator=g) / d**0.5).bfloat16().to(DEV)
    w2 = (torch.randn(d, h, generator=g) / h**0.5).bfloat16().to(DEV)
    gy = torch.randn(t, d, generator=g).bfloat16().to(DEV)
    return x, w1, w2, gy


@needs_kernel
@pytest.mark.parametrize("t,d", [(64, 64), (40, 48)])  # (40, 48): ragged M tile and K not a multiple of BLOCK_K
@pytest.mark.parametrize("impl", ["fused", "tma", "split"])
def test_gemm_forward_bf16(t, d, impl):
    x, w1, _, _ = inputs(1, t, d)
    r = relu2_gemm(x, w1, out=nan_like((t, H), torch.bfloat16), impl=impl)
    ref = relu2_gemm_reference(x, w1)
    assert rel(r.out, ref.out) < 1e-2
    assert r.q is None and r.qt is None


@needs_kernel
@pytest.mark.parametrize("impl", ["fused", "tma", "split"])
def test_gemm_forward_fp8_emits_both_layouts_and_amax(impl):
    x, w1, _, _ = inputs(2)
    xq, _, xs = quantize_current(x, transposed=False)
    wq, _, ws = quantize_current(w1, transposed=False)
    post_ref = relu2_gemm_reference(xq, wq, a_scale=xs, b_scale=ws).out
    qs = post_ref.float().amax() * 0.7 / 448  # scale below the amax: the top values saturate
    kw = dict(a_scale=xs, b_scale=ws, q_dtype=E4M3, q_scale=qs, emit_transposed=True)
    r = relu2_gemm(
        xq, wq, out=nan_like((T, H), torch.bfloat16), out_q=nan_like((T, H), E4M3), out_qt=nan_like((H, T), E4M3),
        amax=torch.zeros((), device=DEV), impl=impl, **kw,
    )
    rr = relu2_gemm_reference(xq, wq, amax=torch.zeros((), device=DEV), **kw)
    assert rel(r.out, rr.out) < 1e-2
    assert rel(r.q, rr.q) < 2e-2  # fp32 sums in another order: a rare tie rounds the other way
    assert torch.equal(r.qt.view(torch.uint8), r.q.t().contiguous().view(torch.uint8))
    assert r.q.float().max() == 448  # saturated, finite
    assert torch.isclose(r.amax, post_ref.float().amax(), rtol=1e-2)


@needs_kernel
@pytest.mark.parametrize("impl", ["fused", "tma", "split"])
def test_gemm_backward_bf16_rebuilds_relu_from_post(impl):
    x, w1, w2, gy = inputs(3)
    post = relu2_gemm_reference(x, w1).out
    r = relu2_gemm(gy, w2.t(), aux=post, out=nan_like((T, H), torch.bfloat16), impl=impl)
    ref = relu2_gemm_reference(gy, w2.t(), aux=post)
    assert rel(r.out, ref.out) < 1e-2
    # The math: dpre = (g @ w2) * 2 relu(pre), relu(pre) = sqrt(post).
    pre = x.float() @ w1.float().t()
    assert rel(r.out, (gy.float() @ w2.float()) * 2 * torch.relu(pre)) < 2e-2


@needs_kernel
@pytest.mark.parametrize("impl", ["fused", "tma", "split"])
def test_gemm_backward_fp8_e5m2_both_layouts(impl):
    x, w1, w2, gy = inputs(4)
    post = relu2_gemm_reference(x, w1).out
    pq, _, ps = quantize_current(post, transposed=False)
    gq, _, gs = quantize_current(gy, fp8_dtype=E5M2, transposed=False)
    w2q, w2qt, w2s = quantize_current(w2)
    dref = relu2_gemm_reference(gy, w2.t(), aux=post).out
    ds = dref.float().abs().amax() * 2 / 57344
    kw = dict(aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, q_dtype=E5M2, q_scale=ds, emit_transposed=True)
    r = relu2_gemm(gq, w2qt, store_out=False, out_q=nan_like((T, H), E5M2), out_qt=nan_like((H, T), E5M2),
                   impl=impl, **kw)
    rr = relu2_gemm_reference(gq, w2qt, store_out=False, **kw)
    assert r.out is None
    assert rel(r.q, rr.q) < 3e-2
    assert torch.equal(r.qt.view(torch.uint8), r.q.t().contiguous().view(torch.uint8))
    assert rel(r.q.float() * ds, dref) < 0.12


@pytest.fixture
def tma_store_launches(monkeypatch):
    """Counts launches of the TMA-epilogue kernel (impl="tma" may fall back to "fused")."""
    from speedrun.kernels import mlp

    calls = []
    real = mlp._launch_tma_store
    monkeypatch.setattr(mlp, "_launch_tma_store", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


@needs_kernel
def test_tma_epilogue_equals_the_pointer_epilogue_bitwise(tma_store_launches):
    """impl="tma" (descriptor loads of post, descriptor stores in half tiles, one amax atomic per
    program) computes exactly what the pointer epilogue computes: same bytes in every output,
    all of them written (outputs poisoned), same amax.  Ragged M (40 rows) and K (48) included."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(40, 48, generator=g).bfloat16().to(DEV)
    w1 = (torch.randn(H, 48, generator=g) / 7).bfloat16().to(DEV)
    outs = {impl: relu2_gemm(x, w1, out=nan_like((40, H), torch.bfloat16), impl=impl).out for impl in ("fused", "tma")}
    assert torch.equal(outs["fused"], outs["tma"])

    x, w1, w2, gy = inputs(12)
    xq, _, xs = quantize_current(x, transposed=False)
    wq, _, ws = quantize_current(w1, transposed=False)
    qs = relu2_gemm_reference(xq, wq, a_scale=xs, b_scale=ws).out.float().amax() * 0.7 / 448  # some saturate
    fwd = {}
    for impl in ("fused", "tma"):
        r = relu2_gemm(xq, wq, a_scale=xs, b_scale=ws, q_dtype=E4M3, q_scale=qs, amax=torch.zeros((), device=DEV),
                       out=nan_like((T, H), torch.bfloat16), out_q=nan_like((T, H), E4M3), impl=impl)
        fwd[impl] = r
    assert torch.equal(fwd["fused"].out, fwd["tma"].out)
    assert torch.equal(fwd["fused"].q.view(torch.uint8), fwd["tma"].q.view(torch.uint8))
    assert torch.equal(fwd["fused"].amax, fwd["tma"].amax) and fwd["tma"].amax > 0

    post, pq = fwd["fused"].out, fwd["fused"].q
    w2_hd = w2.t().contiguous()  # (H, D): the K-major layout the record's bank gives the dpre GEMM
    bwd = {impl: relu2_gemm(gy, w2_hd, aux=post, out=nan_like((T, H), torch.bfloat16), impl=impl).out
           for impl in ("fused", "tma")}
    assert torch.equal(bwd["fused"], bwd["tma"])

    gq, _, gs = quantize_current(gy, fp8_dtype=E5M2, transposed=False)
    w2q, _, w2s = quantize_current(w2_hd, transposed=False)
    ds = bwd["fused"].float().abs().amax() * 2 / 57344
    fp8_bwd = {impl: relu2_gemm(gq, w2q, aux=pq, aux_scale=qs, a_scale=gs, b_scale=w2s, store_out=False, q_dtype=E5M2,
                                q_scale=ds, amax=torch.zeros((), device=DEV), out_q=nan_like((T, H), E5M2), impl=impl)
               for impl in ("fused", "tma")}
    assert torch.equal(fp8_bwd["fused"].q.view(torch.uint8), fp8_bwd["tma"].q.view(torch.uint8))
    assert torch.equal(fp8_bwd["fused"].amax, fp8_bwd["tma"].amax)

    # fp8_full: post only as e4m3 in both layouts (forward), dpre as e5m2 in both (backward)
    both = {impl: relu2_gemm(xq, wq, a_scale=xs, b_scale=ws, store_out=False, q_dtype=E4M3, q_scale=qs,
                             emit_transposed=True, amax=torch.zeros((), device=DEV), out_q=nan_like((T, H), E4M3),
                             out_qt=nan_like((H, T), E4M3), impl=impl) for impl in ("fused", "tma")}
    both_bwd = {impl: relu2_gemm(gq, w2q, aux=pq, aux_scale=qs, a_scale=gs, b_scale=w2s, store_out=False,
                                 q_dtype=E5M2, q_scale=ds, emit_transposed=True, amax=torch.zeros((), device=DEV),
                                 out_q=nan_like((T, H), E5M2), out_qt=nan_like((H, T), E5M2), impl=impl)
                for impl in ("fused", "tma")}
    for r in (both, both_bwd):
        assert torch.equal(r["fused"].q.view(torch.uint8), r["tma"].q.view(torch.uint8))
        assert torch.equal(r["fused"].qt.view(torch.uint8), r["tma"].qt.view(torch.uint8))
        assert torch.equal(r["tma"].qt.view(torch.uint8), r["tma"].q.t().contiguous().view(torch.uint8))
        assert torch.equal(r["fused"].amax, r["tma"].amax)
    assert len(tma_store_launches) == 6


@needs_kernel
def test_tma_epilogue_falls_back_where_tma_cannot_store(tma_store_launches):
    """An output TMA cannot address (transposed rows of 40 bytes: not a multiple of 16) or an
    operand that is not K-major runs the pointer epilogue under impl="tma", same result."""
    x, w1, w2, gy = inputs(13)
    xq = (x[:40] * 4).to(E4M3)
    wq, _, ws = quantize_current(w1, transposed=False)
    one = torch.tensor(0.25, device=DEV)
    kw = dict(a_scale=one, b_scale=ws, q_dtype=E4M3, q_scale=torch.tensor(0.05, device=DEV), emit_transposed=True)
    r = relu2_gemm(xq, wq, amax=torch.zeros((), device=DEV), impl="tma", **kw)
    rf = relu2_gemm(xq, wq, amax=torch.zeros((), device=DEV), impl="fused", **kw)
    assert torch.equal(r.qt.view(torch.uint8), rf.qt.view(torch.uint8))
    post = relu2_gemm_reference(x, w1).out
    r = relu2_gemm(gy, w2.t(), aux=post, impl="tma")  # w2.t(): strided, not TMA-ready
    assert torch.equal(r.out, relu2_gemm(gy, w2.t(), aux=post, impl="fused").out)
    assert tma_store_launches == []


def test_gemm_rejects_bad_shapes_and_dtypes():
    a = torch.randn(64, 40).bfloat16()
    with pytest.raises(ValueError, match=r"\(64, 40\)"):
        relu2_gemm(a, torch.randn(64, 40).bfloat16())
    with pytest.raises(ValueError, match="both be FP8"):
        relu2_gemm(torch.randn(64, 64).to(E4M3), torch.randn(64, 64).bfloat16())
    with pytest.raises(ValueError, match="a_scale"):
        relu2_gemm(torch.randn(64, 64).to(E4M3), torch.randn(64, 64).to(E4M3))
    with pytest.raises(ValueError, match="emit_transposed"):
        relu2_gemm(torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16(), emit_transposed=True)
    with pytest.raises(ValueError, match="impl must be"):
        relu2_gemm(torch.randn(64, 64).bfloat16(), torch.randn(64, 64).bfloat16(), impl="cublas")


# ---------------------------------------------------------------------------------------------
# relu2_mlp


def _run(mode, x, w1, w2, gy, cache=None, calls=2, input_scaling="current", gemm=None):
    state = MLPScaleState.create(DEV, input_scaling=input_scaling)
    xk, w1k, w2k = (t.clone().requires_grad_() for t in (x, w1, w2))
    for _ in range(calls):  # later calls use the delayed scales measured by the earlier ones
        xk.grad = w1k.grad = w2k.grad = None
        y = relu2_mlp(xk, w1k, w2k, mode=mode, cache=cache, scales=state, gemm=gemm)
        y.backward(gy)
        end_fp8_step([state])  # as the training step does after the optimizer update
    return y.detach(), xk.grad, w1k.grad, w2k.grad, state


def _reference(x, w1, w2, gy):
    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
    y = relu2_mlp_reference(xr, w1r, w2r)
    y.backward(gy)
    return y.detach(), xr.grad, w1r.grad, w2r.grad


@needs_kernel
@pytest.mark.parametrize("impl", ["fused", "split", "per-case"])
@pytest.mark.parametrize("mode,bound_y,bound_g", [("bf16", 1e-2, 1e-2), ("fp8_fwd", 8e-2, 8e-2), ("fp8_full", 8e-2, 0.12)])
def test_mlp_forward_backward_vs_reference(mode, bound_y, bound_g, impl, monkeypatch):
    from speedrun.kernels import mlp

    gemm = None if impl == "per-case" else impl  # per-case: the default per direction and dtype
    x, w1, w2, gy = inputs(5)
    ref = _reference(x, w1, w2, gy)
    y, dx, dw1, dw2, state = _run(mode, x, w1, w2, gy, gemm=gemm)
    assert rel(y, ref[0]) < bound_y
    for got, want in zip((dx, dw1, dw2), ref[1:]):
        assert got.dtype == torch.bfloat16
        assert rel(got, want) < bound_g
    if mode != "bf16":
        # The delayed post scale tracks this call's amax of relu(x w1^T)^2.
        post_amax = (torch.relu(x.float() @ w1.float().t()) ** 2).amax()
        assert state.post_ready and torch.isclose(state.post_amax, post_amax, rtol=0.1)
    if mode == "fp8_full":
        assert state.dpre_ready and state.dpre_amax > 0


@needs_kernel
@pytest.mark.parametrize("mode", ["bf16", "fp8_full"])
def test_mlp_never_saves_the_pre_activation(mode):
    t = 32  # T != D, so (T, H) shapes cannot be confused with a weight's (D, H)
    x, w1, w2, _ = inputs(6, t=t)
    saved = []

    def pack(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    xk = x.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        relu2_mlp(xk, w1, w2, mode=mode)
    hidden = [dt for shape, dt in saved if shape in ((t, H), (H, t))]
    if mode == "bf16":
        assert hidden == [torch.bfloat16]  # post only
    else:
        assert hidden == [E4M3, E4M3]  # post in two FP8 layouts, nothing in 16 bits
    if mode == "fp8_full":  # x is kept only as its transposed e4m3 copy
        assert [dt for shape, dt in saved if shape in ((t, D), (D, t))] == [E4M3]


@needs_kernel
def test_mlp_with_weight_cache_matches_on_the_fly_quantisation():
    x, w1, w2, gy = inputs(7)
    bank = torch.stack([w1, w2.t().contiguous()])  # W2 stored (H, D) like the record's bank
    cache = FP8WeightCache()
    cache.refresh({"mlp": bank})
    c = cache.get("mlp")
    pair = (c[0], c[1].t())  # (H, D) and, transposed for free, (D, H)
    a = _run("fp8_full", x, w1, w2, gy, cache=pair, calls=1)
    b = _run("fp8_full", x, w1, w2, gy, cache=None, calls=1)
    for u, v in zip(a[:4], b[:4]):
        assert torch.equal(u, v)  # bootstrap refresh = current scaling = the no-cache path


def test_mlp_rejects_unsupported_inputs():
    x, w1, w2, _ = inputs(8)
    with pytest.raises(ValueError, match=r"\(64, 40\)"):
        relu2_mlp(torch.randn(64, 40).bfloat16(), torch.randn(256, 40).bfloat16(), torch.randn(40, 256).bfloat16())
    with pytest.raises(ValueError, match=r"\(40, 64\)"):
        relu2_mlp(x[:40], w1, w2, mode="fp8_full")
    with pytest.raises(ValueError, match="float32"):
        relu2_mlp(x.float(), w1, w2)
    with pytest.raises(ValueError, match="mode"):
        relu2_mlp(x, w1, w2, mode="fp4")
    with pytest.raises(ValueError, match="w2"):
        relu2_mlp(x, w1, w2.t())
    cache = FP8WeightCache()
    cache.refresh({"w1": w1, "w2": w2})
    with pytest.raises(ValueError, match="bf16"):
        relu2_mlp(x, w1, w2, mode="bf16", cache=(cache.get("w1"), cache.get("w2")))
    with pytest.raises(ValueError, match="cache layouts"):
        relu2_mlp(x, w1, w2, mode="fp8_fwd", cache=(cache.get("w1"), cache.get("w2").t()))


def test_mlp_reference_matches_autograd_definition():
    x, w1, w2, _ = inputs(9)
    y = relu2_mlp_reference(x, w1, w2)
    want = (torch.relu(x.double() @ w1.double().t()) ** 2) @ w2.double().t()
    assert y.dtype == torch.bfloat16 and rel(y, want) < 1e-2


def test_default_gemm_impl_per_direction_and_dtype():
    from speedrun.kernels import mlp

    table = {("up", True): "fused", ("up", False): "fused", ("dpre", True): "split", ("dpre", False): "fused"}
    assert mlp.default_gemm_impl(forward=False, fp8=True, routes=table) == "split"
    assert mlp.default_gemm_impl(forward=True, fp8=True, routes=table) == "fused"
    assert mlp.default_gemm_impl(forward=True, fp8=False, routes="split") == "split"
    assert mlp.default_gemm_impl(forward=False, fp8=True) == mlp.DEFAULT_GEMM_IMPL[("dpre", True)]


def test_train_mlp_gemm_travels_in_the_kernel_options(monkeypatch):
    """train.mlp_gemm: one route for every relu2_gemm call of the installed MLP, or "auto" (None:
    the per-case default); bad names refused.  Each model carries its own, so bench arms in one
    process need nothing re-applied."""
    from speedrun.errors import ConfigError
    from speedrun.kernels import mlp as mlp_module
    from speedrun.kernels.options import KernelOptions
    from speedrun.model.kernel_hooks import FusedMLP, set_kernel_options

    assert KernelOptions(mlp_gemm="fused").mlp_gemm_route == "fused"
    assert KernelOptions().mlp_gemm_route is None
    with pytest.raises(ConfigError, match="train.mlp_gemm must be one of auto, fused, tma, split"):
        KernelOptions(mlp_gemm="cublas")
    seen = []
    monkeypatch.setattr(mlp_module, "relu2_mlp_forward", lambda ctx, *a, **k: seen.append(k["gemm"]) or [None])
    a, b = FusedMLP("bf16"), FusedMLP("bf16")
    set_kernel_options([None, a], KernelOptions(mlp_gemm="split"))
    for m in (a, b):
        m._forward(None, [torch.zeros(1), torch.zeros(1), torch.zeros(1)], -1, None)
    assert seen == ["split", None]


@needs_kernel
@pytest.mark.parametrize("mode,bound_g", [("fp8_fwd", 8e-2), ("fp8_full", 0.12)])
def test_delayed_input_scaling_skips_the_amax_pass(mode, bound_g, monkeypatch):
    """Delayed scaling of x and g: before the first step end a call uses current scaling, later
    calls quantise with the previous step's amax x headroom and never run an amax pass; same error
    bounds as current."""
    from speedrun.kernels import fp8_cache

    x, w1, w2, gy = inputs(21)
    cache = FP8WeightCache()
    cache.refresh({"w1": w1, "w2": w2})
    wc = (cache.get("w1"), cache.get("w2"))
    ref = _reference(x, w1, w2, gy)
    state = MLPScaleState.create(DEV, input_scaling="delayed")
    passes = []
    real_abs_max = fp8_cache.abs_max
    monkeypatch.setattr(fp8_cache, "abs_max", lambda t: passes.append(tuple(t.shape)) or real_abs_max(t))
    for call in range(3):
        xk, w1k, w2k = (t.clone().requires_grad_() for t in (x, w1, w2))
        y = relu2_mlp(xk, w1k, w2k, mode=mode, cache=wc, scales=state)
        y.backward(gy)
        end_fp8_step([state])
        want_passes = [(T, D)] + ([(T, D)] if mode == "fp8_full" else [])
        assert passes == (want_passes if call == 0 else []), (call, passes)
        passes.clear()
        assert rel(y, ref[0]) < 8e-2
        for got, want in zip((xk.grad, w1k.grad, w2k.grad), ref[1:]):
            assert rel(got, want) < bound_g
        # The quantise kernel measured this call's amax for the next one (exact: a max).
        assert state.x_ready and state.x_amax == x.float().abs().max()
        if mode == "fp8_full":
            assert state.g_ready and state.g_amax == gy.float().abs().max()
    # A 10x larger input saturates (scale from the old amax), and the state catches up: x's scale
    # on the next call, post's (measured behind the clipped x) on the one after.
    errs = []
    for _ in range(3):
        errs.append(rel(relu2_mlp(x * 10, w1, w2, mode=mode, cache=wc, scales=state), relu2_mlp_reference(x * 10, w1, w2)))
        end_fp8_step([state])
        assert state.x_amax == (x * 10).float().abs().max()
    assert errs[0] > 0.1 and errs[2] < 8e-2, errs


def test_input_scaling_is_validated():
    with pytest.raises(ValueError, match="input_scaling must be one of"):
        MLPScaleState.create("cpu", input_scaling="late")
    st = MLPScaleState.create("cpu", input_scaling="delayed")
    assert st.x_amax is None and not st.x_ready  # created by the calibrating first call
    with pytest.raises(ValueError, match="which must be 'x' or 'g'"):
        st.quantize_input(torch.zeros(16, 16), "y", transposed=False)


def test_step_scales_are_made_once_per_step():
    """A delayed scale is computed once per step (its two small kernels run once, not per call) and
    follows every change of its amax: the step end's copy, an in-place change, a new tensor."""
    from speedrun.kernels.fp8_cache import AMAX_FLOOR, E4M3, E5M2, FP8_MAX

    st = MLPScaleState.create("cpu", input_scaling="delayed")
    st.post_amax.fill_(3.0)
    first = st.post_scale()
    assert st.post_scale() is first and torch.equal(first, torch.tensor(3.0) * (st.post_headroom / FP8_MAX[E4M3]))
    assert st.post_scale(torch.tensor(6.0)) is not first  # an explicit amax is never cached
    st.accumulator("post", "cpu").fill_(5.0)
    st.used.add("post")
    end_fp8_step([st])
    assert torch.equal(st.post_scale(), torch.tensor(5.0) * (st.post_headroom / FP8_MAX[E4M3]))
    st.post_amax.zero_()  # in place: the floor applies
    assert torch.equal(st.post_scale(), torch.tensor(AMAX_FLOOR) * (st.post_headroom / FP8_MAX[E4M3]))
    st.dpre_amax = torch.tensor(2.0)  # a new tensor (e.g. a loaded state)
    assert torch.equal(st.dpre_scale(), torch.tensor(2.0) * (st.dpre_headroom / FP8_MAX[E5M2]))
    st.g_amax, st.g_ready = torch.tensor(4.0), True
    g = torch.randn(32, 16, dtype=torch.bfloat16)
    _, _, gs = st.quantize_input(g, "g", transposed=False)
    assert st.quantize_input(g, "g", transposed=False)[2] is gs
    assert torch.equal(gs, torch.tensor(4.0) * (st.input_headroom / FP8_MAX[E5M2]))


@needs_kernel
def test_step_synchronous_scales_are_the_same_for_every_micro_batch(monkeypatch):
    """Within a step the scales stay fixed (whatever the micro-batch order), and the next step's
    amax is the max over all of the step's micro-batches: what makes N ranks equal one rank."""
    x, w1, w2, gy = inputs(23)
    cache = FP8WeightCache()
    cache.refresh({"w1": w1, "w2": w2})
    wc = (cache.get("w1"), cache.get("w2"))
    big = x * 1.2  # within the headroom: no saturation, so the amaxes are exact
    outs = {}
    for order in ((x, big), (big, x)):
        state = MLPScaleState.create(DEV, input_scaling="delayed")
        xg = x.clone().requires_grad_()
        relu2_mlp(xg, w1, w2, mode="fp8_full", cache=wc, scales=state).backward(gy)  # step 0 (current)
        end_fp8_step([state])
        assert state.x_amax == x.float().abs().max()
        ys = [relu2_mlp(t.clone().requires_grad_(), w1, w2, mode="fp8_full", cache=wc, scales=state)
              for t in order]  # step 1
        outs[order[0] is x] = {id(t): y for t, y in zip(order, ys)}
        for y in ys:
            y.backward(gy)
        end_fp8_step([state])
        assert state.x_amax == big.float().abs().max()  # max over the step's micro-batches
        post = (torch.relu(big.float() @ w1.float().t()) ** 2).amax()
        assert torch.isclose(state.post_amax, post, rtol=0.1)
    for t in (x, big):  # each micro-batch's output does not depend on its position in the step
        assert torch.equal(outs[True][id(t)], outs[False][id(t)])


@needs_kernel
@pytest.mark.parametrize("mode", ["bf16", "fp8_fwd", "fp8_full"])
def test_fused_mlp_hook_returns_the_banks_layout_without_a_copy(mode):
    """The record's FusedMLP gets w_proj as (H, D); its gradient comes out of the kernel as that
    contiguous (H, D) tensor (dW2 computed as post^T g), so the opaque op's output check passes it
    through instead of copying a transpose (88 copies per record step before)."""
    from speedrun.kernels.opaque import KernelCtx
    from speedrun.model.kernel_hooks import FusedMLP

    x, w1, w2, gy = inputs(9)  # w2 (D, H)
    w_proj = w2.t().contiguous()  # the bank's (H, D)
    hook = FusedMLP(mode)
    ctx = KernelCtx()
    y = hook._forward(ctx, [x, w1, w_proj], 0, 0)[0]
    dx, dw1, dw_proj = hook._backward(ctx, [gy], 0)
    assert dw_proj.shape == w_proj.shape and dw_proj.is_contiguous()
    ref = _reference(x, w1, w2, gy)
    bound = {"bf16": 1e-2, "fp8_fwd": 8e-2, "fp8_full": 0.12}[mode]  # as test_mlp_forward_backward_vs_reference
    assert rel(dw_proj.t(), ref[3]) < bound and rel(dx, ref[1]) < bound and y.shape == x.shape


@needs_kernel
def test_prequantised_input_gives_the_bits_of_the_mlps_own_quantisation():
    """``x_fp8`` (the record's mlp_input_quant=graph): x quantised by the caller in torch ops gives
    the same output and gradients, bit for bit, as the MLP's own amax pass and quantise kernel."""
    from speedrun.kernels.fp8_cache import quantize_current_graph

    x, w1, w2, gy = inputs(12)
    outs = []
    for pre in (False, True):
        xl, w1l, w2l = (t.clone().requires_grad_() for t in (x, w1, w2))
        x_fp8 = quantize_current_graph(x, transposed=False)[::2] if pre else None
        y = relu2_mlp(xl, w1l, w2l, mode="fp8_fwd", scales=MLPScaleState.create(DEV), x_fp8=x_fp8)
        y.backward(gy)
        outs.append([y, xl.grad, w1l.grad, w2l.grad])
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert rel(outs[1][0], _reference(x, w1, w2, gy)[0]) < 8e-2


def test_prequantised_input_is_checked():
    from speedrun.kernels.fp8_cache import quantize_current_graph

    x, w1, w2, _ = inputs(13)
    q, _, s = quantize_current_graph(x, transposed=False)
    with pytest.raises(ValueError, match="needs mode='fp8_fwd'"):
        relu2_mlp(x, w1, w2, mode="fp8_full", x_fp8=(q, s))
    with pytest.raises(ValueError, match="contiguous e4m3"):
        relu2_mlp(x, w1, w2, mode="fp8_fwd", x_fp8=(q[:32], s))
    with pytest.raises(ValueError, match="contiguous e4m3"):
        relu2_mlp(x, w1, w2, mode="fp8_fwd", x_fp8=(q.view(torch.float8_e5m2), s))
    with pytest.raises(ValueError, match="0-d fp32"):
        relu2_mlp(x, w1, w2, mode="fp8_fwd", x_fp8=(q, s.reshape(1)))


def test_graph_input_quant_is_only_for_the_records_current_scaling():
    from speedrun.errors import ConfigError
    from speedrun.model.kernel_hooks import FusedMLP

    FusedMLP("fp8_fwd", input_quant="graph")
    for mode, scaling in (("fp8_full", "current"), ("fp8_fwd", "delayed"), ("bf16", "current")):
        with pytest.raises(ConfigError, match="input_quant='graph' needs mode 'fp8_fwd'"):
            FusedMLP(mode, input_scaling=scaling, input_quant="graph")
    with pytest.raises(ConfigError, match="'kernel' or 'graph'"):
        FusedMLP("fp8_fwd", input_quant="inductor")
