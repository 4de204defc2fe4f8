"""The record arm against upstream f411b3d's own code, on the CPU (``SPEEDRUN_UPSTREAM_SRC``, see
``tests/upstream_model.py``; skipped without it).

Network: upstream's ``GPT`` runs its evaluation forward at the record's shapes (11 layers, width
768, 6 heads of 128) with a small vocabulary.  Every parameter is moved off its init first (most
of the record's gates, MUDD weights and the MLP's down projection start at zero, so a wiring
mistake there would not show at init), then copied into our ``RecordGPT``.  Both run in fp32,
where the per-token losses and every gradient agree to rounding; a wrong gate lane, window, skip,
cache or rotary table moves them by orders of magnitude more (``test_a_miswired_gate_is_caught``).
Three differences are not wiring and are bridged where they happen:

- upstream rotates RoPE pairs the other way (the same model up to a sign flip of one dim per pair:
  ``ours_from`` flips those Q/K bank rows);
- upstream builds its rotary tables in bf16 and rounds the residual/post lambdas to bf16 inside
  its forward (in training both are bf16 anyway; here the tables are rebuilt in fp32 and the
  lambdas made bf16-exact);
- the key offset's overlapping copy needs upstream's compiled semantics (``upstream_model.PATCHES``).

Then the initialisation, the schedule at every step, eight optimizer steps across the untie,
the data generator's batches, the bigram hash and the prefix-token table, and one MLP layer through
upstream's own MLP kernel (bf16 and its FP8 forward, in the interpreter made to round as a GPU
does: ``tests/interpreter_numerics.py``) against the presets' MLP kernels.  The training loss (FP8
head, a CUDA C cross-entropy kernel) cannot run upstream's code on a CPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from speedrun.config import ModelConfig
from speedrun.model.interface import ForwardArgs
from speedrun.model.record import RecordArchConfig, RecordGPT

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 1000  # padded to 1024 by both
L, H, HD, D = 11, 6, 128, 768
# our parameter name -> upstream's, where they differ
UPSTREAM_NAMES = {"lm_head": "lm_head.weight", "embed": "embed.weight", "smear_gate": "smear_gate.weight",
                  "bigram_embed": "bigram_embed.weight", "mudd_gate_scale": "_mudd_gate_scale"}


@pytest.fixture(scope="module")
def upstream_src() -> Path:
    d = os.environ.get("SPEEDRUN_UPSTREAM_SRC")
    if not d or not (Path(d) / "train_gpt.py").is_file():
        pytest.skip("SPEEDRUN_UPSTREAM_SRC not set to a folder with upstream's three files")
    return Path(d)


@pytest.fixture(scope="module")
def upstream(upstream_src):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("upstream's DC kernel runs on the CPU only under TRITON_INTERPRET=1")
    from upstream_model import load_upstream_gpt

    return load_upstream_gpt(upstream_src, bigram_vocab_size=1024 * 15 // 2)


@torch.no_grad()
def perturbed_upstream(up, seed=0):
    torch.manual_seed(seed)
    model = up.GPT(vocab_size=VOCAB, num_layers=L, num_heads=H, head_dim=HD, model_dim=D, max_seq_len=1024)
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        # matrices by their fan-in so activations stay O(1); vectors and gates by a fixed amount
        scale = 0.02 if p.dim() < 2 else 0.5 * p.shape[-1] ** -0.5
        if name == "lm_head.weight":  # (D, V): by its fan-in D, so that the logits spread
            scale = 3 * D**-0.5
        p.add_(torch.randn(p.shape, generator=g) * scale)
    model = model.float().eval()
    for p in (model.resid_lambdas, model.post_lambdas):  # upstream's forward rounds these to bf16
        p.copy_(p.bfloat16())
    for yarn in (model.yarn, model.yarn_paired_head):
        yarn.apply(1, 1)  # rewrites the rotary tables in fp32 (built in bf16); frequencies and scale stay
    return model


def _odd_rotating(ours: RecordGPT) -> torch.Tensor:
    """(HD,) bool: the second dim of every rotating pair.  Upstream rotates each pair (x0, x1) by
    -theta where we rotate by +theta: the same model up to a sign flip of x1 in every rotating
    pair of q and k (QK-norm and the dot products are blind to it), so those Q/K bank rows (and
    their gradients) change sign."""
    odd = torch.zeros(HD, dtype=torch.bool)
    odd[1 : ours.yarn.rope_dims : 2] = True
    return odd


@torch.no_grad()
def ours_from(model_up) -> RecordGPT:
    cfg = ModelConfig(vocab_size=VOCAB, num_layers=L, model_dim=D, num_heads=H, qk_head_dim=HD, v_head_dim=HD,
                      architecture="record")
    ours = RecordGPT(cfg, RecordArchConfig(pad_world_size=1))
    up = dict(model_up.named_parameters())
    for name, p in ours.named_parameters():
        src = up.pop(UPSTREAM_NAMES.get(name, name))
        if name == "mlp_bank":  # upstream pads to 12 layers for 8 ranks; the padding layer is never read
            src = src[:L]
        assert src.shape == p.shape, (name, tuple(src.shape), tuple(p.shape))
        p.copy_(src)
    assert not up, f"upstream parameters without a counterpart: {sorted(up)}"
    ours.qk_bank.view(-1, HD, D)[:, _odd_rotating(ours)] *= -1
    ours.bigram_sign_table.copy_(model_up.bigram_sign_table)
    return ours.float().eval()


def batch_of(up, doc_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(doc_lens)
    tokens = torch.randint(0, VOCAB, (T + 1,), generator=g)
    cu = torch.tensor([0, *torch.tensor(doc_lens).cumsum(0).tolist()], dtype=torch.int32)
    inputs, targets = tokens[:-1].to(torch.int32), tokens[1:].long()
    ours = SimpleNamespace(inputs=inputs, targets=targets, cu_seqlens=cu, max_seqlen=max(doc_lens),
                           num_docs=len(doc_lens), bigram=None)
    return ours, (inputs.long(), targets, cu, up.get_bigram_hash(inputs))


def upstream_loss(model_up, up, batch_up, ws_short, ws_long):
    cfg = up.ForwardScheduleConfig(mtp_weights=torch.ones(1), prefix_weight=torch.zeros(()),
                                   ws_short=ws_short, ws_long=ws_long, train_max_seq_len=1024)
    with torch.no_grad():
        return model_up(*batch_up, cfg)


def our_loss(ours, batch, ws_short, ws_long):
    with torch.no_grad():
        return ours.per_token_loss(batch, ForwardArgs(window_short=ws_short, window_long=ws_long))


DOCS = (150, 97, 137, 128)  # 512 tokens, documents longer and shorter than the short window
# fp32 on both sides: the losses agree to ~7e-6 (2026-12-05, torch 2.13 CPU)
ATOL = 5e-5


def test_bigram_hash_matches_upstream(upstream):
    from speedrun.data.loader import bigram_hash

    tokens = torch.randint(0, 50257, (4096,), dtype=torch.int32)
    mod = upstream.args.bigram_vocab_size - 1
    assert torch.equal(bigram_hash(tokens, mod), upstream.get_bigram_hash(tokens))


def test_eval_forward_matches_upstream(upstream):
    model_up = perturbed_upstream(upstream)
    ours = ours_from(model_up)
    batch, batch_up = batch_of(upstream, DOCS)
    want = upstream_loss(model_up, upstream, batch_up, 64, 192)
    got = our_loss(ours, batch, 64, 192)
    assert want.shape == got.shape == (sum(DOCS),)
    assert want.std() > 0.5, "the perturbed model must not be near-uniform"
    torch.testing.assert_close(got, want.float(), rtol=0, atol=ATOL)


def test_eval_forward_matches_upstream_after_yarn_extensions(upstream):
    """The long window grows twice (the record's stage changes); YaRN rescales the rotary tables and
    the attention scale on both sides."""
    model_up = perturbed_upstream(upstream, seed=1)
    ours = ours_from(model_up)
    for old, new in ((128, 256), (256, 384)):
        model_up.yarn.apply(old, new)
        model_up.yarn_paired_head.apply(old, new)
        ours.yarn.apply(old, new)
    batch, batch_up = batch_of(upstream, DOCS, seed=1)
    want = upstream_loss(model_up, upstream, batch_up, 128, 384)
    got = our_loss(ours, batch, 128, 384)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=ATOL)


def test_gradients_match_upstream(upstream):
    """The backward of the same evaluation loss (mean over tokens) through both networks: every
    parameter's gradient, upstream's through its autograd and its DC correction's Triton backward
    kernel, ours through our references.  fp32: they agree to ~5e-6 (relative, per parameter); the
    bank rows our RoPE convention flips carry flipped gradients, and upstream's padding MLP layer
    gets none."""
    model_up = perturbed_upstream(upstream, seed=3)
    ours = ours_from(model_up)
    batch, batch_up = batch_of(upstream, DOCS, seed=3)
    cfg = upstream.ForwardScheduleConfig(mtp_weights=torch.ones(1), prefix_weight=torch.zeros(()),
                                         ws_short=64, ws_long=192, train_max_seq_len=1024)
    model_up(*batch_up, cfg).mean().backward()
    ours.per_token_loss(batch, ForwardArgs(window_short=64, window_long=192)).mean().backward()
    up = dict(model_up.named_parameters())
    odd_rotating = _odd_rotating(ours)
    for name, p in ours.named_parameters():
        want = up[UPSTREAM_NAMES.get(name, name)].grad
        if name == "mlp_bank":
            assert want[L:].abs().max() == 0
            want = want[:L]
        if name == "qk_bank":
            want = want.clone()
            want.view(-1, HD, D)[:, odd_rotating] *= -1
        assert p.grad is not None and want.norm() > 0, name
        err = ((p.grad - want).norm() / want.norm()).item()
        # upstream casts these lambdas to bf16 in its forward, so their gradients come back bf16
        assert err < (4e-3 if name in ("post_lambdas", "resid_lambdas") else 5e-5), (name, err)


def test_a_miswired_gate_is_caught(upstream):
    """The tolerance above is tight enough: swapping the two XSA lanes of the pre gate (layers 1
    and 3) in our model moves the losses far past it."""
    model_up = perturbed_upstream(upstream, seed=2)
    ours = ours_from(model_up)
    batch, batch_up = batch_of(upstream, DOCS, seed=2)
    want = upstream_loss(model_up, upstream, batch_up, 64, 192)
    with torch.no_grad():
        w2, b2 = ours.mudd_gate_w2[0], ours.mudd_gate_b2[0]
        w2[[*range(6, 12), *range(0, 6)]] = w2[:12].clone()
        b2[[*range(6, 12), *range(0, 6)]] = b2[:12].clone()
    got = our_loss(ours, batch, 64, 192)
    assert (got - want.float()).abs().max() > 20 * ATOL


# ----------------------------------------------------------------------------------------------
# The schedule (recipe §6): every step's settings from upstream's TrainingSchedule


@pytest.mark.parametrize("scheduled,extension", [(1270, 15), (45, 2), (301, 0)])
def test_schedule_matches_upstream_at_every_step(upstream_src, scheduled, extension):
    from speedrun.config import record
    from speedrun.train.recipes import record_schedule
    from upstream_model import load_upstream_schedule

    up = load_upstream_schedule(upstream_src, scheduled, extension)
    cfg = record()
    cfg.train.steps, cfg.train.num_extension = scheduled + extension, extension
    ours = record_schedule(cfg)  # what `speedrun train --preset record` runs
    ts = up.training_schedule
    assert ours.total_steps == ts.total_steps and ours.boundaries == ts.boundaries
    assert ours.split_step == ts.split_step
    # with no extension upstream also warms up two steps past the end, which never train
    assert ours.warmup_steps() == [s for s in up.warmup_steps if s < ts.total_steps]
    last = ts.stages[-1]
    assert ours.final_eval_windows() == (last.window_sizes[0] * 128, ts.ws_post_yarn_ext * 128)
    for step in range(ts.total_steps):
        st, _ = ts.lookup(step)
        got = ours.at(step)
        want_windows = (st.window_sizes[0] * 128, st.window_sizes[1] * 128)
        assert (got.window_short, got.window_long) == want_windows, step
        assert (got.batch_tokens, got.max_seq_len) == (st.batch_size, st.train_max_seq_len), step
        assert got.mtp_weights == pytest.approx(ts.mtp_weights[step].tolist(), rel=1e-6, abs=1e-7), step
        assert got.prefix_weight == pytest.approx(ts.prefix_weights[step].item(), rel=1e-6, abs=1e-7), step
        assert got.lr_mult == pytest.approx(ts.get_lr(step), rel=1e-12), step
        assert got.muon_momentum == pytest.approx(up.get_muon_momentum(step), rel=1e-12), step
        assert got.adam_step == (step % 2 == 1)
        if step:  # upstream applies YaRN when the long window differs from the previous step's
            assert got.yarn_change == (ts.lookup(step - 1)[0].window_sizes[1] != st.window_sizes[1]), step


def test_validation_sizes_match_upstream(upstream_src):
    """The record validates over upstream's token count in upstream's batches: its
    ``val_batch_size`` split over 8 ranks x micro-batches (a batch edge cuts a document's context,
    so the loss depends on it)."""
    from speedrun.config import record
    from upstream_model import exec_upstream

    args = exec_upstream(upstream_src, ("Hyperparameters",), {})["Hyperparameters"]()
    cfg = record()
    assert cfg.train.val_tokens == args.val_tokens
    assert cfg.train.val_batch_tokens * 8 == args.val_batch_size


# ----------------------------------------------------------------------------------------------
# The optimizer (recipe §4): NorMuon + Adam steps against upstream's NorMuonAndAdam


BANKS = ("qk_bank", "vo_bank", "mlp_bank")
# Polar Express runs in bf16 on both sides, with different rounding (upstream rounds the
# normalising norm to bf16; we take it in fp32): the per-step updates differ by 2-3% (Frobenius)
UPDATE_RTOL = 0.05


def _master(p: torch.Tensor, mantissa: torch.Tensor | None) -> torch.Tensor:
    """fp32 master of a bf16 weight and its 16-bit mantissa buffer (either signedness)."""
    from speedrun.optim.normuon import join_bf16

    if mantissa is None:
        return p.detach().float()
    return join_bf16(p.detach().reshape(mantissa.shape), mantissa.view(torch.int16))


def test_optimizer_steps_match_upstream(upstream_src):
    """Eight steps around the record's untie (844-851: NorMuon every step, Adam on the odd ones,
    embed/lm_head untied after 847, Adam gradients summed over two steps), each with the schedule's
    learning rate and momentum, on a record-shaped model of width 96 with random gradients.  Both
    sides start from the same weights in the record's dtypes (bf16, four scalar tables fp32) and get
    their hyperparameters from their own tables; NorMuon's fp32 masters (weight + mantissa) and
    Adam's weights must agree."""
    from speedrun.optim.normuon import NorMuonAndAdam, OptimizerHyper, record_param_table
    from speedrun.optim.schedule import RecordSchedule
    from upstream_model import (exec_upstream, load_upstream_optimizer, load_upstream_schedule,
                                upstream_optimizer_arguments)

    cfg = ModelConfig(vocab_size=VOCAB, num_layers=L, model_dim=96, num_heads=H, qk_head_dim=16, v_head_dim=16,
                      architecture="record")
    torch.manual_seed(0)
    model = RecordGPT(cfg, RecordArchConfig(pad_world_size=1))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.02)
    model.cast_to_record_dtypes(torch.bfloat16)
    model.sync_embed_from_lm_head()
    ours = model.parameter_groups()
    sched = RecordSchedule()
    opt = NorMuonAndAdam(ours, record_param_table(), hyper=OptimizerHyper(), tied=("lm_head", "embed"),
                         use_triton=False)

    # upstream: the same tensors as its own parameters, labelled and reshaped as its model does
    up_opt = load_upstream_optimizer(upstream_src)
    theirs = {}
    for label, p in ours.items():
        q = torch.nn.Parameter(p.detach().clone())
        q.label = UPSTREAM_NAMES.get(label, label).replace(".weight", "")
        theirs[label] = q
    for label in ("qk_bank", "vo_bank"):
        theirs[label].reshape = tuple(theirs[label].shape)
    mlp = theirs["mlp_bank"]
    mlp.reshape = (2 * mlp.shape[0], *mlp.shape[2:])
    sched_up = load_upstream_schedule(upstream_src, 1270, 15)
    tm_ns = exec_upstream(upstream_src, ("TrainingManager",), dict(
        training_schedule=sched_up.training_schedule, get_muon_momentum=sched_up.get_muon_momentum))
    manager = SimpleNamespace(optimizer=None, split_step=sched_up.training_schedule.split_step,
                              _is_adam_step=lambda step: step % 2 == 1)
    manager.optimizer = up_opt.NorMuonAndAdam([(q.label, q) for q in theirs.values()],
                                              **upstream_optimizer_arguments(tm_ns["TrainingManager"]))

    g = torch.Generator().manual_seed(0)
    for step in range(844, 852):
        for label, p in ours.items():
            grad = (torch.randn(p.shape, generator=g) * 0.01).to(p.dtype)
            for q in (p, theirs[label]):
                q.grad = grad.clone() if q.grad is None else q.grad + grad
        before = {lab: (_master(ours[lab], opt.entries[lab].state.get("mantissa")),
                        _master(theirs[lab], manager.optimizer.param_states[theirs[lab]]["mantissa"]))
                  for lab in BANKS}
        s = sched.at(step)
        opt.step(step, lr_mult=s.lr_mult, muon_momentum=s.muon_momentum)
        if s.untie:
            opt.untie()
        tm_ns["TrainingManager"].step_optimizers(manager, step)
        for label, p in ours.items():
            q = theirs[label]
            if label in BANKS:
                mine = _master(p, opt.entries[label].state["mantissa"]) - before[label][0]
                ref = (_master(q, manager.optimizer.param_states[q]["mantissa"]) - before[label][1]).view(mine.shape)
                # Polar Express runs in bf16, so the two updates differ by its rounding
                err = ((mine - ref).norm() / ref.norm()).item()
                assert err < UPDATE_RTOL, (step, label, err)
            else:
                _assert_same_adam_weights(p.detach(), q.detach(), f"step {step} {label}")
            assert (p.grad is None) == (q.grad is None), (step, label)


