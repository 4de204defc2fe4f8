"""A whole run's training time projected from per-stage step benchmarks.

A staged recipe spends different times per step in each stage, so a per-step ratio at one stage
does not say which arm trains faster overall: an arm can be faster per stage-3 step and slower per
stage-1 step.  :func:`project` takes ``speedrun bench step --json`` files, one per
stage (the same arms in each), and sums for every arm

    projected seconds = sum over stages s of  steps_s x median step time_s

where ``steps_s`` comes from the arm's own schedule (its config, saved in the bench file: the
candidate's extension stage is 45 steps, the record's 15).  A stage that was not benched takes
the time of the nearest benched stage before it with the same batch size (the record's
extension stage runs stage 3's batch with wider windows), and the report says so.  The 95%
intervals come from resampling every benched stage's step times (medians of bootstrap samples,
summed; a stage timed by another reuses that stage's draws); the ratio of each arm to the first
arm divides the two arms' draws.  Arms are resampled independently, which ignores the pairing of
the bench's interleaved rounds: the ratio's interval is wider than a paired one, not narrower.

Files from ``speedrun bench step --as-rank-of N`` (rank 0 of N simulated in one process, its
collectives replaced by no-ops) project an N-GPU run: the sum is then every rank's compute
without the communication.  The files' world (simulated or real, and its size) is carried into
the result and printed; files of different worlds are refused, since their steps differ.  Given
a bus bandwidth (``link_gbps``, GB/s as nccl-tests reports "busbw" for the machine), the bytes the
simulated collectives would have moved per step (``comm_bytes_per_step`` in the bench file) add
their time, ring-counted: an all-reduce moves 2(N-1)/N of its tensor per rank, a reduce-scatter
or all-gather (N-1)/N of its full tensor, an all-to-all what the rank sends.  None of it is
overlapped with compute there, so that total bounds the run from above (if the link reaches
that bandwidth and no rank waits for another) where the compute-only sum bounds it from below.

Upstream modded-nanogpt's own runs join as arms (:func:`load_upstream`): the per-stage step
times that ``tools/upstream_step_times.py --json`` reads from its log, on the schedule of the
preset whose recipe it runs (f411b3d: ``record``; PR #344: ``candidate``).  They come first and
are the baseline of the ratios, so every arm is compared with upstream measured on the same
machine.  Their steps come from another process and a timer of their own (each step's
``train_time`` difference in upstream's log), not from the bench's interleaved rounds.  Files
(bench or upstream) that name different cards or torch builds are refused (:func:`same_machine`):
two machines' times make no one run.

What the projection leaves out: compilation and warmup, validation, and how the host runs ahead
of the GPU between steps in a real run (the bench times one step from an idle GPU unless it was
given ``--chain``).  It ranks arms; a full training measures them.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from speedrun.errors import ConfigError


def _filtered(cls, fields: dict[str, Any], where: str) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - known)
    if unknown:
        warnings.warn(f"{where}: ignoring config fields this version does not have: {', '.join(unknown)}",
                      RuntimeWarning, stacklevel=3)
    return {k: v for k, v in fields.items() if k in known}


def config_from_saved(d: dict[str, Any], where: str = "bench file"):
    """A :class:`~speedrun.config.RunConfig` from a saved ``to_dict()``, tolerating fields that a
    later version removed (a warning names them)."""
    from speedrun.config import DataConfig, ModelConfig, RunConfig, TrainConfig

    return RunConfig.from_dict({
        **d,
        "model": _filtered(ModelConfig, d.get("model", {}), where),
        "data": _filtered(DataConfig, d.get("data", {}), where),
        "train": _filtered(TrainConfig, d.get("train", {}), where),
    })


def stage_lengths(cfg) -> list[int]:
    """Optimizer steps in each of the config's stages (their sum is ``train.steps``)."""
    from speedrun.train.recipes import stages_of

    stages = stages_of(cfg)
    starts = [s.start_step for s in stages] + [cfg.train.steps]
    return [max(0, b - a) for a, b in zip(starts, starts[1:])]


def load_benches(paths: list[Path]) -> list[dict[str, Any]]:
    docs = []
    for p in paths:
        try:
            doc = json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read bench file {p}: {e}") from None
        if not isinstance(doc, dict) or "arms" not in doc or "stage" not in doc:
            raise ConfigError(f"{p} is not a 'speedrun bench step --json' file (no 'arms' and 'stage')")
        doc["_path"] = str(p)
        docs.append(doc)
    return docs


