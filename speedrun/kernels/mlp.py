"""The ReLU² MLP ``y = relu(x W1ᵀ)² W2ᵀ`` with fused Triton GEMMs and three precisions.

Shapes (one flat token batch): x (T, D), w1 (H, D), w2 (D, H), y (T, D); record: D=768, H=3072.

Modes of :func:`relu2_mlp`:

``"bf16"``      up GEMM + ReLU² fused in Triton (bf16 ``post`` out), down GEMM ``post @ w2ᵀ`` in torch;
                backward: dpre = (g @ w2) * 2·sqrt(post) fused in Triton, dW2/dW1/dx torch bf16.
``"fp8_fwd"``   the record: forward GEMMs in FP8 e4m3 (x current-scaled, w1/w2 from the weight
                cache, ``post`` emitted by the up kernel both as bf16 and as e4m3 with a delayed
                scale for ``_scaled_mm``); backward as ``"bf16"`` from the saved bf16 ``post``.
``"fp8_full"``  all six GEMMs in FP8: forward as above but ``post`` is stored *only* as e4m3, row-major
                and transposed (both written by the up kernel's epilogue); backward quantises g to
                e5m2 (both layouts, one read), the dpre kernel runs e5m2 x e4m3 and emits dpre as e5m2
                in both layouts, then dW2 = gᵀ·post, dW1 = dpreᵀ·x, dx = dpre·W1 are ``_scaled_mm``
                with e5m2 gradients and e4m3 activations/weights.

What is saved for backward: never the pre-activation.  relu(pre) = sqrt(post) is rebuilt in the
dpre kernel's epilogue (post >= 0 and relu(pre) >= 0, so the square root is exact up to rounding).
bf16/fp8_fwd save x, post (bf16); fp8_full saves x as e4m3 (transposed layout only) and post as e4m3.

Scaling per tensor (dequantisation scale s, real ~= fp8 * s):

=========  ======  ============================================================================
tensor     dtype   policy
=========  ======  ============================================================================
x          e4m3    current (default): s = max|x| / 448 (one amax pass over (T, 768)); or delayed
                   (``MLPScaleState.input_scaling="delayed"``): s = amax(previous step) · 1.5 / 448,
                   this call's amax measured by the quantise kernel, no extra pass; or (fp8_fwd)
                   quantised by the caller and passed in (``x_fp8``), current scaling in torch ops
                   that torch.compile fuses into the norm producing x
w1, w2     e4m3    from :class:`~speedrun.kernels.fp8_cache.FP8WeightCache`, per update (the record
                   network: w1 current, w2 delayed after 16 bootstrap updates, as upstream), or
                   current scaling when no cache is passed (slow path for tests/eval)
post       e4m3    delayed: s = amax(previous step) · 1.8 / 448 (record's headroom); the up
                   kernel measures this call's amax on the fly; values above 448·s saturate
g          e5m2    as x (current or delayed), s = max|g| / 57344; the quantise kernel writes both layouts
dpre       e5m2    delayed: s = amax(previous step) · 2 / 57344, measured in the dpre epilogue
=========  ======  ============================================================================

Delayed scales live in :class:`MLPScaleState` (device tensors, no host sync) and are
step-synchronous: fixed through an optimizer step, then set by
:func:`~speedrun.kernels.fp8_cache.end_fp8_step` to the max over the step's micro-batches and ranks
(so N ranks quantise exactly like one rank with accumulation).  Before the first step end a call
calibrates from its own amax (one extra GEMM).

Kernels.  One fused GEMM, :func:`relu2_gemm`, in two variants behind one dispatcher: a plain
pointer-load kernel (any strides; runs in the CPU interpreter, ``TRITON_INTERPRET=1``, at small
shapes) and, on sm90 with K-major contiguous operands, a persistent TMA-descriptor kernel
(``USE_TMA``); both share one epilogue.  ``impl="tma"`` (the default) adds
a persistent kernel whose epilogue also goes through TMA (``post`` loaded, outputs stored by
descriptor in half tiles, the transposed FP8 layout as transposed boxes; it runs in the
interpreter too) wherever every tensor is TMA-ready.  A third route, ``impl="split"``, runs the GEMM through cuBLAS into a bf16 temporary and the same epilogue as a
bandwidth-bound Triton pass: it trades two passes over an (M, N) bf16 tensor for cuBLAS's faster
mainloop (benchmarks/bench_mlp.py times the routes, interleaved).  The route is chosen per call
(``impl``; the installed MLP passes ``train.mlp_gemm`` from :class:`speedrun.kernels.options.KernelOptions`)
and :data:`DEFAULT_GEMM_IMPL` picks one per direction and dtype.  FP8 outputs are produced as bit patterns by integer
arithmetic and stored through uint8 views: a kernel that stores an FP8 tile both row-major and
transposed gets corrupted bytes from the cvt path on sm90 with Triton 3.6's ptxas
(triton-lang/triton#11111, reproduced here).  Under the interpreter, whose bf16 dot and float
casts are inexact, the kernel upcasts dot operands to fp32 and rounds bf16 outputs itself
(``EXACT_CASTS``).  Without CUDA or the interpreter everything falls back to the PyTorch
references; FP8 GEMMs go through :func:`speedrun.kernels.fp8_ops.scaled_mm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from speedrun.kernels._triton import cdiv, interpreting, launch, sm_count, triton_usable
from speedrun.kernels.fp8_cache import (
    E4M3,
    E5M2,
    FP8_MAX,
    FP8Weight,
    _fp8_bits,
    _fp8_bits_hw,
    _round_to_grid,
    grid_constants,
    headroom_scale,
    InputScaling,
    quantize_current,
)
from speedrun.kernels.fp8_ops import cuda_capability, scaled_mm  # torch._scaled_mm on sm89+, exact fp32 emulation elsewhere
from speedrun.kernels.launch_notes import launch_note

MODES = ("bf16", "fp8_fwd", "fp8_full")
POST_HEADROOM = 1.8
DPRE_HEADROOM = 2.0
_FP8 = (E4M3, E5M2)


# ----------------------------------------------------------------------------------------------
# The fused GEMM: acc = a @ bᵀ, then the ReLU² epilogue (forward) or its derivative (backward)


@triton.jit
def _epilogue(
    acc, offs_m, offs_n, M, N, aux_ptr, out_ptr, q_ptr, qt_ptr, amax_ptr,
    a_scale_ptr, b_scale_ptr, aux_scale_ptr, q_scale_ptr,
    FORWARD: tl.constexpr, AB_SCALED: tl.constexpr, AUX_SCALED: tl.constexpr,
    STORE_OUT: tl.constexpr, STORE_Q: tl.constexpr, STORE_QT: tl.constexpr, Q_MAX: tl.constexpr,
    Q_E5M2: tl.constexpr, EXACT_CASTS: tl.constexpr,
    O_MANT: tl.constexpr, O_EMIN: tl.constexpr, O_SUB_C: tl.constexpr, O_MIN_NORMAL: tl.constexpr,
    Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr, Q_SUB_C: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
):
    """ReLU² (forward) or its derivative from post (backward) on one fp32 accumulator tile, then
    the bf16 and/or FP8 (row-major, transposed) stores and the running amax."""
    if AB_SCALED:
        acc = acc * (tl.load(a_scale_ptr) * tl.load(b_scale_ptr))
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    row_major = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    if FORWARD:
        r = tl.maximum(acc, 0.0)
        v = r * r
    else:
        post = tl.load(aux_ptr + row_major, mask=mask, other=0.0).to(tl.float32)
        if AUX_SCALED:
            post = post * tl.load(aux_scale_ptr)
        v = 2.0 * acc * tl.sqrt(post)
    if STORE_OUT:
        o = v
        if EXACT_CASTS:
            o = _round_to_grid(o, O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL)
        tl.store(out_ptr + row_major, o.to(out_ptr.dtype.element_ty), mask=mask)
    if STORE_Q or STORE_QT:
        inv = tl.math.div_rn(1.0, tl.load(q_scale_ptr))
        qf = tl.minimum(tl.maximum(v * inv, -Q_MAX), Q_MAX)
        if EXACT_CASTS or (STORE_Q and STORE_QT):
            # Both layouts from one tile: bit pattern by integer arithmetic (see _fp8_bits; the
            # hardware cvt path corrupts the transposed store here, triton-lang/triton#11111).
            q = _fp8_bits(qf, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL)
        else:
            q = _fp8_bits_hw(qf, Q_E5M2)
        if STORE_Q:
            tl.store(q_ptr + row_major, q, mask=mask)
        if STORE_QT:
            tl.store(qt_ptr + offs_n[None, :].to(tl.int64) * M + offs_m[:, None], q, mask=mask)
        tile_amax = tl.max(tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1), axis=0)
        tl.atomic_max(amax_ptr, tile_amax)


@triton.jit
def _grouped_tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of output tile ``tile`` in grouped order: GROUP_M row-blocks share each B
    column-block while it sits in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@triton.jit
def _tma_mainloop(a_desc, b_desc, pid_m, pid_n, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, EXACT_CASTS: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) accumulator of a @ bᵀ for one tile, operands through TMA."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
        b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
        if EXACT_CASTS:
            # The CPU interpreter's bf16 dot is wrong; its fp32 dot is exact.
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _relu2_gemm_kernel(
    a_ptr, b_ptr, aux_ptr, out_ptr, q_ptr, qt_ptr, amax_ptr,
    a_scale_ptr, b_scale_ptr, aux_scale_ptr, q_scale_ptr,
    M, N, K: tl.constexpr,
    stride_am, stride_ak, stride_bn, stride_bk,
    FORWARD: tl.constexpr, AB_SCALED: tl.constexpr, AUX_SCALED: tl.constexpr,
    STORE_OUT: tl.constexpr, STORE_Q: tl.constexpr, STORE_QT: tl.constexpr, Q_MAX: tl.constexpr,
    Q_E5M2: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EXACT_CASTS: tl.constexpr,
    O_MANT: tl.constexpr, O_EMIN: tl.constexpr, O_SUB_C: tl.constexpr, O_MIN_NORMAL: tl.constexpr,
    Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr, Q_SUB_C: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
):
    pid_m, pid_n = _grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Wrapped row indices keep the main-loop loads unmasked; the stores below are masked.
    rows_a = offs_m % M
    rows_b = offs_n % N
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + rows_b[:, None].to(tl.int64) * stride_bn + offs_k[None, :] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K is a constexpr: the loop bound must be a plain int for the CPU interpreter (numpy >= 2
    # rejects its 1-element runtime scalars as range() bounds), and K is one of very few widths.
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_ok = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=k_ok, other=0.0)
        if EXACT_CASTS:
            # The CPU interpreter's bf16 dot is wrong; its fp32 dot is exact.
            acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    _epilogue(
        acc, offs_m, offs_n, M, N, aux_ptr, out_ptr, q_ptr, qt_ptr, amax_ptr,
        a_scale_ptr, b_scale_ptr, aux_scale_ptr, q_scale_ptr,
        FORWARD, AB_SCALED, AUX_SCALED, STORE_OUT, STORE_Q, STORE_QT, Q_MAX, Q_E5M2, EXACT_CASTS,
        O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL,
    )


@triton.jit
def _relu2_gemm_tma_kernel(
    a_desc, b_desc, aux_ptr, out_ptr, q_ptr, qt_ptr, amax_ptr,
    a_scale_ptr, b_scale_ptr, aux_scale_ptr, q_scale_ptr,
    M, N, K: tl.constexpr,
    FORWARD: tl.constexpr, AB_SCALED: tl.constexpr, AUX_SCALED: tl.constexpr,
    STORE_OUT: tl.constexpr, STORE_Q: tl.constexpr, STORE_QT: tl.constexpr, Q_MAX: tl.constexpr,
    Q_E5M2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr,
    EXACT_CASTS: tl.constexpr,
    O_MANT: tl.constexpr, O_EMIN: tl.constexpr, O_SUB_C: tl.constexpr, O_MIN_NORMAL: tl.constexpr,
    Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr, Q_SUB_C: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
):
    """sm90 variant of :func:`_relu2_gemm_kernel`: persistent over output tiles (one program per
    SM), operands through TMA descriptors (K-major a (M, K) and b (N, K)); same epilogue."""
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=FLATTEN):
        pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _tma_mainloop(a_desc, b_desc, pid_m, pid_n, K, BLOCK_M, BLOCK_N, BLOCK_K, EXACT_CASTS)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        _epilogue(
            acc, offs_m, offs_n, M, N, aux_ptr, out_ptr, q_ptr, qt_ptr, amax_ptr,
            a_scale_ptr, b_scale_ptr, aux_scale_ptr, q_scale_ptr,
            FORWARD, AB_SCALED, AUX_SCALED, STORE_OUT, STORE_Q, STORE_QT, Q_MAX, Q_E5M2, EXACT_CASTS,
            O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL,
        )


@triton.jit
def _relu2_half_tile(
    acc, off_m, off_n, aux_desc, out_desc, q_desc, qt_desc, aux_scale, inv_q,
    FORWARD: tl.constexpr, AUX_SCALED: tl.constexpr, STORE_OUT: tl.constexpr, STORE_Q: tl.constexpr,
    STORE_QT: tl.constexpr, Q_MAX: tl.constexpr, Q_E5M2: tl.constexpr, EXACT_CASTS: tl.constexpr,
    O_MANT: tl.constexpr, O_EMIN: tl.constexpr, O_SUB_C: tl.constexpr, O_MIN_NORMAL: tl.constexpr,
    Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr, Q_SUB_C: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
):
    """:func:`_epilogue`'s arithmetic on one (BLOCK_M, BLOCK_N / 2) half of a scaled accumulator,
    with ``post`` read and the outputs written through TMA descriptors (out-of-range rows and
    columns are zero-filled on load and dropped on store, so no masks).  Returns the half's
    max|v| (0 when no FP8 output is stored)."""
    if FORWARD:
        r = tl.maximum(acc, 0.0)
        v = r * r
    else:
        post = aux_desc.load([off_m, off_n]).to(tl.float32)
        if AUX_SCALED:
            post = post * aux_scale
        v = 2.0 * acc * tl.sqrt(post)
    if STORE_OUT:
        o = v
        if EXACT_CASTS:
            o = _round_to_grid(o, O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL)
        out_desc.store([off_m, off_n], o.to(out_desc.dtype))
    half_amax = 0.0
    if STORE_Q or STORE_QT:
        qf = tl.minimum(tl.maximum(v * inv_q, -Q_MAX), Q_MAX)
        if EXACT_CASTS or STORE_QT:
            # integer bit patterns: the cvt path corrupts transposed FP8 tiles (see _epilogue)
            q = _fp8_bits(qf, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL)
        else:
            q = _fp8_bits_hw(qf, Q_E5M2)
        if STORE_Q:
            q_desc.store([off_m, off_n], q)
        if STORE_QT:
            qt_desc.store([off_n, off_m], tl.trans(q))
        half_amax = tl.max(tl.max(tl.abs(v), axis=1), axis=0)
    return half_amax


@triton.jit
def _relu2_tma_store_tile(
    tile, a_desc, b_desc, aux_desc, out_desc, q_desc, qt_desc, ab_scale, aux_scale, inv_q, M, N, K: tl.constexpr,
    FORWARD: tl.constexpr, AB_SCALED: tl.constexpr, AUX_SCALED: tl.constexpr,
    STORE_OUT: tl.constexpr, STORE_Q: tl.constexpr, STORE_QT: tl.constexpr, Q_MAX: tl.constexpr,
    Q_E5M2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EXACT_CASTS: tl.constexpr,
    O_MANT: tl.constexpr, O_EMIN: tl.constexpr, O_SUB_C: tl.constexpr, O_MIN_NORMAL: tl.constexpr,
    Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr, Q_SUB_C: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
):
    """One output tile of :func:`_relu2_gemm_tma_store_kernel`; returns its max|v|."""
    pid_m, pid_n = _grouped_tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = _tma_mainloop(a_desc, b_desc, pid_m, pid_n, K, BLOCK_M, BLOCK_N, BLOCK_K, EXACT_CASTS)
    if AB_SCALED:
        acc = acc * ab_scale
    acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
    m0 = pid_m * BLOCK_M
    n0 = pid_n * BLOCK_N
    amax0 = _relu2_half_tile(
        acc0, m0, n0, aux_desc, out_desc, q_desc, qt_desc, aux_scale, inv_q,
        FORWARD, AUX_SCALED, STORE_OUT, STORE_Q, STORE_QT, Q_MAX, Q_E5M2, EXACT_CASTS,
        O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL,
    )
    amax1 = _relu2_half_tile(
        acc1, m0, n0 + BLOCK_N // 2, aux_desc, out_desc, q_desc, qt_desc, aux_scale, inv_q,
        FORWARD, AUX_SCALED, STORE_OUT, STORE_Q, STORE_QT, Q_MAX, Q_E5M2, EXACT_CASTS,
        O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL,
    )
    return tl.maximum(amax0, amax1)


@triton.jit
def _relu2_gemm_tma_store_kernel(
    a_desc, b_desc, aux_desc, out_desc, q_desc, qt_desc, amax_ptr,
    a_scale_ptr, b_scale_ptr, aux_scale_ptr, q_scale_ptr,
    M, N, K: tl.constexpr,
    FORWARD: tl.constexpr, AB_SCALED: tl.constexpr, AUX_SCALED: tl.constexpr,
    STORE_OUT: tl.constexpr, STORE_Q: tl.constexpr, STORE_QT: tl.constexpr, Q_MAX: tl.constexpr,
    Q_E5M2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, PERSISTENT: tl.constexpr,
    EXACT_CASTS: tl.constexpr,
    O_MANT: tl.constexpr, O_EMIN: tl.constexpr, O_SUB_C: tl.constexpr, O_MIN_NORMAL: tl.constexpr,
    Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr, Q_SUB_C: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
):
    """:func:`_relu2_gemm_tma_kernel` with its epilogue through TMA as well: ``post`` (backward)
    is loaded and ``out``/``q``/``qt`` are stored by descriptor in two (BLOCK_M, BLOCK_N / 2)
    halves (half the epilogue's live registers; the stores are asynchronous, so they overlap the
    next tile's main loop; the transposed FP8 half is transposed in registers and stored as a
    (BLOCK_N / 2, BLOCK_M) box of ``qt``), and the FP8 amax is reduced per program, one atomic per
    program instead of one per tile.

    ``PERSISTENT``: one program per SM looping over tiles (the GPU); else one program per tile
    (the CPU interpreter, which cannot loop to a runtime bound)."""
    ab_scale = 1.0
    if AB_SCALED:
        ab_scale = tl.load(a_scale_ptr) * tl.load(b_scale_ptr)
    aux_scale = 1.0
    if AUX_SCALED:
        aux_scale = tl.load(aux_scale_ptr)
    inv_q = 1.0
    if STORE_Q:
        inv_q = tl.math.div_rn(1.0, tl.load(q_scale_ptr))
    if PERSISTENT:
        prog_amax = 0.0
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=FLATTEN):
            tile_amax = _relu2_tma_store_tile(
                tile, a_desc, b_desc, aux_desc, out_desc, q_desc, qt_desc, ab_scale, aux_scale, inv_q, M, N, K,
                FORWARD, AB_SCALED, AUX_SCALED, STORE_OUT, STORE_Q, STORE_QT, Q_MAX, Q_E5M2,
                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EXACT_CASTS,
                O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL,
            )
            prog_amax = tl.maximum(prog_amax, tile_amax)
    else:
        prog_amax = _relu2_tma_store_tile(
            tl.program_id(0), a_desc, b_desc, aux_desc, out_desc, q_desc, qt_desc, ab_scale, aux_scale, inv_q, M, N, K,
            FORWARD, AB_SCALED, AUX_SCALED, STORE_OUT, STORE_Q, STORE_QT, Q_MAX, Q_E5M2,
            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, EXACT_CASTS,
            O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL,
        )
    if STORE_Q or STORE_QT:
        tl.atomic_max(amax_ptr, prog_amax)


class GemmOut(NamedTuple):
    """Outputs of :func:`relu2_gemm`: ``out`` (M, N) or None, ``q`` (M, N) fp8 or None,
    ``qt`` (N, M) fp8 or None, ``amax`` 0-d fp32 (max-accumulated) or None."""

    out: torch.Tensor | None
    q: torch.Tensor | None
    qt: torch.Tensor | None
    amax: torch.Tensor | None


@triton.jit
def _relu2_epilogue_kernel(
    acc_ptr, aux_ptr, out_ptr, q_ptr, qt_ptr, amax_ptr,
    a_scale_ptr, b_scale_ptr, aux_scale_ptr, q_scale_ptr,
    M, N,
    FORWARD: tl.constexpr, AB_SCALED: tl.constexpr, AUX_SCALED: tl.constexpr,
    STORE_OUT: tl.constexpr, STORE_Q: tl.constexpr, STORE_QT: tl.constexpr, Q_MAX: tl.constexpr,
    Q_E5M2: tl.constexpr, EXACT_CASTS: tl.constexpr,
    O_MANT: tl.constexpr, O_EMIN: tl.constexpr, O_SUB_C: tl.constexpr, O_MIN_NORMAL: tl.constexpr,
    Q_MANT: tl.constexpr, Q_EMIN: tl.constexpr, Q_SUB_C: tl.constexpr, Q_MIN_NORMAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The ``split`` path's second half: the GEMM's (M, N) output (already scaled, 16-bit) through
    the same epilogue as the fused kernel, one tile per program (bandwidth-bound)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    acc = tl.load(acc_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    _epilogue(
        acc, offs_m, offs_n, M, N, aux_ptr, out_ptr, q_ptr, qt_ptr, amax_ptr,
        a_scale_ptr, b_scale_ptr, aux_scale_ptr, q_scale_ptr,
        FORWARD, AB_SCALED, AUX_SCALED, STORE_OUT, STORE_Q, STORE_QT, Q_MAX, Q_E5M2, EXACT_CASTS,
        O_MANT, O_EMIN, O_SUB_C, O_MIN_NORMAL, Q_MANT, Q_EMIN, Q_SUB_C, Q_MIN_NORMAL,
    )


# Per-dtype launch configurations for sm90: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages).
# The benchmark (benchmarks/bench_mlp.py --sweep) times alternatives; edit here from its numbers.
GPU_CONFIGS = {
    "bf16": (128, 256, 64, 8, 8, 3),
    "fp8": (128, 256, 128, 8, 8, 3),
}
# The TMA persistent kernel (sm90 and K-major contiguous operands only); USE_TMA False forces
# the pointer kernel everywhere.
# Keys "<dtype>" or, taking precedence for the forward (ReLU²) epilogue, "<dtype>_fwd".
TMA_CONFIGS = {
    "bf16": (128, 256, 64, 8, 8, 3),
    "fp8": (128, 256, 128, 8, 8, 3),
    "fp8_fwd": (128, 128, 128, 8, 8, 4),
}
# impl "tma" (:func:`_relu2_gemm_tma_store_kernel`, epilogue through TMA too), same keys.
TMA_STORE_CONFIGS = {
    "bf16": (128, 256, 64, 8, 8, 3),
    # the FP8 dpre (e5m2 both layouts): 256 x 128 tiles, the fastest of bench_mlp --sweep on the
    # H200 at T = 49,152 (faster than 128 x 256 and than the split route)
    "fp8": (256, 128, 128, 8, 8, 3),
    "fp8_fwd": (128, 256, 128, 8, 8, 3),
}
USE_TMA = True
TMA_FLATTEN = True
# How relu2_gemm runs by default: "fused" (one Triton GEMM with the ReLU² epilogue, pointer
# stores), "tma" (the same with the epilogue's loads and stores through TMA descriptors; where TMA
# cannot run, i.e. before sm90 or with strided or unaligned tensors, it runs as "fused") or "split" (the GEMM through cuBLAS with a 16-bit output, then the epilogue as a
# bandwidth-bound Triton pass: 2 extra passes over an (M, N) bf16 tensor for cuBLAS's faster
# mainloop).  Either one string for every call, or a choice per (direction, operand dtype).
# Default: "tma" in every direction and dtype (upstream's epilogue design), which beat the split
# route in interleaved timings (benchmarks/bench_mlp.py) once the TMA epilogue used 256 x 128 tiles.
DEFAULT_GEMM_IMPL: dict[tuple[str, bool], str] = {
    ("up", True): "tma", ("up", False): "tma", ("dpre", True): "tma", ("dpre", False): "tma",
}
GEMM_IMPLS = ("fused", "tma", "split")


def default_gemm_impl(forward: bool, fp8: bool, routes: str | dict[tuple[str, bool], str] | None = None) -> str:
    """The route of an up (forward) or dpre (backward) GEMM: ``routes`` itself when a name, its
    entry when a table like :data:`DEFAULT_GEMM_IMPL`, that table's entry when None."""
    routes = DEFAULT_GEMM_IMPL if routes is None else routes
    if isinstance(routes, str):
        return routes
    return routes[("up" if forward else "dpre", fp8)]


