"""Stopped and resumed record / candidate runs on a CUDA GPU equal uninterrupted ones bit for bit
(run on the GPU machine: `python -m pytest -q -m gpu tests/gpu/test_faults_gpu.py`).

The record code path at small shapes, with the presets' FP8 kernels, CUDA-graph steps and warmup
(an eager network: compiling each of the ten runs below took minutes, and what a resume must
restore does not depend on compilation), stopped
mid-stage (after step 5 of stages starting at 0, 3, 6, 9): in-process right after that step's
checkpoint, and as a real ``speedrun train`` process sent SIGTERM (and SIGKILL) by itself.  Bit
exactness needs a deterministic step: the embedding tables' gradients use autograd here, since
``model.embedding_grad=atomic`` adds rows with fp32 atomics in an order that varies between runs;
every other switch is the preset's.  Each test first checks that two uninterrupted runs agree, so a
failure says which of the two (the GPU's arithmetic or the resume) differs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from speedrun.config import apply_overrides, preset
from speedrun.train.checkpoint import list_checkpoints
from speedrun.train.loop import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the CPU fault suite's helpers
from test_faults import DRIVER, EXIT, final_state, run_folder, same  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("use_builtin_cache")]

SHAPE = ["model.model_dim=128", "model.num_heads=4", "model.qk_head_dim=32", "model.v_head_dim=32",
         "train.steps=12", "train.num_extension=3", "train.val_every=6", "train.val_tokens=16384",
         "train.log_every=1", "train.sample_tokens=0", "train.dtype=bf16", "train.compile=false",
         "train.optimizer_compile=false", "train.warmup_steps=2", "model.embedding_grad=autograd"]
ARMS = {
    "record": ["model.kernels=fp8", "model.mlp_input_quant=graph", "model.mlp_weight_grad=accumulate",
               "model.gate_gemm_align=8"],
    "candidate": ["model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16",
                  "model.fp8_input_scaling=delayed", "model.qk_prep_fp8_grad=true"],
}


def cfg_for(tmp_path, arm, warmup_steps=2):
    cfg = preset("tiny-record")
    apply_overrides(cfg, [*SHAPE, *ARMS[arm], f"out_dir={tmp_path / 'runs'}", f"train.warmup_steps={warmup_steps}"])
    return cfg


# with the untimed warmup and without it, as the signalled-process test below runs (its fault
# must hit a timed step): beside that test, the pair says whether a resume depends on the warmup
# or on running in a new process
@pytest.mark.parametrize("warmup", [2, 0], ids=["warmup2", "warmup0"])
@pytest.mark.parametrize("arm", sorted(ARMS))
def test_stopped_mid_stage_resumes_bit_exactly_on_gpu(tmp_path, arm, warmup):
    first = final_state(train(cfg_for(tmp_path, arm, warmup), console=False).run_dir)
    second = final_state(train(cfg_for(tmp_path, arm, warmup), console=False).run_dir)
    same(first, second, "two uninterrupted runs (GPU determinism, not resume)")
    cut = train(cfg_for(tmp_path, arm, warmup), console=False, stop_after=5)
    saved = torch.load(list_checkpoints(cut.run_dir)[-1], weights_only=False)
    assert saved["step"] == 5 and saved["fp8"][0]
    resumed = train(cfg_for(tmp_path, arm, warmup), run_dir=cut.run_dir, resume=True, console=False)
    same(first, final_state(resumed.run_dir), "resumed run")


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_record_process_signalled_mid_stage_resumes_bit_exactly_on_gpu(tmp_path, sig):
    """``speedrun train`` processes: SIGTERM as step 4 begins
    stops after step 5 with a checkpoint; SIGKILL there leaves the stage-1 boundary checkpoint
    (step 3).  The stopped run is resumed twice from copies of its folder: by a new process, and
    by ``speedrun train --resume`` inside this test's process (which has trained before, so its
    kernels, caches and library handles are warm), so a failure says whether the new process or
    the CLI's resume path makes the difference."""
    import os
    import shutil
    import subprocess

    from test_faults import resume

    # no untimed warmup: its steps go through run_step too, and the fault must hit a timed step
    args = ["--preset", "tiny-record"] + [x for kv in SHAPE + ARMS["record"] + ["train.warmup_steps=0"]
                                          for x in ("--set", kv)]

    def run(out, fault=None):
        env = dict(os.environ, **({"FAULT": fault} if fault else {}))
        cmd = [sys.executable, "-c", DRIVER] if fault else [sys.executable, "-m", "speedrun"]
        return subprocess.run([*cmd, "train", *args, "--out", str(out), "--quiet"], capture_output=True, text=True,
                              env=env, timeout=1800)

    whole = run(tmp_path / "whole")
    assert whole.returncode == 0, whole.stderr
    again_whole = run(tmp_path / "whole2")  # first: do two processes agree at all on this GPU?
    assert again_whole.returncode == 0, again_whole.stderr
    reference = run_folder(tmp_path / "whole")
    same(final_state(reference), final_state(run_folder(tmp_path / "whole2")),
         "two uninterrupted processes (GPU determinism across processes, not resume)")
    cut = run(tmp_path / "cut", fault=f"step:4:{sig}")
    assert cut.returncode == EXIT[sig], cut.stderr
    folder = run_folder(tmp_path / "cut")
    assert torch.load(list_checkpoints(folder)[-1], weights_only=False)["step"] == (5 if sig == "SIGTERM" else 3)
    here = tmp_path / "resumed-here" / folder.name
    shutil.copytree(folder, here)
    again = subprocess.run([sys.executable, "-m", "speedrun", "train", "--resume", str(folder), "--quiet"],
                           capture_output=True, text=True, timeout=1800)
    assert again.returncode == 0, again.stderr
    assert resume(here) == 0
    verdicts = {name: differences(final_state(reference), final_state(f))
                for name, f in (("a new process", folder), ("this test's process", here))}
    if any(verdicts.values()):
        raise AssertionError("resumed runs against the uninterrupted one:\n" + "\n".join(
            f"- resumed by {name}: " + (f"{len(diff)} tensor(s) differ: {'; '.join(diff[:12])}\n  "
                                        f"{first_divergence(reference, f)}" if diff else "bit-exact")
            for (name, diff), f in zip(verdicts.items(), (folder, here))))


