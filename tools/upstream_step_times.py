"""Median ms per optimizer step, per stage, from an upstream modded-nanogpt log.

Reads the ``step:N/M train_time:Tms step_avg:Sms`` lines (via :mod:`speedrun.evidence.logparse`,
which parses upstream and our logs alike).  Line N is printed after 0-based step N-1, so the
difference between lines N-1 and N is the time of step N-1.  Upstream's ``train_time`` excludes
validation (the clock stops around it) and is read on the host without a device sync, so a single
delta can be off by the queue's lag; medians over a stage are robust to that, and the final
validation line's ``train_time`` (which does sync) gives an exact total.

Stage starts (0-based steps of stage 1, 2, 3 and the extension) come from ``--stages``, else
``--scheduled S`` (upstream: 0, round(S/3), round(2S/3), S), else ``--config bench_config.json``
(written by ``upstream_f411b3d.py``), else the log's "Sampling steps [...] for warmup" line.
The first ``--skip`` (2) steps of each stage are left out of its statistics: they carry the
batch-size switch and any lag from the previous stage.

With ``--ours BENCH.json`` (``speedrun bench step --json`` on the same machine), each of our
arms is set against upstream's stage of the bench's stage index (0 -> stage1, ...): the ratio of
the medians, ours / upstream, with an unpaired bootstrap CI (the two programs cannot be
interleaved).  Our sample is one step timed alone (``arm``) or the mean of K chained steps
(``arm@K``, ``--chain``); upstream's delta is a step of a run issued back to back, which
``arm@K`` resembles.  The bench steps a freshly initialised model, upstream's log a model
trained up to that step (tensor-core power depends on the operands, and at the H200's power
limit so does the clock): ``--ours LOG``, our ``speedrun train`` log of the same schedule
(``SHORT_STEPS=47 SHORT_EXT=2 bash tools/device_run.sh recordrun`` against
``upstream_f411b3d.sh --scheduled 45 --extension 2``), compares the same steps of both, stage by
stage, with the same stage starts and skip.

Usage:  python tools/upstream_step_times.py LOG [--stages 0,35,70,105 | --scheduled 105 |
        --config bench_config.json] [--skip 2] [--json OUT.json] [--ours BENCH.json | --ours OUR_LOG]
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, uninstalled

from speedrun.errors import DataError  # noqa: E402
from speedrun.evidence.logparse import RunSummary, parse_log  # noqa: E402

STAGE_NAMES = ("stage1", "stage2", "stage3", "extension")
_WARMUP = re.compile(r"^Sampling steps (\[[\d, ]*\]) for warmup", re.M)


def starts_from_scheduled(scheduled: int) -> list[int]:
    """Upstream's boundaries for three stages of 1/3 each, then the extension."""
    return [0, round(scheduled / 3), round(2 * scheduled / 3), scheduled]


def starts_from_warmup(text: str) -> list[int]:
    """Stage starts from upstream's warmup line: each transition s is warmed at s-2, s-1, s, s+1."""
    m = _WARMUP.search(text)
    if not m:
        raise DataError("no 'Sampling steps [...] for warmup' line: pass --stages or --scheduled")
    steps = sorted(set(ast.literal_eval(m[1])) - {0, 1})
    runs, run = [], []
    for s in steps:
        if run and s != run[-1] + 1:
            runs.append(run)
            run = []
        run.append(s)
    if run:
        runs.append(run)
    # Transitions exactly 4 apart touch (one run of 8, 12): split such runs into blocks of 4.
    blocks = [r[i:i + 4] for r in runs if len(r) % 4 == 0 for i in range(0, len(r), 4)]
    if len(blocks) != 3 or sum(map(len, runs)) != 12:
        raise DataError(f"warmup steps {steps} do not split into 3 transitions: pass --stages or --scheduled")
    return [0] + [b[2] for b in blocks]


