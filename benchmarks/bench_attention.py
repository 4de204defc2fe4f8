"""Attention backends at the record's stage-3 shapes on one GPU: forward + backward time.

T = 49,152 tokens per rank in documents capped at 2048 tokens (log-normal lengths, median ~400),
6 heads, windows 640 (short) and 1408 (long) tokens; Q/K width 128 or 96, V width 128.  Paired
layers are timed as 2T positions x 3 heads with the window in doubled positions.  Each backend is
checked against the reference on a slice first.  Medians of ``triton.testing.do_bench``; arms are
interleaved (each repetition times every backend once) so drift hits all of them alike.  ``flex``
reuses its cached block mask (as the later layers of a micro-batch do); ``flex+mask`` builds the
mask in every call (as the first layer of each window does).

FLOPs counted: causal windowed attention does 4 * D * (number of allowed (q, k) pairs) per head
forward (QK^T and PV, 2 FLOP per multiply-add), and 2.5x that backward (FlashAttention recompute),
with D = max(D_qk, D_v) for padded backends.

Usage: python benchmarks/bench_attention.py [--reps 5]   (writes $OUT/bench_attention.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from speedrun.attention import backend_problem, get_backend
from speedrun.attention.reference import reference_attention


def make_cu_seqlens(T: int, cap: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < T:
        n = int(torch.empty(1).log_normal_(mean=6.0, std=1.0, generator=g).clamp(8, cap).item())
        n = min(n, T - total)
        lengths.append(n)
        total += n
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def allowed_pairs(cu: torch.Tensor, window: int) -> int:
    total = 0
    for n in (cu[1:] - cu[:-1]).tolist():
        # sum over i in [0, n) of min(i, window) + 1
        full = min(n, window + 1)
        total += full * (full + 1) // 2 + (n - full) * (window + 1)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=49152)
    args = ap.parse_args()
    import triton.testing

    dev = torch.device("cuda")
    T, H, dv = args.tokens, 6, 128
    cu = make_cu_seqlens(T, 2048).to(dev)
    cases = []
    for dqk in (128, 96):
        for name, window, paired in (("short", 640, False), ("long", 1408, False), ("paired", 640, True)):
            cases.append((dqk, name, window, paired))
    backends = [b for b in ("varlen", "flex", "fa3") if backend_problem(b, dev) is None]
    skipped = {b: backend_problem(b, dev) for b in ("varlen", "flex", "fa3") if b not in backends}
    results = []
    for dqk, name, window, paired in cases:
        g = torch.Generator(device=dev).manual_seed(1)
        Tn, Hn, cun = (2 * T, H // 2, cu * 2) if paired else (T, H, cu)
        q = torch.randn(Tn, Hn, dqk, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
        k = torch.randn(Tn, Hn, dqk, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
        v = torch.randn(Tn, Hn, dv, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
        dy = torch.randn(Tn, Hn, dv, device=dev, dtype=torch.bfloat16, generator=g)
        max_len = int((cun[1:] - cun[:-1]).max())
        pairs = allowed_pairs(cun.cpu(), window) * Hn
        times: dict[str, list[float]] = {b: [] for b in backends}
        errors = {}
        for b in backends:
            fn = get_backend(b, dev)
            # correctness on the first 4096 positions' documents
            cut = int(cun[(cun <= 4096).sum() - 1])
            sub_cu = cun[cun <= cut]
            ys = fn(q[:cut].detach(), k[:cut].detach(), v[:cut].detach(), sub_cu, max_len, window=window, scale=0.12)
            ref = reference_attention(q[:cut].detach().float(), k[:cut].detach().float(), v[:cut].detach().float(),
                                      sub_cu, max_len, window=window, scale=0.12)
            errors[b] = ((ys.float() - ref).norm() / ref.norm()).item()
        # "flex+mask": flex with its block mask built in every call (a fresh cu_seqlens tensor
        # misses the mask cache), as the first layer of each window in a micro-batch pays it.
        arms = backends + (["flex+mask"] if "flex" in backends else [])
        times["flex+mask"] = []
        errors["flex+mask"] = errors.get("flex", float("nan"))
        for _ in range(args.reps):
            for b in arms:
                fn = get_backend(b.removesuffix("+mask"), dev)
                fresh = b.endswith("+mask")

                def step():
                    y = fn(q, k, v, cun.clone() if fresh else cun, max_len, window=window, scale=0.12)
                    y.backward(dy)

                times[b].append(triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median"))
        for b in arms:
            ms = statistics.median(times[b])
            d = max(dqk, dv) if not b.startswith("flex") else (dqk + dv) / 2
            flops = 4 * d * pairs * 3.5
            results.append({"qk": dqk, "case": name, "window": window, "backend": b, "ms_fwd_bwd": ms,
                            "spread_ms": [min(times[b]), max(times[b])], "rel_err": errors[b],
                            "tflops": flops / ms / 1e9})
            print(f"qk{dqk:4d} {name:7s} W={window:5d} {b:9s} {ms:8.3f} ms  "
                  f"(range {min(times[b]):.3f}-{max(times[b]):.3f})  {flops / ms / 1e9:6.1f} TFLOP/s  "
                  f"err {errors[b]:.1e}", flush=True)
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_attention.json").write_text(json.dumps({"results": results, "skipped": skipped,
                                                         "device": torch.cuda.get_device_name()}, indent=2))
    print("skipped:", skipped)


if __name__ == "__main__":
    main()
