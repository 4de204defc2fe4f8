"""Packed FP8 QKV weight (Triton pack kernel, CPU interpreter) and the packed FP8 QKV GEMM.

The pack kernel is bit-exact with its reference.  The GEMMs run through
``speedrun.kernels.fp8_ops.scaled_mm``'s exact fp32 emulation on the CPU, so they are checked two
ways: against an independent dequantise-and-multiply of the same FP8 operands (tight: bf16 output
rounding only, rel < 4e-3), and against record.py's bf16 ``F.linear(x, sa * cat(Wq, Wk, Wv))`` with
FP8 bounds: e4m3 x e4m3 forward rel < 6e-2 (measured ~3.8%), e5m2 x e4m3 dX rel < 9e-2 (~5.9%),
e5m2 x e4m3 dW rel < 9e-2; the bf16 dW path matches autograd rel < 1e-2.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.fp8_cache import E4M3, E5M2, FP8_MAX, interpreting, quantize_dual_layout_reference
from speedrun.kernels.qkv_pack import (
    delayed_scale,
    pack_qkv_fp8,
    pack_qkv_fp8_reference,
    packed_column_order,
    packed_qkv_linear,
    packed_qkv_linear_reference,
    packed_weight_reference,
    repack_qkv_fp8,
)

needs_kernel = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or CUDA to run the Triton kernel"
)
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"
H, DQK, DV, D, T = 4, 12, 16, 64, 64
N = H * (2 * DQK + DV)  # 160


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def banks(seed: int, layers: int = 3):
    """A qk bank (layers*H, 2 Dqk, D), a vo bank (2 layers, H Dv, D) and fp32 scalars, record-like."""
    g = torch.Generator().manual_seed(seed)
    qk = (torch.randn(layers * H, 2 * DQK, D, generator=g) * 0.05).bfloat16().to(DEV)
    vo = (torch.randn(2 * layers, H * DV, D, generator=g) * 0.05).bfloat16().to(DEV)
    sc = torch.tensor([0.5, 1.0, -0.7, 1.0, 1.3, 1.0], device=DEV)
    return qk, vo, sc


def poisoned_out():
    nan = lambda s: torch.full(s, float("nan"), device=DEV).to(E4M3)  # noqa: E731
    return nan((N, D)), nan((D, N))


@needs_kernel
@pytest.mark.parametrize("flat", [False, True], ids=["bank3d", "flat2d"])
@pytest.mark.parametrize("sa", [0.5, -0.7], ids=["sa_pos", "sa_neg"])
def test_pack_bit_exact_both_layouts(flat, sa):
    qk, vo, _ = banks(1)
    w_qk = qk[H : 2 * H]  # layer 1's slice of the bank (a view, offset into storage)
    if flat:
        w_qk = w_qk.reshape(2 * H * DQK, D)
    sa_t = torch.tensor(sa, device=DEV)
    p = pack_qkv_fp8(w_qk, vo[2], sa_t, num_heads=H, out=poisoned_out())
    r = pack_qkv_fp8_reference(w_qk, vo[2], sa_t, num_heads=H)
    assert torch.equal(bits(p.data), bits(r.data)) and torch.equal(bits(p.data_t), bits(r.data_t))
    assert torch.equal(bits(p.data_t), bits(p.data.t().contiguous()))
    w = packed_weight_reference(w_qk, vo[2], H).float()
    assert torch.equal(p.amax, w.abs().amax())
    assert torch.allclose(p.raw_scale, w.abs().amax() / 448)
    assert p.scale.item() > 0 and torch.allclose(p.scale, p.raw_scale * abs(sa))
    # What the GEMM sees is sa * W_packed, within e4m3 rounding (2^-4 relative per element).
    assert rel(p.data.float() * p.scale, sa * w) < 3e-2


@needs_kernel
def test_pack_delayed_scale_saturates_and_measures_amax():
    qk, vo, _ = banks(2)
    w = packed_weight_reference(qk[:H], vo[0], H).float()
    amax = w.abs().amax()
    small = (amax / 448 / 4).reshape(()).float()  # 4x too small: the largest values clip
    p = pack_qkv_fp8(qk[:H], vo[0], 1.0, scale=small, out=poisoned_out())
    r = pack_qkv_fp8_reference(qk[:H], vo[0], 1.0, scale=small)
    assert torch.equal(bits(p.data), bits(r.data)) and torch.equal(bits(p.data_t), bits(r.data_t))
    assert torch.isfinite(p.data.float()).all()
    assert p.data.float().abs().max().item() == FP8_MAX[E4M3]
    assert torch.equal(p.amax, amax)  # measured on the way, for the next delayed scale
    assert torch.allclose(delayed_scale(p.amax), amax * 1.12 / 448)


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_kernel), False], ids=["triton", "reference"])
def test_repack_of_all_layers_equals_each_layer_packed_with_its_delayed_scale(kernel, monkeypatch):
    """repack_qkv_fp8 (all layers' scalars as vectors) gives, in every layer's own tensors (same
    addresses), the bits of pack_qkv_fp8 with delayed_scale(last amax), for signs of sa either
    way; poisoned payloads and a stale amax are overwritten; the Triton path and the reference
    arithmetic both."""
    import speedrun.kernels.qkv_pack as qp

    if not kernel:
        monkeypatch.setattr(qp, "triton_usable", lambda *a: False)
    layers = 3
    qk, vo, sc = banks(5, layers)
    src = [(qk[j * H:(j + 1) * H], vo[2 * j], sc[2 * j]) for j in range(layers)]  # sa 0.5, -0.7, 1.3
    packs = [pack_qkv_fp8(*s, num_heads=H) for s in src]  # last update's (current scaling)
    with torch.no_grad():  # the weights move, as an optimizer update moves them
        qk.mul_(1.25)
        vo.add_(0.01)
    want = [pack_qkv_fp8(*s, num_heads=H, scale=delayed_scale(p.amax)) for s, p in zip(src, packs)]
    addresses = [(p.data.data_ptr(), p.data_t.data_ptr(), p.scale.data_ptr(), p.raw_scale.data_ptr(),
                  p.amax.data_ptr()) for p in packs]
    for p in packs:
        p.data.copy_(poisoned_out()[0])
        p.data_t.copy_(poisoned_out()[1])
    packs[1].amax.mul_(1.0)  # its value is read before it is zeroed: the delayed scale comes from it
    repack_qkv_fp8(packs, src)
    for j, (p, w) in enumerate(zip(packs, want)):
        assert torch.equal(bits(p.data), bits(w.data)) and torch.equal(bits(p.data_t), bits(w.data_t)), j
        for name in ("scale", "raw_scale", "amax"):
            assert torch.equal(getattr(p, name), getattr(w, name)), (j, name)
    assert addresses == [(p.data.data_ptr(), p.data_t.data_ptr(), p.scale.data_ptr(), p.raw_scale.data_ptr(),
                          p.amax.data_ptr()) for p in packs]
    assert packs[1].scale.item() > 0  # sa < 0 is folded into the payload's sign, not the scale
    with pytest.raises(ValueError, match="3 packed weights but 2 sources"):
        repack_qkv_fp8(packs, src[:2])


def test_the_candidate_repacks_every_layer_at_once_after_its_first_update(monkeypatch):
    """RecordGPT.refresh_fp8_weights packs layer by layer at the first update and after a resume
    (the saved scales are replayed), and through repack_qkv_fp8 at every other update."""
    import speedrun.kernels.qkv_pack as qp
    from speedrun.config import apply_overrides, preset
    from speedrun.model import build_model

    cfg = preset("tiny-candidate")
    apply_overrides(cfg, ["model.kernels=reference"])
    model = build_model(cfg.model)
    calls = []
    real = qp.repack_qkv_fp8
    monkeypatch.setattr(qp, "repack_qkv_fp8", lambda packs, src: calls.append(len(packs)) or real(packs, src))
    model.refresh_fp8_weights()
    assert calls == [] and len(model._qkv_fp8) == len(model.attn_layers)
    model.refresh_fp8_weights()
    assert calls == [len(model.attn_layers)]
    state = model.fp8_state_dict()
    model.load_fp8_state_dict(state)
    model.refresh_fp8_weights()  # the replayed scales: layer by layer
    assert calls == [len(model.attn_layers)]
    model.refresh_fp8_weights()
    assert calls == [len(model.attn_layers)] * 2


def test_column_order_and_reference_weight():
    qk, vo, _ = banks(3)
    order = packed_column_order(H, DQK, DV, device=DEV)
    w_rec = torch.cat((qk[:H].reshape(2 * H * DQK, D), vo[0]))  # record.py's [Q | K | V] rows
    assert torch.equal(packed_weight_reference(qk[:H], vo[0]), w_rec[order])
    assert sorted(order.tolist()) == list(range(N))
    # Head 1's block: q rows 12..23, k rows 48+12.., v rows 96+16..
    blk = order[40:80].tolist()
    assert blk[:DQK] == list(range(12, 24)) and blk[DQK : 2 * DQK] == list(range(60, 72)) and blk[24:] == list(range(112, 128))


def _dequantised_x(x):
    """x current-scaled to e4m3 and back (what the forward GEMM multiplies), fp32."""
    xs = x.float().abs().amax() / 448
    xq, _, _ = quantize_dual_layout_reference(x, xs.reshape(()), fp8_dtype=E4M3)
    return xq.float() * xs


@needs_kernel
@pytest.mark.parametrize("dw_fp8", [False, True], ids=["dw_bf16", "dw_fp8"])
def test_linear_forward_backward(dw_fp8):
    qk, vo, sc = banks(4)
    g = torch.Generator().manual_seed(40)
    x0 = torch.randn(T, D, generator=g).bfloat16().to(DEV)
    dy = torch.randn(T, N, generator=g).bfloat16().to(DEV)
    j = 1  # layer 1: negative sa_lambda

    def run(fn, packed):
        qkb, vob, scb = (t.clone().requires_grad_() for t in (qk, vo, sc))
        x = x0.clone().requires_grad_()
        y = fn(x, packed, qkb[j * H : (j + 1) * H], vob[2 * j], scb[2 * j], dw_fp8=dw_fp8)
        y.backward(dy)
        return y, x.grad, qkb.grad, vob.grad, scb.grad

    packed = pack_qkv_fp8(qk[j * H : (j + 1) * H], vo[2 * j], sc[2 * j])
    y, dx, dqk, dvo, dsc = run(packed_qkv_linear, packed)
    yr, dxr, dqkr, dvor, dscr = run(packed_qkv_linear_reference, None)

    # Forward: exact emulation of the same operands, then the FP8 bound against bf16.
    xd = _dequantised_x(x0)
    wd = packed.data.float() * packed.scale
    assert rel(y, xd @ wd.t()) < 4e-3
    assert rel(y, yr) < 6e-2
    # dX = e5m2 dy x e4m3 W (transposed cached layout).
    gs = dy.float().abs().amax() / 57344
    dyq = (dy.float() / gs).clamp(-57344, 57344).to(E5M2).float() * gs
    assert rel(dx, dyq @ wd) < 4e-3
    assert rel(dx, dxr) < 9e-2
    # Gradients land only in this layer's bank slices and its sa_lambda.
    others = torch.ones(qk.shape[0], dtype=torch.bool)
    others[j * H : (j + 1) * H] = False
    assert (dqk[others] == 0).all() and (dvo[torch.arange(6) != 2 * j] == 0).all()
    assert (dsc[torch.arange(6) != 2 * j] == 0).all()
    sl = slice(j * H, (j + 1) * H)
    if not dw_fp8:
        assert rel(dqk[sl], dqkr[sl]) < 1e-2 and rel(dvo[2 * j], dvor[2 * j]) < 1e-2
        assert abs(dsc[2 * j] - dscr[2 * j]) / abs(dscr[2 * j]) < 1e-2
    else:
        dw_eff = dyq.t() @ xd  # (N, D), packed order, the e5m2 x e4m3 product
        order = packed_column_order(H, DQK, DV, device=DEV)
        w_rec = torch.cat((qk[sl].reshape(2 * H * DQK, D), vo[2 * j])).float()
        d_rec = torch.empty_like(dw_eff)
        d_rec[order] = dw_eff
        want_qk = (sc[2 * j] * d_rec[: 2 * H * DQK]).reshape(H, 2 * DQK, D)
        assert rel(dqk[sl], want_qk) < 1e-2 and rel(dvo[2 * j], sc[2 * j] * d_rec[2 * H * DQK :]) < 1e-2
        assert rel(dsc[2 * j], (d_rec * w_rec).sum()) < 1e-4  # dsa = sum(dW_eff * W_cat)
        assert rel(dqk[sl], dqkr[sl]) < 9e-2 and rel(dvo[2 * j], dvor[2 * j]) < 9e-2


@needs_kernel
def test_linear_float_sa_and_current_packing():
    qk, vo, _ = banks(5)
    x = torch.randn(T, D).bfloat16().to(DEV).requires_grad_()
    w_qk = qk[:H].clone().requires_grad_()
    y = packed_qkv_linear(x, None, w_qk, vo[0], 0.8)  # packs now; float sa gets no gradient
    assert rel(y, packed_qkv_linear_reference(x, None, w_qk, vo[0], 0.8)) < 6e-2
    y.float().square().sum().backward()
    assert torch.isfinite(w_qk.grad).all() and w_qk.grad.abs().sum() > 0


@needs_kernel
@pytest.mark.parametrize("dw_fp8", [False, True], ids=["dw_bf16", "dw_fp8"])
def test_linear_delayed_input_scaling(dw_fp8, monkeypatch):
    """x and dy through a delayed InputScaling: before the first step end current scaling, then
    no amax pass, and the current-scaled results within the FP8 bounds."""
    from speedrun.kernels import fp8_cache
    from speedrun.kernels.fp8_cache import InputScaling, end_fp8_step

    qk, vo, sc = banks(6)
    g = torch.Generator().manual_seed(41)
    x0 = torch.randn(T, D, generator=g).bfloat16().to(DEV)
    dy = torch.randn(T, N, generator=g).bfloat16().to(DEV)
    packed = pack_qkv_fp8(qk[:H], vo[0], sc[0])
    passes = []
    real = fp8_cache.abs_max
    monkeypatch.setattr(fp8_cache, "abs_max", lambda t: passes.append(tuple(t.shape)) or real(t))

    def run(inputs, fn=packed_qkv_linear):
        x, w_qk = x0.clone().requires_grad_(), qk[:H].clone().requires_grad_()
        kw = {} if fn is packed_qkv_linear_reference else dict(dw_fp8=dw_fp8, inputs=inputs)
        y = fn(x, packed, w_qk, vo[0], sc[0], **kw)
        y.backward(dy)
        return y, x.grad, w_qk.grad

    want = run(None, packed_qkv_linear_reference)  # bf16 reference: the documented FP8 bounds
    passes.clear()
    st = InputScaling(input_scaling="delayed")
    for call in range(3):
        got = run(st)
        end_fp8_step([st])
        assert passes == ([(T, D), (T, N)] if call == 0 else []), (call, passes)
        passes.clear()
        for a, b, bound in zip(got, want, (6e-2, 9e-2, 9e-2)):
            assert rel(a, b) < bound
        assert st.x_amax == x0.float().abs().max() and st.g_amax == dy.float().abs().max()


@pytest.mark.parametrize(
    "case, match",
    [
        ("v_rows", r"w_v must be \(H \* Dv, 64\).*\(63, 64\)"),
        ("x_dim", r"x must be \(T, 64\), got shape \(64, 32\)"),
        ("n16", r"\(40, 64\)"),
        ("packed", r"does not match"),
        ("qk_2d_no_heads", r"needs num_heads"),
    ],
)
def test_bad_shapes_raise_value_error(case, match):
    qk, vo, _ = banks(6)
    x = torch.randn(T, D).bfloat16().to(DEV)
    w_qk, w_v, packed, nh = qk[:H], vo[0], None, None
    if case == "v_rows":
        w_v = vo[0][:63]
    elif case == "x_dim":
        x = x[:, :32]
    elif case == "n16":  # H=1, Dqk=12, Dv=16: N = 40 is not a multiple of 16
        w_qk, w_v = qk[:1], vo[0][:DV]
    elif case == "packed":
        packed = pack_qkv_fp8_reference(qk[:H, : 2 * DQK - 8].contiguous(), vo[0][: H * (DV + 8)], 1.0)
    elif case == "qk_2d_no_heads":
        w_qk = qk[:H].reshape(-1, D)
    with pytest.raises(ValueError, match=match):
        if case == "n16":
            pack_qkv_fp8(w_qk, w_v, 1.0)
        else:
            packed_qkv_linear(x, packed, w_qk, w_v, 1.0, num_heads=nh)
    with pytest.raises(ValueError, match=match):
        if case == "n16":
            pack_qkv_fp8_reference(w_qk, w_v, 1.0)
        else:
            packed_qkv_linear_reference(x, packed, w_qk, w_v, 1.0, num_heads=nh)


@needs_kernel
@pytest.mark.parametrize("g_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("want_dsa", [True, False])
@pytest.mark.parametrize("qk_3d", [True, False])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_unpack_packed_grad_matches_reference(g_dtype, want_dsa, qk_3d, w_dtype, monkeypatch):
    """The backward's unpack kernel: every bank-gradient element bit for bit as the reference
    (outputs poisoned first), dsa to fp32 summation order; fresh inputs, sa < 0, uneven tiles."""
    from speedrun.kernels import qkv_pack as qp

    H, dqk, dv, D = 3, 24, 40, 80  # N = 264 rows: not a multiple of the interpreter's 32-row tiles
    g_ = torch.Generator().manual_seed(11 + qk_3d)
    N = H * (2 * dqk + dv)
    g = torch.randn(N, D, generator=g_).to(g_dtype)
    w_qk = torch.randn(H, 2 * dqk, D, generator=g_).to(w_dtype)
    w_qk = w_qk if qk_3d else w_qk.reshape(2 * H * dqk, D)
    w_v = torch.randn(H * dv, D, generator=g_).to(w_dtype)
    sa = torch.tensor(-0.37)
    poisoned = lambda t, **kw: torch.full_like(t, float("nan"), **kw)  # noqa: E731
    monkeypatch.setattr(qp.torch, "empty_like", poisoned)
    dqk_w, dv_w, dsa = qp.unpack_packed_grad(g, w_qk, w_v, sa, H, want_dsa)
    monkeypatch.undo()
    rq, rv, rdsa = qp.unpack_packed_grad_reference(g, w_qk, w_v, sa, H, want_dsa)
    assert dqk_w.shape == w_qk.shape and dv_w.shape == w_v.shape and dqk_w.dtype == w_dtype
    assert torch.equal(dqk_w, rq) and torch.equal(dv_w, rv)
    if want_dsa:
        assert dsa.shape == sa.shape and abs(dsa - rdsa).item() <= 1e-5 * abs(rdsa).item() + 1e-6
    else:
        assert dsa is None and rdsa is None
