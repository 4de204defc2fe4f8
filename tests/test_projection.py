"""Whole-run projection from per-stage bench files (speedrun bench project)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from speedrun.cli import main
from speedrun.config import preset
from speedrun.errors import ConfigError
from speedrun.evidence.projection import project, stage_lengths


def _bench(stage: int, arms: dict[str, tuple[object, list[float]]]) -> dict:
    return {"stage": stage, "arms": [{"name": n, "config": cfg.to_dict(), "times_ms": t} for n, (cfg, t) in arms.items()]}


def _arms():
    base, cand = preset("record"), preset("candidate")
    return base, cand


def test_stage_lengths_follow_each_schedule():
    base, cand = _arms()
    assert stage_lengths(base) == [423, 424, 423, 15]
    assert stage_lengths(cand) == [423, 424, 423, 45]
    assert sum(stage_lengths(preset("tiny-record"))) == preset("tiny-record").train.steps


def test_projection_sums_steps_times_medians_per_arm(tmp_path):
    base, cand = _arms()
    rng = np.random.default_rng(0)
    noisy = lambda m: list(m + rng.normal(0, 1, 25))  # noqa: E731
    docs = [_bench(0, {"base": (base, [300.0] * 25), "cand": (cand, [400.0] * 25)}),
            _bench(1, {"base": (base, [500.0] * 25), "cand": (cand, [450.0] * 25)}),
            _bench(2, {"base": (base, noisy(650.0)), "cand": (cand, noisy(585.0))})]
    res = project([dict(d, _path=f"s{d['stage']}") for d in docs], n_boot=500)
    by = {a["name"]: a for a in res["arms"]}
    med_b, med_c = np.median(docs[2]["arms"][0]["times_ms"]), np.median(docs[2]["arms"][1]["times_ms"])
    want_b = (423 * 300 + 424 * 500 + (423 + 15) * med_b) / 1000
    want_c = (423 * 400 + 424 * 450 + (423 + 45) * med_c) / 1000
    assert by["base"]["seconds"] == pytest.approx(want_b) and by["cand"]["seconds"] == pytest.approx(want_c)
    assert by["cand"]["ratio"] == pytest.approx(want_c / want_b) and by["base"]["ratio"] == 1.0
    lo, hi = by["cand"]["ci"]
    assert lo <= want_c <= hi and hi - lo < 2  # only stage 2 is noisy: ~1 ms x 468 steps / sqrt(25)
    assert res["unbenched"] == {3: 2}  # the extension stage timed as stage 2
    assert [r["timed_as"] for r in by["cand"]["stages"]] == [0, 1, 2, 2]

    # the same through the CLI, with the files on disk
    paths = []
    for d in docs:
        p = tmp_path / f"bench_stage{d['stage']}.json"
        p.write_text(json.dumps(d))
        paths.append(str(p))
    out = tmp_path / "proj.json"
    assert main(["bench", "project", *paths, "--json", str(out), "--n-boot", "200"]) == 0
    saved = json.loads(out.read_text())
    assert saved["arms"][1]["seconds"] == pytest.approx(want_c)


def test_projection_refuses_incomplete_benches(tmp_path, capsys):
    base, cand = _arms()
    s0 = _bench(0, {"base": (base, [300.0] * 20), "cand": (cand, [400.0] * 20)})
    s2 = _bench(2, {"base": (base, [650.0] * 20), "cand": (cand, [590.0] * 20)})
    with pytest.raises(ConfigError, match="stage 1 .* has no bench"):
        project([dict(s0, _path="a"), dict(s2, _path="b")])
    s2_only_base = _bench(2, {"base": (base, [650.0] * 20)})
    with pytest.raises(ConfigError, match="no arm cand"):
        project([dict(s0, _path="a"), dict(s2_only_base, _path="b")])
    with pytest.raises(ConfigError, match="arm 'base' is benched twice at stage 0"):
        project([dict(s0, _path="a"), dict(s0, _path="b")])
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"nothing": 1}))
    assert main(["bench", "project", str(bad)]) == 2
    assert "not a 'speedrun bench step --json' file" in capsys.readouterr().err


def test_arm_filter_projects_the_named_arms_when_another_lacks_a_stage(tmp_path, capsys):
    base, cand = _arms()
    docs = [_bench(0, {"base": (base, [300.0] * 20), "cand": (cand, [400.0] * 20)}),
            _bench(1, {"base": (base, [500.0] * 20), "cand": (cand, [450.0] * 20)}),
            _bench(2, {"base": (base, [650.0] * 20)})]  # cand's stage 2 is missing
    docs = [dict(d, _path=f"s{d['stage']}") for d in docs]
    with pytest.raises(ConfigError, match="no arm cand"):
        project(docs)
    res = project(docs, n_boot=100, only=["base"])
    assert [a["name"] for a in res["arms"]] == ["base"]
    assert res["arms"][0]["seconds"] == pytest.approx((423 * 300 + 424 * 500 + 438 * 650) / 1000)
    # the order given sets the baseline
    both = [dict(d, _path=f"t{d['stage']}") for d in
            [_bench(s, {"base": (base, [100.0 * (s + 1)] * 20), "cand": (cand, [50.0 * (s + 1)] * 20)})
             for s in range(3)]]
    res = project(both, n_boot=100, only=["cand", "base"])
    assert [a["name"] for a in res["arms"]] == ["cand", "base"]
    assert res["arms"][1]["ratio"] > 1.0
    with pytest.raises(ConfigError, match="--arm nope: no bench file has such an arm"):
        project(docs, only=["nope"])
    paths = []
    for d in docs:
        p = tmp_path / f"s{d['stage']}.json"
        p.write_text(json.dumps({k: v for k, v in d.items() if k != "_path"}))
        paths.append(str(p))
    assert main(["bench", "project", *paths, "--n-boot", "100", "--arm", "base"]) == 0
    assert main(["bench", "project", *paths, "--arm", "nope"]) == 2
    assert "no bench file has such an arm" in capsys.readouterr().err


def test_arms_of_one_stage_may_come_from_separate_files():
    """Arms benched in separate processes at a stage (two arms' graphs not fitting one GPU) add
    up to that stage's arms, the same projection as one file holding both, flagged as not
    interleaved."""
    base, cand = _arms()
    s0 = _bench(0, {"base": (base, [300.0] * 20), "cand": (cand, [400.0] * 20)})
    s1 = _bench(1, {"base": (base, [500.0] * 20), "cand": (cand, [450.0] * 20)})
    s2_base, s2_cand = _bench(2, {"base": (base, [650.0] * 20)}), _bench(2, {"cand": (cand, [590.0] * 20)})
    together = _bench(2, {"base": (base, [650.0] * 20), "cand": (cand, [590.0] * 20)})
    split = project([dict(d, _path=str(i)) for i, d in enumerate([s0, s1, s2_base, s2_cand])], n_boot=100)
    joint = project([dict(d, _path=str(i)) for i, d in enumerate([s0, s1, together])], n_boot=100)
    assert [a["seconds"] for a in split["arms"]] == [a["seconds"] for a in joint["arms"]]
    assert split["separate_processes"] == [2] and joint["separate_processes"] == []
    from speedrun.evidence.projection import render

    assert "stage 2: arms benched in separate processes" in render(split)
    assert "separate processes" not in render(joint)


def test_configs_saved_by_older_versions_still_load():
    base, _ = _arms()
    d = base.to_dict()
    d["model"]["dc_keys"] = "band"  # a switch that no longer exists
    doc = _bench(0, {"base": (base, [1.0] * 20)})
    doc["arms"][0]["config"] = d
    with pytest.warns(RuntimeWarning, match="dc_keys"):
        with pytest.raises(ConfigError, match="stage 1"):
            project([dict(doc, _path="a")])


def test_projection_carries_the_world_and_refuses_to_mix_worlds(tmp_path, capsys):
    """Files of 'bench step --as-rank-of N' project an N-GPU run (the world is carried and
    printed); files of different worlds, simulated or real, are refused."""
    from speedrun.evidence.projection import render

    base, cand = _arms()

    def doc(stage, world=None, real=1):
        d = _bench(stage, {"base": (base, [300.0 + stage] * 20), "cand": (cand, [280.0 + stage] * 20)})
        d.update(world_size=real, simulated_world=world, _path=f"s{stage}-{world}-{real}")
        return d

    r8 = [doc(s, 8) for s in range(3)]
    res = project(r8, n_boot=100)
    assert (res["world_size"], res["simulated"]) == (8, True)
    assert res["world"] == "rank 0 of 8 simulated (collectives replaced by no-ops)"
    text = render(res)
    assert "a run on 8 GPUs, from rank 0 of 8 simulated" in text
    assert "rank 0 of 8 simulated (collectives replaced by no-ops)" in text
    assert project(r8, n_boot=100, as_rank_of=8)["arms"][0]["seconds"] == res["arms"][0]["seconds"]
    with pytest.raises(ConfigError, match="--as-rank-of 4: the files are from rank 0 of 8 simulated"):
        project(r8, as_rank_of=4)
    with pytest.raises(ConfigError, match="different worlds.*s1-4-1: rank 0 of 4 simulated"):
        project([r8[0], doc(1, 4), r8[2]])
    with pytest.raises(ConfigError, match="different worlds.*s2-None-8: 8 processes"):
        project([r8[0], r8[1], doc(2, None, 8)])  # a real 8-rank bench beside simulated ones
    one = project([doc(s) for s in range(3)], n_boot=100)
    assert (one["world_size"], one["simulated"]) == (1, False) and "benched on 1 process" in render(one)
    legacy = [dict(_bench(s, {"base": (base, [1.0] * 20)}), _path=str(s)) for s in range(3)]
    assert project(legacy, n_boot=100)["world_size"] == 1  # files from before the world was recorded

    paths = []
    for d in [r8[0], doc(1, 2), r8[2]]:
        p = tmp_path / f"{d['_path']}.json"
        p.write_text(json.dumps({k: v for k, v in d.items() if k != "_path"}))
        paths.append(str(p))
    assert main(["bench", "project", *paths]) == 2
    assert "rank 0 of 2 simulated" in capsys.readouterr().err


def _upstream_file(tmp_path, stage_times: list[list[float]], gpus=("NVIDIA H100 80GB HBM3",)) -> str:
    """A 'tools/upstream_step_times.py --json' file: per stage (schedule order) its step times."""
    names = ["stage1", "stage2", "stage3", "extension"]
    doc = {"stages": [{"stage": names[i], "times_ms": t, "measured": len(t)} for i, t in enumerate(stage_times)],
           "gpus": list(gpus)}
    p = tmp_path / "upstream_steps.json"
    p.write_text(json.dumps(doc))
    return str(p)


def test_upstream_joins_as_the_baseline_on_its_presets_schedule(tmp_path, capsys):
    """--upstream NAME=FILE:PRESET: upstream's stage times on the preset's step counts, first and
    the baseline of every ratio; its extension without timed steps is timed as its stage 3."""
    base, cand = _arms()
    docs = [_bench(0, {"base": (base, [240.0] * 20), "cand": (cand, [220.0] * 20)}),
            _bench(1, {"base": (base, [460.0] * 20), "cand": (cand, [420.0] * 20)}),
            _bench(2, {"base": (base, [690.0] * 20), "cand": (cand, [620.0] * 20)})]
    paths = []
    for d in docs:
        p = tmp_path / f"bench_stage{d['stage']}.json"
        p.write_text(json.dumps(d))
        paths.append(str(p))
    up = _upstream_file(tmp_path, [[247.0] * 13, [465.0] * 13, [681.0] * 13, []])
    out = tmp_path / "proj.json"
    assert main(["bench", "project", *paths, "--upstream", f"f411b3d={up}:record", "--json", str(out),
                 "--n-boot", "100"]) == 0
    res = json.loads(out.read_text())
    assert [a["name"] for a in res["arms"]] == ["f411b3d", "base", "cand"] and res["baseline"] == "f411b3d"
    want_up = (423 * 247 + 424 * 465 + 438 * 681) / 1000
    by = {a["name"]: a for a in res["arms"]}
    assert by["f411b3d"]["seconds"] == pytest.approx(want_up)
    want_c = (423 * 220 + 424 * 420 + 468 * 620) / 1000
    assert by["cand"]["ratio"] == pytest.approx(want_c / want_up)
    assert "f411b3d: upstream's own run" in capsys.readouterr().out

    from speedrun.evidence.projection import load_upstream

    loaded = [dict(d, _path=str(i)) for i, d in enumerate(docs)]
    with pytest.raises(ConfigError, match="NAME=FILE:PRESET"):
        load_upstream(up)
    with pytest.raises(ConfigError, match="unknown preset 'recrod'"):
        load_upstream(f"u={up}:recrod")
    with pytest.raises(ConfigError, match="no timed step at stage 1"):
        project(loaded, upstream=[load_upstream(f"u={_upstream_file(tmp_path, [[1.0], [], [1.0]])}:record")])
    with pytest.raises(ConfigError, match="name of a benched arm"):
        project(loaded, upstream=[load_upstream(f"base={up}:record")])
    two_gpus = _upstream_file(tmp_path, [[1.0], [1.0], [1.0]], gpus=("H100", "H100"))
    with pytest.raises(ConfigError, match="ran on 2 GPU"):
        project(loaded, upstream=[load_upstream(f"u={two_gpus}:record")])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"arms": []}))
    with pytest.raises(ConfigError, match="not a 'tools/upstream_step_times.py --json' file"):
        load_upstream(f"u={bad}:record")


def test_link_bandwidth_adds_the_simulated_collectives_as_an_upper_bound(tmp_path, capsys):
    """--link-gbps: each stage's bytes per step (as a simulated rank counted them) become ring
    time at the bus bandwidth, summed over each arm's own schedule on top of the compute-only
    total; refused for real ranks and for files without the counts."""
    from speedrun.evidence.projection import comm_ms, render

    base, cand = _arms()
    moved = {"all_reduce": 1e6, "reduce_scatter": 8e8, "all_gather": 8e8, "all_to_all": 2e6}
    # ring accounting on 8 ranks: 2*7/8 of the all-reduce, 7/8 of the rest, the all-to-all as sent
    want = (2 * 7 / 8 * 1e6 + 7 / 8 * 1.6e9 + 2e6) / 400e9 * 1e3
    assert comm_ms(moved, 8, 400.0) == pytest.approx(want)
    with pytest.raises(ConfigError, match="unknown collective kinds"):
        comm_ms({"broadcast": 1.0}, 8, 400.0)

    def doc(stage, world=8, counted=True):
        d = _bench(stage, {"base": (base, [30.0] * 20), "cand": (cand, [28.0] * 20)})
        for a in d["arms"]:
            if counted:
                a["comm_bytes_per_step"] = {k: v * (1 + stage) for k, v in moved.items()}
        d.update(world_size=1, simulated_world=world, _path=f"s{stage}")
        return d

    docs = [doc(s) for s in range(3)]
    res = project(docs, n_boot=100, link_gbps=400.0)
    b = res["arms"][0]
    assert [r["comm_ms"] for r in b["stages"]] == pytest.approx([want, 2 * want, 3 * want, 3 * want])
    assert b["comm_seconds"] == pytest.approx((423 * want + 424 * 2 * want + (423 + 15) * 3 * want) / 1000)
    assert b["seconds_with_comm"] == pytest.approx(b["seconds"] + b["comm_seconds"])
    assert res["arms"][1]["comm_seconds"] > b["comm_seconds"]  # the candidate's longer extension
    assert "at 400 GB/s bus bandwidth and none overlapped" in render(res)
    assert "link_gbps" in res and project(docs, n_boot=100)["link_gbps"] is None

    with pytest.raises(ConfigError, match="needs files from 'bench step --as-rank-of N'"):
        project([doc(s, world=None) for s in range(3)], link_gbps=400.0)
    with pytest.raises(ConfigError, match="has no comm_bytes_per_step"):
        project([doc(0), doc(1, counted=False), doc(2)], link_gbps=400.0)
    with pytest.raises(ConfigError, match="must be a bandwidth > 0"):
        project(docs, link_gbps=0.0)
    paths = []
    for d in docs:
        p = tmp_path / f"{d['_path']}.json"
        p.write_text(json.dumps({k: v for k, v in d.items() if k != "_path"}))
        paths.append(str(p))
    assert main(["bench", "project", *paths, "--as-rank-of", "8", "--n-boot", "100", "--link-gbps", "400"]) == 0
    assert "s of communication; stage 0" in capsys.readouterr().out


def test_projection_refuses_files_of_different_cards_or_torch_builds(tmp_path):
    """Like for like only: bench files and upstream runs that name different cards (or torch
    builds) are refused, each file's named; files that name none (older ones) join any; the
    projection carries and prints the one card and torch."""
    from speedrun.evidence.projection import load_upstream, render

    base, cand = _arms()

    def doc(stage, card="NVIDIA H100 80GB HBM3", torch_v="2.11.0+cu130"):
        d = _bench(stage, {"base": (base, [300.0] * 20), "cand": (cand, [280.0] * 20)})
        fp = {k: v for k, v in (("gpu_name", card), ("torch", torch_v)) if v}
        return dict(d, _path=f"s{stage}-{card}", **({"fingerprint": fp} if fp else {}))

    res = project([doc(0), doc(1), doc(2, card=None, torch_v=None)], n_boot=100)
    assert (res["card"], res["torch"]) == ("NVIDIA H100 80GB HBM3", "2.11.0+cu130")
    assert "card NVIDIA H100 80GB HBM3, torch 2.11.0+cu130" in render(res)
    with pytest.raises(ConfigError, match=r"different cards \(s0-NVIDIA H100 80GB HBM3: NVIDIA H100 80GB HBM3; "
                                          r"s1-NVIDIA H200: NVIDIA H200"):
        project([doc(0), doc(1, card="NVIDIA H200"), doc(2)])
    with pytest.raises(ConfigError, match="different torch builds"):
        project([doc(0), doc(1, torch_v="2.13.0+cu130"), doc(2)])
    h200 = load_upstream(f"u={_upstream_file(tmp_path, [[1.0], [1.0], [1.0]], gpus=('NVIDIA H200',))}:record")
    with pytest.raises(ConfigError, match=r"different cards.*upstream u \(.*\): NVIDIA H200"):
        project([doc(s) for s in range(3)], upstream=[h200])
    assert project([doc(s, card=None, torch_v=None) for s in range(3)], n_boot=10)["card"] is None
