"""torch.compile of the networks: one graph (no graph breaks, fused kernels as opaque ops) that
computes what the eager network computes.

A graph break inside the layer loop makes Dynamo skip the whole network and run it eagerly (the
record preset once ran like that, 2.2x slower, with every elementwise op its own kernel), so the
models compile with ``fullgraph=True``; these tests trace them with the ``aot_eager`` backend
(Dynamo + AOTAutograd, no code generation) to keep CI fast.  The fused-kernel paths run their
Triton kernels under the interpreter here."""

import copy
import shutil

import pytest
import torch

from speedrun.attention.reference import reference_attention
from speedrun.config import ModelConfig
from speedrun.kernels import opaque
from speedrun.model.gpt import GPT
from speedrun.model.record import RecordGPT
from test_candidate import ARGS, _batch, _grads, _pair


def _equal_width_reference(q, k, v, cu_seqlens, max_seqlen, *, window=None, scale=None):
    assert q.shape[-1] == k.shape[-1] == v.shape[-1], "QK-prep should have padded Q/K to V's width"
    return reference_attention(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale)


_equal_width_reference.pads_qk_to_v = True


def _compiled(model):
    model._hidden_fn = torch.compile(model.hidden, fullgraph=True, backend="aot_eager", dynamic=False)
    return model


@pytest.mark.parametrize("qkv_path,kernels,switches", [
    ("reference", "reference", {}), ("reference", "fp8", {}), ("reference", "fp8", {"mlp_input_quant": "graph"}),
    ("reference", "fp8", {"embedding_grad": "atomic"}), ("reference", "fp8", {"embedding_grad": "atomic_graph"}),
    ("reference", "fp8", {"mlp_weight_grad": "accumulate"}), ("fused_fp8", "fp8_full", {})])
def test_compiled_record_network_equals_eager(qkv_path, kernels, switches):
    """Baseline (reference, the record's FP8 MLP, its input quantised in the graph, the embedding
    rows' gradients accumulated in place, looked up before or inside the network, the MLP bank's
    gradient summed in place) and candidate switches: loss, every gradient (the accumulated
    gradients flushed) and the no-grad evaluation forward equal the eager model's, over two steps
    (the second uses the delayed FP8 scales the first measured)."""
    torch._dynamo.reset()
    _, eager = _pair(qkv_path, kernels, **switches)
    if qkv_path != "reference":  # the GPU's case: a backend that wants Q/K at V's width (varlen, FA3)
        eager._backends[torch.device("cpu")] = _equal_width_reference
    compiled = _compiled(copy.deepcopy(eager))
    compiled._backends = dict(eager._backends)
    for step in range(2):
        batch = _batch(64 + 16 * step)
        le, lc = eager.loss(batch, ARGS), compiled.loss(batch, ARGS)
        le.backward()
        lc.backward()
        assert torch.equal(le, lc), (step, le.item(), lc.item())
        for m in (eager, compiled):
            m.flush_embedding_grads()
            m.flush_weight_grads()
        ge, gc = _grads(eager), _grads(compiled)
        if "mlp_weight_grad" in switches:  # the compiled backward kept the op's in-place sums
            assert gc["mlp_bank"].abs().sum() > 0 and compiled.mlp_bank.grad is compiled._mlp_weight_grads.buffer
        if "embedding_grad" in switches:
            assert {"embed", "value_embeds", "bigram_embed"} <= gc.keys()
        assert ge.keys() == gc.keys()
        for name in ge:
            assert torch.allclose(ge[name], gc[name], rtol=1e-5, atol=1e-6), (step, name)
        for m in (eager, compiled):
            m.zero_grad()
    with torch.no_grad():
        assert torch.allclose(eager.per_token_loss(batch, ARGS), compiled.per_token_loss(batch, ARGS), atol=1e-5)
    assert not any(opaque._PENDING.values()), "every fused forward with gradients had its backward"


def test_copies_are_uncompiled_and_own_their_kernels():
    """A deep copy neither calls the original's compiled network nor shares its fused-kernel ops
    (whose saved state would otherwise mix between the two models)."""
    _, model = _pair("fused_fp8", "fp8_full")
    model.compile_body(backend="aot_eager", dynamic=False)
    twin = copy.deepcopy(model)
    assert twin._hidden_fn is None
    assert set(twin._kernel_handles.values()).isdisjoint(model._kernel_handles.values())
    assert set(twin.mlp_impl._handles.values()).isdisjoint(model.mlp_impl._handles.values())
    assert twin.mlp_impl._handles.keys() == model.mlp_impl._handles.keys()


