"""Pull the Triton source of a profile's slowest Inductor kernels out of Inductor's cache.

A profile (``speedrun profile``) names kernels like ``triton_poi_fused_..._37``; to see why one is
slow (its loads, index arithmetic, block sizes) we need the code Inductor generated for it.  This
script reads ``profile.json``, takes the ``--top`` Inductor kernels by time, finds each one's
``def <name>(`` in the cache's generated modules and writes it, with its time and call count, to
``OUT/<name>.py``.  Run it on the GPU machine after the profile, in the same process environment
(``TORCHINDUCTOR_CACHE_DIR``), e.g.::

    python tools/inductor_sources.py /tmp/prof_record/profile.json --out "$OUT/inductor" --top 8
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import re
import sys
from pathlib import Path


def default_cache_dir() -> Path:
    env = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if env:
        return Path(env)
    return Path("/tmp") / f"torchinductor_{getpass.getuser()}"


def slowest_inductor_kernels(profile: dict, top: int) -> list[dict]:
    """The profile's ``top`` Inductor kernels (name starts with ``triton_``), slowest first."""
    rows = [k for k in profile.get("kernels", []) if k["kernel"].startswith("triton_")]
    return sorted(rows, key=lambda k: -k["time_us"])[:top]


def kernel_source(text: str, name: str) -> str | None:
    """The decorators and body of ``def name(`` in ``text`` (a generated module, where a kernel is
    either top-level code or inside a triple-quoted string), or None."""
    m = re.search(rf"^[ \t]*def {re.escape(name)}\(", text, flags=re.M)
    if m is None:
        return None
    # The decorators (Inductor's span several lines) sit between the previous blank line or the
    # string's opening quotes and the def.
    start = max(text.rfind("\n\n", 0, m.start()) + 2, text.rfind("'''", 0, m.start()) + 3, 0)
    end = text.find("'''", m.end())
    nxt = re.search(r"^(def |@triton|class )", text[m.end():], flags=re.M)
    stops = [e for e in (end if end >= 0 else None, m.end() + nxt.start() if nxt else None) if e is not None]
    return text[start:min(stops)] if stops else text[start:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profile", type=Path, help="profile.json written by `speedrun profile`")
    p.add_argument("--cache-dir", type=Path, default=None, help="Inductor cache (default: $TORCHINDUCTOR_CACHE_DIR "
                   "or /tmp/torchinductor_$USER)")
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    profile = json.loads(args.profile.read_text())
    cache = args.cache_dir or default_cache_dir()
    if not cache.is_dir():
        print(f"inductor_sources: no Inductor cache at {cache}", file=sys.stderr)
        return 2
    wanted = slowest_inductor_kernels(profile, args.top)
    steps = max(int(profile.get("steps", 1)), 1)
    files = sorted(cache.rglob("*.py"))
    args.out.mkdir(parents=True, exist_ok=True)
    found = 0
    for row in wanted:
        name = row["kernel"]
        for f in files:
            text = f.read_text(errors="replace")
            if name not in text:
                continue
            src = kernel_source(text, name)
            if src is None:
                continue
            header = (f"# {name}\n# {row['calls'] // steps} launches, {row['time_us'] / steps / 1e3:.3f} ms per step "
                      f"({row['time_us'] / max(row['calls'], 1):.1f} us per launch); from {f}\n")
            (args.out / f"{name[:150]}.py").write_text(header + src)
            found += 1
            print(f"{row['time_us'] / steps / 1e3:8.2f} ms/step  {name}")
            break
        else:
            print(f"  (source not found) {name}")
    print(f"{found} of {len(wanted)} kernel sources written to {args.out}")
    return 0 if found else 1


if __name__ == "__main__":
    raise SystemExit(main())
