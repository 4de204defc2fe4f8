"""Statistics of speedrun results, the way records are judged.

Per group (arm) of runs: final validation losses and train times (seconds).  A record needs mean
loss below the target with a one-sided one-sample t-test p < 0.01; two arms are compared with
Welch's t-test (unequal variances) on losses and on times.  All tests are ``scipy.stats``.

Welch p-values are reported two-sided (what upstream ``statistics.md`` files print) and one-sided
(``p_less``: the candidate B has the smaller mean, i.e. B is faster / has lower loss).
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

import numpy as np
from scipy import stats as sps

from speedrun.evidence.logparse import RunSummary

DEFAULT_TARGET = 3.28


def _f(x: Any) -> float | None:
    """Plain float for JSON; None for NaN/None."""
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) else x


def describe(values: Sequence[float]) -> dict[str, Any]:
    """n, mean, sample std (ddof=1; None for n < 2), median, min, max of ``values``."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return {"n": 0, "mean": None, "std": None, "median": None, "min": None, "max": None}
    return {
        "n": int(v.size),
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if v.size > 1 else None,
        "median": float(np.median(v)),
        "min": float(v.min()),
        "max": float(v.max()),
    }


def one_sample_less(losses: Sequence[float], target: float = DEFAULT_TARGET) -> dict[str, Any]:
    """One-sided one-sample t-test of H1: mean(losses) < target.  p is None for n < 2."""
    if len(losses) < 2:
        return {"target": target, "t": None, "df": None, "p": None}
    r = sps.ttest_1samp(np.asarray(losses, dtype=np.float64), target, alternative="less")
    return {"target": target, "t": _f(r.statistic), "df": len(losses) - 1, "p": _f(r.pvalue)}


def welch(a: Sequence[float], b: Sequence[float]) -> dict[str, Any]:
    """Welch's t-test of B against A (t > 0 when mean B > mean A).

    ``p_two_sided``: means differ; ``p_less``: mean B < mean A; ``p_greater``: mean B > mean A.
    All None when either group has fewer than 2 values.
    """
    if len(a) < 2 or len(b) < 2:
        return {"t": None, "df": None, "p_two_sided": None, "p_less": None, "p_greater": None}
    a_, b_ = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    out: dict[str, Any] = {}
    for alt, key in (("two-sided", "p_two_sided"), ("less", "p_less"), ("greater", "p_greater")):
        r = sps.ttest_ind(b_, a_, equal_var=False, alternative=alt)
        out[key] = _f(r.pvalue)
        out["t"] = _f(r.statistic)
        out["df"] = _f(getattr(r, "df", None))
    return out


def group_stats(runs: Sequence[RunSummary], target: float = DEFAULT_TARGET) -> dict[str, Any]:
    """Statistics of the usable runs of one arm.  Times in seconds."""
    used = [r for r in runs if r.usable]
    losses = [r.val_loss for r in used]
    times = [r.train_time_s for r in used]
    steps = sorted({r.total_steps for r in used})
    return {
        "n": len(used),
        "n_excluded": len(runs) - len(used),
        "steps": steps[0] if len(steps) == 1 else steps,
        "loss": describe(losses),
        "loss_test": one_sample_less(losses, target),
        "time_s": describe(times),
        "losses": losses,
        "times_s": times,
        "runs": [r.name for r in used],
        "seeds": [r.seed for r in used],
        "excluded": [{"run": r.name, "why": "; ".join(r.problems)} for r in runs if not r.usable],
        "environment": environment(used),
    }


def environment(runs: Sequence[RunSummary]) -> dict[str, Any]:
    """Distinct versions and GPU descriptions seen across ``runs`` (sorted lists)."""

    def distinct(attr):
        return sorted({getattr(r, attr) for r in runs if getattr(r, attr)})

    gpus = sorted({f"{len(r.gpus)}x {Counter(r.gpus).most_common(1)[0][0]}" for r in runs if r.gpus})
    return {
        "gpus": gpus,
        "python": distinct("python_version"),
        "torch": distinct("torch_version"),
        "cuda": distinct("cuda_version"),
        "triton": distinct("triton_version"),
        "driver": distinct("driver_version"),
        "peak_allocated_mib": max((r.peak_allocated_mib for r in runs if r.peak_allocated_mib), default=None),
        "peak_reserved_mib": max((r.peak_reserved_mib for r in runs if r.peak_reserved_mib), default=None),
    }


def compare(a: dict[str, Any], b: dict[str, Any], reference_time: float | None = None) -> dict[str, Any]:
    """Compare arm B (candidate) with arm A (baseline), both from :func:`group_stats`.

    ``ratio`` = mean time B / mean time A; ``projected_time_s`` = ratio x ``reference_time``
    (seconds; the time the baseline recipe takes on the reference hardware).
    """
    ta, tb = a["time_s"]["mean"], b["time_s"]["mean"]
    la, lb = a["loss"]["mean"], b["loss"]["mean"]
    ratio = tb / ta if ta and tb else None
    return {
        "ratio": ratio,
        "speedup": 1.0 / ratio if ratio else None,
        "delta_time_s": tb - ta if ta is not None and tb is not None else None,
        "delta_time_pct": 100.0 * (ratio - 1.0) if ratio else None,
        "delta_loss": lb - la if la is not None and lb is not None else None,
        "reference_time_s": reference_time,
        "projected_time_s": ratio * reference_time if ratio and reference_time else None,
        "welch_time": welch(a["times_s"], b["times_s"]),
        "welch_loss": welch(a["losses"], b["losses"]),
        "slowest_b_s": b["time_s"]["max"],
        "fastest_a_s": a["time_s"]["min"],
    }


