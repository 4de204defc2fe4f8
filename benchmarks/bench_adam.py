"""Time the record's Adam update per table on one CUDA GPU: the eager reference
(``speedrun.optim.adam.adam_update_``) against the one-pass Triton kernel
(``speedrun.kernels.fused_adam.adam_update_fused_``), interleaved.

Per table (bf16 weights and gradients, fp32 moments, the record's betas): median ms of each arm
over ``--reps`` interleaved repetitions (CUDA events around each call), the ratio fused /
reference, and the floor: the kernel's compulsory bytes (22 per element: p, grad, two moments
read; p and the moments written) over the copy bandwidth measured in the same run.  The record
updates all of these tables on every odd step; the per-update total is printed last.

Writes ``$OUT/bench_adam.json`` (``OUT`` defaults to ``./bench_out``).
Usage: ``python benchmarks/bench_adam.py [--reps 15]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

# (name, rows, betas, lr_mul, wd_mul): the record's Adam tables with width 768 (recipe §4.1)
TABLES = [
    ("lm_head", 50304, (0.5, 0.95), 1.0, 150.0),  # (768, 50304) in the model; same elements
    ("embed", 50304, (0.5, 0.95), 1.0, 150.0),
    ("value_embeds", 251520, (0.75, 0.95), 75.0, 5.0),
    ("bigram_embed", 377280, (0.75, 0.95), 75.0, 5.0),
]
WIDTH = 768
BYTES_PER_ELEMENT = 2 + 2 + 4 + 4 + 2 + 4 + 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15, help="interleaved repetitions per arm")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_adam: needs a CUDA GPU", file=sys.stderr)
        return 1
    from speedrun.evidence.fingerprint import measure_copy_tbps
    from speedrun.kernels.fused_adam import adam_update_fused_
    from speedrun.optim.adam import adam_update_, new_adam_state

    copy_tbps = measure_copy_tbps()
    print(f"copy bandwidth {copy_tbps:.2f} TB/s", flush=True)
    arms = {"reference": adam_update_, "fused": adam_update_fused_}
    results = []
    for name, rows, betas, lr_mul, wd_mul in TABLES:
        gen = torch.Generator(device="cuda").manual_seed(rows)
        grad = torch.randn(rows, WIDTH, device="cuda", generator=gen).bfloat16()
        params = {a: (torch.randn(rows, WIDTH, device="cuda", generator=gen) * 0.05).bfloat16() for a in arms}
        states = {a: new_adam_state(params[a]) for a in arms}
        kw = dict(lr=0.008 * lr_mul, betas=betas, eps=1e-10, weight_decay=0.005 * wd_mul)
        times: dict[str, list[float]] = {a: [] for a in arms}
        for rep in range(args.reps + 2):  # two untimed warmups (Triton compile, allocator)
            for a, fn in arms.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(params[a], grad, states[a], **kw)
                end.record()
                end.synchronize()
                if rep >= 2:
                    times[a].append(start.elapsed_time(end))
        n = rows * WIDTH
        floor_ms = n * BYTES_PER_ELEMENT / (copy_tbps * 1e12) * 1e3
        med = {a: statistics.median(t) for a, t in times.items()}
        spread = {a: (min(t), max(t)) for a, t in times.items()}
        row = {"table": name, "elements": n, "floor_ms": floor_ms, "median_ms": med, "range_ms": spread,
               "ratio_fused_vs_reference": med["fused"] / med["reference"],
               "fused_tbps": n * BYTES_PER_ELEMENT / (med["fused"] * 1e-3) / 1e12}
        results.append(row)
        print(f"{name:13s} {n / 1e6:7.1f} M  floor {floor_ms:6.2f} ms  reference {med['reference']:7.2f} ms "
              f"({spread['reference'][0]:.2f}-{spread['reference'][1]:.2f})  fused {med['fused']:6.2f} ms "
              f"({spread['fused'][0]:.2f}-{spread['fused'][1]:.2f}, {row['fused_tbps']:.2f} TB/s)  "
              f"ratio {row['ratio_fused_vs_reference']:.3f}", flush=True)
        del grad, params, states
        torch.cuda.empty_cache()
    total = {a: sum(r["median_ms"][a] for r in results) for a in arms}
    floor = sum(r["floor_ms"] for r in results)
    print(f"per Adam update (odd steps): reference {total['reference']:.2f} ms, fused {total['fused']:.2f} ms, "
          f"floor {floor:.2f} ms", flush=True)
    out_dir = Path(os.environ.get("OUT", "./bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "bench_adam.json"
    path.write_text(json.dumps({"copy_tbps": copy_tbps, "reps": args.reps, "tables": results,
                                "total_ms": total, "floor_ms": floor}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
