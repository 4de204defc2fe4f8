"""cuDNN's fused attention (SDPA) through the cuDNN frontend's Python graph API.

Install with ``pip install -e ".[cudnn]"`` (the ``nvidia-cudnn-frontend`` package; the cuDNN
library itself is the one torch ships).  CUDA, Hopper (sm90) or newer: cuDNN takes packed
variable-length batches there only.  Q/K and V may have different widths (96 and 128 both run
natively, no padding), bf16 or fp16 (fp32 inputs are cast to bf16 and the result cast back).

Layout.  The packed batch is cuDNN's "THD" layout: ``q`` (T, H, D) is described to cuDNN as a
(B, H, S, D) tensor with token-major strides (S*H*D, D, H*D, 1), where B = len(cu_seqlens) - 1
document slots, S = the longest document allowed (``max_seqlen``, at most T), and a *ragged
offset* tensor (B+1,) gives each document's first element (``cu_seqlens * H * D``).  A padding
mask with per-document lengths ``cu_seqlens[1:] - cu_seqlens[:-1]`` keeps rows and keys past a
document's end out; the trailing empty slots of a padded ``cu_seqlens`` have length 0.

Masks.  Causal with an optional sliding window is cuDNN's diagonal band anchored top-left:
right bound 0 (no key after the query) and left bound ``window + 1`` (cuDNN's left bound counts
the diagonal: key j is kept when ``j > i - left_bound``, i.e. ``i - window <= j``).

Graphs.  A forward and a backward graph are built (validated, planned, compiled) once per shape
key (:class:`ShapeKey`: T, H, D_qk, D_v, cu_seqlens slots, window, S, scale, dtype, device) and
then only executed: building happens on the first call with a new key (do that in warmup, before
any CUDA-graph capture); executing launches cuDNN's kernels on torch's current stream with the
workspace taken from torch's caching allocator and the per-document lengths and offsets computed
on the GPU from ``cu_seqlens`` -- no host synchronisation, so calls can be captured in a CUDA graph.

Autograd and ``torch.compile``.  The forward and backward run as two custom ops
(``speedrun::cudnn_sdpa_fwd`` / ``speedrun::cudnn_sdpa_bwd``, with shape functions), joined by a
``torch.autograd.Function`` that Dynamo traces; inside a compiled graph each is one opaque node.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
import time
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

from speedrun.attention import check_inputs, half_precision, window_from_op
from speedrun.errors import ConfigError

INSTALL_HINT = 'pip install -e ".[cudnn]"'
# Older cuDNN backends have gaps in the frontend's support table for what this backend uses
# (sliding windows need 9.2, ragged layouts with several heads per group 9.6); torch 2.11's
# CUDA 13 wheels ship 9.19.
MIN_CUDNN_VERSION = 90600


class Uid(IntEnum):
    """Fixed tensor ids of the graphs' variant packs."""

    Q = 1
    K = 2
    V = 3
    O = 4  # noqa: E741 - cuDNN's name for the output
    STATS = 5
    DO = 6
    DQ = 7
    DK = 8
    DV = 9
    SEQ_Q = 10
    SEQ_KV = 11
    OFF_Q = 12
    OFF_K = 13
    OFF_V = 14
    OFF_O = 15
    OFF_STATS = 16


@dataclass(frozen=True)
class ShapeKey:
    """Everything a built cuDNN graph is specialised to.

    tokens: T; heads: H; d_qk, d_v: head widths; slots: len(cu_seqlens) (documents + 1, padding
    included); window: sliding window in tokens (None: full causal); max_seqlen: S, the per-document
    row bound given to cuDNN (already capped at T); scale: softmax scale; dtype: bf16 or fp16;
    device: CUDA device index (-1 for a non-CUDA device, which only tests with a fake module use)."""

    tokens: int
    heads: int
    d_qk: int
    d_v: int
    slots: int
    window: int | None
    max_seqlen: int
    scale: float
    dtype: torch.dtype
    device: int

    @property
    def docs(self) -> int:
        return self.slots - 1


def shape_key(q: torch.Tensor, v: torch.Tensor, slots: int, max_seqlen: int, window: int | None,
              scale: float) -> ShapeKey:
    """The :class:`ShapeKey` of one call: q (T, H, D_qk), v (T, H, D_v), ``slots`` = len(cu_seqlens)."""
    T, H, dqk = q.shape
    dev = q.device.index if q.device.type == "cuda" else -1
    if dev is None:
        dev = torch.cuda.current_device()
    return ShapeKey(int(T), int(H), int(dqk), int(v.shape[-1]), int(slots), None if window is None else int(window),
                    max(1, min(int(max_seqlen), int(T))), float(scale), q.dtype, int(dev))


