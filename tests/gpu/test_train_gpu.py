"""Training paths on a CUDA GPU (run on the H200: `python -m pytest -q -m gpu tests`)."""

import json

import pytest

from speedrun.config import apply_overrides, preset
from speedrun.train.loop import train

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("use_builtin_cache")]


def _vals(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m["val_loss"] for m in map(json.loads, lines) if m["event"] == "val"]


@pytest.mark.parametrize("compile_", [False, True])
def test_core_gpt_trains_on_gpu(tmp_path, compile_):
    cfg = preset("tiny")
    apply_overrides(cfg, ["train.steps=40", "train.val_every=20", f"out_dir={tmp_path}", f"train.compile={compile_}",
                          "train.warmup_steps=1", "train.window=128"])
    result = train(cfg, console=False)
    vals = _vals(result.run_dir)
    assert vals[-1] < vals[0] - 1.0
    log = (result.run_dir / "log.txt").read_text()
    assert "peak memory allocated:" in log
    if compile_:
        assert "compilations during the timed region: 0" in log


@pytest.mark.parametrize("switches", [
    [],                                                                           # plain PyTorch kernels
    ["model.kernels=fp8", "model.qkv_path=reference"],
    ["model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16"],  # candidate switches
    # merged micro-batches: stage 1's 4 chunks of 512 tokens as 2 micro-batches of 1,024
    ["model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16", "train.grad_accum=4",
     "train.min_micro_batch_tokens=1024"],
])
def test_record_code_path_trains_on_gpu(tmp_path, switches):
    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.model_dim=128", "model.num_heads=4", "model.qk_head_dim=32", "model.v_head_dim=32",
                          "train.steps=30", "train.num_extension=3", "train.val_every=15", "train.val_tokens=16384",
                          f"out_dir={tmp_path}", "train.dtype=bf16", *switches])
    result = train(cfg, console=False)
    vals = _vals(result.run_dir)
    assert all(v == v for v in vals) and vals[-1] < vals[0] - 0.5, vals


@pytest.mark.parametrize("switches", [
    ["model.kernels=fp8", "model.qkv_path=reference"],                            # the baseline's kernels
    ["model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16",  # candidate switches
     "train.optimizer_compile=true"],
    # the baseline as the record preset runs it: NorMuon's update compiled too
    ["model.kernels=fp8", "model.qkv_path=reference", "train.optimizer_compile=true"],
    # the MLP input's amax and cast traced into the graph (model.mlp_input_quant=graph)
    ["model.kernels=fp8", "model.qkv_path=reference", "model.mlp_input_quant=graph"],
    # the embedding rows looked up inside the compiled network (model.embedding_grad=atomic_graph)
    ["model.kernels=fp8", "model.qkv_path=reference", "model.embedding_grad=atomic_graph"],
    # the MLP bank's gradient summed in place by beta=1 GEMMs, the gate GEMMs padded
    ["model.kernels=fp8", "model.qkv_path=reference", "model.mlp_weight_grad=accumulate", "model.gate_gemm_align=8"],
    # merged micro-batches (stage 1's 4 chunks of 512 tokens as 2 of 1,024), both presets' switches
    ["model.kernels=fp8", "model.mlp_input_quant=graph", "model.mlp_weight_grad=accumulate", "model.gate_gemm_align=8",
     "train.optimizer_compile=true", "train.grad_accum=4", "train.min_micro_batch_tokens=1024"],
    ["model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16", "model.fp8_input_scaling=delayed",
     "model.qk_prep_fp8_grad=true", "train.optimizer_compile=true", "train.grad_accum=4",
     "train.min_micro_batch_tokens=1024"],
])
def test_record_code_path_compiles_whole_and_trains_on_gpu(tmp_path, switches):
    """Compiled (one graph per shape, fused kernels as opaque ops): trains, and the warmup compiled
    every shape the timed region uses."""
    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.model_dim=128", "model.num_heads=4", "model.qk_head_dim=32", "model.v_head_dim=32",
                          "train.steps=30", "train.num_extension=3", "train.val_every=15", "train.val_tokens=16384",
                          f"out_dir={tmp_path}", "train.dtype=bf16", "train.compile=true", "train.warmup_steps=2",
                          *switches])
    result = train(cfg, console=False)
    vals = _vals(result.run_dir)
    assert all(v == v for v in vals) and vals[-1] < vals[0] - 0.5, vals
    assert "compilations during the timed region: 0" in (result.run_dir / "log.txt").read_text()