def differences(a, b, where="") -> list[str]:
    """Every leaf of two nested checkpoint values that is not equal bit for bit, as
    ``path: how`` (for a tensor: elements that differ, the largest difference and where)."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {getattr(b, 'shape', type(b))} {getattr(b, 'dtype', '')} vs {a.shape} {a.dtype}"]
        if torch.equal(a, b):
            return []
        diff = (a.double() - b.double()).abs()
        flat = int(diff.reshape(-1).argmax())
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)) if a.dim() else ()
        return [f"{where}: {int((a != b).sum())} of {a.numel()} elements, largest {float(diff.max()):.3g} at {index}"]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{where}: keys {sorted(set(a) ^ set(b), key=str)} in one only"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(b)} items vs {len(a)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b or (a != a and b != b) else [f"{where}: {b!r} vs {a!r}"]


def first_divergence(whole: Path, resumed: Path) -> str:
    """The first step whose logged training loss differs between two run folders (each step's
    last ``train`` metric; the resumed folder holds the cut run's steps, then the resumed ones)."""
    import json

    def losses(folder: Path) -> dict[int, float]:
        out = {}
        for line in (folder / "metrics.jsonl").read_text().splitlines():
            m = json.loads(line)
            if m.get("event") == "train":
                out[int(m["step"])] = float(m["loss"])
        return out

    a, b = losses(whole), losses(resumed)
    for step in sorted(set(a) & set(b)):
        if a[step] != b[step]:
            return f"training losses first differ after step {step}: {a[step]!r} vs {b[step]!r} (logged steps {sorted(b)})"
    return f"every logged training loss is equal (steps {sorted(set(a) & set(b))})"