def _assert_same_adam_weights(mine: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Adam's update is elementwise in fp32 on both sides, in a different order of operations: fp32
    weights agree to a few ulps; bf16 weights are equal but for the rare element whose fp32 value
    sits at a rounding boundary, which may land one bf16 step away."""
    if mine.dtype == torch.float32:
        torch.testing.assert_close(mine, ref, rtol=1e-6, atol=0, msg=lambda m: f"{what}: {m}")
        return
    steps = (mine.view(torch.int16).int() - ref.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (steps > 0).float().mean() < 1e-3, (what, steps.max().item(), steps.float().mean().item())


# ----------------------------------------------------------------------------------------------
# The data (recipe §5): BOS-aligned training batches and contiguous validation batches


def _synthetic_shards(tmp_path, n_shards=2, docs=400, seed=0):
    """The golden fixtures' synthetic shards (the live test and the recorded one read the same)."""
    from upstream_goldens import synthetic_shards

    return synthetic_shards(tmp_path, n_shards=n_shards, docs=docs, seed=seed)


def _edges(cu: torch.Tensor) -> list[int]:
    """The distinct document edges of a padded cu_seqlens (both sides pad differently)."""
    return torch.unique_consecutive(cu.long()).tolist()


def test_training_batches_match_upstream(upstream_src, tmp_path):
    """The first shard's batches at stage-1 and then stage-2 shapes (the generator is re-sent new
    sizes, as at a stage change), one rank: the same tokens, targets, document edges and bigram
    ids.  Upstream drops the tail of a shard once no BOS is ahead; the comparison stays in shard 0."""
    from speedrun.data.loader import TrainLoader
    from upstream_model import load_upstream_loader

    files = _synthetic_shards(tmp_path)
    mod = 1024 * 15 // 2 - 1
    up = load_upstream_loader(upstream_src, bigram_vocab_size=mod + 1)
    gen = up.distributed_data_generator(str(tmp_path / "syn_train_*.bin"), 2048, 512, grad_accum_steps=1)
    shapes = [(2048, 512)] * 6 + [(4096, 1024)] * 6
    with TrainLoader(files, 2048, 512, bos_id=50256, prefetch=False, bigram_mod=mod) as ours:
        prev = shapes[0]
        for i, (T, L) in enumerate(shapes):
            if (T, L) != prev:
                ours.set_shape(T, L)
                inputs, targets, cu, bigram, _ = gen.send((T, L, 1))
            else:
                inputs, targets, cu, bigram, _ = next(gen)
            prev = (T, L)
            b = ours.next_batch()
            assert torch.equal(b.inputs, inputs), i
            assert torch.equal(b.targets.long(), targets), i
            assert _edges(b.cu_seqlens) == _edges(cu), i
            assert torch.equal(b.bigram, bigram), i


def test_validation_batches_match_upstream(upstream_src, tmp_path):
    from speedrun.data.loader import ValLoader
    from upstream_model import load_upstream_loader

    files = _synthetic_shards(tmp_path, n_shards=1, seed=1)
    mod = 1024 * 15 // 2 - 1
    up = load_upstream_loader(upstream_src, bigram_vocab_size=mod + 1)
    gen = up.distributed_data_generator(str(files[0]), 4096, -1, grad_accum_steps=1, align_to_bos=False)
    ours = ValLoader(files, 5 * 4096, 4096, bos_id=50256, bigram_mod=mod)
    assert len(ours) == 5
    for i, b in enumerate(ours):
        inputs, targets, cu, bigram, _ = next(gen)
        assert torch.equal(b.inputs, inputs), i
        assert torch.equal(b.targets.long(), targets), i
        assert _edges(b.cu_seqlens) == _edges(cu), i
        assert torch.equal(b.bigram, bigram), i


# ----------------------------------------------------------------------------------------------
# The prefix-token table (recipe §3.5)


def test_prefix_table_matches_upstream(upstream_src, gpt2_dir, monkeypatch):
    """Our table from the GPT-2 BPE files against upstream's ``build_prefix_table`` over
    tiktoken's GPT-2 ranks (read offline from a tiktoken cache beside the upstream source or the
    tokenizer folder)."""
    tiktoken = pytest.importorskip("tiktoken")
    from speedrun.data.tokenizer import get_tokenizer
    from speedrun.model.prefix_table import build_prefix_table
    from upstream_model import exec_upstream

    caches = [d for d in (upstream_src / "tiktoken_cache", Path(gpt2_dir).parent / "tiktoken_cache") if d.is_dir()]
    if not caches:
        pytest.skip("no tiktoken cache beside SPEEDRUN_UPSTREAM_SRC or SPEEDRUN_TOKENIZER_DIR")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(caches[0]))
    ns = exec_upstream(upstream_src, ("build_prefix_table",), dict(tiktoken=tiktoken))
    want = ns["build_prefix_table"](50304)
    got = build_prefix_table(get_tokenizer("gpt2", gpt2_dir), 50304)
    assert (want >= 0).sum() > 40000  # most tokens have a prefix token
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------
# Initialisation (recipe §1.4)


