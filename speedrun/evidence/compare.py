"""``speedrun compare``: full trainings of several arms x seeds on one node, then a records folder.

The plan is every seed for every arm, interleaved (seed 0: A B; seed 1: A B; ...), so drifts of
the node affect all arms alike, and paired: every arm runs the same seeds, which are distinct
across the runs of an arm.  A node fingerprint (GPUs, driver, versions, clocks, measured matmul
TFLOP/s and copy TB/s) is taken before the first run and after the last.

The records folder holds::

    manifest.json       the plan: (arm, seed) in order, status pending/running/done, run folder,
                        abandoned folders, fingerprints; rewritten atomically after every change
    runs/<arm>-seed<S>-try<K>/   each training's run folder (config, log.txt, metrics, checkpoints)
    README.md, results.json, *.png   written by speedrun.evidence.records.write_records when all
                        runs are done

Killed and restarted with the same folder, compare skips done runs; a run left ``running`` is
resumed from its newest checkpoint when it has one, otherwise its folder is marked abandoned (a
file ``ABANDONED`` in it, and listed in the manifest) and the run starts over in a new folder.
Only done runs are ever counted.  Under torchrun every training uses all ranks; only rank 0
reads decisions from and writes the manifest, and broadcasts them; the process group is kept
for the whole compare (``train(..., teardown=False)``).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Sequence

from speedrun.config import RunConfig
from speedrun.errors import ConfigError
from speedrun.evidence.arms import ArmSpec

MANIFEST = "manifest.json"
_VERSION = 1


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def write_json_atomic(path: Path, doc: dict) -> None:
    """Write ``doc`` to ``path`` so that a reader (or a kill) sees the old or the new file, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=2, default=str)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def make_seeds(seeds: int | Sequence[int], base_seed: int = 0) -> list[int]:
    """``seeds`` as a count (``base_seed``, ``base_seed + 1``, ...) or an explicit list; must be distinct."""
    if isinstance(seeds, int):
        if seeds < 1:
            raise ConfigError(f"--seeds must be >= 1, got {seeds}")
        out = [base_seed + i for i in range(seeds)]
    else:
        out = [int(s) for s in seeds]
    if not out or len(set(out)) != len(out):
        raise ConfigError(f"seeds must be distinct and at least one, got {out}")
    return out


def make_plan(arm_names: Sequence[str], seeds: Sequence[int]) -> list[dict]:
    """Interleaved, paired plan: for each seed, every arm in order."""
    plan = []
    for seed in seeds:
        for arm in arm_names:
            plan.append({"index": len(plan), "arm": arm, "seed": seed, "status": "pending", "run_dir": None,
                         "attempt": 0, "abandoned": [], "resumed": 0, "final_val_loss": None,
                         "train_time_ms": None, "finished": None})
    return plan


@dataclass
class CompareResult:
    """Where things are; ``complete`` when every planned run is done and the records are written."""

    out_dir: Path
    manifest: dict
    complete: bool
    records_dir: Path | None = None


def _arm_configs(arms: Sequence[ArmSpec | tuple[str, RunConfig]],
                 common: Sequence[str]) -> dict[str, tuple[RunConfig, dict]]:
    out: dict[str, tuple[RunConfig, dict]] = {}
    for a in arms:
        if isinstance(a, ArmSpec):
            name, cfg, spec = a.name, a.config(common), a.to_dict()
        else:
            name, cfg = a
            spec = {"name": name, "preset": cfg.name, "overrides": []}
        if name in out:
            raise ConfigError(f"arm names must differ; {name!r} is repeated")
        out[name] = (cfg, spec)
    if not out:
        raise ConfigError("compare needs at least one arm")
    return out


def _comparable(cfg_dict: dict) -> dict:
    """A config dict without the fields compare sets per run (seed, output folder)."""
    d = json.loads(json.dumps(cfg_dict))
    d.get("train", {}).pop("seed", None)
    d.pop("out_dir", None)
    return d