EPILOGUE_CONFIG = (64, 128, 8)  # BLOCK_M, BLOCK_N, num_warps of the split path's epilogue pass


def _tma_ready(t: torch.Tensor) -> bool:
    """Row-major contiguous with 16-byte aligned start and rows (what a TMA descriptor needs)."""
    return t.stride(1) == 1 and t.stride(0) == t.shape[1] and t.data_ptr() % 16 == 0 \
        and (t.shape[1] * t.element_size()) % 16 == 0


def _use_tma(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (USE_TMA and a.is_cuda and not interpreting()):
        return False
    if cuda_capability(a.device)[0] < 9:
        return False
    return _tma_ready(a) and _tma_ready(b)


def _use_tma_store(a, b, operands_tma, aux, out, out_q, out_qt) -> bool:
    """Whether the TMA-epilogue kernel can run: the operands TMA-ready (``operands_tma``: the
    :func:`_use_tma` answer on a GPU; the interpreter runs descriptors too, so it is tested on
    CPU) and every epilogue tensor TMA-ready."""
    if interpreting():
        operands_tma = _tma_ready(a) and _tma_ready(b)
    return operands_tma and all(_tma_ready(t) for t in (aux, out, out_q, out_qt) if t is not None)


_INTERP_CONFIG = (32, 64, 32, 2, 1, 1)  # few, fat programs: the interpreter pays a high cost per program


def _check_gemm_args(a, b, aux, aux_scale, a_scale, b_scale, q_dtype, q_scale, store_out, emit_transposed, amax):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"relu2_gemm: expected a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[0]
    if K % 16 or N % 16:
        raise ValueError(f"relu2_gemm: K and N must be multiples of 16, got a {tuple(a.shape)}, b {tuple(b.shape)}")
    a8, b8 = a.dtype in _FP8, b.dtype in _FP8
    if a8 != b8:
        raise ValueError(f"relu2_gemm: a and b must both be FP8 or both 16-bit, got {a.dtype} and {b.dtype}")
    if not a8 and (a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"relu2_gemm: 16-bit operands must be bf16 or fp16 of one dtype, got {a.dtype}, {b.dtype}")
    if a8 and (a_scale is None or b_scale is None):
        raise ValueError("relu2_gemm: FP8 operands need a_scale and b_scale")
    if aux is not None:
        if tuple(aux.shape) != (M, N) or not aux.is_contiguous():
            raise ValueError(f"relu2_gemm: aux (post) must be contiguous ({M}, {N}), got {tuple(aux.shape)}")
        if aux.dtype in _FP8 and aux_scale is None:
            raise ValueError("relu2_gemm: an FP8 aux (post) needs aux_scale")
    if (q_dtype is None) != (q_scale is None):
        raise ValueError("relu2_gemm: q_dtype and q_scale go together")
    if q_dtype is not None and q_dtype not in _FP8:
        raise ValueError(f"relu2_gemm: q_dtype must be an FP8 dtype, got {q_dtype}")
    if emit_transposed and q_dtype is None:
        raise ValueError("relu2_gemm: emit_transposed needs q_dtype/q_scale")
    if not store_out and q_dtype is None:
        raise ValueError("relu2_gemm: nothing to store (store_out=False and no q_dtype)")
    if amax is not None and (amax.dim() != 0 or amax.dtype != torch.float32):
        raise ValueError(f"relu2_gemm: amax must be a 0-d fp32 tensor, got {amax.dtype} {tuple(amax.shape)}")


def _gemm_outputs(a, b, q_dtype, store_out, out_dtype, emit_transposed, amax, out, out_q, out_qt):
    M, N = a.shape[0], b.shape[0]
    dev = a.device
    if store_out and out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=dev)
    if q_dtype is not None:
        if out_q is None:
            out_q = torch.empty((M, N), dtype=q_dtype, device=dev)
        if emit_transposed and out_qt is None:
            out_qt = torch.empty((N, M), dtype=q_dtype, device=dev)
        if amax is None:
            amax = torch.zeros((), dtype=torch.float32, device=dev)
    return (out if store_out else None), out_q, (out_qt if emit_transposed else None), amax


