"""Log parsing: our format, upstream modded-nanogpt logs, truncated and foreign files."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from speedrun.errors import DataError
from speedrun.evidence.logparse import expand, load_group, parse_log, parse_text

DATA = Path(__file__).parent / "data"
RECORD = "2026-07-17_FP8DownProjection"


def test_our_log_fields():
    r = parse_log(DATA / "ours_seed7.txt", label="x")
    assert r.complete and r.usable
    assert (r.final_step, r.total_steps) == (30, 30)
    assert r.val_loss == pytest.approx(3.2712)
    # The source-code preamble holds f-string templates and "seed: {seed}"; none may be parsed.
    assert [s for s, _, _ in r.val_curve] == [0, 10, 20, 30]
    assert r.seed == 7
    assert r.python_version == "3.12.3"
    assert (r.torch_version, r.cuda_version, r.triton_version) == ("2.11.0+cu130", "13.0", "3.6.0")
    assert r.gpus == ["NVIDIA H200"]
    assert (r.peak_allocated_mib, r.peak_reserved_mib) == (1200, 1536)
    assert r.label == "x" and r.name == "ours_seed7.txt"
    # run time is the train_time of the last val line, which equals the last step line here
    assert r.train_time_ms == r.step_times[-1][1]
    assert r.train_time_s == pytest.approx(r.train_time_ms / 1000)
    durations = r.step_durations_ms()
    assert len(durations) == 29  # 30 step lines -> 29 consecutive deltas
    assert all(10 <= ms <= 14 for _, ms in durations)  # 12 ms steps, logged in whole ms


def test_truncated_log_is_incomplete_and_excluded(tmp_path):
    r = parse_log(DATA / "truncated.txt")
    assert not r.complete and not r.usable
    assert r.final_step == 20 and r.total_steps == 30
    assert any("incomplete" in p for p in r.problems)
    for f in ("ours_seed7.txt", "truncated.txt"):
        shutil.copy(DATA / f, tmp_path / f)
    runs, warnings = load_group(tmp_path)
    assert len(runs) == 2
    assert [r.usable for r in runs] == [True, False]
    assert any("truncated.txt" in w and "excluded" in w for w in warnings)


def test_log_without_any_val_line():
    text = "step:1/10 train_time:5ms step_avg:5.00ms\nstep:2/10 train_time:10ms step_avg:5.00ms\n"
    r = parse_text(text)
    assert not r.complete and r.val_loss is None
    assert "no validation line" in r.problems[0]


def test_nan_final_loss_not_usable():
    r = parse_text("step:10/10 val_loss:nan train_time:50ms step_avg:5.00ms\n")
    assert r.complete and not r.usable
    assert r.to_dict()["val_loss"] is None  # JSON-safe


def test_seed_forms():
    line = "step:1/1 val_loss:3.0000 train_time:5ms step_avg:5.00ms\n"
    assert parse_text("config train.seed: 42 steps: 1\n" + line).seed == 42
    assert parse_text('{"seed": 42}\nseed=3\n' + line).seed is None  # only "seed: N" counts
    r = parse_text("seed: 1\nseed: 2\n" + line)
    assert r.seed is None and "several seeds" in r.problems[0]


def test_foreign_text_raises_clear_error():
    with pytest.raises(DataError, match="not a speedrun log"):
        parse_log(DATA / "foreign.txt")


def test_foreign_file_skipped_in_folder_but_error_when_named(tmp_path):
    shutil.copy(DATA / "foreign.txt", tmp_path / "notes.txt")
    shutil.copy(DATA / "ours_seed7.txt", tmp_path / "run.log")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")  # not a log suffix: ignored silently
    runs, warnings = load_group(str(tmp_path))
    assert [r.name for r in runs] == ["run.log"]
    assert any("skipped" in w and "notes.txt" in w for w in warnings)
    with pytest.raises(DataError, match="not a speedrun log"):
        load_group(str(tmp_path / "notes.txt"))


def test_folder_of_only_foreign_files_is_an_error(tmp_path):
    shutil.copy(DATA / "foreign.txt", tmp_path / "a.txt")
    with pytest.raises(DataError, match="no speedrun logs"):
        load_group(tmp_path)


def test_expand_glob_and_missing(tmp_path):
    for name in ("a.txt", "b.txt", "c.log"):
        shutil.copy(DATA / "ours_seed7.txt", tmp_path / name)
    assert [p.name for p in expand(str(tmp_path / "*.txt"))] == ["a.txt", "b.txt"]
    assert len(expand(tmp_path)) == 3
    with pytest.raises(DataError, match="no such file"):
        expand(tmp_path / "nothing-*.txt")


def test_unreadable_path():
    with pytest.raises(DataError):
        parse_log("/nonexistent/speedrun/log.txt")


def test_upstream_logs_parse(upstream_logs_dir):
    base = upstream_logs_dir / RECORD / "baseline"
    runs, warnings = load_group(base)
    assert len(runs) == 13 and all(r.usable for r in runs) and warnings == []
    r = {r.name: r for r in runs}["1d7c6c03-846f-4dc8-9809-dcb1e42496da.txt"]
    assert (r.final_step, r.total_steps) == (1390, 1390)
    assert r.val_loss == pytest.approx(3.2821)
    assert r.train_time_ms == 80694
    assert r.gpus == ["NVIDIA H100 80GB HBM3"] * 8
    assert (r.torch_version, r.cuda_version, r.triton_version) == ("2.10.0+cu128", "12.8", "3.6.0")
    assert r.python_version == "3.12.3" and r.driver_version == "580.159.04"
    assert r.seed is None
    assert r.peak_allocated_mib is not None and r.peak_reserved_mib >= r.peak_allocated_mib
    assert [s for s, _, _ in r.val_curve][::2] == [0, 500, 1000, 1390]
    assert len(r.step_times) == 1390


def test_upstream_log_cut_midway_is_incomplete(upstream_logs_dir, tmp_path):
    src = sorted((upstream_logs_dir / RECORD / "this_pr").glob("*.txt"))[0]
    lines = src.read_text().splitlines()
    cut = next(i for i, line in enumerate(lines) if line.startswith("step:1300/"))
    (tmp_path / "cut.txt").write_text("\n".join(lines[:cut]) + "\n")
    r = parse_log(tmp_path / "cut.txt")
    assert not r.complete and r.final_step == 1250 and r.total_steps == 1390
