"""SM clock, power and temperature per phase of a device call, from an ``nvidia-smi`` log.

Two programs that cannot be interleaved (upstream's training and ours) are compared one after
the other on one machine; this says whether the GPU ran both at the same clocks.  Log with

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu \\
        --format=csv,noheader -lms 250 > clocks.csv &

and mark phases with ``echo "NAME $(date +%s)" >> phases.txt`` when each starts (a phase ends
where the next starts; the last at the log's end).  Samples drawing less than ``--busy-w`` watts
(an idle or host-bound GPU, compiling, loading) are counted but left out of the medians.

Usage:  python tools/gpu_clocks.py clocks.csv [--phases phases.txt] [--busy-w 300] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path


@dataclass
class Sample:
    t: float       # seconds since the epoch (UTC)
    sm_mhz: float
    power_w: float
    temp_c: float


@dataclass
class PhaseClocks:
    phase: str
    samples: int
    busy: int            # samples at or above the busy threshold
    sm_mhz_median: float | None
    sm_mhz_p10: float | None
    power_w_median: float | None
    temp_c_max: float | None


def _number(field: str) -> float:
    """'1980 MHz' / '612.35 W' / '45' -> float."""
    return float(field.strip().split()[0])


def parse_log(text: str) -> list[Sample]:
    """Rows 'YYYY/MM/DD HH:MM:SS.mmm, 1980 MHz, 612.35 W, 45' (nvidia-smi's csv,noheader), UTC
    as the device machines keep it.  Rows that do not parse (a header, a '[N/A]', a row cut off
    when the logger was killed) are skipped; a log with no row at all is an error."""
    out = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        try:
            stamp = datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=timezone.utc)
            out.append(Sample(stamp.timestamp(), _number(parts[1]), _number(parts[2]), _number(parts[3])))
        except ValueError:
            continue
    if not out:
        raise ValueError("no nvidia-smi rows (timestamp, clocks.sm, power.draw, temperature.gpu) in the log")
    return out


def parse_phases(text: str) -> list[tuple[str, float]]:
    """'NAME EPOCH_SECONDS' per line, in time order."""
    phases = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        name, _, stamp = line.strip().rpartition(" ")
        try:
            phases.append((name or f"phase{n}", float(stamp)))
        except ValueError as err:
            raise ValueError(f"phases line {n}: expected 'NAME EPOCH_SECONDS', got {line!r}") from err
    return sorted(phases, key=lambda p: p[1])


def summarize(samples: list[Sample], phases: list[tuple[str, float]], busy_w: float) -> list[PhaseClocks]:
    """One row per phase (or one for the whole log without phases); samples before the first
    phase mark are left out."""
    if not phases:
        phases = [("all", samples[0].t)]
    rows = []
    for i, (name, start) in enumerate(phases):
        end = phases[i + 1][1] if i + 1 < len(phases) else float("inf")
        inside = [s for s in samples if start <= s.t < end]
        busy = [s for s in inside if s.power_w >= busy_w]
        clocks = sorted(s.sm_mhz for s in busy)
        rows.append(PhaseClocks(
            name, len(inside), len(busy),
            statistics.median(clocks) if clocks else None,
            clocks[len(clocks) // 10] if clocks else None,
            statistics.median(s.power_w for s in busy) if busy else None,
            max(s.temp_c for s in inside) if inside else None))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--phases", help="'NAME EPOCH_SECONDS' lines, one per phase start")
    ap.add_argument("--busy-w", type=float, default=300.0, help="samples below this power are idle (default 300 W)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        samples = parse_log(Path(args.log).read_text())
        phases = parse_phases(Path(args.phases).read_text()) if args.phases else []
    except (OSError, ValueError) as err:
        print(f"gpu_clocks: {err}", file=sys.stderr)
        return 2
    rows = summarize(samples, phases, args.busy_w)
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{'phase':<24} {'samples':>7} {'busy':>5} {'SM MHz med':>10} {'p10':>6} {'W med':>6} {'max C':>5}")
    for r in rows:
        print(f"{r.phase:<24} {r.samples:>7} {r.busy:>5} {fmt(r.sm_mhz_median, '.0f'):>10} "
              f"{fmt(r.sm_mhz_p10, '.0f'):>6} {fmt(r.power_w_median, '.0f'):>6} {fmt(r.temp_c_max, '.0f'):>5}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
