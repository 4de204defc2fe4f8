"""FlashAttention-3 through the optional ``kernels`` package (``pip install speedrun[fa3]``).

This is what the upstream record uses on 8xH100.  ``kernels`` fetches a prebuilt binary from the
Hugging Face Hub the first time, so this backend needs network access once (or a populated
kernels cache).  Q/K narrower than V are zero-padded to V's width, like the varlen backend.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from speedrun.attention import check_inputs

FA3_REPO = "kernels-community/flash-attn3"


def fa3_problem(device: torch.device) -> str | None:
    if importlib.util.find_spec("kernels") is None:
        return "the 'kernels' package is not installed (pip install 'speedrun[fa3]')"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "FA3 runs on CUDA only"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "FA3 needs a Hopper GPU (sm90)"
    try:
        _interface()
    except Exception as e:  # network or cache problems surface here
        return f"could not load {FA3_REPO}: {type(e).__name__}: {e}"[:300]
    return None


@functools.cache
def _interface():
    from kernels import get_kernel

    return get_kernel(FA3_REPO, version=1).flash_attn_interface


def fa3_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, window=None, scale=None):
    """See :mod:`speedrun.attention`."""
    check_inputs(q, k, v, cu_seqlens, "fa3")
    dqk, dv = q.shape[-1], v.shape[-1]
    if scale is None:
        scale = dqk**-0.5
    if dqk < dv:
        q = F.pad(q, (0, dv - dqk))
        k = F.pad(k, (0, dv - dqk))
    cu = cu_seqlens.to(torch.int32)
    left = -1 if window is None else int(window)
    out = _interface().flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=int(max_seqlen), max_seqlen_k=int(max_seqlen),
        causal=True, softmax_scale=scale, window_size=(left, 0),
    )
    return out[0] if isinstance(out, tuple) else out


# Same contract as the varlen backend: Q/K may arrive zero-padded to D_v (with an explicit scale).
fa3_varlen_attention.pads_qk_to_v = True