def _load_or_create(path: Path, configs: dict, seeds: list[int], target: float,
                    reference_time: float | None) -> dict:
    if path.exists():
        m = json.loads(path.read_text())
        if m.get("version") != _VERSION:
            raise ConfigError(f"{path}: unknown manifest version {m.get('version')}")
        want = {n: _comparable(c.to_dict()) for n, (c, _) in configs.items()}
        have = {n: _comparable(a["config"]) for n, a in m["arms"].items()}
        if list(want) != list(have) or want != have:
            diff = [n for n in set(want) | set(have) if want.get(n) != have.get(n)]
            raise ConfigError(f"{path.parent} holds a compare of different arms (differing: {sorted(diff)}); "
                              f"resume it with the same --arm/--set arguments or use a new folder")
        if m["seeds"] != seeds:
            raise ConfigError(f"{path.parent} was started with seeds {m['seeds']}, not {seeds}; "
                              f"resume it with the same --seeds/--base-seed or use a new folder")
        m["target"], m["reference_time"] = target, reference_time
        return m
    return {
        "version": _VERSION,
        "created": _now(),
        "arms": {n: {**spec, "config": cfg.to_dict()} for n, (cfg, spec) in configs.items()},
        "seeds": seeds,
        "target": target,
        "reference_time": reference_time,
        "plan": make_plan(list(configs), seeds),
        "fingerprints": [],
        "events": [],
    }


def _next_action(m: dict, out: Path) -> dict | None:
    """Rank 0's decision for the next run (and the manifest change that records it), or None."""
    from speedrun.train.checkpoint import list_checkpoints

    for entry in m["plan"]:
        if entry["status"] == "done":
            continue
        if entry["status"] == "running" and entry["run_dir"]:
            run_dir = Path(entry["run_dir"])
            summary = run_dir / "summary.json"
            if summary.exists():  # killed after the run finished but before the manifest said so
                done = json.loads(summary.read_text())
                entry.update(status="done", final_val_loss=done.get("final_val_loss"),
                             train_time_ms=done.get("train_time_ms"), finished=_now())
                m["events"].append(f"{_now()} {run_dir} had finished; marked done")
                continue
            if (run_dir / "config.json").exists() and list_checkpoints(run_dir):
                entry["resumed"] += 1
                m["events"].append(f"{_now()} resume {entry['arm']} seed {entry['seed']} from {run_dir}")
                return {"index": entry["index"], "arm": entry["arm"], "seed": entry["seed"],
                        "run_dir": str(run_dir), "resume": True}
            if run_dir.exists():
                (run_dir / "ABANDONED").write_text(f"abandoned {_now()}: killed before its first checkpoint; "
                                                   f"this run is not counted\n")
                entry["abandoned"].append(str(run_dir))
                m["events"].append(f"{_now()} abandon {run_dir} (no checkpoint)")
        while True:
            entry["attempt"] += 1
            run_dir = out / "runs" / f"{entry['arm']}-seed{entry['seed']}-try{entry['attempt']}"
            if not run_dir.exists():
                break
            # A folder the manifest does not know (a kill between its creation and the manifest write).
            (run_dir / "ABANDONED").write_text(f"abandoned {_now()}: not in the manifest; not counted\n")
            entry["abandoned"].append(str(run_dir))
        entry["status"], entry["run_dir"] = "running", str(run_dir)
        return {"index": entry["index"], "arm": entry["arm"], "seed": entry["seed"],
                "run_dir": str(run_dir), "resume": False}
    return None


