"""FlexAttention backend: causal + document + sliding-window block masks.

FlexAttention takes D_qk != D_v natively, so 96-wide Q/K with 128-wide V needs no padding.  The
block mask comes from ``cu_seqlens`` and the window.  Outside a compiled graph it is the costly
part: built eagerly, ``create_block_mask`` evaluates the mask at every (q, kv) pair, which took
~39 ms per call at stage-3 shapes on the H200 (T = 49,152) against 1.4 ms for varlen attention.
So on CUDA, outside compiled code, the mask is built by a compiled ``create_block_mask``
(``_compile=True``) and reused by every layer with the same ``cu_seqlens`` tensor, length and
window (a micro-batch's layers share two masks instead of building one each).  On CUDA the
attention kernel is compiled with ``torch.compile`` the first time it runs outside an
already-compiled graph.
"""

from __future__ import annotations

import functools
import weakref

import torch

from speedrun.attention import check_inputs
from speedrun.compiling import allow_schedule_variants


def flex_problem(device: torch.device) -> str | None:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the torch build
        return f"torch.nn.attention.flex_attention is not importable: {e}"
    return None


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Each (T, H, window) combination is its own compiled variant: a staged schedule with paired
    # layers needs a few dozen, more than dynamo's default limit of 8.
    allow_schedule_variants()
    return torch.compile(flex_attention, dynamic=False)


class BlockMaskCache:
    """The last few block masks, each tied to the ``cu_seqlens`` tensor it was built from (by a weak
    reference: a freed tensor's masks can never match a new tensor at the same address) and to a
    key (length, window, the tensor's version counter, so an in-place change misses)."""

    def __init__(self, size: int = 8):
        self.size = size
        self._entries: list[tuple[weakref.ref, tuple, object]] = []

    def get(self, cu_seqlens: torch.Tensor, key: tuple):
        for ref, k, mask in self._entries:
            if ref() is cu_seqlens and k == key:
                return mask
        return None

    def put(self, cu_seqlens: torch.Tensor, key: tuple, mask) -> None:
        self._entries = [e for e in self._entries if e[0]() is not None][-(self.size - 1):]
        self._entries.append((weakref.ref(cu_seqlens), key, mask))


_MASKS = BlockMaskCache()


def document_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """(T,) int32 document index of every position, from padded cu_seqlens."""
    positions = torch.arange(T, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).to(torch.int32)


def flex_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """See :mod:`speedrun.attention`.  Sequence lengths need not be multiples of the block size."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    check_inputs(q, k, v, cu_seqlens, "flex")
    T = q.shape[0]
    docs = document_ids(cu_seqlens, T)

    def mask_mod(b, h, q_idx, kv_idx):
        same = (docs[q_idx] == docs[kv_idx]) & (kv_idx <= q_idx)
        if window is not None:
            same = same & (q_idx - kv_idx <= window)
        return same

    eager_cuda = q.device.type == "cuda" and not torch.compiler.is_compiling()
    key = (T, window, cu_seqlens._version) if eager_cuda else None
    block_mask = _MASKS.get(cu_seqlens, key) if eager_cuda else None
    if block_mask is None:
        block_mask = create_block_mask(mask_mod, None, None, T, T, device=q.device, _compile=eager_cuda)
        if eager_cuda:
            _MASKS.put(cu_seqlens, key, block_mask)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # (1, H, T, D)
    fn = flex_attention
    if q.device.type == "cuda" and not torch.compiler.is_compiling():
        fn = _compiled_flex()
    if q.device.type != "cuda":
        import warnings

        with warnings.catch_warnings():  # eager flex on the CPU is for tests; its speed warning is noise
            warnings.simplefilter("ignore", UserWarning)
            y = fn(qh, kh, vh, block_mask=block_mask, scale=scale)
    else:
        y = fn(qh, kh, vh, block_mask=block_mask, scale=scale)
    return y[0].transpose(0, 1)
