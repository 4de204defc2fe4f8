"""The fa4 attention backend on CPU: selection, errors, the custom ops' shape functions and the
autograd / torch.compile plumbing, with FA4's two entry points stood in by the reference backend
(the real kernels need a GPU; their numerics are compared with the reference in
``tests/gpu/test_attention_fused_gpu.py``).  Also the self-check every fused backend passes."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import speedrun.attention as attn
from speedrun.attention import fa4
from speedrun.attention.reference import reference_attention
from speedrun.attention.selfcheck import check_against_reference
from speedrun.errors import ConfigError


class FakeFA4:
    """FA4's ``_flash_attn_fwd`` / ``_flash_attn_bwd`` computed by the reference backend, recording
    the keyword arguments each call got."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    @staticmethod
    def _reference(q, k, v, kw):
        cu, window = kw["cu_seqlens_q"], kw["window_size_left"]
        return reference_attention(q, k, v, cu, kw["max_seqlen_q"], window=window, scale=kw["softmax_scale"])

    def fwd(self, q, k, v, **kw):
        self.calls.append(("fwd", dict(kw, widths=(q.shape[-1], v.shape[-1]))))
        out = self._reference(q.float(), k.float(), v.float(), kw).to(q.dtype)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        return out, lse, None, None, None

    def bwd(self, q, k, v, out, dout, lse, **kw):
        self.calls.append(("bwd", kw))
        xs = [t.detach().float().requires_grad_() for t in (q, k, v)]
        with torch.enable_grad():  # called from inside a backward, where grad mode is off
            self._reference(*xs, kw).backward(dout.float())
        return tuple(x.grad.to(q.dtype) for x in xs)


@pytest.fixture
def fake(monkeypatch):
    f = FakeFA4()
    monkeypatch.setattr(fa4, "_kernels", lambda: (f.fwd, f.bwd))
    monkeypatch.setattr(fa4, "_check_device", lambda q: None)  # the stand-in runs on the CPU
    fa4._SEEN_CONFIGS.clear()
    return f


def _inputs(T=40, H=2, dqk=96, dv=128, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(T, H, dqk, generator=g).to(dtype) for _ in range(2))
    return q, k, torch.randn(T, H, dv, generator=g).to(dtype)


CU = torch.tensor([0, 13, 30, 40, 40], dtype=torch.int32)


@pytest.mark.parametrize("window", [None, 0, 7])
def test_autograd_routes_through_both_kernels_with_the_contract_s_mask(fake, window):
    """Causal with FA's window (W, 0) keeps i - W <= j <= i: the contract's mask; the loss and all
    three gradients equal the reference's; each kernel got the packed batch's arguments."""
    q, k, v = _inputs()
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    y = fa4.fa4_varlen_attention(*xs, CU, 30, window=window)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
    y.backward(dy)
    rs = [t.float().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*rs, CU, 30, window=window, scale=96**-0.5)
    ref.backward(dy.float())
    assert y.dtype == torch.bfloat16 and y.shape == (40, 2, 128)
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)
    for x, r in zip(xs, rs):
        torch.testing.assert_close(x.grad.float(), r.grad, atol=3e-2, rtol=3e-2)
    (_, fwd_kw), (_, bwd_kw) = fake.calls
    for kw in (fwd_kw, bwd_kw):
        assert kw["causal"] is True and kw["window_size_left"] == window and kw["window_size_right"] is None
        assert kw["cu_seqlens_q"] is kw["cu_seqlens_k"] and kw["cu_seqlens_q"].dtype == torch.int32
        assert kw["max_seqlen_q"] == kw["max_seqlen_k"] == 30 and kw["softmax_scale"] == pytest.approx(96**-0.5)
    assert fwd_kw["return_lse"] is True  # the backward needs it, and inside the op nothing requires grad


def test_fp32_inputs_are_cast_and_returned_in_fp32(fake):
    q, k, v = _inputs(dtype=torch.float32)
    y = fa4.fa4_varlen_attention(q, k, v, CU, 30, window=5, scale=0.2)
    assert y.dtype == torch.float32
    ref = reference_attention(q, k, v, CU, 30, window=5, scale=0.2)
    torch.testing.assert_close(y, ref, atol=3e-2, rtol=3e-2)