def relu2_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    aux: torch.Tensor | None = None,
    aux_scale: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    store_out: bool = True,
    out_dtype: torch.dtype = torch.bfloat16,
    q_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
    emit_transposed: bool = False,
    amax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_q: torch.Tensor | None = None,
    out_qt: torch.Tensor | None = None,
    impl: str | dict[tuple[str, bool], str] | None = None,
) -> GemmOut:
    """Fused ``acc = a @ bᵀ`` (fp32 accumulate) with a ReLU² epilogue (Triton).

    Forward (``aux`` None): ``v = relu(acc · a_scale · b_scale)²``.  Backward (``aux`` = post (M, N),
    bf16 or FP8 with ``aux_scale``): ``v = 2 · acc · a_scale · b_scale · sqrt(post)`` = dpre.

    Args:
        a: (M, K) bf16/fp16, or FP8 with ``a_scale`` (0-d fp32); any strides.
        b: (N, K), same kind as ``a`` (FP8 with ``b_scale``); any strides (``w2.t()`` is fine).
        store_out: write ``v`` as ``out_dtype`` (M, N).
        q_dtype, q_scale: also write ``clamp(v / q_scale, ±FMAX)`` as FP8 (M, N), and max-accumulate
            ``max|v|`` into ``amax``; ``emit_transposed`` adds the (N, M) layout from the same tile.
        out, out_q, out_qt, amax: optional preallocated outputs.
        impl: "fused" (one Triton kernel), "tma" (one Triton kernel, epilogue through TMA;
            "fused" where TMA cannot run) or "split" (cuBLAS GEMM to a bf16 (M, N) temporary,
            then the epilogue in Triton; the accumulator is rounded to bf16 before the epilogue);
            None = :data:`DEFAULT_GEMM_IMPL`'s route for this direction and dtype (a table like it
            picks from that table).

    K and N must be multiples of 16 (M is free).  Returns :class:`GemmOut`.
    """
    _check_gemm_args(a, b, aux, aux_scale, a_scale, b_scale, q_dtype, q_scale, store_out, emit_transposed, amax)
    impl = impl if isinstance(impl, str) else default_gemm_impl(aux is None, a.dtype in _FP8, impl)
    if impl not in GEMM_IMPLS:
        raise ValueError(f"relu2_gemm: impl must be one of {GEMM_IMPLS}, got {impl!r}")
    if not triton_usable(a):
        return relu2_gemm_reference(
            a, b, aux=aux, aux_scale=aux_scale, a_scale=a_scale, b_scale=b_scale, store_out=store_out,
            out_dtype=out_dtype, q_dtype=q_dtype, q_scale=q_scale, emit_transposed=emit_transposed,
            amax=amax, out=out, out_q=out_q, out_qt=out_qt,
        )
    out, out_q, out_qt, amax = _gemm_outputs(a, b, q_dtype, store_out, out_dtype, emit_transposed, amax, out, out_q, out_qt)
    M, K = a.shape
    N = b.shape[0]
    fp8 = a.dtype in _FP8
    dummy = a  # placeholder for pointers a constexpr branch never touches
    common = dict(
        FORWARD=aux is None, AB_SCALED=a_scale is not None, AUX_SCALED=aux is not None and aux.dtype in _FP8,
        STORE_OUT=out is not None, STORE_Q=out_q is not None, STORE_QT=out_qt is not None,
        Q_MAX=FP8_MAX[q_dtype] if q_dtype is not None else 1.0, Q_E5M2=q_dtype == E5M2,
        EXACT_CASTS=interpreting(),
        **{"O_" + k: v for k, v in grid_constants(out_dtype).items()},
        **{"Q_" + k: v for k, v in grid_constants(q_dtype or E4M3).items()},
    )
    ptrs = (
        aux if aux is not None else dummy,
        out if out is not None else dummy,
        out_q.view(torch.uint8) if out_q is not None else dummy,
        out_qt.view(torch.uint8) if out_qt is not None else dummy,
        amax if amax is not None else dummy,
        a_scale if a_scale is not None else dummy,
        b_scale if b_scale is not None else dummy,
        aux_scale if aux_scale is not None else dummy,
        q_scale if q_scale is not None else dummy,
    )
    if impl == "split":
        # cuBLAS: FP8 wants a row-major and b column-major (b.t() of a row-major (N, K) b).
        if fp8:
            acc = scaled_mm(a.contiguous(), b.contiguous().t(), a_scale, b_scale, out_dtype=torch.bfloat16,
                            use_fast_accum=True)
        else:
            acc = a @ b.t()
        bm, bn, warps = (32, 64, 1) if interpreting() else EPILOGUE_CONFIG
        grid = (cdiv(M, bm), cdiv(N, bn))
        with launch_note("_relu2_epilogue_kernel", reads=(acc, aux), writes=(out, out_q, out_qt)):
            launch(_relu2_epilogue_kernel, grid, acc, *ptrs, M, N, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
                                         **{**common, "AB_SCALED": False})
        return GemmOut(out, out_q, out_qt, amax)
    operands_tma = _use_tma(a, b)
    if impl == "tma" and _use_tma_store(a, b, operands_tma, aux, out, out_q, out_qt):
        _launch_tma_store(a, b, aux, out, out_q, out_qt, amax, a_scale, b_scale, aux_scale, q_scale, common)
        return GemmOut(out, out_q, out_qt, amax)
    if operands_tma:
        key = "fp8" if fp8 else "bf16"
        bm, bn, bk, gm, warps, stages = TMA_CONFIGS.get(key + "_fwd" if aux is None else key, TMA_CONFIGS[key])
        from triton.tools.tensor_descriptor import TensorDescriptor

        sms = sm_count(a.device)
        grid = (min(sms, cdiv(M, bm) * cdiv(N, bn)),)
        with launch_note("_relu2_gemm_tma_kernel", reads=(a, b, aux), writes=(out, out_q, out_qt), flops=2 * M * N * K):
            launch(_relu2_gemm_tma_kernel, grid,
                TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]), *ptrs,
                M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_SMS=sms, FLATTEN=TMA_FLATTEN,
                num_warps=warps, num_stages=stages, **common,
            )
        return GemmOut(out, out_q, out_qt, amax)
    bm, bn, bk, gm, warps, stages = _INTERP_CONFIG if interpreting() else GPU_CONFIGS["fp8" if fp8 else "bf16"]
    grid = (cdiv(M, bm) * cdiv(N, bn),)
    with launch_note("_relu2_gemm_kernel", reads=(a, b, aux), writes=(out, out_q, out_qt), flops=2 * M * N * K):
        launch(_relu2_gemm_kernel, grid,
            a, b, *ptrs, M, N, K,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            EVEN_K=K % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm,
            num_warps=warps, num_stages=stages, **common,
        )
    return GemmOut(out, out_q, out_qt, amax)