def _fresh_process_state(cfg: RunConfig) -> None:
    """Make each training in this process start like a fresh process would: no compiled graphs
    of earlier models (their recompiles would pile up to dynamo's cache limit, after which it
    silently runs eager), and peak-memory counters that cover this run only."""
    import torch

    if cfg.train.compile:
        torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _broadcast(obj, info):
    if not info.enabled:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run_compare(arms: Sequence[ArmSpec | tuple[str, RunConfig]], out_dir: str | Path, *,
                seeds: int | Sequence[int] = 4, base_seed: int = 0, common: Sequence[str] = (),
                target: float = 3.28, reference_time: float | None = None, measure: bool = True,
                console: bool = True, stop_after_runs: int | None = None,
                kill_at_step: int | None = None,
                fingerprint: Callable[[bool], dict] | None = None) -> CompareResult:
    """Run (or continue) the compare in ``out_dir``; see the module doc.

    ``arms``: ArmSpecs (``common`` overrides go before each arm's own) or ``(name, RunConfig)``;
    the first is the baseline.  ``target``: validation loss target; ``reference_time`` (s):
    projects the candidate's time as ratio x reference.  ``measure``: measure the node's
    ceilings in the fingerprints (needs a GPU; off for CPU tests).

    Testing hooks (simulated kills): ``stop_after_runs=k`` returns after k runs finished in this
    call; with ``kill_at_step=s`` as well, the next run is then started and stopped right after
    its step-``s`` checkpoint, left ``running`` in the manifest.
    """
    from speedrun import distributed
    from speedrun.train.loop import train

    # train() would end the process group after every run; re-creating it right away races (a
    # fast rank can read the other's stale rendezvous keys and both hang), so keep one group for
    # the whole compare and end it here.
    try:
        return _run_compare(arms, out_dir, seeds, base_seed, common, target, reference_time, measure, console,
                            stop_after_runs, kill_at_step, fingerprint, functools.partial(train, teardown=False))
    finally:
        distributed.teardown()


def _run_compare(arms, out_dir, seeds, base_seed, common, target, reference_time, measure, console,
                 stop_after_runs, kill_at_step, fingerprint, train) -> CompareResult:
    from speedrun import distributed
    from speedrun.evidence.fingerprint import node_fingerprint

    fingerprint = fingerprint or (lambda m: node_fingerprint(measure=m))
    out = Path(out_dir)
    configs = _arm_configs(arms, common)
    seed_list = make_seeds(seeds, base_seed)
    first_cfg = next(iter(configs.values()))[0]
    info = distributed.setup(first_cfg.train.device)
    path = out / MANIFEST
    manifest: dict | None = None
    if info.is_main:
        out.mkdir(parents=True, exist_ok=True)
        manifest = _load_or_create(path, configs, seed_list, target, reference_time)
        if not manifest["fingerprints"]:
            manifest["fingerprints"].append({"when": "before", "at": _now(), **fingerprint(measure)})
        else:
            manifest["events"].append(f"{_now()} restarted")
        write_json_atomic(path, manifest)
        done = sum(e["status"] == "done" for e in manifest["plan"])
        print(f"compare: arms {', '.join(configs)} x seeds {seed_list} = {len(manifest['plan'])} runs, "
              f"interleaved; {done} done already; records in {out}", flush=True)

    finished_here = 0
    while True:
        info = distributed.setup(first_cfg.train.device)
        action = None
        if info.is_main:
            stop = stop_after_runs is not None and finished_here >= stop_after_runs and kill_at_step is None
            if not stop:
                action = _next_action(manifest, out)
                write_json_atomic(path, manifest)
        action = _broadcast(action, info)
        if action is None:
            break
        entry_arm, entry_seed = action["arm"], action["seed"]
        cfg = RunConfig.from_dict(configs[entry_arm][0].to_dict())
        cfg.train.seed = entry_seed
        cfg.out_dir = str(out / "runs")
        cfg.name = entry_arm
        killing = stop_after_runs is not None and kill_at_step is not None and finished_here >= stop_after_runs
        if info.is_main:  # compare's own progress, also under --quiet (which silences the trainings)
            verb = "resuming" if action["resume"] else "starting"
            print(f"compare: {verb} run {action['index'] + 1}/{len(manifest['plan'])}: arm {entry_arm} "
                  f"seed {entry_seed} in {action['run_dir']}", flush=True)
        _fresh_process_state(cfg)
        result = train(cfg, run_dir=Path(action["run_dir"]), resume=action["resume"], console=console,
                       stop_after=kill_at_step if killing else None)
        if result.stopped_early:
            return CompareResult(out, manifest if info.is_main else {}, False)
        if info.is_main:
            e = manifest["plan"][action["index"]]
            e.update(status="done", final_val_loss=result.final_val_loss, train_time_ms=result.train_time_ms,
                     finished=_now())
            write_json_atomic(path, manifest)
        finished_here += 1

    if not info.is_main:
        return CompareResult(out, {}, True, None)
    if any(e["status"] != "done" for e in manifest["plan"]):
        return CompareResult(out, manifest, False)
    if finished_here or not any(f["when"] == "after" for f in manifest["fingerprints"]):
        manifest["fingerprints"].append({"when": "after", "at": _now(), **fingerprint(measure)})
        write_json_atomic(path, manifest)
    records = write_compare_records(out, manifest)
    return CompareResult(out, manifest, True, records)


