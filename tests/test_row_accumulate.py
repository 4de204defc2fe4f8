"""acc[rows] += grad (speedrun.kernels.row_accumulate), the kernel in Triton's interpreter against
the reference: repeated rows (within one program's block and across blocks), a ragged D and N, a
strided grad, bf16 and fp32 gradients, and clear errors for bad arguments."""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.fp8_cache import interpreting
from speedrun.kernels.row_accumulate import accumulate_rows, accumulate_rows_reference

pytestmark = pytest.mark.skipif(not interpreting() and not torch.cuda.is_available(),
                                reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")


@pytest.mark.parametrize("V,N,D,dtype", [(40, 150, 300, torch.bfloat16), (9, 33, 64, torch.float32)])
def test_accumulate_rows_matches_reference(V, N, D, dtype):
    """Repeated rows: one id 70 times (across several 16-row programs), the rest random."""
    g = torch.Generator().manual_seed(V + N)
    start = torch.randn(V, D, generator=g)
    rows = torch.randint(0, V, (N,), generator=g)
    rows[: min(70, N)] = 5
    grad = torch.randn(N, D, generator=g).to(dtype)
    want = accumulate_rows_reference(start.clone(), rows, grad)
    got = accumulate_rows(start.clone(), rows.to(torch.int32), grad)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(want, start)


def test_accumulate_rows_reads_a_strided_gradient():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(24, 2 * 48, generator=g).bfloat16()
    grad = wide[:, ::2]  # column stride 2: copied to a contiguous block first
    rows = torch.randint(0, 7, (24,), generator=g)
    want = accumulate_rows_reference(torch.zeros(7, 48), rows, grad)
    torch.testing.assert_close(accumulate_rows(torch.zeros(7, 48), rows, grad), want, rtol=1e-5, atol=1e-6)
    sliced = wide[3:, :48]  # row stride 96, column stride 1: read in place
    want = accumulate_rows_reference(torch.zeros(7, 48), rows[3:], sliced)
    torch.testing.assert_close(accumulate_rows(torch.zeros(7, 48), rows[3:], sliced), want, rtol=1e-5, atol=1e-6)


def test_accumulate_rows_rejects_bad_arguments():
    acc, rows, grad = torch.zeros(4, 8), torch.tensor([0, 1]), torch.zeros(2, 8)
    with pytest.raises(ValueError, match="float32 table"):
        accumulate_rows(acc.bfloat16(), rows, grad)
    with pytest.raises(ValueError, match="1-D int32/int64"):
        accumulate_rows(acc, rows.float(), grad)
    with pytest.raises(ValueError, match=r"\(len\(rows\), D\) = \(2, 8\)"):
        accumulate_rows(acc, rows, torch.zeros(3, 8))
    assert torch.equal(accumulate_rows(acc, rows[:0], grad[:0]), torch.zeros(4, 8))