def _launch_tma_store(a, b, aux, out, out_q, out_qt, amax, a_scale, b_scale, aux_scale, q_scale, common) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = a.shape
    N = b.shape[0]
    key = "fp8" if a.dtype in _FP8 else "bf16"
    persistent = not interpreting()
    if not persistent:
        bm, bn, bk, gm, warps, stages = _INTERP_CONFIG
    else:
        bm, bn, bk, gm, warps, stages = TMA_STORE_CONFIGS.get(key + "_fwd" if aux is None else key,
                                                              TMA_STORE_CONFIGS[key])
    half = [bm, bn // 2]
    # A descriptor the kernel never reads stands in for absent tensors (constexpr-dead branches).
    out_desc = TensorDescriptor.from_tensor(out, half) if out is not None else None
    q_desc = TensorDescriptor.from_tensor(out_q.view(torch.uint8), half) if out_q is not None else None
    qt_desc = TensorDescriptor.from_tensor(out_qt.view(torch.uint8), half[::-1]) if out_qt is not None else None
    aux_desc = TensorDescriptor.from_tensor(aux, half) if aux is not None else None
    stand_in = next(d for d in (out_desc, q_desc, qt_desc) if d is not None)
    dummy = a
    tiles = cdiv(M, bm) * cdiv(N, bn)
    sms = sm_count(a.device) if persistent else tiles
    grid = (min(sms, tiles),)
    with launch_note("_relu2_gemm_tma_store_kernel", reads=(a, b, aux), writes=(out, out_q, out_qt), flops=2 * M * N * K):
        launch(_relu2_gemm_tma_store_kernel, grid,
            TensorDescriptor.from_tensor(a, [bm, bk]), TensorDescriptor.from_tensor(b, [bn, bk]),
            *(d if d is not None else stand_in for d in (aux_desc, out_desc, q_desc, qt_desc)),
            amax if amax is not None else dummy,
            a_scale if a_scale is not None else dummy, b_scale if b_scale is not None else dummy,
            aux_scale if aux_scale is not None else dummy, q_scale if q_scale is not None else dummy,
            M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, NUM_SMS=sms, FLATTEN=TMA_FLATTEN,
            PERSISTENT=persistent, num_warps=warps, num_stages=stages,
            **common,
        )


def relu2_gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    aux: torch.Tensor | None = None,
    aux_scale: torch.Tensor | None = None,
    a_scale: torch.Tensor | None = None,
    b_scale: torch.Tensor | None = None,
    store_out: bool = True,
    out_dtype: torch.dtype = torch.bfloat16,
    q_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
    emit_transposed: bool = False,
    amax: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_q: torch.Tensor | None = None,
    out_qt: torch.Tensor | None = None,
    impl: str | dict[tuple[str, bool], str] | None = None,
) -> GemmOut:
    """Plain-PyTorch reference of :func:`relu2_gemm` (same signature; fp32 math; ``impl``, the
    kernel's route, is ignored)."""
    _check_gemm_args(a, b, aux, aux_scale, a_scale, b_scale, q_dtype, q_scale, store_out, emit_transposed, amax)
    out, out_q, out_qt, amax = _gemm_outputs(a, b, q_dtype, store_out, out_dtype, emit_transposed, amax, out, out_q, out_qt)
    acc = a.float() @ b.float().t()
    if a_scale is not None:
        acc = acc * (a_scale * b_scale)
    if aux is None:
        v = torch.relu(acc).square()
    else:
        post = aux.float() * aux_scale if aux_scale is not None else aux.float()
        v = 2.0 * acc * post.sqrt()
    if out is not None:
        out.copy_(v)
    if q_dtype is not None:
        fmax = FP8_MAX[q_dtype]
        q = (v * (1.0 / q_scale)).clamp(-fmax, fmax).to(q_dtype)
        out_q.copy_(q)
        if out_qt is not None:
            out_qt.copy_(q.t())
        amax.copy_(torch.maximum(amax, v.abs().amax()))
    return GemmOut(out, out_q, out_qt, amax)


