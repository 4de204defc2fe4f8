"""``tests/interpreter_numerics.py``: Triton's CPU interpreter under ``gpu_numerics()`` computes
what a GPU computes (torch's own casts and fp32 math as the reference), and differs without it
where it must (so the fix is not dead: if a Triton release fixes its interpreter, these tell us)."""

from __future__ import annotations

import pytest
import torch

from interpreter_numerics import gpu_numerics
from speedrun.kernels._triton import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="needs Triton's CPU interpreter (TRITON_INTERPRET=1)")

N = 64


def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def casts(x_ptr, bf16_ptr, fp8_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        tl.store(bf16_ptr + offs, x.to(tl.bfloat16))
        tl.store(fp8_ptr + offs, x.to(tl.float8e4nv))

    @triton.jit
    def bf16_math(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)  # bf16
        tl.store(out_ptr + offs, 2 * x)
        tl.store(out_ptr + N + offs, x * x)
        tl.store(out_ptr + 2 * N + offs, tl.maximum(x, 0))
        tl.store(out_ptr + 3 * N + offs, tl.sqrt(tl.abs(x.to(tl.float32))).to(tl.bfloat16) + x)

    @triton.jit
    def dot(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], tl.dot(a, b, tl.zeros((M, N), dtype=tl.float32)))

    @triton.jit
    def count_to(n, out_ptr):
        total = 0
        for i in range(n):  # a runtime scalar bound
            total += 1
        tl.store(out_ptr, total)

    @triton.jit
    def compare(x_ptr, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        x = tl.load(x_ptr + offs)
        tl.store(out_ptr + offs, tl.where(x < x * 2, 1, 0))

    return casts, bf16_math, dot, count_to, compare


@pytest.fixture(scope="module")
def kernels():
    return _kernels()


def _values(seed=0):
    """fp32 values whose bf16 / fp8 roundings differ from truncation, some beyond e4m3's 448."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, generator=g) * 3
    x[:4] = torch.tensor([1000.0, -1000.0, 449.0, 1.0 + 2**-8 + 2**-10])
    return x


def _casts(kernels, x):
    b = torch.full((N,), float("nan"), dtype=torch.bfloat16)  # poisoned: every element must be written
    f = torch.full((N,), float("nan")).to(torch.float8_e4m3fn)
    kernels[0][(1,)](x, b, f, N)
    return b, f


def test_casts_round_to_nearest_even_and_saturate(kernels):
    x = _values()
    with gpu_numerics():
        b, f = _casts(kernels, x)
    assert torch.equal(b.view(torch.int16), x.bfloat16().view(torch.int16))
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(f.view(torch.int8), want.view(torch.int8))
    b0, _ = _casts(kernels, x)  # the interpreter itself truncates fp32 -> bf16
    assert not torch.equal(b0.view(torch.int16), x.bfloat16().view(torch.int16))


def test_bf16_arithmetic_is_fp32_math_rounded(kernels):
    x = _values(1).bfloat16()
    out = torch.full((4 * N,), float("nan"), dtype=torch.bfloat16)
    with gpu_numerics():
        kernels[1][(1,)](x, out, N)
    xf = x.float()
    want = torch.cat([(2 * xf).bfloat16(), (xf * xf).bfloat16(), xf.clamp(min=0).bfloat16(),
                      (xf.abs().sqrt().bfloat16().float() + xf).bfloat16()])
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_dot_takes_exact_values_of_bf16_and_fp8_operands(kernels):
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        a_, b_ = a.to(dtype), b.to(dtype)
        c = torch.full((16, 16), float("nan"))
        with gpu_numerics():
            kernels[2][(1,)](a_, b_, c, 16, 16, 32)
        torch.testing.assert_close(c, a_.float() @ b_.float(), rtol=1e-5, atol=1e-5)
    c0 = torch.zeros(16, 16)
    kernels[2][(1,)](a.bfloat16(), b.bfloat16(), c0, 16, 16, 32)  # the interpreter multiplies raw bits
    assert (c0 - a.bfloat16().float() @ b.bfloat16().float()).abs().max() > 1


def test_a_runtime_scalar_bounds_a_range(kernels):
    out = torch.zeros(1, dtype=torch.int32)
    with gpu_numerics():
        kernels[3][(1,)](7, out)
    assert out.item() == 7


def test_an_operation_not_emulated_raises(kernels):
    x = _values().bfloat16()
    with gpu_numerics(), pytest.raises(Exception, match="not emulated"):
        kernels[4][(1,)](x, torch.zeros(N, dtype=torch.int32), N)


def test_everything_is_restored_on_exit():
    import triton.runtime.interpreter as ti

    before = (ti._convert_float, ti._patch_lang_tensor, ti.InterpreterBuilder.binary_op,
              ti.InterpreterBuilder.create_dot, hasattr(ti.InterpreterBuilder, "get_bf16"))
    with gpu_numerics():
        assert ti._convert_float is not before[0]
    assert (ti._convert_float, ti._patch_lang_tensor, ti.InterpreterBuilder.binary_op,
            ti.InterpreterBuilder.create_dot, hasattr(ti.InterpreterBuilder, "get_bf16")) == before
