"""The DC correction (record_parts.dc_postonly_correction) at reduced q/k width, with no padding.

With the packed QKV layout, q/k have width Dqk (record: 96) while v has Dv (128), and q/k may be
strided views into the packed projection output.  The plain-PyTorch DC accepts that as is: these
tests prove it against a dense per-query loop, against contiguous copies, and against q/k
zero-padded to Dv (what a padding backend would see), forward and backward.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.model.record_parts import dc_gate_weights, dc_postonly_correction

T, H, DQK, DV, W = 40, 3, 12, 16, 7
SCALE = 0.3


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def packed_inputs(seed: int):
    """q, k strided views into a (T, H, 2 Dqk + Dv) packed tensor, v another view; gates; documents."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randn(T, H, 2 * DQK + DV, generator=g, dtype=torch.float64).requires_grad_()
    base = torch.randn(T, H, DV, generator=g, dtype=torch.float64)
    w1, w2 = dc_gate_weights(torch.randn(T, H, generator=g, dtype=torch.float64),
                             torch.randn(T, H, generator=g, dtype=torch.float64))
    cu = torch.tensor([0, 9, 9, 25, T], dtype=torch.int32)  # includes an empty document
    return packed, base, w1, w2, cu


def views(packed):
    return packed[..., :DQK], packed[..., DQK : 2 * DQK], packed[..., 2 * DQK :]


def dense_dc(base, q, k, v, w1, w2, cu, scale, window):
    """One query at a time: the definition in dc_postonly_correction's docstring."""
    out = base.clone()
    starts = cu.tolist()
    for t in range(T):
        doc_start = max(s for s in starts[:-1] if s <= t)
        lo = max(doc_start, t - window + 1)
        s = torch.einsum("hd,shd->hs", q[t], k[lo : t + 1]) * scale
        p = torch.softmax(s, dim=-1)
        a = (w1[t][:, None] * p).sum(0)  # (S,)
        out[t] = base[t] + w2[t][:, None] * torch.einsum("s,shd->hd", a, v[lo : t + 1])
    return out


@pytest.mark.parametrize("block", [16, 4, 7])  # 4 and 7 < W - 1: a query's window spans several blocks
def test_strided_reduced_width_matches_dense_definition(block):
    packed, base, w1, w2, cu = packed_inputs(0)
    q, k, v = views(packed)
    assert not q.is_contiguous() and not k.is_contiguous() and q.shape[-1] != v.shape[-1]
    got = dc_postonly_correction(base, q, k, v, w1, w2, cu, scale=SCALE, window=W, block=block)
    want = dense_dc(base, q, k, v, w1, w2, cu, SCALE, W)
    assert got.shape == (T, H, DV)
    assert rel(got - base, want - base) < 1e-5  # math runs in fp32


def test_strided_equals_contiguous_and_zero_padded_forward_backward():
    packed, base, w1, w2, cu = packed_inputs(1)
    g = torch.randn(T, H, DV, dtype=torch.float64)
    kw = dict(scale=SCALE, window=W, block=16)

    q, k, v = views(packed)
    out = dc_postonly_correction(base, q, k, v, w1, w2, cu, **kw)
    (grad_strided,) = torch.autograd.grad(out, packed, g)

    p2 = packed.detach().clone().requires_grad_()
    q2, k2, v2 = (t.contiguous() for t in views(p2))
    out2 = dc_postonly_correction(base, q2, k2, v2, w1, w2, cu, **kw)
    (grad_contig,) = torch.autograd.grad(out2, p2, g)
    assert torch.equal(out, out2) and torch.equal(grad_strided, grad_contig)

    # Zero-padding q/k to Dv changes nothing: padding copies are unnecessary.
    p3 = packed.detach().clone().requires_grad_()
    q3, k3, v3 = views(p3)
    pad = lambda t: torch.nn.functional.pad(t, (0, DV - DQK))  # noqa: E731
    out3 = dc_postonly_correction(base, pad(q3), pad(k3), v3, w1, w2, cu, **kw)
    (grad_pad,) = torch.autograd.grad(out3, p3, g)
    assert rel(out3, out) < 1e-6 and rel(grad_pad, grad_strided) < 1e-6
    assert grad_strided[..., :DQK].abs().sum() > 0 and grad_strided[..., DQK : 2 * DQK].abs().sum() > 0


def test_bf16_views_of_a_packed_projection():
    """bf16 as in training: views of a (T, H*(2 Dqk + Dv)) GEMM output, against fp64 math."""
    packed, base, w1, w2, cu = packed_inputs(2)
    flat = packed.detach().reshape(T, -1).bfloat16()
    q, k, v = views(flat.view(T, H, -1))
    got = dc_postonly_correction(base.bfloat16(), q, k, v, w1.bfloat16(), w2.bfloat16(), cu, scale=SCALE, window=W)
    assert got.dtype == torch.bfloat16
    want = dense_dc(base, *(t.double() for t in (q, k, v)), w1.bfloat16().double(), w2.bfloat16().double(), cu, SCALE, W)
    assert rel(got, want) < 1e-2


@pytest.mark.parametrize("block", [8, 4])
def test_gradients_match_the_dense_definition(block):
    """Every input's gradient (q, k, v through the packed tensor; base; both gates) against autograd
    through the per-query loop, including the window's edge and documents shorter than it."""
    packed, base, w1, w2, cu = packed_inputs(3)
    base, w1, w2 = (t.detach().clone().requires_grad_() for t in (base, w1, w2))
    g = torch.randn(T, H, DV, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    got = torch.autograd.grad(dc_postonly_correction(base, *views(packed), w1, w2, cu, scale=SCALE, window=W,
                                                     block=block), (packed, base, w1, w2), g)
    want = torch.autograd.grad(dense_dc(base, *views(packed), w1, w2, cu, SCALE, W), (packed, base, w1, w2), g)
    for name, a, b in zip(("qkv", "base", "w1", "w2"), got, want):
        assert rel(a, b) < 1e-5, name  # the banded path runs in fp32

