"""Records folder: logs copied, results.json numbers equal scipy's, README tables, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from matplotlib import image as mpimg
from scipy import stats as sps

from speedrun.evidence.logparse import load_group, parse_log
from speedrun.evidence.records import write_records

DATA = Path(__file__).parent / "data"
RECORD = "2026-07-17_FP8DownProjection"


def make_log(path: Path, seed: int, final_loss: float, step_ms: float, total: int = 40,
             truncate_at: int | None = None) -> Path:
    """Write a synthetic log in our format: per-step lines every step, validation every 10."""
    rng = np.random.default_rng(seed)
    lines = ["Running PyTorch 2.11.0+cu130 compiled for CUDA 13.0", "gpu: NVIDIA H200", f"seed: {seed}",
             f"step:0/{total} val_loss:10.8000 train_time:0ms step_avg:0.01ms"]
    t = 0.0
    for s in range(1, (truncate_at or total) + 1):
        t += step_ms * (1 + 0.02 * rng.standard_normal())
        lines.append(f"step:{s}/{total} train_time:{t:.0f}ms step_avg:{t / s:.2f}ms")
        if s % 10 == 0:
            loss = final_loss + (total - s) * 0.05 + 0.001 * rng.standard_normal()
            lines.append(f"step:{s}/{total} val_loss:{loss:.4f} train_time:{t:.0f}ms step_avg:{t / s:.2f}ms")
    if truncate_at is None:
        lines.append("peak memory allocated: 1000 MiB reserved: 1200 MiB")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def two_arms(tmp_path):
    src = tmp_path / "src"
    runs = []
    for i in range(4):
        runs.append(parse_log(make_log(src / "a" / f"log{i}.txt", 100 + i, 3.277 + 0.001 * i, 50.0), "base"))
    for i in range(5):
        runs.append(parse_log(make_log(src / "b" / f"log{i}.txt", 200 + i, 3.2775 + 0.0008 * i, 47.0), "cand"))
    runs.append(parse_log(make_log(src / "b" / "dead.txt", 299, 3.28, 47.0, truncate_at=25), "cand"))
    return runs


FP_BEFORE = {"hostname": "h", "gpu_name": "NVIDIA H200", "matmul_bf16_tflops": 700.0, "copy_tbps": 4.0}
FP_AFTER = {"hostname": "h", "gpu_name": "NVIDIA H200", "matmul_bf16_tflops": 640.0, "copy_tbps": 4.0}


def test_write_records_files_numbers_plots(two_arms, tmp_path):
    out = write_records(tmp_path / "rec", two_arms, FP_BEFORE, FP_AFTER, target=3.28, reference_time=73.897)
    assert out == tmp_path / "rec"
    for f in ("README.md", "results.json", "val_loss_vs_step.png", "val_loss_vs_time.png", "step_time.png"):
        assert (out / f).is_file(), f
    for f in ("val_loss_vs_step.png", "val_loss_vs_time.png", "step_time.png"):
        img = mpimg.imread(out / f)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300
        assert img[..., :3].std() > 0.01  # something was drawn
    assert len(list((out / "logs" / "base").glob("*.txt"))) == 4
    assert len(list((out / "logs" / "cand").glob("*.txt"))) == 6  # the incomplete log is kept too

    j = json.loads((out / "results.json").read_text())
    a_runs = [r for r in two_arms if r.label == "base"]
    b_runs = [r for r in two_arms if r.label == "cand" and r.usable]
    la, lb = [r.val_loss for r in a_runs], [r.val_loss for r in b_runs]
    ta, tb = [r.train_time_s for r in a_runs], [r.train_time_s for r in b_runs]
    ga, gb = j["groups"]["base"], j["groups"]["cand"]
    assert (ga["n"], gb["n"], gb["n_excluded"]) == (4, 5, 1)
    assert ga["steps"] == 40
    assert gb["loss"]["mean"] == pytest.approx(np.mean(lb), rel=1e-12)
    assert gb["loss"]["std"] == pytest.approx(np.std(lb, ddof=1), rel=1e-12)
    assert gb["loss_test"]["p"] == pytest.approx(sps.ttest_1samp(lb, 3.28, alternative="less").pvalue, rel=1e-12)
    assert ga["time_s"]["median"] == pytest.approx(np.median(ta))
    assert (ga["time_s"]["min"], ga["time_s"]["max"]) == (min(ta), max(ta))
    c = j["comparison"]
    assert c["ratio"] == pytest.approx(np.mean(tb) / np.mean(ta), rel=1e-12)
    assert c["projected_time_s"] == pytest.approx(np.mean(tb) / np.mean(ta) * 73.897, rel=1e-12)
    assert c["welch_time"]["p_less"] == pytest.approx(
        sps.ttest_ind(tb, ta, equal_var=False, alternative="less").pvalue, rel=1e-12)
    assert c["welch_loss"]["p_two_sided"] == pytest.approx(
        sps.ttest_ind(lb, la, equal_var=False).pvalue, rel=1e-12)
    assert j["fingerprint_before"]["matmul_bf16_tflops"] == 700.0
    assert any("node slowed" in w for w in j["warnings"])
    assert any("dead.txt" in w for w in j["warnings"])
    logs = {r["name"]: r["log"] for r in j["runs"]}
    assert (out / logs["dead.txt"]).is_file()

    readme = (out / "README.md").read_text()
    assert "# Records: cand vs base" in readme
    assert f"{gb['loss']['mean']:.5f}" in readme
    assert "![step_time](step_time.png)" in readme
    assert "| matmul_bf16_tflops | 700 | 640 |" in readme
    assert "(incomplete)" in readme


def test_write_records_keeps_logs_already_inside(tmp_path):
    out = tmp_path / "rec"
    runs = [parse_log(make_log(out / "logs" / "x" / f"{i}.txt", i, 3.27, 20.0), "x") for i in range(3)]
    write_records(out, runs, {}, {})
    assert sorted(p.name for p in (out / "logs" / "x").iterdir()) == ["0.txt", "1.txt", "2.txt"]
    j = json.loads((out / "results.json").read_text())
    assert "comparison" not in j and j["groups"]["x"]["n"] == 3
    assert [r["log"] for r in j["runs"]] == [f"logs/x/{i}.txt" for i in range(3)]


def test_write_records_rejects_empty(tmp_path):
    with pytest.raises(ValueError):
        write_records(tmp_path, [], {}, {})


def test_matplotlib_imported_only_when_plotting():
    from speedrun.evidence import plots, records

    for mod in (plots, records):
        assert not any(getattr(v, "__name__", "").startswith("matplotlib") for v in vars(mod).values())


def test_records_from_upstream_logs(upstream_logs_dir, tmp_path):
    d = upstream_logs_dir / RECORD
    a, _ = load_group(sorted((d / "baseline").glob("*.txt"))[:2], "baseline")
    b, _ = load_group(sorted((d / "this_pr").glob("*.txt"))[:2], "this_pr")
    out = write_records(tmp_path / "rec", a + b, {}, {}, reference_time=73.897)
    j = json.loads((out / "results.json").read_text())
    assert j["groups"]["baseline"]["n"] == 2 and j["groups"]["this_pr"]["steps"] == 1390
    assert mpimg.imread(out / "step_time.png").shape[0] > 200
