"""Attention backends timed at the record's stage-3 shape (``speedrun doctor`` and
``benchmarks/bench_attention.py``).

Stage 3 of the record on one rank: T = 49,152 tokens per micro-batch in documents of at most
2048 tokens, ``cu_seqlens`` padded to 129 entries, 6 heads, V width 128, Q/K width 128 (record) or
96 (candidate), windows from :data:`speedrun.optim.schedule.RECORD_STAGES` (640 short, 1408 long).
Document lengths come from real webmix batches (the training loader on a shard) or, without data,
from a log-normal stand-in (median ~400 tokens).

FLOPs: a query-key pair costs 2 * D_qk (the score) + 2 * D_v (the weighted value) FLOPs forward
and 2 * (3 * D_qk + 2 * D_v) backward (score recomputed, dP, dV, dQ, dK), counting only the pairs
the causal, document and window masks allow.  "Useful" FLOPs use the true widths; a backend that
zero-pads Q/K to V's width executes the padded count.
"""

from __future__ import annotations

import glob
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from speedrun.evidence.fingerprint import time_cuda_ms

STAGE3_TOKENS = 49152
STAGE3_SEQ_CAP = 2048
STAGE3_SLOTS = 129  # the loader's max_docs (128) + 1 at 49,152 tokens per rank
HEADS = 6
V_DIM = 128
BOS_ID = 50256


def stage3_windows() -> tuple[int, int]:
    """(short, long) window in tokens of the record's stage 3 (index 2 of the schedule)."""
    from speedrun.optim.schedule import RECORD_STAGES

    short, long = RECORD_STAGES[2].window_blocks
    return short * 128, long * 128


def synthetic_cu_seqlens(T: int = STAGE3_TOKENS, cap: int = STAGE3_SEQ_CAP, slots: int = STAGE3_SLOTS,
                         seed: int = 0) -> torch.Tensor:
    """(slots,) int32 document starts of log-normal lengths (median ~400, capped at ``cap``), then
    T, padded with T; the shortest documents are merged when there are too many for ``slots``."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    total = 0
    while total < T:
        n = int(torch.empty(1).log_normal_(mean=6.0, std=1.0, generator=g).clamp(8, cap).item())
        n = min(n, T - total)
        lengths.append(n)
        total += n
    while len(lengths) > slots - 1:  # merge neighbours (never above the cap) like the loader
        i = min(range(len(lengths) - 1), key=lambda j: lengths[j] + lengths[j + 1])
        lengths[i : i + 2] = [lengths[i] + lengths[i + 1]]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    cu += [T] * (slots - len(cu))
    return torch.tensor(cu, dtype=torch.int32)


def webmix_cu_seqlens(pattern: str, T: int = STAGE3_TOKENS, cap: int = STAGE3_SEQ_CAP, batches: int = 1,
                      skip: int = 0) -> list[torch.Tensor]:
    """``cu_seqlens`` of real training batches: the training loader over the shards matching
    ``pattern`` at stage-3 settings, batches ``skip .. skip + batches - 1``."""
    from speedrun.data.loader import TrainLoader, default_max_docs

    files = sorted(glob.glob(pattern))
    if not files:
        raise FileNotFoundError(f"no shards match {pattern}")
    loader = TrainLoader([Path(f) for f in files], T, cap, bos_id=BOS_ID, max_docs=default_max_docs(T, cap),
                         prefetch=False)
    try:
        out = []
        for i in range(skip + batches):
            b = loader.next_batch()
            if i >= skip:
                out.append(b.cu_seqlens.to(torch.int32).cpu())
        return out
    finally:
        loader.close()


def allowed_pairs(cu: torch.Tensor, window: int | None) -> int:
    """Number of (query, key) pairs the causal + document + window mask allows, per head."""
    total = 0
    for n in (cu[1:] - cu[:-1]).tolist():
        if window is None or window + 1 >= n:
            total += n * (n + 1) // 2
        else:  # the first window+1 queries see a growing prefix, the rest window+1 keys each
            w = window + 1
            total += w * (w + 1) // 2 + (n - w) * w
    return total


def attention_flops(pairs: int, heads: int, d_qk: int, d_v: int, backward: bool = True) -> float:
    """FLOPs of forward (+ backward) attention over ``pairs`` allowed pairs per head."""
    fwd = 2.0 * pairs * heads * (d_qk + d_v)
    bwd = 2.0 * pairs * heads * (3 * d_qk + 2 * d_v)
    return fwd + (bwd if backward else 0.0)


@dataclass
class Case:
    """One attention call's inputs (bf16, requires_grad) and its upstream gradient."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dy: torch.Tensor
    cu: torch.Tensor
    max_seqlen: int
    window: int | None
    scale: float = 0.12

    @property
    def pairs_per_head(self) -> int:
        return allowed_pairs(self.cu.cpu(), self.window)

    def flops(self, d_qk: int | None = None) -> float:
        """Forward + backward FLOPs (at Q/K width ``d_qk``, default the inputs' own)."""
        return attention_flops(self.pairs_per_head, self.q.shape[1], d_qk or self.q.shape[-1], self.v.shape[-1])


