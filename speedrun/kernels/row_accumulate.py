"""``acc[rows] += grad`` for embedding gradients: bf16 rows added into an fp32 table in one pass.

The backward of an in-place-accumulating embedding lookup (:mod:`speedrun.model.embedding_grad`)
adds each looked-up row's gradient (N, D) into an fp32 accumulator of the table (V, D); a row id
may repeat (frequent tokens).  ``torch.index_add_`` needs the source in the accumulator's dtype:
a (N, D) fp32 copy of the gradient is written and read again first (at stage-3 shapes 151 MB more
per lookup, seven lookups per micro-batch).  A Triton kernel reads the bf16 rows and adds them
in fp32 directly, one atomic add per element: N D (2 + 8) bytes (read, atomic read-modify-write).
Atomic adds make the order of the fp32 sums, and so their last bits, vary from run to run (as
autograd's own embedding backward on CUDA does).  A variant that sorted the rows and summed each
id's run in registers first (one add per distinct id) made the stage-3 step slower on the H200
and was removed.

``accumulate_rows_reference`` (plain PyTorch, same signature) is the CPU path and the tests' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from speedrun.kernels._triton import cdiv, launch, triton_usable
from speedrun.kernels.launch_notes import launch_note

BLOCK_ROWS, BLOCK_D, NUM_WARPS = 16, 256, 4


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


def _check(acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> None:
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


def accumulate_rows_reference(acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``acc[rows[i]] += grad[i]`` for every i (repeats summed), in place; returns ``acc``.
    acc (V, D) float32; rows (N,) int32/int64 in [0, V); grad (N, D) any float dtype."""
    _check(acc, rows, grad)
    return acc.index_add_(0, rows, grad.to(acc.dtype))


def accumulate_rows(acc: torch.Tensor, rows: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """:func:`accumulate_rows_reference` as a Triton kernel (CUDA, or the CPU interpreter); other
    devices take the reference.  Rows must lie in [0, V): they are not checked here (the forward's
    lookup of the same rows already is)."""
    _check(acc, rows, grad)
    if not triton_usable(acc) or grad.shape[0] == 0:
        return accumulate_rows_reference(acc, rows, grad)
    if grad.stride(1) != 1:
        grad = grad.contiguous()
    N, D = grad.shape
    with launch_note("_accumulate_rows_kernel", reads=(rows, grad), extra_bytes=2 * N * D * 4):
        launch(_accumulate_rows_kernel, (cdiv(N, BLOCK_ROWS), cdiv(D, BLOCK_D)), grad, rows, acc, N, D,
               grad.stride(0), BLOCK_R=BLOCK_ROWS, BLOCK_C=BLOCK_D, num_warps=NUM_WARPS)
    return acc
