"""Statistics: checked against scipy directly and against an upstream record's published figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from scipy import stats as sps

from speedrun.cli import main
from speedrun.evidence.logparse import load_group, parse_log
from speedrun.evidence.stats import analyze, describe, one_sample_less, pseudo_replication, render_markdown, welch

DATA = Path(__file__).parent / "data"
RECORD = "2026-07-17_FP8DownProjection"


def test_describe_matches_numpy():
    v = np.random.default_rng(1).normal(3.28, 0.002, size=11)
    d = describe(v)
    assert d["n"] == 11
    assert d["mean"] == pytest.approx(v.mean(), rel=1e-12)
    assert d["std"] == pytest.approx(v.std(ddof=1), rel=1e-12)
    assert d["median"] == pytest.approx(np.median(v))
    assert (d["min"], d["max"]) == (v.min(), v.max())
    assert describe([1.0])["std"] is None and describe([])["mean"] is None


def test_one_sample_matches_scipy():
    v = np.random.default_rng(2).normal(3.279, 0.002, size=9)
    got = one_sample_less(v, 3.28)
    ref = sps.ttest_1samp(v, 3.28, alternative="less")
    assert got["p"] == pytest.approx(ref.pvalue, rel=1e-12)
    assert got["t"] == pytest.approx(ref.statistic, rel=1e-12)
    assert got["df"] == 8
    assert one_sample_less([3.27], 3.28)["p"] is None


def test_welch_matches_scipy_and_direction():
    rng = np.random.default_rng(3)
    a, b = rng.normal(80.0, 0.1, 10), rng.normal(79.0, 0.3, 7)  # B faster
    got = welch(a, b)
    for key, alt in (("p_two_sided", "two-sided"), ("p_less", "less"), ("p_greater", "greater")):
        assert got[key] == pytest.approx(sps.ttest_ind(b, a, equal_var=False, alternative=alt).pvalue, rel=1e-12)
    assert got["t"] < 0 and got["p_less"] < 1e-3 < 0.99 < got["p_greater"]
    assert welch([1.0], [1.0, 2.0])["p_less"] is None


def test_pseudo_replication_same_seed_and_identical_curves(tmp_path):
    shutil.copy(DATA / "ours_seed7.txt", tmp_path / "a.txt")
    shutil.copy(DATA / "ours_seed7.txt", tmp_path / "b.txt")
    runs = [parse_log(tmp_path / "a.txt"), parse_log(tmp_path / "b.txt")]
    w = pseudo_replication({"g": runs})
    assert any("seed 7" in x and "of g" in x for x in w)
    assert any("identical val-loss" in x for x in w)
    # The same run in two groups: no seed warning (paired seeds are fine), but the curve repeats.
    w = pseudo_replication({"a": runs[:1], "b": runs[1:]})
    assert not any("seed" in x for x in w) and any("identical val-loss" in x for x in w)
    runs[1].seed = 8
    runs[1].val_curve = [(s, loss + 1e-4, t) for s, loss, t in runs[1].val_curve]
    assert pseudo_replication({"g": runs}) == []


def _upstream(upstream_logs_dir):
    d = upstream_logs_dir / RECORD
    a, wa = load_group(d / "baseline", "baseline")
    b, wb = load_group(d / "this_pr", "this_pr")
    return analyze({"baseline": a, "this_pr": b}, target=3.28, reference_time=73.897, warnings=wa + wb)


# Published in records/track_1_short/2026-07-17_FP8DownProjection/{this_pr,baseline}/statistics.md
PUBLISHED = {
    "this_pr": dict(mean=3.2783692308, std=0.0014156180, p=0.0006690604, t_mean=79.684923, t_std=0.182767,
                    t_median=79.653, t_min=79.532, t_max=80.231,
                    times=[79.536, 79.740, 79.814, 79.658, 79.593, 79.629, 80.231, 79.653, 79.641, 79.532,
                           79.539, 79.682, 79.656]),
    "baseline": dict(mean=3.2782461538, std=0.0020164389, p=0.0042976481, t_mean=80.728615, t_std=0.065165,
                     t_median=80.720, t_min=80.610, t_max=80.840,
                     times=[80.610, 80.710, 80.678, 80.720, 80.747, 80.693, 80.659, 80.694, 80.763, 80.795,
                            80.818, 80.840, 80.745]),
}


def test_upstream_published_figures(upstream_logs_dir):
    res = _upstream(upstream_logs_dir)
    assert [w for w in res["warnings"]] == []
    for arm, pub in PUBLISHED.items():
        g = res["groups"][arm]
        assert g["n"] == 13 and g["steps"] == 1390
        assert sorted(g["times_s"]) == pytest.approx(sorted(pub["times"]), abs=1e-9)
        assert g["loss"]["mean"] == pytest.approx(pub["mean"], abs=1e-10)
        assert g["loss"]["std"] == pytest.approx(pub["std"], abs=1e-10)
        assert g["loss_test"]["p"] == pytest.approx(pub["p"], abs=1e-10)
        t = g["time_s"]
        assert t["mean"] == pytest.approx(pub["t_mean"], abs=1e-6)
        assert t["std"] == pytest.approx(pub["t_std"], abs=1e-6)
        assert (t["median"], t["min"], t["max"]) == pytest.approx((pub["t_median"], pub["t_min"], pub["t_max"]))
        assert g["environment"]["gpus"] == ["8x NVIDIA H100 80GB HBM3"]
    c = res["comparison"]
    assert (c["a"], c["b"]) == ("baseline", "this_pr")
    assert c["speedup"] == pytest.approx(1.01309774, abs=1e-8)
    assert c["delta_time_s"] == pytest.approx(-1.043692, abs=1e-6)
    assert c["delta_loss"] == pytest.approx(0.0001230769, abs=1e-10)
    assert c["projected_time_s"] == pytest.approx(c["ratio"] * 73.897)
    assert c["welch_loss"]["p_two_sided"] == pytest.approx(0.8587465, abs=1e-7)
    # statistics.md prints |t| = 19.394 and "p = 4.9e-12" for time: that is the TWO-sided Welch p;
    # the one-sided p (candidate faster) is half of it.
    wt = c["welch_time"]
    assert wt["t"] == pytest.approx(-19.394, abs=1e-3)
    assert wt["p_two_sided"] == pytest.approx(4.9e-12, rel=0.01)
    assert wt["p_less"] == pytest.approx(wt["p_two_sided"] / 2, rel=1e-9)
    assert (c["slowest_b_s"], c["fastest_a_s"]) == (80.231, 80.610)
    md = render_markdown(res)
    assert "3.27837" in md and "6.69e-04" in md and "79.685" in md and "4.91e-12" in md


def test_cli_stats_two_groups_json(upstream_logs_dir, tmp_path, capsys):
    d = upstream_logs_dir / RECORD
    out = tmp_path / "s.json"
    rc = main(["stats", str(d / "baseline"), str(d / "this_pr"), "--labels", "A,B", "--json", str(out)])
    assert rc == 0
    assert "**B vs A**" in capsys.readouterr().out
    j = json.loads(out.read_text())
    assert j["groups"]["B"]["loss_test"]["p"] == pytest.approx(
        sps.ttest_1samp(j["groups"]["B"]["losses"], 3.28, alternative="less").pvalue
    )
    assert len(j["runs"]["A"]) == 13


def test_cli_stats_errors(tmp_path, capsys):
    log = str(DATA / "ours_seed7.txt")
    assert main(["stats", log, log, "--labels", "only-one"]) == 2
    assert "--labels" in capsys.readouterr().err
    assert main(["stats", str(DATA / "foreign.txt")]) == 2
    assert "not a speedrun log" in capsys.readouterr().err


def test_cli_stats_single_group_small(tmp_path, capsys):
    for f in ("ours_seed7.txt", "truncated.txt"):
        shutil.copy(DATA / f, tmp_path / f)
    assert main(["stats", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 1 | 30 | 3.27120 |" in out  # one usable run of 30 steps
    assert "excluded" in out and "tests need at least 2" in out