def offset_multipliers(heads: int, d_qk: int, d_v: int, device: torch.device) -> torch.Tensor:
    """(3, 1) int64 elements per token of a packed width-d_qk tensor, width-d_v tensor and the
    (T, H, 1) statistics: H * d_qk, H * d_v, H.  Made once per shape (a host-to-device copy, so
    not under graph capture) and reused by every call."""
    return torch.tensor([[heads * d_qk], [heads * d_v], [heads]], dtype=torch.int64).to(device)


def ragged_offsets(cu_seqlens: torch.Tensor, multipliers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document lengths and element offsets from document starts, on cu_seqlens' device.

    cu_seqlens: (N+1,) int32 (trailing repeats of T allowed); multipliers: from
    :func:`offset_multipliers`.  Returns ``lengths`` (N, 1, 1, 1) int32 and ``offsets`` (3, N+1)
    int64: row 0 the first element of each document in a packed (T, H, D_qk) tensor, row 1 in a
    (T, H, D_v) one, row 2 in the (T, H, 1) softmax statistics.  Two kernels, no host sync."""
    cu = cu_seqlens.reshape(-1)
    lengths = (cu[1:] - cu[:-1]).to(torch.int32).view(-1, 1, 1, 1)
    return lengths, cu[None, :] * multipliers  # int32 * int64 -> int64 in one kernel


def _offset_views(offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = offsets.shape[1]
    return tuple(offsets[i].view(n, 1, 1, 1) for i in range(3))


def _packed_dims(key: ShapeKey, width: int) -> tuple[list[int], list[int]]:
    """(B, H, S, width) dims and token-major strides of a packed (T, H, width) tensor."""
    B, H, S = key.docs, key.heads, key.max_seqlen
    return [B, H, S, width], [S * H * width, width, H * width, 1]


def _mask_kwargs(cudnn, key: ShapeKey) -> dict:
    kw = {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "diagonal_band_right_bound": 0}
    if key.window is not None:
        kw["diagonal_band_left_bound"] = key.window + 1
    return kw


def _io_type(cudnn, dtype: torch.dtype):
    if dtype == torch.bfloat16:
        return cudnn.data_type.BFLOAT16
    if dtype == torch.float16:
        return cudnn.data_type.HALF
    raise ConfigError(f"cudnn attention takes bf16 or fp16 tensors, got {dtype}")


class _GraphBuilder:
    """Declares the packed tensors of one graph (shared by the forward and backward builders)."""

    def __init__(self, cudnn, handle, key: ShapeKey):
        self.cudnn, self.key = cudnn, key
        self.io = _io_type(cudnn, key.dtype)
        self.g = cudnn.pygraph(io_data_type=self.io, intermediate_data_type=cudnn.data_type.FLOAT,
                               compute_data_type=cudnn.data_type.FLOAT, handle=handle)
        B = key.docs
        one = [1, 1, 1, 1]
        self.seq_q = self.g.tensor(name="seq_len_q", dim=[B, 1, 1, 1], stride=one, data_type=cudnn.data_type.INT32,
                                   uid=int(Uid.SEQ_Q))
        self.seq_kv = self.g.tensor(name="seq_len_kv", dim=[B, 1, 1, 1], stride=one, data_type=cudnn.data_type.INT32,
                                    uid=int(Uid.SEQ_KV))
        self.off = {u: self.g.tensor(name=f"offset_{u.name.lower()}", dim=[B + 1, 1, 1, 1], stride=one,
                                     data_type=cudnn.data_type.INT64, uid=int(u))
                    for u in (Uid.OFF_Q, Uid.OFF_K, Uid.OFF_V, Uid.OFF_O, Uid.OFF_STATS)}

    def packed_input(self, uid: Uid, width: int, offset: Uid):
        dims, strides = _packed_dims(self.key, width)
        t = self.g.tensor(name=uid.name.lower(), dim=dims, stride=strides, data_type=self.io, uid=int(uid))
        t.set_ragged_offset(self.off[offset])
        return t

    def packed_output(self, t, uid: Uid, width: int, offset: Uid) -> None:
        dims, strides = _packed_dims(self.key, width)
        t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(self.io).set_uid(int(uid))
        t.set_ragged_offset(self.off[offset])

    def stats(self, t=None):
        """The (T, H, 1) fp32 log-sum-exp statistics: declared as output (t given) or input."""
        B, H, S = self.key.docs, self.key.heads, self.key.max_seqlen
        dims, strides = [B, H, S, 1], [S * H, 1, H, 1]
        if t is None:
            t = self.g.tensor(name="stats", dim=dims, stride=strides, data_type=self.cudnn.data_type.FLOAT,
                              uid=int(Uid.STATS))
        else:
            t.set_output(True).set_dim(dims).set_stride(strides).set_data_type(self.cudnn.data_type.FLOAT)
            t.set_uid(int(Uid.STATS))
        t.set_ragged_offset(self.off[Uid.OFF_STATS])
        return t

    def finish(self):
        self.g.build([self.cudnn.heur_mode.A, self.cudnn.heur_mode.FALLBACK])
        return self.g, int(self.g.get_workspace_size())


def build_forward_graph(cudnn, handle, key: ShapeKey):
    """Forward graph: Q, K, V, lengths, offsets -> O (T, H, D_v), Stats (T, H, 1).  Returns
    ``(graph, workspace bytes)``."""
    b = _GraphBuilder(cudnn, handle, key)
    q = b.packed_input(Uid.Q, key.d_qk, Uid.OFF_Q)
    k = b.packed_input(Uid.K, key.d_qk, Uid.OFF_K)
    v = b.packed_input(Uid.V, key.d_v, Uid.OFF_V)
    o, stats = b.g.sdpa(name="sdpa_fwd", q=q, k=k, v=v, generate_stats=True, attn_scale=key.scale,
                        use_padding_mask=True, seq_len_q=b.seq_q, seq_len_kv=b.seq_kv, **_mask_kwargs(cudnn, key))
    b.packed_output(o, Uid.O, key.d_v, Uid.OFF_O)
    b.stats(stats)
    return b.finish()


def build_backward_graph(cudnn, handle, key: ShapeKey):
    """Backward graph: Q, K, V, O, dO, Stats, lengths, offsets -> dQ, dK, dV.  Returns
    ``(graph, workspace bytes)``."""
    b = _GraphBuilder(cudnn, handle, key)
    q = b.packed_input(Uid.Q, key.d_qk, Uid.OFF_Q)
    k = b.packed_input(Uid.K, key.d_qk, Uid.OFF_K)
    v = b.packed_input(Uid.V, key.d_v, Uid.OFF_V)
    o = b.packed_input(Uid.O, key.d_v, Uid.OFF_O)
    do = b.packed_input(Uid.DO, key.d_v, Uid.OFF_O)
    stats = b.stats()
    # The total token count bounds cuDNN's internal fp32 dQ accumulator: without it the workspace
    # is sized for B * S rows (every slot at full length), many times T for padded cu_seqlens.
    total = max(64, math.ceil(key.tokens / 64) * 64)
    dq, dk, dv = b.g.sdpa_backward(name="sdpa_bwd", q=q, k=k, v=v, o=o, dO=do, stats=stats, attn_scale=key.scale,
                                   use_padding_mask=True, seq_len_q=b.seq_q, seq_len_kv=b.seq_kv,
                                   max_total_seq_len_q=total, max_total_seq_len_kv=total, **_mask_kwargs(cudnn, key))
    b.packed_output(dq, Uid.DQ, key.d_qk, Uid.OFF_Q)
    b.packed_output(dk, Uid.DK, key.d_qk, Uid.OFF_K)
    b.packed_output(dv, Uid.DV, key.d_v, Uid.OFF_V)
    return b.finish()


def import_cudnn():
    """``import cudnn`` (the frontend), making sure it talks to the cuDNN library torch loaded.

    The frontend opens libcudnn itself (from site-packages or the loader path); where it finds
    none (a wheel installed into another folder), it is pointed at the copy already mapped into
    this process by torch.  Raises ImportError when the package is missing."""
    import cudnn  # noqa: PLC0415 - optional dependency, imported on first use

    try:
        cudnn.backend_version()
    except Exception:  # noqa: BLE001 - no library opened yet: hand it torch's
        path = _loaded_libcudnn()
        module = getattr(cudnn, "_pybind_module", None)
        if path and module is not None and hasattr(module, "_set_dlhandle_cudnn"):
            lib = ctypes.CDLL(path)
            module._set_dlhandle_cudnn(ctypes.cast(lib._handle, ctypes.c_void_p).value)
    return cudnn


def _loaded_libcudnn() -> str | None:
    """Path of the libcudnn.so.N mapped into this process (Linux), if any."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1] if "/" in line else ""
                if os.path.basename(path).startswith("libcudnn.so"):
                    return path
    except OSError:
        pass
    return None


def _refuse_under_capture(key: ShapeKey, what: str) -> None:
    """A new shape met inside CUDA-graph capture cannot be set up there (cuDNN's planning
    allocates and synchronises): say so instead of failing inside the capture."""
    if key.device >= 0 and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"cudnn attention: asked to {what} for a new shape inside CUDA-graph capture ({key}); "
                           "run one eager forward and backward with these shapes before capturing")