def test_compiled_core_network_equals_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = GPT(ModelConfig(vocab_size=257, num_layers=2, model_dim=32, num_heads=2, qk_head_dim=16, v_head_dim=16))
    compiled = copy.deepcopy(eager)
    compiled.compile_body(backend="aot_eager", dynamic=False)
    batch = _batch(64)
    le, lc = eager.loss(batch, ARGS), compiled.loss(batch, ARGS)
    le.backward()
    lc.backward()
    assert torch.allclose(le, lc, atol=1e-6)
    for (n, a), b in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6), n


def test_opaque_kernel_saved_state_and_errors():
    """Backwards pop the newest saved forward; a forward whose loss is dropped leaves state that
    clear_pending() removes; a backward with nothing saved, or an output off its promised shape,
    is refused with the kernel's name."""
    h = opaque.register(opaque.OpaqueKernel(
        name="scale[test]", forward=lambda ctx, ts: (setattr(ctx, "k", ts[1].item()) or [ts[0] * ts[1]]),
        backward=lambda ctx, gs: [gs[0] * ctx.k], out_specs=lambda ts: [(tuple(ts[0].shape), ts[0].dtype)],
        diff=(True, False)))
    x = torch.randn(4, requires_grad=True)
    opaque.call(h, [x, torch.tensor(5.0)])  # dropped without a backward
    y2 = opaque.call(h, [x, torch.tensor(2.0)])[0]
    y3 = opaque.call(h, [x, torch.tensor(3.0)])[0]
    y3.sum().backward()
    y2.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 5.0))  # 3 then 2: each backward found its own forward
    assert len(opaque._PENDING[h]) == 1
    opaque.clear_pending()
    with torch.no_grad():  # keeps nothing
        opaque.call(h, [x, torch.tensor(1.0)])
    assert not opaque._PENDING.get(h)
    y = opaque.call(h, [x.detach(), torch.tensor(1.0)])[0]  # nothing needs a gradient: nothing kept
    assert not opaque._PENDING.get(h) and not y.requires_grad
    bad = opaque.register(opaque.OpaqueKernel(
        name="short[test]", forward=lambda ctx, ts: [ts[0][:2]], backward=lambda ctx, gs: gs,
        out_specs=lambda ts: [(tuple(ts[0].shape), ts[0].dtype)], diff=(True,)))
    with pytest.raises(RuntimeError, match=r"short\[test\]: output 0 has shape"):
        opaque.call(bad, [x])
    lost = opaque.call(h, [x, torch.tensor(1.0)])[0]
    opaque.clear_pending()
    with pytest.raises(RuntimeError, match=r"scale\[test\]: backward without a saved forward"):
        lost.sum().backward()


def test_compile_model_compiles_what_training_calls(monkeypatch):
    """train()'s compile step compiles the network the loss methods call (torch.compile(model)
    would compile only forward(), which training never calls)."""
    from speedrun.config import preset
    from speedrun.train.loop import compile_model

    cfg = preset("tiny-record")
    cfg.train.compile = True
    model = RecordGPT(ModelConfig(vocab_size=257, num_layers=6, model_dim=32, num_heads=2, qk_head_dim=16,
                                  v_head_dim=16, architecture="record"))
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.setdefault("fn", fn) and fn)
    # (not monkeypatch.setattr: pytest restores a module attribute it finds no __dict__ entry for
    # by deleting it, and deleting a torch config entry hides it for the rest of the session)
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    saved = getattr(config, limit)
    setattr(config, limit, 8)
    try:
        assert compile_model(model, cfg) is model
        assert seen["fn"] == model.hidden and model._hidden_fn is not None
        # one graph per schedule variant (stage shapes x train/validation): Dynamo's default of 8
        # is too few for a staged schedule (a fullgraph compile fails past it); never lowered
        assert getattr(config, limit) == 64
        from speedrun.compiling import allow_schedule_variants

        allow_schedule_variants(16)
        assert getattr(config, limit) == 64
    finally:
        setattr(config, limit, saved)