def write_compare_records(out: Path, manifest: dict) -> Path:
    """write_records over the done runs of ``manifest`` (arm order kept), then add the plan to
    results.json and README.md."""
    from speedrun.evidence.logparse import parse_log
    from speedrun.evidence.records import write_records

    runs = []
    for arm in manifest["arms"]:
        for e in manifest["plan"]:
            if e["arm"] == arm and e["status"] == "done":
                runs.append(parse_log(Path(e["run_dir"]) / "log.txt", label=arm))
    fps = manifest["fingerprints"]
    before = next((f for f in fps if f["when"] == "before"), {})
    after = next((f for f in reversed(fps) if f["when"] == "after"), {})
    strip = lambda f: {k: v for k, v in f.items() if k not in ("when", "at")}  # noqa: E731
    write_records(out, runs, strip(before), strip(after), target=manifest["target"],
                  reference_time=manifest["reference_time"])
    results = json.loads((out / "results.json").read_text())
    results["plan"] = manifest["plan"]
    results["seeds"] = manifest["seeds"]
    results["arms_spec"] = {n: {k: v for k, v in a.items() if k != "config"} for n, a in manifest["arms"].items()}
    write_json_atomic(out / "results.json", results)
    with open(out / "README.md", "a", encoding="utf-8") as f:
        f.write("\n## Plan (interleaved, paired seeds)\n\n")
        for n, a in manifest["arms"].items():
            f.write(f"- **{n}**: preset `{a['preset']}`" + (f", overrides `{', '.join(a['overrides'])}`"
                                                               if a["overrides"] else "") + "\n")
        f.write("\n| # | arm | seed | run folder | resumed | abandoned folders |\n"
                "| ---: | --- | ---: | --- | ---: | --- |\n")
        for e in manifest["plan"]:
            rel = os.path.relpath(e["run_dir"], out)
            ab = ", ".join(os.path.relpath(a, out) for a in e["abandoned"]) or "-"
            f.write(f"| {e['index'] + 1} | {e['arm']} | {e['seed']} | {rel} | {e['resumed']} | {ab} |\n")
        if any(e["resumed"] for e in manifest["plan"]):
            f.write("\nA resumed run's time is the time up to its checkpoint plus the time after it.\n")
    return out


def _parse_seeds(text: str) -> int | list[int]:
    try:
        if "," in text:
            return [int(s) for s in text.split(",") if s.strip()]
        return int(text)
    except ValueError:
        raise ConfigError(f"--seeds takes a count (4) or a comma-separated list (0,1,2), got {text!r}") from None


def cli_compare(args) -> int:
    """``speedrun compare`` (arguments from speedrun.cli.evidence)."""
    from speedrun.evidence.arms import data_overrides, parse_arms

    arms = parse_arms(args.arm)
    common = data_overrides(args.data, args.val_data) + list(args.overrides)
    result = run_compare(arms, args.out, seeds=_parse_seeds(args.seeds), base_seed=args.base_seed, common=common,
                         target=args.target, reference_time=args.reference_time, measure=not args.no_measure,
                         console=not args.quiet)
    if not result.manifest:  # not rank 0
        return 0
    done = sum(e["status"] == "done" for e in result.manifest["plan"])
    print(f"compare: {done}/{len(result.manifest['plan'])} runs done; manifest {result.out_dir / MANIFEST}")
    if result.records_dir:
        print(f"records: {result.records_dir / 'README.md'}")
    return 0 if result.complete else 1