class CudnnSDPA:
    """cuDNN handles and built graphs for one process; runs forward and backward.

    ``module``: the cuDNN frontend module (default: imported on first use; tests pass a fake).
    ``builds`` counts graph builds (one per new shape key and direction), ``build_seconds`` their
    host time (cuDNN plans and may compile kernels then)."""

    def __init__(self, module: Any = None):
        self._module = module
        self._handles: dict[int, int] = {}
        self._streams: dict[int, int] = {}  # the stream each device's handle was last set to
        self._graphs: dict[tuple[str, ShapeKey], tuple[Any, int]] = {}
        self._multipliers: dict[ShapeKey, torch.Tensor] = {}
        self.builds = 0
        self.build_seconds = 0.0

    @property
    def cudnn(self):
        if self._module is None:
            self._module = import_cudnn()
        return self._module

    def handle(self, device: int):
        h = self._handles.get(device)
        if h is None:
            if device >= 0:
                with torch.cuda.device(device):
                    h = self.cudnn.create_handle()
            else:
                h = self.cudnn.create_handle()
            self._handles[device] = h
        return h

    def graph(self, direction: str, key: ShapeKey) -> tuple[Any, int]:
        """The built ``(graph, workspace bytes)`` for ``direction`` ("fwd" or "bwd") and ``key``."""
        entry = self._graphs.get((direction, key))
        if entry is None:
            _refuse_under_capture(key, f"build the {direction} graph")
            build = build_forward_graph if direction == "fwd" else build_backward_graph
            handle = self.handle(key.device)
            start = time.perf_counter()
            try:
                # the frontend plans for the current device: make it the tensors' one
                with torch.cuda.device(key.device) if key.device >= 0 else contextlib.nullcontext():
                    entry = build(self.cudnn, handle, key)
            except ConfigError:
                raise
            except Exception as e:  # cuDNN refuses a configuration: name it
                raise RuntimeError(f"cuDNN could not build the attention {direction} graph for {key}: "
                                   f"{type(e).__name__}: {e}") from e
            self._graphs[(direction, key)] = entry
            self.builds += 1
            self.build_seconds += time.perf_counter() - start
        return entry

    def _execute(self, graph, workspace_bytes: int, pack: dict, device: torch.device, key: ShapeKey) -> None:
        handle = self.handle(key.device)
        if device.type == "cuda":
            # cuDNN runs on its handle's stream: follow torch's current stream (a capture stream
            # too); cudnnSetStream queries the driver, so only when the stream changed
            stream = torch.cuda.current_stream(device).cuda_stream
            if self._streams.get(key.device) != stream:
                self.cudnn.set_stream(handle=handle, stream=stream)
                self._streams[key.device] = stream
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        graph.execute({int(u): t for u, t in pack.items()}, workspace, handle=handle)

    def multipliers(self, key: ShapeKey, device: torch.device) -> torch.Tensor:
        m = self._multipliers.get(key)
        if m is None:
            _refuse_under_capture(key, "set up the offsets")
            m = self._multipliers[key] = offset_multipliers(key.heads, key.d_qk, key.d_v, device)
        return m

    def forward(self, q, k, v, cu_seqlens, max_seqlen: int, window: int | None, scale: float):
        """q, k (T, H, D_qk), v (T, H, D_v) contiguous bf16/fp16, cu_seqlens (N+1,) int32 ->
        ``(o (T, H, D_v), stats (T, H, 1) fp32, lengths, offsets)``; the last three feed
        :meth:`backward` (see :func:`ragged_offsets`)."""
        key = shape_key(q, v, cu_seqlens.numel(), max_seqlen, window, scale)
        graph, ws = self.graph("fwd", key)
        lengths, offsets = ragged_offsets(cu_seqlens, self.multipliers(key, q.device))
        off_qk, off_v, off_st = _offset_views(offsets)
        o = torch.empty(key.tokens, key.heads, key.d_v, dtype=v.dtype, device=q.device)
        stats = torch.empty(key.tokens, key.heads, 1, dtype=torch.float32, device=q.device)
        pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.STATS: stats, Uid.SEQ_Q: lengths, Uid.SEQ_KV: lengths,
                Uid.OFF_Q: off_qk, Uid.OFF_K: off_qk, Uid.OFF_V: off_v, Uid.OFF_O: off_v, Uid.OFF_STATS: off_st}
        self._execute(graph, ws, pack, q.device, key)
        return o, stats, lengths, offsets

    def backward(self, do, q, k, v, o, stats, lengths, offsets, max_seqlen: int, window: int | None, scale: float):
        """Gradients (dq, dk, dv) of the forward's o for upstream gradient ``do`` (T, H, D_v)."""
        key = shape_key(q, v, offsets.shape[1], max_seqlen, window, scale)
        graph, ws = self.graph("bwd", key)
        off_qk, off_v, off_st = _offset_views(offsets)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        pack = {Uid.Q: q, Uid.K: k, Uid.V: v, Uid.O: o, Uid.DO: do, Uid.STATS: stats, Uid.DQ: dq, Uid.DK: dk,
                Uid.DV: dv, Uid.SEQ_Q: lengths, Uid.SEQ_KV: lengths, Uid.OFF_Q: off_qk, Uid.OFF_K: off_qk,
                Uid.OFF_V: off_v, Uid.OFF_O: off_v, Uid.OFF_STATS: off_st}
        self._execute(graph, ws, pack, q.device, key)
        return dq, dk, dv


