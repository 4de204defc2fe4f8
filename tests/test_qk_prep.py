"""Fused QK-prep (Triton, CPU interpreter) against its plain-PyTorch reference and record.py's ops.

Kernel tests need ``TRITON_INTERPRET=1`` (set by conftest without CUDA) or CUDA; without either the
module falls back to the reference and comparing it with itself proves nothing, so they skip.
Bounds: the bf16 forward reproduces the reference's two roundings (norm, rotation), so it matches
up to rare one-ulp flips from fp32 summation order (rel < 2e-3); bf16 backward is fp32 math rounded
once where autograd rounds at every op (rel < 1e-2); fp32 everywhere rel < 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels.fp8_cache import interpreting
from speedrun.kernels.qk_prep import DEFAULT_EPS, _check, _launch_bwd, _launch_fwd, qk_prep, qk_prep_reference
from speedrun.kernels.qkv_pack import packed_column_order
from speedrun.model.rotary import rope_frequencies, rope_tables
from speedrun.model.yarn import Yarn

needs_kernel = pytest.mark.skipif(
    not (interpreting() or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or CUDA to run the Triton kernel"
)
DEV = "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"

H, DQK, DV, NF = 4, 16, 32, 4  # 8 rotating dims, 8 stationary
FWD_BOUND = {torch.bfloat16: 2e-3, torch.float16: 1e-3, torch.float32: 1e-5}
BWD_BOUND = {torch.bfloat16: 1e-2, torch.float16: 5e-3, torch.float32: 1e-5}

# (paired, key_offset, pad_to, aux)
VARIANTS = {
    "plain": (False, False, None, False),
    "paired": (True, False, None, False),
    "paired_aux": (True, False, None, True),
    "key_offset": (False, True, None, False),
    "key_offset_aux_pad": (False, True, DV, True),
    "pad": (False, False, 24, False),
    "paired_aux_pad": (True, False, DV, True),  # the candidate's paired layers on varlen / FA3
}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def tables(T: int, nf: int = NF, seed: int = 0):
    """RoPE tables with a YaRN-like perturbation so every angle is irregular."""
    freqs = rope_frequencies(2 * nf, 1024.0) * (1 + 0.1 * torch.rand(nf, generator=torch.Generator().manual_seed(seed)))
    cos, sin = rope_tables(2 * T + 5, freqs)
    return cos.to(DEV), sin.to(DEV)


def inputs(T, dtype, aux, seed, h=H, dqk=DQK, dv=DV):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, h * (2 * dqk + dv), generator=g) * 3 + 0.5).to(dtype).to(DEV)
    a = (torch.randn(T, h * dv, generator=g)).to(dtype).to(DEV) if aux else None
    return qkv, a


def nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_and_backward_match_reference(variant, dtype):
    paired, key_offset, pad_to, aux = VARIANTS[variant]
    T = 37  # not a multiple of any block: tail rows are masked
    qkv, a = inputs(T, dtype, aux, seed=list(VARIANTS).index(variant))
    cos, sin = tables(T)
    kw = dict(num_heads=H, qk_dim=DQK, v_dim=DV, paired=paired, key_offset=key_offset, pad_to=pad_to, aux_v=a)
    T_, H_, dqk, dv, n, dout = _check(qkv, cos, sin, H, DQK, DV, paired, key_offset, pad_to, a, None, "t")

    # Forward through the launcher into poisoned outputs: every element must be written.
    q, k, v = nan((T, H, dout), dtype), nan((T, H, dout), dtype), nan((T, H, dv), dtype)
    _launch_fwd(qkv, cos, sin, a, T, H, dqk, dv, n, dout, paired, key_offset, DEFAULT_EPS, q, k, v)
    rq, rk, rv = qk_prep_reference(qkv, cos, sin, **kw)
    for got, want in ((q, rq), (k, rk), (v, rv)):
        assert torch.isfinite(got).all()
        assert rel(got.reshape(want.shape), want) < FWD_BOUND[dtype]

    # Backward through the launcher into a poisoned d qkv, against autograd of the reference.
    gen = torch.Generator().manual_seed(7)
    gq, gk, gv = (torch.randn(t.shape, generator=gen).to(dtype).to(DEV) for t in (rq, rk, rv))
    x = qkv.clone().requires_grad_()
    ar = a.clone().requires_grad_() if a is not None else None
    outs = qk_prep_reference(x, cos, sin, **{**kw, "aux_v": ar})
    want = torch.autograd.grad(outs, [x] + ([ar] if ar is not None else []), (gq, gk, gv))
    dx = nan(tuple(qkv.shape), dtype)
    thd = lambda t: t.reshape(T, H, t.shape[-1])  # noqa: E731
    _launch_bwd(qkv, cos, sin, thd(gq), thd(gk), thd(gv), T, H, dqk, dv, n, paired, key_offset, DEFAULT_EPS, out=dx)
    assert torch.isfinite(dx).all()
    assert rel(dx, want[0]) < BWD_BOUND[dtype]

    # The autograd Function end to end (shapes, aux gradient).
    x2 = qkv.clone().requires_grad_()
    a2 = a.clone().requires_grad_() if a is not None else None
    fq, fk, fv = qk_prep(x2, cos, sin, **{**kw, "aux_v": a2})
    assert fq.shape == rq.shape and fk.shape == rk.shape and fv.shape == rv.shape
    assert fq.is_contiguous() and fk.is_contiguous() and fv.is_contiguous()
    got = torch.autograd.grad((fq, fk, fv), [x2] + ([a2] if a2 is not None else []), (gq, gk, gv))
    assert rel(got[0], want[0]) < BWD_BOUND[dtype]
    if a is not None:
        assert torch.equal(got[1], want[1])  # d aux_v = dv exactly


@needs_kernel
@pytest.mark.parametrize("variant", ["plain", "paired_aux", "key_offset_aux_pad"])
@pytest.mark.parametrize("block_r", [None, 8])  # the interpreter's rows per program; the GPU's
def test_backward_e5m2_epilogue_is_the_delayed_quantisation_of_d_qkv(variant, block_r, monkeypatch):
    """model.qk_prep_fp8_grad: the backward's e5m2 copy of d qkv has the bits of the delayed
    quantisation rule (quantize_dual_layout_reference's, which quantize_delayed reproduces) applied
    to the stored d qkv with the same scale, the bf16 d qkv is unchanged, and the amax accumulator
    ends at max(its start, max |d qkv|) (a start above it stays).  T = 37: ragged row blocks."""
    from speedrun.kernels import qk_prep as m
    from speedrun.kernels.fp8_cache import E5M2, abs_max_reference

    if block_r is not None:
        monkeypatch.setattr(m, "_INTERP_CONFIG", {"BLOCK_R": block_r, "num_warps": 2})
    paired, key_offset, pad_to, aux = VARIANTS[variant]
    T = 37
    qkv, a = inputs(T, torch.bfloat16, aux, seed=11)
    cos, sin = tables(T)
    T_, H_, dqk, dv, n, dout = _check(qkv, cos, sin, H, DQK, DV, paired, key_offset, pad_to, a, None, "t")
    gen = torch.Generator().manual_seed(12)
    gq, gk = (torch.randn(T, H, dout, generator=gen).bfloat16().to(DEV) for _ in range(2))
    gv = torch.randn(T, H, dv, generator=gen).bfloat16().to(DEV)
    args = (qkv, cos, sin, gq, gk, gv, T, H, dqk, dv, n, paired, key_offset, DEFAULT_EPS)
    plain = _launch_bwd(*args)
    for start in (0.0, 1e6):
        q8 = torch.full(tuple(qkv.shape), 0x7F, dtype=torch.uint8, device=DEV).view(E5M2)  # poisoned (NaN)
        scale = torch.tensor(abs_max_reference(plain).item() * 1.5 / 57344, device=DEV)
        acc = torch.full((), start, device=DEV)
        dx = _launch_bwd(*args, fp8_out=(q8, scale, acc))
        assert torch.equal(dx, plain)
        want_q = (plain.float() * (1.0 / scale)).clamp(-57344.0, 57344.0).to(E5M2)  # the reference's rule
        assert torch.equal(q8.view(torch.uint8), want_q.view(torch.uint8))
        assert (q8.float() != 0).float().mean() > 0.5  # the scale puts most values in e5m2's range
        assert acc.item() == max(start, abs_max_reference(plain).item())


def test_backward_e5m2_epilogue_refuses_bad_outputs():
    from speedrun.kernels.fp8_cache import E5M2

    T = 16
    qkv, _ = inputs(T, torch.bfloat16, False, seed=1)
    cos, sin = tables(T)
    g = torch.zeros(T, H, DQK, dtype=torch.bfloat16, device=DEV)
    gv = torch.zeros(T, H, DV, dtype=torch.bfloat16, device=DEV)
    z = torch.zeros((), device=DEV)
    args = (qkv, cos, sin, g, g, gv, T, H, DQK, DV, NF, False, False, DEFAULT_EPS)
    for q8, sc, match in ((torch.empty(qkv.shape, dtype=torch.float8_e4m3fn, device=DEV), z, "contiguous e5m2"),
                          (torch.empty((T, 8), dtype=E5M2, device=DEV), z, "contiguous e5m2"),
                          (torch.empty(qkv.shape, dtype=E5M2, device=DEV), z.reshape(1), "scale must be a 0-d fp32")):
        with pytest.raises(ValueError, match=match):
            _launch_bwd(*args, fp8_out=(q8, sc, z))
    with pytest.raises(ValueError, match="needs 16-bit qkv"):
        _launch_bwd(qkv.float(), cos, sin, g.float(), g.float(), gv.float(), *args[6:],
                    fp8_out=(torch.empty(qkv.shape, dtype=E5M2, device=DEV), z, z))


@needs_kernel
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_block_sizes_mask_their_tails(variant, monkeypatch):
    """The GPU's launch parameters (tuned on the H200: small row blocks) run here in the
    interpreter, whose own blocks are larger: T H = 148 rows leave a partial block at either size,
    and every output must still be written and match the reference, forward and backward."""
    from speedrun.kernels import qk_prep as m

    for cfg in {(c["BLOCK_R"], c["num_warps"]) for c in m.CONFIGS.values()}:
        monkeypatch.setattr(m, "_INTERP_CONFIG", {"BLOCK_R": cfg[0], "num_warps": cfg[1]})
        test_forward_and_backward_match_reference(variant, torch.bfloat16)


@needs_kernel
def test_reference_is_record_attention_prep():
    """qk_prep_reference == a transcription of RecordGPT._attention's ops with a real Yarn (after a
    YaRN extension), from the record's [Q | K | V] column order."""
    T, h, dqk, dv = 24, 4, 16, 16
    yarn = Yarn(dqk, 0.5, 1024.0, max_positions=8)
    yarn.apply(16, 64)
    cos, sin = yarn.tables(2 * T, DEV)
    g = torch.Generator().manual_seed(3)
    rec = torch.randn(T, h * (2 * dqk + dv), generator=g).bfloat16().to(DEV)  # record column order
    packed = rec[:, packed_column_order(h, dqk, dv, device=DEV)]
    norm = lambda z: torch.nn.functional.rms_norm(z, (z.shape[-1],))  # noqa: E731
    for paired, key_offset in ((False, False), (False, True), (True, False)):
        q = norm(rec[:, : h * dqk].view(T, h, dqk))
        k = norm(rec[:, h * dqk : 2 * h * dqk].view(T, h, dqk))
        v = rec[:, 2 * h * dqk :].view(T, h, dv)
        if paired:
            q, k = yarn.rotate_paired(q), yarn.rotate_paired(k)
            q, k, v = (z.reshape(2 * T, h // 2, z.shape[-1]) for z in (q, k, v))
        else:
            q, k = yarn.rotate(q), yarn.rotate(k)
            if key_offset:
                r = yarn.rope_dims
                k = torch.cat((k[:, :, :r], torch.cat((k[:1, :, r:], k[:-1, :, r:]))), dim=-1)
        got = qk_prep_reference(packed, cos, sin, num_heads=h, qk_dim=dqk, v_dim=dv, paired=paired, key_offset=key_offset)
        for a, b in zip(got, (q, k, v)):
            assert torch.equal(a, b)
        fused = qk_prep(packed, cos, sin, num_heads=h, qk_dim=dqk, v_dim=dv, paired=paired, key_offset=key_offset)
        for a, b in zip(fused, (q, k, v)):
            assert rel(a, b) < FWD_BOUND[torch.bfloat16]


@needs_kernel
def test_key_offset_semantics_and_t0():
    """Stationary key dims at t are the plain layer's at t-1; t = 0 keeps its own; rotating dims untouched."""
    T = 20
    qkv, _ = inputs(T, torch.float32, False, seed=5)
    cos, sin = tables(T)
    kw = dict(num_heads=H, qk_dim=DQK, v_dim=DV)
    _, k0, _ = qk_prep(qkv, cos, sin, **kw)
    _, k1, _ = qk_prep(qkv, cos, sin, key_offset=True, **kw)
    r = 2 * NF
    assert torch.equal(k1[:, :, :r], k0[:, :, :r])
    assert torch.equal(k1[1:, :, r:], k0[:-1, :, r:])
    assert torch.equal(k1[0], k0[0])
    # T = 1: nothing to shift (record: `if T > 1`).
    _, k2, _ = qk_prep(qkv[:1], cos, sin, key_offset=True, **kw)
    assert torch.equal(k2, k0[:1])


@needs_kernel
def test_paired_positions():
    """Paired: head h of token t is rotated as position 2t + h%2 of a plain layer."""
    T = 8
    qkv, _ = inputs(T, torch.float32, False, seed=6)
    cos, sin = tables(T)
    q, _, _ = qk_prep(qkv, cos, sin, num_heads=H, qk_dim=DQK, v_dim=DV, paired=True)
    assert q.shape == (2 * T, H // 2, DQK)
    q = q.reshape(T, H, DQK)
    # A plain layer over 2T tokens whose token 2t + j carries heads of parity j.
    P = 2 * DQK + DV
    x = qkv.view(T, H, P)
    spread = torch.zeros(2 * T, H, P, device=DEV)
    for h in range(H):
        spread[h % 2 :: 2, h] = x[:, h]
    spread[..., :DQK] += (spread[..., :DQK] == 0).float()  # keep unused rows non-degenerate
    qp, _, _ = qk_prep(spread.reshape(2 * T, H * P), cos, sin, num_heads=H, qk_dim=DQK, v_dim=DV)
    for h in range(H):
        assert rel(q[:, h], qp[h % 2 :: 2, h]) < 1e-6


@needs_kernel
def test_padding_is_zero_and_gradient_ignores_it():
    T = 16
    qkv, _ = inputs(T, torch.bfloat16, False, seed=8)
    cos, sin = tables(T)
    x = qkv.clone().requires_grad_()
    q, k, v = qk_prep(x, cos, sin, num_heads=H, qk_dim=DQK, v_dim=DV, pad_to=DV)
    assert q.shape == (T, H, DV) and k.shape == (T, H, DV)
    assert (q[..., DQK:] == 0).all() and (k[..., DQK:] == 0).all()
    q0, k0, _ = qk_prep(qkv, cos, sin, num_heads=H, qk_dim=DQK, v_dim=DV)
    assert torch.equal(q[..., :DQK], q0) and torch.equal(k[..., :DQK], k0)
    # Gradient into the padding columns must not leak into d qkv.
    gq = torch.randn(q.shape).bfloat16()
    gk = torch.randn(k.shape).bfloat16()
    gv = torch.randn(v.shape).bfloat16()
    d1 = torch.autograd.grad((q, k, v), x, (gq, gk, gv))[0]
    gq2, gk2 = gq.clone(), gk.clone()
    gq2[..., DQK:] = 1e3
    gk2[..., DQK:] = -1e3
    d2 = torch.autograd.grad(qk_prep(x, cos, sin, num_heads=H, qk_dim=DQK, v_dim=DV, pad_to=DV), x, (gq2, gk2, gv))[0]
    assert torch.equal(d1, d2)


@needs_kernel
def test_strided_gradients_and_record_width():
    """Non-contiguous output gradients, and a 96-wide head (non-power-of-two, 24 frequencies)."""
    T, h, dqk, dv, nf = 8, 2, 96, 128, 24
    qkv, _ = inputs(T, torch.float32, False, seed=9, h=h, dqk=dqk, dv=dv)
    cos, sin = tables(T, nf)
    x = qkv.clone().requires_grad_()
    kw = dict(num_heads=h, qk_dim=dqk, v_dim=dv, key_offset=True)
    out = qk_prep(x, cos, sin, **kw)
    big = [torch.randn(T, h, 2 * t.shape[-1]) for t in out]
    grads = [b[..., ::2] for b in big]  # unit-stride violations handled by the wrapper
    got = torch.autograd.grad(out, x, grads)[0]
    xr = qkv.clone().requires_grad_()
    want = torch.autograd.grad(qk_prep_reference(xr, cos, sin, **kw), xr, grads)[0]
    assert rel(got, want) < 1e-5
    for a, b in zip(out, qk_prep_reference(qkv, cos, sin, **kw)):
        assert rel(a, b) < 1e-5


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(qkv_shape=(8, 4 * 63)), r"\(8, 252\)"),
        (dict(cos_rows=8, paired=True), r"need 16"),
        (dict(nf=9), r"rotate 2\*9 dims"),
        (dict(pad_to=8), r"pad_to=8"),
        (dict(paired=True, key_offset=True), r"key_offset"),
        (dict(heads=3, paired=True, qkv_shape=(8, 3 * 64)), r"even num_heads"),
        (dict(aux_shape=(8, 5)), r"\(8, 5\)"),
        (dict(qkv_dtype=torch.float64), r"float64"),
    ],
)
def test_bad_shapes_raise_value_error(kwargs, match):
    heads = kwargs.get("heads", H)
    shape = kwargs.get("qkv_shape", (8, heads * (2 * DQK + DV)))
    qkv = torch.randn(shape, dtype=kwargs.get("qkv_dtype", torch.bfloat16))
    nf = kwargs.get("nf", NF)
    cos = torch.randn(kwargs.get("cos_rows", 20), nf)
    aux = torch.randn(kwargs["aux_shape"]).bfloat16() if "aux_shape" in kwargs else None
    for fn in (qk_prep, qk_prep_reference):
        with pytest.raises(ValueError, match=match):
            fn(qkv, cos, cos.clone(), num_heads=heads, qk_dim=DQK, v_dim=DV, paired=kwargs.get("paired", False),
               key_offset=kwargs.get("key_offset", False), pad_to=kwargs.get("pad_to"), aux_v=aux)


