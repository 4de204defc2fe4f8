"""The candidate arm's switches on the record network: reduced-width Q/K, packed QKV, fused QK-prep."""

from types import SimpleNamespace

import pytest
import torch

from speedrun.config import ModelConfig, preset
from speedrun.errors import ConfigError
from speedrun.model.interface import ForwardArgs
from speedrun.model.record import RecordGPT


def _pair(qkv_path, kernels="reference", dtype=torch.float32, **switches):
    base = dict(vocab_size=257, num_layers=6, model_dim=32, num_heads=2, qk_head_dim=12, v_head_dim=16,
                architecture="record")
    torch.manual_seed(0)
    ref = RecordGPT(ModelConfig(**base))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    cand = RecordGPT(ModelConfig(**base, qkv_path=qkv_path, kernels=kernels, **switches))
    cand.load_state_dict(ref.state_dict())
    return ref.to(dtype), cand.to(dtype)


def _batch(T=64):
    g = torch.Generator().manual_seed(3)
    return SimpleNamespace(inputs=torch.randint(0, 257, (T,), generator=g, dtype=torch.int32),
                           targets=torch.randint(0, 257, (T,), generator=g),
                           cu_seqlens=torch.tensor([0, 23, T, T], dtype=torch.int32), max_seqlen=T, bigram=None)


ARGS = ForwardArgs(window_short=16, window_long=48, mtp_weights=(1.0, 0.5), prefix_weight=0.0)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("qkv_path,bound_loss,bound_grad", [("fused", 1e-5, 1e-4), ("fused_fp8", 5e-2, 0.25)])
def test_candidate_path_matches_reference(qkv_path, bound_loss, bound_grad):
    """FP8 off: the packed layout + fused QK-prep equals the reference path (fp32 here: to rounding).
    FP8 on: within the documented bound (e4m3 operands, e5m2 gradients: a few percent)."""
    ref, cand = _pair(qkv_path)
    batch = _batch()
    lr, lc = ref.loss(batch, ARGS), cand.loss(batch, ARGS)
    lr.backward()
    lc.backward()
    assert abs(lc.item() - lr.item()) / lr.item() < bound_loss
    gr, gc = _grads(ref), _grads(cand)
    assert gr.keys() == gc.keys()
    for name in ("qk_bank", "vo_bank", "scalars", "mlp_bank", "embed"):
        if gr[name].norm() == 0:
            continue
        err = ((gc[name] - gr[name]).norm() / gr[name].norm()).item()
        assert err < bound_grad, (name, err)


@pytest.mark.parametrize("fp8,plain", [
    (dict(kernels="fp8"), dict()),  # the record: FP8 MLP forward (and head)
    (dict(kernels="fp8_full", qkv_path="fused_fp8"), dict(qkv_path="fused")),  # the candidate's FP8 switches
], ids=["record", "candidate"])
def test_evaluation_runs_without_fp8(fp8, plain):
    """Upstream validates in bf16 (its FP8 paths are for training only): in evaluation mode the FP8
    model's per-token loss is the same model's without FP8, to the bit, while its training loss is
    not (the FP8 kernels run there)."""
    base = dict(vocab_size=257, num_layers=6, model_dim=32, num_heads=2, qk_head_dim=16, v_head_dim=16,
                architecture="record")
    torch.manual_seed(0)
    ref = RecordGPT(ModelConfig(**base, **plain))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    quant = RecordGPT(ModelConfig(**base, **fp8))
    quant.load_state_dict(ref.state_dict())
    batch = _batch()
    for model in (ref, quant):
        model.refresh_fp8_weights()
    with torch.no_grad():
        assert torch.equal(quant.eval().per_token_loss(batch, ARGS), ref.eval().per_token_loss(batch, ARGS))
        assert quant.train().loss(batch, ARGS) != ref.train().loss(batch, ARGS)


def test_value_residual_gradient_is_not_copied(monkeypatch):
    """QK-prep's value residual gets v's gradient by reference (attach_value_residual_grad): no
    opaque op returns a tensor it was handed, which the op would have to copy (T x H x Dv per
    layer with a value residual and micro-batch, ~1.4 ms per stage-3 step of the candidate)."""
    from speedrun.kernels import opaque, qk_prep

    if not qk_prep.interpreting():
        pytest.skip("the opaque QK-prep op runs on the CPU only under TRITON_INTERPRET=1")
    copied = []
    unalias = opaque._unalias

    def spy(outs, inputs):
        res = unalias(outs, inputs)
        copied.extend(o.shape for o, r in zip(outs, res) if o is not r)
        return res

    monkeypatch.setattr(opaque, "_unalias", spy)
    _, cand = _pair("fused")
    assert any(k[0] == "qk_prep" and k[2] for k in cand._kernel_handles)  # value-residual layers exist
    cand.loss(_batch(), ARGS).backward()
    assert copied == []