def test_compile_cpp_wrapper_option_reaches_torch_compile(monkeypatch):
    from speedrun.config import preset
    from speedrun.errors import ConfigError
    from speedrun.train.loop import compile_model

    cfg = preset("tiny-record")
    cfg.train.compile, cfg.train.compile_cpp_wrapper = True, True
    model = RecordGPT(ModelConfig(vocab_size=257, num_layers=6, model_dim=32, num_heads=2, qk_head_dim=16,
                                  v_head_dim=16, architecture="record"))
    seen = {}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.update(kw) or fn)
    compile_model(model, cfg)
    assert seen["options"] == {"cpp_wrapper": True} and seen["fullgraph"] is True
    cfg.train.compile = False
    with pytest.raises(ConfigError, match="compile_cpp_wrapper needs train.compile"):
        compile_model(model, cfg)
    # torch's varlen attention (the CUDA default) cannot be called from the C++ wrapper
    cfg.train.compile = True
    monkeypatch.setattr("speedrun.attention.resolve_backend", lambda name, device: "varlen")
    seen.clear()
    with pytest.raises(ConfigError, match="varlen attention backend"):
        compile_model(model, cfg)
    assert not seen


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_opaque_ops_run_under_inductors_cpp_wrapper():
    """Inductor's C++ wrapper calls our opaque ops (one real output each way, the case that
    crashed it before the trailing empty output; pytorch/pytorch#190551) with eager's results."""
    h = opaque.register(opaque.OpaqueKernel(
        name="scale2", forward=lambda ctx, ins: [ins[0] * 2], backward=lambda ctx, gs: [gs[0] * 2],
        out_specs=lambda ins: [(tuple(ins[0].shape), ins[0].dtype)], diff=(True,)))

    def f(x):
        return opaque.call(h, [torch.sin(x) + 1])[0].cos().sum()

    compiled = torch.compile(f, fullgraph=True, options={"cpp_wrapper": True})
    x = torch.randn(16, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = compiled(x), f(x2)
    y.backward()
    y2.backward()
    torch.testing.assert_close(y, y2)
    torch.testing.assert_close(x.grad, x2.grad)


def test_bank_gradients_are_stacked_not_summed_selects():
    """The banks' per-layer weights are taken by split/unbind once per forward, so each bank's
    gradient is one cat/stack in the backward graph.  Indexing them per layer (bank[i, 0],
    bank[j*H:(j+1)*H]) made it a sum of zero-padded select/slice_backwards, which Inductor
    compiled to kernels loading every layer's gradient for every element (many times the bank's
    bytes).  The value embeddings and the q/k/v split of
    the projection output are checked the same way."""
    from types import SimpleNamespace

    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch.manual_seed(0)
    model = RecordGPT(ModelConfig(vocab_size=257, num_layers=6, model_dim=64, num_heads=2, qk_head_dim=32,
                                  v_head_dim=32, architecture="record"))
    graphs = {}

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm.forward)
        return compiler

    hidden = torch.compile(model.hidden, backend=aot_autograd(fw_compiler=keep("fw"), bw_compiler=keep("bw")),
                           fullgraph=True)
    T = 128
    batch = SimpleNamespace(inputs=torch.randint(0, 257, (T,)), cu_seqlens=torch.tensor([0, 60, T], dtype=torch.int32),
                            max_seqlen=68)
    hidden(batch).float().square().sum().backward()
    summed = ("aten.select_backward.default", "aten.slice_backward.default")
    for name in ("qk_bank", "vo_bank", "mlp_bank"):
        shape = tuple(getattr(model, name).shape)
        producers = [str(n.target) for n in graphs["bw"].graph.nodes
                     if n.op == "call_function" and isinstance(n.meta.get("val"), torch.Tensor)
                     and tuple(n.meta["val"].shape) == shape]
        assert producers and not any(p in summed for p in producers), (name, producers)
    # the value embeddings' (n_ve, T, D) gradient: a stack, not summed select_backwards
    ve_shape = (model.num_ve, T, 64)
    assert not any(str(n.target) in summed and tuple(n.meta["val"].shape) == ve_shape
                   for n in graphs["bw"].graph.nodes if n.op == "call_function" and "val" in n.meta)
    # the (T, 3 H D) gradient of the QKV projection output: a cat, not summed slice_backwards
    width = 3 * 2 * 32
    assert not any(str(n.target) == "aten.slice_backward.default" and tuple(n.meta["val"].shape) == (T, width)
                   for n in graphs["bw"].graph.nodes if n.op == "call_function" and "val" in n.meta)
