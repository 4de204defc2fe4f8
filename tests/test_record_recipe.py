"""The record recipe's training path (RecordGPT + NorMuon/Adam + RecordSchedule) on the CPU."""

import json

import pytest
import torch

from speedrun.config import apply_overrides, preset
from speedrun.optim.schedule import RecordSchedule
from speedrun.train.checkpoint import list_checkpoints
from speedrun.train.loop import train
from speedrun.train.recipes import record_stages_scaled, stages_of


pytestmark = pytest.mark.usefixtures("use_builtin_cache")


def tiny_record(tmp_path, *extra):
    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12",
                          "train.batch_divisor=256", "train.steps=21", "train.num_extension=3",
                          "train.val_tokens=2048", "train.val_every=0", "train.log_every=3",
                          f"out_dir={tmp_path / 'runs'}", *extra])
    return cfg


def test_record_stages_scale_and_follow_the_schedule():
    cfg = preset("record")
    stages = stages_of(cfg)
    assert [s.start_step for s in stages] == [0, 423, 847, 1270]
    assert [s.batch_tokens for s in stages] == [131072, 262144, 393216, 393216]
    assert [(s.window_short, s.window_long) for s in stages] == [(128, 384), (384, 896), (640, 1408), (768, 1664)]
    small = record_stages_scaled(64, 8)
    assert [s.batch_tokens for s in small] == [2048, 4096, 6144, 6144]
    assert [s.max_seq_len for s in small] == [112, 256, 256, 256]
    sched = RecordSchedule(18, 3, stages=small, block_size=16)
    assert sched.at(6).window_long == 7 * 16 and sched.at(6).yarn_change


def test_tiny_record_recipe_learns(tmp_path):
    cfg = tiny_record(tmp_path, "train.val_every=21")
    result = train(cfg, console=False)
    metrics = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [m["val_loss"] for m in metrics if m["event"] == "val"]
    assert len(vals) == 2 and vals[-1] < vals[0] - 1.0, vals
    log = (result.run_dir / "log.txt").read_text()
    assert "step:21/21 val_loss:" in log


@pytest.fixture(scope="module")
def uninterrupted_tiny_record(tmp_path_factory, builtin_cache):
    """The final weights of the 12-step run never killed, which every resume test below compares
    with: made once per module and worker (it is the same run whatever the stop)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPEEDRUN_CACHE_DIR", str(builtin_cache))
        cfg = tiny_record(tmp_path_factory.mktemp("uninterrupted"), "train.checkpoint_every=1", "train.steps=12")
        whole = train(cfg, console=False)
    return torch.load(list_checkpoints(whole.run_dir)[-1], weights_only=False)["model"]


@pytest.mark.parametrize("stop", [3, 5, 10])
def test_tiny_record_resume_equals_uninterrupted(tmp_path, uninterrupted_tiny_record, stop):
    """Kill after ``stop`` steps, resume from that checkpoint: the same weights as a run never
    killed (that run is shared by the three stops).  3: a stage boundary (stages start at 0, 3, 6,
    9); 3 and 5: after an even step, when Adam's gradients of two steps are half summed; 10: inside
    the extension."""
    cfg = tiny_record(tmp_path, "train.checkpoint_every=1", "train.steps=12")
    cut = train(tiny_record(tmp_path, "train.checkpoint_every=1", "train.steps=12"), console=False, stop_after=stop)
    resumed = train(cfg, run_dir=cut.run_dir, resume=True, console=False)
    a = uninterrupted_tiny_record
    b = torch.load(list_checkpoints(resumed.run_dir)[-1], weights_only=False)["model"]
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_record_schedule_needs_the_record_network(tmp_path):
    from speedrun.errors import ConfigError

    cfg = tiny_record(tmp_path, "model.architecture=core")
    with pytest.raises(ConfigError, match="architecture=record"):
        train(cfg, console=False)


def test_optimizer_kernels_switch_reaches_the_optimizer(tmp_path):
    """train.optimizer_kernels picks NorMuonAndAdam's kernels (an A/B arm for the one-pass Adam
    and the Polar Express kernels); a bad value is a clear error."""
    from speedrun.errors import ConfigError
    from speedrun.model import build_model
    from speedrun.train.recipes import build_recipe

    for value, expected in (("auto", None), ("reference", False), ("triton", True)):
        cfg = tiny_record(tmp_path, f"train.optimizer_kernels={value}")
        recipe = build_recipe(cfg, build_model(cfg.model), None)
        assert recipe.optimizer.use_triton is expected, value
    cfg = tiny_record(tmp_path, "train.optimizer_kernels=fast")
    with pytest.raises(ConfigError, match="optimizer_kernels must be one of auto, triton, reference"):
        build_recipe(cfg, build_model(cfg.model), None)


def test_optimizer_compile_switch_reaches_the_optimizer(tmp_path):
    """train.optimizer_compile hands Inductor to NorMuon's update (an A/B arm; off by default)."""
    from speedrun.model import build_model
    from speedrun.train.recipes import build_recipe

    for sets, expected in (((), None), (("train.optimizer_compile=true",), "inductor")):
        cfg = tiny_record(tmp_path, *sets)
        recipe = build_recipe(cfg, build_model(cfg.model), None)
        assert recipe.optimizer.compile_backend == expected, sets