def test_init_matches_upstream(upstream):
    """Every parameter starts as upstream's: equal where upstream's init is deterministic (zeros,
    ones, the lambdas, the MUDD and gate biases), and from the same distribution where it is
    random (same support and spread; the draws differ)."""
    torch.manual_seed(0)
    model_up = upstream.GPT(vocab_size=VOCAB, num_layers=L, num_heads=H, head_dim=HD, model_dim=D, max_seq_len=1024)
    cfg = ModelConfig(vocab_size=VOCAB, num_layers=L, model_dim=D, num_heads=H, qk_head_dim=HD, v_head_dim=HD,
                      architecture="record")
    ours = RecordGPT(cfg, RecordArchConfig(pad_world_size=1))
    up = {n: p.detach().float() for n, p in model_up.named_parameters()}
    random = {"qk_bank", "vo_bank", "mlp_bank", "lm_head", "embed", "value_embeds", "mudd_w1", "mudd_gate_w1"}
    for name, p in ours.named_parameters():
        mine, want = p.detach().float(), up[UPSTREAM_NAMES.get(name, name)]
        if name == "mlp_bank":
            want = want[:L]
        assert mine.shape == want.shape, name
        if name not in random:
            torch.testing.assert_close(mine, want, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            continue
        for part_m, part_w in ((mine[:, 0], want[:, 0]), (mine[:, 1], want[:, 1])) if name == "mlp_bank" else ((mine, want),):
            if name not in ("lm_head", "embed", "value_embeds"):  # uniform draws: the same bound
                assert part_m.abs().max() == pytest.approx(part_w.abs().max().item(), rel=0.01, abs=1e-12), name
            assert part_m.std() == pytest.approx(part_w.std().item(), rel=0.03, abs=1e-12), name
    assert torch.equal(ours.embed, ours.lm_head.T)  # tied at init, as upstream copies lm_head^T


@pytest.mark.parametrize("case,mode", [("bf16", "bf16"), ("fp8", "fp8_fwd")])
def test_mlp_kernels_match_upstreams_kernel_live(upstream_src, case, mode):
    """The MLP golden's comparison with upstream's kernel run now (``test_upstream_goldens`` has
    the bounds and the recorded values)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("upstream's MLP kernel runs on the CPU only under TRITON_INTERPRET=1")
    import upstream_goldens as G
    from interpreter_numerics import gpu_numerics
    from test_upstream_goldens import MLP_BOUNDS
    from upstream_model import load_upstream_mlp, run_upstream_mlp

    inputs = G.mlp_inputs()
    with gpu_numerics():
        want = run_upstream_mlp(load_upstream_mlp(upstream_src), inputs["x"], inputs["w1"], inputs["w2"],
                                inputs["g"], fp8=case == "fp8")
    got = G.our_mlp(inputs, mode)
    errors = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in ("y", "dx", "dw1", "dw2")}
    assert MLP_BOUNDS[mode][0] == case and max(errors.values()) < MLP_BOUNDS[mode][1], (mode, errors)
