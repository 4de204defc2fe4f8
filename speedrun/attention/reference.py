"""Plain-PyTorch varlen attention: the oracle every other backend is tested against.

Documents are gathered into a padded batch (N_docs, H, L, D), attended with one
``scaled_dot_product_attention`` call under a causal + sliding-window + validity mask, and
scattered back.  Runs on any device; the boolean mask costs O(N_docs * L^2) memory.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speedrun.attention import check_inputs


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """See :mod:`speedrun.attention` for the contract.  ``max_seqlen`` is not needed here.

    Under ``torch.compile`` the document gather (whose shapes depend on the data) is replaced by
    one dense (T, T) mask from document ids: same result, O(T^2) memory, traceable."""
    check_inputs(q, k, v, cu_seqlens, "reference")
    if torch.compiler.is_compiling():
        return _dense_masked_attention(q, k, v, cu_seqlens, window, scale)
    T, H, dqk = q.shape
    dv = v.shape[-1]
    if scale is None:
        scale = dqk**-0.5
    cu = cu_seqlens.to(device=q.device, dtype=torch.long)
    starts, ends = cu[:-1], cu[1:]
    lengths = ends - starts
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    if int(cu[-1]) != T or int(cu[0]) != 0 or bool((lengths < 0).any()):
        raise ValueError(f"reference attention: cu_seqlens must rise from 0 to T={T}, got {cu_seqlens.tolist()}")
    L = int(lengths.max())
    offs = torch.arange(L, device=q.device)
    valid = offs[None, :] < lengths[:, None]  # (N, L)
    idx = torch.where(valid, starts[:, None] + offs[None, :], torch.zeros_like(starts)[:, None])

    def gather(x: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (N, H, L, D)
        return x[idx].permute(0, 2, 1, 3)

    qb, kb, vb = gather(q), gather(k), gather(v)
    i = offs[:, None]
    j = offs[None, :]
    allowed = j <= i
    if window is not None:
        allowed = allowed & (i - j <= window)
    mask = allowed[None] & valid[:, None, :]  # (N, Lq, Lk)
    # Padding queries see key 0 so no softmax row is empty (their outputs are discarded).
    mask = mask | (~valid[:, :, None] & (j == 0)[None])
    out_dtype = v.dtype
    compute = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu" else q.dtype
    y = F.scaled_dot_product_attention(
        qb.to(compute), kb.to(compute), vb.to(compute), attn_mask=mask[:, None], scale=scale
    )  # (N, H, L, Dv)
    y = y.permute(0, 2, 1, 3)[valid]  # (T_valid, H, Dv) in document order
    out = y.new_empty(T, H, dv)
    flat_idx = idx[valid]
    out = out.index_copy(0, flat_idx, y)
    return out.to(out_dtype)


def _dense_masked_attention(q, k, v, cu_seqlens, window, scale):
    """Traceable form of :func:`reference_attention`: causal, same-document, windowed (T, T) mask."""
    T, H, dqk = q.shape
    if scale is None:
        scale = dqk**-0.5
    pos = torch.arange(T, device=q.device)
    doc = torch.searchsorted(cu_seqlens.to(device=q.device, dtype=torch.long), pos, right=True)
    i, j = pos[:, None], pos[None, :]
    allowed = (j <= i) & (doc[:, None] == doc[None, :])
    if window is not None:
        allowed = allowed & (i - j <= window)
    compute = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu" else q.dtype
    y = F.scaled_dot_product_attention(q.to(compute).transpose(0, 1), k.to(compute).transpose(0, 1),
                                       v.to(compute).transpose(0, 1), attn_mask=allowed[None], scale=scale)
    return y.transpose(0, 1).to(v.dtype)
