"""`speedrun train` through a real subprocess: the embedded default and bad-input exits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SMALL = ["--set", "model.num_layers=1", "--set", "model.model_dim=64", "--set", "model.num_heads=2",
         "--set", "model.qk_head_dim=16", "--set", "model.v_head_dim=32", "--set", "train.batch_tokens=1024",
         "--set", "train.max_seq_len=128", "--set", "train.val_tokens=2048", "--set", "train.sample_tokens=10"]


def speedrun(*args, env_extra=None, cwd=None):
    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "speedrun", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=600)


@pytest.fixture
def env(builtin_cache):
    return {"SPEEDRUN_CACHE_DIR": str(builtin_cache)}


def test_help_teaches():
    out = speedrun("--help")
    assert out.returncode == 0 and "speedrun train" in out.stdout
    out = speedrun("train", "--help")
    assert out.returncode == 0 and "--resume" in out.stdout and "torchrun" in out.stdout


def test_embedded_default_trains_with_few_steps(tmp_path, env):
    out = speedrun("train", "--steps", "4", "--out", str(tmp_path), "--set", "train.val_every=2",
                   "--set", "train.log_every=2", *SMALL, env_extra=env)
    assert out.returncode == 0, out.stderr
    assert "step 4/4" in out.stdout and "eta" in out.stdout and "tok/s" in out.stdout
    assert "step:4/4 val_loss:" in out.stdout and "sample:" in out.stdout
    run_dir = Path(out.stdout.split("run folder:")[1].split()[0])
    assert (run_dir / "log.txt").exists() and (run_dir / "summary.json").exists()
    # resume a finished run: refused with one line, its result kept (tests/test_faults.py has more)
    summary = (run_dir / "summary.json").read_text()
    again = speedrun("train", "--resume", str(run_dir), env_extra=env)
    assert again.returncode == 2 and "is a finished run (4 steps" in again.stderr, again.stderr
    assert (run_dir / "summary.json").read_text() == summary


def test_show_config_applies_flags():
    out = speedrun("train", "--show-config", "--steps", "7", "--data", "x/fw_train_*.bin")
    cfg = json.loads(out.stdout)
    assert cfg["train"]["steps"] == 7
    assert cfg["data"]["source"] == "shards" and cfg["data"]["val_files"] == "x/fw_val_*.bin"
    assert cfg["model"]["vocab_size"] == 50257 and cfg["data"]["bos_id"] == 50256


@pytest.mark.parametrize("args,needle", [
    (["train", "--set", "train.nope=1"], "unknown setting"),
    (["train", "--preset", "nope"], "unknown preset"),
    (["train", "--data", "/nonexistent/*_train_*.bin"], "no train shard matches"),
    (["train", "--resume", "/nonexistent/run"], "cannot resume"),
    (["train", "--set", "model.model_dim=100"], "model_dim"),
    (["train", "--preset", "record"], "not ready"),
])
def test_bad_input_exits_with_one_clear_line(args, needle, tmp_path):
    out = speedrun(*args, "--out", str(tmp_path))
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert needle in out.stderr
    assert "Traceback" not in out.stderr
