"""FlexAttention backend: causal + document + sliding-window block masks.

FlexAttention takes D_qk != D_v natively, so 96-wide Q/K with 128-wide V needs no padding.  The
block mask is rebuilt per call from ``cu_seqlens`` (cheap next to the attention itself at
training shapes).  On CUDA the kernel is compiled with ``torch.compile`` the first time it runs
outside an already-compiled graph.
"""

from __future__ import annotations

import functools

import torch

from speedrun.attention import check_inputs


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
    # layers needs a few dozen, more than dynamo's default limit of 8 (the record also uses 64).
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, max(getattr(torch._dynamo.config, limit), 64))
    return torch.compile(flex_attention, dynamic=False)


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

    block_mask = create_block_mask(mask_mod, None, None, T, T, device=q.device)
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
