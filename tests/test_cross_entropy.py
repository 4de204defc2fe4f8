"""Softcapped multi-token CE: Triton kernel and fused head vs plain-PyTorch references (CPU).

Run the Triton parts under the interpreter: ``TRITON_INTERPRET=1 python -m pytest tests/test_cross_entropy.py``.
Shapes are small (N=64 rows, D=64, V_pad=384 with 300 real tokens) so the file runs in seconds.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from speedrun.errors import DataError
from speedrun.kernels import cross_entropy as ce
from speedrun.kernels.cross_entropy import (
    DEFAULT_SOFTCAP,
    fused_softcapped_ce,
    fused_softcapped_ce_reference,
    mtp_target_matrix,
    softcapped_ce_eval,
    softcapped_ce_fwd_bwd,
    softcapped_ce_fwd_bwd_reference,
    softcapped_multitoken_ce_reference,
)
from speedrun.kernels.fp8_ops import fp8_supported, quantize_tensorwise, scaled_mm

N, D, V_PAD, VOCAB = 64, 64, 384, 300

needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available(),
    reason="Triton kernels need TRITON_INTERPRET=1 on a machine without CUDA",
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def make_batch(n=N, v_pad=V_PAD, vocab=VOCAB, scale=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v_pad, generator=g) * scale).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), generator=g)
    targets[[3, 17]] = -1  # masked next-token positions (e.g. a document's padding)
    prefix = torch.randint(0, vocab, (n,), generator=g)
    prefix[::3] = -1  # rows whose next token has no proper-prefix token
    return logits, targets, prefix


def random_weights(k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + seed)
    w = torch.rand(k, generator=g) + 0.1
    w[0] = 1.0
    return w


# ----------------------------------------------------------------------------------------------
# The reference itself, against independent formulations


def test_mtp_target_matrix_shifts_and_masks_only_the_batch_end():
    t = torch.tensor([5, 6, 7, 8, 9])
    m = mtp_target_matrix(t, 5, 3)
    assert m.tolist() == [[5, 6, 7], [6, 7, 8], [7, 8, 9], [8, 9, -1], [9, -1, -1]]
    # more targets than rows: a slice of rows still sees the following tokens
    assert mtp_target_matrix(t, 2, 3).tolist() == [[5, 6, 7], [6, 7, 8]]


def test_reference_next_token_equals_plain_cross_entropy():
    logits, targets, _ = make_batch()
    targets = targets.clamp_min(0)
    a, b, c = DEFAULT_SOFTCAP
    s = a * torch.sigmoid((logits.float() + b) / c)
    want = F.cross_entropy(s[:, :VOCAB], targets, reduction="none")
    got = softcapped_multitoken_ce_reference(logits, targets, [1.0], vocab_size=VOCAB)
    assert rel(got, want) < 1e-6


def test_reference_multi_token_and_prefix_terms_by_explicit_loops():
    logits, targets, prefix = make_batch()
    w = [1.0, 0.5, 0.25]
    got = softcapped_multitoken_ce_reference(logits, targets, w, prefix, 0.3, DEFAULT_SOFTCAP, VOCAB)
    a, b, c = DEFAULT_SOFTCAP
    logp = torch.log_softmax(a * torch.sigmoid((logits.float()[:, :VOCAB] + b) / c), dim=-1)
    want = torch.zeros(N)
    for t in range(N):
        for k, wk in enumerate(w):
            if t + k < N and targets[t + k] >= 0:
                want[t] += wk * -logp[t, targets[t + k]]
        if prefix[t] >= 0:
            want[t] += 0.3 * -logp[t, prefix[t]]
    assert rel(got, want) < 1e-6
    assert got[-1] == pytest.approx(-logp[-1, targets[-1]].item(), rel=1e-5)  # only k=0 left at the end


def test_reference_without_softcap_is_raw_logits():
    logits, targets, _ = make_batch()
    targets = targets.clamp_min(0)
    got = softcapped_multitoken_ce_reference(logits, targets, [1.0], softcap=None)
    assert rel(got, F.cross_entropy(logits.float(), targets, reduction="none")) < 1e-6


# ----------------------------------------------------------------------------------------------
# The Triton CE kernel against the reference


@needs_interpreter
@pytest.mark.parametrize(
    "k, with_prefix, grad_dtype, softcap, block_m, block_v, sigmoid",
    [
        (1, False, torch.float32, DEFAULT_SOFTCAP, 64, 512, "exact"),
        (2, True, torch.float32, DEFAULT_SOFTCAP, 16, 128, "exact"),
        (3, True, torch.bfloat16, DEFAULT_SOFTCAP, 64, 128, "exact"),
        (3, False, torch.float8_e5m2, DEFAULT_SOFTCAP, 32, 256, "exact"),
        (3, True, torch.float8_e5m2, DEFAULT_SOFTCAP, 64, 512, "exact"),
        (2, True, torch.float32, None, 64, 128, "exact"),
        # the tanh identity's constants (an exact tanh here; the GPU's approximate one in tests/gpu)
        (2, True, torch.float32, DEFAULT_SOFTCAP, 16, 128, "tanh"),
        (3, True, torch.float8_e5m2, (15.0, -2.0, 3.0), 64, 512, "tanh"),
    ],
)
def test_kernel_matches_reference(k, with_prefix, grad_dtype, softcap, block_m, block_v, sigmoid):
    logits, targets, prefix = make_batch(seed=k)
    w = random_weights(k, seed=k)
    prefix = prefix if with_prefix else None
    scale = 1.0 / ce.GRAD_UNIT_SCALE if grad_dtype == torch.float8_e5m2 else 3.0
    losses = torch.full((N,), float("nan"))
    dlogits = torch.full((N, V_PAD), float("nan")).to(grad_dtype)
    kw = dict(softcap=softcap, vocab_size=VOCAB, grad_out_scale=scale, grad_dtype=grad_dtype)
    got_l, got_d = softcapped_ce_fwd_bwd(
        logits, targets, w, prefix, 0.3, losses_out=losses, dlogits_out=dlogits, block_m=block_m,
        block_v=block_v, sigmoid=sigmoid, **kw,
    )
    assert got_l is losses and got_d is dlogits
    assert torch.isfinite(losses).all() and torch.isfinite(dlogits.float()).all()
    ref_l, ref_d = softcapped_ce_fwd_bwd_reference(logits, targets, w, prefix, 0.3, **kw)
    assert rel(losses, ref_l) < 1e-5
    # The reference gradient comes from autograd through softcapped_multitoken_ce_reference.
    ref_exact = softcapped_ce_fwd_bwd_reference(logits, targets, w, prefix, 0.3, **{**kw, "grad_dtype": torch.float32})[1]
    if grad_dtype == torch.float32:
        assert rel(dlogits, ref_exact) < 1e-5
    elif grad_dtype == torch.bfloat16:
        assert rel(dlogits, ref_exact) < 1e-2
        assert (dlogits.float() != ref_d.float()).float().mean() < 1e-3  # same rounding of ~equal fp32
    else:
        # e5m2 has two mantissa bits: per element at most 2**-3 relative rounding error.
        assert rel(dlogits, ref_exact) < 0.08
        assert (dlogits.float() != ref_d.float()).float().mean() < 1e-3
        assert (dlogits.float() != 0).float().mean() > 0.5  # the test data reaches the e5m2 range
    assert (dlogits[:, VOCAB:].float() == 0).all()


@needs_interpreter
def test_kernel_block_m_one_and_a_slice_of_rows_with_following_targets():
    logits, targets, prefix = make_batch()
    w = [1.0, 0.5, 0.25]
    full_l, full_d = softcapped_ce_fwd_bwd(logits, targets, w, prefix, 0.25, vocab_size=VOCAB, block_m=8)
    # rows 40..47 alone, one row per program, with every following target still visible
    part_l, part_d = softcapped_ce_fwd_bwd(
        logits[40:48], targets[40:], w, prefix[40:48], 0.25, vocab_size=VOCAB, block_m=1, block_v=128
    )
    assert rel(part_l, full_l[40:48]) < 1e-6 and rel(part_d, full_d[40:48]) < 1e-6


@needs_interpreter
def test_kernel_weights_as_device_tensors_and_zero_weights():
    logits, targets, prefix = make_batch()
    w = torch.tensor([1.0, 0.5, 0.0])  # a ramp that reached 0
    l0, d0 = softcapped_ce_fwd_bwd(logits, targets, w, prefix, torch.tensor([0.0]), vocab_size=VOCAB)
    l1, d1 = softcapped_ce_fwd_bwd(logits, targets, w[:2], None, 0.0, vocab_size=VOCAB)
    assert rel(l0, l1) < 1e-6 and rel(d0, d1) < 1e-6


@needs_interpreter
def test_kernel_turns_invalid_ids_into_nan_without_host_checks():
    logits, targets, prefix = make_batch()
    targets = targets.clone()
    targets[10] = VOCAB  # a padded column: not a real token
    prefix = prefix.clone()
    prefix[20] = -7
    losses, dlogits = softcapped_ce_fwd_bwd(
        logits, targets, [1.0, 0.5], prefix, 0.25, vocab_size=VOCAB, check_targets=False
    )
    nan_rows = torch.isnan(losses).nonzero().flatten().tolist()
    assert nan_rows == [9, 10, 20]  # row 9 predicts targets[10] as its second token
    assert torch.isfinite(dlogits.float()).all()


def test_target_ranges_checked_on_cpu():
    logits, targets, prefix = make_batch()
    bad = targets.clone()
    bad[5] = VOCAB + 3
    with pytest.raises(DataError, match="vocab_size=300"):
        softcapped_ce_fwd_bwd(logits, bad, [1.0], vocab_size=VOCAB)
    with pytest.raises(DataError, match="prefix_targets"):
        softcapped_ce_fwd_bwd(logits, targets, [1.0], prefix - 5, 0.1, vocab_size=VOCAB)


@pytest.mark.parametrize("fn", [softcapped_ce_fwd_bwd, softcapped_ce_fwd_bwd_reference])
def test_kernel_entry_rejects_bad_inputs(fn):
    logits, targets, prefix = make_batch()
    with pytest.raises(ValueError, match="vocab_size=400"):
        fn(logits, targets, vocab_size=400)
    with pytest.raises(ValueError, match="stride"):
        fn(logits.t().contiguous().t(), targets, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="int64 or int32"):
        fn(logits, targets.float(), vocab_size=VOCAB)
    with pytest.raises(ValueError, match="contiguous"):
        fn(logits, torch.stack([targets, targets], 1)[:, 0], vocab_size=VOCAB)
    with pytest.raises(ValueError, match="at least one entry per row"):
        fn(logits, targets[:10], vocab_size=VOCAB)
    with pytest.raises(ValueError, match="one entry per row"):
        fn(logits, targets, [1.0], prefix[:10], 0.1, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        fn(logits.to(torch.int32), targets)
    with pytest.raises(ValueError, match="2-D"):
        fn(logits[0], targets)


def test_kernel_rejects_bad_tuning_and_outputs():
    logits, targets, _ = make_batch()
    with pytest.raises(ValueError, match="block_v"):
        softcapped_ce_fwd_bwd(logits, targets, block_v=100)
    with pytest.raises(ValueError, match="losses_out"):
        softcapped_ce_fwd_bwd(logits, targets, losses_out=torch.empty(N, dtype=torch.float64))
    with pytest.raises(ValueError, match="grad_dtype"):
        softcapped_ce_fwd_bwd(logits, targets, grad_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="softcap"):
        softcapped_ce_fwd_bwd(logits, targets, softcap=(0.0, 5.0, 7.5))
    with pytest.raises(ValueError, match="sigmoid must be one of"):
        softcapped_ce_fwd_bwd(logits, targets, sigmoid="fast")


# ----------------------------------------------------------------------------------------------
# The whole head (GEMMs + kernel) through autograd


def make_head(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g).to(torch.bfloat16)  # like norm(x): unit RMS
    w = (torch.randn(D, V_PAD, generator=g) * 0.3).to(torch.bfloat16)
    _, targets, prefix = make_batch(n=n, seed=seed)
    row_grad = torch.rand(n, generator=g) + 0.5  # non-uniform grad_output: must be honoured
    return x, w, targets, prefix, row_grad


def run_head(fn, x, w, targets, prefix, row_grad, **kw):
    xx = x.clone().requires_grad_(True)
    ww = w.clone().requires_grad_(True)
    losses = fn(xx, ww, targets, [1.0, 0.5, 0.25], prefix, 0.25, vocab_size=VOCAB, **kw)
    (losses * row_grad).sum().backward()
    return losses.detach(), xx.grad, ww.grad


@needs_interpreter
def test_fused_bf16_head_matches_reference_autograd():
    args = make_head(seed=1)
    got = run_head(fused_softcapped_ce, *args)
    want = run_head(fused_softcapped_ce_reference, *args)
    assert got[1].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    assert rel(got[0], want[0]) < 1e-5  # same bf16 logits, fp32 softmax
    assert rel(got[1], want[1]) < 2e-2  # dX through bf16 dlogits
    assert rel(got[2], want[2]) < 2e-2  # dW through bf16 dlogits


def test_fp8_head_with_a_cached_weight_is_bit_identical(kernels_use_references):
    """The per-update quantised head weight gives the same losses and gradients, bit for bit, as
    quantising in the call; a weight of another shape or scale, or use without FP8, is refused."""
    from speedrun.kernels.cross_entropy import W_SCALE, quantize_head_weight

    args = make_head(seed=5)
    w = args[1]
    cached = quantize_head_weight(w, W_SCALE)
    assert cached.data_cm.stride() == (1, w.shape[0]) and torch.equal(
        cached.data_cm.view(torch.uint8), cached.data.view(torch.uint8))
    got = run_head(fused_softcapped_ce, *args, use_fp8=True, fp8_weight=cached)
    want = run_head(fused_softcapped_ce, *args, use_fp8=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    x, _, targets, prefix, _ = args
    with pytest.raises(ValueError, match="does not match"):
        fused_softcapped_ce(x, w, targets, use_fp8=True, vocab_size=VOCAB, fp8_weight=quantize_head_weight(w, 2 * W_SCALE))
    with pytest.raises(ValueError, match="does not match"):
        fused_softcapped_ce(x, w[:, :64].contiguous(), targets, use_fp8=True, vocab_size=64, fp8_weight=cached)
    with pytest.raises(ValueError, match="only used with use_fp8"):
        fused_softcapped_ce(x, w, targets, vocab_size=VOCAB, fp8_weight=cached)


@needs_interpreter
def test_fused_fp8_head_emulated_on_cpu():
    args = make_head(seed=2)
    x, w, targets, prefix, row_grad = args
    got = run_head(fused_softcapped_ce, *args, use_fp8=True)
    same_ops = run_head(fused_softcapped_ce, *args, use_fp8=True, ce_backend="reference")
    exact_grad = run_head(fused_softcapped_ce_reference, *args, use_fp8=True)
    bf16 = run_head(fused_softcapped_ce_reference, *args, use_fp8=False)
    # Same GEMMs, Triton vs reference CE: only rare e5m2 rounding flips may differ.
    for a, b in zip(got, same_ops):
        assert rel(a, b) < 1e-3
    # The forward is exactly quantise -> dequantise -> fp32 GEMM -> bf16.
    assert rel(got[0], exact_grad[0]) < 1e-5
    # Documented bound: e5m2 dlogits (2 mantissa bits) and e4m3 operands in the backward GEMMs
    # keep dX and dW within 10% (Frobenius) of the exact gradient of the quantised forward.
    assert rel(got[1], exact_grad[1]) < 0.1
    assert rel(got[2], exact_grad[2]) < 0.1
    # ...and the FP8 path really quantises: it differs from the bf16 head.
    assert rel(got[0], bf16[0]) > 1e-4


@needs_interpreter
def test_fused_head_without_weight_grad():
    x, w, targets, prefix, _ = make_head(seed=3)
    xx = x.clone().requires_grad_(True)
    losses = fused_softcapped_ce(xx, w, targets, [1.0], prefix, 0.25, vocab_size=VOCAB)
    losses.sum().backward()
    want_x = x.clone().requires_grad_(True)
    fused_softcapped_ce_reference(want_x, w, targets, [1.0], prefix, 0.25, vocab_size=VOCAB).sum().backward()
    assert rel(xx.grad, want_x.grad) < 2e-2


@pytest.mark.parametrize("fn", [fused_softcapped_ce, fused_softcapped_ce_reference])
def test_head_rejects_bad_inputs(fn):
    x, w, targets, prefix, _ = make_head()
    with pytest.raises(ValueError, match=r"\(D, V_pad\)"):
        fn(x, w.t().contiguous(), targets)  # the (V, D) nn.Linear layout
    with pytest.raises(ValueError, match="contiguous"):
        fn(x, w.t().contiguous().t(), targets)
    with pytest.raises(ValueError, match="share a dtype"):
        fn(x.float(), w, targets)
    with pytest.raises(ValueError, match="vocab_size=999"):
        fn(x, w, targets, vocab_size=999)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        fn(x.to(torch.float64), w.to(torch.float64), targets)
    with pytest.raises(ValueError, match="must be"):
        fn(x[None], w, targets)


def test_fused_rejects_unknown_backend():
    x, w, targets, _, _ = make_head()
    with pytest.raises(ValueError, match="ce_backend"):
        fused_softcapped_ce(x, w, targets.clamp_min(0), ce_backend="cuda")


# ----------------------------------------------------------------------------------------------
# Validation loss


def test_eval_matches_plain_cross_entropy_in_chunks():
    x, w, targets, _, _ = make_head(seed=4)
    got = softcapped_ce_eval(x, w, targets, vocab_size=VOCAB, chunk_rows=7)
    a, b, c = DEFAULT_SOFTCAP
    s = a * torch.sigmoid(((x @ w).float() + b) / c)
    want = F.cross_entropy(s[:, :VOCAB], targets, reduction="none", ignore_index=-1)
    assert rel(got, want) < 1e-6
    assert got[3] == 0 and got[17] == 0  # ignored positions
    # It is the next-token term of the training loss.
    train = softcapped_multitoken_ce_reference(x @ w, targets, [1.0], vocab_size=VOCAB)
    assert rel(got, train) < 1e-6


def test_eval_rejects_bad_targets():
    x, w, targets, _, _ = make_head()
    with pytest.raises(ValueError, match="targets must be"):
        softcapped_ce_eval(x, w, targets[:5])
    with pytest.raises(DataError):
        softcapped_ce_eval(x, w, targets + VOCAB, vocab_size=VOCAB)


# ----------------------------------------------------------------------------------------------
# FP8 helpers


def test_quantize_tensorwise_saturates_and_rounds_like_a_cast():
    x = torch.randn(4096) * 300
    x[:4] = torch.tensor([1e6, -1e6, 448.0 * 0.5, 0.0])
    q = quantize_tensorwise(x.to(torch.bfloat16), 0.5, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn
    assert q[:4].float().tolist() == [448.0, -448.0, 448.0, 0.0]
    want = (x.to(torch.bfloat16).float() / 0.5).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.float(), want.float())
    g = quantize_tensorwise(torch.tensor([1e9, -1e9]), 1.0, torch.float8_e5m2)
    assert g.float().tolist() == [57344.0, -57344.0]
    with pytest.raises(ValueError, match="dtype"):
        quantize_tensorwise(x, 1.0, torch.bfloat16)


def test_scaled_mm_emulation_is_the_dequantised_product():
    a = quantize_tensorwise(torch.randn(32, 48), 0.01, torch.float8_e4m3fn)
    b = quantize_tensorwise(torch.randn(48, 16), 0.02, torch.float8_e5m2)
    got = scaled_mm(a, b, 0.01, torch.tensor(0.02), torch.float32)
    want = (a.float() * 0.01) @ (b.float() * 0.02)
    assert rel(got, want) < 1e-6
    assert scaled_mm(a, b, 0.01, 0.02, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="inner"):
        scaled_mm(a, a, 1.0, 1.0)
    with pytest.raises(ValueError, match="e5m2 x e5m2"):
        scaled_mm(b.t(), b, 1.0, 1.0)
    with pytest.raises(ValueError, match="FP8"):
        scaled_mm(a.float(), b, 1.0, 1.0)
    assert fp8_supported("cpu") is False


@needs_interpreter
def test_transpose_fp8_matches_torch():
    from speedrun.kernels.cross_entropy import transpose_fp8

    x = torch.randn(70, 200).to(torch.float8_e5m2)  # ragged against the 64 x 128 tiles
    got = transpose_fp8(x)
    assert got.shape == (200, 70) and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), x.t().contiguous().view(torch.uint8))
    with pytest.raises(ValueError, match="1-byte"):
        transpose_fp8(x.float())


def test_kernel_rejects_softcap_beyond_fixed_offset():
    logits, targets, _ = make_batch()
    with pytest.raises(ValueError, match="A <= 64"):
        softcapped_ce_fwd_bwd(logits, targets, softcap=(80.0, 5.0, 7.5))


def test_without_triton_the_head_runs_its_reference_and_the_kernel_says_why(kernels_use_references):
    """Off-GPU without the interpreter: "auto" falls back to the reference (same numbers as asking
    for it), and the raw kernel entry refuses with a clear message instead of crashing in Triton."""
    x, w, targets, prefix, _ = make_head(seed=4)
    got = fused_softcapped_ce(x, w, targets, [1.0, 0.5], prefix, 0.25, vocab_size=VOCAB)
    want = fused_softcapped_ce(x, w, targets, [1.0, 0.5], prefix, 0.25, vocab_size=VOCAB, ce_backend="reference")
    assert torch.equal(got, want)
    logits, targets, prefix = make_batch()
    with pytest.raises(ValueError, match="needs a CUDA tensor or TRITON_INTERPRET=1"):
        softcapped_ce_fwd_bwd(logits, targets, vocab_size=VOCAB)


@needs_interpreter
@pytest.mark.parametrize("max_programs", [1, 3, 1000])
def test_kernel_persistent_grid_equals_one_program_per_block(max_programs):
    """max_programs: fewer programs than row blocks (3 programs for 8 blocks of 8 rows: uneven
    shares), one program for all, or more than needed; every row is written exactly as with one
    program per block (outputs poisoned first)."""
    logits, targets, prefix = make_batch(seed=7)
    w = [1.0, 0.5, 0.25]
    kw = dict(softcap=DEFAULT_SOFTCAP, vocab_size=VOCAB, grad_out_scale=1 / ce.GRAD_UNIT_SCALE,
              grad_dtype=torch.float8_e5m2, block_m=8, block_v=128)
    want_l, want_d = softcapped_ce_fwd_bwd(logits, targets, w, prefix, 0.25, **kw)
    losses = torch.full((N,), float("nan"))
    dlogits = torch.full((N, V_PAD), float("nan")).to(torch.float8_e5m2)
    softcapped_ce_fwd_bwd(logits, targets, w, prefix, 0.25, losses_out=losses, dlogits_out=dlogits,
                          max_programs=max_programs, **kw)
    assert torch.equal(losses, want_l)
    assert torch.equal(dlogits.view(torch.uint8), want_d.view(torch.uint8))
    with pytest.raises(ValueError, match="max_programs must be >= 1"):
        softcapped_ce_fwd_bwd(logits, targets, w, prefix, 0.25, max_programs=0, **kw)


@needs_interpreter
def test_ce_sigmoid_option_reaches_the_head(monkeypatch):
    """train.ce_sigmoid travels in the run's KernelOptions (checked) to the installed head, whose
    kernel launch then uses it; a head without options uses the exact sigmoid."""
    from speedrun.errors import ConfigError
    from speedrun.kernels.options import KernelOptions
    from speedrun.model.kernel_hooks import FusedHead, set_kernel_options

    seen = []
    real = ce.softcapped_ce_fwd_bwd
    monkeypatch.setattr(ce, "softcapped_ce_fwd_bwd", lambda *a, **k: seen.append(k["sigmoid"]) or real(*a, **k))
    x, w, targets, prefix, _ = make_head(seed=5)
    head = FusedHead(use_fp8=True)
    head(x, w, targets, [1.0, 0.5], prefix, 0.25, softcap=DEFAULT_SOFTCAP)
    set_kernel_options([head, None], KernelOptions(ce_sigmoid="tanh"))
    head(x, w, targets, [1.0, 0.5], prefix, 0.25, softcap=DEFAULT_SOFTCAP)
    assert seen == ["exact", "tanh"]
    with pytest.raises(ConfigError, match="train.ce_sigmoid must be one of exact, tanh"):
        KernelOptions(ce_sigmoid="fast")
    with pytest.raises(ValueError, match="sigmoid must be one of"):
        fused_softcapped_ce(x, w, targets, sigmoid="fast")


@needs_interpreter
@pytest.mark.parametrize("softcap", [DEFAULT_SOFTCAP, None])
def test_kernel_ignores_what_the_padded_logit_columns_hold(softcap):
    """The kernel reads whole padded rows (vectorised loads need a mask at a multiple of 16) and
    drops the padded columns itself: NaN or +inf there changes no loss and no gradient byte."""
    logits, targets, prefix = make_batch(seed=13)
    kw = dict(softcap=softcap, vocab_size=VOCAB, grad_out_scale=1 / ce.GRAD_UNIT_SCALE,
              grad_dtype=torch.float8_e5m2, block_m=8, block_v=128)
    want_l, want_d = softcapped_ce_fwd_bwd(logits, targets, [1.0, 0.5], prefix, 0.25, **kw)
    for junk in (float("nan"), float("inf")):
        dirty = logits.clone()
        dirty[:, VOCAB:] = junk
        losses, d = softcapped_ce_fwd_bwd(dirty, targets, [1.0, 0.5], prefix, 0.25, **kw)
        assert torch.equal(losses, want_l)
        assert torch.equal(d.view(torch.uint8), want_d.view(torch.uint8))


def test_hardware_tanh_only_on_nvidia_gpus_that_have_it(monkeypatch):
    """sigmoid="tanh" uses PTX tanh.approx only on NVIDIA GPUs of capability >= 7.5; ROCm, older
    GPUs, CPUs and the interpreter get the exact tanh through the same identity."""
    cuda = torch.device("cuda", 0)
    assert not ce.hardware_tanh(torch.device("cpu"))
    monkeypatch.setattr(ce, "interpreting", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(ce, "cuda_capability", lambda d: (9, 0))
    assert ce.hardware_tanh(cuda)
    monkeypatch.setattr(ce, "cuda_capability", lambda d: (7, 0))
    assert not ce.hardware_tanh(cuda)
    monkeypatch.setattr(ce, "cuda_capability", lambda d: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert not ce.hardware_tanh(cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(ce, "interpreting", lambda: True)
    assert not ce.hardware_tanh(cuda)


@needs_interpreter
@pytest.mark.parametrize("grad_dtype,block_m,block_v", [(torch.float8_e5m2, 32, 128), (torch.float8_e5m2, 16, 64),
                                                        (torch.bfloat16, 32, 128), (torch.float32, 64, 512)])
def test_kernel_writes_the_transposed_gradient_with_the_same_bits(grad_dtype, block_m, block_v):
    """``dlogits_t_out``: the kernel's second layout is the exact transpose of its first (the
    e5m2 one made by integer arithmetic, as the GPU's dual-layout stores need), the first is what
    the kernel writes without it, and the target columns' sparse rewrite reaches both."""
    logits, targets, prefix = make_batch(seed=11)
    w = random_weights(3, seed=11)
    scale = 1.0 / ce.GRAD_UNIT_SCALE if grad_dtype == torch.float8_e5m2 else 3.0
    kw = dict(vocab_size=VOCAB, grad_out_scale=scale, grad_dtype=grad_dtype, block_m=block_m, block_v=block_v)
    ref_l, ref_d = softcapped_ce_fwd_bwd(logits, targets, w, prefix, 0.3, **kw)
    dlogits = torch.full((N, V_PAD), float("nan")).to(grad_dtype)
    dlogits_t = torch.full((V_PAD, N), float("nan")).to(grad_dtype)
    losses, got = softcapped_ce_fwd_bwd(logits, targets, w, prefix, 0.3, dlogits_out=dlogits, dlogits_t_out=dlogits_t, **kw)
    bits = (lambda t: t.view(torch.uint8)) if grad_dtype == torch.float8_e5m2 else (lambda t: t)
    assert got is dlogits and torch.equal(losses, ref_l)
    assert torch.equal(bits(dlogits), bits(ref_d))
    assert torch.equal(bits(dlogits_t), bits(ref_d.t().contiguous()))
    rows = torch.arange(N)[targets >= 0]
    assert (dlogits_t[targets[rows], rows].float() < 0).all()  # the target columns: p - 1 < 0