def pseudo_replication(groups: dict[str, Sequence[RunSummary]]) -> list[str]:
    """Warnings for runs that may not be independent.

    A seed used twice *within one group* (that group's n counts one sample twice or, with a
    nondeterministic run, two correlated ones), and two logs anywhere with identical
    validation-loss sequences (the same run counted twice).  The same seed in different groups is
    not flagged: giving every arm the same seeds is the paired design ``speedrun compare`` uses.
    """
    out = []
    for label, runs in groups.items():
        seeds = Counter(r.seed for r in runs if r.seed is not None)
        for seed, k in sorted(seeds.items()):
            if k > 1:
                names = [r.name for r in runs if r.seed == seed]
                out.append(f"pseudo-replication: seed {seed} appears in {k} runs of {label} ({', '.join(names)})")
    by_curve: dict[tuple, list[str]] = {}
    for runs in groups.values():
        for r in runs:
            curve = tuple(loss for _, loss, _ in r.val_curve)
            if len(curve) >= 2:
                by_curve.setdefault(curve, []).append(r.path)
    for names in by_curve.values():
        if len(names) > 1:
            out.append(
                "pseudo-replication: identical val-loss sequences in " + ", ".join(names)
            )
    return out


def analyze(
    groups: dict[str, Sequence[RunSummary]],
    target: float = DEFAULT_TARGET,
    reference_time: float | None = None,
    warnings: Sequence[str] = (),
) -> dict[str, Any]:
    """Everything ``speedrun stats`` reports, as a JSON-able dict.

    ``groups`` maps label -> runs, in order; with two groups the first is the baseline A and the
    second the candidate B.  Statistics use only usable (complete, finite) runs.
    """
    labels = list(groups)
    result: dict[str, Any] = {
        "target": target,
        "reference_time_s": reference_time,
        "groups": {k: group_stats(v, target) for k, v in groups.items()},
        "warnings": list(warnings),
    }
    result["warnings"] += pseudo_replication({k: [r for r in v if r.usable] for k, v in groups.items()})
    for k, g in result["groups"].items():
        if g["n"] < 2:
            result["warnings"].append(f"{k}: {g['n']} usable run(s); tests need at least 2")
    if len(labels) == 2:
        a, b = (result["groups"][k] for k in labels)
        result["comparison"] = {"a": labels[0], "b": labels[1], **compare(a, b, reference_time)}
    return result


# ----------------------------------------------------------------------------------------------
# Markdown


def _num(x: Any, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _p(x: float | None) -> str:
    if x is None:
        return "n/a"
    return f"{x:.2e}" if x < 1e-3 else f"{x:.4f}"


def render_markdown(result: dict[str, Any]) -> str:
    """Markdown tables of an :func:`analyze` result."""
    target = result["target"]
    lines = [
        f"| arm | n | steps | mean val loss | std | p (mean < {target}) | mean time (s) | std (s) "
        "| median (s) | range (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for k, g in result["groups"].items():
        lo, t = g["loss"], g["time_s"]
        rng = "n/a" if t["min"] is None else f"{t['min']:.3f}-{t['max']:.3f}"
        lines.append(
            f"| {k} | {g['n']} | {g['steps']} | {_num(lo['mean'], '.5f')} | {_num(lo['std'], '.5f')} "
            f"| {_p(g['loss_test']['p'])} | {_num(t['mean'], '.3f')} | {_num(t['std'], '.3f')} "
            f"| {_num(t['median'], '.3f')} | {rng} |"
        )
    c = result.get("comparison")
    if c:
        wt, wl = c["welch_time"], c["welch_loss"]
        lines += [
            "",
            f"**{c['b']} vs {c['a']}**",
            "",
            "| quantity | value |",
            "| --- | ---: |",
            f"| time ratio B/A | {_num(c['ratio'], '.5f')} |",
            f"| speedup A/B | {_num(c['speedup'], '.5f')}x |",
            f"| delta time (s) | {_num(c['delta_time_s'], '+.3f')} ({_num(c['delta_time_pct'], '+.3f')}%) |",
            f"| delta loss | {_num(c['delta_loss'], '+.5f')} |",
        ]
        if c["projected_time_s"] is not None:
            lines.append(
                f"| projected time (ratio x {c['reference_time_s']:g} s) | {c['projected_time_s']:.3f} s |"
            )
        lines += [
            f"| Welch time: t, df | {_num(wt['t'], '.3f')}, {_num(wt['df'], '.1f')} |",
            f"| Welch time: p one-sided (B faster) | {_p(wt['p_less'])} |",
            f"| Welch time: p two-sided | {_p(wt['p_two_sided'])} |",
            f"| Welch loss: p two-sided | {_p(wl['p_two_sided'])} |",
            f"| Welch loss: p one-sided (B lower) | {_p(wl['p_less'])} |",
            f"| slowest B / fastest A (s) | {_num(c['slowest_b_s'], '.3f')} / {_num(c['fastest_a_s'], '.3f')} |",
        ]
    envs = {k: g["environment"] for k, g in result["groups"].items()}
    lines += ["", "| arm | GPUs | Python | PyTorch | CUDA | Triton | driver | peak alloc/reserved MiB |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k, e in envs.items():
        peak = f"{_num(e['peak_allocated_mib'], 'd')}/{_num(e['peak_reserved_mib'], 'd')}"
        cells = [", ".join(e[x]) or "?" for x in ("gpus", "python", "torch", "cuda", "triton", "driver")]
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {peak} |")
    if result["warnings"]:
        lines += ["", "**Warnings**", ""] + [f"- {w}" for w in result["warnings"]]
    return "\n".join(lines) + "\n"

