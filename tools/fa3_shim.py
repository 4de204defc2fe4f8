"""Stand-in for the ``flash_attn_interface`` that upstream modded-nanogpt fetches from the kernels hub.

Upstream (KellerJordan/modded-nanogpt) calls FlashAttention-3 through
``get_kernel('kernels-community/flash-attn3').flash_attn_interface.flash_attn_varlen_func``.
Our benchmark machine has no FA3 and no network, so ``tools/upstream_f411b3d.py`` copies
this module next to a patched upstream ``train_gpt.py`` and points that name here.  The call is
routed to torch's built-in varlen FlashAttention (``torch.nn.attention.varlen.varlen_attn``), the
same backend our own ``speedrun.attention.varlen`` uses, so a per-step comparison measures the two
training programs with one attention kernel.

Semantics mirror :func:`speedrun.attention.varlen.torch_varlen_attention`: causal only; FA's
``window_size=(left, right)`` is in tokens, as is torch's, and ``left = -1`` means unlimited.
This file must stay self-contained (stdlib + torch): it runs inside the upstream folder, where the
``speedrun`` package is not importable by default.

``SPEEDRUN_SHIM_BACKEND=cudnn`` or ``fa4`` (read once, at import) routes the calls to that
speedrun backend instead (:func:`speedrun.attention.cudnn.cudnn_varlen_attention`,
:func:`speedrun.attention.fa4.fa4_varlen_attention`), so upstream and our arms can be compared on
that kernel too; it needs the ``speedrun`` package and the backend's packages on ``PYTHONPATH``
(``tools/upstream_f411b3d.sh`` sets that up).  ``varlen`` (the default) is torch's kernel.
"""

from __future__ import annotations

import inspect
import os

import torch

__all__ = ["flash_attn_varlen_func", "varlen_problem", "BACKEND"]

SHIM_BACKENDS = ("varlen", "cudnn", "fa4")
# speedrun's fused backends the shim can route to: module and function
_FUSED = {"cudnn": ("speedrun.attention.cudnn", "cudnn_varlen_attention"),
          "fa4": ("speedrun.attention.fa4", "fa4_varlen_attention")}
# which kernel answers the calls; read once, outside any compiled region
BACKEND = os.environ.get("SPEEDRUN_SHIM_BACKEND", "varlen")

# FA3 keyword arguments we accept only at their neutral value: anything else would silently change
# the maths, so it is refused instead of ignored.
_NEUTRAL_KWARGS = {
    "seqused_q": None,
    "seqused_k": None,
    "qv": None,
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
    "softcap": 0.0,
    "attention_chunk": 0,
    "num_splits": 1,
    "pack_gqa": None,
    "deterministic": False,
    "sm_margin": 0,
    "return_attn_probs": False,
    "dropout_p": 0.0,
}


