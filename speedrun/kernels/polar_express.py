"""Polar Express orthogonalisation for the NorMuon optimizer, with its symmetric Triton GEMMs.

Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932) approximates the polar factor
``U V^T`` of ``G = U S V^T`` with a fixed number of odd matrix polynomials ``X <- a X + b (XX^T) X
+ c (XX^T)^2 X``.  Each iteration needs one Gram matrix (``X X^T`` for wide X, ``X^T X`` for tall X),
one symmetric "b*A + c*A@A" and one general GEMM.  The ``a X`` term rides in the symmetric
product's diagonal (``X (aI + bA + cA^2)``), so the general GEMM is a plain ``bmm``: a
``baddbmm`` into a separate output first copies its addend there (a bank-sized device copy per
iteration) and then reads it again.  The Gram matrix and ``A@A`` are symmetric, so
the Triton kernels here compute only the tiles on or above the diagonal and store each tile twice
(itself and its mirror), which halves the FLOPs of those two products.

Kernels (each has a plain-PyTorch reference of the same signature; all take bf16/fp16/fp32 inputs,
accumulate in fp32 and write ``out``'s dtype):

- :func:`xxt` ``(A (B, M, K) or (M, K), out (B, M, M) or (M, M)) -> out``: ``out = A @ A^T``.
- :func:`xtx` ``(A (B, M, K) or (M, K), out (B, K, K) or (K, K)) -> out``: ``out = A^T @ A``.
- :func:`ba_plus_caa` ``(A (B, M, M) symmetric, alpha, beta, out, diag=0) -> out``:
  ``out = alpha * A @ A^T + beta * A + diag * I``.

Dispatch: Triton on CUDA tensors; the references on CPU unless ``use_triton=True`` is forced, which
on CPU needs ``TRITON_INTERPRET=1`` set before this module is imported (the CPU tests do that at
small shapes).  Importing this module touches no GPU.
"""

from __future__ import annotations

import torch
from torch import Tensor

from speedrun.kernels._triton import launch, sm_count
from speedrun.kernels.launch_notes import launch_note

try:  # Triton is optional on CPU-only installs; the references then do all the work.
    import triton
    import triton.language as tl

    _HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None
    _HAVE_TRITON = False

__all__ = [
    "POLAR_EXPRESS_COEFFS",
    "PRE_NORM_SAFETY",
    "PRE_NORM_EPS",
    "xxt",
    "xxt_reference",
    "xtx",
    "xtx_reference",
    "ba_plus_caa",
    "ba_plus_caa_reference",
    "polar_express",
    "polar_express_normalize",
    "polar_express_iterate",
    "polar_express_reference",
    "triton_interpreted",
]

# The record's five (a, b, c) triples: X <- a X + b (XX^T) X + c (XX^T)^2 X.  They were optimised for
# 5 iterations with a 2e-2 safety factor and cushion 2 (record recipe §4.1, train_gpt.py L168-L174).
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Pre-normalisation X / (||X||_F * PRE_NORM_SAFETY + PRE_NORM_EPS) puts the spectral norm below 1
# with a little room, since the polynomials were fitted on (0, 1].
PRE_NORM_SAFETY = 1.02
PRE_NORM_EPS = 1e-6

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ------------------------------------------------------------------------------------------------
# Triton kernels