def stage_ranges(starts: list[int], total: int) -> list[tuple[str, int, int]]:
    """``(name, first step, end step)`` with 0-based, end-exclusive steps."""
    if starts[0] != 0 or starts != sorted(starts) or starts[-1] >= total:
        raise DataError(f"stage starts {starts} do not fit a run of {total} steps")
    bounds = [*starts, total]
    return [(STAGE_NAMES[i] if i < len(STAGE_NAMES) else f"stage{i + 1}", bounds[i], bounds[i + 1])
            for i in range(len(starts))]


def step_ms(run: RunSummary) -> dict[int, float]:
    """``{0-based step: ms}`` from consecutive train_time deltas."""
    return {n - 1: ms for n, ms in run.step_durations_ms()}


def stage_stats(times: dict[int, float], name: str, lo: int, hi: int, skip: int) -> dict:
    """Median/mean/min/max ms per step over steps [lo + skip, hi) that the log timed."""
    xs = [times[s] for s in range(lo + skip, hi) if s in times]
    row = {"stage": name, "steps": [lo, hi], "measured": len(xs)}
    if xs:
        row.update(median_ms=statistics.median(xs), mean_ms=statistics.fmean(xs), min_ms=min(xs), max_ms=max(xs),
                   times_ms=xs)
    return row


def _row(arm: str, chain: int, up: dict, ours_ms: list[float], seed: int) -> dict:
    """One comparison row: our times against upstream's stage ``up`` (median ratio, unpaired CI)."""
    from speedrun.evidence.bench import unpaired_ratio_ci

    return {"arm": arm, "chain": chain, "stage": up["stage"], "ours_ms": statistics.median(ours_ms),
            "ours_n": len(ours_ms), "upstream_ms": up["median_ms"], "upstream_n": up["measured"],
            **unpaired_ratio_ci(up["times_ms"], ours_ms, seed=seed)}


def against_ours(res: dict, bench: dict, seed: int = 0) -> list[dict]:
    """Each arm of our ``bench step`` result against upstream's stage of the same index:
    ``{"arm", "stage", "ours_ms", "upstream_ms", "ratio", "ci_low", "ci_high", ...}``."""
    index = int(bench["stage"])
    if not 0 <= index < 3:
        raise DataError(f"our bench timed stage index {index}; upstream's log has stages 0-2 (stage1-stage3)")
    up = res["stages"][index]
    if up["measured"] < 2:
        raise DataError(f"{res['log']}: {up['stage']} has {up['measured']} timed steps after the skip; need >= 2")
    return [_row(arm["name"], arm.get("chain", 1), up, arm["times_ms"], seed) for arm in bench["arms"]]


def against_our_log(res: dict, ours: dict, seed: int = 0) -> list[dict]:
    """Stage by stage, our training log's step times (``summarize`` of a ``speedrun train`` log of
    the same schedule) against upstream's: same rows as :func:`against_ours`, arm ``log``."""
    rows = [_row("log", 1, up, mine["times_ms"], seed) for up, mine in zip(res["stages"], ours["stages"])
            if up["measured"] >= 2 and mine["measured"] >= 2]
    if not rows:
        raise DataError(f"{ours['log']}: no stage with >= 2 timed steps on both sides")
    return rows


def format_against(rows: list[dict]) -> str:
    lines = [f"{'ours':14s} {'stage':7s} {'ours ms':>9s} {'upstream ms':>12s}  ours / upstream [95% CI, unpaired bootstrap]"]
    for r in rows:
        lines.append(f"{r['arm']:14s} {r['stage']:7s} {r['ours_ms']:9.2f} {r['upstream_ms']:12.2f}  "
                     f"{r['ratio']:.4f} [{r['ci_low']:.4f}, {r['ci_high']:.4f}]  (n {r['ours_n']} / {r['upstream_n']})")
    return "\n".join(lines)


def projected_ms(stages: list[dict]) -> float | None:
    """The run's training time as ``speedrun bench project`` projects one: each stage's steps x
    its median step, a stage without timed steps at the median of the stage before it (None if
    the first has none).  Set against the log's final ``train_time`` it measures the projection's
    own error on a real run: the slow steps a median leaves out (stage switches, pauses)."""
    total, last = 0.0, None
    for st in stages:
        last = st.get("median_ms", last)
        if last is None:
            return None
        total += (st["steps"][1] - st["steps"][0]) * last
    return total


