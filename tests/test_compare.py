"""speedrun compare on the CPU: a killed compare resumes, counts each run once, writes records."""

import json

import pytest

from speedrun.errors import ConfigError
from speedrun.evidence.arms import parse_arms
from speedrun.evidence.compare import MANIFEST, make_plan, make_seeds, run_compare


pytestmark = pytest.mark.usefixtures("use_builtin_cache", "one_thread")

COMMON = [
    "model.num_layers=1", "model.model_dim=64", "model.num_heads=2", "model.qk_head_dim=16", "model.v_head_dim=32",
    "train.batch_tokens=1024", "train.max_seq_len=128", "train.steps=4", "train.val_every=2",
    "train.val_tokens=1024", "train.log_every=1", "train.sample_tokens=0", "train.checkpoint_every=2",
    "train.lr_warmup_steps=1",
]


def _fp(measure):
    return {"gpu_name": None, "matmul_bf16_tflops": None, "measured": measure}


def test_seeds_and_plan_are_paired_and_interleaved():
    assert make_seeds(3, 10) == [10, 11, 12]
    assert make_seeds([5, 1]) == [5, 1]
    with pytest.raises(ConfigError):
        make_seeds([1, 1])
    plan = make_plan(["a", "b"], [0, 1])
    assert [(e["arm"], e["seed"]) for e in plan] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]


def test_killed_compare_resumes_and_counts_every_run_once(tmp_path):
    arms = parse_arms(["base=tiny", "cand=tiny:train.lr=1e-3,train.embed_lr=1e-3"])
    out = tmp_path / "rec"
    kw = dict(seeds=2, base_seed=7, common=COMMON, target=3.28, reference_time=100.0, measure=False,
              console=False, fingerprint=_fp)

    # 1) one run finishes, the second is killed right after its step-2 checkpoint.
    r = run_compare(arms, out, stop_after_runs=1, kill_at_step=2, **kw)
    assert not r.complete
    m = json.loads((out / MANIFEST).read_text())
    assert [e["status"] for e in m["plan"]] == ["done", "running", "pending", "pending"]

    # 2) restart: the killed run resumes from its checkpoint; stop after it.
    r = run_compare(arms, out, stop_after_runs=1, **kw)
    m = json.loads((out / MANIFEST).read_text())
    assert [e["status"] for e in m["plan"]] == ["done", "done", "pending", "pending"]
    assert m["plan"][1]["resumed"] == 1 and m["plan"][1]["attempt"] == 1

    # 3) simulate a kill of the third run before its first checkpoint.
    third = out / "runs" / "base-seed8-try1"
    third.mkdir(parents=True)
    (third / "config.json").write_text("{}")
    m["plan"][2].update(status="running", run_dir=str(third), attempt=1)
    (out / MANIFEST).write_text(json.dumps(m))

    # A restart with other arms must not mix into this folder.
    with pytest.raises(ConfigError, match="different arms"):
        run_compare(parse_arms(["base=tiny"]), out, **kw)

    r = run_compare(arms, out, **kw)
    assert r.complete and r.records_dir == out
    m = json.loads((out / MANIFEST).read_text())
    plan = m["plan"]
    assert all(e["status"] == "done" for e in plan)
    assert [(e["arm"], e["seed"]) for e in plan] == [("base", 7), ("cand", 7), ("base", 8), ("cand", 8)]
    assert plan[2]["abandoned"] == [str(third)] and (third / "ABANDONED").exists()
    assert plan[2]["run_dir"].endswith("base-seed8-try2")
    assert [f["when"] for f in m["fingerprints"]] == ["before", "after"]

    res = json.loads((out / "results.json").read_text())
    assert res["groups"]["base"]["n"] == 2 and res["groups"]["cand"]["n"] == 2
    assert sorted(res["groups"]["base"]["seeds"]) == [7, 8] and sorted(res["groups"]["cand"]["seeds"]) == [7, 8]
    assert len(res["runs"]) == 4
    assert str(third) not in json.dumps(res["runs"])
    assert res["comparison"]["projected_time_s"] == pytest.approx(100.0 * res["comparison"]["ratio"])
    readme = (out / "README.md").read_text()
    assert "| base |" in readme and "Plan (interleaved, paired seeds)" in readme and "runs/base-seed8-try1" in readme
    for png in ("val_loss_vs_step.png", "val_loss_vs_time.png", "step_time.png"):
        assert (out / png).stat().st_size > 1000

    # Running again does nothing new.
    again = run_compare(arms, out, **kw)
    assert again.complete
    assert json.loads((out / MANIFEST).read_text())["plan"] == plan


@pytest.mark.gpu
def test_compare_on_gpu_measures_the_node(tmp_path):
    """On a GPU: fingerprints before/after carry measured matmul TFLOP/s and copy TB/s."""
    arms = parse_arms(["base=tiny"])
    r = run_compare(arms, tmp_path / "rec", seeds=2, common=COMMON + ["train.device=cuda"], measure=True,
                    console=False)
    assert r.complete
    fps = r.manifest["fingerprints"]
    assert [f["when"] for f in fps] == ["before", "after"]
    assert all(f["matmul_bf16_tflops"] and f["copy_tbps"] for f in fps)
    assert "log.txt" in json.dumps(json.loads((tmp_path / "rec" / "results.json").read_text())["runs"])


def test_compare_cli(tmp_path, capsys):
    from speedrun.cli import main

    out = tmp_path / "rec"
    args = ["compare", "--arm", "base=tiny", "--seeds", "3,5", "--out", str(out), "--no-measure", "--quiet",
            "--reference-time", "60"] + [x for s in COMMON for x in ("--set", s)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "2/2 runs done" in text and "README.md" in text
    # --quiet silences the trainings, not the plan: the seeds are on screen before any run.
    assert "arms base x seeds [3, 5] = 2 runs" in text and "starting run 2/2: arm base seed 5" in text
    m = json.loads((out / MANIFEST).read_text())
    assert m["seeds"] == [3, 5] and m["fingerprints"][0]["matmul_bf16_tflops"] is None
    assert main(args[:3] + ["--seeds", "x"] + args[5:]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_restart_decisions_without_training(tmp_path):
    """A run that finished before the manifest said so is done; stray folders are never reused."""
    from speedrun.evidence.compare import _next_action

    m = {"plan": make_plan(["a", "b"], [0]), "events": []}
    done_dir = tmp_path / "runs" / "a-seed0-try1"
    done_dir.mkdir(parents=True)
    (done_dir / "summary.json").write_text(json.dumps({"final_val_loss": 4.5, "train_time_ms": 12.0}))
    m["plan"][0].update(status="running", run_dir=str(done_dir), attempt=1)
    stray = tmp_path / "runs" / "b-seed0-try1"  # created by a kill before the manifest was written
    stray.mkdir(parents=True)
    act = _next_action(m, tmp_path)
    assert m["plan"][0]["status"] == "done" and m["plan"][0]["final_val_loss"] == 4.5
    assert act == {"index": 1, "arm": "b", "seed": 0, "run_dir": str(tmp_path / "runs" / "b-seed0-try2"),
                   "resume": False}
    assert m["plan"][1]["abandoned"] == [str(stray)] and (stray / "ABANDONED").exists()
    # Killed before its folder existed: a new attempt, nothing to abandon.
    m["plan"][1]["run_dir"] = str(tmp_path / "runs" / "gone")
    act = _next_action(m, tmp_path)
    assert act["run_dir"].endswith("b-seed0-try3") and m["plan"][1]["abandoned"] == [str(stray)]
