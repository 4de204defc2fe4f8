"""FlashAttention-4's CuTe-DSL kernels (the ``flash-attn-4`` package) as an attention backend.

Install with ``pip install -e ".[fa4]"`` (flash-attn-4 and NVIDIA's CuTe DSL with its CUDA 13
libraries, ~100 MB; no network at run time).  CUDA, Hopper (sm90) or newer.  Q/K and V may have
different widths (96 with V 128 runs natively, no padding), bf16 or fp16 (fp32 inputs are cast
to bf16 and the result cast back).

Masks.  FlashAttention's causal sliding window, ``window_size=(W, 0)``, keeps key j for query i
when ``i - W <= j <= i``: the contract of :mod:`speedrun.attention` as it stands; no window is
plain causal.  Documents are isolated by ``cu_seqlens`` (the padded trailing slots are empty
documents).

Kernels.  FA4 compiles each kernel configuration on the host the first time it meets it (CuTe
DSL, just in time) and keeps it for the process.  A configuration depends on the head widths,
the dtype, causal or windowed, and the direction, not on the token count or the window's value,
so a run compiles a handful, in its untimed warmup.  Later calls only launch, on torch's current
stream, with memory from torch's caching allocator and no host synchronisation (``max_seqlen``
is given), so they can be captured in a CUDA graph; a configuration first met inside a capture
is refused with a message (:func:`_new_config`), as compiling there cannot work.

Autograd and ``torch.compile``.  The forward and the backward run as two custom ops
(``speedrun::fa4_fwd`` / ``speedrun::fa4_bwd``, with shape functions), joined by a
``torch.autograd.Function`` that Dynamo traces; inside a compiled graph each is one opaque node.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import warnings

import torch

from speedrun.attention import check_inputs, half_precision, window_from_op
from speedrun.errors import ConfigError

INSTALL_HINT = 'pip install -e ".[fa4]"'
# The package's import name; flash-attn 2's wheel uses the same top-level name without ``cute``.
_MODULE = "flash_attn.cute.interface"


def _find_fa4() -> bool:
    """Whether FA4's interface module is installed (without importing it or CUDA code)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None and \
            importlib.util.find_spec("flash_attn.cute") is not None
    except (ImportError, ValueError):  # a parent that is not a package
        return False


@functools.cache
def _kernels():
    """FA4's forward and backward entry points (imported on first use: the CuTe DSL is heavy)."""
    module = importlib.import_module(_MODULE)
    return module._flash_attn_fwd, module._flash_attn_bwd


# (direction, D_qk, D_v, dtype, windowed, device index) met so far: FA4 compiles a kernel for each
_SEEN_CONFIGS: set[tuple] = set()


def _capturing(t: torch.Tensor) -> bool:
    """Whether ``t``'s device is capturing a CUDA graph on the current stream."""
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _new_config(direction: str, q: torch.Tensor, v: torch.Tensor, window: int) -> tuple | None:
    """The kernel configuration this call needs when FA4 has not compiled it yet (this call will),
    else None; a new one inside a CUDA-graph capture is refused with a message (FA4 would compile
    there, which a capture does not allow)."""
    key = (direction, q.shape[-1], v.shape[-1], q.dtype, window >= 0, q.device.index)
    if key in _SEEN_CONFIGS:
        return None
    if _capturing(q):
        raise RuntimeError(f"fa4 attention: a {direction} with D_qk={key[1]}, D_v={key[2]}, {key[3]}, "
                           f"{'windowed' if key[4] else 'causal'} met for the first time inside CUDA-graph "
                           "capture, where FA4 cannot compile it; run one eager forward and backward with "
                           "these shapes before capturing")
    return key


# While it compiles a kernel, the CuTe DSL warns that FA4's own ``aux_data`` argument is not a JIT
# argument (FA4 means it as a compile-time value): a note about FA4's code, nothing the caller can
# act on, printed for every kernel of every run.  Only that warning, only while compiling.
_FA4_COMPILE_NOISE = r"Argument aux_data \(position \d+\) cannot be converted to a JitArgument"


@contextlib.contextmanager
def _compiling(new_config: tuple | None):
    """Around a kernel call: when the call compiles ``new_config``, silence FA4's compile-time
    note, and count the configuration as compiled once the call has succeeded."""
    if new_config is None:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_FA4_COMPILE_NOISE, category=UserWarning)
        yield
    _SEEN_CONFIGS.add(new_config)