# ----------------------------------------------------------------------------------------------
# Delayed-scale state


@dataclass
class MLPScaleState(InputScaling):
    """Delayed scales of one MLP layer: ``post`` (e4m3, forward) and ``dpre`` (e5m2, backward),
    plus the scaling of its input x and output gradient g (:class:`InputScaling`'s fields:
    ``input_scaling="current"`` or ``"delayed"``).

    ``post_amax``/``dpre_amax`` are 0-d fp32 device tensors, fixed through an optimizer step; the
    scale is ``max(amax, 1e-12) · headroom / FMAX``.  The GEMM epilogues max-accumulate each call's
    amax into ``post_acc``/``dpre_acc``, and :func:`~speedrun.kernels.fp8_cache.end_fp8_step`
    turns those into the next step's amax (max over micro-batches and ranks).  Until the first
    step end (``*_ready`` False) a call calibrates: one extra GEMM measures its own amax.
    """

    post_amax: torch.Tensor
    dpre_amax: torch.Tensor
    post_acc: torch.Tensor | None = None
    dpre_acc: torch.Tensor | None = None
    post_headroom: float = POST_HEADROOM
    dpre_headroom: float = DPRE_HEADROOM
    post_ready: bool = False
    dpre_ready: bool = False
    calls: int = field(default=0)

    @classmethod
    def create(cls, device: torch.device | str | None = None, **kwargs) -> "MLPScaleState":
        z = lambda: torch.zeros((), dtype=torch.float32, device=device)  # noqa: E731
        return cls(post_amax=z(), dpre_amax=z(), **kwargs)

    def slot_scaling(self, slot: str) -> tuple[float, float]:
        if slot == "post":
            return self.post_headroom, FP8_MAX[E4M3]
        if slot == "dpre":
            return self.dpre_headroom, FP8_MAX[E5M2]
        return super().slot_scaling(slot)

    def post_scale(self, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The post scale from ``amax`` (default: the step's :attr:`post_amax`, computed once per
        step) and the headroom."""
        if amax is None:
            return self.step_scale("post")
        return headroom_scale(amax, self.post_headroom, FP8_MAX[E4M3])

    def dpre_scale(self, amax: torch.Tensor | None = None) -> torch.Tensor:
        """The dpre scale from ``amax`` (default: the step's :attr:`dpre_amax`, computed once per
        step) and the headroom."""
        if amax is None:
            return self.step_scale("dpre")
        return headroom_scale(amax, self.dpre_headroom, FP8_MAX[E5M2])


# ----------------------------------------------------------------------------------------------
# The MLP


def relu2_mlp_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``relu(x @ w1ᵀ)² @ w2ᵀ`` in fp32 math, returned in ``x.dtype``; differentiable by autograd.

    x (T, D), w1 (H, D), w2 (D, H) -> (T, D).
    """
    post = torch.relu(x.float() @ w1.float().t()).square()
    return (post @ w2.float().t()).to(x.dtype)


def _check_mlp_args(x, w1, w2, mode, cache):
    if mode not in MODES:
        raise ValueError(f"relu2_mlp: mode must be one of {MODES}, got {mode!r}")
    if x.dim() != 2 or w1.dim() != 2 or w2.dim() != 2:
        raise ValueError(
            f"relu2_mlp: expected x (T, D), w1 (H, D), w2 (D, H); got {tuple(x.shape)}, {tuple(w1.shape)}, {tuple(w2.shape)}"
        )
    T, D = x.shape
    H = w1.shape[0]
    if w1.shape[1] != D or tuple(w2.shape) != (D, H):
        raise ValueError(
            f"relu2_mlp: shape mismatch x {tuple(x.shape)}, w1 {tuple(w1.shape)} (want (H, {D})), w2 {tuple(w2.shape)} (want ({D}, H))"
        )
    if D % 16 or H % 16:
        raise ValueError(f"relu2_mlp: D and H must be multiples of 16, got x {tuple(x.shape)}, w1 {tuple(w1.shape)}")
    if mode != "bf16" and T % 16:
        raise ValueError(f"relu2_mlp: FP8 modes need T a multiple of 16 (scaled_mm), got x {tuple(x.shape)}")
    for name, t in (("x", x), ("w1", w1), ("w2", w2)):
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"relu2_mlp: {name} must be bf16 or fp16, got {t.dtype} with shape {tuple(t.shape)}")
    if cache is not None:
        if mode == "bf16":
            raise ValueError("relu2_mlp: an FP8 weight cache was passed with mode='bf16'")
        c1, c2 = cache
        if tuple(c1.data.shape) != tuple(w1.shape) or tuple(c2.data.shape) != tuple(w2.shape):
            raise ValueError(
                f"relu2_mlp: cache layouts {tuple(c1.data.shape)}, {tuple(c2.data.shape)} do not match w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}"
            )


