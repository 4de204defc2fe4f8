"""PNG plots of runs grouped by arm (matplotlib, Agg backend chosen at call time, not import)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from speedrun.evidence.logparse import RunSummary

_SMOOTH = 15  # steps in the moving mean of the step-time curve


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless: records are written on machines without a display
    import matplotlib.pyplot as plt

    return plt


def _colors(n: int) -> list:
    return [f"C{i % 10}" for i in range(n)]


def plot_val_loss(arms: dict[str, Sequence[RunSummary]], path: str | Path, x: str = "step",
                  target: float | None = None) -> Path:
    """Validation loss against ``x`` ("step" or "time", time in seconds), one colour per arm and
    one thin line per run; the loss axis starts at the second validation so the final descent is
    visible.  Returns ``path``."""
    if x not in ("step", "time"):
        raise ValueError(f"x must be 'step' or 'time', got {x!r}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    tail_losses = []
    for (label, runs), color in zip(arms.items(), _colors(len(arms))):
        for i, r in enumerate(runs):
            if not r.val_curve:
                continue
            steps, losses, times = zip(*r.val_curve)
            xs = steps if x == "step" else [t / 1000.0 for t in times]
            ax.plot(xs, losses, color=color, alpha=0.6, lw=1, marker=".", ms=3,
                    label=f"{label} ({len(runs)} runs)" if i == 0 else None)
            tail_losses.extend(losses[1:] if len(losses) > 1 else losses)
    if target is not None:
        ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target}")
    if tail_losses:
        lo, hi = min(tail_losses), max(tail_losses)
        if target is not None:
            lo = min(lo, target)
        pad = 0.05 * (hi - lo) + 1e-3
        ax.set_ylim(lo - pad, hi + pad)
    ax.set_xlabel("step" if x == "step" else "train time (s)")
    ax.set_ylabel("validation loss")
    ax.set_title(f"Validation loss vs {x}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_step_times(arms: dict[str, Sequence[RunSummary]], path: str | Path) -> Path:
    """Per-step time (ms, from consecutive ``train_time`` deltas): left, the median over each
    arm's runs against step (moving mean over ``_SMOOTH`` steps); right, the distribution (histogram) of all steps per arm."""
    plt = _pyplot()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=100)
    all_ms = []
    per_arm = {}
    for label, runs in arms.items():
        by_step: dict[int, list[float]] = {}
        for r in runs:
            for s, ms in r.step_durations_ms():
                by_step.setdefault(s, []).append(ms)
        per_arm[label] = by_step
        all_ms.extend(ms for v in by_step.values() for ms in v)
    if all_ms:
        # Clip the axis at a high percentile: the first steps and validation pauses are outliers.
        hi = float(np.percentile(all_ms, 99.5))
        lo = float(min(all_ms))
        bins = np.linspace(lo, hi, 60) if hi > lo else 20
        for (label, by_step), color in zip(per_arm.items(), _colors(len(per_arm))):
            if not by_step:
                continue
            steps = sorted(by_step)
            med = np.array([np.median(by_step[s]) for s in steps])
            # Logged times are whole ms without a sync per step: smooth so arms can be told apart.
            k = min(_SMOOTH, len(med))
            smooth = np.convolve(med, np.ones(k) / k, mode="valid")
            ax0.plot(steps[k // 2: k // 2 + len(smooth)], smooth, color=color, lw=1, label=label)
            vals = [ms for v in by_step.values() for ms in v]
            ax1.hist(vals, bins=bins, color=color, alpha=0.45, histtype="stepfilled",
                     label=f"{label}: median {np.median(vals):.2f} ms")
        ax0.set_ylim(max(0.0, lo * 0.9), hi * 1.05)
    else:
        ax0.text(0.5, 0.5, "no per-step lines", ha="center", transform=ax0.transAxes)
    ax0.set_xlabel("step")
    ax0.set_ylabel(f"step time (ms): median over runs, {_SMOOTH}-step mean")
    ax0.grid(alpha=0.3)
    ax1.set_xlabel("step time (ms)")
    ax1.set_ylabel("steps")
    ax1.grid(alpha=0.3)
    for ax in (ax0, ax1):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Step time")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