def test_compiled_normuon_on_a_cpu_torch_that_cannot_is_refused(tmp_path, monkeypatch):
    from speedrun import distributed
    from speedrun.errors import ConfigError
    from speedrun.model import build_model
    from speedrun.train import recipes

    monkeypatch.setattr(recipes, "cpu_inductor_compiles_bf16_normuon", lambda: False)
    cfg = tiny_record(tmp_path, "train.optimizer_compile=true", "train.dtype=bf16")
    with pytest.raises(ConfigError, match="optimizer_compile=true with train.dtype=bf16 on the CPU needs torch >= 2.13"):
        recipes.build_recipe(cfg, build_model(cfg.model), distributed.DistInfo())
    cfg = tiny_record(tmp_path, "train.optimizer_compile=true")  # fp32 on the CPU: fine
    assert recipes.build_recipe(cfg, build_model(cfg.model), distributed.DistInfo()).optimizer.compile_backend


def test_fused_normuon_update_trains_like_the_eager_one(tmp_path):
    """train.optimizer_compile=true (NorMuon's update through Inductor, here on the CPU) follows
    the eager update, and the warmup makes every graph: none in the timed region, although the
    schedule changes lr, momentum and decay every step."""
    out = {}
    for flag in ("false", "true"):
        cfg = tiny_record(tmp_path, f"train.optimizer_compile={flag}", "train.warmup_steps=1", "train.steps=9",
                          "train.num_extension=3", "train.val_every=3", f"name=fused-{flag}")
        result = train(cfg, console=False)
        metrics = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        out[flag] = metrics
    vals = {flag: [m["val_loss"] for m in ms if m["event"] == "val"] for flag, ms in out.items()}
    assert len(vals["true"]) == 4 and vals["true"][-1] < vals["true"][0] - 0.5, vals
    for a, b in zip(vals["false"], vals["true"]):
        assert abs(a - b) < 3e-4 * abs(a), vals  # seen: 4e-5
    assert [m["count"] for m in out["true"] if m["event"] == "recompiles"] == [0]


@pytest.mark.parametrize("kernels", ["triton", "fp8_full"])
def test_fused_kernels_train_like_the_reference(tmp_path, kernels):
    """The record network with the Triton head and MLP (interpreted on CPU) follows the plain path."""
    from speedrun.model.record import RecordGPT
    from speedrun.model.interface import ForwardArgs
    from types import SimpleNamespace

    cfg = preset("tiny-record").model
    apply_overrides_model = dict(num_layers=4, model_dim=32, num_heads=2, qk_head_dim=16, v_head_dim=16)
    for k, v in apply_overrides_model.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    ref = RecordGPT(cfg)
    cfg.kernels = kernels
    torch.manual_seed(0)
    fused = RecordGPT(cfg)
    fused.load_state_dict(ref.state_dict())
    with torch.no_grad():
        for p in list(ref.parameters()):
            p.add_(torch.randn_like(p) * 0.02)
        fused.load_state_dict(ref.state_dict())
    T = 64
    g = torch.Generator().manual_seed(1)
    batch = SimpleNamespace(inputs=torch.randint(0, 257, (T,), generator=g, dtype=torch.int32),
                            targets=torch.randint(0, 257, (T,), generator=g),
                            cu_seqlens=torch.tensor([0, 30, T, T], dtype=torch.int32), max_seqlen=T, bigram=None)
    args = ForwardArgs(window_short=16, window_long=48, mtp_weights=(1.0, 0.5), prefix_weight=0.0)
    lr, lf = ref.loss(batch, args), fused.loss(batch, args)
    lr.backward()
    lf.backward()
    ref.flush_embedding_grads()  # the preset accumulates the embedding tables' gradients in place
    fused.flush_embedding_grads()
    bound = 2e-2 if kernels == "triton" else 1e-1
    assert abs(lf.item() - lr.item()) / lr.item() < bound
    for (name, pr), (_, pf) in zip(ref.named_parameters(), fused.named_parameters()):
        if pr.grad is None or pr.grad.norm() == 0:
            continue
        err = ((pf.grad - pr.grad).norm() / pr.grad.norm()).item()
        assert err < (5e-2 if kernels == "triton" else 0.25), (name, err)


