"""CUDA-graph steps (speedrun.train.graphs, speedrun.train.update_graphs) on a GPU: captured steps
and optimizer updates train as the eager ones do, each capture passes its self-check, and a
replayed step's micro-batches and update issue no eager kernel."""

import json

import pytest
import torch

from speedrun.config import apply_overrides, preset
from speedrun.train.graphs import CHECK_TOLERANCE, STEPS_UNTIL_REPLAY, STEPS_UNTIL_UPDATE_REPLAY
from speedrun.train.loop import train

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("use_builtin_cache")]

RECORD = ["model.kernels=fp8", "model.mlp_input_quant=graph", "model.mlp_weight_grad=accumulate",
          "model.gate_gemm_align=8", "train.optimizer_compile=true",
          "train.cuda_graph_optimizer=true"]
CANDIDATE = ["model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16",
             "model.fp8_input_scaling=delayed", "model.qk_prep_fp8_grad=true", "train.optimizer_compile=true",
             "train.cuda_graph_optimizer=true"]


def _train_losses(tmp_path, switches, graphs: str):
    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.model_dim=128", "model.num_heads=4", "model.qk_head_dim=32", "model.v_head_dim=32",
                          "train.steps=40", "train.num_extension=4", "train.val_every=0", "train.log_every=1",
                          "train.val_tokens=16384", f"out_dir={tmp_path / graphs}", "train.dtype=bf16",
                          f"train.cuda_graphs={graphs}", *switches])
    result = train(cfg, console=False)
    metrics = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [m["loss"] for m in metrics if m["event"] == "train"]
    graph_summary = next((m for m in metrics if m["event"] == "cuda_graphs"), None)
    return losses, graph_summary, (result.run_dir / "log.txt").read_text()


@pytest.mark.parametrize("compile_", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("switches", [RECORD, CANDIDATE], ids=["record", "candidate"])
def test_graph_steps_train_as_the_eager_loop(tmp_path, switches, compile_):
    """40 steps over the three stages and the extension, with and without graphs, from the same
    initialisation and data: the same losses within the run-to-run noise of atomic adds, and most
    steps replayed."""
    extra = [f"train.compile={str(compile_).lower()}", "train.warmup_steps=2"]
    eager, none, _ = _train_losses(tmp_path, switches + extra, "off")
    graphed, summary, log = _train_losses(tmp_path, switches + extra, "on")
    assert none is None and summary is not None, log
    assert len(graphed) == len(eager) == 40
    worst = max(abs(a - b) / abs(b) for a, b in zip(graphed, eager))
    assert worst < 2e-2, (worst, graphed, eager)
    # four stages of ~10 steps: each replays from its STEPS_UNTIL_REPLAY-th step on
    assert summary["replayed_steps"] >= 40 - 4 * (STEPS_UNTIL_REPLAY + 1), summary
    assert summary["captures"] >= 8 and summary["check_worst_rel_err"] <= CHECK_TOLERANCE, summary
    # the optimizer's updates: their keys hold the gradients' addresses (the run-long buffers, the
    # same in every stage), the plan (Adam or not, tied or split) and the device work captured with
    # the update (the flush on Adam steps, the FP8 refresh and its scaling rule, which changes after
    # the weight caches' first refreshes), so some keys come and go early: 16 of 40 replayed at least
    assert summary["update_captures"] >= 2 and summary["replayed_updates"] >= 16, summary
    if compile_:
        assert "compilations during the timed region: 0" in log


def test_replayed_step_launches_one_graph(tmp_path):
    """The micro-batch loop of a replayed step and its optimizer update: one graph launch each and
    no kernel launched eagerly (the inputs, the loss weights and the update's values travel by
    copies)."""
    from torch.profiler import ProfilerActivity, profile

    from speedrun import distributed
    from speedrun.evidence.bench import build_session

    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.model_dim=128", "model.num_heads=4", "model.qk_head_dim=32", "model.v_head_dim=32",
                          "train.steps=40", "train.num_extension=4", f"out_dir={tmp_path}", "train.dtype=bf16",
                          "train.cuda_graphs=on", *CANDIDATE])
    session = build_session("cand", cfg, 0, distributed.setup(cfg.train.device))
    traced_names: dict[str, list[str]] = {"loop": [], "update": []}

    def traced(real, names):
        def run(*args, **kwargs):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = real(*args, **kwargs)
                torch.cuda.synchronize()
            names.extend(e.name for e in prof.events())
            return out

        return run

    try:
        for _ in range(STEPS_UNTIL_UPDATE_REPLAY):
            session.step()
        updates = session.recipe.update_graphs
        assert updates is session.graphs.updates is not None
        session.graphs.run = traced(session.graphs.run, traced_names["loop"])
        updates.launch = traced(updates.launch, traced_names["update"])
        before = session.graphs.stats.replayed_steps, session.graphs.stats.replayed_updates
        session.step()
    finally:
        session.close()
    assert (session.graphs.stats.replayed_steps, session.graphs.stats.replayed_updates) == (before[0] + 1,
                                                                                           before[1] + 1)
    for part, names in traced_names.items():
        launches = [n for n in names if n in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                              "cuLaunchKernelEx")]
        assert names.count("cudaGraphLaunch") == 1, (part, sorted(set(names)))
        assert not launches, (part, launches)


_LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


@pytest.mark.parametrize("switches", [RECORD, CANDIDATE], ids=["record", "candidate"])
def test_a_replayed_step_launches_no_kernel_outside_its_graphs(tmp_path, switches):
    """Two whole steps (an even one and an Adam one) once everything replays, under the profiler:
    each launches its loop's graph and its update's (which holds the embedding tables' gradient
    flush and the FP8 weight copies' refresh too), and no kernel outside them: issue 32's "no
    eager kernel besides the input copies" on one rank."""
    from torch.profiler import ProfilerActivity, profile

    from speedrun import distributed
    from speedrun.evidence.bench import build_session

    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.model_dim=128", "model.num_heads=4", "model.qk_head_dim=32", "model.v_head_dim=32",
                          "train.steps=40", "train.num_extension=4", f"out_dir={tmp_path}", "train.dtype=bf16",
                          "train.cuda_graphs=on", *switches])
    session = build_session("arm", cfg, 0, distributed.setup(cfg.train.device))
    try:
        for _ in range(STEPS_UNTIL_UPDATE_REPLAY + 1):
            session.step()
        before = session.graphs.stats.replayed_steps, session.graphs.stats.replayed_updates
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                session.step()
            torch.cuda.synchronize()
    finally:
        session.close()
    stats = session.graphs.stats
    assert (stats.replayed_steps, stats.replayed_updates) == (before[0] + 2, before[1] + 2)
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 4
    outside = [n for n in names if n in _LAUNCHES]
    assert not outside, outside


@pytest.mark.parametrize("arm", ["record", "candidate"])
def test_record_shape_graphs_pass_their_self_check(webmix_dir, arm):
    """The presets at stage-1 shapes (8 micro-batches of 16,384 tokens): both step keys and both
    update keys captured, each replay equal to the eager run within the check's tolerance, and
    the replayed steps cost the keys' address watches no walk."""
    from speedrun import distributed
    from speedrun.evidence.bench import build_session

    cfg = preset(arm)
    apply_overrides(cfg, [f"data.train_files={webmix_dir}/webmix_train_*.bin",
                          f"data.val_files={webmix_dir}/webmix_val_*.bin", "train.max_docs=256",
                          "train.cuda_graphs=on", "train.cuda_graph_optimizer=true"])
    session = build_session(arm, cfg, 0, distributed.setup(cfg.train.device))
    watches = [session.graphs._watch, session.graphs.updates._watch]
    try:
        for _ in range(STEPS_UNTIL_UPDATE_REPLAY):
            session.step()
        walks = [w.walks for w in watches]
        for _ in range(2):  # both keys of the loop and of the update replay
            session.step()
    finally:
        session.close()
    summary = session.graphs.summary()
    assert summary["captures"] == 2 and summary["replayed_steps"] == 4, summary
    assert summary["update_captures"] == 2 and summary["replayed_updates"] == 2, summary
    assert [w.walks for w in watches] == walks  # replays leave the keys' watches settled: no walk
    assert summary["check_worst_rel_err"] <= CHECK_TOLERANCE, summary
