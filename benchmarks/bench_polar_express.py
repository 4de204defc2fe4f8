"""Time the Polar Express Triton kernels against plain bf16 torch GEMMs at the record's shapes.

Usage (on a CUDA GPU): ``python benchmarks/bench_polar_express.py [--sweep]``; ``--sweep`` first
times a list of block configs per kernel and shape and prints the best (candidates for
``speedrun.kernels.polar_express.TUNED_CONFIGS``).
Prints one table (median ms by triton.testing.do_bench, and speedup = torch / triton) and writes
``polar_express_bench.json`` to ``$OUT`` (default ``./bench_out``).  The torch baselines are what a
plain implementation would run: ``torch.bmm`` for the Gram matrices, ``torch.baddbmm`` for
b*A + c*A@A, and the whole Polar Express with those in place of the Triton kernels; row
``pe_fold_aX`` times the iteration with ``a X`` folded into the polynomial (the default) against
the same kernels followed by ``baddbmm`` (whose separate output is first filled with a copy of X).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch


SWEEP_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)
    (128, 128, 64, 4, 8), (64, 128, 128, 4, 8), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
    (64, 64, 64, 4, 4), (64, 64, 128, 3, 4), (64, 64, 32, 5, 4), (32, 64, 64, 4, 4),
    (128, 128, 32, 4, 8), (64, 128, 64, 3, 8), (128, 128, 64, 3, 8), (128, 256, 64, 3, 8),
]


def sweep() -> list[dict]:
    """Time every SWEEP_CONFIGS entry per kernel and record shape (inside CUDA graphs)."""
    from triton.testing import do_bench_cudagraph

    from speedrun.kernels import polar_express as pe

    cases = []
    for B, M, K in [(8, 256, 768), (8, 192, 768), (64, 256, 768), (3, 768, 768), (24, 768, 768)]:
        A = torch.randn(B, M, K, device="cuda").bfloat16()
        out = torch.empty(B, M, M, device="cuda", dtype=torch.bfloat16)
        cases.append((("xxt", B, M, K), lambda A=A, out=out: pe.xxt(A, out)))
    for B, M, K in [(3, 3072, 768), (24, 3072, 768)]:
        A = torch.randn(B, M, K, device="cuda").bfloat16()
        out = torch.empty(B, K, K, device="cuda", dtype=torch.bfloat16)
        cases.append((("xtx", B, K, K), lambda A=A, out=out: pe.xtx(A, out)))
    for B, M in [(8, 256), (8, 192), (3, 768), (24, 768)]:
        X = torch.randn(B, M, 512, device="cuda")
        A = (X @ X.mT / 512).bfloat16()
        out = torch.empty_like(A)
        cases.append((("ba_plus_caa", B, M, M), lambda A=A, out=out: pe.ba_plus_caa(A, 0.5, -2.5, out)))
    results = []
    for key, fn in cases:
        best = None
        for cfg in SWEEP_CONFIGS:
            pe.TUNED_CONFIGS[key] = cfg
            try:
                ms = do_bench_cudagraph(fn, rep=50, return_mode="median")
            except Exception:  # noqa: BLE001 - e.g. out of shared memory: skip the config
                continue
            results.append({"key": list(key), "config": list(cfg), "graph_ms": ms})
            if best is None or ms < best[1]:
                best = (cfg, ms)
        pe.TUNED_CONFIGS.pop(key, None)
        by_cfg = {tuple(r["config"]): r["graph_ms"] for r in results if r["key"] == list(key)}
        record = by_cfg.get(pe._config(key[3], key[0]), float("nan"))
        rule = by_cfg.get(pe._config(key[3], key[0], 2, key, torch.device("cuda")), float("nan"))
        print(f"{str(key):<32} record cfg {record:.4f} ms  rule cfg {rule:.4f} ms  "
              f"best {best[1]:.4f} ms with {best[0]}")
    return results


def _iterate_with_baddbmm(pe, X):
    """Polar Express's iteration as it ran before the a X fold: Triton Gram and polynomial
    kernels, then ``a X + X P`` by ``baddbmm`` into a second buffer."""
    tall = X.size(-2) > X.size(-1)
    n = X.size(-1) if tall else X.size(-2)
    gram = torch.empty((X.size(0), n, n), device=X.device, dtype=torch.bfloat16)
    poly, nxt = torch.empty_like(gram), torch.empty_like(X)
    for a, b, c in pe.POLAR_EXPRESS_COEFFS:
        (pe.xtx if tall else pe.xxt)(X, gram)
        pe.ba_plus_caa(gram, c, b, poly)
        if tall:
            torch.baddbmm(X, X, poly, beta=a, out=nxt)
        else:
            torch.baddbmm(X, poly, X, beta=a, out=nxt)
        X, nxt = nxt, X
    return X


def main() -> int:
    if not torch.cuda.is_available():
        print("bench_polar_express: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench, do_bench_cudagraph

    from speedrun.kernels import polar_express as pe

    dev = "cuda"
    rows = []
    sweep_rows = sweep() if "--sweep" in sys.argv else None

    def bench(name, shape, fn_triton, fn_torch, flops, extra=None):
        row = {"op": name, "shape": list(shape)}
        for tag, fn in (("triton", fn_triton), ("torch", fn_torch), *((extra or {}).items())):
            row[f"{tag}_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
            # Inside a CUDA graph the Python launch cost disappears: the GPU time alone.
            try:
                row[f"{tag}_graph_ms"] = do_bench_cudagraph(fn, rep=100, return_mode="median")
            except Exception as e:  # noqa: BLE001 - report, keep benchmarking
                row[f"{tag}_graph_ms"] = float("nan")
                row[f"{tag}_graph_error"] = repr(e)[:200]
        row["speedup"] = row["torch_ms"] / row["triton_ms"]
        row["graph_speedup"] = row["torch_graph_ms"] / row["triton_graph_ms"]
        row["triton_graph_tflops"] = flops / row["triton_graph_ms"] / 1e9
        rows.append(row)

    # Gram matrices: (B, M, K) -> (B, M, M); dense FLOPs counted (the kernel does about half).
    for B, M, K in [(8, 256, 768), (8, 192, 768), (64, 256, 768), (3, 768, 768), (24, 768, 768)]:
        A = torch.randn(B, M, K, device=dev).bfloat16()
        out = torch.empty(B, M, M, device=dev, dtype=torch.bfloat16)
        bench("xxt", (B, M, K), lambda: pe.xxt(A, out), lambda: torch.bmm(A, A.mT, out=out), 2 * B * M * M * K)
    for B, M, K in [(3, 3072, 768), (8, 3072, 768), (24, 3072, 768)]:
        A = torch.randn(B, M, K, device=dev).bfloat16()
        out = torch.empty(B, K, K, device=dev, dtype=torch.bfloat16)
        bench("xtx", (B, M, K), lambda: pe.xtx(A, out), lambda: torch.bmm(A.mT, A, out=out), 2 * B * K * K * M)
    for B, M in [(8, 256), (8, 192), (3, 768), (8, 768), (24, 768)]:
        X = torch.randn(B, M, 512, device=dev)
        A = (X @ X.mT / 512).bfloat16()
        out = torch.empty_like(A)
        bench("ba_plus_caa", (B, M, M), lambda: pe.ba_plus_caa(A, 0.5, -2.5, out),
              lambda: torch.baddbmm(A, A, A, beta=-2.5, alpha=0.5, out=out), 2 * B * M * M * M)
    # Whole orthogonalisation: per-rank chunks on 8 GPUs, and full banks on one GPU.
    for shape in [(8, 256, 768), (3, 768, 768), (3, 3072, 768), (64, 256, 768), (24, 768, 768), (24, 3072, 768)]:
        G = torch.randn(shape, device=dev)
        B, m, n = shape
        small, big = min(m, n), max(m, n)
        flops = 5 * B * (2 * small * small * big * 2 + 2 * small**3)  # gram + X@B, plus B = A@A
        bench("polar_express", shape, lambda: pe.polar_express(G, use_triton=True),
              lambda: pe.polar_express(G, use_triton=False), flops)
        # a X folded into the polynomial (bmm) against the same Triton kernels with a baddbmm,
        # which first copies X into its output: "torch" here is the unfolded form
        X = pe.polar_express_normalize(G)
        bench("pe_fold_aX", shape, lambda: pe.polar_express_iterate(X.clone(), use_triton=True),
              lambda: _iterate_with_baddbmm(pe, X.clone()), flops)

    header = (f"{'op':<14} {'shape':<18} {'triton ms':>10} {'torch ms':>9} {'x':>5} | {'graph: triton':>13} "
              f"{'torch':>8} {'x':>5} {'TFLOP/s':>8}")
    print("median ms (triton.testing.do_bench); 'graph' = inside a CUDA graph (no launch cost); "
          "x = torch / triton")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['op']:<14} {str(tuple(r['shape'])):<18} {r['triton_ms']:>10.4f} {r['torch_ms']:>9.4f} "
              f"{r['speedup']:>5.2f} | {r['triton_graph_ms']:>13.4f} {r['torch_graph_ms']:>8.4f} "
              f"{r['graph_speedup']:>5.2f} {r['triton_graph_tflops']:>8.1f}")

    out_dir = Path(os.environ.get("OUT", "./bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "note": "median ms from triton.testing.do_bench (and do_bench_cudagraph for *_graph_ms); "
                "TFLOP/s count dense (non-symmetric) FLOPs",
    }
    path = out_dir / "polar_express_bench.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows, "sweep": sweep_rows}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