@pytest.mark.parametrize("input_scaling", ["current", "delayed"])
def test_fp8_candidate_resume_equals_uninterrupted(tmp_path, kernels_use_references, input_scaling):
    """FP8 delayed scales (MLP weight cache, packed QKV weights, MLP activations, and the MLP's x/g
    scales when delayed) are part of the checkpoint: without them a resumed run re-bootstraps its
    scales and drifts from the uninterrupted one.  With a warmup, whose FP8 scales are reset before
    the resumed run loads the saved ones.  (PyTorch reference kernels: the scale bookkeeping is
    the same code.)"""
    extra = ("model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16", "train.batch_divisor=1024",
             "train.checkpoint_every=3", "train.steps=8", "train.num_extension=1", "train.warmup_steps=1",
             f"model.fp8_input_scaling={input_scaling}")
    whole = train(tiny_record(tmp_path, *extra), console=False)
    cut = train(tiny_record(tmp_path, *extra), console=False, stop_after=5)
    resumed = train(tiny_record(tmp_path, *extra), run_dir=cut.run_dir, resume=True, console=False)
    a = torch.load(list_checkpoints(whole.run_dir)[-1], weights_only=False)
    b = torch.load(list_checkpoints(resumed.run_dir)[-1], weights_only=False)
    (state,) = a["fp8"]  # one rank
    delayed = input_scaling == "delayed"
    sections = {"mlp_weights", "qkv", "mlp_activations"} | ({"qkv_inputs"} if delayed else set())
    assert set(state) == sections and set(b["fp8"][0]) == set(state)
    assert all(bool(v["post_ready"]) for v in state["mlp_activations"].values())
    if delayed:
        assert all(v["x_ready"] and v["g_ready"] and v["x_amax"] > 0 for v in state["qkv_inputs"].values())
    assert all(v["input_scaling"] == input_scaling and bool(v["g_ready"]) == delayed and (v["x_amax"] is not None) == delayed
               for v in state["mlp_activations"].values())
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


@pytest.mark.parametrize("switches", [("model.kernels=fp8",),
                                      ("model.kernels=fp8_full", "model.qkv_path=fused_fp8", "model.qk_head_dim=16",
                                       "model.fp8_input_scaling=delayed")], ids=["record", "candidate"])
def test_fp8_warmup_is_undone(tmp_path, kernels_use_references, switches):
    """The untimed warmup's FP8 scales go with its weights: the MLP weight cache (past its 16
    bootstrap updates after this warmup's 18 refreshes), the packed QKV weights' delayed scales and
    the activation scales are reset, so a run with a warmup takes the very steps of one without
    (upstream's scales are buffers restored with its weights).  Without the reset the warmed run
    starts from the warmup's scales and drifts."""
    extra = (*switches, "train.batch_divisor=1024", "train.steps=12", "train.num_extension=3")
    weights = []
    for warmup in (0, 3):
        result = train(tiny_record(tmp_path / str(warmup), *extra, f"train.warmup_steps={warmup}"), console=False)
        weights.append(torch.load(list_checkpoints(result.run_dir)[-1], weights_only=False)["model"])
    for k in weights[0]:
        assert torch.equal(weights[0][k], weights[1][k]), k


def test_warmup_runs_only_the_steps_a_short_stage_has(tmp_path, monkeypatch):
    """4 scheduled steps (stages of 1, 2 and 1 steps) + a 1-step extension, 2 warmup steps per
    stage: the warmup runs the steps each stage has instead of stepping past the end of the
    schedule (which raised)."""
    from speedrun.train import loop

    steps = []
    real = loop.run_step

    def spy(model, recipe, loader, step, *args, **kwargs):
        steps.append(step)
        return real(model, recipe, loader, step, *args, **kwargs)

    monkeypatch.setattr(loop, "run_step", spy)
    result = train(tiny_record(tmp_path, "train.steps=5", "train.num_extension=1", "train.warmup_steps=2"),
                   console=False)
    assert result.final_val_loss == result.final_val_loss
    assert steps == [0, 1, 2, 3, 4] + [0, 1, 2, 3, 4]  # the warmup, then the timed run


@pytest.mark.parametrize("extra", [[], ["model.embedding_grad=atomic_graph"], ["model.kernels=fp8"]],
                         ids=["preset", "lookups_in_graph", "fp8"])
def test_compiled_run_never_recompiles_after_the_warmup(tmp_path, monkeypatch, request, extra):
    """The warmup compiles every training stage and every validation the run will make (mid-run
    ones in several stages, and the final one with its wider window): the timed region, and the
    validations inside it, compile nothing, also with the embedding lookups traced into the
    network, and with the FP8 kernels, which validation leaves out (the network then branches on
    ``training``).  (Dynamo with its eager backend: the guards and recompiles are Dynamo's, no
    code generation needed; the FP8 kernels as their PyTorch references.)"""
    import torch._dynamo
    from speedrun.model.record import RecordGPT

    if "model.kernels=fp8" in extra:
        request.getfixturevalue("kernels_use_references")

    real = RecordGPT.compile_body
    monkeypatch.setattr(RecordGPT, "compile_body", lambda self, **kw: real(self, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    cfg = tiny_record(tmp_path, "train.compile=true", "train.warmup_steps=1", "train.steps=12", "train.val_every=5",
                      *extra)
    result = train(cfg, console=False)
    metrics = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if m["event"] == "val"] == [0, 5, 10, 12]  # stages 0, 1, 3, final
    (recompiles,) = [m["count"] for m in metrics if m["event"] == "recompiles"]
    assert recompiles == 0
    assert "compilations during the timed region: 0" in (result.run_dir / "log.txt").read_text()