def test_transposed_gradient_output_is_checked():
    logits, targets, _ = make_batch()
    for fn in (softcapped_ce_fwd_bwd_reference,) + ((softcapped_ce_fwd_bwd,) if ce.interpreting() else ()):
        for bad in (torch.empty(N, V_PAD, dtype=torch.float8_e5m2), torch.empty(V_PAD, N, dtype=torch.bfloat16),
                    torch.empty(N, V_PAD, dtype=torch.float8_e5m2).t()):
            with pytest.raises(ValueError, match="dlogits_t_out must be a contiguous"):
                fn(logits, targets, vocab_size=VOCAB, grad_dtype=torch.float8_e5m2, dlogits_t_out=bad)
    ref_l, ref_d = softcapped_ce_fwd_bwd_reference(logits, targets, vocab_size=VOCAB)
    out_t = torch.empty(V_PAD, N, dtype=logits.dtype)
    softcapped_ce_fwd_bwd_reference(logits, targets, vocab_size=VOCAB, dlogits_t_out=out_t)
    assert torch.equal(out_t, ref_d.t())


@needs_interpreter
def test_dual_gradient_layout_gives_the_heads_gradients_bit_for_bit(monkeypatch):
    """train.ce_grad_layout=dual: the FP8 head takes dW's operand from the kernel's second layout
    (no transpose pass) and returns the same loss and gradients as the transpose route."""
    from speedrun.errors import ConfigError
    from speedrun.kernels.options import KernelOptions

    calls = []
    real = ce.transpose_fp8
    monkeypatch.setattr(ce, "transpose_fp8", lambda t: calls.append(t.shape) or real(t))
    args = make_head(seed=7)
    base = run_head(fused_softcapped_ce, *args, use_fp8=True)
    assert len(calls) == 1
    dual = run_head(fused_softcapped_ce, *args, use_fp8=True, grad_layout=KernelOptions(ce_grad_layout="dual").ce_grad_layout)
    assert len(calls) == 1  # no transpose pass this time
    for a, b in zip(base, dual):
        assert torch.equal(a, b)
    with pytest.raises(ConfigError, match="train.ce_grad_layout must be one of transpose, dual"):
        KernelOptions(ce_grad_layout="both")