def _weights_fp8(w1, w2, cache):
    if cache is not None:
        return cache
    q1, q1t, s1 = quantize_current(w1.detach(), fp8_dtype=E4M3)
    q2, q2t, s2 = quantize_current(w2.detach(), fp8_dtype=E4M3)
    return FP8Weight(q1, q1t, s1), FP8Weight(q2, q2t, s2)


class _Relu2MLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, w2, mode, c1, c2, state, x_fp8=None, gemm=None):
        ctx.mode = mode
        ctx.gemm = gemm  # relu2_gemm's impl (route name, table or None: the default)
        if mode == "bf16":
            post = relu2_gemm(x, w1, impl=gemm).out
            y = post @ w2.t()
            ctx.save_for_backward(x, w1, w2, post)
            return y
        full = mode == "fp8_full"
        if x_fp8 is not None:  # quantised by the caller (fp8_fwd only: no transposed layout needed)
            (xq, x_scale), xqt = x_fp8, None
        else:
            xq, xqt, x_scale = state.quantize_input(x, "x", transposed=full)
        if state.post_ready:
            post_scale = state.post_scale()
        else:  # before the first step end: this call's own amax (one extra GEMM)
            pre_post = relu2_gemm(xq, c1.data, a_scale=x_scale, b_scale=c1.scale, impl=gemm).out
            post_scale = state.post_scale(pre_post.float().abs().amax())
        r = relu2_gemm(
            xq, c1.data, a_scale=x_scale, b_scale=c1.scale, store_out=not full, out_dtype=x.dtype,
            q_dtype=E4M3, q_scale=post_scale, emit_transposed=full, amax=state.accumulator("post", x.device),
            impl=gemm,
        )
        y = scaled_mm(r.q, c2.data.t(), post_scale, c2.scale, out_dtype=x.dtype, use_fast_accum=True)
        if full:
            ctx.save_for_backward(xqt, x_scale, r.q, r.qt, post_scale, c1.data_t, c1.scale, c2.data_t, c2.scale)
            ctx.state = state
        else:
            ctx.save_for_backward(x, w1, w2, r.out)
        return y

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        if ctx.mode != "fp8_full":
            x, w1, w2, post = ctx.saved_tensors
            dpre = relu2_gemm(g, w2.t(), aux=post, out_dtype=g.dtype, impl=ctx.gemm).out
            dx = dpre @ w1
            sink = getattr(ctx, "dw_sink", None)
            if sink is not None:  # the caller's buffer takes dW1, dW2 (both (H, D)) in its GEMMs
                sink(0, dpre.t(), x)
                sink(1, post.t(), g)
                return dx, None, None, None, None, None, None, None, None
            dw1 = dpre.t() @ x
            # dW2 (D, H) as the transpose of a contiguous (H, D) product: the banks store w2 as
            # (H, D), whose gradient then needs no transposing copy (88 per step in the record)
            dw2 = (post.t() @ g).t()
            return dx, dw1, dw2, None, None, None, None, None, None
        xqt, x_scale, pq, pqt, p_scale, w1t, w1s, w2t, w2s = ctx.saved_tensors
        state = ctx.state
        gq, gqt, g_scale = state.quantize_input(g, "g", transposed=True)
        if state.dpre_ready:
            d_scale = state.dpre_scale()
        else:
            d = relu2_gemm(gq, w2t, aux=pq, aux_scale=p_scale, a_scale=g_scale, b_scale=w2s, impl=ctx.gemm).out
            d_scale = state.dpre_scale(d.float().abs().amax())
        r = relu2_gemm(
            gq, w2t, aux=pq, aux_scale=p_scale, a_scale=g_scale, b_scale=w2s, store_out=False,
            q_dtype=E5M2, q_scale=d_scale, emit_transposed=True, amax=state.accumulator("dpre", g.device),
            impl=ctx.gemm,
        )
        dtype = g.dtype
        dx = scaled_mm(r.q, w1t.t(), d_scale, w1s, out_dtype=dtype)
        dw1 = scaled_mm(r.qt, xqt.t(), d_scale, x_scale, out_dtype=dtype)
        dw2 = scaled_mm(pqt, gqt.t(), p_scale, g_scale, out_dtype=dtype).t()  # (H, D) contiguous, as above
        return dx, dw1, dw2, None, None, None, None, None, None