def test_compiles_without_graph_breaks(fake):
    q, k, v = (t.requires_grad_() for t in _inputs())

    def f(q, k, v):
        return (fa4.fa4_varlen_attention(q * 2, k, v, CU, 30, window=9, scale=0.1).float() ** 2).mean()

    torch._dynamo.reset()
    loss = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()
    assert [c for c, _ in fake.calls] == ["fwd", "bwd"]


def test_op_shape_functions():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(50, 3, 96, dtype=torch.bfloat16), torch.empty(50, 3, 96, dtype=torch.bfloat16)
        v = torch.empty(50, 3, 128, dtype=torch.bfloat16)
        cu = torch.empty(9, dtype=torch.int32)
        o, lse = torch.ops.speedrun.fa4_fwd(q, k, v, cu, 64, 640, 0.1)
        assert o.shape == (50, 3, 128) and o.dtype == torch.bfloat16
        assert lse.shape == (3, 50) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.speedrun.fa4_bwd(o, q, k, v, o, lse, cu, 64, 640, 0.1)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_a_new_kernel_configuration_inside_a_capture_is_refused(fake, monkeypatch):
    """FA4 compiles a configuration the first time it meets it, which a CUDA-graph capture cannot
    hold: a call inside a capture runs only configurations an eager call met before."""
    q, k, v = _inputs()
    fa4.fa4_varlen_attention(q, k, v, CU, 30, window=7)  # windowed forward, D_qk 96: met eagerly
    monkeypatch.setattr(fa4, "_capturing", lambda t: True)
    fa4.fa4_varlen_attention(q, k, v, CU, 30, window=640)  # the same configuration: another window only
    with pytest.raises(RuntimeError, match=r"forward with D_qk=96, D_v=128.*causal.*inside CUDA-graph capture"):
        fa4.fa4_varlen_attention(q, k, v, CU, 30, window=None)
    with pytest.raises(RuntimeError, match=r"D_qk=128.*eager forward and backward"):
        fa4.fa4_varlen_attention(*_inputs(dqk=128), CU, 30, window=7)


def test_a_configuration_whose_compile_failed_is_not_counted_as_compiled(fake, monkeypatch):
    """A call that raised (FA4's compile failing) leaves its configuration unmet: a later call
    inside a capture is refused instead of trusting a kernel that was never built."""
    q, k, v = _inputs()
    real_fwd = fake.fwd

    def failing_fwd(*args, **kw):
        raise RuntimeError("CuTe DSL: compile failed")

    monkeypatch.setattr(fa4, "_kernels", lambda: (failing_fwd, fake.bwd))
    with pytest.raises(RuntimeError, match="compile failed"):
        fa4.fa4_varlen_attention(q, k, v, CU, 30, window=7)
    monkeypatch.setattr(fa4, "_capturing", lambda t: True)
    monkeypatch.setattr(fa4, "_kernels", lambda: (real_fwd, fake.bwd))
    with pytest.raises(RuntimeError, match="first time inside CUDA-graph capture"):
        fa4.fa4_varlen_attention(q, k, v, CU, 30, window=7)
    monkeypatch.setattr(fa4, "_capturing", lambda t: False)
    fa4.fa4_varlen_attention(q, k, v, CU, 30, window=7)  # compiles (eagerly) this time
    monkeypatch.setattr(fa4, "_capturing", lambda t: True)
    fa4.fa4_varlen_attention(q, k, v, CU, 30, window=7)  # and is then allowed in a capture


# ---------------------------------------------------------------- selection and errors


def test_explicit_fa4_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(fa4, "_find_fa4", lambda: False)
    problem = attn.backend_problem("fa4", "cuda")
    assert "flash-attn-4 package is not installed" in problem and 'pip install -e ".[fa4]"' in problem
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[fa4\]"'):
        attn.resolve_backend("fa4", "cpu")


def test_explicit_fa4_on_cpu_is_refused(monkeypatch):
    monkeypatch.setattr(fa4, "_find_fa4", lambda: True)
    with pytest.raises(ConfigError, match="fa4.*CUDA only"):
        attn.resolve_backend("fa4", "cpu")
    with pytest.raises(ConfigError, match="CUDA only"):
        fa4.fa4_varlen_attention(*_inputs(), CU, 30)


