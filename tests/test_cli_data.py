"""`speedrun data ...` through a real subprocess: exit codes, one-line errors, no tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from speedrun.data.shards import read_shard, write_shard


def _run(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "speedrun", "data", *args], capture_output=True, text=True,
                          env=e, cwd=cwd, timeout=120)


def _one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("speedrun data: error: "), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_tokenize_inspect_and_strict(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    for i in range(12):
        (src / f"doc{i}.md").write_text(f"Paragraph {i} about shards.\n" * 5)
    (src / "latin1.txt").write_bytes(b"na\xefve text")
    r = _run("tokenize", str(src), "--out", str(tmp_path / "out"), "--tokenizer", "bytes",
             "--val-fraction", "0.25", "--workers", "2", "--prefix", "t")
    assert r.returncode == 0, r.stderr
    assert "skipped 1 file(s)" in r.stdout and "latin1.txt" in r.stdout
    train = tmp_path / "out" / "t_train_000000.bin"
    toks = read_shard(train, vocab_size=257)
    assert toks[0] == 256

    r = _run("inspect", str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert "documents" in r.stdout and "p50" in r.stdout and "Paragraph" in r.stdout

    r = _run("tokenize", str(src), "--out", str(tmp_path / "strict"), "--tokenizer", "bytes", "--strict")
    _one_line_error(r, "latin1.txt", "UTF-8")
    assert not list((tmp_path / "strict").glob("*_train_*.bin"))


def test_bad_shard_is_one_line(tmp_path):
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x00" * 100)
    _one_line_error(_run("inspect", str(bad)), "bad.bin", "short header")
    good = write_shard(tmp_path / "ok.bin", np.array([256, 1, 2]))
    with open(good, "ab") as f:
        f.write(b"\x01")
    _one_line_error(_run("inspect", str(good)), "ok.bin", "trailing bytes")
    _one_line_error(_run("inspect", str(tmp_path / "missing.bin")), "missing.bin", "does not exist")


def test_fineweb_offline(tmp_path):
    r = _run("fineweb", "--train-shards", "1", "--out", str(tmp_path / "fw"), env={"HF_HUB_OFFLINE": "1"})
    _one_line_error(r, "HF_HUB_OFFLINE", "--data", "speedrun data tokenize")


def test_help_has_examples():
    for sub in ("tokenize", "fineweb", "inspect"):
        r = _run(sub, "--help")
        assert r.returncode == 0 and "examples:" in r.stdout