if _HAVE_TRITON:

    @triton.jit
    def _upper_tile(pid_tile, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Map a flat tile id to the (row, col) origin of an output tile of an N x N result.

        Tiles are visited in groups of GROUP_M tile-rows so that neighbouring programs share input
        rows in L2.  Returns (row0, col0, keep) where keep is False for tiles wholly below the
        diagonal, which the mirror store of another tile covers.
        """
        tiles_m = tl.cdiv(N, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        group = pid_tile // per_group
        first_m = group * GROUP_M
        rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
        tm = first_m + (pid_tile % per_group) % rows_in_group
        tn = (pid_tile % per_group) // rows_in_group
        row0 = tm * BLOCK_M
        col0 = tn * BLOCK_N
        keep = row0 < col0 + BLOCK_N
        return row0, col0, keep

    @triton.jit
    def _store_sym(c_base, acc, offs_r, offs_c, N, s_r, s_c):
        """Store tile ``acc`` at (offs_r, offs_c) and its transpose at (offs_c, offs_r)."""
        out = acc.to(c_base.dtype.element_ty)
        mask = (offs_r[:, None] < N) & (offs_c[None, :] < N)
        tl.store(c_base + offs_r[:, None] * s_r + offs_c[None, :] * s_c, out, mask=mask)
        mask_t = (offs_c[:, None] < N) & (offs_r[None, :] < N)
        tl.store(c_base + offs_c[:, None] * s_r + offs_r[None, :] * s_c, tl.trans(out), mask=mask_t)

    @triton.jit
    def _row_gram_tile(a_base, offs_r, offs_c, N, K, s_r, s_c,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INTERPRET: tl.constexpr):
        """fp32 tile of sum_k A[r, k] A[c, k] for rows offs_r x offs_c of an (N, K) matrix."""
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if INTERPRET:
            # The interpreter (numpy 2.x) cannot take a runtime bound in range(); a while loop
            # computes the same thing.  On GPU the for-loop form is kept so it gets pipelined.
            k0 = 0
            while k0 < K:
                kk = k0 + offs_k
                lhs = tl.load(a_base + offs_r[:, None] * s_r + kk[None, :] * s_c,
                              mask=(offs_r[:, None] < N) & (kk[None, :] < K), other=0.0)
                rhs = tl.load(a_base + offs_c[:, None] * s_r + kk[None, :] * s_c,
                              mask=(offs_c[:, None] < N) & (kk[None, :] < K), other=0.0)
                # The interpreter's bf16 dot is wrong (numpy has no bf16); fp32 operands are exact.
                acc = tl.dot(lhs.to(tl.float32), tl.trans(rhs.to(tl.float32)), acc)
                k0 += BLOCK_K
        else:
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + offs_k
                lhs = tl.load(a_base + offs_r[:, None] * s_r + kk[None, :] * s_c,
                              mask=(offs_r[:, None] < N) & (kk[None, :] < K), other=0.0)
                rhs = tl.load(a_base + offs_c[:, None] * s_r + kk[None, :] * s_c,
                              mask=(offs_c[:, None] < N) & (kk[None, :] < K), other=0.0)
                acc = tl.dot(lhs, tl.trans(rhs), acc)
        return acc

    @triton.jit
    def _col_gram_tile(a_base, offs_i, offs_j, M, K, s_r, s_c,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       INTERPRET: tl.constexpr):
        """fp32 tile of sum_r A[r, i] A[r, j] for columns offs_i x offs_j of an (M, K) matrix."""
        offs_r = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if INTERPRET:
            r0 = 0
            while r0 < M:
                rr = r0 + offs_r
                lhs_t = tl.load(a_base + rr[:, None] * s_r + offs_i[None, :] * s_c,
                                mask=(rr[:, None] < M) & (offs_i[None, :] < K), other=0.0)
                rhs = tl.load(a_base + rr[:, None] * s_r + offs_j[None, :] * s_c,
                              mask=(rr[:, None] < M) & (offs_j[None, :] < K), other=0.0)
                acc = tl.dot(tl.trans(lhs_t.to(tl.float32)), rhs.to(tl.float32), acc)
                r0 += BLOCK_K
        else:
            for r0 in range(0, M, BLOCK_K):
                rr = r0 + offs_r
                lhs_t = tl.load(a_base + rr[:, None] * s_r + offs_i[None, :] * s_c,
                                mask=(rr[:, None] < M) & (offs_i[None, :] < K), other=0.0)
                rhs = tl.load(a_base + rr[:, None] * s_r + offs_j[None, :] * s_c,
                              mask=(rr[:, None] < M) & (offs_j[None, :] < K), other=0.0)
                acc = tl.dot(tl.trans(lhs_t), rhs, acc)
        return acc

    @triton.jit
    def _xxt_kernel(
        a_ptr, c_ptr, M, K,
        sa_b, sa_r, sa_c, sc_b, sc_r, sc_c,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        # Grid: (upper-triangle candidate tiles of the M x M output, batch).
        row0, col0, keep = _upper_tile(tl.program_id(0), M, BLOCK_M, BLOCK_N, GROUP_M)
        if not keep:
            return
        batch = tl.program_id(1).to(tl.int64)
        offs_r = row0 + tl.arange(0, BLOCK_M)
        offs_c = col0 + tl.arange(0, BLOCK_N)
        acc = _row_gram_tile(a_ptr + batch * sa_b, offs_r, offs_c, M, K, sa_r, sa_c,
                             BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
        _store_sym(c_ptr + batch * sc_b, acc, offs_r, offs_c, M, sc_r, sc_c)

    @triton.jit
    def _xtx_kernel(
        a_ptr, c_ptr, M, K,
        sa_b, sa_r, sa_c, sc_b, sc_r, sc_c,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        # Grid: (upper-triangle candidate tiles of the K x K output, batch); reduces over M rows.
        row0, col0, keep = _upper_tile(tl.program_id(0), K, BLOCK_M, BLOCK_N, GROUP_M)
        if not keep:
            return
        batch = tl.program_id(1).to(tl.int64)
        offs_i = row0 + tl.arange(0, BLOCK_M)
        offs_j = col0 + tl.arange(0, BLOCK_N)
        acc = _col_gram_tile(a_ptr + batch * sa_b, offs_i, offs_j, M, K, sa_r, sa_c,
                             BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
        _store_sym(c_ptr + batch * sc_b, acc, offs_i, offs_j, K, sc_r, sc_c)

    @triton.jit
    def _ba_plus_caa_kernel(
        a_ptr, c_ptr, M, alpha, beta, diag,
        sa_b, sa_r, sa_c, sc_b, sc_r, sc_c,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        # XX^T tiling with K = M, plus beta * A on the tile; A symmetric makes the mirror store exact.
        row0, col0, keep = _upper_tile(tl.program_id(0), M, BLOCK_M, BLOCK_N, GROUP_M)
        if not keep:
            return
        batch = tl.program_id(1).to(tl.int64)
        a_base = a_ptr + batch * sa_b
        offs_r = row0 + tl.arange(0, BLOCK_M)
        offs_c = col0 + tl.arange(0, BLOCK_N)
        acc = _row_gram_tile(a_base, offs_r, offs_c, M, M, sa_r, sa_c,
                             BLOCK_M, BLOCK_N, BLOCK_K, INTERPRET)
        tile = tl.load(a_base + offs_r[:, None] * sa_r + offs_c[None, :] * sa_c,
                       mask=(offs_r[:, None] < M) & (offs_c[None, :] < M), other=0.0)
        acc = acc * alpha + tile.to(tl.float32) * beta
        acc += tl.where(offs_r[:, None] == offs_c[None, :], diag, 0.0)
        _store_sym(c_ptr + batch * sc_b, acc, offs_r, offs_c, M, sc_r, sc_c)


_INTERPRETED: bool | None = None


def triton_interpreted() -> bool:
    """True when the Triton kernels run under ``TRITON_INTERPRET=1`` (set before import)."""
    global _INTERPRETED
    if _INTERPRETED is None:
        _INTERPRETED = False
        if _HAVE_TRITON:
            try:
                from triton.runtime.interpreter import InterpretedFunction

                _INTERPRETED = isinstance(_xxt_kernel, InterpretedFunction)
            except ImportError:  # pragma: no cover - layout of older Triton
                pass
    return _INTERPRETED


# Shape-specific overrides: (kind, batch, output side, reduced dim) ->
# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps).  ``benchmarks/bench_polar_express.py --sweep``
# prints candidates.
TUNED_CONFIGS: dict[tuple[str, int, int, int], tuple[int, int, int, int, int]] = {}
# True: always use the record's H100 configs instead of the occupancy rule below.
USE_RECORD_CONFIGS = False

def _config(reduce_dim: int, kind: str, elem_bytes: int = 2,
            key: tuple[str, int, int, int] | None = None,
            device: torch.device | None = None) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps) for a kernel.

    Record configs (H100-tuned, bf16): (128, 128, 64) when the reduced dimension is 768 (and always
    for ba+cAA), else (64, 128, 128); 4 stages, 8 warps.  Measured on an H200 (2026-12-02,
    do_bench_cudagraph): problems with fewer 128x128 output tiles than SMs (a rank's qk/vo chunk)
    run ~2x faster with (64, 64, 128, 3 stages, 4 warps), and big batches ~10% faster with
    (128, 128, 64, 3 stages, 8 warps); that occupancy rule is the default unless
    ``USE_RECORD_CONFIGS`` is set.  fp32 inputs need twice the shared memory per stage, so they
    get a shorter BLOCK_K and 3 stages.  Under the interpreter small tiles (BLOCK_M != BLOCK_N on
    purpose, to exercise the partial-diagonal tiles) keep CPU tests fast.
    """
    if triton_interpreted():
        return 32, 64, 32, 1, 1
    if key is not None and elem_bytes == 2 and key in TUNED_CONFIGS:
        return TUNED_CONFIGS[key]
    if elem_bytes > 2:
        return 64, 128, 32, 3, 8
    if USE_RECORD_CONFIGS or key is None or device is None:
        if kind == "ba_plus_caa" or reduce_dim == 768:
            return 128, 128, 64, 4, 8
        return 64, 128, 128, 4, 8
    _, batch, n_out, _ = key
    big_tiles = batch * (-(-n_out // 128)) ** 2
    if big_tiles < sm_count(device):
        return 64, 64, 128, 3, 4
    return 128, 128, 64, 3, 8


# ------------------------------------------------------------------------------------------------
# Argument checks shared by kernels and references


def _as3d(t: Tensor) -> Tensor:
    return t if t.ndim == 3 else t.unsqueeze(0)


def _check(name: str, A: Tensor, out: Tensor, expect_out: tuple[int, ...]) -> None:
    if A.ndim not in (2, 3):
        raise ValueError(f"{name}: A must be (M, K) or (B, M, K), got shape {tuple(A.shape)}")
    if A.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: A dtype {A.dtype} not supported (bf16, fp16, fp32)")
    if min(A.shape) == 0:
        raise ValueError(f"{name}: A has an empty dimension, shape {tuple(A.shape)}")
    if tuple(out.shape) != expect_out:
        raise ValueError(f"{name}: out must have shape {expect_out} for A of shape {tuple(A.shape)}, "
                         f"got {tuple(out.shape)}")
    if out.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: out dtype {out.dtype} not supported (bf16, fp16, fp32)")
    if out.device != A.device:
        raise ValueError(f"{name}: A is on {A.device} but out is on {out.device}")


def _check_triton(name: str, A: Tensor, out: Tensor) -> None:
    if not _HAVE_TRITON:
        raise ValueError(f"{name}: Triton is not installed; use {name}_reference")
    if not A.is_cuda and not triton_interpreted():
        raise ValueError(f"{name}: the Triton kernel needs a CUDA tensor (or TRITON_INTERPRET=1 set "
                         f"before import); got a tensor on {A.device}. Use {name}_reference on CPU.")
    if A.is_cuda and triton_interpreted():
        raise ValueError(f"{name}: TRITON_INTERPRET=1 runs kernels on CPU tensors only")
    if (A.ndim == 3 and A.size(0) > 1) and (A.stride(0) == 0 or out.stride(0) == 0):
        raise ValueError(f"{name}: broadcast (stride-0) batch dimensions are not supported")


def _launch_sym(kernel, name: str, A: Tensor, out: Tensor, n_out: int, reduce_dim: int, *scalars) -> Tensor:
    a3, c3 = _as3d(A), _as3d(out)
    bm, bn, bk, stages, warps = _config(reduce_dim, name, A.element_size(), (name, a3.size(0), n_out, reduce_dim),
                                        A.device)
    grid = (-(-n_out // bm) * -(-n_out // bn), a3.size(0))  # (triton.cdiv is slow to call from Python)
    if grid[1] > 65535:
        raise ValueError(f"{name}: batch of {grid[1]} exceeds the 65535 grid limit")
    sizes = (a3.size(1), a3.size(2)) if kernel is not _ba_plus_caa_kernel else (a3.size(1),)
    # symmetric output: the kernels compute the upper-triangle blocks, ~half of a full GEMM's FLOPs
    flops = a3.size(0) * n_out * n_out * (a3.size(1) if kernel is _xtx_kernel else a3.size(2))
    with launch_note(f"_{name}_kernel", reads=(A,), writes=(out,), flops=flops):
        launch(kernel, grid,
            a3, c3, *sizes, *scalars,
            a3.stride(0), a3.stride(1), a3.stride(2), c3.stride(0), c3.stride(1), c3.stride(2),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, INTERPRET=triton_interpreted(),
            num_stages=stages, num_warps=warps,
        )
    return out


# ------------------------------------------------------------------------------------------------
# Public kernels and references


def xxt(A: Tensor, out: Tensor) -> Tensor:
    """``out = A @ A^T`` with Triton. A: (M, K) or (B, M, K); out: (M, M) or (B, M, M). Returns out."""
    M = A.shape[-2]
    _check("xxt", A, out, (*A.shape[:-2], M, M))
    _check_triton("xxt", A, out)
    return _launch_sym(_xxt_kernel, "xxt", A, out, M, A.shape[-1])


def xxt_reference(A: Tensor, out: Tensor) -> Tensor:
    """Plain-PyTorch ``out = A @ A^T`` (fp32 accumulate), same shapes as :func:`xxt`."""
    _check("xxt", A, out, (*A.shape[:-2], A.shape[-2], A.shape[-2]))
    a = A.float()
    out.copy_(a @ a.mT)
    return out


def xtx(A: Tensor, out: Tensor) -> Tensor:
    """``out = A^T @ A`` with Triton. A: (M, K) or (B, M, K); out: (K, K) or (B, K, K). Returns out."""
    K = A.shape[-1]
    _check("xtx", A, out, (*A.shape[:-2], K, K))
    _check_triton("xtx", A, out)
    return _launch_sym(_xtx_kernel, "xtx", A, out, K, K)


def xtx_reference(A: Tensor, out: Tensor) -> Tensor:
    """Plain-PyTorch ``out = A^T @ A`` (fp32 accumulate), same shapes as :func:`xtx`."""
    _check("xtx", A, out, (*A.shape[:-2], A.shape[-1], A.shape[-1]))
    a = A.float()
    out.copy_(a.mT @ a)
    return out


def _check_square(name: str, A: Tensor) -> None:
    if A.ndim in (2, 3) and A.shape[-1] != A.shape[-2]:
        raise ValueError(f"{name}: A must be square (symmetric), got shape {tuple(A.shape)}")


def ba_plus_caa(A: Tensor, alpha: float, beta: float, out: Tensor, diag: float = 0.0) -> Tensor:
    """``out = alpha * A @ A^T + beta * A + diag * I`` with Triton, for symmetric A of shape (M, M)
    or (B, M, M); fp32 accumulation, one rounding to ``out``'s dtype.

    Only the upper-triangle tiles are computed; the result is exact only if A is symmetric.
    """
    _check_square("ba_plus_caa", A)
    _check("ba_plus_caa", A, out, tuple(A.shape))
    _check_triton("ba_plus_caa", A, out)
    return _launch_sym(_ba_plus_caa_kernel, "ba_plus_caa", A, out, A.shape[-1], A.shape[-1],
                       float(alpha), float(beta), float(diag))


def ba_plus_caa_reference(A: Tensor, alpha: float, beta: float, out: Tensor, diag: float = 0.0) -> Tensor:
    """Plain-PyTorch ``out = alpha * A @ A^T + beta * A + diag * I`` (fp32 accumulate), same shapes."""
    _check_square("ba_plus_caa", A)
    _check("ba_plus_caa", A, out, tuple(A.shape))
    a = A.float()
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    out.copy_(alpha * (a @ a.mT) + beta * a + diag * eye)
    return out


# ------------------------------------------------------------------------------------------------
# Polar Express


def _use_triton(G: Tensor, use_triton: bool | None) -> bool:
    if use_triton is None:
        return _HAVE_TRITON and G.is_cuda and not triton_interpreted()
    if use_triton and not _HAVE_TRITON:
        raise ValueError("polar_express(use_triton=True): Triton is not installed")
    if use_triton and not G.is_cuda and not triton_interpreted():
        raise ValueError("polar_express(use_triton=True) on a CPU tensor needs TRITON_INTERPRET=1 "
                         "set before import")
    return bool(use_triton)


def _gram_bmm_wide(X: Tensor, out: Tensor) -> Tensor:
    return torch.bmm(X, X.mT, out=out)


def _gram_bmm_tall(X: Tensor, out: Tensor) -> Tensor:
    return torch.bmm(X.mT, X, out=out)


def _poly_bmm(A: Tensor, alpha: float, beta: float, out: Tensor) -> Tensor:
    return torch.baddbmm(A, A, A, beta=beta, alpha=alpha, out=out)


def polar_express(G: Tensor, steps: int = 5, use_triton: bool | None = None) -> Tensor:
    """Approximate polar factor (orthogonalisation) of each matrix in ``G``.

    G: (..., rows, cols), any float dtype; leading dims are a batch of independent matrices.
    Returns a new bf16 tensor of G's shape whose singular values are close to 1 (within roughly
    [0.7, 1.2] after 5 steps; exactly what the record uses, not an exact polar factor).
    Computation is bf16 with fp32 accumulation inside the GEMMs.  Wide/square matrices iterate on
    ``X X^T`` (rows x rows), tall ones on ``X^T X`` (cols x cols), so the Gram matrix is always the
    smaller one.  ``steps`` <= 5 uses the first ``steps`` coefficient triples.
    Equals ``polar_express_iterate(polar_express_normalize(G), steps, use_triton)``: callers that
    fuse the normalisation with what comes before it (the NorMuon update) call the two halves.

    use_triton: None = Triton on CUDA, bf16 torch.bmm elsewhere; True/False force it.
    """
    _check_polar_input("polar_express", G)
    return polar_express_iterate(polar_express_normalize(G), steps, use_triton).reshape(G.shape)


def _check_polar_input(name: str, G: Tensor) -> None:
    if G.ndim < 2:
        raise ValueError(f"{name}: G must have at least 2 dims (..., rows, cols), got {tuple(G.shape)}")
    if not G.is_floating_point():
        raise ValueError(f"{name}: G must be a float tensor, got {G.dtype}")
    if G.numel() == 0:
        raise ValueError(f"{name}: G has an empty dimension, shape {tuple(G.shape)}")


def polar_express_normalize(G: Tensor) -> Tensor:
    """Polar Express's input: each matrix of G over (its Frobenius norm x PRE_NORM_SAFETY + PRE_NORM_EPS).

    G: (..., rows, cols), any float dtype.  Returns a contiguous bf16 (B, rows, cols) tensor, B the
    product of the leading dims.  The norm is taken in fp32 (no over/underflow for huge or tiny
    gradients), then the quotient is rounded once to bf16.  Plain PyTorch, so ``torch.compile``
    can fuse it with the tensor's producer.
    """
    Gf = G.reshape(-1, *G.shape[-2:]).float()
    denom = Gf.norm(dim=(-2, -1), keepdim=True) * PRE_NORM_SAFETY + PRE_NORM_EPS
    return torch.div(Gf, denom).to(torch.bfloat16).contiguous()


def polar_express_iterate(X: Tensor, steps: int = 5, use_triton: bool | None = None) -> Tensor:
    """The Polar Express iteration on an already normalised batch (see :func:`polar_express`).

    X: contiguous bf16 (B, rows, cols), each matrix's spectral norm at most 1 (the output of
    :func:`polar_express_normalize`).  Returns a bf16 tensor of X's shape; X itself serves as
    the iteration's second buffer, so its contents are overwritten when ``steps`` >= 2.
    """
    if X.ndim != 3 or X.dtype != torch.bfloat16 or not X.is_contiguous() or X.numel() == 0:
        raise ValueError(f"polar_express_iterate: X must be a non-empty contiguous bf16 (B, rows, cols) tensor, "
                         f"got {X.dtype} {tuple(X.shape)}{'' if X.is_contiguous() else ' (not contiguous)'}")
    if not 1 <= steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"polar_express: steps must be in 1..{len(POLAR_EXPRESS_COEFFS)}, got {steps}")
    triton_path = _use_triton(X, use_triton)
    tall = X.size(-2) > X.size(-1)
    n = X.size(-1) if tall else X.size(-2)
    gram = torch.empty((X.size(0), n, n), device=X.device, dtype=torch.bfloat16)
    poly = torch.empty_like(gram)
    nxt = torch.empty_like(X)
    gram_fn = (xtx if tall else xxt) if triton_path else (_gram_bmm_tall if tall else _gram_bmm_wide)
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        gram_fn(X, gram)
        if triton_path:  # a X folded into the polynomial, rounded once in the kernel's fp32 epilogue
            ba_plus_caa(gram, c, b, poly, diag=a)  # poly = a*I + b*A + c*A@A
            if tall:
                torch.bmm(X, poly, out=nxt)
            else:
                torch.bmm(poly, X, out=nxt)
        else:  # plain bf16 batched GEMMs, the fallback where Triton is not available; folding a
            # here would round the polynomial twice
            _poly_bmm(gram, c, b, poly)  # poly = b*A + c*A@A
            if tall:
                torch.baddbmm(X, X, poly, beta=a, out=nxt)  # a*X + X @ poly
            else:
                torch.baddbmm(X, poly, X, beta=a, out=nxt)  # a*X + poly @ X
        X, nxt = nxt, X
    return X


def polar_express_reference(G: Tensor, steps: int = 5, use_triton: bool | None = None) -> Tensor:
    """Plain-PyTorch Polar Express (same signature as :func:`polar_express`; ``use_triton`` ignored).

    Computes the same bf16 iteration with dense torch matmuls and no symmetric shortcuts, written
    as the textbook ``X <- a X + (b A + c A^2) X`` on the wide orientation (tall inputs transposed).
    """
    del use_triton
    if G.ndim < 2 or G.numel() == 0 or not G.is_floating_point():
        raise ValueError(f"polar_express_reference: need a non-empty float (..., rows, cols) tensor, "
                         f"got {G.dtype} {tuple(G.shape)}")
    X = G.to(torch.bfloat16).float()
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) * PRE_NORM_SAFETY + PRE_NORM_EPS)).to(torch.bfloat16)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        A = (X @ X.mT)
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return (X.mT if transposed else X).contiguous()


def _spectral_bounds(X: Tensor) -> tuple[float, float]:
    """(min, max) singular value over a batch; a test/diagnostic helper."""
    s = torch.linalg.svdvals(X.float())
    return float(s.min()), float(s.max())

