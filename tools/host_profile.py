"""Where a training step's host time goes, by Python function (cProfile), per arm.

``speedrun bench step --host-steps`` says how long the host takes to issue each phase of a step
(enough host time per micro-batch forward that the GPU waits for it at stage 1).  This script says which Python functions that time is
spent in: it builds each arm the way ``bench step`` does, runs untimed warmup steps (compilation),
then profiles a few steps with cProfile (its own overhead inflates pure-Python frames, so compare
functions with each other, not with the unprofiled step time) and prints the functions with the
most own time and the most cumulative time, one table per arm.

Usage (GPU machine, repo root):
  python tools/host_profile.py --arm record --arm candidate --stage 0 \
      --data '/tmp/webmix/webmix_train_*.bin' --set train.max_docs=256 [--out DIR]
Writes ``host_profile_<arm>.txt`` into ``--out`` (default ``$OUT`` or ``bench_out``).  With CUDA
graphs the warmup runs at least until every step key replays.  ``--as-rank-of N``: one rank's
share of an N-GPU step, as ``speedrun bench step --as-rank-of N``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def profile_arm(spec: str, common: list[str], stage: int, warmup: int, steps: int, top: int,
                as_rank_of: int | None = None) -> str:
    import torch

    from speedrun import distributed
    from speedrun.evidence.arms import parse_arm
    from speedrun.evidence.bench import build_session

    arm = parse_arm(spec)
    cfg = arm.config(common)
    info = distributed.setup(cfg.train.device)
    session = build_session(arm.name, cfg, stage, info, simulate_world=as_rank_of)
    cuda = info.device.type == "cuda"
    warmup = session.warmup_steps(warmup)  # with CUDA graphs, the profiled steps replay
    try:
        for _ in range(warmup):
            session.step()
        prof = cProfile.Profile()
        wall = []
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize(info.device)
            t0 = time.perf_counter()
            prof.enable()
            session.step()
            prof.disable()
            wall.append((time.perf_counter() - t0) * 1000.0)
            if cuda:
                torch.cuda.synchronize(info.device)
    finally:
        session.close()
        distributed.teardown()
    out = io.StringIO()
    where = f", rank 0 of {as_rank_of} simulated" if as_rank_of else ""
    out.write(f"# host profile: arm {arm.name} ({spec}), stage {stage}{where}, {steps} steps after {warmup} warmup\n")
    out.write(f"# host wall ms per step under cProfile: {', '.join(f'{w:.1f}' for w in wall)}\n\n")
    st = pstats.Stats(prof, stream=out)
    st.strip_dirs()
    out.write("## by own time (tottime), totals over all profiled steps\n")
    st.sort_stats("tottime").print_stats(top)
    out.write("\n## by cumulative time\n")
    st.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arm", action="append", required=True, help="NAME=PRESET[:overrides] or PRESET (repeatable)")
    p.add_argument("--stage", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--data", help="training shards glob")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--as-rank-of", type=int, metavar="N",
                   help="one rank's share of an N-GPU step, collectives as no-ops (as 'bench step --as-rank-of')")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench_out")))
    args = p.parse_args(argv)
    from speedrun.errors import SpeedrunError
    from speedrun.evidence.arms import data_overrides, parse_arm

    common = data_overrides(args.data) + list(args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in args.arm:
        try:
            text = profile_arm(spec, common, args.stage, args.warmup, args.steps, args.top, args.as_rank_of)
        except SpeedrunError as e:  # a bad arm, override, stage or simulated world
            print(f"host_profile: {e}", file=sys.stderr)
            return 2
        path = args.out / f"host_profile_{parse_arm(spec).name}.txt"
        path.write_text(text)
        print(text[:6000], flush=True)
        print(f"written: {path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
