"""The core GPT: shapes, widths, causality, document isolation, gradient flow."""

from types import SimpleNamespace

import torch

from speedrun.config import ModelConfig
from speedrun.model import build_model
from speedrun.model.interface import ForwardArgs
from speedrun.model.rotary import Rotary, apply_rotary, rope_frequencies, rope_tables


def _cfg(**kw):
    base = dict(vocab_size=100, num_layers=2, model_dim=32, num_heads=2, qk_head_dim=8, v_head_dim=16)
    base.update(kw)
    return ModelConfig(**base)


def _batch(T=40, cu=(0, 15, 40), vocab=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        inputs=torch.randint(0, vocab, (T,), generator=g, dtype=torch.int32),
        targets=torch.randint(0, vocab, (T,), generator=g),
        cu_seqlens=torch.tensor(list(cu) + [T, T], dtype=torch.int32),
        max_seqlen=T,
    )


def _randomize(model):
    # Output projections start at zero (identity blocks); give them values so every path matters.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_qk_and_v_widths_are_independent():
    model = build_model(_cfg())
    attn = model.blocks[0].attn
    assert attn.qkv.weight.shape == (2 * (8 + 8 + 16), 32)
    assert attn.proj.weight.shape == (32, 32)
    loss = model.loss(_batch())
    assert loss.shape == () and torch.isfinite(loss)


def test_initial_loss_is_near_uniform_and_padded_vocab_unused():
    model = build_model(_cfg())
    assert model.embed.weight.shape[0] == 128
    losses = model.per_token_loss(_batch())
    assert losses.shape == (40,)
    assert abs(losses.mean().item() - torch.log(torch.tensor(100.0)).item()) < 1.5


def test_model_is_causal_and_documents_are_isolated():
    model = _randomize(build_model(_cfg()))
    batch = _batch()
    base = model.per_token_loss(batch).detach()
    b2 = _batch()
    b2.inputs[25] = (b2.inputs[25] + 1) % 100
    out = model.per_token_loss(b2).detach()
    changed = (out - base).abs() > 1e-7
    assert not changed[:25].any()
    assert changed[25:].any()
    b3 = _batch()
    b3.inputs[3] = (b3.inputs[3] + 1) % 100
    out = model.per_token_loss(b3).detach()
    changed = (out - base).abs() > 1e-7
    assert not changed[15:].any(), "a token changed the loss of another document"
    assert changed[3:15].any()


def test_every_parameter_gets_a_gradient():
    model = _randomize(build_model(_cfg()))
    model.loss(_batch(), ForwardArgs(window_short=4)).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_rotary_preserves_norm_and_keeps_stationary_dims():
    rot = Rotary(16, rope_fraction=0.5, base=1024.0)
    x = torch.randn(10, 2, 16)
    y = rot(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[..., 8:], x[..., 8:])
    torch.testing.assert_close(y[0], x[0])  # position 0 is not rotated


def test_rotary_scores_depend_only_on_relative_position():
    freqs = rope_frequencies(8, 100.0)
    cos, sin = rope_tables(64, freqs)
    q = torch.randn(1, 1, 8).expand(64, 1, 8)
    k = torch.randn(1, 1, 8).expand(64, 1, 8)
    qr, kr = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    s1 = (qr[20] * kr[17]).sum()
    s2 = (qr[50] * kr[47]).sum()
    torch.testing.assert_close(s1, s2, rtol=1e-5, atol=1e-5)