def summarize(path: Path, starts: list[int] | None, skip: int) -> dict:
    """Per-stage statistics of one upstream log (see the module doc)."""
    run = parse_log(path)
    if not run.step_times:
        raise DataError(f"{path}: no 'step:N/M train_time:...' lines")
    if starts is None:
        starts = starts_from_warmup(Path(path).read_text(errors="replace"))
    times = step_ms(run)
    stages = [stage_stats(times, *r, skip) for r in stage_ranges(starts, run.total_steps)]
    final = run.train_time_ms if run.complete else None
    projected = projected_ms(stages)
    return {
        "log": str(path),
        "total_steps": run.total_steps,
        "last_step_logged": run.step_times[-1][0],
        "stage_starts": starts,
        "skip": skip,
        "stages": stages,
        "final_train_time_ms": final,
        "projected_ms": projected,
        "projected_over_final": projected / final if projected is not None and final else None,
        "peak_allocated_mib": run.peak_allocated_mib,
        "torch": run.torch_version,
        "gpus": run.gpus,
    }


def format_table(res: dict) -> str:
    lines = [f"{res['log']}: {res['last_step_logged']}/{res['total_steps']} steps logged, "
             f"stage starts {res['stage_starts']}, first {res['skip']} steps of each stage skipped",
             f"{'stage':10s} {'steps':>9s} {'n':>4s} {'median ms':>10s} {'mean':>9s} {'min':>9s} {'max':>9s}"]
    for s in res["stages"]:
        steps = f"{s['steps'][0]}-{s['steps'][1] - 1}"
        if s["measured"]:
            lines.append(f"{s['stage']:10s} {steps:>9s} {s['measured']:4d} {s['median_ms']:10.1f} "
                         f"{s['mean_ms']:9.1f} {s['min_ms']:9.1f} {s['max_ms']:9.1f}")
        else:
            lines.append(f"{s['stage']:10s} {steps:>9s}    0  (no timed steps)")
    if res["final_train_time_ms"] is not None:
        lines.append(f"final train_time {res['final_train_time_ms']:.0f} ms "
                     f"({res['final_train_time_ms'] / res['total_steps']:.1f} ms/step overall)")
    if res.get("projected_over_final") is not None:
        lines.append(f"projected as speedrun bench project does (steps x median per stage): "
                     f"{res['projected_ms']:.0f} ms = {res['projected_over_final']:.4f} of the final train_time")
    if res["peak_allocated_mib"] is not None:
        lines.append(f"peak memory allocated {res['peak_allocated_mib']} MiB")
    return "\n".join(lines)


def resolve_starts(args: argparse.Namespace) -> list[int] | None:
    if args.stages:
        return [int(x) for x in args.stages.split(",")]
    if args.scheduled is not None:
        return starts_from_scheduled(args.scheduled)
    if args.config is not None:
        return list(json.loads(Path(args.config).read_text())["stage_starts"])
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--stages", help="comma-separated 0-based first steps of each stage, e.g. 0,35,70,105")
    ap.add_argument("--scheduled", type=int, help="num_scheduled_iterations of the run")
    ap.add_argument("--config", type=Path, help="bench_config.json written by upstream_f411b3d.py")
    ap.add_argument("--skip", type=int, default=2, help="steps left out at the start of each stage")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--ours", type=Path, metavar="BENCH.json|LOG",
                    help="`speedrun bench step --json` output of the same machine (each arm / upstream's stage), "
                         "or our `speedrun train` log of the same schedule (stage by stage)")
    args = ap.parse_args(argv)
    try:
        res = summarize(args.log, resolve_starts(args), args.skip)
        if args.ours is not None and args.ours.suffix == ".json":
            res["against_ours"] = against_ours(res, json.loads(args.ours.read_text()))
        elif args.ours is not None:  # our own training log of the same schedule
            res["against_ours"] = against_our_log(res, summarize(args.ours, res["stage_starts"], args.skip))
    except (DataError, OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(res))
    if "against_ours" in res:
        print(format_against(res["against_ours"]))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
