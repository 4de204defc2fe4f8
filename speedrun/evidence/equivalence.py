"""Do two training runs end with the same weights?  (N ranks vs 1 rank with gradient accumulation.)

A run on N ranks with ``grad_accum = 8 / N`` takes the same optimizer steps as one rank with
``grad_accum = 8``: the same tokens, the same gradients up to the order of the sums.  NorMuon
orthogonalises in bf16, so sums taken in another order show up as bf16 rounding differences in the
weights; anything larger is a bug in the sharding, the reductions or the loader's rank slicing.
:func:`compare_runs` measures it from the runs' newest checkpoints and logs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from speedrun.evidence.logparse import parse_log
from speedrun.train.checkpoint import load_latest


def relative_errors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """``||a - b|| / ||a||`` (Frobenius, fp32) per tensor of two state dicts with the same keys and
    shapes; 0 where both are zero, inf where only ``a`` is."""
    if a.keys() != b.keys():
        raise ValueError(f"state dicts differ in keys: only in the first {sorted(a.keys() - b.keys())[:5]}, "
                         f"only in the second {sorted(b.keys() - a.keys())[:5]}")
    out = {}
    for k in a:
        x, y = a[k].detach().float().cpu(), b[k].detach().float().cpu()
        if x.shape != y.shape:
            raise ValueError(f"{k}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        norm = x.norm().item()
        diff = (x - y).norm().item()
        out[k] = (0.0 if diff == 0 else float("inf")) if norm == 0 else diff / norm
    return out


def compare_runs(run_a: str | Path, run_b: str | Path, *, tolerance: float = 5e-3,
                 val_tolerance: float = 1e-3) -> dict[str, Any]:
    """Compare the newest checkpoints (model weights) and the validation losses of two run folders.

    Returns a JSON-able dict: ``step`` of each checkpoint, ``max_rel`` and the five ``worst``
    tensors (relative error), ``val_a`` / ``val_b`` (the logs' validation losses by step),
    ``val_max_rel`` (largest relative difference of the losses at the same steps),
    ``weights_ok`` (same step, every tensor within ``tolerance``), ``val_ok`` (validations at the
    same steps, within ``val_tolerance``) and ``ok`` (both).

    FP8 runs do not reach bf16-level weight agreement across world sizes even with their
    step-synchronous scales: FP8 rounding turns sum-order differences into whole-ulp differences of
    single elements, and those grow chaotically over steps, so for them ``val_ok`` is the
    meaningful verdict."""
    ca, cb = load_latest(Path(run_a)), load_latest(Path(run_b))
    errs = relative_errors(ca["model"], cb["model"])
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:5]
    vals = []
    for run in (run_a, run_b):
        vals.append({step: loss for step, loss, _ in parse_log(Path(run) / "log.txt").val_curve})
    max_rel = max(errs.values()) if errs else 0.0
    common = sorted(vals[0].keys() & vals[1].keys())
    val_rel = [abs(vals[0][k] - vals[1][k]) / abs(vals[0][k]) for k in common if vals[0][k]]
    val_max_rel = max(val_rel) if val_rel else float("nan")
    weights_ok = ca["step"] == cb["step"] and max_rel <= tolerance
    val_ok = bool(common) and vals[0].keys() == vals[1].keys() and val_max_rel <= val_tolerance
    return {
        "run_a": str(run_a), "run_b": str(run_b), "step_a": ca["step"], "step_b": cb["step"],
        "tensors": len(errs), "max_rel": max_rel, "worst": worst, "tolerance": tolerance,
        "val_a": vals[0], "val_b": vals[1], "val_max_rel": val_max_rel, "val_tolerance": val_tolerance,
        "weights_ok": weights_ok, "val_ok": val_ok, "ok": weights_ok and val_ok,
    }


def render(result: dict[str, Any]) -> str:
    """A few lines for the console."""
    lines = [f"{result['run_a']}  vs  {result['run_b']}",
             f"checkpoint steps {result['step_a']} / {result['step_b']}; {result['tensors']} tensors; "
             f"max relative error {result['max_rel']:.2e} (tolerance {result['tolerance']:.0e})"]
    lines += [f"  {err:.2e}  {name}" for name, err in result["worst"]]
    for step in sorted(set(result["val_a"]) | set(result["val_b"])):
        lines.append(f"  val_loss at step {step}: {result['val_a'].get(step)} / {result['val_b'].get(step)}")
    lines.append(f"validation losses: largest relative difference {result['val_max_rel']:.1e} "
                 f"(tolerance {result['val_tolerance']:.0e})")
    verdict = {(True, True): "EQUIVALENT", (False, True): "SAME LOSSES, WEIGHTS DIFFER BEYOND TOLERANCE",
               (True, False): "SAME WEIGHTS, LOSSES DIFFER", (False, False): "NOT EQUIVALENT"}
    lines.append(verdict[(result["weights_ok"], result["val_ok"])])
    return "\n".join(lines)