def test_candidate_preset_is_record_plus_switches():
    rec, cand = preset("record"), preset("candidate")
    assert (cand.model.qk_head_dim, cand.model.v_head_dim) == (96, 128)
    assert cand.model.qkv_path == "fused_fp8" and cand.model.kernels == "fp8_full"
    assert (cand.model.fp8_input_scaling, rec.model.fp8_input_scaling) == ("delayed", "current")
    assert cand.train.optimizer_compile and rec.train.optimizer_compile and not preset("tiny-record").train.optimizer_compile
    assert (cand.train.steps, cand.train.num_extension) == (1315, 45)
    assert (rec.train.steps, rec.train.num_extension) == (1285, 15)
    # the record's MLP switches (its FP8-forward MLP only); the exact gate padding in both arms
    assert (rec.model.mlp_input_quant, rec.model.mlp_weight_grad) == ("graph", "accumulate")
    assert (cand.model.mlp_input_quant, cand.model.mlp_weight_grad) == ("kernel", "autograd")
    assert rec.model.gate_gemm_align == cand.model.gate_gemm_align == 8
    rec.model.validate()
    cand.model.validate()
    assert cand.model.model_dim == rec.model.model_dim == cand.model.num_heads * cand.model.v_head_dim


def test_softmax_scale_starts_by_pr344s_rule():
    """0.1 at equal Q/K and V widths (the record), 0.1 * sqrt(v / qk) for narrower Q/K (PR #344's
    0.1155 at 96 of 128; tests/test_upstream_pr344_goldens.py checks it against PR #344's model); a
    configured ``model.attn_scale`` wins."""
    from speedrun.model.record import RecordArchConfig

    arch = RecordArchConfig()
    start = lambda name: RecordGPT.starting_attn_scale(preset(name).model, arch)  # noqa: E731
    assert start("record") == start("tiny-record") == 0.1
    assert start("candidate") == start("tiny-candidate") == pytest.approx(0.1 * (4 / 3) ** 0.5, rel=1e-12)
    cfg = preset("candidate").model
    cfg.attn_scale = 0.1
    assert RecordGPT.starting_attn_scale(cfg, arch) == 0.1
    ref, cand = _pair("reference")
    assert ref.attn_scale == cand.attn_scale == pytest.approx(0.1 * (16 / 12) ** 0.5)
    ref.apply_yarn(64, 128)
    ref.reset_yarn()
    assert ref.attn_scale == cand.attn_scale


def test_unknown_switch_values_are_clear_errors():
    with pytest.raises(ConfigError, match="qkv_path"):
        ModelConfig(architecture="record", qkv_path="fast").validate()
    with pytest.raises(ConfigError, match="architecture=record only"):
        ModelConfig(kernels="fp8").validate()
    for kernels, scaling in (("fp8_full", "current"), ("fp8", "delayed"), ("reference", "current")):
        with pytest.raises(ConfigError, match="mlp_input_quant=graph"):
            ModelConfig(architecture="record", kernels=kernels, fp8_input_scaling=scaling,
                        mlp_input_quant="graph").validate()
    with pytest.raises(ConfigError, match="mlp_input_quant"):
        ModelConfig(architecture="record", kernels="fp8", mlp_input_quant="inductor").validate()


def test_mlp_input_quantised_in_the_graph_equals_the_kernel_route(monkeypatch):
    """model.mlp_input_quant=graph: the MLP's own input quantisation never runs, and the record
    network's loss and gradients are the kernel route's, bit for bit (same scale, same bytes)."""
    from speedrun.kernels.fp8_cache import InputScaling

    calls = []
    own = InputScaling.quantize_input
    monkeypatch.setattr(InputScaling, "quantize_input", lambda self, t, which, **kw: calls.append(which) or own(self, t, which, **kw))
    _, kernel = _pair("reference", "fp8")
    _, graph = _pair("reference", "fp8", mlp_input_quant="graph")
    batch = _batch()
    results = []
    for model in (kernel, graph):
        calls.clear()
        loss = model.loss(batch, ARGS)
        loss.backward()
        results.append((loss, _grads(model), list(calls)))
    (lk, gk, ck), (lg, gg, cg) = results
    assert ck == ["x"] * 6 and cg == []  # six MLP layers; graph: none through the MLP's own pass
    assert torch.equal(lk, lg) and gk.keys() == gg.keys()
    assert all(torch.equal(gk[n], gg[n]) for n in gk)