_SM90_COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from speedrun.kernels import cross_entropy as m
from speedrun.kernels.fp8_cache import grid_constants
import torch
fn = m._ce_fwd_bwd_kernel
ptrs = dict(logits_ptr="*bf16", dlogits_ptr="*u8", dlogits_t_ptr="*u8", losses_ptr="*fp32", targets_ptr="*i64",
            mtp_w_ptr="*fp32", prefix_ptr="*i64", prefix_w_ptr="*fp32")
floats = ("cap_a", "k1", "k2", "a_over_c", "grad_mult")
consts = dict(N_PREDICT=3, HAS_PREFIX=True, SOFTCAP=True, GRAD_FP8=True, SOFT_ROUND=False, SOFT_ROUND_BF16=False,
              SIGMOID_TANH=True, TANH_ASM=True, STORE_T=True, FP8_BITS=True, BLOCK_M=m.TRANSPOSED_BLOCK_M,
              BLOCK_V=m.TRANSPOSED_BLOCK_V, **grid_constants(torch.float8_e5m2))
sig = {a: ptrs.get(a, "fp32" if a in floats else "i32") for a in fn.arg_names if a not in consts}
# record shapes: pointers, strides, row and column counts multiples of 16 (not the real vocabulary)
attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig
         if a in ptrs or a in ("stride_logits", "stride_dlogits", "stride_dlogits_t", "n_rows", "n_cols")}
