"""torch's built-in varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``).

That kernel wants one head dim for q, k and v.  When D_qk < D_v, Q and K are zero-padded to D_v:
the extra zeros add nothing to q.k, and the softmax scale is passed explicitly so it still
refers to the real width's choice.  CUDA only, bf16/fp16.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from speedrun.attention import check_inputs


def _varlen_fn():
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn


def varlen_problem(device: torch.device) -> str | None:
    try:
        fn = _varlen_fn()
    except ImportError:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if "window_size" not in inspect.signature(fn).parameters:
        return f"torch {torch.__version__}'s varlen_attn has no window_size (sliding windows unsupported)"
    if device.type != "cuda":
        return "varlen_attn runs on CUDA only"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def torch_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """See :mod:`speedrun.attention`."""
    check_inputs(q, k, v, cu_seqlens, "varlen")
    dqk, dv = q.shape[-1], v.shape[-1]
    if scale is None:
        scale = dqk**-0.5
    if dqk > dv:
        raise ValueError(f"varlen attention: D_qk={dqk} > D_v={dv} is not supported (pad V instead)")
    if dqk < dv:
        q = F.pad(q, (0, dv - dqk))
        k = F.pad(k, (0, dv - dqk))
    cu = cu_seqlens.to(torch.int32)
    left = -1 if window is None else int(window)
    return _varlen_fn()(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), scale=scale, window_size=(left, 0))


# The kernel needs D_qk == D_v: producers that can write Q/K already zero-padded to D_v (the fused
# QK-prep) do so and save this function's pad copies; they must pass ``scale`` explicitly.
torch_varlen_attention.pads_qk_to_v = True
