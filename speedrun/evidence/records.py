"""Write a records folder: the logs, results.json, README.md with the speedrun's tables, plots.

Layout of ``out_dir``::

    README.md                 tables per arm and between arms, environment, plots
    results.json              the same numbers (speedrun.evidence.stats.analyze) + fingerprints
    logs/<arm>/<log>          every run's log (copied unless already inside out_dir)
    val_loss_vs_step.png, val_loss_vs_time.png, step_time.png
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from speedrun.evidence import plots
from speedrun.evidence.logparse import RunSummary
from speedrun.evidence.stats import DEFAULT_TARGET, analyze, render_markdown

# Fingerprint fields compared before/after the runs, and the relative drop that is worth a warning
# (a node that slows down during the runs makes its timings suspect; back-to-back bf16 matmul
# measurements on one H200 already vary by a few percent, hence 5%).
_DRIFT_FIELDS = ("matmul_bf16_tflops", "copy_tbps")
_DRIFT_WARN = 0.05


def group_by_arm(runs: Sequence[RunSummary]) -> dict[str, list[RunSummary]]:
    """Runs grouped by ``label`` in order of first appearance (unlabelled runs: arm "run")."""
    arms: dict[str, list[RunSummary]] = {}
    for r in runs:
        arms.setdefault(r.label or "run", []).append(r)
    return arms


def fingerprint_drift(before: dict, after: dict) -> list[str]:
    """Warnings for measured ceilings that fell by more than 5% between ``before`` and ``after``."""
    out = []
    for k in _DRIFT_FIELDS:
        b, a = (before or {}).get(k), (after or {}).get(k)
        if b and a and a < b * (1 - _DRIFT_WARN):
            out.append(f"node slowed during the runs: {k} {b:.3g} before, {a:.3g} after")
    return out


def _copy_logs(out_dir: Path, arms: dict[str, list[RunSummary]]) -> dict[int, str]:
    """Copy each log under out_dir/logs/<arm>/; returns id(run) -> path relative to out_dir."""
    rel: dict[int, str] = {}
    out_res = out_dir.resolve()
    for arm, runs in arms.items():
        used: set[str] = set()
        for r in runs:
            src = Path(r.path)
            if src.resolve().is_relative_to(out_res):
                rel[id(r)] = str(src.resolve().relative_to(out_res))
                continue
            name = src.name
            i = 1
            while name in used:  # two arms' logs may share file names (e.g. log.txt per run folder)
                name = f"{src.stem}-{i}{src.suffix}"
                i += 1
            used.add(name)
            dst = out_dir / "logs" / _safe(arm) / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            if src.is_file():
                shutil.copy2(src, dst)
            rel[id(r)] = str(dst.relative_to(out_dir))
    return rel


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "run"


def _fingerprint_table(before: dict, after: dict) -> list[str]:
    keys = [k for k in dict.fromkeys([*(before or {}), *(after or {})])]
    lines = ["| field | before | after |", "| --- | --- | --- |"]
    for k in keys:
        b, a = (before or {}).get(k), (after or {}).get(k)
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("" if v is None else str(v))  # noqa: E731
        lines.append(f"| {k} | {fmt(b)} | {fmt(a)} |")
    return lines


def write_records(
    out_dir: str | Path,
    runs: list[RunSummary],
    fingerprint_before: dict,
    fingerprint_after: dict,
    target: float = DEFAULT_TARGET,
    reference_time: float | None = None,
) -> Path:
    """Write a records folder for ``runs`` (grouped into arms by ``RunSummary.label``; the first
    arm is the baseline A, the second the candidate B) and return ``out_dir``.

    ``fingerprint_before`` / ``fingerprint_after`` are :func:`node_fingerprint` dicts taken around
    the runs; ``reference_time`` (seconds) projects B's time as (mean B / mean A) x reference.
    """
    if not runs:
        raise ValueError("write_records needs at least one run")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arms = group_by_arm(runs)
    rel = _copy_logs(out, arms)
    result = analyze(arms, target=target, reference_time=reference_time)
    result["warnings"] += fingerprint_drift(fingerprint_before, fingerprint_after)
    for r in runs:
        if not r.usable:
            result["warnings"].append(f"{r.label or 'run'}/{r.name}: excluded ({'; '.join(r.problems)})")

    plot_files = {
        "val_loss_vs_step": "val_loss_vs_step.png",
        "val_loss_vs_time": "val_loss_vs_time.png",
        "step_time": "step_time.png",
    }
    plots.plot_val_loss(arms, out / plot_files["val_loss_vs_step"], x="step", target=target)
    plots.plot_val_loss(arms, out / plot_files["val_loss_vs_time"], x="time", target=target)
    plots.plot_step_times(arms, out / plot_files["step_time"])

    runs_json = []
    for r in runs:
        d = r.to_dict()
        d["arm"] = r.label or "run"
        d["log"] = rel[id(r)]
        d.pop("path")
        runs_json.append(d)
    doc: dict[str, Any] = {
        "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **result,
        "runs": runs_json,
        "fingerprint_before": fingerprint_before,
        "fingerprint_after": fingerprint_after,
        "plots": plot_files,
    }
    (out / "results.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "README.md").write_text(_readme(doc, arms))
    return out


def _readme(doc: dict[str, Any], arms: dict[str, list[RunSummary]]) -> str:
    names = list(arms)
    title = f"{names[1]} vs {names[0]}" if len(names) == 2 else ", ".join(names)
    parts = [
        f"# Records: {title}",
        "",
        f"Written {doc['written']}. Final validation loss and train time are taken from each log's last "
        "`val_loss` line; a run counts only if that line is at the final step. p is the one-sided "
        f"one-sample t-test of mean loss < {doc['target']}; Welch tests compare the second arm (B) with "
        "the first (A); std is the sample std (ddof=1). Numbers: `results.json`.",
        "",
        "## Results",
        "",
        render_markdown(doc),
        "## Raw values",
        "",
    ]
    for k, g in doc["groups"].items():
        parts += [
            f"**{k}** losses: `{[round(x, 4) for x in g['losses']]}`",
            "",
            f"**{k}** times (s): `{[round(x, 3) for x in g['times_s']]}`",
            "",
        ]
    parts += ["## Node fingerprint (before / after the runs)", ""]
    parts += _fingerprint_table(doc["fingerprint_before"], doc["fingerprint_after"])
    parts += ["", "## Plots", ""]
    for key, f in doc["plots"].items():
        parts += [f"![{key}]({f})", ""]
    parts += ["## Logs", ""]
    for r in doc["runs"]:
        state = "" if r["complete"] else " (incomplete)"
        parts.append(f"- [{r['arm']}/{r['name']}]({r['log']}){state}")
    return "\n".join(parts) + "\n"
