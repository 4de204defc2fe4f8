"""Rank-of-N bench on a GPU: a simulated rank 0 of 8 steps the record's and the candidate's FP8
code paths with CUDA graphs and the compiled optimizer, its weights stay finite (the no-op
gathers never leave uninitialised memory in them), and bench step reports the simulation."""

import pytest
import torch

from speedrun import distributed
from speedrun.config import apply_overrides, preset
from speedrun.evidence.arms import parse_arms
from speedrun.evidence.bench import bench_step, build_session
from speedrun.optim.simcomms import SimulatedComms
from speedrun.train.graphs import STEPS_UNTIL_REPLAY

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("use_builtin_cache")]

SHAPE = ["model.model_dim=128", "model.num_heads=4", "model.qk_head_dim=32", "model.v_head_dim=32",
         "train.steps=40", "train.num_extension=4", "train.dtype=bf16", "train.grad_accum=0",
         "train.cuda_graphs=on"]
RECORD = ["model.kernels=fp8", "model.mlp_input_quant=graph", "model.mlp_weight_grad=accumulate",
          "model.gate_gemm_align=8", "train.optimizer_compile=true"]
CANDIDATE = ["model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16",
             "model.fp8_input_scaling=delayed", "model.qk_prep_fp8_grad=true", "train.optimizer_compile=true"]


@pytest.mark.parametrize("switches", [RECORD, CANDIDATE], ids=["record", "candidate"])
@pytest.mark.parametrize("stage", [0, 2])
def test_a_simulated_rank_of_8_steps_with_graphs_and_stays_finite(tmp_path, switches, stage):
    cfg = preset("tiny-record")
    apply_overrides(cfg, [*SHAPE, f"out_dir={tmp_path}", *switches])
    s = build_session("arm", cfg, stage, distributed.setup("cuda"), simulate_world=8)
    try:
        assert isinstance(s.optimizer.comms, SimulatedComms) and s.optimizer.comms.world == 8
        for _ in range(STEPS_UNTIL_REPLAY + 4):  # even and odd (Adam) steps, captured then replayed
            loss = s.step()
        torch.cuda.synchronize()
        assert torch.isfinite(loss), loss
        for name, p in s.model.named_parameters():
            assert torch.isfinite(p).all(), name
        g = s.graphs.summary()
        assert g["replayed_steps"] > 0 and g["captures"] > 0, g
    finally:
        s.close()


def test_bench_step_as_rank_of_8_on_gpu():
    arms = parse_arms(["rec=tiny-record:" + ",".join(RECORD), "cand=tiny-record:" + ",".join(CANDIDATE)])
    res = bench_step(arms, stage=1, steps=20, warmup=3, common=SHAPE, simulate_world=8)
    assert res["simulated_world"] == 8 and "rank 0 of 8 simulated" in res["simulation"]
    for a in res["arms"]:
        assert a["grad_accum"] == 1 and a["micro_batch_tokens"] == a["stage"]["batch_tokens"] // 8
        assert all(t > 0 for t in a["times_ms"]) and a["peak_mib"] > 0
        assert a["cuda_graphs"]["replayed_steps"] > 0
