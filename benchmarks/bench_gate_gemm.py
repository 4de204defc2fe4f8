"""The record network's MUDD / MUDD-gate projections, forward + backward, compiled, with their
output columns unpadded (``model.gate_gemm_align=1``) or padded to a multiple of 8, on one CUDA GPU.

Why: ``mudd_mlp`` ends in a GEMM with 5, 12, 14 or 41 output columns (K = 64 hidden).  Those row
strides are not 16-byte aligned, so cuBLAS runs its slow ``align1`` kernels on them (as it does
for upstream).  Padding w2 with zero
rows makes every stride aligned at the cost of a few zero columns.

Each arm is :func:`speedrun.model.record_parts.mudd_mlp` compiled with ``torch.compile``, at
stage-3 shapes (T = 49,152 tokens, D = 768, hidden 64), one call per output width as a stage-3
micro-batch has them.  Arms are interleaved (``--reps`` rounds of ``triton.testing.do_bench``);
prints medians, the ratio padded / unpadded, the byte floor at ``--copy-tbps``, and each arm's
GEMM kernel names (torch.profiler).  Writes ``$OUT/bench_gate_gemm.json``.

Caveat: each round issues ~40 small kernels per arm from the host, so the medians sit far above
the byte floor with a wide spread: the timing is launch-bound and does not carry over to a
compiled stage-3 step, where the GPU trails the host.  Read the kernel
names (which GEMMs each arm gets); time the switch in ``speedrun bench step`` arms.

Usage: ``python benchmarks/bench_gate_gemm.py [--tokens 49152] [--reps 7]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

WIDTHS = (12, 41, 14, 5)  # pre gate, post gate, MUDD of the last layer, final MUDD (record preset)


def make_step(x, params, align):
    from speedrun.model.record_parts import mudd_mlp

    @torch.compile
    def fwd(x, w1, w2, b2):
        return mudd_mlp(x, w1, w2, b2, 0.1, align)

    grads = [torch.randn(x.shape[0], p[1].shape[0], device=x.device, dtype=x.dtype) for p in params]

    def step():
        for (w1, w2, b2), g in zip(params, grads):
            out = fwd(x, w1, w2, b2)
            torch.autograd.backward(out, g)

    return step


def gemm_kernels(step) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if any(w in e.key.lower() for w in ("gemm", "cutlass", "nvjet", "sm90"))}
    return sorted(names)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=49152)
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--copy-tbps", type=float, default=4.2, help="measured copy bandwidth, TB/s, for the floor")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_gate_gemm needs a CUDA GPU")
    import triton.testing

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    T, D, Hd = args.tokens, args.dim, args.hidden
    x = torch.randn(T, D, device=dev, dtype=dt, requires_grad=True)
    params = [tuple((torch.randn(*s, device=dev, dtype=dt) * 0.02).requires_grad_()
                    for s in ((Hd, D), (n, Hd), (n,))) for n in WIDTHS]
    leaves = [x, *(p for ps in params for p in ps)]
    arms = {"align1": make_step(x, params, 1), "align8": make_step(x, params, 8)}
    kernels = {}
    for name, step in arms.items():
        step()  # compile
        kernels[name] = gemm_kernels(step)
    times: dict[str, list[float]] = {n: [] for n in arms}
    for r in range(args.reps):
        order = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for name in order:
            times[name].append(triton.testing.do_bench(arms[name], warmup=5, rep=50, grad_to_none=leaves))
    med = {n: statistics.median(t) for n, t in times.items()}
    # compulsory bytes of one mudd_mlp fwd+bwd, bf16: x read by the forward GEMM and by dW1, dx
    # written; the hidden (T, 64) written, read back (gelu backward, dW2) and its gradient once
    # each; the outputs and their gradients are tiny.
    floor_bytes = len(WIDTHS) * 2 * (3 * T * D + 4 * T * Hd)
    floor_ms = floor_bytes / (args.copy_tbps * 1e12) * 1e3
    print(f"mudd_mlp x {len(WIDTHS)} (widths {WIDTHS}), fwd+bwd compiled, T={T} D={D} hidden={Hd}, {args.reps} rounds")
    for n in arms:
        iqr = statistics.quantiles(times[n], n=4) if len(times[n]) > 1 else [0, 0, 0]
        print(f"  {n}: median {med[n]:.3f} ms (IQR {iqr[2] - iqr[0]:.3f})  GEMMs: {', '.join(kernels[n]) or '-'}")
    print(f"  align8 / align1: {med['align8'] / med['align1']:.4f}; floor {floor_ms:.3f} ms "
          f"({floor_bytes / 1e6:.0f} MB at {args.copy_tbps} TB/s)")
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gate_gemm.json").write_text(json.dumps(
        {"widths": WIDTHS, "tokens": T, "times_ms": times, "median_ms": med, "kernels": kernels,
         "floor_ms": floor_ms, "device": torch.cuda.get_device_name()}, indent=1))


if __name__ == "__main__":
    main()
