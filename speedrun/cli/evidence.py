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


def _chain_lengths(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected step counts like 1 or 1,3, got {text!r}") from None


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


_ARM_HELP = ("an arm: NAME=PRESET[:SECTION.FIELD=VALUE,...], e.g. base=tiny or "
             "cand=tiny:model.qk_head_dim=16,train.lr=1e-3 (repeatable; the first arm is the baseline)")

_BENCH_EPILOG = """\
Each arm is a preset plus overrides, built once (model, optimizer, loader at the chosen stage's
shapes) exactly as 'speedrun train' builds it.  Every arm is warmed up first (compilation is
untimed), then the arms are timed interleaved, the order rotating each round (A B C, B C A, ...),
one optimizer step at a time
(all grad_accum micro-batches, gradient all-reduce and update), with CUDA events from an idle GPU
(perf_counter on the CPU).  Printed per arm: median and IQR (ms), tokens/s, the arm's peak
memory on CUDA (what it keeps allocated plus the most one step adds, MiB), and the ratio of its
median to the first arm's with a paired bootstrap 95% CI.  Under torchrun a step's time is the
maximum over ranks.  To see the noise floor, time the baseline twice (--arm base=record --arm
base2=record ...): the A/A ratio's CI shows how small a difference this node resolves.

Is the step host-bound?  --host-steps N traces N more steps per arm: for each phase (setup,
data, forward, backward, optimizer...) the host's time to issue it, the GPU's time for it (CUDA
events at the phase ends) and the lead, how long after the host issued the phase's end the GPU
got there.  A lead near 0 means the GPU was waiting for Python at that point.  --chain K times
K steps back to back per sample (their mean): no idle GPU at each step's start, comparable with
step times a training run logs without synchronizing (upstream's); --chain 1,3 times both in the
same rounds (arm and arm@3, paired).  --sync-scan runs
one more step under torch's sync debug mode and names the lines that make the host wait for the
GPU (a .item(), torch.tensor(list, device="cuda"), t[idx] = True: blocking copies).

GPU clocks: on CUDA with nvidia-ml-py, a thread samples the SM clock, power and temperature
during each arm's timed steps (rank 0's GPU), printed per arm.  An H200 at its power limit lowers
its clock, so two arms can run the same kernels at different clocks; read a ratio with them.
--no-clocks turns the sampling off.

Garbage collection: after the warmups the bench runs one full collection and freezes what
survives (train.gc_freeze, on by default, as in `speedrun train`), so a full collection over the
compiled graphs cannot stall a random timed step; the collections that still run are counted per
arm (count by generation, ms per step, longest pause).  Every arm must use the same gc_freeze.

No multi-GPU machine?  --as-rank-of N runs, on one device, exactly rank 0's share of an N-GPU
step: the micro-batches one rank of N runs (train.grad_accum=0: 8 // N of stage batch / 8 tokens
each), its slice of the data, and its 1/N of NorMuon + Adam (Polar Express and the Adam tables at
the N-rank shapes), with every collective replaced by a no-op that returns a tensor of the right
shape.  The table says "rank 0 of N simulated (collectives replaced by no-ops)"; a step time is
one GPU's compute, without the communication (or waits for slower ranks) of a real N-GPU step.
'bench project' of such files projects the whole N-GPU run.

arm syntax: NAME=PRESET[:SECTION.FIELD=VALUE,SECTION.FIELD=VALUE,...]  (a bare PRESET names the
arm after the preset; --set applies to every arm before the arm's own overrides)

examples:
  speedrun bench step --arm base=tiny --arm cand=tiny:model.qk_head_dim=16,train.lr=1e-3
  speedrun bench step --arm base=small --arm nocomp=small:train.compile=false \\
      --data 'data/fineweb10B/fineweb_train_*.bin' --stage 0 --steps 30 --json bench.json
  torchrun --standalone --nproc_per_node=8 -m speedrun bench step --arm a=small --arm b=small:... --data ...
  speedrun bench step --arm rec=record --arm cand=candidate --stage 0 --as-rank-of 8 \\
      --data ... --json rank8_stage0.json          (one GPU: what each GPU of 8 computes per step)
"""

_PROJECT_EPILOG = """\
A per-step ratio at one stage does not say which arm trains faster: a staged recipe spends
different times per step in each stage.  This sums, for every arm, steps x median step time over
the stages of the arm's own schedule (read from the config saved in each file), with bootstrap
95% intervals for the total and for the ratio to the first arm.  A stage without a bench (the
record's short extension stage) takes the nearest earlier benched stage with its batch size.
Compilation, warmup and validation are not included: it ranks arms, a full training measures them.

examples:
  for s in 0 1 2; do speedrun bench step --arm base=record --arm cand=candidate --stage $s \
      --data ... --json bench_stage$s.json; done
  speedrun bench project bench_stage0.json bench_stage1.json bench_stage2.json

Files from 'bench step --as-rank-of N' project an N-GPU run (communication not included); the
table says so.  Every file must come from the same world, simulated or real: files of different
N are refused.
"""

_COMPARE_EPILOG = """\
Runs full trainings of every arm for every seed, interleaved (seed s0: A B, seed s1: A B, ...;
the same seeds for every arm), and writes a records folder: manifest.json (the plan and each
run's status), runs/<arm>-seed<S>-try<K>/ (each run folder with its log), README.md with the
speedrun's tables (n, steps, mean/std loss, one-sided p vs --target, time mean/std/median/range,
ratio and projected time vs --reference-time), results.json and PNG plots.  A node fingerprint
(GPUs, driver, versions, clocks, measured matmul TFLOP/s and copy TB/s) is taken before and after.

Killed?  Run the same command again: done runs are kept, a run that was running resumes from its
newest checkpoint (set train.checkpoint_every) or restarts in a new folder (the old one is marked
ABANDONED and never counted).  Under torchrun every training uses all ranks.

examples:
  speedrun compare --arm base=tiny --arm cand=tiny:train.lr=1e-3 --seeds 4 --out records/lr
  torchrun --standalone --nproc_per_node=8 -m speedrun compare --arm base=small --arm fp8=small:... \\
      --data 'data/fineweb10B/fineweb_train_*.bin' --seeds 8 --target 3.28 --reference-time 89.9 \\
      --set train.checkpoint_every=500 --out records/fp8
"""

_PROFILE_EPILOG = """\
Profiles N optimizer steps (after untimed warmup) with torch.profiler and lists every op group
(name, shapes, dtypes) with calls and time per step.  For GEMMs, copies, norms, softmax,
elementwise ops and reductions it computes the minimal FLOPs and bytes from the shapes, the
achieved TFLOP/s and TB/s, the floor time under the ceilings measured in the same run (bf16
matmul, copy bandwidth; on the CPU give --peak-tflops/--peak-tbps or get no floors) and the time
above it ("recoverable"), ranked.  Writes profile.md, roofline.png and profile.json to --out.

--ncu reruns the steps under Nsight Compute and adds measured DRAM bytes per kernel next to the
bytes its ops need (needs 'ncu' on PATH and a GPU).  Slow: every profiled kernel is replayed
(tens of ms each; a record step runs ~7,000 kernels), so narrow it with --ncu-kernels REGEX and
--ncu-launches N, and bound it with --ncu-timeout S.

examples:
  speedrun profile --arm tiny --steps 2 --peak-tflops 0.1 --peak-tbps 0.02      (CPU)
  speedrun profile --arm small --data 'data/fineweb10B/fineweb_train_*.bin' --steps 5 --out prof/small
  speedrun profile --arm record --data ... --steps 1 --ncu --ncu-kernels '_relu2|_dual_layout|_ce_'
  speedrun profile --arm e=record:train.cuda_graphs=off --stage 2 --device-only --data ... --out prof/e
  speedrun profile --arm g=record --stage 2 --device-only --data ... --out prof/g
  speedrun profile --diff prof/e prof/g      (where the graph step's time goes against the eager one's)
"""


def _arm_common(p) -> None:
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override applied to every arm before its own overrides (repeatable)")
    p.add_argument("--data", metavar="GLOB", help="training shards (sets data.source=shards)")
    p.add_argument("--val-data", metavar="GLOB", help="validation shards (default: --data with train -> val)")


def _add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="micro-benchmarks of training (see 'speedrun bench step --help')",
                           description="Benchmarks of the training step.")
    bsub = bench.add_subparsers(dest="bench_command", metavar="WHAT")
    p = bsub.add_parser(
        "step", help="time one optimizer step of two or more arms, interleaved",
        description="Time one optimizer step of several arms at one stage's shapes.",
        epilog=_BENCH_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arm", action="append", required=True, help=_ARM_HELP)
    p.add_argument("--stage", type=int, default=0, help="index into the config's stages (default 0)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per arm (>= 20; default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per arm first (default 3)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results (with every time) as JSON")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling (default 0)")
    p.add_argument("--device", help="cpu, cuda or auto (sets train.device)")
    p.add_argument("--host-steps", type=int, default=0, metavar="N",
                   help="N more steps per arm traced phase by phase: host issue time, GPU time and how "
                        "far the GPU trails the host (default 0; 5 is enough)")
    p.add_argument("--chain", type=_chain_lengths, default=(1,), metavar="K[,K...]",
                   help="steps issued back to back per timed sample, reported as their mean (default 1: "
                        "each step timed alone from an idle GPU; K > 1 lets the host run ahead into the "
                        "next step as a training run does, the way upstream's logged step times are taken); "
                        "several (1,3) time every arm both ways in the same rounds, as ARM and ARM@3")
    p.add_argument("--no-clocks", dest="clocks", action="store_false",
                   help="do not sample the GPU's SM clock, power and temperature during the timed steps")
    p.add_argument("--as-rank-of", type=int, default=None, metavar="N",
                   help="run rank 0's share of an N-GPU step on this one device: its micro-batches (one of "
                        "the per-rank size at N=8 with grad_accum=0), its loader slice and its 1/N of the "
                        "optimizer, with every collective replaced by a no-op (for 'bench project' of an "
                        "N-GPU run; communication time not included)")
    p.add_argument("--sync-scan", action="store_true",
                   help="one more step per arm under torch's sync debug mode: list the calls that "
                        "synchronise with the GPU, with our code's lines (CUDA)")
    _arm_common(p)
    p.set_defaults(func=_bench_step)
    p = bsub.add_parser(
        "project", help="whole-run training time per arm from 'bench step' files of several stages",
        description="Project each arm's training time over its whole schedule from per-stage step benchmarks.",
        epilog=_PROJECT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("files", nargs="+", type=Path, metavar="FILE",
                   help="'speedrun bench step --json' files: every stage with the same arms (in one "
                        "file, or split over several files of that stage)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the projection as JSON")
    p.add_argument("--n-boot", type=int, default=2000, help="bootstrap resamples for the intervals (default 2000)")
    p.add_argument("--as-rank-of", type=int, default=None, metavar="N",
                   help="require files from 'bench step --as-rank-of N' (a simulated rank of N); without it "
                        "the files' own world size is used (every file must have the same)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling (default 0)")
    p.add_argument("--arm", action="append", metavar="NAME",
                   help="project only this benched arm (repeatable; the first is the baseline unless "
                        "--upstream names one): e.g. when another arm lacks a stage's bench")
    p.add_argument("--link-gbps", type=float, metavar="GB/S",
                   help="with --as-rank-of files: also add the collectives the simulated rank counted, at this bus "
                        "bandwidth (nccl-tests' busbw of the target machine), none overlapped: an upper bound")
    p.add_argument("--upstream", action="append", metavar="NAME=FILE:PRESET",
                   help="an upstream run as the first arm and baseline: FILE from 'tools/upstream_step_times.py "
                        "--json' (its stage times), PRESET the schedule it trains (f411b3d: record, PR #344: "
                        "candidate); repeatable")
    p.set_defaults(func=_bench_project)
    bench.set_defaults(func=lambda args: bench.print_help() or 2)


def _bench_project(args) -> int:
    from speedrun.evidence.projection import cli_project

    return cli_project(args)


def _bench_step(args) -> int:
    from speedrun.evidence.bench import cli_bench_step

    return cli_bench_step(args)


def _add_compare(sub) -> None:
    p = sub.add_parser(
        "compare", help="full trainings of arms x seeds, interleaved, into a records folder",
        description="Train several arms with several seeds each on this node and write a records folder.",
        epilog=_COMPARE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arm", action="append", required=True, help=_ARM_HELP)
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="records folder (created; reused to resume)")
    p.add_argument("--seeds", default="4", help="number of seeds (base-seed, base-seed+1, ...) or a list 0,1,2")
    p.add_argument("--base-seed", type=int, default=0, help="first seed when --seeds is a count (default 0)")
    p.add_argument("--target", type=float, default=3.28, help="validation loss target (default 3.28)")
    p.add_argument("--reference-time", type=float, default=None, metavar="SECONDS",
                   help="project the candidate's time as ratio x this baseline time")
    p.add_argument("--no-measure", action="store_true", help="fingerprints without matmul/copy measurements")
    p.add_argument("--quiet", action="store_true", help="no training progress on the console")
    _arm_common(p)
    p.set_defaults(func=_compare)


def _compare(args) -> int:
    from speedrun.evidence.compare import cli_compare

    return cli_compare(args)


def _add_profile(sub) -> None:
    p = sub.add_parser(
        "profile", help="per-op/per-kernel time, achieved TFLOP/s and TB/s, recoverable ms, roofline",
        description="Profile training steps and rank ops by time above their roofline floor.",
        epilog=_PROFILE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--arm", default="tiny", help="NAME=PRESET[:SECTION.FIELD=VALUE,...] (default: tiny)")
    p.add_argument("--stage", type=int, default=0, help="index into the config's stages (default 0)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--out", type=Path, metavar="DIR", help="output folder (default profile-<arm>)")
    p.add_argument("--peak-tflops", type=float, help="matmul ceiling in TFLOP/s (instead of measuring)")
    p.add_argument("--peak-tbps", type=float, help="memory ceiling in TB/s (instead of measuring)")
    p.add_argument("--no-measure", action="store_true", help="do not measure ceilings on the GPU")
    p.add_argument("--ncu", action="store_true", help="also measure DRAM bytes per kernel with Nsight Compute")
    p.add_argument("--ncu-kernels", metavar="REGEX",
                   help="with --ncu: only kernels whose name matches (e.g. '_relu2|_dual_layout|_ce_')")
    p.add_argument("--ncu-launches", type=int, metavar="N", help="with --ncu: stop after N profiled launches")
    p.add_argument("--ncu-timeout", type=float, metavar="S", help="with --ncu: give up after S seconds (clear error)")
    p.add_argument("--stacks", action="store_true",
                   help="record Python stacks: name the source line behind each op row (slower profiling)")
    p.add_argument("--device-only", action="store_true",
                   help="record GPU activity alone (no op rows): the timeline's idle gaps as in an unprofiled step")
    p.add_argument("--top", type=int, default=30, help="rows per table on screen (default 30)")
    p.add_argument("--device", help="cpu, cuda or auto (sets train.device)")
    p.add_argument("--diff", nargs=2, metavar=("BASE", "OTHER"),
                   help="profile nothing: compare two earlier profiles (profile.json or its --out folder) per "
                        "step, device busy/idle time and kernel by kernel (e.g. eager against CUDA graphs)")
    p.add_argument("--json", metavar="FILE", help="with --diff: also write the comparison as JSON")
    _arm_common(p)
    p.set_defaults(func=_profile)


def _profile(args) -> int:
    if args.diff:
        from speedrun.evidence.profile_diff import cli_diff

        return cli_diff(*args.diff, top=args.top, json_out=args.json)
    if args.json:
        print("speedrun profile: --json goes with --diff (a profile writes profile.json into --out)", file=sys.stderr)
        return 2
    from speedrun.evidence.profile import cli_profile

    return cli_profile(args)


_COMMANDS = (_add_stats, _add_doctor, _add_bench, _add_compare, _add_profile)


def register(subparsers) -> None:
    """Add the evidence subcommands to the top-level ``speedrun`` parser."""
    for add in _COMMANDS:
        add(subparsers)
