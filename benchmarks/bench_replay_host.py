"""Host cost of a replayed training step, phase by phase, on any machine (a CPU included).

With CUDA graphs a step's micro-batches are one graph launch, and what is left on the host is the
Python around it: fetching the batches, the step key (its address watch), the input copies, the
launch, the host state set back, then the optimizer's host half and the eager tail.  This builds
the record's or the candidate's code path at the record's depth (11 layers; the host's
bookkeeping grows with the number of layers and tensors, not their width) at a tiny width on the
built-in corpus, runs its steps through :class:`speedrun.train.graphs.StepGraphs` with the capture
stood in by one eager run and a replay that launches nothing (:class:`NoOpCapture`), and prints
the median host microseconds of each phase over the traced steps, with the host time per
micro-batch (:func:`speedrun.evidence.host.summarize_traces`).

So the loop's kernels never run once the step replays, and every phase up to the launch is pure
host work.  The phases after it (``optimizer``, ``fp8_refresh``) run their kernels eagerly, as
PyTorch references off a GPU: there they are compute, not host cost.  ``--world N`` runs rank 0
of an N-GPU step (one micro-batch, collectives simulated), as ``bench step --as-rank-of N``.
Between steps the host sleeps ``--gpu-wait-ms``: in training it waits there for the GPU to finish
the step before (the loop reads that step's time and loss), and the loader builds the next
batches in that wait (:meth:`speedrun.data.loader.TrainLoader.build_ahead`); 0 leaves no gap.

Usage: ``python benchmarks/bench_replay_host.py [--arms record candidate] [--world 1 8]
[--steps 30] [--batch-divisor 1024] [--gpu-wait-ms 20]``.  Run without ``TRITON_INTERPRET`` (the
fused kernels then run their references on a CPU).  Compare figures only within one run of this
script.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from speedrun.train.graphs import RerunCapture


class NoOpCapture(RerunCapture):
    """:class:`speedrun.train.graphs.RerunCapture` whose replays launch nothing: capturing still
    runs the loop once (so the bookkeeping a capture leaves is there), a replay runs nothing."""

    def capture(self, fn):
        fn()
        return self

    def replay(self) -> None:
        pass


# arm -> (CPU preset, overrides): the record's FP8 switches on tiny-record (as the record preset
# sets them), the candidate's are tiny-candidate's own
ARMS = {
    "record": ("tiny-record", ["model.kernels=fp8", "model.mlp_input_quant=graph", "model.mlp_weight_grad=accumulate"]),
    "candidate": ("tiny-candidate", []),
}


def measure(arm: str, world: int, steps: int, batch_divisor: int, out_dir: str, gpu_wait_ms: float = 0.0) -> dict:
    """Host phases (median us) of ``steps`` replayed steps of ``arm`` (:data:`ARMS`) at 11 layers,
    the host idle for ``gpu_wait_ms`` after each step (the training loop's wait for the GPU)."""
    import time

    from speedrun import distributed
    from speedrun.config import apply_overrides, preset
    from speedrun.evidence.bench import build_session
    from speedrun.evidence.host import summarize_traces, trace_step
    from speedrun.train.graphs import StepGraphs
    from speedrun.train.loop import micro_batching

    preset_name, switches = ARMS[arm]
    cfg = preset(preset_name)
    apply_overrides(cfg, ["model.num_layers=11", f"train.batch_divisor={batch_divisor}", "train.grad_accum=0",
                          "train.steps=400", f"out_dir={out_dir}", *switches])
    session = build_session(arm, cfg, 0, distributed.setup("cpu"), simulate_world=None if world == 1 else world)
    try:
        session.graphs = graphs = StepGraphs(session.run_model, session.recipe, session.info.device, session.dtype,
                                             capture_with=NoOpCapture, check=False, ends_step=world == 1)
        for _ in range(graphs.steps_until_replay + 2):
            session.step()
        replayed, walks = graphs.stats.replayed_steps, graphs._watch.walks
        traces = []
        for _ in range(steps):
            time.sleep(gpu_wait_ms / 1000.0)
            traces.append(trace_step(session.step, session.info.device))
        if graphs.stats.replayed_steps != replayed + steps:
            raise RuntimeError(f"{arm}: not every traced step replayed ({graphs.summary()})")
        count = micro_batching(session.stage, session.cfg, session.info.world_size).count
        summary = summarize_traces(traces, micro_batches=count)
        summary["key_walks"] = graphs._watch.walks - walks  # the step key's walks while traced: 0 when settled
    finally:
        session.close()
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="code paths")
    p.add_argument("--world", nargs="+", type=int, default=[1, 8], help="1: one rank; N: rank 0 of N, simulated")
    p.add_argument("--steps", type=int, default=30, help="traced steps per arm and world")
    p.add_argument("--batch-divisor", type=int, default=1024, help="the preset's batches divided by this")
    p.add_argument("--gpu-wait-ms", type=float, default=20.0,
                   help="host idle after each step, standing in for the training loop's wait for the GPU")
    args = p.parse_args(argv)
    if args.steps < 3 or any(w < 1 for w in args.world) or args.gpu_wait_ms < 0:
        print("--steps must be >= 3, every --world >= 1 and --gpu-wait-ms >= 0", file=sys.stderr)
        return 2
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world:
            for arm in args.arms:
                s = measure(arm, world, args.steps, args.batch_divisor, tmp, args.gpu_wait_ms)
                phases = "  ".join(f"{name} {t['host_ms'] * 1000:.0f}" for name, t in s["phases"].items())
                print(f"{arm:<16} world {world}: {s['micro_batch_host_ms'] * 1000:7.0f} us per micro-batch "
                      f"({s['micro_batches']} per step), whole step {s['host_ms'] * 1000:.0f} us; "
                      f"key walks while traced {s['key_walks']}\n    {phases}")
    print(f"(median host microseconds over {args.steps} replayed steps, {args.gpu_wait_ms:g} ms idle before each; "
          f"torch {torch.__version__}, one thread; compare within one run only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
