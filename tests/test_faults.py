"""The fault suite: runs interrupted by SIGINT, SIGTERM and SIGKILL (at random steps, inside
checkpoint writes, at a stage boundary) resume bit for bit; a corrupt latest checkpoint falls back
to the one before; a finished run is never resumed over; bad inputs fail with one clear line.

Interrupted runs are real ``speedrun train`` subprocesses (one intra-op thread each, so the
uninterrupted run they are compared with does the same arithmetic).  A small driver injects the
fault from inside the process: a signal sent to itself as a chosen step begins, or half-way
through writing the n-th checkpoint file.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from speedrun.cli import main
from speedrun.train.checkpoint import list_checkpoints

pytestmark = pytest.mark.usefixtures("use_builtin_cache")

# The driver: FAULT="step:K:SIG" signals itself as step K begins (0-based, the K+1-th step);
# FAULT="save:N:SIG" signals itself half-way through writing the N-th checkpoint file.
DRIVER = r"""
import io, os, signal, sys
import torch
from speedrun.train import loop

kind, n, sig = os.environ["FAULT"].split(":")
n, signum = int(n), getattr(signal, sig)
if kind == "step":
    run_step = loop.run_step
    def faulty_step(model, recipe, loader, step, *args, **kwargs):
        if step == n:
            os.kill(os.getpid(), signum)
        return run_step(model, recipe, loader, step, *args, **kwargs)
    loop.run_step = faulty_step