_SM90_COMPILE = r"""
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from speedrun.kernels import qk_prep as m
from speedrun.kernels.fp8_cache import grid_constants
import torch
out = {}
rc = grid_constants(torch.bfloat16)
common = dict(EPS=m.DEFAULT_EPS, H=6, DQK=96, DV=128, NF=24, BLOCK_D=128, BLOCK_V=128, ROUND=True, EXACT=False, **rc)
ptrs = ["qkv_ptr", "cos_ptr", "sin_ptr"]
e5m2 = {f"Q_{k}": v for k, v in grid_constants(torch.float8_e5m2).items()}
bwd_ptrs = ["dq_ptr", "dk_ptr", "dv_ptr", "dx_ptr", "dx8_ptr", "scale8_ptr", "amax8_ptr"]
for name, fn, extra, consts in (
    ("fwd", m._qk_prep_fwd_kernel, ["aux_ptr", "q_ptr", "k_ptr", "v_ptr"],
     dict(DOUT=96, PAIRED=False, KEY_OFFSET=True, HAS_AUX=True, BLOCK_R=m.CONFIGS["fwd"]["BLOCK_R"])),
    ("bwd", m._qk_prep_bwd_kernel, bwd_ptrs,
     dict(PAIRED=False, KEY_OFFSET=True, BLOCK_R=m.CONFIGS["bwd"]["BLOCK_R"], STORE_E5M2=False, **e5m2)),
    ("bwd_e5m2", m._qk_prep_bwd_kernel, bwd_ptrs,
     dict(PAIRED=False, KEY_OFFSET=True, BLOCK_R=m.CONFIGS["bwd"]["BLOCK_R"], STORE_E5M2=True, **e5m2)),
):
    types = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "dx8_ptr": "*u8", "scale8_ptr": "*fp32", "amax8_ptr": "*fp32"}
    sig = {a: types.get(a, "*bf16") for a in ptrs + extra}
    for a in fn.arg_names:
        if a not in sig and a not in consts and a not in common:
            sig[a] = "i32"
    full = {**sig, **{k: "constexpr" for k in {**common, **consts}}}
    # Runtime specialisation at record shapes: every pointer and int argument is a multiple of 16.
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig}
    cst = {(fn.arg_names.index(k),): v for k, v in {**common, **consts}.items()}
    k = triton.compile(ASTSource(fn=fn, signature=full, constexprs=cst, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=m.CONFIGS[name[:3]]["num_warps"]))
    out[name] = dict(shared=k.metadata.shared, convert_layout=k.asm["ttgir"].count("convert_layout"),
                     fp8_casts=k.asm["ttgir"].count("f8E5M2"))
print(json.dumps(out))
"""


def test_sm90_compile_keeps_pairs_in_registers():
    """Compile fwd/bwd for sm90 here (no GPU needed): the pair split/join and row reductions must
    need no shared memory and no layout conversion at the record shape."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    import triton

    if not any(shutil.which("ptxas", path=p) for p in [os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")]):
        pytest.skip("Triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("fwd", "bwd"):
        assert info[name] == {"shared": 0, "convert_layout": 0, "fp8_casts": 0}, info
    # The e5m2 epilogue (model.qk_prep_fp8_grad) builds too and converts with the hardware
    # instruction (one layout: safe).  Its 1-byte stores want wider vectors than the bf16 ones, so
    # the compiler converts the bf16 tiles' layout before their stores (5 conversions, 2 KB of
    # shared memory at the record shape; bench_qk_prep.py times the cost).
    assert info["bwd_e5m2"]["fp8_casts"] > 0 and info["bwd_e5m2"]["convert_layout"] <= 6, info
