"""The GPU test suite (``pytest -m gpu``) at one commit, in parts that each fit one device call,
and the suite's summary from the parts' JUnit files.

A device call lasts at most ten minutes and the whole suite takes longer on one GPU, so it runs in
three parts, each with pytest-xdist workers sharing the GPU (the tests are correctness tests:
sharing slows them, it does not change what they check):

- ``kernels``: the kernel, attention, launch, host and logging tests (many small files; workers
  take whole files);
- ``graphs``: ``test_graphs_gpu.py`` (the compiled graph-vs-eager variants take minutes each;
  workers take single tests);
- ``runs``: training, fault, rank-of-N and fused-attention tests (workers take single tests).

On the GPU machine, repo root, ``.carry`` and ``.whl`` carried (fa4's tests need FA4 installed by
``tools/fa4_carry.sh``; without it they skip)::

    python3 tools/gpu_suite.py run kernels|graphs|runs     # -> $OUT/gpu_suite_<part>.{xml,txt}

Here, from the folder the parts' outputs were copied to::

    python tools/gpu_suite.py summary gpu_suite_*.xml     # per file: passed, failed, skipped, s

``summary`` refuses parts from different commits (each part records the commit and whether the
tree differed from it) and lists every file of ``tests/gpu`` that no part ran.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = "tests/gpu"

# part -> (test files, xdist distribution, workers, seconds the part may take)
PARTS: dict[str, tuple[tuple[str, ...], str, int, int]] = {
    "kernels": (("test_attention_gpu.py", "test_cross_entropy_gpu.py", "test_dc_gpu.py", "test_fused_adam_gpu.py",
                 "test_host_gpu.py", "test_launch_gpu.py", "test_mlp_gpu.py", "test_polar_express_gpu.py",
                 "test_qk_prep_gpu.py", "test_qkv_pack_gpu.py", "test_row_accumulate_gpu.py",
                 "test_steplog_gpu.py"), "loadfile", 4, 540),
    "graphs": (("test_graphs_gpu.py",), "load", 4, 540),
    "runs": (("test_train_gpu.py", "test_faults_gpu.py", "test_rank_of_n_gpu.py", "test_attention_fused_gpu.py"),
             "load", 4, 540),
}


def gpu_test_files(root: Path = ROOT) -> set[str]:
    """Every GPU test file's name."""
    return {p.name for p in (root / GPU_TESTS).glob("test_*.py")}


def _tree_state(root: Path) -> str:
    """The commit the tree is at, ``+dirty`` when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def run_part(part: str, out: Path) -> int:
    """Run one part through ``tools/device_run.sh tests`` (data, wheels and FA4's site set up there)."""
    files, dist, workers, seconds = PARTS[part]
    out.mkdir(parents=True, exist_ok=True)
    xml = out / f"gpu_suite_{part}.xml"
    state = _tree_state(ROOT)
    args = (f"-n {workers} --dist {dist} --timeout=400 --junitxml={xml} "
            f"-o junit_suite_name=gpu_suite:{part}:{state} -o junit_family=xunit1")
    env = dict(os.environ, OUT=str(out), BUDGET_S=str(seconds + 20), TESTS_S=str(seconds), TESTS_ARGS=args,
               TESTS_PATHS=" ".join(f"{GPU_TESTS}/{f}" for f in files))
    env.pop("TESTS_K", None)
    rc = subprocess.run(["bash", str(ROOT / "tools" / "device_run.sh"), "tests"], cwd=ROOT, env=env).returncode
    log = out / "gpu_tests.txt"
    if log.exists():
        log.replace(out / f"gpu_suite_{part}.txt")
    return rc


def read_part(path: Path) -> tuple[str, str, list[dict]]:
    """(part, tree state, test cases) from one part's JUnit file."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise SystemExit(f"{path}: not a JUnit file pytest wrote ({e}); was the part cut before it ended?")
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    cases = []
    name = ""
    for suite in suites:
        name = suite.get("name", name)
        for case in suite.iter("testcase"):
            outcome, message = "passed", ""
            for tag, name_of in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
                child = case.find(tag)
                if child is not None:
                    outcome, message = name_of, (child.get("message") or "").split("\n")[0][:160]
                    break
            file = (case.get("file") or case.get("classname", "").replace(".", "/") + ".py").split("/")[-1]
            cases.append({"file": file, "name": case.get("name", ""), "outcome": outcome,
                          "seconds": float(case.get("time") or 0.0), "message": message})
    fields = name.split(":")
    if len(fields) != 3 or fields[0] != "gpu_suite":
        raise SystemExit(f"{path}: its suite name {name!r} is not 'gpu_suite:<part>:<commit>' "
                         "(write it with `tools/gpu_suite.py run`)")
    return fields[1], fields[2], cases


def summarize(paths: list[Path], all_files: set[str]) -> str:
    """The suite's table, refusing parts of different trees."""
    parts = [read_part(p) for p in paths]
    states = {state for _, state, _ in parts}
    if len(states) != 1:
        raise SystemExit("the parts ran at different trees: "
                         + ", ".join(f"{part} at {state}" for part, state, _ in parts))
    counts: dict[str, Counter] = defaultdict(Counter)  # file -> outcome counts and test seconds
    part_of: dict[str, str] = {}
    problems = []
    for part, _, cases in parts:
        for c in cases:
            counts[c["file"]][c["outcome"]] += 1
            counts[c["file"]]["seconds"] += c["seconds"]
            part_of[c["file"]] = part
            if c["outcome"] in ("failed", "error"):
                problems.append(f"- {c['outcome'].upper()} {c['file']}::{c['name']}: {c['message']}")
    lines = [f"GPU suite at {states.pop()}: {', '.join(sorted(p for p, _, _ in parts))}", "",
             "| file | part | passed | failed | errors | skipped | test s |", "|---|---|---:|---:|---:|---:|---:|"]

    def row(label: str, part: str, c: Counter) -> str:
        return (f"| {label} | {part} | {c['passed']} | {c['failed']} | {c['error']} | {c['skipped']} | "
                f"{c['seconds']:.0f} |")

    lines += [row(f, part_of[f], counts[f]) for f in sorted(counts)]
    lines.append(row("**all**", "", sum(counts.values(), Counter())))
    not_run = sorted(all_files - set(counts))
    lines += ["", "Not run by any part: " + (", ".join(not_run) if not_run else "none")]
    if problems:
        lines += ["", "Failures and errors:", *problems]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one part on the GPU machine")
    run.add_argument("part", choices=sorted(PARTS))
    run.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench_out")))
    summary = sub.add_parser("summary", help="the suite's table from the parts' JUnit files")
    summary.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args(argv)
    if args.command == "run":
        return run_part(args.part, args.out)
    print(summarize(args.files, gpu_test_files()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