def make_case(cu: torch.Tensor, d_qk: int, window: int | None, *, paired: bool = False, heads: int = HEADS,
              d_v: int = V_DIM, cap: int = STAGE3_SEQ_CAP, device="cuda", seed: int = 1) -> Case:
    """Random bf16 inputs for documents ``cu``; ``paired``: the record's paired-head layers
    (2T positions of H/2 heads, documents and cap doubled, window as given)."""
    T = int(cu[-1])
    cu = cu.to(device)
    if paired:
        T, heads, cu, cap = 2 * T, heads // 2, cu * 2, cap * 2
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(d, grad=True):
        t = torch.randn(T, heads, d, device=device, dtype=torch.bfloat16, generator=g)
        return t.requires_grad_() if grad else t

    return Case(rnd(d_qk), rnd(d_qk), rnd(d_v), rnd(d_v, False), cu, cap, window)


def time_fwd_bwd(fn: Callable, case: Case, *, reps: int = 20, warmup: int = 5) -> list[float]:
    """Milliseconds of ``fn`` forward + backward on ``case``, one CUDA-event timing per rep."""
    def step():
        for t in (case.q, case.k, case.v):
            t.grad = None
        y = fn(case.q, case.k, case.v, case.cu, case.max_seqlen, window=case.window, scale=case.scale)
        y.backward(case.dy)

    return time_cuda_ms(step, reps, warmup)


def doctor_timings(names: list[str], device: str | torch.device = "cuda", reps: int = 10) -> dict[str, str]:
    """For ``speedrun doctor``: per backend, "fwd+bwd X ms (...)" at the stage-3 shape (Q/K 128,
    short window, synthetic documents) or the error it raised.  ``reference`` is skipped (its
    padded batch at T = 49,152 needs tens of GB)."""
    from speedrun.attention import get_backend

    short, _ = stage3_windows()
    case = make_case(synthetic_cu_seqlens(), 128, short, device=device)
    out = {}
    for name in names:
        if name == "reference":
            continue
        try:
            ms = statistics.median(time_fwd_bwd(get_backend(name, device), case, reps=reps, warmup=3))
            tflops = case.flops() / ms / 1e9
            out[name] = (f"fwd+bwd {ms:.2f} ms at stage 3 (T={STAGE3_TOKENS}, H={HEADS}, qk128/v128, W={short}; "
                         f"{tflops:.0f} TFLOP/s)")
        except Exception as e:  # noqa: BLE001 - one backend failing must not hide the others
            out[name] = f"fwd+bwd timing failed: {type(e).__name__}: {e}"[:200]
    return out
