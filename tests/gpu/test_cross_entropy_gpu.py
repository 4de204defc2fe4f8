"""Loss head at record shapes on a CUDA GPU: Triton CE kernel and the FP8/bf16 head vs references.

Record shapes: D=768, V_pad=50304 with 50257 real tokens, 3 MTP weights and the prefix term.
The references run in row chunks so fp32 (N, V) intermediates stay small.  Run on the H200:
``python -m pytest -m gpu tests/gpu/test_cross_entropy_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.cross_entropy import (
    GRAD_UNIT_SCALE,
    fused_softcapped_ce,
    fused_softcapped_ce_reference,
    softcapped_ce_eval,
    softcapped_ce_fwd_bwd,
    softcapped_ce_fwd_bwd_reference,
    softcapped_multitoken_ce_reference,
)
from speedrun.kernels.fp8_ops import fp8_supported, quantize_tensorwise, scaled_mm

pytestmark = pytest.mark.gpu

D, V_PAD, VOCAB = 768, 50304, 50257
MTP = [1.0, 0.5, 0.25]
CHUNK = 1024


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def batch(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    targets = torch.randint(0, VOCAB, (n,), device="cuda", generator=g)
    prefix = torch.randint(0, VOCAB, (n,), device="cuda", generator=g)
    prefix[::3] = -1
    targets[::997] = -1
    return targets, prefix


def chunked_reference(logits, targets, prefix, grad_dtype, grad_out_scale):
    """Reference (losses, dlogits) row chunk by row chunk; chunks still see the following targets."""
    losses, grads = [], []
    for a in range(0, logits.shape[0], CHUNK):
        b = min(a + CHUNK, logits.shape[0])
        l, g = softcapped_ce_fwd_bwd_reference(
            logits[a:b], targets[a:], MTP, prefix[a:b], 0.25, vocab_size=VOCAB,
            grad_out_scale=grad_out_scale, grad_dtype=grad_dtype, check_targets=False,
        )
        losses.append(l)
        grads.append(g)
    return torch.cat(losses), torch.cat(grads)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float8_e5m2])
def test_kernel_at_record_vocab(grad_dtype):
    n = 8192
    logits = (torch.randn(n, V_PAD, device="cuda") * 6).to(torch.bfloat16)
    targets, prefix = batch(n)
    scale = 1.0 / GRAD_UNIT_SCALE if grad_dtype == torch.float8_e5m2 else 1.0
    losses = torch.full((n,), float("nan"), device="cuda")
    dlogits = torch.full((n, V_PAD), float("nan"), device="cuda").to(grad_dtype)
    softcapped_ce_fwd_bwd(
        logits, targets, torch.tensor(MTP, device="cuda"), prefix, torch.tensor([0.25], device="cuda"),
        vocab_size=VOCAB, grad_out_scale=scale, grad_dtype=grad_dtype, losses_out=losses, dlogits_out=dlogits,
    )
    assert torch.isfinite(losses).all() and torch.isfinite(dlogits.float()).all()
    assert (dlogits[:, VOCAB:].float() == 0).all()
    ref_l, ref_d = chunked_reference(logits, targets, prefix, grad_dtype, scale)
    ref_exact = chunked_reference(logits, targets, prefix, torch.float32, scale)[1]
    assert rel(losses, ref_l) < 1e-5
    mismatch = (dlogits.float() != ref_d.float()).float().mean().item()
    assert mismatch < 1e-3, f"{mismatch:.2e} of dlogits round differently from torch's cast"
    assert rel(dlogits, ref_exact) < (1e-2 if grad_dtype == torch.bfloat16 else 0.08)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float8_e5m2])
def test_kernel_with_hardware_tanh_at_record_vocab(grad_dtype):
    """sigmoid="tanh" (tanh.approx.f32, relative error <= ~2**-11): the capped logits move by at
    most A * 2**-12 ~ 0.006, so the losses stay within 1e-3 (relative) of the exact reference and
    the gradients within the bounds of the exact kernel; a different rounding of some gradient
    elements is expected (bf16 spacing is 2**-8, the error in p up to ~0.6%)."""
    n = 8192
    logits = (torch.randn(n, V_PAD, device="cuda") * 6).to(torch.bfloat16)
    targets, prefix = batch(n, seed=3)
    scale = 1.0 / GRAD_UNIT_SCALE if grad_dtype == torch.float8_e5m2 else 1.0
    losses = torch.full((n,), float("nan"), device="cuda")
    dlogits = torch.full((n, V_PAD), float("nan"), device="cuda").to(grad_dtype)
    softcapped_ce_fwd_bwd(
        logits, targets, MTP, prefix, 0.25, vocab_size=VOCAB, grad_out_scale=scale, grad_dtype=grad_dtype,
        losses_out=losses, dlogits_out=dlogits, sigmoid="tanh",
    )
    assert torch.isfinite(losses).all() and torch.isfinite(dlogits.float()).all()
    assert (dlogits[:, VOCAB:].float() == 0).all()
    ref_l, ref_d = chunked_reference(logits, targets, prefix, grad_dtype, scale)
    ref_exact = chunked_reference(logits, targets, prefix, torch.float32, scale)[1]
    err = rel(losses, ref_l)
    assert 1e-7 < err < 1e-3, err  # not the exact route, and close to it
    assert (losses - ref_l).abs().max().item() < 0.03
    assert rel(dlogits, ref_exact) < (1e-2 if grad_dtype == torch.bfloat16 else 0.08)
    if grad_dtype == torch.float8_e5m2:
        assert (dlogits.float() != ref_d.float()).float().mean().item() < 2e-2


def test_kernel_full_record_batch_losses():
    n = 49152
    logits = (torch.randn(n, V_PAD, device="cuda") * 6).to(torch.bfloat16)
    targets, prefix = batch(n, seed=1)
    losses, _ = softcapped_ce_fwd_bwd(
        logits, targets, MTP, prefix, 0.25, vocab_size=VOCAB, grad_out_scale=1 / GRAD_UNIT_SCALE,
        grad_dtype=torch.float8_e5m2,
    )
    ref = torch.cat([
        softcapped_multitoken_ce_reference(logits[a : a + CHUNK], targets[a:], MTP, prefix[a : a + CHUNK], 0.25, vocab_size=VOCAB)
        for a in range(0, n, CHUNK)
    ])
    assert rel(losses, ref) < 1e-5


def head(n, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n, D, device="cuda", generator=g).to(torch.bfloat16)
    # lm_head weights of the record's magnitude (|W| well under w_s * 448 = 1.6)
    w = (torch.randn(D, V_PAD, device="cuda", generator=g) * 0.08).to(torch.bfloat16)
    targets, prefix = batch(n, seed)
    return x, w, targets, prefix


def run(fn, x, w, targets, prefix, grad_scale, **kw):
    xx = x.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    losses = fn(xx, ww, targets, torch.tensor(MTP, device="cuda"), prefix, 0.25, vocab_size=VOCAB, **kw)
    (losses.sum() * grad_scale).backward()
    return losses.detach(), xx.grad, ww.grad


def test_bf16_head_at_record_shape():
    args = head(4096)
    got = run(fused_softcapped_ce, *args, 0.5)
    want = run(fused_softcapped_ce_reference, *args, 0.5)
    assert rel(got[0], want[0]) < 1e-4
    assert rel(got[1], want[1]) < 2e-2 and rel(got[2], want[2]) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_supported("cuda"), reason="needs FP8 tensor cores (sm89+)")
def test_fp8_head_at_record_shape():
    args = head(4096, seed=3)
    got = run(fused_softcapped_ce, *args, 0.125, use_fp8=True)
    same_ops = run(fused_softcapped_ce, *args, 0.125, use_fp8=True, ce_backend="reference")
    exact = run(fused_softcapped_ce_reference, *args, 0.125, use_fp8=True)
    for a, b in zip(got, same_ops):
        assert rel(a, b) < 1e-2
    # use_fast_accum in the forward GEMM vs the fp32 emulation of the reference
    assert rel(got[0], exact[0]) < 1e-3
    assert rel(got[1], exact[1]) < 0.1 and rel(got[2], exact[2]) < 0.1
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_supported("cuda"), reason="needs FP8 tensor cores (sm89+)")
def test_scaled_mm_matches_emulation_on_gpu():
    a = quantize_tensorwise(torch.randn(256, 768, device="cuda"), 100 / 448, torch.float8_e4m3fn)
    b = quantize_tensorwise(torch.randn(768, 512, device="cuda") * 0.05, 1.6 / 448, torch.float8_e4m3fn)
    got = scaled_mm(a, b.t().contiguous().t(), 100 / 448, 1.6 / 448, torch.float32)
    want = (a.float() @ b.float()) * (100 / 448 * 1.6 / 448)
    # Hopper's FP8 tensor cores accumulate with fewer than fp32's bits even without fast
    # accumulation (measured 1.3e-4 here), so the emulation is exact only up to that.
    assert rel(got, want) < 1e-3
    # row-major B is accepted (copied into column-major)
    assert rel(scaled_mm(a, b, 100 / 448, 1.6 / 448, torch.float32), want) < 1e-3


def test_transpose_fp8_on_gpu():
    from speedrun.kernels.cross_entropy import transpose_fp8

    x = torch.randn(4100, 50304, device="cuda").to(torch.float8_e5m2)
    assert torch.equal(transpose_fp8(x).view(torch.uint8), x.t().contiguous().view(torch.uint8))


def test_eval_at_record_shape():
    x, w, targets, _ = head(4096, seed=5)
    got = softcapped_ce_eval(x, w, targets, vocab_size=VOCAB, chunk_rows=1000)
    want = softcapped_multitoken_ce_reference(x @ w, targets, [1.0], vocab_size=VOCAB)
    assert rel(got, want) < 1e-5


@pytest.mark.parametrize("use_fp8", [False, True])
def test_fused_head_under_torch_compile(use_fp8):
    if use_fp8 and not fp8_supported("cuda"):
        pytest.skip("needs FP8 tensor cores (sm89+)")
    x, w, targets, prefix = head(1024, seed=7)
    mtp = torch.tensor(MTP, device="cuda")
    pw = torch.tensor([0.25], device="cuda")

    def step(xx, ww):
        losses = fused_softcapped_ce(xx, ww, targets, mtp, prefix, pw, use_fp8=use_fp8, vocab_size=VOCAB)
        return losses.sum() * 0.5

    results = []
    for fn in (step, torch.compile(step)):
        xx = x.clone().requires_grad_(True)
        ww = w.clone().requires_grad_(True)
        loss = fn(xx, ww)
        loss.backward()
        results.append((loss.detach(), xx.grad, ww.grad))
    for a, b in zip(*results):
        assert rel(a, b) < 1e-3


@pytest.mark.parametrize("n", [49152, 16384])
def test_head_quantisation_kernels_bitwise_at_record_shapes(n):
    """The head's x quantisation (static scale) and its row-scaled transposed weight-gradient
    operand: Triton bits equal the references' at record shapes (outputs poisoned first by a
    previous allocation of NaN bytes in the caching allocator)."""
    from speedrun.kernels.cross_entropy import X_SCALE
    from speedrun.kernels.fp8_cache import (
        quantize_rows_scaled_t, quantize_rows_scaled_t_reference, quantize_static, quantize_static_reference)

    g = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn(n, D, device="cuda", generator=g) * 30).bfloat16()
    go = torch.rand(n, device="cuda", generator=g) * 1e-4
    go[::7] = 0.0
    s = torch.tensor(X_SCALE, device="cuda")
    torch.empty(n * D * 2, dtype=torch.uint8, device="cuda").fill_(0x7F)  # NaN-ish garbage to be reused
    q = quantize_static(x, s)
    assert torch.equal(q.view(torch.uint8), quantize_static_reference(x, s).view(torch.uint8))
    xg_scale = go.abs().amax() * s
    qt = quantize_rows_scaled_t(x, go, xg_scale)
    assert torch.equal(qt.view(torch.uint8), quantize_rows_scaled_t_reference(x, go, xg_scale).view(torch.uint8))


@pytest.mark.parametrize("n", [49152, 4010])  # the record's stage-3 micro-batch; a ragged last row block
def test_kernel_writes_both_gradient_layouts_at_record_shape(n):
    """train.ce_grad_layout=dual on sm90: the e5m2 bytes of both layouts, made by integer arithmetic
    and stored row-major and transposed (the route Triton 3.6's cvt corrupts), equal the row-major
    kernel's bytes (same tiling, so the same sums) and their transpose."""
    from speedrun.kernels.cross_entropy import TRANSPOSED_BLOCK_M, TRANSPOSED_BLOCK_V, transpose_fp8

    logits = (torch.randn(n, V_PAD, device="cuda") * 6).to(torch.bfloat16)
    targets, prefix = batch(n, seed=4)
    kw = dict(vocab_size=VOCAB, grad_out_scale=1 / GRAD_UNIT_SCALE, grad_dtype=torch.float8_e5m2, sigmoid="tanh",
              block_m=TRANSPOSED_BLOCK_M, block_v=TRANSPOSED_BLOCK_V)
    ref_l, ref_d = softcapped_ce_fwd_bwd(logits, targets, MTP, prefix, 0.25, **kw)
    ref_t = transpose_fp8(ref_d)
    d = torch.full((n, V_PAD), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e5m2)  # NaN-poisoned
    d_t = torch.full((V_PAD, n), 0x7F, dtype=torch.uint8, device="cuda").view(torch.float8_e5m2)
    losses, _ = softcapped_ce_fwd_bwd(logits, targets, MTP, prefix, 0.25, dlogits_out=d, dlogits_t_out=d_t, **kw)
    assert torch.equal(losses, ref_l)
    assert torch.equal(d.view(torch.uint8), ref_d.view(torch.uint8))
    assert torch.equal(d_t.view(torch.uint8), ref_t.view(torch.uint8))


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8_supported("cuda"), reason="needs FP8 tensor cores (sm89+)")
def test_fp8_head_gradients_are_the_same_with_either_gradient_layout(monkeypatch):
    args = head(8192, seed=5)
    base = run(fused_softcapped_ce, *args, 0.125, use_fp8=True, grad_layout="transpose")
    dual = run(fused_softcapped_ce, *args, 0.125, use_fp8=True, grad_layout="dual")
    # the two routes tile the row sums differently (1 x 1024 vs 32 x 128): rounding-level changes
    assert rel(dual[0], base[0]) < 1e-6
    assert rel(dual[1], base[1]) < 1e-2 and rel(dual[2], base[2]) < 1e-2


def test_scale_rows_at_record_shape():
    """The head's dX times the per-token loss gradient, in place (49,152 x 768 bf16): the
    reference's bits (CUDA's fp32 -> bf16 cast rounds to nearest even, as the kernel does)."""
    from speedrun.kernels.cross_entropy import scale_rows_, scale_rows_reference_

    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(49152, D, device="cuda", generator=g).bfloat16()
    s = torch.rand(49152, device="cuda", generator=g) + 0.25
    want = scale_rows_reference_(x.clone(), s)
    got = scale_rows_(x.clone(), s)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
