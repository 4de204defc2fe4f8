"""Host cost of one opaque op call (``speedrun.kernels.opaque``) inside a compiled graph.

Each fused kernel of the compiled network (MLP, packed QKV, QK-prep) is one ``opaque_fwd`` and,
in the backward, one ``opaque_bwd`` call: Python work per call that the GPU waits for whenever
its own work per call is short (stage 1).  This compiles a chain of ``--ops`` opaque calls whose
kernel is a single multiply, and the same chain of plain multiplies, and prints the median host
microseconds per op, forward and backward, of each (``--reps`` timed repetitions after warmup).
Runs on the CPU (no GPU needed) or on ``--device cuda`` (synchronised per repetition).

Usage: ``python benchmarks/bench_opaque.py [--ops 20] [--reps 30] [--device cpu]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(n_ops: int):
    from speedrun.kernels import opaque

    handles = [opaque.register(opaque.OpaqueKernel(
        name=f"double[{i}]", forward=lambda ctx, ts: [ts[0] * 2], backward=lambda ctx, gs: [gs[0] * 2],
        out_specs=lambda ts: [(tuple(ts[0].shape), ts[0].dtype)], diff=(True,))) for i in range(n_ops)]

    def chain_opaque(x):
        for h in handles:
            x = opaque.call(h, [x])[0]
        return x

    def chain_plain(x):
        for _ in handles:
            x = x * 2
        return x

    return {"opaque": chain_opaque, "plain": chain_plain}


def time_arm(fn, x, reps: int, sync) -> tuple[list[float], list[float]]:
    fwd, bwd = [], []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        y = fn(x)
        sync()
        t1 = time.perf_counter()
        y.sum().backward()
        sync()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return fwd, bwd


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=20)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both arms")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    x = torch.randn(16, 16, device=dev, requires_grad=True)
    arms = {name: torch.compile(fn, fullgraph=True) for name, fn in build(args.ops).items()}
    for fn in arms.values():  # compile and warm up
        for _ in range(3):
            fn(x).sum().backward()
    per_op = {name: ([], []) for name in arms}
    for _ in range(args.rounds):
        for name, fn in arms.items():
            f, b = time_arm(fn, x, args.reps, sync)
            per_op[name][0].extend(t / args.ops * 1e6 for t in f)
            per_op[name][1].extend(t / args.ops * 1e6 for t in b)
    print(f"host us per op ({args.ops} ops per graph, {args.rounds} x {args.reps} repetitions, {dev}):")
    med = {}
    for name, (f, b) in per_op.items():
        med[name] = (statistics.median(f), statistics.median(b))
        q = lambda v: statistics.quantiles(v, n=4)  # noqa: E731
        print(f"  {name:7} forward {med[name][0]:6.1f} (IQR {q(f)[0]:.1f}-{q(f)[2]:.1f})   "
              f"backward {med[name][1]:6.1f} (IQR {q(b)[0]:.1f}-{q(b)[2]:.1f})")
    extra = [med["opaque"][i] - med["plain"][i] for i in range(2)]
    print(f"  opaque over plain: forward {extra[0]:.1f} us, backward {extra[1]:.1f} us per op")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
