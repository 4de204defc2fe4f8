"""Stage-3 attention timing helpers on CPU: document lengths, mask pair counts and FLOPs (the
timings themselves run on the GPU: ``benchmarks/bench_attention.py`` and ``speedrun doctor``)."""

from __future__ import annotations

import os

import pytest
import torch

from speedrun.evidence import attention_timing as at


def test_stage3_windows_come_from_the_schedule():
    assert at.stage3_windows() == (640, 1408)


def test_synthetic_documents_fill_the_padded_slots():
    cu = at.synthetic_cu_seqlens()
    assert cu.dtype == torch.int32 and cu.numel() == at.STAGE3_SLOTS
    assert int(cu[0]) == 0 and int(cu[-1]) == at.STAGE3_TOKENS and bool((cu[1:] >= cu[:-1]).all())
    lengths = cu[1:] - cu[:-1]
    assert int(lengths.max()) <= at.STAGE3_SEQ_CAP
    small = at.synthetic_cu_seqlens(T=4000, cap=64, slots=40)  # more documents than slots: merged
    assert small.numel() == 40 and int(small[-1]) == 4000


def _pairs_by_mask(cu, window):
    T = int(cu[-1])
    pos = torch.arange(T)
    doc = torch.searchsorted(cu[1:].contiguous(), pos, right=True)
    i, j = pos[:, None], pos[None, :]
    allowed = (j <= i) & (doc[:, None] == doc[None, :])
    if window is not None:
        allowed &= i - j <= window
    return int(allowed.sum())


@pytest.mark.parametrize("window", [None, 0, 3, 17, 1000])
def test_allowed_pairs_count_the_mask(window):
    cu = torch.tensor([0, 1, 9, 40, 41, 90, 90, 90], dtype=torch.int32)
    assert at.allowed_pairs(cu, window) == _pairs_by_mask(cu, window)


def test_flops_formula():
    # equal widths: 4 * D * pairs forward, 2.5x that backward (14 * D per pair per head in all)
    assert at.attention_flops(10, 3, 128, 128) == 14 * 128 * 10 * 3
    assert at.attention_flops(10, 3, 128, 128, backward=False) == 4 * 128 * 10 * 3
    assert at.attention_flops(1, 1, 96, 128) == 2 * (96 + 128) + 2 * (3 * 96 + 2 * 128)


def test_webmix_documents_follow_the_loader():
    data = os.environ.get("SPEEDRUN_TEST_DATA")
    if not data:
        pytest.skip("needs SPEEDRUN_TEST_DATA")
    (cu,) = at.webmix_cu_seqlens(os.path.join(data, "webmix_train_*.bin"), T=4096, cap=512)
    assert cu.dtype == torch.int32 and int(cu[0]) == 0 and int(cu[-1]) == 4096
    assert int((cu[1:] - cu[:-1]).max()) <= 512
    with pytest.raises(FileNotFoundError):
        at.webmix_cu_seqlens("/nonexistent/*.bin")