def test_bad_inputs_give_clear_errors(fake):
    q, k, v = _inputs()
    cu = CU
    with pytest.raises(ConfigError, match="same shape"):
        fa4.fa4_varlen_attention(q, k[:, :, :8], v, cu, 30)
    with pytest.raises(ConfigError, match="window must be >= 0"):
        fa4.fa4_varlen_attention(q, k, v, cu, 30, window=-3)
    with pytest.raises(ConfigError, match=r"Q/K width 100 is not a multiple of 8"):
        fa4.fa4_varlen_attention(torch.zeros(40, 2, 100), torch.zeros(40, 2, 100), v, cu, 30)
    with pytest.raises(ConfigError, match=r"V width 264 is not a multiple of 8 in \[8, 256\]"):
        fa4.fa4_varlen_attention(q, k, torch.zeros(40, 2, 264), cu, 30)
    assert fake.calls == []


def test_auto_prefers_fa4_then_cudnn(monkeypatch):
    """fa4 first (the fastest measured), cudnn when fa4 cannot run; what was passed over and what
    was taken said in one warning, once."""
    problems = {"cudnn": None, "fa4": None, "fa3": None, "varlen": None}
    monkeypatch.setattr(attn, "backend_problem", lambda name, device: problems.get(name))
    attn._warn_skipped.cache_clear()
    assert attn.resolve_backend("auto", "cuda") == "fa4"
    problems["fa4"] = "self-check failed: dq at D_qk=96 differs"
    with pytest.warns(UserWarning, match="skipping fa4: self-check failed: dq at D_qk=96 differs; using cudnn$"):
        assert attn.resolve_backend("auto", "cuda") == "cudnn"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: the same again stays quiet
        assert attn.resolve_backend("auto", "cuda") == "cudnn"
    problems["cudnn"] = "not installed"
    with pytest.warns(UserWarning, match="skipping fa4: self-check.*; skipping cudnn: not installed; using fa3$") as said:
        assert attn.resolve_backend("auto", "cuda") == "fa3"
    assert len(said) == 1 and said[0].category is attn.AttentionFallbackWarning


def test_the_fallback_warning_can_be_silenced(tmp_path):
    """A user who chose not to install the faster backends silences ``auto``'s warning with
    ``PYTHONWARNINGS="ignore:attention backend auto"`` (any command, ``speedrun train`` too), or
    in code by its class, :class:`speedrun.attention.AttentionFallbackWarning`."""
    script = tmp_path / "auto.py"
    script.write_text(
        "import sys, warnings\n"
        "import speedrun.attention as attn\n"
        "if sys.argv[1:] == ['by-class']:\n"
        "    warnings.filterwarnings('ignore', category=attn.AttentionFallbackWarning)\n"
        "attn.backend_problem = lambda name, device: 'not installed' if name in ('fa4', 'cudnn') else None\n"
        "print(attn.resolve_backend('auto', 'cuda'))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}

    def run(*args, **extra):
        return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=120,
                              env={**env, **extra})

    loud = run()
    assert loud.stdout.strip() == "fa3" and "AttentionFallbackWarning: attention backend auto: skipping fa4" in loud.stderr
    for quiet in (run(PYTHONWARNINGS="ignore:attention backend auto"), run("by-class")):
        assert quiet.stdout.strip() == "fa3" and quiet.stderr == "", quiet.stderr


def test_available_backends_lists_fa4():
    report = attn.available_backends("cpu")
    assert report["fa4"][0] is False and ("CUDA" in report["fa4"][1] or "not installed" in report["fa4"][1])
    assert fa4.fa4_varlen_attention.pads_qk_to_v is False and attn._load("fa4") is fa4.fa4_varlen_attention


def test_importing_the_backend_does_not_import_fa4():
    """No import-time side effects: FA4 (and the CuTe DSL behind it) load on first use."""
    import subprocess
    import sys

    code = "import sys, speedrun.attention.fa4; print(any(m.startswith('flash_attn') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- the self-check of fused backends


