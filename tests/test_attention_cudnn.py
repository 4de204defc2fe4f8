"""The cudnn attention backend on CPU: selection, errors, the ragged offsets built from
cu_seqlens, the shape-key graph cache and the autograd / torch.compile plumbing, with a fake
cuDNN frontend module standing in for ``import cudnn`` (the real one needs a GPU; its numerics
are compared with the reference in ``tests/gpu/test_attention_fused_gpu.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import speedrun.attention as attn
from speedrun.attention import cudnn as cb
from speedrun.errors import ConfigError


# ---------------------------------------------------------------- a fake cuDNN frontend module


class FakeTensor:
    """A graph tensor: records what the graph builder declared."""

    def __init__(self, name="", dim=None, stride=None, data_type=None, uid=None):
        self.name, self.dim, self.stride, self.data_type, self.uid = name, dim, stride, data_type, uid
        self.ragged = None
        self.output = False

    def set_ragged_offset(self, t):
        self.ragged = t
        return self

    def set_output(self, flag):
        self.output = flag
        return self

    def set_dim(self, dim):
        self.dim = dim
        return self

    def set_stride(self, stride):
        self.stride = stride
        return self

    def set_data_type(self, dt):
        self.data_type = dt
        return self

    def set_uid(self, uid):
        self.uid = uid
        return self


class FakeGraph:
    def __init__(self, module, **kwargs):
        self.module, self.kwargs = module, kwargs
        self.tensors: list[FakeTensor] = []
        self.op = None
        self.built = False
        module.graphs.append(self)

    def tensor(self, name="", dim=None, stride=None, data_type=None, uid=None):
        t = FakeTensor(name, dim, stride, data_type, uid)
        self.tensors.append(t)
        return t

    def sdpa(self, name, q, k, v, **kw):
        self.op = ("sdpa", kw)
        outs = (FakeTensor("o"), FakeTensor("stats"))
        self.tensors += outs
        return outs

    def sdpa_backward(self, name, **kw):
        self.op = ("sdpa_backward", kw)
        outs = (FakeTensor("dq"), FakeTensor("dk"), FakeTensor("dv"))
        self.tensors += outs
        return outs

    def build(self, modes):
        self.built = True

    def get_workspace_size(self):
        return 96

    def execute(self, pack, workspace, handle=None):
        """Fills each output with its uid (so tests can see which buffer became which result)."""
        assert self.built and handle == self.module.HANDLE
        self.module.executions.append((self, dict(pack), workspace))
        for t in self.tensors:
            if t.output:
                pack[t.uid].fill_(float(t.uid))


def fake_module():
    m = SimpleNamespace(graphs=[], executions=[], HANDLE=1234)
    m.data_type = SimpleNamespace(BFLOAT16="bf16", HALF="fp16", FLOAT="fp32", INT32="i32", INT64="i64")
    m.diagonal_alignment = SimpleNamespace(TOP_LEFT="top_left")
    m.heur_mode = SimpleNamespace(A="A", FALLBACK="FALLBACK")
    m.pygraph = lambda **kw: FakeGraph(m, **kw)
    m.create_handle = lambda: m.HANDLE
    m.set_stream = lambda handle, stream: None
    return m


@pytest.fixture
def fake():
    """A fake frontend behind the process runner (restored afterwards)."""
    m = fake_module()
    old = cb._Runner.sdpa
    cb._Runner.sdpa = cb.CudnnSDPA(module=m)
    yield m
    cb._Runner.sdpa = old


def _inputs(T=40, H=2, dqk=12, dv=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, dqk, generator=g).to(dtype)
    k = torch.randn(T, H, dqk, generator=g).to(dtype)
    v = torch.randn(T, H, dv, generator=g).to(dtype)
    return q, k, v


# ---------------------------------------------------------------- ragged offsets and shape keys


def test_ragged_offsets_match_a_plain_computation():
    g = torch.Generator().manual_seed(3)
    for trial in range(5):
        T = int(torch.randint(1, 300, (1,), generator=g))
        cuts = sorted(set(torch.randint(1, T, (6,), generator=g).tolist())) if T > 1 else []
        starts = [0, *cuts, T] + [T] * trial  # trailing repeats: empty padding slots
        cu = torch.tensor(starts, dtype=torch.int32)
        H, dqk, dv = 3, 96, 128
        mult = cb.offset_multipliers(H, dqk, dv, torch.device("cpu"))
        lengths, offsets = cb.ragged_offsets(cu, mult)
        off_qk, off_v, off_st = cb._offset_views(offsets)
        assert lengths.dtype == torch.int32 and offsets.dtype == torch.int64 and offsets.shape == (3, len(starts))
        assert lengths.shape == (len(starts) - 1, 1, 1, 1) and off_qk.shape == (len(starts), 1, 1, 1)
        assert lengths.flatten().tolist() == [b - a for a, b in zip(starts, starts[1:])]
        assert off_qk.flatten().tolist() == [s * H * dqk for s in starts]
        assert off_v.flatten().tolist() == [s * H * dv for s in starts]
        assert off_st.flatten().tolist() == [s * H for s in starts]
        # element offsets address a packed (T, H, D) tensor: document i starts at row starts[i]
        x = torch.arange(T * H * dv).view(T, H, dv)
        for i, s in enumerate(starts[:-1]):
            if s < T:
                assert x.flatten()[int(off_v.flatten()[i])] == x[s, 0, 0]


def test_shape_key_fields_and_cap():
    q, k, v = _inputs(T=40, dqk=12, dv=16)
    cu = torch.tensor([0, 10, 40, 40], dtype=torch.int32)
    key = cb.shape_key(q, v, cu.numel(), 2048, 8, 0.5)
    assert (key.tokens, key.heads, key.d_qk, key.d_v, key.slots, key.docs) == (40, 2, 12, 16, 4, 3)
    assert key.max_seqlen == 40  # capped at T: rows past T can never exist
    assert (key.window, key.scale, key.dtype, key.device) == (8, 0.5, torch.bfloat16, -1)
    assert cb.shape_key(q, v, 4, 30, None, 0.5).max_seqlen == 30
    assert cb.shape_key(q, v, 4, 30, None, 0.5) != cb.shape_key(q, v, 4, 30, 8, 0.5)


# ---------------------------------------------------------------- graphs: declared once per key


def test_forward_graph_declares_the_packed_layout_and_mask():
    m = fake_module()
    key = cb.ShapeKey(tokens=100, heads=3, d_qk=96, d_v=128, slots=9, window=640, max_seqlen=64, scale=0.12,
                      dtype=torch.bfloat16, device=-1)
    graph, ws = cb.build_forward_graph(m, m.HANDLE, key)
    assert ws == 96 and graph.built and graph.kwargs["io_data_type"] == "bf16"
    by_uid = {t.uid: t for t in graph.tensors}
    q, v, o, stats = by_uid[cb.Uid.Q], by_uid[cb.Uid.V], by_uid[cb.Uid.O], by_uid[cb.Uid.STATS]
    assert q.dim == [8, 3, 64, 96] and q.stride == [64 * 3 * 96, 96, 3 * 96, 1]
    assert v.dim == [8, 3, 64, 128] and v.stride == [64 * 3 * 128, 128, 3 * 128, 1]
    assert o.output and o.dim == [8, 3, 64, 128] and o.stride == v.stride
    assert stats.output and stats.data_type == "fp32" and stats.dim == [8, 3, 64, 1] and stats.stride == [64 * 3, 1, 3, 1]
    assert q.ragged.uid == cb.Uid.OFF_Q and v.ragged.uid == cb.Uid.OFF_V and o.ragged.uid == cb.Uid.OFF_O
    assert stats.ragged.uid == cb.Uid.OFF_STATS and by_uid[cb.Uid.OFF_Q].dim == [9, 1, 1, 1]
    op, kw = graph.op
    assert op == "sdpa" and kw["generate_stats"] and kw["use_padding_mask"] and kw["attn_scale"] == 0.12
    # contract: key j >= i - 640 kept; cuDNN keeps j > i - left_bound
    assert kw["diagonal_band_left_bound"] == 641 and kw["diagonal_band_right_bound"] == 0
    assert kw["seq_len_q"].uid == cb.Uid.SEQ_Q and kw["seq_len_kv"].uid == cb.Uid.SEQ_KV


def test_backward_graph_and_full_causal_mask():
    m = fake_module()
    key = cb.ShapeKey(tokens=100, heads=3, d_qk=96, d_v=128, slots=9, window=None, max_seqlen=64, scale=0.12,
                      dtype=torch.float16, device=-1)
    graph, _ = cb.build_backward_graph(m, m.HANDLE, key)
    op, kw = graph.op
    assert op == "sdpa_backward" and "diagonal_band_left_bound" not in kw
    assert kw["diagonal_band_right_bound"] == 0 and kw["max_total_seq_len_q"] == 128  # T rounded up to 64
    by_uid = {t.uid: t for t in graph.tensors}
    for uid, width, off in ((cb.Uid.DQ, 96, cb.Uid.OFF_Q), (cb.Uid.DK, 96, cb.Uid.OFF_K), (cb.Uid.DV, 128, cb.Uid.OFF_V)):
        assert by_uid[uid].output and by_uid[uid].dim == [8, 3, 64, width] and by_uid[uid].ragged.uid == off
    assert by_uid[cb.Uid.DO].ragged.uid == cb.Uid.OFF_O and graph.kwargs["io_data_type"] == "fp16"


def test_graphs_are_built_once_per_shape_key(fake):
    q, k, v = _inputs()
    cu = torch.tensor([0, 7, 30, 40, 40], dtype=torch.int32)
    sdpa = cb.default_runner()
    o1, stats, lengths, offsets = sdpa.forward(q, k, v, cu, 32, 8, 0.3)
    assert sdpa.builds == 1 and o1.shape == (40, 2, 16) and stats.shape == (40, 2, 1) and stats.dtype == torch.float32
    assert lengths.flatten().tolist() == [7, 23, 10, 0] and offsets[1].tolist() == [0, 7 * 32, 30 * 32, 40 * 32, 40 * 32]
    cu2 = torch.tensor([0, 20, 21, 40, 40], dtype=torch.int32)  # other documents, same slot count
    sdpa.forward(q, k, v, cu2, 32, 8, 0.3)
    assert sdpa.builds == 1 and len(fake.graphs) == 1  # executed again, not rebuilt
    sdpa.forward(q, k, v, cu2, 32, 16, 0.3)  # another window
    sdpa.forward(q, k, v, cu2, 32, 8, 0.25)  # another scale
    sdpa.forward(q, k, v, torch.tensor([0, 40], dtype=torch.int32), 32, 8, 0.3)  # another slot count
    assert sdpa.builds == 4
    sdpa.backward(o1, q, k, v, o1, stats, lengths, offsets, 32, 8, 0.3)
    sdpa.backward(o1, q, k, v, o1, stats, lengths, offsets, 32, 8, 0.3)
    assert sdpa.builds == 5
    _, pack, _ = fake.executions[-1]  # the backward reads the forward's lengths and offsets
    assert pack[cb.Uid.SEQ_Q] is lengths and pack[cb.Uid.OFF_V].data_ptr() == offsets[1].data_ptr()
    # the variant pack: q and k share the width-D_qk offsets, v/o the width-D_v ones, lengths from cu
    _, pack, workspace = fake.executions[1]
    assert pack[cb.Uid.OFF_Q] is pack[cb.Uid.OFF_K] and pack[cb.Uid.OFF_V] is pack[cb.Uid.OFF_O]
    assert pack[cb.Uid.SEQ_Q].flatten().tolist() == [20, 1, 19, 0]
    assert pack[cb.Uid.OFF_V].flatten().tolist() == [0, 20 * 32, 21 * 32, 40 * 32, 40 * 32]
    assert workspace.numel() == 96 and workspace.dtype == torch.uint8


def test_autograd_routes_through_both_graphs(fake):
    q, k, v = (t.requires_grad_() for t in _inputs())
    cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)
    y = cb._CudnnAttention.apply(q, k, v, cu, 40, -1, 0.3)
    assert y.shape == (40, 2, 16) and bool((y == float(cb.Uid.O)).all())
    y.sum().backward()
    assert bool((q.grad == float(cb.Uid.DQ)).all()) and bool((k.grad == float(cb.Uid.DK)).all())
    assert bool((v.grad == float(cb.Uid.DV)).all())
    fwd, bwd = fake.graphs
    assert fwd.op[0] == "sdpa" and bwd.op[0] == "sdpa_backward"
    assert "diagonal_band_left_bound" not in fwd.op[1]  # window -1 means full causal


@pytest.mark.slow
def test_compiles_without_graph_breaks(fake):
    """Dynamo traces the autograd.Function; the cuDNN calls are opaque custom-op nodes."""
    q, k, v = (t.requires_grad_() for t in _inputs())
    cu = torch.tensor([0, 7, 30, 40], dtype=torch.int32)

    def f(q, k, v, cu):
        return (cb._CudnnAttention.apply(q * 2, k, v, cu, 40, 8, 0.3) * 3).sum()

    torch._dynamo.reset()
    loss = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, cu)
    loss.backward()
    assert loss.item() == 3 * float(cb.Uid.O) * 40 * 2 * 16
    assert bool((q.grad == 2 * float(cb.Uid.DQ)).all())


def test_op_shape_functions():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(50, 3, 96, dtype=torch.bfloat16), torch.empty(50, 3, 96, dtype=torch.bfloat16)
        v = torch.empty(50, 3, 128, dtype=torch.bfloat16)
        cu = torch.empty(9, dtype=torch.int32)
        o, stats, lengths, offsets = torch.ops.speedrun.cudnn_sdpa_fwd(q, k, v, cu, 64, 640, 0.1)
        assert o.shape == (50, 3, 128) and o.dtype == torch.bfloat16
        assert stats.shape == (50, 3, 1) and stats.dtype == torch.float32
        assert lengths.shape == (8, 1, 1, 1) and lengths.dtype == torch.int32
        assert offsets.shape == (3, 9) and offsets.dtype == torch.int64
        dq, dk, dv = torch.ops.speedrun.cudnn_sdpa_bwd(o, q, k, v, o, stats, lengths, offsets, 64, 640, 0.1)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ---------------------------------------------------------------- selection and errors


def test_explicit_cudnn_without_the_package_says_how_to_install(monkeypatch):
    def missing():
        raise ImportError("No module named 'cudnn'")

    monkeypatch.setattr(cb, "import_cudnn", missing)
    problem = attn.backend_problem("cudnn", "cuda")
    assert "not installed" in problem and 'pip install -e ".[cudnn]"' in problem
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[cudnn\]"'):
        attn.resolve_backend("cudnn", "cpu")


def test_explicit_cudnn_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="cudnn.*CUDA only"):
        attn.resolve_backend("cudnn", "cpu")
    q, k, v = _inputs()
    with pytest.raises(ConfigError, match="CUDA only"):
        cb.cudnn_varlen_attention(q, k, v, torch.tensor([0, 40], dtype=torch.int32), 40)


def test_bad_inputs_give_clear_errors():
    q, k, v = _inputs()
    cu = torch.tensor([0, 40], dtype=torch.int32)
    with pytest.raises(ConfigError, match="same shape"):
        cb.cudnn_varlen_attention(q, k[:, :, :4], v, cu, 40)
    with pytest.raises(ConfigError, match="bf16 or fp16"):
        cb._io_type(fake_module(), torch.float32)
    sdpa = cb.CudnnSDPA(module=fake_module())
    with pytest.raises(ConfigError, match="bf16 or fp16"):
        sdpa.forward(q.float(), k.float(), v.float(), cu, 40, None, 0.1)


def test_a_refused_build_names_the_shape():
    m = fake_module()

    def refuse(modes):
        raise RuntimeError("GRAPH_NOT_SUPPORTED: hidden_dim should be multiple of 8")

    m.pygraph = lambda **kw: _refusing(m, kw, refuse)
    sdpa = cb.CudnnSDPA(module=m)
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match=r"could not build the attention fwd graph for ShapeKey\(tokens=40.*multiple of 8"):
        sdpa.forward(q, k, v, torch.tensor([0, 40], dtype=torch.int32), 40, None, 0.1)


def _refusing(m, kw, refuse):
    g = FakeGraph(m, **kw)
    g.build = refuse
    return g


def test_auto_takes_cudnn_without_fa4_and_falls_back_with_a_message(monkeypatch):
    problems = {"cudnn": None, "fa4": "not installed", "fa3": "no kernels", "varlen": None, "flex": None}
    monkeypatch.setattr(attn, "backend_problem", lambda name, device: problems.get(name))
    attn._warn_skipped.cache_clear()
    with pytest.warns(UserWarning, match="auto: skipping fa4: not installed; using cudnn$"):
        assert attn.resolve_backend("auto", "cuda") == "cudnn"
    problems["cudnn"] = "self-check failed: out at D_qk=96 differs from the reference (rel err 1.0e+00)"
    with pytest.warns(UserWarning, match="skipping fa4: not installed; skipping cudnn: self-check failed.*; using varlen$"):
        assert attn.resolve_backend("auto", "cuda") == "varlen"
    assert attn.resolve_backend("auto", "cpu") == "reference"
    with pytest.raises(ConfigError, match="cudnn.*self-check failed"):
        attn.resolve_backend("cudnn", "cuda")


def test_available_backends_lists_cudnn():
    report = attn.available_backends("cpu")
    assert report["cudnn"][0] is False and "CUDA" in report["cudnn"][1]
    assert cb.cudnn_varlen_attention.pads_qk_to_v is False
    assert attn.get_backend("reference") is not None and attn._load("cudnn") is cb.cudnn_varlen_attention


def test_importing_the_backend_does_not_import_the_frontend():
    """No import-time side effects: ``import cudnn`` (which opens the cuDNN library) waits for the
    first use."""
    import subprocess
    import sys

    code = "import sys, speedrun.attention.cudnn; print('cudnn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_window_zero_is_the_diagonal_alone_and_matches_the_reference():
    """Window 0 never reaches cuDNN: the output is V and only dV is non-zero, as the reference's."""
    from speedrun.attention.reference import reference_attention

    g = torch.Generator().manual_seed(3)
    T, H = 40, 2
    cu = torch.tensor([0, 7, 8, 40], dtype=torch.int32)
    q, k, v = (torch.randn(T, H, d, generator=g) for d in (16, 16, 24))
    dy = torch.randn(T, H, 24, generator=g)
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    cb._DiagonalOnly.apply(*xs).backward(dy)
    rs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*rs, cu, 33, window=0, scale=0.3)
    ref.backward(dy)
    torch.testing.assert_close(cb._DiagonalOnly.apply(q, k, v), ref)
    for ours, theirs in zip(xs, rs):
        torch.testing.assert_close(ours.grad, theirs.grad)