def _check_x_fp8(x2, mode, x_fp8):
    if x_fp8 is None:
        return
    if mode != "fp8_fwd":
        raise ValueError(f"relu2_mlp: a pre-quantised input (x_fp8) needs mode='fp8_fwd', got {mode!r}")
    q, scale = x_fp8
    if q.dtype != E4M3 or tuple(q.shape) != tuple(x2.shape) or not q.is_contiguous():
        raise ValueError(f"relu2_mlp: x_fp8 must be a contiguous e4m3 {tuple(x2.shape)} tensor like the flattened x, "
                         f"got {q.dtype} {tuple(q.shape)}")
    if scale.dtype != torch.float32 or scale.dim() != 0:
        raise ValueError(f"relu2_mlp: x_fp8's scale must be a 0-d fp32 tensor, got {scale.dtype} {tuple(scale.shape)}")


def _mlp_inputs(x, w1, w2, mode, cache, scales, x_fp8=None):
    """Checked (T, D) contiguous x, the FP8 weights (None in bf16 mode) and the scale state."""
    x2 = x.reshape(-1, x.shape[-1])
    _check_mlp_args(x2, w1, w2, mode, cache)
    _check_x_fp8(x2, mode, x_fp8)
    c1 = c2 = None
    if mode != "bf16":
        c1, c2 = _weights_fp8(w1, w2, cache)
        if scales is None:
            scales = MLPScaleState.create(x.device)
    return x2.contiguous(), c1, c2, scales


