"""Bytes the optimizer's collectives move per step on each rank of an N-rank run, without N GPUs.

Builds a preset's model and recipe as rank 0 of N simulated ranks (:mod:`speedrun.optim.simcomms`:
no-op collectives that count the bytes a real one moves), gives every parameter a zero gradient
and runs the optimizer's update for one even and one odd step (the record's Adam tables update
on odd steps only), on the CPU.  Prints the bytes per kind for each step and their mean, and the
time at each bus bandwidth given (ring accounting, as ``speedrun bench project --link-gbps``).

No rows are marked for the sparse bigram exchange here, so its table falls back to a dense
reduce-scatter on Adam steps: an overstatement of what a real step, which sends only the touched
rows, moves.  ``speedrun bench step --as-rank-of N`` counts a real step's traffic (with data).

Usage:
  python tools/comm_traffic.py --preset record --world 8 --gbps 350 --gbps 450 [--set K=V ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def step_traffic(preset_name: str, world: int, overrides: list[str] = (), steps: tuple[int, ...] = (100, 101)) -> dict:
    """``{"steps": {step: {kind: bytes}}, "mean": {kind: bytes}}`` for rank 0 of ``world``."""
    import torch

    from speedrun.config import apply_overrides, preset
    from speedrun.distributed import DistInfo, simulated_rank
    from speedrun.model import build_model
    from speedrun.train.recipes import build_recipe

    cfg = preset(preset_name)
    apply_overrides(cfg, ["train.device=cpu", "train.compile=false", "train.optimizer_compile=false", *overrides])
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    model.cast_for_training(torch.bfloat16)
    info = simulated_rank(DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")), world)
    recipe = build_recipe(cfg, model, info)
    comms = recipe.optimizer.comms
    per_step = {}
    for step in steps:
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        before = dict(comms.traffic)
        recipe.optimizer_step(step)
        per_step[step] = {k: comms.traffic[k] - before[k] for k in before}
    mean = {k: sum(s[k] for s in per_step.values()) / len(per_step) for k in comms.traffic}
    return {"preset": preset_name, "world": world, "steps": per_step, "mean": mean}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="record")
    p.add_argument("--world", type=int, default=8, help="ranks of the run (default 8)")
    p.add_argument("--gbps", type=float, action="append", default=[], help="bus bandwidth in GB/s (repeatable)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--json", type=Path, help="also write the counts as JSON")
    args = p.parse_args(argv)
    from speedrun.evidence.projection import comm_ms

    from speedrun.errors import SpeedrunError

    try:
        res = step_traffic(args.preset, args.world, args.overrides)
    except (SpeedrunError, KeyError, ValueError) as e:  # an unknown preset or field, a bad world
        print(f"comm_traffic: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    mb = lambda d: ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in d.items())  # noqa: E731
    for step, moved in res["steps"].items():
        print(f"{args.preset}, rank 0 of {args.world}, step {step}: {mb(moved)}")
    print(f"mean per step: {mb(res['mean'])}")
    res["ms_per_step"] = {}
    for gbps in args.gbps:
        res["ms_per_step"][gbps] = comm_ms(res["mean"], args.world, gbps)
        print(f"at {gbps:g} GB/s bus bandwidth, none overlapped: {res['ms_per_step'][gbps]:.2f} ms per step")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
