"""Host cost of launching a CUDA graph, against the number of kernels it holds.

A replayed training step's host time ends in one ``torch.cuda.CUDAGraph.replay()`` per step key
(:mod:`speedrun.train.graphs`).  Whether that launch costs the host time per node decides what
could lower it: fewer kernels per graph, or less Python around the launch.  This measures the
launch alone: graphs of N tiny kernels (in-place adds on a 1-element tensor, so the GPU time is negligible and
the launch queue never fills), each launched ``--reps`` times from an idle GPU, the host wall
time of ``replay()`` alone per launch; then a least-squares line through (N, median) gives the
fixed cost (microseconds) and the cost per node (nanoseconds).

The graph's node count is read back from the driver (``cuGraphGetNodes`` on
``raw_cuda_graph()``, the graph kept with ``keep_graph=True``) where libcuda can be loaded, so the
table shows what was launched, not what was asked for.

Usage: ``python benchmarks/bench_graph_launch.py [--nodes 1 10 100 300 1000 3000] [--reps 50]
[--json FILE]``.  Needs a CUDA GPU.  Compare figures only within one run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time


def driver_node_count(graph) -> int | None:
    """Nodes of ``graph`` (a ``torch.cuda.CUDAGraph`` made with ``keep_graph=True``) as the driver
    counts them, or None where libcuda or the raw graph is unavailable."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_size_t(0)
        status = lib.cuGraphGetNodes(ctypes.c_void_p(graph.raw_cuda_graph()), None, ctypes.byref(count))
    except (OSError, AttributeError, RuntimeError):
        return None
    return int(count.value) if status == 0 else None


def launch_cost(nodes: int, reps: int) -> dict:
    """Median, q1, q3 host microseconds of one ``replay()`` of a graph of ``nodes`` tiny kernels,
    each launch from an idle GPU (synchronised before, not timed)."""
    import torch

    x = torch.zeros(1, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm the op on the capture stream
        x.add_(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    try:
        graph, kept = torch.cuda.CUDAGraph(keep_graph=True), True
    except TypeError:  # a torch without keep_graph: launched all the same, not counted
        graph, kept = torch.cuda.CUDAGraph(), False
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(nodes):
            x.add_(1.0)
    counted = None
    if kept:
        graph.instantiate()
        counted = driver_node_count(graph)
    graph.replay()  # the first launch uploads the graph: not timed
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    q = statistics.quantiles(times, n=4)
    return {"nodes_asked": nodes, "nodes_counted": counted, "median_us": statistics.median(times),
            "q1_us": q[0], "q3_us": q[2], "reps": reps}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of ys against xs (at least two distinct xs)."""
    if len(set(xs)) < 2:
        raise ValueError("need at least two distinct node counts")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", nargs="+", type=int, default=[1, 10, 100, 300, 1000, 3000],
                   help="kernels per graph (each >= 1)")
    p.add_argument("--reps", type=int, default=50, help="timed launches per graph (>= 4)")
    p.add_argument("--json", help="also write the rows and the fit as JSON")
    args = p.parse_args(argv)
    if any(n < 1 for n in args.nodes) or args.reps < 4 or len(set(args.nodes)) < 2:
        print("--nodes: two or more distinct counts, each >= 1; --reps >= 4", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("bench_graph_launch needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [launch_cost(n, args.reps) for n in sorted(set(args.nodes))]
    fixed_us, per_node_us = fit_line([r["nodes_asked"] for r in rows], [r["median_us"] for r in rows])
    print(f"{'nodes':>6} {'counted':>8} {'median us':>10} {'q1':>8} {'q3':>8}")
    for r in rows:
        print(f"{r['nodes_asked']:>6} {str(r['nodes_counted']):>8} {r['median_us']:>10.1f} "
              f"{r['q1_us']:>8.1f} {r['q3_us']:>8.1f}")
    print(f"fit: {fixed_us:.1f} us + {per_node_us * 1000:.0f} ns per node "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__}, {args.reps} launches per graph)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                       "fixed_us": fixed_us, "per_node_us": per_node_us}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
