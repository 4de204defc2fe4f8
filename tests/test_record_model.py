"""The record network (speedrun.model.record and its parts) on CPU at toy sizes."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from speedrun.config import ModelConfig
from speedrun.data.loader import bigram_hash
from speedrun.errors import ConfigError
from speedrun.model.interface import ForwardArgs
from speedrun.model.prefix_table import build_prefix_table
from speedrun.model.record import RecordArchConfig, RecordGPT, scaled_record_arch
from speedrun.model.record_parts import (
    GateLayout,
    bigram_sign_index,
    dc_postonly_correction,
    softcapped_mtp_ce,
)
from speedrun.model.yarn import Yarn
from speedrun.model.rotary import apply_rotary



pytestmark = pytest.mark.usefixtures("one_thread")


ARGS = ForwardArgs(window_short=8, window_long=24, mtp_weights=(1.0, 0.5, 0.25), prefix_weight=0.25)


def tiny_cfg(num_layers=6, heads=4, qk=16, v=16, vocab=257) -> ModelConfig:
    return ModelConfig(vocab_size=vocab, num_layers=num_layers, model_dim=heads * v, num_heads=heads,
                       qk_head_dim=qk, v_head_dim=v)


def make_batch(T=96, doc_lens=(40, 30, 26), vocab=257, seed=0, pad_docs=2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (T + 1,), generator=g)
    cu = [0]
    for n in doc_lens:
        cu.append(cu[-1] + n)
    assert cu[-1] == T
    cu += [T] * pad_docs
    return SimpleNamespace(
        inputs=tokens[:-1].to(torch.int32), targets=tokens[1:].long(),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32), max_seqlen=max(doc_lens),
        num_docs=len(doc_lens), bigram=None,
    )


@torch.no_grad()
def perturb(model: RecordGPT, scale=0.05, seed=1) -> RecordGPT:
    """Move every parameter off its (often zero) init so that every path carries signal."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


# ----------------------------------------------------------------------------------------------
# Whole model


@pytest.mark.parametrize("qk,v", [(16, 16), (12, 16)])
def test_forward_backward_reaches_every_parameter(qk, v):
    model = perturb(RecordGPT(tiny_cfg(qk=qk, v=v)))
    vocab = model.vocab
    assert vocab == 384 and model.qk_bank.shape[1:] == (2 * qk, 64)
    table = torch.full((vocab,), -1, dtype=torch.int64)
    table[:257] = torch.randint(-1, 257, (257,))
    model.set_prefix_table(table)
    batch = make_batch()
    loss = model.loss(batch, ARGS)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    unused = model.unused_parameter_slices()
    ids = batch.inputs.long()
    touched = {
        "embed": ids,
        "value_embeds": torch.cat([j * vocab + ids for j in range(model.num_ve)]),
        "bigram_embed": bigram_hash(ids, model.bigram_vocab - 1).long(),
    }
    for label, p in model.parameter_groups().items():
        assert p.grad is not None, label
        assert torch.isfinite(p.grad).all(), label
        mask = torch.ones_like(p.grad, dtype=torch.bool)
        for idx in unused.get(label, []):
            assert (p.grad[idx] == 0).all(), f"{label}{idx} should be unused"
            mask[idx] = False
        if label in touched:  # embedding tables: exactly the looked-up rows get gradient
            rows = torch.zeros(p.shape[0], dtype=torch.bool)
            rows[touched[label]] = True
            assert (p.grad[rows] != 0).any(-1).all() and (p.grad[~rows] == 0).all(), label
            continue
        live = p.grad[mask]
        assert live.numel() > 0 and (live != 0).float().mean() > 0.5, f"{label}: most used entries got no gradient"
    assert (model.ve_gate_bank.grad[model.ve_index[model.last]] == 0).all()  # veg of the MUDD layer
    per_tok = model.per_token_loss(batch, ARGS)
    assert per_tok.shape == (96,) and per_tok.dtype == torch.float32 and torch.isfinite(per_tok).all()


