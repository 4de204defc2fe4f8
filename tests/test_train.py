"""The training loop end to end on the CPU: loss falls, validation, run folder, resume equality."""

import json

import pytest
import torch

from speedrun.config import Stage, apply_overrides, preset
from speedrun.data import write_shard
from speedrun.errors import ConfigError
from speedrun.train.checkpoint import list_checkpoints
from speedrun.train.loop import train


pytestmark = pytest.mark.usefixtures("use_builtin_cache")


def small_cfg(tmp_path, **train):
    cfg = preset("tiny")
    apply_overrides(cfg, [
        "model.num_layers=2", "model.model_dim=64", "model.num_heads=2", "model.qk_head_dim=16",
        "model.v_head_dim=32", "train.batch_tokens=1024", "train.max_seq_len=128", "train.steps=30",
        "train.val_every=15", "train.val_tokens=4096", "train.log_every=5", "train.sample_tokens=20",
        "train.lr_warmup_steps=5", f"out_dir={tmp_path / 'runs'}",
    ])
    for k, v in train.items():
        setattr(cfg.train, k, v)
    return cfg


def final_weights(run_dir):
    ckpt = list_checkpoints(run_dir)[-1]
    return torch.load(ckpt, weights_only=False)["model"]


def test_tiny_run_learns_and_writes_its_folder(tmp_path):
    cfg = small_cfg(tmp_path)
    result = train(cfg, console=False)
    d = result.run_dir
    metrics = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    vals = [m["val_loss"] for m in metrics if m["event"] == "val"]
    assert len(vals) == 3  # steps 0, 15, 30
    assert vals[-1] < vals[0] - 0.8, vals
    losses = [m["loss"] for m in metrics if m["event"] == "train"]
    assert losses[-1] < losses[0]
    log = (d / "log.txt").read_text()
    assert "step:30/30 val_loss:" in log and "step:30/30 train_time:" in log
    assert "seed: 1337" in log and "Running PyTorch" in log and "git commit:" in log
    assert "attention backend: reference (model.attention_backend=auto)" in log  # auto, resolved on a CPU
    assert json.loads((d / "config.json").read_text())["train"]["steps"] == 30
    assert (d / "sample.txt").exists() and len(result.sample) > 0
    assert json.loads((d / "summary.json").read_text())["final_val_loss"] == pytest.approx(vals[-1])


