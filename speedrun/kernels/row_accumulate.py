"""``acc[rows] += grad`` for embedding gradients: bf16 rows added into an fp32 table in one pass.

The backward of an in-place-accumulating embedding lookup (:mod:`speedrun.model.embedding_grad`)
adds each looked-up row's gradient (N, D) into an fp32 accumulator of the table (V, D); a row id
may repeat (frequent tokens).  ``torch.index_add_`` needs the source in the accumulator's dtype:
a (N, D) fp32 copy of the gradient is written and read again first (at stage-3 shapes 151 MB more
per lookup, seven lookups per micro-batch).  Two Triton kernels read the bf16 rows and add them in
fp32 directly:

- ``method="atomic"``: one atomic add per element, N D (2 + 8) bytes (read, atomic
  read-modify-write), as many atomics as elements.
- ``method="sorted"``: the rows sorted first (``torch.sort``, no synchronisation); each program
  takes BLOCK_R consecutive sorted positions, sums each run of equal ids with a segmented scan in
  registers and adds the run's sum once: a plain read-modify-write for runs inside its block (no
  other program has that id), an atomic add only for the first and last run (which may continue
  in a neighbouring block).  Bytes: N D 2 (gather) + U D 8 (U distinct ids) and ~2 atomics per
  block and column; a repeated id costs one add instead of one per occurrence.

Atomic adds make the order of the fp32 sums, and so their last bits, vary from run to run (as
autograd's own embedding backward on CUDA does); the sorted method only at block boundaries.

``accumulate_rows_reference`` (plain PyTorch, same signature) is the CPU path and the tests' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speedrun.kernels.fp8_cache import cdiv, triton_usable
from speedrun.kernels.launch import launch
from speedrun.kernels.launch_notes import launch_note

BLOCK_ROWS, BLOCK_D, NUM_WARPS = 16, 256, 4  # method "atomic"
SORTED_CONFIG = (64, 128, 8)  # method "sorted": BLOCK_R, BLOCK_C, warps
METHODS = ("atomic", "sorted")


@triton.jit
def _accumulate_rows_kernel(grad_ptr, rows_ptr, acc_ptr, N, D, stride_g,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    rmask = r < N
    mask = rmask[:, None] & (c < D)[None, :]
    dst = tl.load(rows_ptr + r, mask=rmask, other=0).to(tl.int64)
    g = tl.load(grad_ptr + r.to(tl.int64)[:, None] * stride_g + c[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(acc_ptr + dst[:, None] * D + c[None, :], g, mask=mask, sem="relaxed")


@triton.jit
def _segment_add(v1, f1, v2, f2):
    """Combine of a segmented inclusive sum: a start flag (f2) restarts the sum at v2."""
    return tl.where(f2 != 0, v2, v1 + v2), f1 | f2


@triton.jit
def _accumulate_sorted_rows_kernel(grad_ptr, order_ptr, ids_ptr, acc_ptr, N, D, stride_g,
                                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    start = tl.program_id(0) * BLOCK_R
    i = start + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    valid = i < N
    cmask = c < D
    ids = tl.load(ids_ptr + i, mask=valid, other=-1)
    # distinct sentinels: the block's first position starts a run, its last valid one ends one
    prev = tl.load(ids_ptr + i - 1, mask=valid & (i > start), other=-2)
    nxt = tl.load(ids_ptr + i + 1, mask=(i + 1 < N) & (i + 1 < start + BLOCK_R), other=-3)
    run_start = tl.broadcast_to((ids != prev).to(tl.int32)[:, None], (BLOCK_R, BLOCK_C))
    run_end = valid & (ids != nxt)
    src = tl.load(order_ptr + i, mask=valid, other=0).to(tl.int64)
    g = tl.load(grad_ptr + src[:, None] * stride_g + c[None, :], mask=valid[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    sums, _ = tl.associative_scan((g, run_start), 0, _segment_add)
    # the first and last run of the block may continue in a neighbour: those add atomically
    first = tl.load(ids_ptr + start)
    last = tl.load(ids_ptr + tl.minimum(start + BLOCK_R, N) - 1)
    shared = (ids == first) | (ids == last)
    dst = acc_ptr + ids.to(tl.int64)[:, None] * D + c[None, :]
    write = run_end[:, None] & cmask[None, :]
    tl.atomic_add(dst, sums, mask=write & shared[:, None], sem="relaxed")
    own = write & (~shared)[:, None]
    tl.store(dst, tl.load(dst, mask=own, other=0.0) + sums, mask=own)


def _check(acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor, method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"accumulate_rows: method must be one of {', '.join(METHODS)}, got {method!r}")
    if acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous():
        raise ValueError(f"accumulate_rows: acc must be a contiguous (V, D) float32 table, got "
                         f"{acc.dtype} {tuple(acc.shape)}")
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"accumulate_rows: rows must be 1-D int32/int64, got {rows.dtype} {tuple(rows.shape)}")
    if grad.dim() != 2 or grad.shape != (rows.shape[0], acc.shape[1]):
        raise ValueError(f"accumulate_rows: grad must be (len(rows), D) = ({rows.shape[0]}, {acc.shape[1]}), "
                         f"got {tuple(grad.shape)}")
    if not (acc.device == rows.device == grad.device):
        raise ValueError(f"accumulate_rows: tensors on {acc.device}, {rows.device}, {grad.device}")


def accumulate_rows_reference(acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
                              method: str = "atomic") -> torch.Tensor:
    """``acc[rows[i]] += grad[i]`` for every i (repeats summed), in place; returns ``acc``.
    acc (V, D) float32; rows (N,) int32/int64 in [0, V); grad (N, D) any float dtype.
    ``method`` names the kernel this stands in for (the result is the same)."""
    _check(acc, rows, grad, method)
    return acc.index_add_(0, rows, grad.to(acc.dtype))


def accumulate_rows(acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor,
                    method: str = "atomic") -> torch.Tensor:
    """:func:`accumulate_rows_reference` as a Triton kernel (CUDA, or the CPU interpreter); other
    devices take the reference.  ``method``: "atomic" or "sorted" (module docstring).  Rows must
    lie in [0, V): they are not checked here (the forward's lookup of the same rows already is)."""
    _check(acc, rows, grad, method)
    if not triton_usable(acc) or grad.shape[0] == 0:
        return accumulate_rows_reference(acc, rows, grad, method)
    if grad.stride(1) != 1:
        grad = grad.contiguous()
    N, D = grad.shape
    if method == "atomic":
        with launch_note("_accumulate_rows_kernel", reads=(rows, grad), extra_bytes=2 * N * D * 4):
            launch(_accumulate_rows_kernel, (cdiv(N, BLOCK_ROWS), cdiv(D, BLOCK_D)), grad, rows, acc, N, D,
                   grad.stride(0), BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_D, num_warps=NUM_WARPS)
        return acc
    ids, order = torch.sort(rows)
    block_r, block_c, warps = SORTED_CONFIG
    # bytes: the distinct rows' read-modify-write is not known on the host; noted as if all distinct
    with launch_note("_accumulate_sorted_rows_kernel", reads=(ids, order, grad), extra_bytes=2 * N * D * 4):
        launch(_accumulate_sorted_rows_kernel, (cdiv(N, block_r), cdiv(D, block_c)), grad, order, ids, acc, N, D,
               grad.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps)
    return acc