def test_record_parameter_count_on_meta():
    cfg = ModelConfig(vocab_size=50257, num_layers=11, model_dim=768, num_heads=6, qk_head_dim=128, v_head_dim=128)
    with torch.device("meta"):
        model = RecordGPT(cfg, RecordArchConfig(pad_world_size=8))
    assert sum(p.numel() for p in model.parameters()) == 643_751_335  # recipe §10.1, stored total
    shapes = {k: tuple(p.shape) for k, p in model.parameter_groups().items()}
    assert shapes["qk_bank"] == (64, 256, 768) and shapes["vo_bank"] == (24, 768, 768)
    assert shapes["mlp_bank"] == (12, 2, 3072, 768) and shapes["lm_head"] == (768, 50304)
    assert shapes["bigram_embed"] == (377280, 768) and shapes["value_embeds"] == (251520, 768)
    assert shapes["mudd_gate_w2"] == (2, 41, 64) and shapes["ve_gate_bank"] == (5, 6, 12)
    assert model.pre_layout.size == 26 and model.post_layout.size == 41
    assert model.bank_padding(1)["qk_bank"] == (60, 60)
    assert sum(p.numel() for p in model.parameters()) == 635_887_015  # recipe §10.1, real total
    cfg96 = ModelConfig(vocab_size=50257, num_layers=11, model_dim=768, num_heads=6, qk_head_dim=96, v_head_dim=128)
    with torch.device("meta"):
        model96 = RecordGPT(cfg96, RecordArchConfig(pad_world_size=8))
    assert tuple(model96.qk_bank.shape) == (64, 192, 768) and model96.yarn.rope_dims == 48


def test_record_gate_layout_matches_recipe():
    pre = GateLayout.build(6, [1, 3], [3], [0, 1, 2, 3])
    post = GateLayout.build(6, [4, 7], [10], [4, 5, 7, 8, 9], skip=True, dc_layers=[10])
    assert (pre.xsa[1], pre.xsa[3], pre.attn_gate[3]) == (slice(0, 6), slice(6, 12), slice(12, 18))
    assert [pre.x0[i] for i in range(4)] == [18, 20, 22, 24] and pre.bigram[3] == 25 and pre.size == 26
    assert (post.xsa[7], post.attn_gate[10], post.x0[4], post.bigram[9]) == (slice(6, 12), slice(12, 18), 18, 27)
    assert post.skip == 28 and post.dc_w1[10] == slice(29, 35) and post.dc_w2[10] == slice(35, 41)
    b = post.bias_init(attn_gate=0.25, bigram=0.05, skip=0.5, dc_w1=1.0)
    assert b[12:18].eq(0.25).all() and b[19:28:2].eq(0.05).all() and b[18:28:2].eq(0).all()
    assert b[28] == 0.5 and b[29:35].eq(1.0).all() and b[35:41].eq(0).all()


def test_init_values_follow_record():
    model = RecordGPT(tiny_cfg())
    s = model.mudd_gate_scale
    eff_post = model.mudd_gate_b2[1] * s
    assert torch.allclose(eff_post[model.post_layout.skip], torch.tensor(0.5))
    assert torch.allclose(model.mudd_b2[1, 1] * 0.1, torch.tensor(-0.5))  # backout
    assert torch.equal(model.embed, model.lm_head.T)
    assert (model.mlp_bank[:, 1] == 0).all() and (model.mlp_bank[:, 0] != 0).any()
    L = model.num_layers
    assert model.scalars[2 * L] == 0 and model.scalars[2 * L + 1] == -1.5
    assert torch.allclose(model.scalars[0:2 * L:2], torch.tensor(0.5))


def test_causal_per_token_loss():
    model = perturb(RecordGPT(tiny_cfg()))
    batch = make_batch()
    with torch.no_grad():
        base = model.per_token_loss(batch, ARGS)
        for p in (1, 37, 41, 80):  # inside doc 0, doc 0's last token, inside docs 1 and 2
            changed = SimpleNamespace(**vars(batch))
            changed.inputs = batch.inputs.clone()
            changed.inputs[p] = (changed.inputs[p] + 1) % 257
            out = model.per_token_loss(changed, ARGS)
            assert torch.equal(out[:p], base[:p]), f"position {p} leaked backwards"
            assert not torch.equal(out[p:], base[p:]), f"changing position {p} changed nothing"


