"""The compiled-handle launch cache on a CUDA GPU: results through the cached handle equal the
plain launch's, across the specialisations that change the compiled kernel (pointer alignment,
the value 1, divisibility by 16, constexprs), with outputs poisoned before each launch.

Run on the H200: ``python -m pytest -q -m gpu tests/gpu/test_launch_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from speedrun.kernels import _triton as L  # noqa: E402
from speedrun.kernels.fp8_cache import abs_max  # noqa: E402


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr, SQUARE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if SQUARE:
        x = x * x
    tl.store(out_ptr + offs, alpha * x + tl.load(y_ptr + offs, mask=mask), mask=mask)


def _axpy(x, y, alpha, block, **meta):
    out = torch.full_like(y, float("nan"))
    n = x.numel()
    L.launch(_axpy_kernel, (triton.cdiv(n, block),), x, y, out, n, alpha, BLOCK=block, **meta)
    return out


def test_cached_launch_equals_torch_across_specialisations():
    api = L._api()
    assert api, f"the fast path must be available on CUDA with Triton 3.6: {L.off_reason()}"
    print("triton launch hooks:", api[2].runtime.launch_enter_hook, api[2].runtime.launch_exit_hook)
    L.clear()
    L.set_enabled(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    # small integers and power-of-two alphas: every result is exact, with or without FMA
    base = torch.randint(-8, 9, (4096 + 7,), device="cuda", generator=gen).float()
    ybase = torch.randint(-8, 9, (4096 + 7,), device="cuda", generator=gen).float()
    cases = [(0, 4096, 128, {}), (1, 4095, 128, {}), (0, 1, 128, {}), (3, 33, 64, {}), (0, 4096, 256, {}),
             (0, 1000, 128, {"SQUARE": True})]
    alphas = (0.5, 2.0, -1.0)
    for rep, alpha in enumerate(alphas):  # round 0 compiles and caches, rounds 1-2 use the handle
        for off, n, block, meta in cases:
            x, y = base[off:off + n], ybase[off:off + n]
            got = _axpy(x, y, alpha, block, **meta)
            want = alpha * (x * x if meta.get("SQUARE") else x) + y
            assert torch.equal(got, want), (rep, off, n, block, meta, (got - want).abs().max().item())
        if rep == 0:
            assert L.stats() == {"cached": 0, "plain": len(cases), "uncacheable": 0}, L.stats()
            cached = L.cached_kernels()
            assert cached >= len(cases) - 1, cached  # offsets 0 and 3 (12 bytes) may share a key
    assert L.cached_kernels() == cached
    assert L.stats() == {"cached": 2 * len(cases), "plain": len(cases), "uncacheable": 0}, L.stats()


def test_plain_and_cached_agree_on_a_real_kernel():
    x = torch.randn(3, 50_000, device="cuda").bfloat16()
    L.set_enabled(False)
    plain = [abs_max(x[i]).clone() for i in range(3)]
    L.set_enabled(True)
    L.clear()
    cached = [abs_max(x[i]).clone() for i in range(3)] + [abs_max(x[i]).clone() for i in range(3)]
    assert L.stats()["cached"] >= 3, (L.stats(), L.off_reason())
    for i in range(6):
        assert torch.equal(cached[i], plain[i % 3]), i
        assert cached[i].item() == x[i % 3].float().abs().max().item()
