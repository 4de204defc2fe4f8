"""Evidence subcommands: ``stats`` (statistics of finished runs) and ``doctor`` (preflight).

Each subcommand is one ``_add_<name>(subparsers)`` function that sets ``func``; add new ones
(bench, compare, profile) to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_STATS_EPILOG = """\
Each positional argument is one group of runs: a log file, a folder (searched recursively for
*.txt and *.log) or a quoted glob.  With two groups the first is the baseline A and the second the
candidate B, and they are compared (Welch t-tests, time ratio B/A).

A run's result is its last 'step:N/M val_loss:X train_time:Tms' line; runs whose last validation
is not at the final step are reported as incomplete and left out of the statistics.

examples:
  speedrun stats logs/                                  one group: losses, times, p vs 3.28
  speedrun stats runs/baseline runs/candidate --labels base,fp8
  speedrun stats 'a/*.txt' 'b/*.txt' --reference-time 73.897 --json stats.json
"""

_DOCTOR_EPILOG = """\
Checks versions, GPU, FP8 (torch._scaled_mm), attention backends, data shards, the offline
tokenizer, and measures the node (bf16 matmul TFLOP/s, copy TB/s) when a GPU is present.
Every problem is printed with its fix.

examples:
  speedrun doctor                                      report only (exit 0)
  speedrun doctor --require-gpu --data 'data/fineweb10B/fineweb_*.bin'
                                                       exit 1 if a timed GPU run cannot work
"""


def _add_stats(sub) -> None:
    p = sub.add_parser(
        "stats",
        help="final losses, train times and t-tests of sets of runs",
        description="Statistics of speedrun logs (ours and upstream modded-nanogpt).",
        epilog=_STATS_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("groups", nargs="+", metavar="LOGS_OR_DIR", help="one group of runs per argument")
    p.add_argument("--labels", help="comma-separated group names (default: the arguments)")
    p.add_argument("--target", type=float, default=3.28, help="validation loss target (default 3.28)")
    p.add_argument("--reference-time", type=float, default=None, metavar="SECONDS",
                   help="project B's time as (mean B / mean A) x this reference time")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(func=_stats)


def _stats(args) -> int:
    from speedrun.evidence.logparse import load_group
    from speedrun.evidence.stats import analyze, render_markdown
    from speedrun.errors import ConfigError

    labels = args.labels.split(",") if args.labels else [str(g).rstrip("/") for g in args.groups]
    if len(labels) != len(args.groups):
        raise ConfigError(f"--labels names {len(labels)} group(s) but {len(args.groups)} were given")
    if len(set(labels)) != len(labels):
        raise ConfigError(f"group labels must differ, got {labels}")
    groups, warnings = {}, []
    for label, spec in zip(labels, args.groups):
        runs, w = load_group(spec, label)
        groups[label] = runs
        warnings += w
    result = analyze(groups, target=args.target, reference_time=args.reference_time, warnings=warnings)
    sys.stdout.write(render_markdown(result))
    if args.json:
        result["runs"] = {k: [r.to_dict() for r in v] for k, v in groups.items()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine before a timed run",
        description="Environment preflight for timed runs; prints each problem with its fix.",
        epilog=_DOCTOR_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--require-gpu", action="store_true",
                   help="exit 1 if a problem blocks a timed GPU run (no GPU, no FP8, no attention, no data)")
    p.add_argument("--data", default=None, metavar="GLOB",
                   help="shards to look for (default data/fineweb10B/fineweb_*.bin)")
    p.add_argument("--no-measure", action="store_true", help="skip the matmul/copy measurements")
    p.set_defaults(func=_doctor)


def _doctor(args) -> int:
    from speedrun.evidence.doctor import run_doctor

    rep = run_doctor(require_gpu=args.require_gpu, data_glob=args.data, measure=not args.no_measure)
    sys.stdout.write(rep.render())
    return rep.exit_code()


_COMMANDS = (_add_stats, _add_doctor)


def register(subparsers) -> None:
    """Add the evidence subcommands to the top-level ``speedrun`` parser."""
    for add in _COMMANDS:
        add(subparsers)