class _Runner:
    """Holds the process's :class:`CudnnSDPA` (created on first use; tests may swap it)."""

    sdpa: CudnnSDPA | None = None

    @classmethod
    def get(cls) -> CudnnSDPA:
        if cls.sdpa is None:
            cls.sdpa = CudnnSDPA()
        return cls.sdpa


def default_runner() -> CudnnSDPA:
    return _Runner.get()


def _fwd_impl(q, k, v, cu_seqlens, max_seqlen: int, window: int, scale: float):
    return default_runner().forward(q.contiguous(), k.contiguous(), v.contiguous(), cu_seqlens.contiguous(),
                                    max_seqlen, window_from_op(window), scale)


def _fwd_fake(q, k, v, cu_seqlens, max_seqlen, window, scale):
    T, H, _ = q.shape
    n = cu_seqlens.shape[0]
    return (torch.empty(T, H, v.shape[-1], dtype=v.dtype, device=q.device),
            torch.empty(T, H, 1, dtype=torch.float32, device=q.device),
            torch.empty(n - 1, 1, 1, 1, dtype=torch.int32, device=q.device),
            torch.empty(3, n, dtype=torch.int64, device=q.device))


def _bwd_impl(do, q, k, v, o, stats, lengths, offsets, max_seqlen: int, window: int, scale: float):
    return default_runner().backward(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                                     stats.contiguous(), lengths.contiguous(), offsets.contiguous(), max_seqlen,
                                     window_from_op(window), scale)