def test_self_check_passes_a_correct_backend_and_names_what_a_wrong_one_gets_wrong():
    cpu = torch.device("cpu")
    assert check_against_reference(reference_attention, cpu) is None

    def no_window(q, k, v, cu, max_seqlen, *, window=None, scale=None):
        return reference_attention(q, k, v, cu, max_seqlen, window=None, scale=scale)

    assert check_against_reference(no_window, cpu).startswith("self-check failed: out at D_qk=96")

    def broken(*args, **kw):
        raise RuntimeError("kernel exploded")

    assert check_against_reference(broken, cpu) == "self-check failed: RuntimeError: kernel exploded"


@pytest.mark.parametrize("qk", [16, 32])
def test_record_network_on_fa4_trains_as_on_the_reference(fake, monkeypatch, qk):
    """The record network (paired-head layers, short and long windows, Q/K narrower than V or
    equal) choosing ``fa4``: the backend gets unpadded Q/K and the network's windows, and the loss
    and every parameter gradient equal the reference backend's (FA4 stood in by the reference, so
    the match checks the wiring: what the network hands the backend and what comes back)."""
    from types import SimpleNamespace

    from speedrun.config import ModelConfig
    from speedrun.model.interface import ForwardArgs
    from speedrun.model.record import RecordGPT

    monkeypatch.setattr(fa4, "fa4_problem", lambda device: None)  # the stand-in runs on the CPU
    base = dict(vocab_size=257, num_layers=6, model_dim=64, num_heads=2, qk_head_dim=qk, v_head_dim=32,
                architecture="record")
    args = ForwardArgs(window_short=32, window_long=96, mtp_weights=(1.0, 0.5), prefix_weight=0.0)
    g = torch.Generator().manual_seed(3)
    T = 256
    batch = SimpleNamespace(inputs=torch.randint(0, 257, (T,), generator=g, dtype=torch.int32),
                            targets=torch.randint(0, 257, (T,), generator=g),
                            cu_seqlens=torch.tensor([0, 70, 71, 200, T, T], dtype=torch.int32), max_seqlen=129,
                            bigram=None)
    out = {}
    for name in ("reference", "fa4"):
        torch.manual_seed(0)
        m = RecordGPT(ModelConfig(**base, attention_backend=name))
        loss = m.loss(batch, args)
        loss.backward()
        out[name] = (loss.item(), torch.cat([p.grad.flatten() for p in m.parameters() if p.grad is not None]))
    (l_ref, g_ref), (l_fa4, g_fa4) = out["reference"], out["fa4"]
    fwd = [kw for c, kw in fake.calls if c == "fwd"]
    assert {kw["window_size_left"] for kw in fwd} == {32, 96}  # the network's short and long windows
    assert {kw["widths"] for kw in fwd} == {(qk, 32)}  # Q/K unpadded, whatever their width
    assert fake.calls and all(kw["cu_seqlens_q"].dtype == torch.int32 for _, kw in fake.calls)
    assert abs(l_fa4 - l_ref) <= 1e-2 * abs(l_ref), (l_fa4, l_ref)
    assert ((g_fa4 - g_ref).norm() / g_ref.norm()).item() < 3e-2


def test_only_fa4_s_compile_note_is_silenced_and_only_while_compiling(fake, monkeypatch):
    """The CuTe DSL's note about FA4's ``aux_data`` argument, emitted as a kernel compiles, is
    silenced in the call that compiles it; any other warning there, and the same note from a call
    that does not compile, still reaches the caller."""
    import warnings

    note = ("Argument aux_data (position 17) cannot be converted to a JitArgument for function "
            "'cutlass___call___flash_attncuteflash_fwd_sm90'. Its type is not supported.")
    real_fwd = fake.fwd

    def noisy_fwd(q, k, v, **kw):
        warnings.warn(note, UserWarning)
        warnings.warn("something else FA4 says", UserWarning)
        return real_fwd(q, k, v, **kw)

    monkeypatch.setattr(fa4, "_kernels", lambda: (noisy_fwd, fake.bwd))
    q, k, v = _inputs()
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        fa4.fa4_varlen_attention(q, k, v, CU, 30, window=7)
    assert [str(w.message) for w in first] == ["something else FA4 says"]
    with warnings.catch_warnings(record=True) as again:  # same configuration: nothing compiles
        warnings.simplefilter("always")
        fa4.fa4_varlen_attention(q, k, v, CU, 30, window=3)
    assert [str(w.message) for w in again] == [note, "something else FA4 says"]