else:
    save, calls = torch.save, [0]
    def faulty_save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] != n:
            return save(obj, f, *args, **kwargs)
        buf = io.BytesIO()
        save(obj, buf, *args, **kwargs)
        data = buf.getvalue()
        with open(f, "wb") as out:
            out.write(data[: len(data) // 2])
            out.flush()
            os.kill(os.getpid(), signum)
            out.write(data[len(data) // 2:])
    torch.save = faulty_save
from speedrun.cli import main
sys.exit(main(sys.argv[1:]))
"""

# A 1-layer core GPT: 10 steps, a checkpoint every 3 (and at the end), log every 2.
CORE = ["--steps", "10", "--set", "model.num_layers=1", "--set", "model.model_dim=32", "--set", "model.num_heads=1",
        "--set", "model.qk_head_dim=16", "--set", "model.v_head_dim=32", "--set", "model.attention_backend=reference",
        "--set", "train.batch_tokens=256", "--set", "train.max_seq_len=64", "--set", "train.val_tokens=512",
        "--set", "train.val_every=5", "--set", "train.log_every=2", "--set", "train.sample_tokens=0",
        "--set", "train.lr_warmup_steps=2", "--set", "train.checkpoint_every=3"]
# The record code path (NorMuon + Adam, staged schedule) shrunk: stages begin at steps 0, 3, 6 and 9.
RECORD = ["--preset", "tiny-record", "--steps", "12", "--set", "model.num_layers=4", "--set", "model.model_dim=32",
          "--set", "model.num_heads=2", "--set", "model.qk_head_dim=12", "--set", "train.batch_divisor=256",
          "--set", "train.num_extension=3", "--set", "train.val_tokens=2048", "--set", "train.val_every=0",
          "--set", "train.log_every=3", "--set", "train.sample_tokens=0"]

EXIT = {"SIGINT": 130, "SIGTERM": 143, "SIGKILL": -signal.SIGKILL}


def random_step(sig: str, low: int, high: int) -> int:
    """A step in [low, high), random but fixed per signal, so a failure can be rerun."""
    return random.Random(f"issue-36-{sig}").randrange(low, high)


def speedrun(args, out: Path, fault: str | None = None, cache=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    if fault:
        env["FAULT"] = fault
    if cache:
        env["SPEEDRUN_CACHE_DIR"] = str(cache)
    cmd = [sys.executable, "-c", DRIVER] if fault else [sys.executable, "-m", "speedrun"]
    return subprocess.run([*cmd, "train", *args, "--out", str(out), "--quiet"], capture_output=True, text=True,
                          env=env, timeout=300)


def run_folder(out: Path) -> Path:
    (folder,) = [p for p in out.iterdir() if p.is_dir()]
    return folder


def resume(folder: Path) -> int:
    """``speedrun train --resume folder`` in this process, on one intra-op thread (as the
    subprocesses): what a user runs after the fault, without a second interpreter start."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return main(["train", "--resume", str(folder), "--quiet"])
    finally:
        torch.set_num_threads(threads)


def same(a, b, where="") -> None:
    """``a`` and ``b`` (nested checkpoint values) equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), (where, a, b)


def final_state(folder: Path) -> dict:
    state = torch.load(list_checkpoints(folder)[-1], weights_only=False)
    summary = json.loads((folder / "summary.json").read_text())
    return {"step": state["step"], "model": state["model"], "optimizer": state["optimizer"],
            "fp8": state.get("fp8"), "loaders": state["loaders"], "val": summary["final_val_loss"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, builtin_cache):
    """The uninterrupted runs, one per configuration, made once."""
    made = {}

    def get(name: str, args: list[str]) -> dict:
        if name not in made:
            out = tmp_path_factory.mktemp(f"whole-{name}")
            done = speedrun(args, out, cache=builtin_cache)
            assert done.returncode == 0, done.stderr
            made[name] = final_state(run_folder(out))
        return made[name]

    return get


def check_resumes_exactly(out: Path, whole: dict) -> Path:
    folder = run_folder(out)
    assert not (folder / "summary.json").exists()
    assert resume(folder) == 0
    same(whole, final_state(folder))
    return folder


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_signal_at_a_random_step_resumes_exactly(tmp_path, reference, sig):
    whole = reference("core", CORE)
    # SIGKILL: after the first periodic checkpoint (step 3; before it there is nothing to resume)
    step = random_step(sig, 3 if sig == "SIGKILL" else 1, 9)
    run = speedrun(CORE, tmp_path, fault=f"step:{step}:{sig}")
    assert run.returncode == EXIT[sig], (step, run.returncode, run.stderr)
    folder = run_folder(tmp_path)
    steps = [torch.load(p, weights_only=False)["step"] for p in list_checkpoints(folder)]
    if sig == "SIGKILL":  # the newest periodic checkpoint before the kill
        assert steps[-1] == step // 3 * 3, (step, steps)
    else:  # the step that was running finishes, then a checkpoint of it is written
        assert steps[-1] == step + 1, (step, steps)
        assert f"stopped by {sig} after step {step + 1}" in (folder / "log.txt").read_text()
        assert f"--resume {folder}" in run.stdout
    check_resumes_exactly(tmp_path, whole)


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_signal_inside_a_checkpoint_write_resumes_exactly(tmp_path, reference, sig):
    """Half of the step-6 checkpoint written when the signal comes: SIGKILL leaves a partial
    temporary file beside the intact step-3 checkpoint (resumed from, then removed); SIGTERM waits
    for the write to finish and stops after it."""
    whole = reference("core", CORE)
    run = speedrun(CORE, tmp_path, fault=f"save:2:{sig}")
    assert run.returncode == EXIT[sig], run.stderr
    folder = run_folder(tmp_path)
    names = sorted(p.name for p in (folder / "checkpoints").iterdir())
    if sig == "SIGKILL":
        assert names == ["step_000003.pt", "step_000006.pt.tmp"], names
    else:
        assert names == ["step_000003.pt", "step_000006.pt"], names
    check_resumes_exactly(tmp_path, whole)
    assert not list((folder / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
@pytest.mark.parametrize("sig,step", [("SIGKILL", 3), ("SIGTERM", 4)], ids=["kill-at-boundary", "term-mid-stage"])
def test_record_path_killed_at_a_stage_boundary_resumes_exactly(tmp_path, reference, sig, step):
    """The record schedule writes a checkpoint at every stage boundary (no periodic ones here):
    killed as stage 1 begins, the run resumes from the boundary into stage 1's shapes; stopped by
    SIGTERM inside stage 1, from its own checkpoint."""
    whole = reference("record", RECORD)
    run = speedrun(RECORD, tmp_path, fault=f"step:{step}:{sig}")
    assert run.returncode == EXIT[sig], run.stderr
    steps = [torch.load(p, weights_only=False)["step"] for p in list_checkpoints(run_folder(tmp_path))]
    assert steps[-1] == (3 if sig == "SIGKILL" else step + 1), steps
    check_resumes_exactly(tmp_path, whole)


def test_corrupt_latest_checkpoint_falls_back_to_the_one_before(tmp_path, reference):
    whole = reference("core", CORE)
    run = speedrun(CORE, tmp_path, fault="step:7:SIGKILL")  # checkpoints at 3 and 6
    assert run.returncode == EXIT["SIGKILL"]
    folder = run_folder(tmp_path)
    latest = list_checkpoints(folder)[-1]
    assert latest.name == "step_000006.pt"
    latest.write_bytes(latest.read_bytes()[:1000])  # a torn file (e.g. a disk that filled up)
    check_resumes_exactly(tmp_path, whole)
    log = (folder / "log.txt").read_text()
    assert f"checkpoint {latest} cannot be read" in log and "Resumed from step 3" in log


def test_finished_run_refuses_resume_and_keeps_its_results(tmp_path, reference, capsys):
    whole = reference("core", CORE)
    run = speedrun(CORE, tmp_path)
    assert run.returncode == 0
    folder = run_folder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "is a finished run (10 steps" in err and "--steps N (N > 10)" in err and len(err.splitlines()) == 1
    assert main(["train", "--resume", str(folder), "--steps", "8"]) == 2
    assert "must exceed the finished run's 10 steps" in capsys.readouterr().err
    assert main(["train", "--resume", str(folder), "--set", "train.lr=1"]) == 2
    assert "--set does not apply with --resume" in capsys.readouterr().err
    after = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == before
    same(whole, final_state(folder))
    # killed after its final checkpoint but before its summary: resuming validates again, loses nothing
    (folder / "summary.json").unlink()
    assert resume(folder) == 0
    same(whole, final_state(folder))


def test_finished_run_extends_into_a_new_folder(tmp_path, one_thread):
    run = speedrun(CORE, tmp_path)
    assert run.returncode == 0
    folder = run_folder(tmp_path)
    before = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert main(["train", "--resume", str(folder), "--steps", "12", "--quiet"]) == 0
    ext = folder.with_name(folder.name + "-to12")
    assert json.loads((ext / "summary.json").read_text())["steps"] == 12
    assert "Resumed from step 10" in (ext / "log.txt").read_text()
    assert {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


BAD = [
    (["--steps", "-5"], "train.steps=-5 is out of range: must be an int >= 1"),
    (["--steps", "0"], "train.steps=0 is out of range: must be an int >= 1"),
    (["--set", "train.lr=-1"], "train.lr=-1.0 is out of range: must be a finite number > 0"),
    (["--set", "train.lr=nan"], "train.lr=nan is not finite"),
    (["--set", "train.beta2=1.5"], "train.beta2=1.5 is out of range: must be a finite number in [0, 1)"),
    (["--set", "train.cooldown_frac=2"], "must be a finite number in [0, 1]"),
    (["--set", "train.dtype=fp16"], "train.dtype='fp16' is not allowed: must be one of auto, bf16, fp32"),
    (["--set", "train.device=gpu"], "must be auto, cpu, cuda or cuda:N"),
    (["--set", "train.log_every=0"], "train.log_every=0 is out of range: must be an int >= 1"),
    (["--set", "train.val_tokens=0"], "train.val_tokens=0"),
    (["--set", "train.seed=-1"], "train.seed=-1 is out of range"),
    (["--set", "train.checkpoint_every_s=-10"], "train.checkpoint_every_s=-10.0 is out of range"),
    (["--set", "train.schedule=cosine"], "must be one of trapezoid, record"),
    (["--set", "train.mlp_gemm=fast"], "must be one of auto, fused, tma, split"),
    (["--set", "train.ce_sigmoid=fast"], "must be one of exact, tanh"),
    (["--set", "model.num_layers=0"], "model.num_layers=0 is out of range: must be an int >= 1"),
    (["--set", "model.kernels=fp4"], "must be one of reference, triton, fp8, fp8_full"),
    (["--set", "model.rope_fraction=1.5"], "model.rope_fraction=1.5 is out of range"),
    (["--set", "model.gate_gemm_align=3"], "must be one of 1, 2, 4, 8, 16"),
    (["--set", "data.source=web"], "must be one of builtin, shards"),
    (["--set", "data.bos_id=999"], "data.bos_id=999: must be below model.vocab_size (257)"),
    (["--set", "train.compile=maybe"], "cannot read 'maybe' as bool"),
    (["--set", "train.steps=ten"], "cannot read 'ten' as int"),
    (["--name", "../escape"], "must be a name of letters, digits"),
    (["--set", 'train.stages=[[2, 1024, 128, null, null]]'], "must rise strictly from 0"),
    (["--set", "train.stages=[[0, 0, 128, null, null]]"], "train.stages[0].batch_tokens=0 is out of range"),
    (["--preset", "tiny-record", "--set", "train.num_extension=200"], "train.num_extension=200: must be below"),
    (["--data", "/tmp/shards/web_*.bin"], "has no 'train' in its name"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_value_is_one_clear_line_before_any_run_folder(tmp_path, capsys, args, needle):
    out = tmp_path / "runs"
    rc = main(["train", *args, "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("speedrun train: error: ") and len(err.splitlines()) == 1, err
    assert needle in err, err
    assert not out.exists()


def _shards(folder: Path, names: list[str]) -> None:
    from speedrun.data import write_shard

    for name in names:
        write_shard(folder / name, [256] + list(range(200)) * 20, vocab_size=257)


def test_validation_shards_are_never_training_shards(tmp_path, capsys):
    _shards(tmp_path, ["mine_train_000.bin", "mine_val_000.bin", "other_000.bin"])
    common = ["--tokenizer", "bytes", "--out", str(tmp_path / "runs"), "--quiet"]
    # the README's old example: no 'train' in the glob, so no validation shards can be named from it
    assert main(["train", "--data", str(tmp_path / "*.bin"), *common]) == 2
    assert "pass --val-data" in capsys.readouterr().err
    # explicit, overlapping: refused, then accepted when asked for
    overlap = ["--data", str(tmp_path / "*.bin"), "--val-data", str(tmp_path / "mine_val_*.bin")]
    assert main(["train", *overlap, *common, "--show-config"]) == 0  # config is fine; the files are not
    capsys.readouterr()
    assert main(["train", *overlap, *common, "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "1 validation shard(s) are also training shards" in err and "--allow-val-overlap" in err
    assert not (tmp_path / "runs").exists()
    from speedrun.cli.train import build_config, register  # noqa: F401
    from speedrun.data.splits import val_glob_for
    from speedrun.train.loop import resolve_data

    assert val_glob_for("data/fineweb10B/fineweb_train_*.bin") == "data/fineweb10B/fineweb_val_*.bin"
    assert val_glob_for("data/train/part_*.bin") == "data/val/part_*.bin"
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["train", *overlap, "--tokenizer", "bytes", "--allow-val-overlap"])
    train_files, val_files, _ = resolve_data(build_config(args))
    assert set(val_files) <= set(train_files)
    args = parser.parse_args(["train", "--data", str(tmp_path / "mine_train_*.bin"), "--tokenizer", "bytes"])
    train_files, val_files, _ = resolve_data(build_config(args))
    assert [p.name for p in train_files] == ["mine_train_000.bin"] and [p.name for p in val_files] == ["mine_val_000.bin"]


def _core_cfg(tmp_path, *extra):
    from speedrun.cli.train import build_config, register
    import argparse

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return build_config(parser.parse_args(["train", *CORE, "--out", str(tmp_path / "runs"), *extra]))


def test_nan_loss_stops_with_the_step_and_the_last_good_checkpoint(tmp_path, monkeypatch, one_thread):
    from speedrun.model.gpt import GPT
    from speedrun.train.faults import TrainingDiverged
    from speedrun.train.loop import train

    loss = GPT.loss
    calls = [0]

    def poisoned(self, batch, args):
        calls[0] += 1
        out = loss(self, batch, args)
        return out * float("nan") if calls[0] == 5 else out  # the 5th step's loss

    monkeypatch.setattr(GPT, "loss", poisoned)
    with pytest.raises(TrainingDiverged) as caught:
        train(_core_cfg(tmp_path), console=False)
    folder = run_folder(tmp_path / "runs")
    msg = str(caught.value)
    assert "training loss is nan after step 5" in msg, msg  # read at the step-5 validation
    assert f"last good checkpoint: {folder / 'checkpoints' / 'step_000003.pt'} (step 3)" in msg
    assert [p.name for p in list_checkpoints(folder)] == ["step_000003.pt"]  # none of the NaN state
    assert "error: TrainingDiverged: training loss is nan" in (folder / "log.txt").read_text()
    assert not (folder / "summary.json").exists()


def test_failed_start_removes_its_run_folder(tmp_path, monkeypatch):
    from speedrun.train import loop

    def broken(*args):  # fails after the run folder exists, before the first step
        raise RuntimeError("writing the log's header failed")

    monkeypatch.setattr(loop, "_log_header", broken)
    with pytest.raises(RuntimeError):
        loop.train(_core_cfg(tmp_path), console=False)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_run_killed_before_its_first_checkpoint_says_what_to_do(tmp_path, capsys):
    run = speedrun(CORE, tmp_path, fault="step:1:SIGKILL")
    assert run.returncode == EXIT["SIGKILL"]
    assert resume(run_folder(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "has no checkpoints to resume from" in err and "train.checkpoint_every_s" in err and "start it again" in err
    assert main(["train", "--resume", str(run_folder(tmp_path)), "--steps", "20"]) == 2  # not finished: no extension
    assert "has not finished: resume it without --steps" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# FP8 state across a resume (in-process, stop_after = killed right after that step's checkpoint)

FP8_ARMS = {
    # the record preset's FP8 switches: FP8 head and MLP forward, the MLP input quantised in the
    # graph, the MLP bank's gradient summed in place, aligned gate GEMMs
    "record": ("model.kernels=fp8", "model.mlp_input_quant=graph", "model.mlp_weight_grad=accumulate",
               "model.gate_gemm_align=8"),
    # the candidate's: packed FP8 QKV, FP8 across the MLP, delayed scaling, e5m2 d qkv from QK-prep
    "candidate": ("model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16",
                  "model.fp8_input_scaling=delayed", "model.qk_prep_fp8_grad=true"),
}


def tiny_fp8(tmp_path, arm, *extra):
    from speedrun.config import apply_overrides, preset

    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12",
                          "train.batch_divisor=1024", "train.steps=8", "train.num_extension=1",
                          "train.val_tokens=2048", "train.val_every=0", "train.log_every=2", "train.sample_tokens=0",
                          "train.warmup_steps=1", f"out_dir={tmp_path / 'runs'}", *FP8_ARMS[arm], *extra])
    return cfg


def fp8_resume_matches(tmp_path, arm, stop, *extra):
    from speedrun.train.loop import train

    whole = train(tiny_fp8(tmp_path, arm, *extra), console=False)
    cut = train(tiny_fp8(tmp_path, arm, *extra), console=False, stop_after=stop)
    assert cut.stopped_early
    saved = torch.load(list_checkpoints(cut.run_dir)[-1], weights_only=False)
    assert saved["step"] == stop and saved["fp8"][0], "the checkpoint holds FP8 state"
    resumed = train(tiny_fp8(tmp_path, arm, *extra), run_dir=cut.run_dir, resume=True, console=False)
    same(final_state(whole.run_dir), final_state(resumed.run_dir))
    return saved["fp8"][0]


@pytest.mark.parametrize("arm", sorted(FP8_ARMS))
def test_fp8_run_stopped_mid_stage_resumes_exactly(tmp_path, kernels_use_references, one_thread, arm):
    """Weights, optimizer, loader and the FP8 state itself (weight caches with their amax
    history, delayed activation scales) equal an uninterrupted run's after a stop mid-stage (step 3
    of stages starting at 0, 2, 5, 7), with a warmup before both.  PyTorch references of the kernels:
    the scale bookkeeping is the same code (the interpreter variant below is slow)."""
    state = fp8_resume_matches(tmp_path, arm, 3)
    assert "mlp_weights" in state and "mlp_activations" in state
    if arm == "candidate":
        assert {"qkv", "qkv_inputs"} <= set(state)


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["record", "candidate"])
def test_fp8_run_resumes_exactly_through_the_triton_interpreter(tmp_path, one_thread, monkeypatch, arm):
    """The same through the Triton kernels themselves (interpreted on the CPU, so as few steps as
    can be): one 5-step run (stages starting at 0, 1, 3, 4) keeps every checkpoint; a new run
    folder holding only its step-2 one (inside stage 1) resumes to the end and must equal it."""
    from speedrun.train import loop

    save = loop.save_checkpoint
    monkeypatch.setattr(loop, "save_checkpoint", lambda run_dir, step, state: save(run_dir, step, state, keep=100))
    extra = ("train.steps=5", "train.warmup_steps=0", "train.val_tokens=384", "train.checkpoint_every=1")
    whole = loop.train(tiny_fp8(tmp_path, arm, *extra), console=False)
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copy(whole.run_dir / "config.json", cut / "config.json")
    shutil.copy(whole.run_dir / "checkpoints" / "step_000002.pt", cut / "checkpoints" / "step_000002.pt")
    assert torch.load(cut / "checkpoints" / "step_000002.pt", weights_only=False)["fp8"][0]
    loop.train(tiny_fp8(tmp_path, arm, *extra), run_dir=cut, resume=True, console=False)
    same(final_state(whole.run_dir), final_state(cut))


def test_shards_are_written_with_the_usual_file_mode(tmp_path):
    _shards(tmp_path, ["a_train_000.bin"])
    mask = os.umask(0)
    os.umask(mask)
    assert (tmp_path / "a_train_000.bin").stat().st_mode & 0o777 == 0o666 & ~mask


def test_checkpoint_policy_by_steps_wall_clock_stages_and_signals():
    from types import SimpleNamespace

    from speedrun.config import preset
    from speedrun.train.faults import RunGuard

    cfg = preset("tiny")
    cfg.train.checkpoint_every, cfg.train.checkpoint_every_s = 5, 600.0
    now = [0.0]
    guard = RunGuard(cfg, [0, 4, 8], SimpleNamespace(enabled=False), Path("run"), clock=lambda: now[0])
    assert [d for d in range(1, 11) if guard.checkpoint_due(d, agree=False)] == [4, 5, 8, 10]
    now[0] = 599.0
    assert not guard.checkpoint_due(1, agree=False)
    now[0] = 600.0  # ten minutes since the last checkpoint (here: since the guard began)
    assert guard.checkpoint_due(1, agree=False)
    guard.checkpoint_written(Path("run/checkpoints/step_000001.pt"), 1)
    assert not guard.checkpoint_due(2, agree=False) and not guard.stop
    guard._on_signal(signal.SIGTERM, None)
    assert guard.checkpoint_due(2, agree=False) and guard.stop and guard.signal_name == "SIGTERM"
    with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C does not wait
        guard._on_signal(signal.SIGINT, None)
    cfg.train.checkpoint_every, cfg.train.checkpoint_every_s, cfg.train.checkpoint_stages = 0, 0.0, False
    quiet = RunGuard(cfg, [0, 4, 8], SimpleNamespace(enabled=False), Path("run"), clock=lambda: 1e9)
    assert not any(quiet.checkpoint_due(d, agree=True) for d in range(1, 11))


def test_host_flags_travel_over_a_gloo_group_beside_nccl(monkeypatch):
    """Under NCCL, setup() makes a gloo group for host values and any_rank() reduces over it (a CPU
    tensor: no device stream is touched, so the loop's per-step checks never synchronise); under
    gloo the default group serves; on one process nothing is reduced."""
    import torch.distributed as dist

    from speedrun import distributed

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda **kw: calls.append(("new_group", kw)) or "gloo-group")

    def all_reduce(t, op=None, group=None):
        calls.append(("all_reduce", t.device.type, group))
        t.copy_(torch.tensor([1.0, 0.0]))  # another rank saw the first flag

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    for backend, group in (("nccl", "gloo-group"), ("gloo", None)):
        calls.clear()
        monkeypatch.setattr(dist, "get_backend", lambda b=backend: b)
        info = distributed.setup("cpu")
        assert info.enabled and info.host_group == group
        assert calls == ([("new_group", {"backend": "gloo"})] if backend == "nccl" else [])
        assert distributed.any_rank([False, False], info) == [True, False]
        assert calls[-1] == ("all_reduce", "cpu", group)
    assert distributed.any_rank([True, False], distributed.DistInfo()) == [True, False]
