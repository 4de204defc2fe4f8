"""Attention backends at the record's stage-3 shapes on one GPU: forward + backward time.

Every backend that runs here (cudnn, fa4, fa3, varlen, flex; see ``speedrun.attention``) is timed on
the same inputs: T = 49,152 tokens per rank in documents of at most 2048 tokens (``cu_seqlens``
padded to 129 entries as the loader does), 6 heads, V width 128, Q/K width 128 (record) and 96
(candidate), the record's stage-3 windows (640 short, 1408 long tokens, from
``speedrun.optim.schedule``), and the paired-head layers (2T positions x 3 heads, short window).
Document lengths: real webmix training batches when ``--data`` (or ``$SPEEDRUN_TEST_DATA``) names
shards, else a log-normal stand-in (median ~400).  Each backend is first checked against the
reference on a slice.  Timings: CUDA events around forward + backward, ``--iters`` per
repetition after a warmup, median over repetitions; arms interleave (each repetition times every
backend once) so drift hits all alike.  ``flex`` reuses its cached block mask (as later layers of
a micro-batch do); ``flex+mask`` builds it in every call (as the first layer of each window).

Reported per case and backend: median ms, useful TFLOP/s (causal + document + window pairs at the
true widths; ``speedrun.evidence.attention_timing``) and its fraction of the bf16 matmul rate
measured here, and the speedup over varlen.  ``step_attention_ms`` sums one micro-batch's attention
layers (4 short, 2 long, 4 paired in the record's 10 attention layers) per backend and width.

Usage: python benchmarks/bench_attention.py [--reps 5] [--iters 10] [--data GLOB]
(writes $OUT/bench_attention.json; about 1-2 minutes on an H100, most of it flex's compilation)
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
from speedrun.evidence.attention_timing import (STAGE3_TOKENS, make_case, stage3_windows, synthetic_cu_seqlens,
                                                webmix_cu_seqlens)
from speedrun.evidence.fingerprint import measure_matmul_tflops

BACKENDS = ("cudnn", "fa4", "fa3", "varlen", "flex")
# the record's attention layers per micro-batch: layers 1, 4, 7, 8 short; 3, 10 long; 0, 2, 5, 9 paired
LAYER_COUNTS = {"short": 4, "long": 2, "paired": 4}


def _check(fn, case, cut_tokens: int = 4096) -> float:
    """Relative error against the reference on the documents inside the first ``cut_tokens``."""
    cu = case.cu
    cut = int(cu[(cu <= cut_tokens).sum() - 1])
    sub = cu[cu <= cut]
    q, k, v = (t[:cut].detach() for t in (case.q, case.k, case.v))
    y = fn(q, k, v, sub, case.max_seqlen, window=case.window, scale=case.scale)
    ref = reference_attention(q.float(), k.float(), v.float(), sub, case.max_seqlen, window=case.window,
                              scale=case.scale)
    return ((y.float() - ref).norm() / ref.norm()).item()


def _time(fn, case, iters: int, fresh_cu: bool) -> float:
    """Mean ms of one forward + backward over ``iters`` back-to-back calls (CUDA events)."""
    def step():
        for t in (case.q, case.k, case.v):
            t.grad = None
        cu = case.cu.clone() if fresh_cu else case.cu
        fn(case.q, case.k, case.v, cu, case.max_seqlen, window=case.window, scale=case.scale).backward(case.dy)

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        step()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions (median over them)")
    ap.add_argument("--iters", type=int, default=10, help="forward+backward calls per timing")
    ap.add_argument("--data", default=None, help="webmix/fineweb training shards (glob) for real document lengths")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    args = ap.parse_args()

    dev = torch.device("cuda")
    data = args.data or (os.environ.get("SPEEDRUN_TEST_DATA") and os.environ["SPEEDRUN_TEST_DATA"] + "/webmix_train_*.bin")
    docs_source = "synthetic log-normal"
    cu = synthetic_cu_seqlens()
    if data:
        try:
            cu = webmix_cu_seqlens(data, skip=3)[0]
            docs_source = f"training loader on {data} (batch 3)"
        except Exception as e:  # noqa: BLE001 - missing or unreadable shards: fall back, say so
            print(f"(no real documents: {type(e).__name__}: {e}; using the synthetic lengths)")
    lengths = (cu[1:] - cu[:-1])
    lengths = lengths[lengths > 0]
    print(f"documents: {docs_source}: {len(lengths)} in {int(cu[-1])} tokens, median {int(lengths.median())}, "
          f"max {int(lengths.max())}; cu_seqlens slots {cu.numel()}", flush=True)

    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    backends = [b for b in names if backend_problem(b, dev) is None]
    skipped = {b: backend_problem(b, dev) for b in names if b not in backends}
    for b, why in skipped.items():
        print(f"skipped {b}: {why}", flush=True)
    matmul = measure_matmul_tflops()
    print(f"bf16 matmul 8192^3: {matmul:.0f} TFLOP/s", flush=True)

    short, long = stage3_windows()
    cases = [(dqk, name, window, name == "paired") for dqk in (128, 96)
             for name, window in (("short", short), ("long", long), ("paired", short))]
    results = []
    for dqk, name, window, paired in cases:
        case = make_case(cu, dqk, window, paired=paired)
        arms = backends + (["flex+mask"] if "flex" in backends else [])
        fns = {b: get_backend(b.removesuffix("+mask"), dev) for b in arms}
        errors = {}
        for b in arms:
            try:
                errors[b] = _check(fns[b], case)
                _time(fns[b], case, 2, b.endswith("+mask"))  # warmup: compiles, builds graphs
            except Exception as e:  # noqa: BLE001 - report and drop the arm
                errors[b] = f"{type(e).__name__}: {e}"[:300]
                print(f"qk{dqk} {name}: {b} failed: {errors[b]}", flush=True)
        arms = [b for b in arms if isinstance(errors[b], float)]
        times: dict[str, list[float]] = {b: [] for b in arms}
        for _ in range(args.reps):
            for b in arms:
                times[b].append(_time(fns[b], case, args.iters, b.endswith("+mask")))
        flops = case.flops()
        base = statistics.median(times["varlen"]) if "varlen" in times else None
        for b in arms:
            ms = statistics.median(times[b])
            tf = flops / ms / 1e9
            row = {"qk": dqk, "case": name, "window": window, "tokens": int(case.q.shape[0]),
                   "heads": int(case.q.shape[1]), "backend": b, "ms_fwd_bwd": ms,
                   "spread_ms": [min(times[b]), max(times[b])], "rel_err": errors[b], "tflops": tf,
                   "fraction_of_matmul": tf / matmul, "speedup_vs_varlen": (base / ms) if base else None}
            results.append(row)
            sp = f"  x{base / ms:4.2f} vs varlen" if base else ""
            print(f"qk{dqk:4d} {name:7s} W={window:5d} {b:9s} {ms:8.3f} ms  (range {min(times[b]):.3f}-"
                  f"{max(times[b]):.3f})  {tf:6.1f} TFLOP/s = {tf / matmul:5.1%} of matmul  err {errors[b]:.1e}{sp}",
                  flush=True)
        for b, err in errors.items():
            if not isinstance(err, float):
                results.append({"qk": dqk, "case": name, "window": window, "backend": b, "error": err})

    step = {}
    for dqk in (128, 96):
        for b in {r["backend"] for r in results if "ms_fwd_bwd" in r}:
            rows = {r["case"]: r["ms_fwd_bwd"] for r in results if r.get("backend") == b and r["qk"] == dqk
                    and "ms_fwd_bwd" in r}
            if len(rows) == len(LAYER_COUNTS):
                step[f"qk{dqk}/{b}"] = sum(n * rows[c] for c, n in LAYER_COUNTS.items())
    print("one micro-batch's attention layers (4 short + 2 long + 4 paired), fwd+bwd ms:")
    for key in sorted(step):
        qk = key.split("/")[0]
        base = step.get(f"{qk}/varlen")
        print(f"  {key:16s} {step[key]:8.2f}" + (f"  x{base / step[key]:4.2f} vs varlen" if base else ""))
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_attention.json").write_text(json.dumps({
        "results": results, "skipped": skipped, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "matmul_bf16_tflops": matmul, "documents": docs_source, "tokens": STAGE3_TOKENS,
        "cu_seqlens": cu.tolist(), "windows": {"short": short, "long": long}, "step_attention_ms": step,
        "cudnn_version": _cudnn_version(), "cudnn_graph_builds": _cudnn_builds()}, indent=2))


def _cudnn_builds():
    """Graphs the cudnn backend built in this run and their host seconds (None if it did not run)."""
    from speedrun.attention.cudnn import _Runner

    sdpa = _Runner.sdpa
    if sdpa is None:
        return None
    print(f"cudnn: {sdpa.builds} graphs built in {sdpa.build_seconds:.1f} s")
    return {"builds": sdpa.builds, "seconds": sdpa.build_seconds}


def _cudnn_version():
    try:
        from speedrun.attention.cudnn import import_cudnn

        m = import_cudnn()
        return {"frontend": getattr(m, "__version__", None), "backend": int(m.backend_version())}
    except Exception:  # noqa: BLE001 - the frontend is optional
        return {"backend": torch.backends.cudnn.version()}


if __name__ == "__main__":
    main()