def load_upstream(spec: str) -> dict[str, Any]:
    """An upstream run as a projection arm, from ``NAME=FILE:PRESET``: FILE is
    ``tools/upstream_step_times.py --json`` output (per stage, in schedule order, the step times
    of upstream's log), PRESET the preset whose schedule it trains (its step counts per stage).
    Returns ``{"name", "config", "times_by_stage": {stage index: [ms, ...]}, "gpus", "path"}``."""
    from speedrun.config import PRESETS, preset

    name, sep, rest = spec.partition("=")
    path, sep2, preset_name = rest.rpartition(":")
    if not (sep and sep2 and name and path and preset_name):
        raise ConfigError(f"--upstream {spec!r}: want NAME=FILE:PRESET (e.g. f411b3d=upstream_steps.json:record)")
    if preset_name not in PRESETS:
        raise ConfigError(f"--upstream {spec!r}: unknown preset {preset_name!r}; known: {', '.join(sorted(PRESETS))}")
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read upstream step file {path}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("stages"), list):
        raise ConfigError(f"{path} is not a 'tools/upstream_step_times.py --json' file (no 'stages' list)")
    times = {i: [float(t) for t in st.get("times_ms") or []] for i, st in enumerate(doc["stages"])}
    return {"name": name, "config": preset(preset_name).to_dict(), "times_by_stage": times,
            "gpus": list(doc.get("gpus") or []), "torch": doc.get("torch"), "path": path}


def machine_of(doc: dict[str, Any]) -> dict[str, str | None]:
    """``{"card", "torch"}`` a bench file (its ``fingerprint``) or an upstream arm
    (:func:`load_upstream`) ran on; None where the file does not say (older files)."""
    if "times_by_stage" in doc:
        return {"card": (doc.get("gpus") or [None])[0], "torch": doc.get("torch")}
    fp = doc.get("fingerprint") or {}
    return {"card": fp.get("gpu_name"), "torch": fp.get("torch")}


def same_machine(sources: list[tuple[str, dict[str, Any]]]) -> dict[str, str | None]:
    """The one card and torch build that every ``(label, doc)`` source names (None: none names
    one); raises :class:`ConfigError` listing each source's where two differ: a projection's
    ratios compare like with like only."""
    found: dict[str, str | None] = {}
    for key in ("card", "torch"):
        named = {label: machine_of(doc)[key] for label, doc in sources}
        values = {v for v in named.values() if v}
        if len(values) > 1:
            raise ConfigError(f"the files ran on different {'cards' if key == 'card' else 'torch builds'} ("
                              + "; ".join(f"{label}: {v or 'not recorded'}" for label, v in named.items())
                              + "): project each machine's files on their own")
        found[key] = next(iter(values), None)
    return found


def bench_world(doc: dict[str, Any]) -> tuple[int, bool]:
    """(ranks, simulated) of a bench file: ``simulated_world`` for ``--as-rank-of N`` files, else
    the processes it ran on (``world_size``; 1 for files that predate the field)."""
    sim = doc.get("simulated_world")
    if sim:
        return int(sim), True
    return int(doc.get("world_size") or 1), False


def describe_world(world: int, simulated: bool) -> str:
    if simulated:
        return f"rank 0 of {world} simulated (collectives replaced by no-ops)"
    return f"{world} process{'es' if world > 1 else ''}"


def comm_ms(moved: dict[str, float], world: int, link_gbps: float) -> float:
    """Milliseconds the collectives of one step take at ``link_gbps`` GB/s of bus bandwidth on
    ``world`` ranks, from the bytes per kind a simulated rank counted (see the module docstring)."""
    share = (world - 1) / world
    factor = {"all_reduce": 2 * share, "reduce_scatter": share, "all_gather": share, "all_to_all": 1.0}
    unknown = set(moved) - set(factor)
    if unknown:
        raise ConfigError(f"unknown collective kinds {sorted(unknown)} in comm_bytes_per_step")
    return sum(factor[k] * float(b) for k, b in moved.items()) / (link_gbps * 1e9) * 1e3


