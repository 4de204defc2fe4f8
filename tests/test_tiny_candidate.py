"""``--preset tiny-candidate``: the candidate's own kernels end to end on a CPU (Triton interpreter).

``tiny-record`` runs the record's code path at toy size; ``tiny-candidate`` is the same with the
candidate's switches, so that its packed FP8 QKV GEMM, fused QK-prep (handing the GEMM its e5m2
gradient), FP8 MLP forward and backward, FP8 weight cache and delayed input scaling train,
checkpoint and resume on a CPU.  The run here is shrunk further (4 layers of 32, batches / 4096),
since every Triton program costs the interpreter ~0.1 s.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from speedrun.config import apply_overrides, preset
from speedrun.train.checkpoint import list_checkpoints
from speedrun.train.loop import train

pytestmark = pytest.mark.usefixtures("use_builtin_cache", "one_thread")

CANDIDATE_SWITCHES = ("qkv_path", "kernels", "fp8_input_scaling", "qk_prep_fp8_grad", "mlp_input_quant",
                      "mlp_weight_grad")


def test_tiny_candidate_is_tiny_record_with_the_candidates_switches():
    tiny, rec, cand, full = preset("tiny-candidate"), preset("tiny-record"), preset("candidate"), preset("record")
    for field in CANDIDATE_SWITCHES:
        assert getattr(tiny.model, field) == getattr(cand.model, field), field
    # Q/K narrowed by the candidate's ratio (96 of 128), V and the residual kept
    assert tiny.model.qk_head_dim / tiny.model.v_head_dim == cand.model.qk_head_dim / cand.model.v_head_dim
    for field in ("num_layers", "model_dim", "num_heads", "v_head_dim", "architecture", "embedding_grad"):
        assert getattr(tiny.model, field) == getattr(rec.model, field), field
    # the extension grows by the candidate's factor (45 of 15), the scheduled steps stay
    assert tiny.train.num_extension == rec.train.num_extension * cand.train.num_extension // full.train.num_extension
    assert tiny.train.steps - tiny.train.num_extension == rec.train.steps - rec.train.num_extension
    tiny.model.validate()


def _config(out_dir, *extra):
    cfg = preset("tiny-candidate")
    apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12",
                          "model.mlp_ratio=2", "train.batch_divisor=4096", "train.steps=4", "train.num_extension=0",
                          "train.val_tokens=128", "train.val_every=0", "train.log_every=1", "train.sample_tokens=0",
                          "train.warmup_steps=0", "train.checkpoint_every=1", f"out_dir={out_dir}", *extra])
    return cfg


@pytest.fixture
def kernel_names(monkeypatch):
    """The names of the Triton kernels the interpreter runs."""
    interpreter = pytest.importorskip("triton.runtime.interpreter")
    names = set()
    real = interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        names.add(getattr(self.fn, "__name__", repr(self.fn)))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", run)
    return names


@pytest.mark.slow
def test_tiny_candidate_trains_checkpoints_and_resumes_exactly(tmp_path, kernel_names):
    """Four steps (stages of 1, 2 and 1 steps) through the candidate's kernels, a checkpoint after
    each (the last two kept); a run resumed after the third (a copy of the run folder without the
    fourth checkpoint: a stage start, and an Adam step whose gradients are half summed) ends with
    the very weights and FP8 state of the run never stopped."""
    from speedrun.kernels.fp8_cache import interpreting

    if not interpreting():
        pytest.skip("needs TRITON_INTERPRET=1 (set by conftest without a GPU) before the kernels are imported")
    whole = train(_config(tmp_path / "whole"), console=False)
    # the candidate's own kernels ran (not their PyTorch references)
    for kernel in ("_pack_kernel", "_qk_prep_fwd_kernel", "_qk_prep_bwd_kernel", "_relu2_gemm_tma_store_kernel",
                   "_ce_fwd_bwd_kernel"):
        assert kernel in kernel_names, (kernel, sorted(kernel_names))
    assert whole.final_val_loss == whole.final_val_loss  # not NaN
    assert [p.name for p in list_checkpoints(whole.run_dir)] == ["step_000003.pt", "step_000004.pt"]

    cut_dir = tmp_path / "cut" / whole.run_dir.name
    shutil.copytree(whole.run_dir, cut_dir)
    for later in (cut_dir / "checkpoints").glob("*000004*"):  # as if killed after the third step
        later.unlink()
    (cut_dir / "summary.json").unlink()  # a killed run has no summary (with one it is finished)
    resumed = train(_config(tmp_path / "cut"), run_dir=cut_dir, resume=True, console=False)

    a = torch.load(list_checkpoints(whole.run_dir)[-1], weights_only=False)
    b = torch.load(list_checkpoints(resumed.run_dir)[-1], weights_only=False)
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    (state,) = a["fp8"]
    assert {"mlp_weights", "qkv", "mlp_activations", "qkv_inputs"} <= set(state)
    _assert_same_state(a["fp8"], b["fp8"], "fp8")


def _assert_same_state(x, y, where):
    if isinstance(x, torch.Tensor):
        assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            _assert_same_state(x[k], y[k], f"{where}.{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (u, v) in enumerate(zip(x, y)):
            _assert_same_state(u, v, f"{where}[{i}]")
    else:
        assert x == y, (where, x, y)
