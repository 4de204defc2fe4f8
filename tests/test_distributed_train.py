"""Two gloo ranks take the same optimizer steps as one rank with gradient accumulation.

This exercises the loader's rank slicing, the sharded NorMuon reduce-scatter / all-gather, the
replicated and sharded Adam tables, the sparse bigram-gradient exchange and the validation
reduction, through the real `speedrun train` entry point under torchrun (CPU, gloo).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import speedrun
from speedrun.evidence.equivalence import compare_runs, render
from speedrun.train.checkpoint import list_checkpoints, rank_state_path

COMMON = ["train", "--preset", "tiny-record", "--steps", "5", "--quiet",
          "--set", "model.num_layers=4", "--set", "model.model_dim=32", "--set", "model.num_heads=2",
          "--set", "model.qk_head_dim=12", "--set", "train.batch_divisor=256", "--set", "train.num_extension=1",
          "--set", "train.val_every=2", "--set", "train.val_tokens=3072"]


def _run(args, tmp_path, env_extra, nproc=1):
    # the subprocesses run the speedrun under test, not whatever an editable install points at
    tree = str(Path(speedrun.__file__).resolve().parent.parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=tree, **env_extra)
    if nproc == 1:
        cmd = [sys.executable, "-m", "speedrun", *args]
    else:
        torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
        cmd = [torchrun, "--standalone", f"--nproc_per_node={nproc}", "-m", "speedrun", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_two_ranks_equal_one_rank_with_accumulation(tmp_path, builtin_cache):
    env = {"SPEEDRUN_CACHE_DIR": str(builtin_cache)}
    _run(COMMON + ["--out", str(tmp_path / "one"), "--set", "train.grad_accum=2"], tmp_path, env)
    _run(COMMON + ["--out", str(tmp_path / "two"), "--set", "train.grad_accum=1"], tmp_path, env, nproc=2)
    (run_one,) = [p for p in (tmp_path / "one").iterdir() if p.is_dir()]
    (run_two,) = [p for p in (tmp_path / "two").iterdir() if p.is_dir()]
    # NorMuon orthogonalises in bf16: sums taken in another order differ by bf16 rounding
    res = compare_runs(run_one, run_two, tolerance=5e-3)
    assert res["ok"] and res["step_a"] == 5 and res["tensors"] > 10, render(res)
    # validation: the same 3072 tokens (a whole number of steps for 1 and 2 ranks), reduced over ranks
    one_l, two_l = list(res["val_a"].values()), list(res["val_b"].values())
    assert one_l[0] == two_l[0]  # same weights, same tokens: the rank reduction changes nothing
    assert one_l == pytest.approx(two_l, rel=1e-3)


def test_two_rank_resume_equals_uninterrupted(tmp_path, builtin_cache):
    """Resume under torchrun: each rank's sharded optimizer state, its half-summed Adam gradients
    (the checkpoint after step 3 falls between two Adam steps) and its FP8 activation scales come
    back, so the resumed run ends on the very weights of the uninterrupted one, and with the
    bigram rows each rank marked for the sparse exchange.  (Kernels run their PyTorch references
    here: the interpreter would make this minutes long.)"""
    env = {"SPEEDRUN_CACHE_DIR": str(builtin_cache), "TRITON_INTERPRET": "0"}
    args = COMMON + ["--out", str(tmp_path / "whole"), "--set", "train.checkpoint_every=3",
                     "--set", "model.kernels=fp8_full", "--set", "model.qkv_path=fused_fp8"]
    _run(args, tmp_path, env, nproc=2)
    (run,) = [p for p in (tmp_path / "whole").iterdir() if p.is_dir()]
    want = torch.load(list_checkpoints(run)[-1], weights_only=False)
    assert want["step"] == 5 and len(want["fp8"]) == 2 and want["optimizer"] is None  # sharded: per-rank files
    cut = tmp_path / "cut" / run.name
    shutil.copytree(run, cut)
    for f in (cut / "checkpoints").glob("step_000005*"):
        f.unlink()  # as if killed between the checkpoints of steps 3 and 5
    (cut / "summary.json").unlink()  # a killed run has no summary (with one it is finished)
    _run(["train", "--resume", str(cut), "--quiet"], tmp_path, env, nproc=2)
    got = torch.load(list_checkpoints(cut)[-1], weights_only=False)
    assert got["step"] == 5
    for k in want["model"]:
        assert torch.equal(want["model"][k], got["model"][k]), k
    for rank in range(2):  # the bigram rows each rank's loop marked on the host since the Adam step
        marks = [torch.load(rank_state_path(r, 5, rank), weights_only=False)["optimizer"]["touched"]["bigram_embed"]
                 for r in (run, cut)]
        assert marks[0].device.type == "cpu" and 0 < int(marks[0].sum()) < len(marks[0])
        assert torch.equal(marks[0], marks[1])