def relu2_mlp_forward(ctx, x, w1, w2, *, mode: str, cache=None, scales: "MLPScaleState | None" = None,
                      x_fp8=None, dw_sink=None, gemm=None) -> torch.Tensor:
    """The forward half of :func:`relu2_mlp` for callers that run forward and backward themselves
    (:mod:`speedrun.kernels.opaque`): same arguments, state for the backward kept on ``ctx`` (a
    :class:`~speedrun.kernels.opaque.KernelCtx`).  Returns y (..., D).

    ``dw_sink(which, a, b)`` (modes ``bf16`` and ``fp8_fwd``, whose weight gradients are bf16
    GEMMs): the backward hands it the operands of dW1 = ``a @ b`` (``which`` 0) and of dW2 as
    (H, D) (``which`` 1) instead of computing them, and returns None for both weights
    (:class:`speedrun.model.bank_grad.MLPBankGradAccumulator` adds them into its buffer)."""
    if dw_sink is not None and mode == "fp8_full":
        raise ValueError("relu2_mlp: dw_sink needs mode 'bf16' or 'fp8_fwd' (fp8_full's weight gradients "
                         "are FP8 GEMMs, which cannot add into a buffer)")
    x2, c1, c2, scales = _mlp_inputs(x, w1, w2, mode, cache, scales, x_fp8)
    ctx.x_shape = x.shape
    ctx.dw_sink = dw_sink
    y = _Relu2MLP.forward(ctx, x2, w1, w2, mode, c1, c2, scales, x_fp8, gemm)
    return y.reshape(*x.shape[:-1], w2.shape[0])


def relu2_mlp_backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward half: ``g`` (..., D) -> (dx like x, dw1 (H, D), dw2 (D, H)); dw2 is the
    transpose of a contiguous (H, D) tensor (the layout the record's bank stores w2 in).  With a
    ``dw_sink`` given to the forward, dw1 and dw2 are None (the sink took them)."""
    dx, dw1, dw2 = _Relu2MLP.backward(ctx, g.reshape(-1, g.shape[-1]))[:3]
    return dx.reshape(ctx.x_shape), dw1, dw2


def relu2_mlp(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    *,
    mode: str = "bf16",
    cache: tuple[FP8Weight, FP8Weight] | None = None,
    scales: MLPScaleState | None = None,
    x_fp8: tuple[torch.Tensor, torch.Tensor] | None = None,
    gemm: str | dict[tuple[str, bool], str] | None = None,
) -> torch.Tensor:
    """``relu(x @ w1ᵀ)² @ w2ᵀ`` with gradients for x, w1, w2 (see the module docstring for modes).

    Args:
        x: (T, D) bf16/fp16 (leading dims are flattened: (..., D) works); D, H multiples of 16, and
            T a multiple of 16 in the FP8 modes.
        w1: (H, D), w2: (D, H), same dtype as x (gradients come back in that dtype).
        mode: ``"bf16"``, ``"fp8_fwd"`` (record) or ``"fp8_full"``.
        cache: FP8 modes: ``(FP8Weight of w1 (H, D), FP8Weight of w2 (D, H))`` from
            :class:`~speedrun.kernels.fp8_cache.FP8WeightCache` (use ``.t()`` on an entry stored as
            (H, D)).  None quantises both weights now with current scaling (two extra reads each).
        scales: the layer's :class:`MLPScaleState` (delayed post/dpre scales).  None uses a fresh
            one, i.e. calibrates on this call (one extra GEMM forward and one backward).
        x_fp8: ``"fp8_fwd"`` only: ``(x_q (T, D) e4m3, scale 0-d fp32)``, x already quantised by the
            caller (``real ~= x_q * scale``; e.g. :func:`~speedrun.kernels.fp8_cache.quantize_current_graph`
            compiled into the code that makes x); the MLP then skips its own input quantisation.
            x itself is still needed (the backward's dW1 reads it in bf16).
        gemm: the GEMM route of every :func:`relu2_gemm` call (its ``impl``; None: the default
            per direction and dtype, :data:`DEFAULT_GEMM_IMPL`).
    """
    x2, c1, c2, scales = _mlp_inputs(x, w1, w2, mode, cache, scales, x_fp8)
    y = _Relu2MLP.apply(x2, w1, w2, mode, c1, c2, scales, x_fp8, gemm)
    return y.reshape(*x.shape[:-1], w2.shape[0])
