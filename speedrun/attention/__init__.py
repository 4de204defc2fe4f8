"""Attention backends behind one call.

Every backend computes causal, document-masked, optionally sliding-window attention over one
packed sequence of documents::

    y = backend(q, k, v, cu_seqlens, max_seqlen, window=W, scale=s)

- ``q``, ``k``: (T, H, D_qk); ``v``: (T, H, D_v); D_qk may differ from D_v.  bf16 or fp32.
- ``cu_seqlens``: (N+1,) int32 document starts, last entry T; trailing repeats of T (empty
  documents) are allowed, so the tensor can be padded to a fixed size.
- ``max_seqlen``: an upper bound on any document's length (int).
- ``window``: query i sees keys j of its own document with ``i - window <= j <= i``
  (``None``: the whole causal prefix of the document).
- ``scale``: softmax scale applied to q.k.
- returns y: (T, H, D_v) in v's dtype.

Backends: ``reference`` (plain PyTorch, any device, the test oracle), ``flex`` (FlexAttention
with block masks; takes D_qk != D_v natively), ``varlen`` (torch's built-in FlashAttention varlen
kernel; pads Q/K with zeros to D_v), ``fa3`` (FlashAttention-3 through the optional ``kernels``
package), ``cudnn`` (cuDNN's fused attention through the optional ``nvidia-cudnn-frontend``
package; takes D_qk != D_v natively), ``fa4`` (FlashAttention-4's CuTe-DSL kernels through the
optional ``flash-attn-4`` package; takes D_qk != D_v natively).  ``auto`` picks the fastest
that works on the tensors' device; on CUDA a backend with a self-check (fa4, cudnn) must also
pass it, and when ``auto`` passes over one of them it says why once (an
:class:`AttentionFallbackWarning` naming the reason and the install command; naming a backend, or
``PYTHONWARNINGS="ignore:attention backend auto"``, keeps it quiet).

A backend function with ``pads_qk_to_v = True`` runs with D_qk == D_v only and zero-pads narrower
Q/K itself; a caller that can produce Q/K already padded (zeros in the extra columns, ``scale``
passed explicitly) saves those copies.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch

from speedrun.errors import ConfigError

AttentionFn = Callable[..., torch.Tensor]

# Preference order for "auto" on CUDA: fastest first at the record's stage-3 shapes on Hopper,
# both Q/K widths, as benchmarks/bench_attention.py measured them (docs/status.md, "Attention
# alone"); fa3 has never run here (it needs the network), so it comes after the measured ones.
_CUDA_PREFERENCE = ("fa4", "cudnn", "fa3", "varlen", "flex", "reference")
# the fused backends whose absence or failed self-check ``auto`` reports: each is faster than
# what it falls back to, so a user should hear why it was not used
_REPORTED_WHEN_SKIPPED = ("fa4", "cudnn")
BACKENDS = ("reference", "flex", "varlen", "fa3", "cudnn", "fa4")


def _load(name: str) -> AttentionFn:
    if name == "reference":
        from speedrun.attention.reference import reference_attention

        return reference_attention
    if name == "flex":
        from speedrun.attention.flex import flex_varlen_attention

        return flex_varlen_attention
    if name == "varlen":
        from speedrun.attention.varlen import torch_varlen_attention

        return torch_varlen_attention
    if name == "fa3":
        from speedrun.attention.fa3 import fa3_varlen_attention

        return fa3_varlen_attention
    if name == "cudnn":
        from speedrun.attention.cudnn import cudnn_varlen_attention

        return cudnn_varlen_attention
    if name == "fa4":
        from speedrun.attention.fa4 import fa4_varlen_attention

        return fa4_varlen_attention
    raise ConfigError(f"unknown attention backend {name!r}; known: {', '.join(BACKENDS)}, auto")


def backend_problem(name: str, device: torch.device | str) -> str | None:
    """Why backend ``name`` cannot run on ``device`` (None if it can)."""
    device = torch.device(device)
    if name == "reference":
        return None
    if name == "flex":
        from speedrun.attention.flex import flex_problem

        return flex_problem(device)
    if name == "varlen":
        from speedrun.attention.varlen import varlen_problem

        return varlen_problem(device)
    if name == "fa3":
        from speedrun.attention.fa3 import fa3_problem

        return fa3_problem(device)
    if name == "cudnn":
        from speedrun.attention.cudnn import cudnn_problem

        return cudnn_problem(device)
    if name == "fa4":
        from speedrun.attention.fa4 import fa4_problem

        return fa4_problem(device)
    return f"unknown attention backend {name!r}"


def resolve_backend(name: str, device: torch.device | str) -> str:
    """Turn ``auto`` into a concrete backend name for ``device``; check an explicit name works."""
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda":
            return "reference"
        skipped: list[tuple[str, str]] = []
        for candidate in _CUDA_PREFERENCE:
            problem = backend_problem(candidate, device)
            if problem is None:
                break
            if candidate in _REPORTED_WHEN_SKIPPED:
                skipped.append((candidate, problem))
        else:
            candidate = "reference"
        if skipped:
            _warn_skipped(tuple(skipped), candidate)
        return candidate
    problem = backend_problem(name, device)
    if problem:
        raise ConfigError(f"attention backend {name!r} cannot run on {device}: {problem}")
    return name


class AttentionFallbackWarning(UserWarning):
    """``auto`` passed over a faster attention backend (not installed, or its self-check failed)."""


@functools.cache
def _warn_skipped(skipped: tuple[tuple[str, str], ...], chosen: str) -> None:
    """Say once, in one warning, why ``auto`` passed over the faster backends and what it took."""
    reasons = "; ".join(f"skipping {name}: {problem}" for name, problem in skipped)
    warnings.warn(f"attention backend auto: {reasons}; using {chosen}", AttentionFallbackWarning, stacklevel=3)


def get_backend(name: str, device: torch.device | str = "cpu") -> AttentionFn:
    """The attention function for backend ``name`` (``auto`` resolved for ``device``)."""
    return _load(resolve_backend(name, device))


def available_backends(device: torch.device | str | None = None) -> dict[str, tuple[bool, str]]:
    """For each backend: (works, detail), checked by running a tiny problem against the reference."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    out: dict[str, tuple[bool, str]] = {}
    from speedrun.attention.reference import reference_attention

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    T, H, dqk, dv = 64, 2, 32, 64
    q, k = (torch.randn(T, H, dqk, generator=g).to(device, dtype) for _ in range(2))
    v = torch.randn(T, H, dv, generator=g).to(device, dtype)
    cu = torch.tensor([0, 20, 64, 64], dtype=torch.int32, device=device)
    ref = reference_attention(q.float(), k.float(), v.float(), cu, 44, window=16, scale=0.2)
    for name in BACKENDS:
        problem = backend_problem(name, device)
        if problem:
            out[name] = (False, problem)
            continue
        try:
            y = _load(name)(q, k, v, cu, 44, window=16, scale=0.2).float()
            err = ((y - ref).norm() / ref.norm()).item()
            ok = err < 2e-2
            out[name] = (ok, f"rel err {err:.1e} vs reference" + ("" if ok else " (too large)"))
        except Exception as e:  # a backend that imports but fails to run is reported, not raised
            out[name] = (False, f"{type(e).__name__}: {e}"[:200])
    return out


def window_from_op(window: int) -> int | None:
    """The window of the fused backends' custom ops (an int argument: -1 for "no window") as the
    contract's ``window`` (None for no window)."""
    return None if window < 0 else window


def half_precision(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` in one 16-bit dtype, as the fused kernels take them: q's when it is bf16 or
    fp16, else bf16 (the caller casts the result back to its own dtype)."""
    if q.dtype not in (torch.bfloat16, torch.float16):
        return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return q, k.to(q.dtype), v.to(q.dtype)
    return q, k, v


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, backend: str) -> None:
    """Raise ConfigError naming the backend and shapes when inputs do not fit the interface."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ConfigError(f"{backend} attention wants (T, H, D) tensors, got q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)}")
    if q.shape != k.shape:
        raise ConfigError(f"{backend} attention: q{tuple(q.shape)} and k{tuple(k.shape)} must have the same shape")
    if v.shape[:2] != q.shape[:2]:
        raise ConfigError(f"{backend} attention: v{tuple(v.shape)} must match q{tuple(q.shape)} in (T, H)")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ConfigError(f"{backend} attention: cu_seqlens must be 1-D with >= 2 entries, got {tuple(cu_seqlens.shape)}")