k = triton.compile(ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in consts}},
                             constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()}, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
ttgir = k.asm["ttgir"]
print(json.dumps(dict(fp8_casts=ttgir.count("f8E5M2"), stores=ttgir.count("tt.store"))))
"""


def test_sm90_build_of_the_dual_layout_kernel_has_no_fp8_cast():
    """The CE kernel with both gradient layouts builds for sm90 here (no GPU needed), and its e5m2
    bytes come from integer arithmetic: no FP8 conversion in the compiled kernel, the cvt path
    that corrupts FP8 tiles stored in two layouts on sm90 (triton-lang/triton#11111)."""
    import json
    import shutil
    import subprocess
    import sys

    import triton

    if not shutil.which("ptxas", path=os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")):
        pytest.skip("Triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["fp8_casts"] == 0 and info["stores"] >= 5, info  # losses, 2 dense, 2 sparse (per target)


@needs_interpreter
@pytest.mark.parametrize("dtype,shape", [(torch.bfloat16, (64, 768)), (torch.bfloat16, (37, 300)), (torch.float16, (20, 64))])
def test_scale_rows_matches_its_reference_bits(dtype, shape):
    """The head's dX times each row's loss gradient, in place: the kernel (16-row tiles, ragged
    here) gives the reference's bits, one rounding of the fp32 product, specials included."""
    g = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x[1, 2], x[2, 3], x[3, 4] = float("nan"), float("inf"), -60000.0
    s = torch.rand(shape[0], generator=g) * 2 + 0.01
    s[3] = 1.5  # -60000 * 1.5 overflows fp16 (inf), not bf16
    want = ce.scale_rows_reference_(x.clone(), s)
    got = x.clone()
    assert ce.scale_rows_(got, s) is got
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and nan.sum() == 1  # (NaN payloads may differ)
    assert torch.equal(got.masked_fill(nan, 0).view(torch.int16), want.masked_fill(nan, 0).view(torch.int16))
    assert not torch.equal(got.masked_fill(nan, 0), x.masked_fill(nan, 0))  # it did scale


def test_scale_rows_rejects_bad_inputs():
    x = torch.randn(8, 16).bfloat16()
    for fn in (ce.scale_rows_, ce.scale_rows_reference_):
        with pytest.raises(ValueError, match="x must be a contiguous 2-D bf16/fp16"):
            fn(x.float(), torch.ones(8))
        with pytest.raises(ValueError, match="x must be a contiguous 2-D bf16/fp16"):
            fn(x.t(), torch.ones(16))
        with pytest.raises(ValueError, match="row_scale must be a contiguous fp32 \\(8,\\)"):
            fn(x, torch.ones(8, 1))
        with pytest.raises(ValueError, match="row_scale must be a contiguous fp32 \\(8,\\)"):
            fn(x, torch.ones(8, dtype=torch.float64))