@pytest.mark.parametrize("merge", [False, True])
def test_resume_after_kill_equals_uninterrupted_run(tmp_path, merge):
    # merge: two micro-batches of 512 tokens taken as one of 1,024 (train.min_micro_batch_tokens)
    extra = dict(grad_accum=2, min_micro_batch_tokens=1024) if merge else {}
    cfg = small_cfg(tmp_path, steps=12, val_every=0, checkpoint_every=4, **extra)
    whole = train(cfg, console=False)
    # The same run, killed right after its step-8 checkpoint, then resumed.
    cut = train(small_cfg(tmp_path, steps=12, val_every=0, checkpoint_every=4, **extra), console=False, stop_after=8)
    assert cut.stopped_early
    assert [p.name for p in list_checkpoints(cut.run_dir)][-1] == "step_000008.pt"
    resumed = train(cfg, run_dir=cut.run_dir, resume=True, console=False)
    a, b = final_weights(whole.run_dir), final_weights(resumed.run_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed.final_val_loss == pytest.approx(whole.final_val_loss, abs=0)


def test_warmup_is_untimed_and_undone(tmp_path):
    plain = train(small_cfg(tmp_path, steps=6, val_every=0), console=False)
    warmed = train(small_cfg(tmp_path, steps=6, val_every=0, warmup_steps=2), console=False)
    a, b = final_weights(plain.run_dir), final_weights(warmed.run_dir)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_stages_change_batch_and_window(tmp_path):
    cfg = small_cfg(tmp_path, steps=6, val_every=0)
    cfg.train.stages = [Stage(0, 512, 64, 16, 16), Stage(3, 1024, 128, 32, 32)]
    result = train(cfg, console=False)
    assert result.final_val_loss == result.final_val_loss  # finite, not NaN


def test_shard_data_with_vocab_mismatch_is_a_clear_error(tmp_path):
    import numpy as np

    from speedrun.errors import SpeedrunError

    tokens = np.array([256, 1, 2, 3, 300, 5] * 400, dtype=np.uint16)
    write_shard(tmp_path / "x_train_000000.bin", tokens)
    write_shard(tmp_path / "x_val_000000.bin", tokens)
    cfg = small_cfg(tmp_path, steps=2)
    apply_overrides(cfg, ["data.source=shards", f"data.train_files={tmp_path}/x_train_*.bin",
                          f"data.val_files={tmp_path}/x_val_*.bin", "data.tokenizer=bytes"])
    with pytest.raises(SpeedrunError, match="300|vocab"):
        train(cfg, console=False)


def test_model_vocab_wider_than_tokenizer_is_refused_before_training(tmp_path):
    """GPT-2 shards, the byte tokenizer and model.vocab_size widened to let the ids through: the
    shard check passes, so the mismatch must be caught up front (it used to train with the wrong
    BOS split and fail only when decoding the final sample)."""
    import numpy as np

    tokens = np.array([50256, 11, 300, 5000, 7] * 400, dtype=np.uint16)
    write_shard(tmp_path / "g_train_000000.bin", tokens)
    write_shard(tmp_path / "g_val_000000.bin", tokens)
    cfg = small_cfg(tmp_path, steps=2)
    apply_overrides(cfg, ["data.source=shards", f"data.train_files={tmp_path}/g_train_*.bin",
                          f"data.val_files={tmp_path}/g_val_*.bin", "data.tokenizer=bytes",
                          "model.vocab_size=50257"])
    with pytest.raises(ConfigError, match="tokenizer bytes has 257 ids but model.vocab_size is 50257"):
        train(cfg, console=False)
    assert not list(tmp_path.rglob("log.txt")), "refused before a run folder was written"


def test_micro_batching_merges_by_the_smallest_sufficient_divisor():
    from speedrun.train.loop import MicroBatching, micro_batching

    cfg = preset("record")  # 8 micro-batches on one GPU: chunks of 16,384 / 32,768 / 49,152 tokens
    stages = [Stage(0, 131072, 2048, 128, 384), Stage(1, 262144, 2048, 128, 384), Stage(2, 393216, 2048, 128, 384)]
    plans = lambda world: [micro_batching(s, cfg, world) for s in stages]  # noqa: E731
    assert plans(1) == [MicroBatching(16384, 1, 8), MicroBatching(32768, 1, 8), MicroBatching(49152, 1, 8)]
    cfg.train.min_micro_batch_tokens = 49152
    assert plans(1) == [MicroBatching(16384, 4, 2), MicroBatching(32768, 2, 4), MicroBatching(49152, 1, 8)]
    assert [p.tokens for p in plans(1)] == [65536, 65536, 49152]
    cfg.train.min_micro_batch_tokens = 40000  # 3 chunks would do, but 3 does not divide 8
    assert plans(1)[0] == MicroBatching(16384, 4, 2)
    assert plans(2)[0] == MicroBatching(16384, 4, 1)  # 2 ranks: 4 chunks each, all merged
    assert plans(8)[0] == MicroBatching(16384, 1, 1)  # 8 ranks: nothing to merge
    cfg.train.min_micro_batch_tokens = 10**9  # more than a whole step: one micro-batch per rank
    assert plans(1)[2] == MicroBatching(49152, 8, 1)
    for bad in (-1, 1.5, True):
        cfg.train.min_micro_batch_tokens = bad
        with pytest.raises(ConfigError, match="min_micro_batch_tokens"):
            micro_batching(stages[0], cfg, 1)


def _one_step_grads(cfg):
    """Gradients of one training step (optimizer not applied) and its mean loss."""
    from speedrun import distributed
    from speedrun.data import TrainLoader
    from speedrun.model import build_model
    from speedrun.train.loop import micro_batching, resolve_data, run_step
    from speedrun.train.recipes import build_recipe

    info = distributed.DistInfo()
    train_files, _, tokenizer = resolve_data(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    recipe = build_recipe(cfg, model, info, tokenizer)

    def no_update(step, mark=None, before=None):  # the gradients as the update would read them
        if before is not None:
            before.launch()

    recipe.optimizer_step = no_update
    plan = micro_batching(recipe.stages[0], cfg, 1)
    with TrainLoader(train_files, plan.chunk, recipe.stages[0].max_seq_len, bos_id=cfg.data.bos_id,
                     prefetch=False, merge=plan.merge) as loader:
        loss = run_step(model, recipe, loader, 0, cfg, info, torch.float32)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, float(loss), plan


def test_merged_micro_batches_give_the_same_step(tmp_path):
    """Four micro-batches as two of twice the tokens: the same tokens, so the same mean loss and
    gradients (the core model attends within documents and has no cross-position mixing; up to
    the order of the sums)."""
    base = small_cfg(tmp_path, grad_accum=4, batch_tokens=2048)
    merged = small_cfg(tmp_path, grad_accum=4, batch_tokens=2048, min_micro_batch_tokens=1024)
    g0, loss0, plan0 = _one_step_grads(base)
    g1, loss1, plan1 = _one_step_grads(merged)
    assert (plan0.count, plan0.tokens, plan1.count, plan1.tokens) == (4, 512, 2, 1024)
    assert loss1 == pytest.approx(loss0, rel=1e-5)
    assert g0.keys() == g1.keys() and g0
    for k in g0:
        assert torch.allclose(g1[k], g0[k], rtol=1e-4, atol=1e-7), k


def test_validation_batch_tokens():
    from speedrun.train.loop import MicroBatching, validation_batch_tokens

    plans = [MicroBatching(16384, 1, 8), MicroBatching(49152, 1, 8)]
    cfg = preset("record")
    assert validation_batch_tokens(cfg, plans) == 262144  # upstream's, whatever the micro-batches
    cfg.train.batch_divisor = 1024
    assert validation_batch_tokens(cfg, plans) == 256  # shrunk with the stages
    cfg.train.val_batch_tokens = 0
    assert validation_batch_tokens(cfg, plans) == 49152  # the largest unmerged micro-batch
    for bad in (-1, 1.5, True):
        cfg.train.val_batch_tokens = bad
        with pytest.raises(ConfigError, match="val_batch_tokens"):
            validation_batch_tokens(cfg, plans)


def test_record_backpropagates_each_micro_batch_sum(tmp_path, monkeypatch):
    """The record recipe's gradient is upstream's: per-token losses summed over each micro-batch,
    over the accumulation count (``loss.sum() * grad_scale``), i.e. the mean's times the
    micro-batch's tokens; the returned training loss stays the mean."""
    from speedrun.train.recipes import RecordRecipe

    cfg = preset("tiny-record")
    apply_overrides(cfg, ["train.grad_accum=2", f"out_dir={tmp_path / 'runs'}"])
    g_sum, loss_sum, plan = _one_step_grads(cfg)
    monkeypatch.setattr(RecordRecipe, "loss_reduction", "mean")
    g_mean, loss_mean, _ = _one_step_grads(cfg)
    assert plan.count == 2 and plan.chunk > 1
    assert loss_sum == pytest.approx(loss_mean, rel=1e-6)
    assert g_sum.keys() == g_mean.keys() and g_sum
    for k in g_sum:
        torch.testing.assert_close(g_sum[k], g_mean[k] * plan.chunk, rtol=1e-4, atol=1e-6 * plan.chunk, msg=k)


def test_record_recipe_trains_with_merged_micro_batches(tmp_path):
    cfg = preset("tiny-record")
    apply_overrides(cfg, ["train.steps=12", "train.grad_accum=4", "train.min_micro_batch_tokens=1024",
                          "train.val_every=0", "train.sample_tokens=0", f"out_dir={tmp_path / 'runs'}"])
    result = train(cfg, console=False)
    log = (result.run_dir / "log.txt").read_text()
    assert "micro-batches per step by stage (train.min_micro_batch_tokens=1024): 2 x 1024" in log
    assert result.final_val_loss == result.final_val_loss and result.final_val_loss < 6.0


def test_logging_every_step_does_not_synchronise_every_step(tmp_path, monkeypatch):
    """The timed loop synchronises only where it stops the clock (validation, checkpoints, the
    end), not where it logs: with a line every step, twice the steps cost no more syncs; every
    step still gets its line, in order."""
    import speedrun.train.loop as loop

    counts = {}

    def counted(steps):
        syncs = []
        monkeypatch.setattr(loop, "_sync", lambda device: syncs.append(device))
        cfg = small_cfg(tmp_path / str(steps), steps=steps, log_every=1, val_every=0, checkpoint_every=0,
                        checkpoint_every_s=0.0, sample_tokens=0)
        result = train(cfg, console=False)
        lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines if m.get("event") == "train"] == list(range(1, steps + 1))
        counts[steps] = len(syncs)

    counted(10)
    counted(20)
    assert counts[10] == counts[20], counts
