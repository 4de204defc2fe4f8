"""``speedrun profile --diff BASE OTHER``: where two profiles of the same step differ, kernel by kernel.

Two ``profile.json`` files of ``speedrun profile`` (best ``--device-only``, the same stage and
card; e.g. one arm with ``train.cuda_graphs=off`` and one with graphs) are compared per step:

- the device timeline: span (first kernel start to last end), busy (the union of kernel, copy
  and memset intervals) and idle time, so a slower step says whether its GPU waited or worked
  longer;
- every kernel, grouped by :func:`speedrun.evidence.profile.kernel_key` (template and argument
  lists dropped, so one kernel of two instantiations is one row): calls and time per step in
  each, and the difference, ranked by its size.  Kernels of one side only are rows too.

The profiles are not interleaved: run both on one warm machine, close in time, and read a
difference of a kernel's time together with its calls (more calls is more work; the same calls
in more time is a slower kernel: another algorithm, another clock, another layout).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from speedrun.errors import ConfigError
from speedrun.evidence.profile import kernel_key

__all__ = ["load_profile", "diff_profiles", "render_diff"]


HEAVIEST_CHECKED = 5  # the base's heaviest kernels whose calls per step must match
CALLS_TOLERANCE = 0.1  # relative difference in calls per step beyond which they do not


def load_profile(path: str | Path) -> dict[str, Any]:
    """A ``speedrun profile`` JSON (the file, or the ``--out`` folder holding ``profile.json``)."""
    p = Path(path)
    if p.is_dir():
        p = p / "profile.json"
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such profile (give a profile.json or the folder 'speedrun profile --out' wrote)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not a readable JSON file ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("kernels"), list) or not isinstance(doc.get("steps"), int):
        raise ConfigError(f"{p}: not a 'speedrun profile' JSON (no kernel table or step count)")
    if doc["steps"] < 1:
        raise ConfigError(f"{p}: profiles {doc['steps']} steps")
    for row in doc["kernels"]:
        if not (isinstance(row, dict) and isinstance(row.get("kernel"), str)
                and isinstance(row.get("calls"), int) and isinstance(row.get("time_us"), (int, float))):
            raise ConfigError(f"{p}: a kernel row lacks kernel/calls/time_us: {row!r}")
    doc["_path"] = str(p)
    return doc


def _per_step_kernels(doc: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """kernel key -> (calls per step, µs per step)."""
    n = doc["steps"]
    out: dict[str, list[float]] = {}
    for row in doc["kernels"]:
        acc = out.setdefault(kernel_key(row["kernel"]), [0.0, 0.0])
        acc[0] += row["calls"] / n
        acc[1] += float(row["time_us"]) / n
    return {k: (c, us) for k, (c, us) in out.items()}


def _timeline(doc: dict[str, Any]) -> dict[str, float] | None:
    t = doc.get("timeline")
    if not isinstance(t, dict):
        return None
    n = doc["steps"]
    return {k: float(t[k]) / n for k in ("span_us", "busy_us", "idle_us") if k in t}


def diff_profiles(base: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """Per-step comparison of two loaded profiles (see the module docstring).

    Returns ``{"base", "other"`` (their paths, arms, devices, steps), ``"warnings"``, ``"timeline"``
    (``{measure: {"base", "other", "delta"}}`` in µs per step, where both have one),
    ``"kernel_us"`` (the kernels' summed time per step, each side and the delta), ``"rows"``:
    ``[{"kernel", "base_calls", "other_calls", "base_us", "other_us", "delta_us"}]`` ranked by
    ``|delta_us|``}."""
    warnings = []
    if base.get("device") != other.get("device"):
        warnings.append(f"the profiles ran on different devices ({base.get('device')} / {other.get('device')}): "
                        "their kernel times do not compare")
    if bool(base.get("device_only")) != bool(other.get("device_only")):
        warnings.append("one profile recorded device activity only and the other ops too: the profiler's own "
                        "host work differs, so their idle time does not compare")
    kb, ko = _per_step_kernels(base), _per_step_kernels(other)
    # The same step's heaviest kernels run equally often on both sides; where they do not, the
    # profiles recorded different work (a CUDA-graph capture and its self-check among the profiled
    # steps runs every kernel twice, or the arms' shapes differ) and their times do not compare.
    heaviest = sorted((k for k in kb if k in ko), key=lambda k: -kb[k][1])[:HEAVIEST_CHECKED]
    for k in heaviest:
        bc, oc = kb[k][0], ko[k][0]
        if abs(oc - bc) > CALLS_TOLERANCE * max(bc, oc):
            warnings.append(f"`{k}`, among the base's heaviest kernels, ran {bc:g} times per step there and "
                            f"{oc:g} in the other: the profiles recorded different work per step (a CUDA-graph "
                            "capture among the profiled steps, or other shapes), so their times do not compare")
            break
    rows = []
    for k in sorted(set(kb) | set(ko)):
        bc, bu = kb.get(k, (0.0, 0.0))
        oc, ou = ko.get(k, (0.0, 0.0))
        rows.append({"kernel": k, "base_calls": bc, "other_calls": oc, "base_us": bu, "other_us": ou,
                     "delta_us": ou - bu})
    rows.sort(key=lambda r: (-abs(r["delta_us"]), r["kernel"]))
    tb, to = _timeline(base), _timeline(other)
    timeline = {}
    if tb and to:
        timeline = {k: {"base": tb[k], "other": to[k], "delta": to[k] - tb[k]} for k in tb if k in to}
    sb, so = sum(u for _, u in kb.values()), sum(u for _, u in ko.values())

    def side(d):
        return {"path": d.get("_path"), "arm": d.get("arm"), "device": d.get("device"), "steps": d["steps"]}

    return {"base": side(base), "other": side(other), "warnings": warnings, "timeline": timeline,
            "kernel_us": {"base": sb, "other": so, "delta": so - sb}, "rows": rows}


def render_diff(res: dict[str, Any], top: int = 30) -> str:
    """Markdown of :func:`diff_profiles`' result; times in ms per step."""
    ms = lambda us: us / 1000.0  # noqa: E731
    b, o = res["base"], res["other"]
    lines = [f"# Profile diff: {o['arm']} against {b['arm']} (per step)", "",
             f"- base: `{b['path']}` ({b['device']}, {b['steps']} step(s))",
             f"- other: `{o['path']}` ({o['device']}, {o['steps']} step(s))"]
    lines += [f"- **warning:** {w}" for w in res["warnings"]]
    lines += ["", "| measure | base ms | other ms | other - base ms |", "|---|---:|---:|---:|"]
    for name, label in (("span_us", "device span"), ("busy_us", "device busy"), ("idle_us", "device idle")):
        t = res["timeline"].get(name)
        if t:
            lines.append(f"| {label} | {ms(t['base']):.3f} | {ms(t['other']):.3f} | {ms(t['delta']):+.3f} |")
    k = res["kernel_us"]
    lines.append(f"| kernels' summed time | {ms(k['base']):.3f} | {ms(k['other']):.3f} | {ms(k['delta']):+.3f} |")
    rows = res["rows"][:top]
    lines += ["", f"Kernels by the size of their difference (top {len(rows)} of {len(res['rows'])}):", "",
              "| kernel | calls base | calls other | base ms | other ms | other - base ms |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = r["kernel"] if len(r["kernel"]) <= 90 else r["kernel"][:87] + "..."
        lines.append(f"| `{name}` | {r['base_calls']:.1f} | {r['other_calls']:.1f} | {ms(r['base_us']):.3f} | "
                     f"{ms(r['other_us']):.3f} | {ms(r['delta_us']):+.3f} |")
    return "\n".join(lines) + "\n"


def cli_diff(base_path: str, other_path: str, top: int = 30, json_out: str | None = None) -> int:
    """``speedrun profile --diff BASE OTHER``: print the markdown, optionally save the JSON."""
    import sys

    try:
        res = diff_profiles(load_profile(base_path), load_profile(other_path))
    except ConfigError as e:
        print(f"speedrun profile --diff: {e}", file=sys.stderr)
        return 2
    print(render_diff(res, top=top), end="")
    if json_out:
        Path(json_out).write_text(json.dumps(res, indent=2) + "\n")
    return 0