def project(docs: list[dict[str, Any]], n_boot: int = 2000, seed: int = 0,
            as_rank_of: int | None = None, upstream: list[dict[str, Any]] = (),
            only: list[str] | None = None, link_gbps: float | None = None) -> dict[str, Any]:
    """Projected whole-run seconds per arm from bench files of several stages (see the module doc).

    ``as_rank_of`` N: refuse files that are not ``--as-rank-of N`` benches.  ``only``: project
    these benched arms alone, in this order (e.g. when one arm lacks a stage's bench); every
    name must be benched at some stage.  ``link_gbps``: add the simulated collectives' time at
    this bus bandwidth (simulated files only): each stage row gains ``comm_ms``, each arm
    ``comm_seconds`` and ``seconds_with_comm``.  Returns ``{"arms":
    [{"name", "seconds", "ci", "ratio", "ratio_ci", "stages": [...]}, ...], "baseline",
    "unbenched", "world_size", "simulated", "world", "separate_processes", "upstream"}``, the
    ``upstream`` arms (:func:`load_upstream`) first, then the benched ones in the order
    the files first name them; the baseline is the first.  Files of the same stage add their arms
    (listed in "separate_processes": those arms were not interleaved)."""
    from speedrun.train.recipes import stages_of

    if not docs:
        raise ConfigError("project: give at least one bench file")
    worlds = {bench_world(d) for d in docs}
    if len(worlds) > 1:
        raise ConfigError("bench files of different worlds cannot make one run: "
                          + "; ".join(f"{d['_path']}: {describe_world(*bench_world(d))}" for d in docs))
    (world, simulated), = worlds
    machine = same_machine([(d.get("_path", f"stage {d.get('stage')}"), d) for d in docs]
                           + [(f"upstream {up['name']} ({up['path']})", up) for up in upstream])
    for up in upstream:
        if simulated or (up["gpus"] and len(up["gpus"]) != world):
            raise ConfigError(f"upstream {up['name']} ran on {len(up['gpus']) or '?'} GPU(s); the bench files are "
                              f"from {describe_world(world, simulated)}: not one kind of run")
    if as_rank_of is not None and (world, simulated) != (as_rank_of, True):
        raise ConfigError(f"--as-rank-of {as_rank_of}: the files are from {describe_world(world, simulated)}, "
                          f"not from 'bench step --as-rank-of {as_rank_of}'")
    # Several files of one stage add their arms (arms benched in separate processes, e.g. when
    # two arms' CUDA graphs do not fit on one GPU together): such a stage's arms were not
    # interleaved, which the result records in "separate_processes".
    by_stage: dict[int, dict[str, dict]] = {}
    files_per_stage: dict[int, int] = {}
    names: list[str] = []
    for doc in docs:
        s = int(doc["stage"])
        arms = by_stage.setdefault(s, {})
        files_per_stage[s] = files_per_stage.get(s, 0) + 1
        for a in doc["arms"]:
            if a["name"] in arms:
                raise ConfigError(f"arm {a['name']!r} is benched twice at stage {s} ({doc['_path']}); "
                                  "give each arm once per stage")
            arms[a["name"]] = a
            if a["name"] not in names:
                names.append(a["name"])
    if only:
        unknown = [n for n in only if n not in names]
        if unknown:
            raise ConfigError(f"--arm {', '.join(unknown)}: no bench file has such an arm (benched: {', '.join(names)})")
        names = list(dict.fromkeys(only))
    for up in reversed(upstream):  # upstream first: the baseline of every ratio
        if up["name"] in names:
            raise ConfigError(f"upstream arm {up['name']!r} has the name of a benched arm")
        for s, arms in by_stage.items():
            if not up["times_by_stage"].get(s):
                raise ConfigError(f"upstream {up['name']} ({up['path']}) has no timed step at stage {s}")
            arms[up["name"]] = {"name": up["name"], "config": up["config"], "times_ms": up["times_by_stage"][s]}
        names.insert(0, up["name"])
    for s, arms in by_stage.items():
        missing = [n for n in names if n not in arms]
        if missing:
            raise ConfigError(f"stage {s}'s bench has no arm {', '.join(missing)}; every file needs the same arms")
    if link_gbps is not None:
        if not link_gbps > 0:
            raise ConfigError(f"--link-gbps must be a bandwidth > 0 GB/s, got {link_gbps}")
        if not simulated:
            raise ConfigError("--link-gbps adds the collectives a simulated rank counted: it needs files from "
                              "'bench step --as-rank-of N' (a real run's steps already include their communication)")
    rng = np.random.default_rng(seed)
    benched = sorted(by_stage)
    out_arms, unbenched = [], {}
    draws = {}
    for name in names:
        first = by_stage[benched[0]][name]
        cfg = config_from_saved(first["config"], f"arm {name}")
        lengths = stage_lengths(cfg)
        stages = stages_of(cfg)
        rows, total, boot = [], 0.0, np.zeros(n_boot)
        medians: dict[int, np.ndarray] = {}  # benched stage -> bootstrap medians, shared by the stages timed by it
        for i, n_steps in enumerate(lengths):
            src = i if i in by_stage else next(
                (j for j in reversed(benched) if j < i and stages[j].batch_tokens == stages[i].batch_tokens), None)
            if src is None:
                if n_steps == 0:
                    continue
                raise ConfigError(f"arm {name}: stage {i} ({n_steps} steps) has no bench and no earlier benched "
                                  f"stage with its batch of {stages[i].batch_tokens} tokens; bench it (--stage {i})")
            if src != i:
                unbenched[i] = src
            times = np.asarray(by_stage[src][name]["times_ms"], dtype=float)
            if times.size == 0:
                raise ConfigError(f"arm {name}: stage {src}'s bench holds no step times")
            med = float(np.median(times))
            rows.append({"stage": i, "steps": n_steps, "timed_as": src, "median_ms": med,
                         "seconds": n_steps * med / 1000})
            if link_gbps is not None:
                moved = by_stage[src][name].get("comm_bytes_per_step")
                if moved is None:
                    raise ConfigError(f"arm {name}: stage {src}'s bench has no comm_bytes_per_step (a file of an "
                                      "older version, or not a simulated rank): bench it again for --link-gbps")
                rows[-1]["comm_ms"] = comm_ms(moved, world, link_gbps)
            total += n_steps * med / 1000
            if src not in medians:
                medians[src] = np.median(rng.choice(times, size=(n_boot, times.size), replace=True), axis=1)
            boot += n_steps * medians[src] / 1000
        draws[name] = boot
        out_arms.append({"name": name, "seconds": total, "ci": _ci(boot), "stages": rows})
        if link_gbps is not None:
            comm_s = sum(r["steps"] * r["comm_ms"] / 1000 for r in rows)
            out_arms[-1].update(comm_seconds=comm_s, seconds_with_comm=total + comm_s)
    base = names[0]
    for arm in out_arms:
        arm["ratio"] = arm["seconds"] / out_arms[0]["seconds"]
        arm["ratio_ci"] = _ci(draws[arm["name"]] / draws[base])
    return {"arms": out_arms, "baseline": base, "unbenched": unbenched, "n_boot": n_boot,
            "world_size": world, "simulated": simulated, "world": describe_world(world, simulated),
            "separate_processes": sorted(s for s, n in files_per_stage.items() if n > 1),
            "upstream": [{"name": up["name"], "path": up["path"]} for up in upstream], "link_gbps": link_gbps,
            "card": machine["card"], "torch": machine["torch"]}


