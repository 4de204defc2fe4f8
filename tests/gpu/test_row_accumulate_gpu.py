"""acc[rows] += grad on CUDA at the record's shapes (a stage-3 micro-batch of 49,152 rows into the
bigram table, 377,280 x 768) against torch's index_add_.  Atomic fp32 adds sum repeats in another
order than index_add_, so the bound is a few fp32 ulps of the sums.

Run on the H200: ``pytest -m gpu tests/gpu/test_row_accumulate_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.row_accumulate import accumulate_rows, accumulate_rows_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("V,N", [(377280, 49152), (50304, 8232)])
def test_accumulate_rows_matches_index_add_on_cuda(V, N):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    D = 768
    gen = torch.Generator(device="cuda").manual_seed(V)
    # Zipf-like ids: a few rows very often (frequent tokens), most rarely
    rows = (torch.rand(N, device="cuda", generator=gen) ** 4 * V).long()
    grad = torch.randn(N, D, device="cuda", generator=gen).bfloat16()
    start = torch.randn(V, D, device="cuda", generator=gen)
    want = accumulate_rows_reference(start.clone(), rows, grad)
    got = accumulate_rows(start.clone(), rows, grad)
    counts = torch.bincount(rows, minlength=V)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * counts.max().item() ** 0.5)
    untouched = counts == 0
    assert torch.equal(got[untouched], start[untouched])
