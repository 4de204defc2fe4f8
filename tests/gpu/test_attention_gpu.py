"""Attention backends on a CUDA GPU against the reference: varlen and flex (with its block mask
built by a compiled create_block_mask and reused across calls), at a small stage-like shape.

Run on the H200: ``python -m pytest -q -m gpu tests/gpu/test_attention_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from speedrun.attention import backend_problem, get_backend  # noqa: E402
from speedrun.attention.reference import reference_attention  # noqa: E402


def _case(T=4096, H=6, dqk=128, dv=128, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(T, H, dqk, device="cuda", generator=g).bfloat16() for _ in range(2))
    v = torch.randn(T, H, dv, device="cuda", generator=g).bfloat16()
    cu = torch.tensor([0, 700, 701, 2500, 4000, T, T], dtype=torch.int32, device="cuda")
    return q, k, v, cu


@pytest.mark.parametrize("backend", ["varlen", "flex"])
def test_backend_matches_reference_on_gpu(backend):
    if backend_problem(backend, torch.device("cuda")) is not None:
        pytest.skip(backend_problem(backend, torch.device("cuda")))
    q, k, v, cu = _case()
    fn = get_backend(backend, "cuda")
    for window in (640, 1408, 640):  # the third call reuses flex's cached mask
        y = fn(q, k, v, cu, 1800, window=window, scale=0.12)
        ref = reference_attention(q.double(), k.double(), v.double(), cu, 1800, window=window, scale=0.12)
        assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
    cu[2] = 1200  # in place (still increasing): a cached mask must not be reused
    y = fn(q, k, v, cu, 1800, window=640, scale=0.12)
    ref = reference_attention(q.double(), k.double(), v.double(), cu, 1800, window=640, scale=0.12)
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
