"""Embedding gradients accumulated in place (speedrun.model.embedding_grad, model.embedding_grad)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from speedrun.config import ModelConfig
from speedrun.errors import ConfigError
from speedrun.model.embedding_grad import EmbeddingGradAccumulator
from speedrun.model.interface import ForwardArgs
from speedrun.model.record import RecordGPT

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lookup_gradients_with_repeated_rows_equal_autograd():
    """Two micro-batches with repeated rows, on top of an existing gradient (Adam's half-summed
    one): after the flush, .grad is what autograd's dense route gives."""
    g = torch.Generator().manual_seed(0)
    table = torch.randn(20, 8, generator=g)
    w_ref = torch.nn.Parameter(table.clone())
    w_acc = torch.nn.Parameter(table.clone())
    start = torch.randn(20, 8, generator=g)
    w_ref.grad, w_acc.grad = start.clone(), start.clone()
    acc = EmbeddingGradAccumulator()
    for _ in range(2):
        rows = torch.randint(0, 20, (50,), generator=g)
        rows[:10] = 3  # one row many times
        up = torch.randn(50, 8, generator=g)
        (F.embedding(rows, w_ref) * up).sum().backward()
        out = acc.lookup(w_acc, rows)
        assert torch.equal(out, table[rows])
        assert acc.pending()
        (out * up).sum().backward()
        assert torch.equal(w_acc.grad, start)  # nothing reaches .grad before the flush
    acc.flush()
    assert not acc.pending()
    torch.testing.assert_close(w_acc.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    acc.flush()  # nothing pending: a second flush changes nothing
    torch.testing.assert_close(w_acc.grad, w_ref.grad, rtol=1e-6, atol=1e-6)
    # a table without a gradient yet gets its own copy (an fp32 .grad must not alias the accumulator)
    fresh = torch.nn.Parameter(table.clone())
    acc.lookup(fresh, torch.tensor([4, 4])).sum().backward()
    acc.flush()
    assert torch.equal(fresh.grad[4], torch.full((8,), 2.0)) and fresh.grad.abs().sum() == 16


def test_bf16_table_sums_in_fp32_and_rounds_once():
    """A row hit 4,096 times by a bf16 gradient of 1 + 2^-7: summed in fp32 it is exact; summed in
    bf16 (each add rounded) it would stall far below.  The flushed .grad is the fp32 sum rounded once."""
    w = torch.nn.Parameter(torch.zeros(4, 16, dtype=torch.bfloat16))
    acc = EmbeddingGradAccumulator()
    rows = torch.zeros(4096, dtype=torch.long)
    up = torch.full((4096, 16), 1 + 2**-7, dtype=torch.bfloat16)
    (acc.lookup(w, rows) * up).sum().backward()
    acc.flush()
    assert w.grad.dtype == torch.bfloat16
    assert torch.equal(w.grad[0], torch.full((16,), 4096 * (1 + 2**-7)).to(torch.bfloat16))
    assert torch.equal(w.grad[1:], torch.zeros(3, 16, dtype=torch.bfloat16))


def test_lookup_without_gradient_records_nothing_and_rows_must_be_1d():
    w = torch.nn.Parameter(torch.randn(6, 4))
    acc = EmbeddingGradAccumulator()
    with torch.no_grad():
        out = acc.lookup(w, torch.tensor([1, 1, 5]))
    assert not acc.pending() and not out.requires_grad and torch.equal(out, w.detach()[[1, 1, 5]])
    with pytest.raises(ValueError, match="rows must be 1-D"):
        acc.lookup(w, torch.tensor([[1, 2]]))
    acc.lookup(w, torch.tensor([0])).sum().backward()
    acc.clear()  # an abandoned step: its gradient is dropped, not flushed later
    acc.flush()
    assert w.grad is None


def _tiny(embedding_grad: str) -> ModelConfig:
    return ModelConfig(vocab_size=257, num_layers=4, model_dim=32, num_heads=2, qk_head_dim=16, v_head_dim=16,
                       architecture="record", embedding_grad=embedding_grad)


def _batch(seed: int, T: int = 64):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 257, (T,), generator=g, dtype=torch.int32)
    inputs[::7] = 11  # repeated tokens: repeated rows in every table
    return SimpleNamespace(inputs=inputs, targets=torch.randint(0, 257, (T,), generator=g),
                           cu_seqlens=torch.tensor([0, 30, T, T], dtype=torch.int32), max_seqlen=T, bigram=None)


