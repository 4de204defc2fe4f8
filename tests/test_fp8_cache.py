"""The dual-layout FP8 quantise kernel (Triton, CPU interpreter) and the per-update FP8 weight cache.

Kernel tests need ``TRITON_INTERPRET=1`` (set by .ci/run) or CUDA; without either the module
falls back to the reference and comparing it with itself proves nothing, so they skip.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.fp8_cache import (
    abs_max,
    abs_max_partials,
    abs_max_reference,
    E4M3,
    E5M2,
    FP8_MAX,
    FP8Weight,
    FP8WeightCache,
    StaleFP8CacheError,
    interpreting,
    quantize_current,
    quantize_current_graph,
    quantize_current_reference,
    quantize_dual_layout,
    quantize_dual_layout_reference,
)

needs_kernel = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or CUDA to run the Triton kernel"
)
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEV).to(dtype)


@needs_kernel
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_dual_layout_bit_exact_with_saturation_and_subnormals(fp8_dtype):
    g = torch.Generator().manual_seed(11)
    # Wide dynamic range: some values saturate, some land in the FP8 subnormal range.
    w = (torch.randn(64, 96, generator=g) * torch.logspace(-4, 1, 96)).bfloat16().to(DEV)
    scale = torch.tensor(0.004 if fp8_dtype == E4M3 else 3e-5, device=DEV)
    out, out_t = _poisoned((64, 96), fp8_dtype), _poisoned((96, 64), fp8_dtype)
    q, qt, amax = quantize_dual_layout(w, scale, fp8_dtype=fp8_dtype, out=out, out_t=out_t)
    rq, rqt, ramax = quantize_dual_layout_reference(w, scale, fp8_dtype=fp8_dtype)
    assert (w.float() / scale).abs().max() > FP8_MAX[fp8_dtype]  # the test really saturates
    assert torch.equal(_bits(q), _bits(rq))
    assert torch.equal(_bits(qt), _bits(rqt))
    assert torch.equal(amax, ramax)
    assert torch.isfinite(q.float()).all() and torch.isfinite(qt.float()).all()


@needs_kernel
def test_transposed_layout_is_quantised_transpose():
    g = torch.Generator().manual_seed(12)
    w = (torch.randn(48, 128, generator=g) * 0.05).bfloat16().to(DEV)
    scale = torch.tensor(0.2 / 448, device=DEV)
    _, qt, _ = quantize_dual_layout(w, scale)
    q_of_t, _, _ = quantize_dual_layout(w.t().contiguous(), scale)
    assert torch.equal(_bits(qt), _bits(q_of_t))
    assert qt.is_contiguous() and tuple(qt.shape) == (128, 48)


@needs_kernel
def test_batched_strided_per_matrix_scales():
    g = torch.Generator().manual_seed(13)
    bank = (torch.randn(3, 2, 32, 64, generator=g) * 0.03).bfloat16().to(DEV)
    w = bank[:, 1]  # batch stride 2*32*64: the c_proj half of an MLP bank
    scale = (torch.rand(3, generator=g) * 1e-4 + 5e-5).to(DEV)
    amax0 = torch.zeros(3, device=DEV)
    q, qt, amax = quantize_dual_layout(w, scale, amax=amax0, out=_poisoned((3, 32, 64), E4M3), out_t=_poisoned((3, 64, 32), E4M3))
    rq, rqt, ramax = quantize_dual_layout_reference(w, scale)
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(_bits(qt), _bits(rqt))
    assert torch.equal(amax, w.float().abs().amax(dim=(1, 2)))
    assert amax is amax0  # written in place


@pytest.mark.parametrize(
    "shape,dtype,match",
    [((30, 64), torch.bfloat16, r"\(30, 64\)"), ((64, 40), torch.bfloat16, r"\(64, 40\)"),
     ((64, 64), torch.int32, "int32"), ((4, 4, 4, 4), torch.bfloat16, r"\(4, 4, 4, 4\)")],
)
def test_unsupported_inputs_raise(shape, dtype, match):
    w = torch.ones(shape, dtype=dtype)
    with pytest.raises(ValueError, match=match):
        quantize_dual_layout(w, torch.tensor(1.0))


def test_bad_layout_and_scale_raise():
    w = torch.randn(32, 64).bfloat16()
    with pytest.raises(ValueError, match="row-major"):
        quantize_dual_layout(w.t(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="scale"):
        quantize_dual_layout(w, torch.ones(3))
    with pytest.raises(ValueError, match="scale"):
        quantize_dual_layout(w, 1.0)
    with pytest.raises(ValueError, match="fp8_dtype"):
        quantize_dual_layout(w, torch.tensor(1.0), fp8_dtype=torch.bfloat16)


def test_quantize_current_scale_and_roundtrip():
    g = torch.Generator().manual_seed(14)
    x = torch.randn(32, 64, generator=g).bfloat16().to(DEV)
    q, qt, s = quantize_current(x)
    assert torch.allclose(s, x.float().abs().max() / 448)
    deq = q.float() * s
    assert ((deq - x.float()).norm() / x.float().norm()).item() < 4e-2  # e4m3: 3 mantissa bits
    assert torch.equal(_bits(qt), _bits(q.t().contiguous()))


@needs_kernel
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("shape,spread", [((48, 80), 1.0), ((32, 64), 1e-14), ((16, 32), 0.0)])
def test_quantize_current_matches_its_reference_bit_for_bit(fp8_dtype, transposed, shape, spread):
    """The kernel derives the scale from the amax itself (no torch clamp/div kernels): same bits as
    the reference, including the 1e-12 floor (tiny and all-zero inputs)."""
    g = torch.Generator().manual_seed(hash((shape, spread, transposed)) % 2**31)
    x = (torch.randn(*shape, generator=g) * spread * (1 + 40 * torch.rand(shape, generator=g))).bfloat16().to(DEV)
    q, qt, s = quantize_current(x, fp8_dtype=fp8_dtype, transposed=transposed)
    rq, rqt, rs = quantize_current_reference(x, fp8_dtype=fp8_dtype, transposed=transposed)
    assert s.dtype == torch.float32 and s.dim() == 0 and torch.equal(s, rs), (s, rs)
    assert torch.equal(_bits(q), _bits(rq))
    if transposed:
        assert torch.equal(_bits(qt), _bits(rqt)) and torch.equal(_bits(qt), _bits(q.t().contiguous()))
    else:
        assert qt is None and rqt is None
    if spread == 0.0:
        assert s.item() == pytest.approx(1e-12 / FP8_MAX[fp8_dtype], rel=1e-6)


@needs_kernel
def test_quantize_current_nan_gives_nan_scale_and_bad_shapes_are_refused():
    x = torch.randn(32, 64).bfloat16().to(DEV)
    x[5, 7] = float("nan")
    assert quantize_current(x)[2].isnan() and quantize_current_reference(x)[2].isnan()
    with pytest.raises(ValueError, match="one \\(R, C\\) matrix"):
        quantize_current(torch.randn(2, 32, 64).bfloat16().to(DEV))
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_current(torch.randn(30, 64).bfloat16().to(DEV))


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("shape,spread", [((48, 80), 1.0), ((32, 64), 1e-14), ((16, 32), 0.0)])
def test_quantize_current_graph_matches_the_reference_bits(fp8_dtype, transposed, shape, spread):
    """The torch-ops route of current scaling (for torch.compile to fuse) against the reference:
    same scale and bytes in eager, including the 1e-12 floor and saturation-free rounding."""
    g = torch.Generator().manual_seed(hash((shape, spread, transposed, str(fp8_dtype))) % 2**31)
    x = (torch.randn(*shape, generator=g) * spread * (1 + 40 * torch.rand(shape, generator=g))).bfloat16()
    q, qt, s = quantize_current_graph(x, fp8_dtype=fp8_dtype, transposed=transposed)
    rq, rqt, rs = quantize_current_reference(x, fp8_dtype=fp8_dtype, transposed=transposed)
    assert s.dtype == torch.float32 and s.dim() == 0 and torch.equal(s, rs), (s, rs)
    assert q.dtype == fp8_dtype and torch.equal(_bits(q), _bits(rq))
    assert (qt is None) == (not transposed) and (qt is None or torch.equal(_bits(qt), _bits(rqt)))


def test_quantize_current_graph_nan_and_bad_inputs():
    x = torch.randn(32, 64).bfloat16()
    x[3, 9] = float("nan")
    assert quantize_current_graph(x)[2].isnan()
    with pytest.raises(ValueError, match="one \\(R, C\\) matrix"):
        quantize_current_graph(torch.randn(2, 32, 64).bfloat16())
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_current_graph(torch.randn(30, 64).bfloat16())
    with pytest.raises(ValueError, match="row-major"):
        quantize_current_graph(torch.randn(64, 32).bfloat16().t())


def test_quantize_current_graph_compiled_after_a_norm_keeps_the_bits():
    """What the record compiles (mlp_input_quant=graph): an RMS norm, then the quantisation, in one
    Inductor graph.  The quantised bytes and scale equal the reference's on the compiled norm's
    output (on the CPU Inductor divides exactly; the GPU test bounds the approximate division)."""
    torch._dynamo.reset()

    def norm_then_quantise(x):
        h = torch.nn.functional.rms_norm(x, (x.shape[-1],)).bfloat16()
        q, _, s = quantize_current_graph(h, transposed=False)
        return h, q, s

    g = torch.Generator().manual_seed(21)
    x = torch.randn(64, 48, generator=g) * (1 + 5 * torch.rand(64, 1, generator=g))
    h, q, s = torch.compile(norm_then_quantise, backend="inductor", fullgraph=True)(x)
    rq, _, rs = quantize_current_reference(h, transposed=False)
    assert torch.equal(s, rs) and torch.equal(_bits(q), _bits(rq))
    assert (q.float() * s - h.float()).abs().max() <= h.float().abs().max() * 2**-4  # half an e4m3 step at most


# ---------------------------------------------------------------------------------------------
# FP8WeightCache


def _weights(seed=15):
    g = torch.Generator().manual_seed(seed)
    bank = torch.nn.Parameter((torch.randn(2, 2, 32, 64, generator=g) * 0.02).bfloat16())
    return bank


def test_cache_refresh_get_and_staleness():
    bank = _weights()
    cache = FP8WeightCache()
    with pytest.raises(KeyError):
        cache.get("w1")
    cache.refresh({"w1": bank[:, 0], "w2": bank[:, 1]})
    e = cache.get("w1")
    assert e.version == cache.version == 1
    assert tuple(e.data.shape) == (2, 32, 64) and tuple(e.data_t.shape) == (2, 64, 32)
    assert ((e.data.float() * e.scale[:, None, None] - bank[:, 0].detach().float()).norm() / bank[:, 0].float().norm()) < 4e-2
    cache.invalidate()
    with pytest.raises(StaleFP8CacheError, match="refresh"):
        cache.get("w1")
    cache.refresh({"w1": bank[:, 0], "w2": bank[:, 1]})
    cache.get("w1")
    with torch.no_grad():
        bank.add_(0.001)  # an in-place optimizer update bumps the version counter
    with pytest.raises(StaleFP8CacheError, match="modified in place"):
        cache.get("w2")
    cache.refresh({"w1": bank[:, 0], "w2": bank[:, 1]})
    assert cache.version == 3 and cache.get("w2").version == 3


def test_cache_refresh_must_be_complete_and_shape_stable():
    bank = _weights()
    cache = FP8WeightCache()
    cache.refresh({"w1": bank[:, 0], "w2": bank[:, 1]})
    with pytest.raises(ValueError, match="missing"):
        cache.refresh({"w1": bank[:, 0]})
    with pytest.raises(ValueError, match="changed shape"):
        cache.refresh({"w1": bank[:1, 0], "w2": bank[:, 1]})
    with pytest.raises(ValueError, match="unknown"):
        cache.refresh({"w1": bank[:, 0], "w2": bank[:, 1]}, multipliers={"w3": 2.0})


def test_cache_bootstrap_then_delayed_scaling():
    bank = _weights()
    cache = FP8WeightCache(bootstrap_refreshes=1, headroom=1.12)
    w = bank[:, 0]
    cache.refresh({"w": w})
    amax0 = w.detach().float().abs().amax(dim=(1, 2))
    assert torch.allclose(cache.get("w").scale, amax0 / 448)  # bootstrap: current amax
    with torch.no_grad():
        bank.mul_(1.5)  # grows beyond the headroom -> the delayed scale saturates
    cache.refresh({"w": w})
    assert torch.allclose(cache.get("w").scale, amax0 * 1.12 / 448)  # delayed: previous amax x headroom
    assert cache.saturated("w").all()
    e = cache.get("w")
    assert e.data.float().abs().max() == 448  # clipped, never inf/NaN
    cache.refresh({"w": w})  # the amax measured last refresh catches up
    assert torch.allclose(cache.get("w").scale, amax0 * 1.5 * 1.12 / 448, rtol=1e-2)
    assert not cache.saturated("w").any()


def test_cache_current_names_rescale_at_every_refresh():
    """Upstream's MLP: the up projection (here "fc") is current-scaled at every update, the down
    projection ("proj") delayed once its bootstrap is over."""
    bank = _weights()
    cache = FP8WeightCache(bootstrap_refreshes=1, headroom=1.12, current_names=("fc",))
    fc, proj = bank[:, 0], bank[:, 1]
    cache.refresh({"fc": fc, "proj": proj})
    with torch.no_grad():
        bank.mul_(1.5)
    cache.refresh({"fc": fc, "proj": proj})
    amax = lambda w: w.detach().float().abs().amax(dim=(1, 2))  # noqa: E731
    assert torch.allclose(cache.get("fc").scale, amax(fc) / 448)
    assert not cache.saturated("fc").any()
    assert torch.allclose(cache.get("proj").scale, amax(proj) / 1.5 * 1.12 / 448)
    assert cache.saturated("proj").all()


def test_record_mlp_cache_scales_like_upstream():
    from speedrun.model.record import RecordGPT

    cache = RecordGPT._new_mlp_weight_cache()
    assert cache.current_names == {"fc"} and cache.bootstrap_refreshes == 16 and cache.headroom == 1.12


def test_cache_multiplier_folded_into_scale():
    bank = _weights()
    lam = torch.tensor([0.5, -2.0])
    plain, folded = FP8WeightCache(), FP8WeightCache()
    plain.refresh({"w": bank[:, 0]})
    folded.refresh({"w": bank[:, 0]}, multipliers={"w": lam})
    a, b = plain.get("w"), folded.get("w")
    assert torch.equal(_bits(a.data), _bits(b.data))  # same payload
    assert torch.allclose(b.scale, a.scale * lam)


def test_fp8weight_views():
    bank = _weights()
    cache = FP8WeightCache()
    cache.refresh({"w": bank[:, 1]})
    e = cache.get("w")
    t = e.t()
    assert t.data is e.data_t and t.data_t is e.data
    one = e[1]
    assert tuple(one.data.shape) == (32, 64) and one.scale.dim() == 0
    with pytest.raises(ValueError, match="batched"):
        FP8Weight(e.data[0], e.data_t[0], e.scale[0])[0]


@needs_kernel
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_every_fp8_code_and_every_tie_rounds_like_torch(fp8_dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float()
    codes = codes[torch.isfinite(codes)]
    ordered = codes.unique()  # sorted, -0 merged into 0
    ties = (ordered[1:] + ordered[:-1]) / 2  # halfway points: round-to-nearest-even decides
    vals = torch.cat([codes, ties, -torch.zeros(1)])
    n = -(-vals.numel() // 1024) * 1024  # (16k, 64)
    w = torch.cat([vals, torch.randn(n - vals.numel()) * 10]).bfloat16().reshape(-1, 64).to(DEV)
    assert torch.equal(w.float().flatten()[: vals.numel()].cpu(), vals)  # bf16 holds them exactly
    one = torch.tensor(1.0, device=DEV)
    q, qt, _ = quantize_dual_layout(w, one, fp8_dtype=fp8_dtype)
    rq, rqt, _ = quantize_dual_layout_reference(w, one, fp8_dtype=fp8_dtype)
    assert torch.equal(_bits(q), _bits(rq)) and torch.equal(_bits(qt), _bits(rqt))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1, 1000, 5 * 1024 + 7])  # one element; ragged last block; several programs
def test_abs_max_equals_the_reference_exactly(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    x[n // 2] = -17.25  # the largest magnitude is negative
    want = abs_max_reference(x)
    assert want == 17.25 and torch.equal(abs_max(x), want)
    assert torch.equal(abs_max(x.view(1, -1)), want)
    assert abs_max(torch.zeros(n, dtype=dtype)) == 0


@needs_kernel
def test_abs_max_special_values_and_fallbacks():
    x = torch.randn(3000)
    x[2999] = float("-inf")
    assert abs_max(x) == float("inf")
    x[5] = float("nan")  # NaN wins over inf, as in torch: a broken tensor must not look finite
    assert abs_max(x).isnan()
    y = torch.randn(64, 48).bfloat16()
    assert torch.equal(abs_max(y.t()), abs_max_reference(y))  # non-contiguous: the reference path
    assert abs_max(torch.empty(0)) == 0


@needs_kernel
@pytest.mark.parametrize("n", [1, 1000, 5 * 1024 + 7])
def test_abs_max_partials_reduce_to_abs_max(n):
    """Per-program maxima (no zeroed buffer, no atomics): their max is abs_max, every slot is
    written (the buffer is torch.empty), and a NaN in any program's range propagates."""
    g = torch.Generator().manual_seed(n + 1)
    x = torch.randn(n, generator=g).bfloat16().to(DEV)
    x[-1] = 9.5  # the largest magnitude in the last program's range
    parts = abs_max_partials(x)
    assert parts.dtype == torch.float32 and parts.dim() == 1 and 1 <= parts.numel() <= max(1, -(-n // 1024))
    assert torch.isfinite(parts).all() and torch.equal(parts.max(), abs_max(x)) and parts.max() == 9.5
    if n > 2048:
        x[2048] = float("nan")  # inside a later program's range
        assert abs_max_partials(x).isnan().any()
    y = torch.randn(64, 48).bfloat16().to(DEV)
    assert torch.equal(abs_max_partials(y.t()), abs_max_reference(y).reshape(1))  # non-contiguous: reference


@needs_kernel
def test_quantize_current_reduces_partials_from_every_program():
    """quantize_current's kernel reduces the abs-max pass's partials itself: the scale follows a
    maximum or a NaN that lies in any program's range, bit for bit with the reference."""
    from speedrun.kernels.fp8_cache import _quantize

    for where in (0, 1500, 48 * 80 - 1):  # first, middle, last of four programs' ranges
        x = torch.randn(48, 80).bfloat16().to(DEV)
        x.view(-1)[where] = -300.0
        q, qt, s = quantize_current(x)
        rq, rqt, rs = quantize_current_reference(x)
        assert torch.equal(s, rs) and s.item() == pytest.approx(300.0 / 448) and torch.equal(_bits(q), _bits(rq))
        x.view(-1)[where] = float("nan")
        assert quantize_current(x)[2].isnan()
    with pytest.raises(ValueError, match="partials need scale_from_amax"):
        _quantize(x, torch.tensor(1.0), E4M3, transposed=True, partials=torch.ones(3))


# ---- static and row-scaled quantisation (the FP8 LM head's x and its weight-gradient operand) ----


@needs_kernel
@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
def test_static_and_row_scaled_quantise_match_their_references_bit_for_bit(fp8_dtype):
    from speedrun.kernels.fp8_cache import (
        quantize_rows_scaled_t, quantize_rows_scaled_t_reference, quantize_static, quantize_static_reference)

    fmax = FP8_MAX[fp8_dtype]
    for seed in range(2):  # fresh inputs each round
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(48, 160, generator=g) * 3).to(DEV).bfloat16()
        x[0, :4] = torch.tensor([1e4, -1e4, 1e-30, 0.0])  # saturation both ways, underflow, zero
        scale = torch.tensor(0.7 / fmax * 3, device=DEV)
        q = quantize_static(x, scale, fp8_dtype=fp8_dtype)
        assert q.dtype == fp8_dtype and q.shape == x.shape
        assert torch.equal(_bits(q), _bits(quantize_static_reference(x, scale, fp8_dtype=fp8_dtype)))
        assert q[0, 0].float() == fmax and q[0, 1].float() == -fmax
        rows = torch.randn(48, generator=g).to(DEV) * torch.logspace(-3, 3, 48).to(DEV)
        rows[5] = 0.0
        rows[6] = -rows[6]
        qt = quantize_rows_scaled_t(x, rows, scale, fp8_dtype=fp8_dtype)
        ref = quantize_rows_scaled_t_reference(x, rows, scale, fp8_dtype=fp8_dtype)
        assert qt.shape == (160, 48) and qt.is_contiguous()
        assert torch.equal(_bits(qt), _bits(ref))
        assert (qt[:, 5].float() == 0).all()
        # the values: the transposed, row-scaled, saturated quantisation of x
        want = ((x.float() * rows[:, None]) / scale).clamp(-fmax, fmax)
        assert torch.allclose(qt.float().t(), want, rtol=0.13, atol=2 ** -9 if fp8_dtype == E4M3 else 2 ** -16)


def test_static_and_row_scaled_quantise_refuse_bad_inputs():
    from speedrun.kernels.fp8_cache import quantize_rows_scaled_t, quantize_static

    x = torch.randn(32, 48).bfloat16()
    s = torch.tensor(0.01)
    with pytest.raises(ValueError, match="multiples of 16"):
        quantize_static(torch.randn(30, 48).bfloat16(), s)
    with pytest.raises(ValueError, match="one .R, C. matrix"):
        quantize_static(torch.randn(2, 32, 48).bfloat16(), torch.tensor([0.1, 0.1]))
    with pytest.raises(ValueError, match=r"row_scale must be a contiguous fp32 \(32,\)"):
        quantize_rows_scaled_t(x, torch.ones(31), s)
    with pytest.raises(ValueError, match="row_scale must be a contiguous fp32"):
        quantize_rows_scaled_t(x, torch.ones(32, dtype=torch.float64), s)
    with pytest.raises(ValueError, match="scale must be an fp32 tensor"):
        quantize_rows_scaled_t(x, torch.ones(32), 0.01)


def test_static_and_row_scaled_quantise_without_triton_use_the_reference_rule(monkeypatch):
    """Where no Triton kernel can run (a CPU without the interpreter) the launcher's fallback must
    still apply the row factors and give the references' bits."""
    from speedrun.kernels import fp8_cache as F

    monkeypatch.setattr(F, "triton_usable", lambda t: False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 48, generator=g).bfloat16()
    rows = torch.randn(32, generator=g) * 10
    s = torch.tensor(0.02)
    qt = F.quantize_rows_scaled_t(x, rows, s)
    assert qt.shape == (48, 32)
    assert torch.equal(_bits(qt), _bits(F.quantize_rows_scaled_t_reference(x, rows, s)))
    assert not torch.equal(_bits(qt), _bits(F.quantize_rows_scaled_t_reference(x, torch.ones(32), s)))
    assert torch.equal(_bits(F.quantize_static(x, s)), _bits(F.quantize_static_reference(x, s)))


def test_current_scale_is_the_correctly_rounded_quotient():
    """current_scale = fl(max(amax, 1e-12) / fmax), which the quantise kernel computes with div_rn.
    On CUDA torch divides by a Python scalar as a multiply by its reciprocal (amax 5.25 gave
    0.011718750931 there, not 0.01171875): the float64 quotient rounded once is the rule."""
    from speedrun.kernels.fp8_cache import AMAX_FLOOR, FP8_MAX, current_scale

    g = torch.Generator().manual_seed(3)
    amax = torch.cat([torch.tensor([5.25, 0.0, 1e-30, 448.0]), torch.rand(4096, generator=g) * 10])
    for fmax in FP8_MAX.values():
        want = (amax.double().clamp_min(AMAX_FLOOR) / fmax).float()
        got = current_scale(amax, fmax)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    assert current_scale(torch.tensor(5.25), 448.0).item() == 0.01171875


def test_host_cdiv_and_next_pow2_match_tritons():
    """The launchers' grid helpers agree with triton.cdiv / triton.next_power_of_2 (whose host
    calls cost ~4 us each), and interpreting() reports what Triton decided at import."""
    import os

    import triton

    from speedrun.kernels.fp8_cache import cdiv, interpreting, next_pow2

    for a in list(range(0, 70)) + [49152 * 3072, 2**31 - 1]:
        for b in (1, 7, 16, 64, 128, 1000):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in list(range(1, 300)) + [50304, 2**20, 2**20 + 1]:
        assert next_pow2(n) == triton.next_power_of_2(n)
    assert interpreting() == (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


def test_cuda_capability_is_asked_once_per_device(monkeypatch):
    """The launchers ask for the capability on every call; torch's query costs ~40 us of host time."""
    from speedrun.kernels import fp8_ops

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: asked.append(i) or (9, 0))
    fp8_ops._capability_of.cache_clear()
    try:
        for _ in range(3):
            assert fp8_ops.cuda_capability(torch.device("cuda", 0)) == (9, 0)
        assert fp8_ops.cuda_capability(torch.device("cuda", 1)) == (9, 0)
        assert asked == [0, 1]
        # while torch.compile traces, the query goes straight to torch (a constant to Dynamo)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert fp8_ops.cuda_capability(torch.device("cuda", 0)) == (9, 0)
        assert asked == [0, 1, 0] and fp8_ops._capability_of.cache_info().currsize == 2
    finally:
        fp8_ops._capability_of.cache_clear()


def test_to_scale_tensor_passes_ready_scales_through():
    from speedrun.kernels.fp8_ops import to_scale_tensor

    ready = torch.tensor(0.5)
    assert to_scale_tensor(ready, torch.device("cpu")) is ready
    one = to_scale_tensor(torch.tensor([0.25], dtype=torch.float64), torch.device("cpu"))
    assert one.shape == () and one.dtype == torch.float32 and one.item() == 0.25
    assert to_scale_tensor(2.0, torch.device("cpu")).item() == 2.0
    with pytest.raises(ValueError, match="one value"):
        to_scale_tensor(torch.ones(2), torch.device("cpu"))