def _ci(x: np.ndarray) -> list[float]:
    return [float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))]


def render(res: dict[str, Any]) -> str:
    lines = ["projected training time (sum over stages of steps x median step time; compile, warmup and",
             "validation not included)"]
    if res.get("simulated"):
        n = res["world_size"]
        lines.append(f"a run on {n} GPUs, from {res['world']}: every rank's compute, communication not included")
    elif "world_size" in res:
        lines.append(f"benched on {res['world']}")
    if res.get("card") or res.get("torch"):
        lines.append(f"card {res.get('card') or 'not recorded'}, torch {res.get('torch') or 'not recorded'}")
    lines.append("")
    stages = sorted({r["stage"] for a in res["arms"] for r in a["stages"]})
    head = "| arm | " + " | ".join(f"stage {s}" for s in stages) + " | total s [95% CI] | vs " + res["baseline"] + " [95% CI] |"
    lines += [head, "|" + "---|" * (len(stages) + 3)]
    for a in res["arms"]:
        cells = {r["stage"]: f"{r['steps']} x {r['median_ms']:.1f} ms" for r in a["stages"]}
        lines.append(f"| {a['name']} | " + " | ".join(cells.get(s, "-") for s in stages)
                     + f" | {a['seconds']:.1f} [{a['ci'][0]:.1f}, {a['ci'][1]:.1f}]"
                     + f" | {a['ratio']:.4f} [{a['ratio_ci'][0]:.4f}, {a['ratio_ci'][1]:.4f}] |")
    for i, src in sorted(res["unbenched"].items()):
        lines.append(f"(stage {i} was not benched: timed as stage {src}, the nearest earlier stage with its batch)")
    for s in res.get("separate_processes", []):
        lines.append(f"(stage {s}: arms benched in separate processes, not interleaved)")
    for up in res.get("upstream", []):
        lines.append(f"({up['name']}: upstream's own run, its step times read from its log: {up['path']})")
    if res.get("link_gbps"):
        lines += ["", f"with the collectives the simulated rank counted, at {res['link_gbps']:g} GB/s bus bandwidth "
                      "and none overlapped with compute (an upper bound; the total above is the lower one):"]
        for a in res["arms"]:
            lines.append(f"- {a['name']}: {a['seconds_with_comm']:.1f} s ({a['comm_seconds']:+.1f} s of communication; "
                         + ", ".join(f"stage {r['stage']} {r['comm_ms']:.2f} ms/step" for r in a["stages"]) + ")")
    return "\n".join(lines) + "\n"


def cli_project(args) -> int:
    import sys

    try:
        upstream = [load_upstream(spec) for spec in getattr(args, "upstream", None) or []]
        res = project(load_benches(args.files), n_boot=args.n_boot, seed=args.seed,
                      as_rank_of=getattr(args, "as_rank_of", None), upstream=upstream,
                      only=getattr(args, "arm", None), link_gbps=getattr(args, "link_gbps", None))
    except ConfigError as e:
        print(f"speedrun bench project: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0