def _bwd_fake(do, q, k, v, o, stats, lengths, offsets, max_seqlen, window, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Low-level torch.library ops (as in speedrun.kernels.opaque): no int[] arguments, so Inductor's
# C++ wrapper can call them too; window -1 stands for "no window".  The forward also returns the
# document lengths and offsets it computed, which the backward reuses.
_LIB = torch.library.Library("speedrun", "FRAGMENT")
_LIB.define("cudnn_sdpa_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, int max_seqlen, int window, "
            "float scale) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define("cudnn_sdpa_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor stats, Tensor lengths, "
            "Tensor offsets, int max_seqlen, int window, float scale) -> (Tensor, Tensor, Tensor)")
_LIB.impl("cudnn_sdpa_fwd", _fwd_impl, "CompositeExplicitAutograd")
_LIB.impl("cudnn_sdpa_bwd", _bwd_impl, "CompositeExplicitAutograd")
torch.library.register_fake("speedrun::cudnn_sdpa_fwd", _fwd_fake, lib=_LIB)
torch.library.register_fake("speedrun::cudnn_sdpa_bwd", _bwd_fake, lib=_LIB)


class _CudnnAttention(torch.autograd.Function):
    """y = attention(q, k, v); backward through cuDNN's backward graph (saves o, the statistics and
    the document lengths and offsets)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen: int, window: int, scale: float):
        o, stats, lengths, offsets = torch.ops.speedrun.cudnn_sdpa_fwd(q, k, v, cu_seqlens, max_seqlen, window, scale)
        ctx.save_for_backward(q, k, v, o, stats, lengths, offsets)
        ctx.args = (max_seqlen, window, scale)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, stats, lengths, offsets = ctx.saved_tensors
        dq, dk, dv = torch.ops.speedrun.cudnn_sdpa_bwd(do.contiguous(), q, k, v, o, stats, lengths, offsets, *ctx.args)
        return dq, dk, dv, None, None, None, None


class _DiagonalOnly(torch.autograd.Function):
    """Window 0: every query sees only its own key, so the softmax weight is exactly 1 and the
    output is V itself (dQ = dK = 0, dV = dO).  cuDNN's band mask is not asked for this case: its
    left bound would be 1, which it does not compute correctly."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.qk = (q.shape, q.dtype, k.shape, k.dtype)
        return v.clone()

    @staticmethod
    def backward(ctx, do):
        qs, qd, ks, kd = ctx.qk
        return do.new_zeros(qs, dtype=qd), do.new_zeros(ks, dtype=kd), do


def cudnn_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """See :mod:`speedrun.attention`.  CUDA only; Q/K of any width cuDNN takes (multiples of 16,
    at most 128; 96 and 128 here) with V 128, no padding."""
    check_inputs(q, k, v, cu_seqlens, "cudnn")
    if q.device.type != "cuda":
        raise ConfigError(f"cudnn attention runs on CUDA only, got tensors on {q.device}")
    if window is not None and int(window) < 0:
        raise ConfigError(f"cudnn attention: window must be >= 0 or None, got {window}")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    out_dtype = v.dtype
    q, k, v = half_precision(q, k, v)
    if window is not None and int(window) == 0:
        y = _DiagonalOnly.apply(q, k, v)
        return y if y.dtype == out_dtype else y.to(out_dtype)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    y = _CudnnAttention.apply(q, k, v, cu, int(max_seqlen), -1 if window is None else int(window), float(scale))
    return y if y.dtype == out_dtype else y.to(out_dtype)


# cuDNN takes D_qk != D_v natively: producers should hand over unpadded Q/K.
cudnn_varlen_attention.pads_qk_to_v = False


def cudnn_problem(device: torch.device) -> str | None:
    """Why the cudnn backend cannot run on ``device`` (None if it can), including a tiny forward
    and backward checked against the reference backend (run once per device and process)."""
    on_cuda = device.type == "cuda" and torch.cuda.is_available()
    try:
        cudnn = import_cudnn()
    except ImportError:
        return (f"the nvidia-cudnn-frontend package is not installed ({INSTALL_HINT})"
                + ("" if on_cuda else "; and cuDNN attention runs on CUDA only"))
    except Exception as e:  # noqa: BLE001 - a broken install is reported, not raised
        return f"import cudnn failed: {type(e).__name__}: {e}"[:300]
    if not on_cuda:
        return "cuDNN attention runs on CUDA only"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < (9, 0):
        return "cuDNN's packed (THD) attention needs a Hopper (sm90) or newer GPU"
    try:
        version = int(cudnn.backend_version())
    except Exception as e:  # noqa: BLE001
        return f"the cuDNN frontend cannot reach the cuDNN library: {type(e).__name__}: {e}"[:300]
    if version < MIN_CUDNN_VERSION:
        return f"cuDNN {version} is older than {MIN_CUDNN_VERSION} (ragged sliding-window SDPA)"
    return _self_check(index)


@functools.cache
def _self_check(index: int) -> str | None:
    """:func:`speedrun.attention.selfcheck.check_against_reference`, once per device and process."""
    from speedrun.attention.selfcheck import check_against_reference

    return check_against_reference(cudnn_varlen_attention, torch.device("cuda", index))
