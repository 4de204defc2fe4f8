"""The one-pass Adam kernel against the eager reference on CUDA, at the record's table shapes
(skipped without a GPU).  The kernel follows the reference's operations; the compiler may fuse a
multiply and an add of the second-moment update into one FMA (one rounding fewer than the two
eager kernels): on the H200 (eighth session) exp_avg came out bit-equal and exp_avg_sq within one
fp32 ulp.  The bounds: the moments within 2 fp32 ulps, p within one bf16 ulp, and differing
elements rare.

Run on the H200: ``pytest -m gpu tests/gpu/test_fused_adam_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.fused_adam import adam_update_fused_
from speedrun.optim.adam import adam_update_, new_adam_state

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape,betas,lr_mul,wd_mul", [
    ((50304, 768), (0.5, 0.95), 1.0, 150.0),   # lm_head (beta1 0.5: lerp's second formula)
    ((377280 // 4, 768), (0.75, 0.95), 75.0, 5.0),  # a quarter of the bigram table
    ((12, 768 + 3), (0.9, 0.99), 5.0, 0.0),  # scalars-like, ragged
])
def test_fused_adam_matches_reference_on_cuda(shape, betas, lr_mul, wd_mul):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    p_ref = (torch.randn(shape, device="cuda", generator=gen) * 0.05).bfloat16()
    p_fused = p_ref.clone()
    s_ref, s_fused = new_adam_state(p_ref), new_adam_state(p_fused)
    s_fused["exp_avg"].fill_(float("nan")).zero_()
    for step in range(3):
        g = torch.randn(shape, device="cuda", generator=gen).bfloat16()
        g[: shape[0] // 3] = 0  # untouched rows, as in the sparse tables
        kw = dict(lr=0.008 * lr_mul, betas=betas, eps=1e-10, weight_decay=0.005 * wd_mul)
        adam_update_(p_ref, g, s_ref, **kw)
        adam_update_fused_(p_fused, g, s_fused, **kw)
    torch.cuda.synchronize()
    for key in ("exp_avg", "exp_avg_sq"):
        ref, got = s_ref[key], s_fused[key]
        ulp = (torch.nextafter(ref.abs(), torch.full_like(ref, float("inf"))) - ref.abs())
        err = (got - ref).abs()
        assert (err <= 2 * ulp).all(), (key, err.max())
        assert (err > 0).float().mean() < 0.01, (key, "more than 1% of the elements differ")
    ulp_p = (torch.nextafter(p_ref.abs(), torch.full_like(p_ref, float("inf"))) - p_ref.abs()).float()
    err_p = (p_fused.float() - p_ref.float()).abs()
    assert (err_p <= ulp_p).all(), err_p.max()
    assert (err_p > 0).float().mean() < 0.01, "more than 1% of the weights differ"