def test_candidate_bank_shapes_at_full_size():
    with torch.device("meta"):
        cfg = preset("candidate").model
        model = RecordGPT(cfg)
    assert tuple(model.qk_bank.shape[1:]) == (2 * 96, 768)
    assert tuple(model.vo_bank.shape[1:]) == (768, 768)


def _fp8_model():
    cfg = ModelConfig(vocab_size=257, num_layers=6, model_dim=32, num_heads=2, qk_head_dim=16, v_head_dim=16,
                      architecture="record", qkv_path="fused_fp8", kernels="fp8_full")
    torch.manual_seed(0)
    model = RecordGPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def test_fp8_weight_cache_is_used_and_never_stale():
    from speedrun.kernels.fp8_cache import StaleFP8CacheError

    model = _fp8_model()
    batch = _batch()
    on_the_fly = model.loss(batch, ARGS).item()  # no cache yet: quantised on the call
    model.refresh_fp8_weights()
    cached = model.loss(batch, ARGS)
    cached.backward()  # backward reads the cache too
    assert abs(cached.item() - on_the_fly) / on_the_fly < 2e-2
    with torch.no_grad():
        model.mlp_bank.add_(0.01)  # an update without a refresh
    with pytest.raises(StaleFP8CacheError):
        model.loss(batch, ARGS)
    model.refresh_fp8_weights()
    with torch.no_grad():
        model.scalars.mul_(1.01)  # sa_lambda is folded into the packed QKV scale
    with pytest.raises(StaleFP8CacheError):
        model.loss(batch, ARGS)


def test_fp8_head_weight_is_quantised_once_per_update(kernels_use_references, monkeypatch):
    """The FP8 lm_head comes from refresh_fp8_weights (one quantisation per optimizer update, not
    one per micro-batch), gives the same loss bit for bit as quantising in the call, and an
    in-place change of lm_head without a refresh is refused."""
    from speedrun.kernels import cross_entropy as CE
    from speedrun.kernels.fp8_cache import StaleFP8CacheError

    model = _fp8_model()
    batch = _batch()
    calls = []
    real = CE.quantize_head_weight
    monkeypatch.setattr(CE, "quantize_head_weight", lambda *a, **k: calls.append(1) or real(*a, **k))
    model.refresh_fp8_weights()
    assert len(calls) == 1 and model.head_fp8_weight() is not None
    cached = model._head_fp8
    model._head_fp8 = None  # the head alone quantises in the call (MLP/QKV caches stay)
    on_the_fly = model.loss(batch, ARGS)
    model._head_fp8 = cached
    calls.clear()
    for _ in range(3):  # micro-batches of one step
        loss = model.loss(batch, ARGS)
        loss.backward()
        assert torch.equal(loss, on_the_fly)
    assert not calls
    with torch.no_grad():
        model.lm_head.add_(0.01)  # an update without a refresh
    with pytest.raises(StaleFP8CacheError, match="lm_head"):
        model.loss(batch, ARGS)
    model.refresh_fp8_weights()
    assert len(calls) == 1 and not torch.equal(model.loss(batch, ARGS), on_the_fly)


def test_training_refreshes_the_fp8_cache_once_per_update(tmp_path, builtin_cache, monkeypatch,
                                                         kernels_use_references):
    """The candidate's FP8 weight copies are requantised once at construction and once after each
    optimizer update, never more.  The count is the training loop's bookkeeping, the same whatever
    runs the quantisation: the kernels' PyTorch references here (the candidate's Triton kernels run
    end to end in test_tiny_candidate)."""
    from speedrun.config import apply_overrides
    from speedrun.train import recipes
    from speedrun.train.loop import train

    monkeypatch.setenv("SPEEDRUN_CACHE_DIR", str(builtin_cache))
    seen = []
    real = recipes.RecordRecipe.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        seen.append(self)

    monkeypatch.setattr(recipes.RecordRecipe, "__init__", spy)
    cfg = preset("tiny-record")
    apply_overrides(cfg, ["model.num_layers=4", "model.model_dim=32", "model.num_heads=2", "model.qk_head_dim=16",
                          "model.qkv_path=fused_fp8", "model.kernels=fp8_full", "train.batch_divisor=1024",
                          "train.steps=5", "train.num_extension=1", "train.val_every=0", "train.val_tokens=384",
                          f"out_dir={tmp_path}"])
    result = train(cfg, console=False)
    assert result.final_val_loss == result.final_val_loss
    (recipe,) = seen
    assert recipe.fp8_refreshes == 1 + 5  # at construction, then after each of the 5 updates