@pytest.mark.parametrize("mode", ["atomic", "atomic_graph"])
def test_record_model_accumulated_gradients_equal_autograd(mode):
    """The record network, two micro-batches: every parameter's gradient after the flush equals
    the autograd route's (embed, value and bigram tables through the accumulator, looked up before
    the network or inside it, the rest as before), and the losses are the same."""
    torch.manual_seed(0)
    ref = RecordGPT(_tiny("autograd"))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)  # off the zero inits (bigram table) so every path carries signal
    acc = RecordGPT(_tiny(mode))
    acc.load_state_dict(ref.state_dict())
    args = ForwardArgs(window_short=16, window_long=48, mtp_weights=(1.0, 0.5), prefix_weight=0.0)
    for seed in (1, 2):
        lr, la = ref.loss(_batch(seed), args), acc.loss(_batch(seed), args)
        assert torch.equal(lr, la)
        lr.backward()
        la.backward()
    assert acc.embed.grad is None  # held until the flush
    acc.flush_embedding_grads()
    names = {"embed", "value_embeds", "bigram_embed"}
    for (name, pr), (_, pa) in zip(ref.named_parameters(), acc.named_parameters()):
        assert (pr.grad is None) == (pa.grad is None), name
        if pr.grad is not None:
            torch.testing.assert_close(pa.grad, pr.grad, rtol=1e-5, atol=1e-7, msg=name)
            if name in names:
                assert pr.grad.abs().sum() > 0, name
    # evaluation (no gradient) goes through the in-graph lookups and records nothing
    with torch.no_grad():
        assert torch.equal(ref.per_token_loss(_batch(3), args), acc.per_token_loss(_batch(3), args))
    assert not acc._embedding_grads.pending()
    # a copy gets accumulators of its own parameters
    twin = copy.deepcopy(acc)
    assert twin._embedding_grads is not acc._embedding_grads and not twin._embedding_grads.pending()


def test_embedding_grad_switch_is_validated():
    with pytest.raises(ConfigError, match="embedding_grad"):
        ModelConfig(embedding_grad="sparse").validate()
    with pytest.raises(ConfigError, match="architecture=record only"):
        ModelConfig(embedding_grad="atomic").validate()
    with pytest.raises(RuntimeError, match="embedding_grad='atomic'"):
        RecordGPT(_tiny("autograd")).embedding_lookups(_batch(0))
    with pytest.raises(RuntimeError, match="table 'embed' was not prepared"):
        RecordGPT(_tiny("atomic_graph")).embedding_lookups(_batch(0), traced=True)