def _load_varlen():
    """``(varlen_attn, parameter names)``, or ``(None, reason)`` when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:  # torch < 2.10
        return None, f"torch {torch.__version__} has no torch.nn.attention.varlen ({e})"
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _load_fused(name: str):
    """``(speedrun's backend function, None)``, or ``(None, reason)`` when speedrun is not importable."""
    import importlib

    module, function = _FUSED[name]
    try:
        return getattr(importlib.import_module(module), function), None
    except ImportError as e:
        return None, (f"SPEEDRUN_SHIM_BACKEND={name} needs the speedrun package on PYTHONPATH (the repository "
                      f"root) and the backend's packages installed: {e}")


# Resolved once at import, outside any compiled region: the signature differs between torch
# releases (2.10: ``is_causal``; later: ``scale`` and ``window_size``), and inspecting it inside
# the traced function would be wasted work on every call.
_VARLEN, _PARAMS = _load_varlen()
_FUSED_FN, _FUSED_PROBLEM = _load_fused(BACKEND) if BACKEND in _FUSED else (None, None)


def varlen_problem() -> str | None:
    """Why :func:`flash_attn_varlen_func` cannot run here, or None."""
    if BACKEND not in SHIM_BACKENDS:
        return f"SPEEDRUN_SHIM_BACKEND={BACKEND!r}: known backends are {', '.join(SHIM_BACKENDS)}"
    if BACKEND in _FUSED:
        return _FUSED_PROBLEM
    if _VARLEN is None:
        return _PARAMS
    if "window_size" not in _PARAMS and "is_causal" not in _PARAMS:
        return f"torch {torch.__version__}'s varlen_attn takes neither window_size nor is_causal"
    if not torch.cuda.is_available():
        return "varlen_attn runs on CUDA only and no CUDA device is visible"
    return None


def _check_extra(extra: dict) -> None:
    for name, value in extra.items():
        if name not in _NEUTRAL_KWARGS:
            raise TypeError(f"fa3_shim.flash_attn_varlen_func: unsupported FA3 argument {name}={value!r}")
        if value != _NEUTRAL_KWARGS[name]:
            raise NotImplementedError(
                f"fa3_shim.flash_attn_varlen_func: {name}={value!r} is not supported "
                f"(only {_NEUTRAL_KWARGS[name]!r}); torch's varlen_attn has no equivalent"
            )


def _require_cuda(q: torch.Tensor) -> None:
    # torch's own error on CPU ("Could not run 'aten::_flash_attention_forward' ...") hides the cause.
    if not q.is_cuda:
        raise RuntimeError(f"fa3_shim: torch's varlen_attn runs on CUDA only; got tensors on {q.device}")


def _window_kwargs(left: int, softmax_scale: float | None) -> dict:
    """Keyword arguments for this torch's varlen_attn: a causal window of ``left`` tokens."""
    kw = {}
    if softmax_scale is not None:
        if "scale" not in _PARAMS:
            raise NotImplementedError(f"torch {torch.__version__}'s varlen_attn takes no scale argument")
        kw["scale"] = softmax_scale
    if "window_size" in _PARAMS:
        kw["window_size"] = (left, 0)  # (left, 0) = causal with a left window; (-1, 0) = plain causal
    elif left == -1:
        kw["is_causal"] = True  # torch 2.10's API: causal only, no window
    else:
        raise NotImplementedError(
            f"torch {torch.__version__}'s varlen_attn has no window_size; upstream asks for a window of {left} tokens"
        )
    return kw


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple = (-1, -1),
    **extra,
) -> torch.Tensor:
    """FA3's ``flash_attn_varlen_func`` (the subset upstream uses) on torch's varlen_attn.

    q, k, v: (total_tokens, heads, head_dim), bf16/fp16 on CUDA.  cu_seqlens_*: (docs + 1,)
    cumulative document starts (padding entries equal to total_tokens are empty documents).
    window_size: ``(left, right)`` in tokens; right must be 0 (causal) and left -1 or a count.
    Returns the (total_tokens, heads, head_dim) output, like FA3 without ``return_attn_probs``.
    """
    _check_extra(extra)
    if not causal:
        raise NotImplementedError("fa3_shim.flash_attn_varlen_func: only causal=True is supported")
    left, right = window_size
    left = -1 if left is None else int(left)
    if int(right) not in (0, -1):  # FA treats right=-1 under causal as 0
        raise NotImplementedError(f"fa3_shim.flash_attn_varlen_func: window right={right} (only 0) is not supported")
    if BACKEND != "varlen":
        return _fused_call(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, left, softmax_scale)
    if _VARLEN is None:
        raise RuntimeError(f"fa3_shim: {_PARAMS}")
    _require_cuda(q)
    # FA3 takes int32 cu_seqlens; torch's kernel insists on them, so cast when needed (free when
    # already int32, which is what upstream's loader produces).
    cu_q = cu_seqlens_q if cu_seqlens_q.dtype == torch.int32 else cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k if cu_seqlens_k.dtype == torch.int32 else cu_seqlens_k.to(torch.int32)
    max_q = max_seqlen_q if isinstance(max_seqlen_q, int) else int(max_seqlen_q)
    max_k = max_seqlen_k if isinstance(max_seqlen_k, int) else int(max_seqlen_k)
    return _VARLEN(q, k, v, cu_q, cu_k, max_q, max_k, **_window_kwargs(left, softmax_scale))


def _fused_call(q, k, v, cu_q, cu_k, max_seqlen, left: int, softmax_scale) -> torch.Tensor:
    """The call on speedrun's fused backend: one ``cu_seqlens`` for queries and keys (upstream
    passes the same tensor for both), FA's left window in tokens as its ``window``."""
    problem = varlen_problem()
    if problem is not None:
        raise RuntimeError(f"fa3_shim: {problem}")
    if cu_k is not cu_q:
        raise NotImplementedError(f"fa3_shim ({BACKEND}): cu_seqlens_k must be cu_seqlens_q (self-attention over "
                                  "one packed batch)")
    return _FUSED_FN(q, k, v, cu_q, int(max_seqlen), window=None if left == -1 else left, scale=softmax_scale)