def _fwd_impl(q, k, v, cu_seqlens, max_seqlen: int, window: int, scale: float):
    fwd, _ = _kernels()
    with _compiling(_new_config("forward", q, v, window)):
        out, lse, *_ = fwd(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens_q=cu_seqlens,
                           cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
                           softmax_scale=scale, causal=True, window_size_left=window_from_op(window),
                           window_size_right=None, return_lse=True)
    return out, lse


def _fwd_fake(q, k, v, cu_seqlens, max_seqlen, window, scale):
    T, H, _ = q.shape
    return (torch.empty(T, H, v.shape[-1], dtype=q.dtype, device=q.device),
            torch.empty(H, T, dtype=torch.float32, device=q.device))


def _bwd_impl(dout, q, k, v, out, lse, cu_seqlens, max_seqlen: int, window: int, scale: float):
    _, bwd = _kernels()
    with _compiling(_new_config("backward", q, v, window)):
        dq, dk, dv = bwd(q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), dout.contiguous(),
                         lse.contiguous(), softmax_scale=scale, causal=True, window_size_left=window_from_op(window),
                         window_size_right=None, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
                         max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)[:3]
    return dq, dk, dv


def _bwd_fake(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Low-level torch.library ops, as the cudnn backend's: no int[] arguments, window -1 for "none".
_LIB = torch.library.Library("speedrun", "FRAGMENT")
_LIB.define("fa4_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, int window, float scale) "
            "-> (Tensor, Tensor)")
_LIB.define("fa4_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens, "
            "int max_seqlen, int window, float scale) -> (Tensor, Tensor, Tensor)")
_LIB.impl("fa4_fwd", _fwd_impl, "CompositeExplicitAutograd")
_LIB.impl("fa4_bwd", _bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("speedrun::fa4_fwd", _fwd_fake, lib=_LIB)
torch.library.register_fake("speedrun::fa4_bwd", _bwd_fake, lib=_LIB)


class _FA4Attention(torch.autograd.Function):
    """y = attention(q, k, v); the backward through FA4's (saves o and the log-sum-exp)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, window: int, scale: float):
        o, lse = torch.ops.speedrun.fa4_fwd(q, k, v, cu_seqlens, max_seqlen, window, scale)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.args = (max_seqlen, window, scale)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu = ctx.saved_tensors
        dq, dk, dv = torch.ops.speedrun.fa4_bwd(do.contiguous(), q, k, v, o, lse, cu, *ctx.args)
        return dq, dk, dv, None, None, None, None


def _check_device(q: torch.Tensor) -> None:
    if q.device.type != "cuda":
        raise ConfigError(f"fa4 attention runs on CUDA only, got tensors on {q.device}")


def fa4_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """See :mod:`speedrun.attention`.  CUDA only; Q/K and V widths multiples of 8 up to 256."""
    check_inputs(q, k, v, cu_seqlens, "fa4")
    _check_device(q)
    if window is not None and int(window) < 0:
        raise ConfigError(f"fa4 attention: window must be >= 0 or None, got {window}")
    for name, width in (("Q/K", q.shape[-1]), ("V", v.shape[-1])):
        if width % 8 or not 8 <= width <= 256:
            raise ConfigError(f"fa4 attention: {name} width {width} is not a multiple of 8 in [8, 256]")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out_dtype = v.dtype
    q, k, v = half_precision(q, k, v)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    y = _FA4Attention.apply(q, k, v, cu, int(max_seqlen), -1 if window is None else int(window), float(scale))
    return y if y.dtype == out_dtype else y.to(out_dtype)


# FA4 takes D_qk != D_v natively: producers should hand over unpadded Q/K.
fa4_varlen_attention.pads_qk_to_v = False


def fa4_problem(device: torch.device) -> str | None:
    """Why the fa4 backend cannot run on ``device`` (None if it can), including a tiny forward
    and backward checked against the reference backend (run once per device and process)."""
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    if not _find_fa4():
        return (f"the flash-attn-4 package is not installed ({INSTALL_HINT})"
                + ("" if on_cuda else "; and FA4 runs on CUDA only"))
    if not on_cuda:
        return "FA4 runs on CUDA only"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (9, 0):
        return "this backend uses FA4's Hopper (sm90) and newer kernels; this GPU is older"
    try:
        _kernels()
    except Exception as e:  # noqa: BLE001 - a broken install (a missing CuTe DSL library) is reported
        return f"import {_MODULE} failed: {type(e).__name__}: {e}"[:300]
    return _self_check(index)


@functools.cache
def _self_check(index: int) -> str | None:
    """:func:`speedrun.attention.selfcheck.check_against_reference`, once per device and process."""
    from speedrun.attention.selfcheck import check_against_reference

    return check_against_reference(fa4_varlen_attention, torch.device("cuda", index))
