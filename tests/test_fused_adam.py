"""The one-pass Adam kernel against the eager reference (speedrun.optim.adam.adam_update_), in
Triton's interpreter at small shapes: fresh random inputs, both lerp branches (beta1 0.5 takes
torch's second formula), every parameter dtype, several steps (bias correction), a size that is
not a multiple of the block, and the dispatch rules."""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.fused_adam import adam_update_fused_, fused_adam_supported
from speedrun.kernels.fp8_cache import interpreting
from speedrun.optim.adam import adam_update_, adam_update_auto_, new_adam_state

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")

ULPS_MOMENTS = 4  # torch's CPU addcmul rounds (value*g)*g, the kernel CUDA's value*(g*g)


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of x (its dtype)."""
    x = x.float() if x.dtype == torch.float32 else x
    return (torch.nextafter(x.abs(), torch.tensor(float("inf"), dtype=x.dtype)) - x.abs()).float()


def _pair(n: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, generator=gen) * 0.05).to(dtype)
    # some gradients exactly zero and some tiny, as in a sparse embedding table
    g = torch.randn(n, generator=gen).mul_(torch.rand(n, generator=gen) > 0.2).to(dtype)
    g[: n // 10] *= 1e-6
    return p, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("betas,wd", [((0.9, 0.99), 0.005 * 150), ((0.5, 0.95), 0.75), ((0.75, 0.95), 0.0)])
def test_fused_adam_matches_reference_over_steps(dtype, betas, wd):
    n = 3 * 1024 + 77  # not a multiple of the block
    p_ref, g = _pair(n, dtype, seed=hash((str(dtype), betas)) % 1000)
    p_fused = p_ref.clone()
    s_ref, s_fused = new_adam_state(p_ref), new_adam_state(p_fused)
    for step in range(3):
        grad = g * (1 + step)  # fresh per step, same for both paths
        adam_update_(p_ref, grad, s_ref, lr=0.008 * 75, betas=betas, eps=1e-10, weight_decay=wd)
        adam_update_fused_(p_fused, grad, s_fused, lr=0.008 * 75, betas=betas, eps=1e-10, weight_decay=wd)
    assert s_fused["step"] == s_ref["step"] == 3
    for key in ("exp_avg", "exp_avg_sq"):
        err = (s_fused[key] - s_ref[key]).abs()
        assert (err <= ULPS_MOMENTS * _ulp(s_ref[key]) + 1e-30).all(), (key, err.max())
    # p: the moments' few-ulp differences reach the update (relative), then p over three steps
    err = (p_fused.float() - p_ref.float()).abs()
    assert (err <= 4 * _ulp(p_ref) + 1e-30).all(), err.max()
    assert not torch.equal(p_ref, _pair(n, dtype, seed=hash((str(dtype), betas)) % 1000)[0]), "p must change"


def test_fused_adam_writes_every_element_and_nothing_else():
    n = 2048 + 5
    buf = torch.full((n + 64,), float("nan"))  # poisoned tail beyond the parameter
    p = buf[:n]
    p.copy_(torch.randn(n) * 0.1)
    g = torch.randn(n)
    state = new_adam_state(p)
    state["exp_avg"].fill_(float("nan"))  # poisoned moments must be overwritten, not kept
    state["exp_avg"].zero_()
    adam_update_fused_(p, g, state, lr=0.01, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.1)
    assert torch.isfinite(p).all() and torch.isfinite(state["exp_avg"]).all()
    assert torch.isnan(buf[n:]).all(), "wrote past the parameter"
    assert (state["exp_avg_sq"] > 0).sum() == (g != 0).sum()


def test_fused_adam_refuses_what_it_cannot_take():
    p = torch.randn(8, 6)
    state = new_adam_state(p)
    with pytest.raises(ValueError, match="same shape"):
        adam_update_fused_(p, torch.randn(6, 8), state, lr=0.1, betas=(0.9, 0.95), eps=1e-10, weight_decay=0.0)
    with pytest.raises(ValueError, match="contiguous"):
        adam_update_fused_(p.t(), torch.randn(6, 8), new_adam_state(p.t()), lr=0.1, betas=(0.9, 0.95),
                           eps=1e-10, weight_decay=0.0)
    half_state = {"step": 0, "exp_avg": torch.zeros(8, 6, dtype=torch.bfloat16),
                  "exp_avg_sq": torch.zeros(8, 6)}
    with pytest.raises(ValueError, match="fp32"):
        adam_update_fused_(p, torch.randn(8, 6), half_state, lr=0.1, betas=(0.9, 0.95), eps=1e-10,
                           weight_decay=0.0)


def test_auto_dispatch_takes_the_reference_for_what_the_kernel_cannot_take():
    p = torch.randn(8, 6)
    assert fused_adam_supported(p, torch.randn(8, 6))
    assert not fused_adam_supported(p.t(), torch.randn(6, 8))
    assert not fused_adam_supported(p.double(), torch.randn(8, 6))
    pt = torch.randn(8, 12)[:, ::2]  # non-contiguous: the reference runs and still updates in place
    assert not fused_adam_supported(pt, torch.randn(8, 6))
    before = pt.clone()
    adam_update_auto_(pt, torch.randn(8, 6), new_adam_state(pt), lr=0.1, betas=(0.9, 0.95), eps=1e-10,
                      weight_decay=0.0)
    assert not torch.equal(pt, before)
    with pytest.raises(ValueError, match="contiguous"):
        adam_update_auto_(pt, torch.randn(8, 6), new_adam_state(pt), lr=0.1, betas=(0.9, 0.95), eps=1e-10,
                          weight_decay=0.0, use_triton=True)