@pytest.mark.parametrize("qkv_path", ["fused", "fused_fp8"])
def test_qk_prep_writes_the_backends_padded_width(qkv_path):
    """With a backend that needs D_qk == D_v (varlen, FA3) QK-prep writes Q/K zero-padded to D_v, so
    the backend pads nothing; loss and gradients equal the unpadded path (DC reads the Dqk view)."""
    from speedrun.attention.reference import reference_attention

    seen = []

    def equal_width_backend(q, k, v, cu_seqlens, max_seqlen, *, window=None, scale=None):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        assert scale is not None
        return reference_attention(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale)

    equal_width_backend.pads_qk_to_v = True
    _, plain = _pair(qkv_path)
    _, padded = _pair(qkv_path)
    padded._backends[torch.device("cpu")] = equal_width_backend
    batch = _batch()
    lp, lq = plain.loss(batch, ARGS), padded.loss(batch, ARGS)
    lp.backward()
    lq.backward()
    assert seen and all(s == (16, 16, 16) for s in seen), seen
    assert torch.allclose(lp, lq, rtol=1e-6), (lp.item(), lq.item())
    gp, gq = _grads(plain), _grads(padded)
    for name in gp:
        assert torch.allclose(gp[name], gq[name], rtol=1e-4, atol=1e-6), name


def test_qk_prep_hands_the_qkv_gemm_its_e5m2_gradient(monkeypatch):
    """model.qk_prep_fp8_grad: once the delayed dy scales are ready (after the first step end), each
    attention layer's QK-prep backward writes d qkv as e5m2 and the packed QKV GEMM's backward takes
    it instead of quantising d qkv itself.  Loss and every gradient are the switch-off model's, bit
    for bit (the same bytes by the same rule), over two steps; a copy of d qkv (another tensor)
    would be quantised as usual."""
    from speedrun.kernels.fp8_cache import interpreting

    if not interpreting():
        pytest.skip("the fused QK-prep kernel runs on CUDA or under TRITON_INTERPRET=1")
    switches = dict(fp8_input_scaling="delayed")
    _, off = _pair("fused_fp8", "fp8_full", dtype=torch.bfloat16, **switches)
    _, on = _pair("fused_fp8", "fp8_full", dtype=torch.bfloat16, qk_prep_fp8_grad=True, **switches)
    layers = len(on.attn_layers)
    results = {}
    for name, model in (("off", off), ("on", on)):
        steps = []
        for step in range(2):
            batch = _batch(64 + 16 * step)
            loss = model.loss(batch, ARGS)
            loss.backward()
            steps.append((loss.detach(), _grads(model)))
            model.end_fp8_step()
            model.zero_grad()
        results[name] = steps
    taken = [st.handoffs_taken for st in on._qkv_inputs.values()]
    assert sum(taken) == layers and all(t == 1 for t in taken)  # none in step 1 (scales not ready), all in step 2
    assert all(st.handoffs_taken == 0 for st in off._qkv_inputs.values())
    for (lo, go), (ln, gn) in zip(results["off"], results["on"]):
        assert torch.equal(lo, ln) and go.keys() == gn.keys()
        for k in go:
            assert torch.equal(go[k], gn[k]), k


def test_handed_over_gradient_is_taken_only_for_its_own_tensor():
    from speedrun.kernels.fp8_cache import E5M2, InputScaling

    st = InputScaling(input_scaling="delayed")
    g = torch.randn(32, 48).bfloat16()
    st.quantize_input(g, "g", transposed=False)  # not ready: current scaling, and its amax counts
    from speedrun.kernels.fp8_cache import end_fp8_step

    end_fp8_step([st])
    scale, acc = st.g_epilogue_args(g.device)
    fake = torch.zeros(g.shape, dtype=E5M2)
    st.hand_over_g(g, fake, scale)
    q, qt, s = st.quantize_input(g.clone(), "g", transposed=False)  # another tensor: quantised
    assert st.handoffs_taken == 0 and q.float().abs().sum() > 0
    st.hand_over_g(g, fake, scale)
    assert st.quantize_input(g, "g", transposed=True)[1] is not None and st.handoffs_taken == 0  # transposed wanted
    st.hand_over_g(g, fake, scale)
    q, qt, s = st.quantize_input(g, "g", transposed=False)
    assert q is fake and qt is None and s is scale and st.handoffs_taken == 1
    assert InputScaling().g_epilogue_args(g.device) is None  # current scaling: no epilogue
