"""Are two runs' final weights the same?  ``python tools/compare_runs.py RUN_A RUN_B``

Compares the newest checkpoints of two run folders tensor by tensor (relative Frobenius error)
and their validation losses (:mod:`speedrun.evidence.equivalence`); exit status 0 when every
tensor is within ``--tolerance`` (default 5e-3: bf16 rounding of sums taken in another order,
what N ranks vs 1 rank with gradient accumulation should show) and the losses within
``--val-tolerance`` (relative, default 1e-3), 1 otherwise, 2 when a run folder has no checkpoint
or log.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from speedrun.errors import SpeedrunError  # noqa: E402
from speedrun.evidence.equivalence import compare_runs, render  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_a", help="run folder (holds checkpoints/ and log.txt)")
    p.add_argument("run_b", help="run folder to compare with")
    p.add_argument("--tolerance", type=float, default=5e-3, help="largest relative error per tensor")
    p.add_argument("--val-tolerance", type=float, default=1e-3, help="largest relative validation-loss difference")
    p.add_argument("--json", help="also write the result as JSON")
    args = p.parse_args(argv)
    try:
        res = compare_runs(args.run_a, args.run_b, tolerance=args.tolerance, val_tolerance=args.val_tolerance)
    except (SpeedrunError, ValueError, OSError) as e:
        print(f"compare_runs: {e}", file=sys.stderr)
        return 2
    print(render(res))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