def test_lookups_inside_the_inductor_compiled_network_accumulate():
    """embedding_grad=atomic_graph compiled by Inductor (CPU): the gathers are traced into the
    network and the backward's accumulate op survives compilation (its result is the anchor's
    gradient): the flushed table gradients equal the eager atomic model's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = RecordGPT(_tiny("atomic"))
    with torch.no_grad():
        for p in eager.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    graph = RecordGPT(_tiny("atomic_graph"))
    graph.load_state_dict(eager.state_dict())
    graph.compile_body(backend="inductor", dynamic=False)
    args = ForwardArgs(window_short=16, window_long=48, mtp_weights=(1.0, 0.5), prefix_weight=0.0)
    for seed in (1, 2):
        le, lg = eager.loss(_batch(seed), args), graph.loss(_batch(seed), args)
        torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-6)
        le.backward()
        lg.backward()
    assert graph.embed.grad is None and graph._embedding_grads.pending()
    for m in (eager, graph):
        m.flush_embedding_grads()
    for name in ("embed", "value_embeds", "bigram_embed"):
        ge, gg = getattr(eager, name).grad, getattr(graph, name).grad
        assert gg is not None and gg.abs().sum() > 0, name
        torch.testing.assert_close(gg, ge, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.usefixtures("use_builtin_cache")
def test_training_steps_flush_the_accumulated_gradients(tmp_path, monkeypatch):
    """The tiny record recipe (Adam on odd steps with two steps' gradients summed, tied tables):
    with the in-place embedding gradients the tables have no gradient at the even step 0, and
    Adam at step 1 receives the autograd route's two-step sums to fp32 rounding.  (Weights after
    Adam are not compared: its first updates are nearly sign(g), so rounding-level differences in
    entries that cancel to ~0 flip whole updates.)"""
    from speedrun.config import apply_overrides, preset
    from speedrun.optim.normuon import NorMuonAndAdam
    from speedrun.train.loop import train

    tables = ("embed", "value_embeds", "bigram_embed", "lm_head")
    seen: dict[str, dict] = {}
    real_kernels = NorMuonAndAdam.launch_kernels  # reads the gradients the step applies (the flush ran)

    def spy(self, plan):
        if plan.step_index in (0, 1):
            seen[mode][plan.step_index] = {t: (None if self.entries[t].param.grad is None
                                               else self.entries[t].param.grad.clone()) for t in tables}
        return real_kernels(self, plan)

    monkeypatch.setattr(NorMuonAndAdam, "launch_kernels", spy)
    for mode in ("autograd", "atomic"):
        seen[mode] = {}
        cfg = preset("tiny-record")
        apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12",
                              "train.batch_divisor=256", "train.steps=5", "train.num_extension=1",
                              "train.val_tokens=2048", "train.val_every=0", "train.log_every=5",
                              f"model.embedding_grad={mode}", f"out_dir={tmp_path / mode}"])
        train(cfg, console=False)
    assert seen["autograd"][0]["value_embeds"] is not None  # autograd's route fills .grad every step
    assert all(seen["atomic"][0][t] is None for t in ("embed", "value_embeds", "bigram_embed"))
    for t in tables:
        want, got = seen["autograd"][1][t], seen["atomic"][1][t]
        assert want.abs().max() > 0, t
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item(), msg=t)


def test_discard_drops_the_pending_sum_in_place():
    w = torch.nn.Parameter(torch.randn(6, 4))
    acc = EmbeddingGradAccumulator()
    acc.lookup(w, torch.tensor([1, 2, 2])).sum().backward()
    (table,) = [a for _, a in acc._acc.values()]
    acc.discard()
    assert not acc.pending() and torch.equal(table, torch.zeros_like(table))
    assert [a for _, a in acc._acc.values()][0] is table  # the same memory, zeroed
    acc.flush()
    assert w.grad is None


@pytest.mark.usefixtures("use_builtin_cache")
def test_embedding_gradients_wait_for_adam_steps_checkpoints_and_warmup(tmp_path, monkeypatch):
    """The loop flushes the tables' accumulators before Adam's (odd) steps only; a checkpoint
    after an even step saves the pending sums instead; the warmup's last (even) step leaves
    nothing behind, so a run with a warmup ends at the weights of one without."""
    from speedrun.config import apply_overrides, preset
    from speedrun.train.checkpoint import list_checkpoints
    from speedrun.train.loop import train

    flushes: list[bool] = []
    real_flush = RecordGPT.prepare_embedding_flush

    def spy(self):
        flushes.append(self._embedding_grads.pending())
        return real_flush(self)

    monkeypatch.setattr(RecordGPT, "prepare_embedding_flush", spy)
    weights = {}
    for warmup in (0, 1):
        cfg = preset("tiny-record")
        apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=12",
                              "train.batch_divisor=256", "train.steps=5", "train.num_extension=1",
                              "train.val_tokens=2048", "train.val_every=0", "train.log_every=5",
                              f"train.warmup_steps={warmup}", f"out_dir={tmp_path / str(warmup)}"])
        flushes.clear()
        result = train(cfg, console=False)
        ckpt = torch.load(list_checkpoints(result.run_dir)[-1], weights_only=False)
        weights[warmup] = ckpt["model"]
        if warmup == 0:
            assert flushes == [True, True], flushes  # steps 0-4: before steps 1 and 3 (Adam)
            # the final checkpoint follows the even step 4: its gradient sums travel with it
            assert set(ckpt["embedding_grads"]) == {"embed", "bigram_embed", "value_embeds"}
            assert all(t.abs().sum() > 0 and t.dtype == torch.float32 for t in ckpt["embedding_grads"].values())
    for name, tensor in weights[0].items():
        assert torch.equal(weights[1][name], tensor), name


def test_pending_sums_restore_exactly_and_bad_state_is_refused():
    model = RecordGPT(_tiny("atomic"))
    assert model.embedding_grad_state() == {}
    model.loss(_batch(0), ForwardArgs()).backward()
    state = {k: v.clone() for k, v in model.embedding_grad_state().items()}
    assert set(state) == {"embed", "bigram_embed", "value_embeds"}
    other = RecordGPT(_tiny("atomic"))
    other.load_embedding_grad_state(state)
    assert {k: torch.equal(v, state[k]) for k, v in other.embedding_grad_state().items()} == dict.fromkeys(state, True)
    other.load_embedding_grad_state({})  # a checkpoint after an odd step: nothing pending
    assert other.embedding_grad_state() == {}
    with pytest.raises(ValueError, match="unknown table 'lm_head'"):
        other.load_embedding_grad_state({"lm_head": state["embed"]})
    with pytest.raises(ValueError, match="of shape"):
        other.load_embedding_grad_state({"embed": state["embed"][:1]})
    with pytest.raises(ValueError, match="embedding_grad='autograd'"):
        RecordGPT(_tiny("autograd")).load_embedding_grad_state(state)
