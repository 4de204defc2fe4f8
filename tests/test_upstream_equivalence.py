"""Our record network against upstream f411b3d's own model code, same weights, on the CPU.

Upstream's ``GPT`` comes from its ``train_gpt.py`` (``SPEEDRUN_UPSTREAM_SRC``, see
``tests/upstream_model.py``) and runs its evaluation forward at the record's shapes (11 layers,
width 768, 6 heads of 128) with a small vocabulary.  Every parameter is moved off its init first
(most of the record's gates, MUDD weights and the MLP's down projection start at zero, so a wiring
mistake there would not show at init), then copied into our ``RecordGPT``.  Both run in fp32, where
the two per-token losses agree to rounding; a wrong gate lane, window, skip, cache or rotary
table moves them by orders of magnitude more (``test_a_miswired_gate_is_caught``).

Three differences are not wiring and are bridged here, each where it happens:
- upstream rotates RoPE pairs the other way (the same model up to a sign flip of one dim per pair:
  ``ours_from`` flips those Q/K bank rows);
- upstream builds its rotary tables in bf16 and rounds the residual/post lambdas to bf16 inside
  its forward (in training both are bf16 anyway; here the tables are rebuilt in fp32 and the
  lambdas made bf16-exact);
- the key offset's overlapping copy needs upstream's compiled semantics (``upstream_model.PATCHES``).

Upstream's bigram hash pairs position 1 with the modulus rather than with token 0 (it overwrites
``out[0]`` before reading it); our loader does the same (``test_bigram_hash_matches_upstream``).
The training loss (FP8 head, CUDA cross-entropy kernel) cannot run upstream's code on a CPU.
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


@pytest.fixture(scope="module")
def upstream():
    d = os.environ.get("SPEEDRUN_UPSTREAM_SRC")
    if not d or not (Path(d) / "train_gpt.py").is_file():
        pytest.skip("SPEEDRUN_UPSTREAM_SRC not set to a folder with upstream's three files")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("upstream's DC kernel runs on the CPU only under TRITON_INTERPRET=1")
    from upstream_model import load_upstream_gpt

    return load_upstream_gpt(Path(d), bigram_vocab_size=1024 * 15 // 2)


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


@torch.no_grad()
def ours_from(model_up) -> RecordGPT:
    cfg = ModelConfig(vocab_size=VOCAB, num_layers=L, model_dim=D, num_heads=H, qk_head_dim=HD, v_head_dim=HD,
                      architecture="record")
    ours = RecordGPT(cfg, RecordArchConfig(pad_world_size=1))
    up = dict(model_up.named_parameters())
    names = {"lm_head": "lm_head.weight", "embed": "embed.weight", "smear_gate": "smear_gate.weight",
             "bigram_embed": "bigram_embed.weight", "mudd_gate_scale": "_mudd_gate_scale"}
    for name, p in ours.named_parameters():
        src = up.pop(names.get(name, name))
        if name == "mlp_bank":  # upstream pads to 12 layers for 8 ranks; the padding layer is never read
            src = src[:L]
        assert src.shape == p.shape, (name, tuple(src.shape), tuple(p.shape))
        p.copy_(src)
    assert not up, f"upstream parameters without a counterpart: {sorted(up)}"
    # Upstream rotates each pair (x0, x1) by -theta where we rotate by +theta: the same model up to a
    # sign flip of x1 in every rotating pair of q and k (QK-norm and the dot products are blind to
    # it), so the rows of those dims change sign in the Q/K bank.
    odd_rotating = torch.zeros(HD, dtype=torch.bool)
    odd_rotating[1 : ours.yarn.rope_dims : 2] = True
    ours.qk_bank.view(-1, HD, D)[:, odd_rotating] *= -1
    ours.bigram_sign_table.copy_(model_up.bigram_sign_table)
    return ours.float().eval()


def batch_of(up, doc_lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(doc_lens)
    tokens = torch.randint(0, VOCAB, (T + 1,), generator=g)
    tokens[0] = 999  # a document start token somewhere in the stream, as BOS would be
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
