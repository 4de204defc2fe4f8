"""build_run is the one way to get a run; the model contract replaces attribute probing."""

import pytest
import torch

from speedrun import distributed
from speedrun.config import preset
from speedrun.errors import ConfigError


def _tiny():
    cfg = preset("tiny")
    cfg.train.steps = 2
    return cfg


class _Built(Exception):
    pass


def test_train_and_bench_build_the_same_run(monkeypatch):
    """train() and bench step's sessions both come from build_run: same weights, dtype, options."""
    from speedrun.evidence.bench import build_session
    from speedrun.train import builder, loop

    info = distributed.DistInfo()
    run = builder.build_run(_tiny(), info)
    session = build_session("a", _tiny(), 0, info)
    try:
        assert session.dtype == run.dtype and type(session.model) is type(run.model)
        for (name, a), (_, b) in zip(run.model.state_dict().items(), session.model.state_dict().items()):
            assert torch.equal(a, b), name
    finally:
        session.close()
    seen = []

    def spy(cfg, info):
        seen.append(cfg)
        raise _Built

    monkeypatch.setattr(loop, "build_run", spy)
    with pytest.raises(_Built):
        loop.train(_tiny(), console=False)
    assert len(seen) == 1


def test_build_run_checks_the_kernel_options_and_hands_them_to_the_fused_kernels():
    from speedrun.train.builder import build_run

    cfg = preset("tiny-record")
    cfg.model.kernels = "fp8_full"
    cfg.train.ce_sigmoid, cfg.train.mlp_gemm = "tanh", "split"
    run = build_run(cfg, distributed.DistInfo())
    assert run.kernel_options.ce_sigmoid == "tanh" and run.kernel_options.mlp_gemm_route == "split"
    assert run.model.ce_impl.options is run.kernel_options and run.model.mlp_impl.options is run.kernel_options
    cfg.train.ce_grad_layout = "both"
    with pytest.raises(ConfigError, match="train.ce_grad_layout.*one of transpose, dual"):
        build_run(cfg, distributed.DistInfo())


def test_trainable_model_hooks_default_to_nothing():
    from speedrun.model.gpt import GPT
    from speedrun.model.interface import TrainableModel
    from speedrun.model.record import RecordGPT

    assert issubclass(GPT, TrainableModel) and issubclass(RecordGPT, TrainableModel)
    m = TrainableModel()
    for hook in (m.flush_weight_grads, m.flush_embedding_grads, m.after_optimizer_step, m.end_step,
                 m.after_evaluation, m.reset_after_warmup):
        assert hook() is None
    assert m.bigram_mod is None and not m.uses_fp8_weights and not m.generates_text
    assert m.cast_for_training(torch.bfloat16) is m
    assert m.extra_state() == {"fp8": {}, "embedding_grads": {}}
    m.load_extra_state({"fp8": {}, "embedding_grads": {}})
    with pytest.raises(ValueError, match="'fp8' state"):
        m.load_extra_state({"fp8": {"mlp_weights": {}}})
    with pytest.raises(ConfigError, match="has no compile_body"):
        m.compile_body()


def test_the_loop_and_the_bench_do_not_probe_the_model():
    """Hooks, not hasattr/getattr on the model, in the code that trains and times it."""
    import inspect

    from speedrun.evidence import bench
    from speedrun.train import builder, loop, recipes

    for module in (loop, builder, recipes, bench):
        src = inspect.getsource(module)
        assert "hasattr(model" not in src and "getattr(model" not in src and "getattr(self.model" not in src, module