@pytest.mark.parametrize("key_offset", [False, True])
def test_document_isolation(key_offset):
    """Only smear, the bigram hash and the key offset cross documents (module docstring)."""
    model = perturb(RecordGPT(tiny_cfg(), scaled_record_arch(6, key_offset=key_offset)))
    batch = make_batch()
    doc1 = slice(40, 70)
    with torch.no_grad():
        base = model.per_token_loss(batch, ARGS)
        inner = SimpleNamespace(**vars(batch))
        inner.inputs = batch.inputs.clone()
        inner.inputs[20] = (inner.inputs[20] + 1) % 257  # not doc 0's last token
        out = model.per_token_loss(inner, ARGS)
        if key_offset:
            assert not torch.equal(out[doc1], base[doc1])  # the record's key offset leaks
        else:
            assert torch.equal(out[40:], base[40:])
        last = SimpleNamespace(**vars(batch))
        last.inputs = batch.inputs.clone()
        last.inputs[39] = (last.inputs[39] + 1) % 257  # doc 0's last token: smear + bigram reach doc 1
        out = model.per_token_loss(last, ARGS)
        assert not torch.equal(out[40], base[40])


def test_loss_falls_with_adam():
    torch.manual_seed(0)
    cfg = tiny_cfg(num_layers=4, heads=2, qk=8, v=16)
    model = RecordGPT(cfg)
    T = 64
    pattern = torch.tensor([3, 17, 99, 4, 250, 3, 8, 61])
    tokens = pattern.repeat(T // 8 + 1)
    batch = SimpleNamespace(inputs=tokens[:T].int(), targets=tokens[1 : T + 1].long(),
                            cu_seqlens=torch.tensor([0, 32, T], dtype=torch.int32), max_seqlen=32, num_docs=2,
                            bigram=None)
    args = ForwardArgs(window_short=8, window_long=16, mtp_weights=(1.0,), prefix_weight=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model.loss(batch, args)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.sync_embed_from_lm_head()
        losses.append(loss.item())
    assert losses[-1] < 0.3 * losses[0], losses


def test_scaled_arch_layouts_build_and_run():
    for L in (4, 5):
        model = perturb(RecordGPT(tiny_cfg(num_layers=L, heads=2, qk=8, v=16)))
        loss = model.loss(make_batch(T=48, doc_lens=(30, 18)), ARGS)
        assert torch.isfinite(loss)
    with pytest.raises(ConfigError):
        scaled_record_arch(8)
    with pytest.raises(ConfigError):
        RecordGPT(tiny_cfg(), scaled_record_arch(6, xsa_layers=(0,)))  # XSA on a paired layer
    with pytest.raises(ConfigError):
        RecordGPT(ModelConfig(vocab_size=257, num_layers=6, model_dim=48, num_heads=3, qk_head_dim=16, v_head_dim=16))


@pytest.mark.parametrize("align", [8, 16])
def test_gate_gemm_padding_changes_nothing(align):
    """model.gate_gemm_align pads the MUDD / MUDD-gate projections' output columns with zeros and
    slices them off: the loss and every gradient equal the unpadded network's, and the padded
    outputs really are wider (the GEMM sees an aligned row stride)."""
    import dataclasses

    from speedrun.model import record_parts

    plain = perturb(RecordGPT(tiny_cfg()))
    padded = RecordGPT(dataclasses.replace(tiny_cfg(), gate_gemm_align=align))
    padded.load_state_dict(plain.state_dict())
    widths = []
    real_linear = F.linear

    def spy(x, w, b=None):
        out = real_linear(x, w, b)
        widths.append(out.shape[-1])
        return out

    batch = make_batch()
    lp = plain.loss(batch, ARGS)
    lp.backward()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(record_parts.F, "linear", spy)
        la = padded.loss(batch, ARGS)
    la.backward()
    gate_sizes = {plain.pre_layout.size, plain.post_layout.size, 14, 5}
    assert {-(-n // align) * align for n in gate_sizes} <= set(widths) and not gate_sizes & set(widths), widths
    torch.testing.assert_close(la, lp, rtol=1e-6, atol=0)
    for (name, p1), (_, p2) in zip(plain.named_parameters(), padded.named_parameters()):
        torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ConfigError, match="gate_gemm_align"):
        dataclasses.replace(tiny_cfg(), gate_gemm_align=3).validate()


def test_bank_padding_keeps_real_rows():
    model = RecordGPT(tiny_cfg())
    qk = model.qk_bank.detach().clone()
    layout = model.bank_padding(8)
    assert layout["qk_bank"] == (20, 24) and layout["vo_bank"] == (10, 16) and layout["mlp_bank"] == (12, 16)
    assert torch.equal(model.qk_bank[:20], qk) and (model.qk_bank[20:] == 0).all()
    assert model.scalars.shape[0] % 8 == 0 and model.mlp_bank.bank_shape == (16, 256, 64)
    assert model.bank_padding(5)["mlp_bank"] == (12, 20) and torch.equal(model.qk_bank[:20], qk)
    assert model.loss(make_batch(), ARGS).isfinite()


def test_prefix_table_changes_training_loss_only_when_set():
    model = perturb(RecordGPT(tiny_cfg()))
    batch = make_batch()
    with torch.no_grad():
        off = model.loss(batch, ARGS)
        assert torch.equal(model.loss(batch, ForwardArgs(8, 24, (1.0, 0.5, 0.25), 0.0)), off)
        table = torch.full((model.vocab,), -1, dtype=torch.int64)
        table[:257] = torch.arange(257).roll(1)
        model.set_prefix_table(table)
        assert not torch.equal(model.loss(batch, ARGS), off)
    with pytest.raises(ValueError):
        model.set_prefix_table(torch.zeros(10, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------
# Parts


def test_softcapped_mtp_ce_matches_loop():
    T, D, V = 10, 8, 24
    h, w = torch.randn(T, D), torch.randn(D, V)
    tg = torch.randint(0, V, (T,))
    tg[3] = -1
    pt = torch.randint(-1, V, (T,))
    weights = (1.0, 0.5, 0.25)
    got = softcapped_mtp_ce(h, w, tg, weights, pt, 0.3, softcap=(23.0, 5.0, 7.5))
    z = 23 * torch.sigmoid((h @ w + 5) / 7.5)
    ref = torch.zeros(T)
    for t in range(T):
        for k, wk in enumerate(weights):
            if t + k < T and tg[t + k] >= 0:
                ref[t] += wk * F.cross_entropy(z[t], tg[t + k])
        if pt[t] >= 0:
            ref[t] += 0.3 * F.cross_entropy(z[t], pt[t])
    assert torch.allclose(got, ref, atol=1e-5)


def naive_dc(base, q, k, v, w1, w2, cu, scale, window):
    T, H, _ = q.shape
    out = base.clone().double()
    doc = torch.searchsorted(cu.long(), torch.arange(T), right=True) - 1
    for t in range(T):
        keys = [s for s in range(max(0, t - window + 1), t + 1) if doc[s] == doc[t]]
        a = torch.zeros(len(keys), dtype=torch.float64)
        for h in range(H):
            sc = torch.stack([q[t, h].double() @ k[s, h].double() for s in keys]) * scale
            a += w1[t, h].double() * torch.softmax(sc, 0)
        for h in range(H):
            out[t, h] += w2[t, h].double() * (a[:, None] * v[keys, h].double()).sum(0)
    return out


@pytest.mark.parametrize("T,window,block", [(37, 5, 8), (50, 16, 16), (20, 112, 128), (50, 21, 8)])
def test_dc_banded_matches_naive(T, window, block):
    H, Dqk, Dv = 3, 12, 16
    q, k = torch.randn(T, H, Dqk), torch.randn(T, H, Dqk)
    v, base = torch.randn(T, H, Dv), torch.randn(T, H, Dv)
    w1, w2 = torch.randn(T, H), torch.randn(T, H)
    cu = torch.tensor([0, 7, 7, T // 2, T, T], dtype=torch.int32)
    got = dc_postonly_correction(base, q, k, v, w1, w2, cu, scale=0.3, window=window, block=block)
    ref = naive_dc(base, q, k, v, w1, w2, cu, 0.3, window)
    assert ((got.double() - ref).norm() / ref.norm()) < 1e-5


def test_bigram_hash_and_sign_index():
    x = torch.tensor([5, 50303, 7, 0], dtype=torch.int32)
    mod = 377279
    h = bigram_hash(x, mod)
    assert h.dtype == torch.int32 and h[0] == mod
    assert h[1] == ((36313 * int(x[1])) ^ (27191 * mod)) % mod  # upstream's in-place quirk
    for t in range(2, 4):
        assert h[t] == ((36313 * int(x[t])) ^ (27191 * int(x[t - 1]))) % mod
    s = bigram_sign_index(x, 8192)
    assert s[0] == 0 and s[2] == (50303 ^ 7) % 8192


def test_yarn_apply_and_paired_positions():
    y = Yarn(16, 0.5, 1024.0, attn_scale=0.1)
    f0 = y.freqs.clone()
    y.apply(384, 896)
    s = 384 / 896
    assert math.isclose(y.attn_scale, 0.1 * (0.2 * math.log(896 / 384) + 1))
    rot = 384 * f0 / (2 * math.pi)
    assert torch.allclose(y.freqs[rot >= 32], f0[rot >= 32]) and torch.allclose(y.freqs[rot <= 1], f0[rot <= 1] * s)
    y.reset()
    assert torch.equal(y.freqs, f0) and y.attn_scale == 0.1
    # Paired: the record views (T, H, D) as (T, H/2, 2D), first D dims at position 2t, second at 2t+1.
    T, H, D = 5, 4, 16
    x = torch.randn(T, H, D)
    cos, sin = y.tables(2 * T, "cpu")
    wide = x.view(T, H // 2, 2 * D)
    first = apply_rotary(wide[..., :D].contiguous(), cos[0::2][:T], sin[0::2][:T])
    second = apply_rotary(wide[..., D:].contiguous(), cos[1::2][:T], sin[1::2][:T])
    ref = torch.cat((first, second), dim=-1).view(T, H, D)
    assert torch.allclose(y.rotate_paired(x), ref)
    assert y.rope_dims == 8 and torch.equal(y.rotate(x)[..., 8:], x[..., 8:])  # stationary half


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factor_rotation_equals_the_sliced_reference_bitwise(dtype):
    """The elementwise rotation (factor tables, pair swap) gives apply_rotary's bits: the same fp32
    products and sums, stationary dims untouched; paired and key-offset forms too; gradients of the
    two forms agree.  Poisoned stationary values (1e30) would turn into inf/NaN if any were scaled."""
    from speedrun.model.rotary import rotate_with_factors, rotary_factors, shift_stationary_keys

    y = Yarn(16, 0.5, 1024.0, attn_scale=0.1)
    y.apply(384, 896)  # non-trivial frequencies
    T, H, D = 7, 4, 16
    x = torch.randn(T, H, D).to(dtype)
    x[..., 12] = 1e30
    cos, sin = y.tables(2 * T, "cpu")
    assert torch.equal(y.rotate(x), apply_rotary(x, cos, sin))
    even = apply_rotary(x[:, 0::2], cos[0 : 2 * T : 2], sin[0 : 2 * T : 2])
    odd = apply_rotary(x[:, 1::2], cos[1 : 2 * T : 2], sin[1 : 2 * T : 2])
    assert torch.equal(y.rotate_paired(x), torch.stack((even, odd), dim=2).flatten(1, 2))
    r = y.rope_dims
    shifted = torch.cat((x[:1, :, r:], x[:-1, :, r:]))
    assert torch.equal(shift_stationary_keys(x, r), torch.cat((x[:, :, :r], shifted), dim=-1))
    assert torch.equal(shift_stationary_keys(x[:1], r), x[:1])
    # gradients (both compute in fp32): the transposed rotation, to fp32 rounding
    xg = torch.randn(T, H, D, requires_grad=True)
    g = torch.randn(T, H, D)
    fc, fs = rotary_factors(cos, sin, D)
    (gx,) = torch.autograd.grad((rotate_with_factors(xg, fc[:T, None], fs[:T, None]) * g).sum(), xg)
    (gr,) = torch.autograd.grad((apply_rotary(xg, cos, sin) * g).sum(), xg)
    assert torch.allclose(gx, gr, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(gx, g, rtol=1e-3)  # the rotation is not the identity


def test_rotation_rejects_a_width_it_has_no_tables_for():
    y = Yarn(16, 0.5, 1024.0)
    with pytest.raises(ValueError, match=r"expected x \(T, H, 16\)"):
        y.rotate(torch.randn(3, 2, 12))
    with pytest.raises(ValueError, match="even number of heads"):
        y.rotate_paired(torch.randn(3, 3, 16))
    from speedrun.model.rotary import rotary_factors

    with pytest.raises(ValueError, match="even head_dim"):
        rotary_factors(torch.zeros(4, 5), torch.zeros(4, 5), 8)


def test_prefix_table_from_mappings_and_byte_tokenizer():
    mapping = {b"a": 0, b"ab": 1, b"abc": 2, b"b": 3, b"abd": 4, b"xyz": 5}
    assert build_prefix_table(mapping, 8).tolist() == [-1, 0, 1, -1, 1, -1, -1, -1]
    byte_tok = SimpleNamespace(name="bytes", vocab_size=257, bos_id=256)
    assert (build_prefix_table(byte_tok, 384) == -1).all()
    with pytest.raises(ValueError):
        build_prefix_table(mapping, 4)
    with pytest.raises(ValueError):
        build_prefix_table(object(), 8)


def test_prefix_table_gpt2(gpt2_dir):
    from speedrun.data.tokenizer import get_tokenizer

    tok = get_tokenizer("gpt2", gpt2_dir)
    table = build_prefix_table(tok, 50304)
    enc = tok.encoding
    assert table.shape == (50304,) and table[50256] == -1 and (table[50257:] == -1).all()
    the = enc.encode_single_token(b" the")
    assert enc.decode_single_token_bytes(int(table[the])) == b" th"
    for tid in torch.randint(256, 50256, (200,)).tolist():
        b = enc.decode_single_token_bytes(tid)
        p = int(table[tid])
        if p >= 0:
            pb = enc.decode_single_token_bytes(p)
            assert b.startswith(pb) and len(pb) < len(b)


def test_eval_ce_chunks_and_matches_kernel_reference():
    from speedrun.model.record_parts import softcapped_ce_eval_plain

    T, D, V = 11, 8, 24
    h, w = torch.randn(T, D), torch.randn(D, V)
    tg = torch.randint(0, V, (T,))
    tg[4] = -1
    got = softcapped_ce_eval_plain(h, w, tg, softcap=(23.0, 5.0, 7.5), chunk_rows=3)
    z = 23 * torch.sigmoid((h @ w + 5) / 7.5)
    ref = F.cross_entropy(z, tg, reduction="none", ignore_index=-1)
    assert torch.allclose(got, ref, atol=1e-6) and got[4] == 0
    try:
        from speedrun.kernels.cross_entropy import softcapped_multitoken_ce_reference
    except ImportError:
        pytest.skip("speedrun.kernels.cross_entropy not available")
    pt = torch.randint(-1, V, (T,))
    mine = softcapped_mtp_ce(h, w, tg, (1.0, 0.5), pt, 0.25, softcap=(23.0, 5.0, 7.5))
    theirs = softcapped_multitoken_ce_reference(h @ w, tg, (1.0, 0.5), pt, 0.25, (23.0, 5.0, 7.5))
    assert torch.allclose(mine, theirs, atol=1e-5)
