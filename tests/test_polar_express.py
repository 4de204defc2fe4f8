"""Polar Express kernels vs their references (Triton under TRITON_INTERPRET=1 at small shapes)."""

from __future__ import annotations

import pytest
import torch

from speedrun.kernels import polar_express as pe

needs_interpreter = pytest.mark.skipif(
    not pe.triton_interpreted(), reason="Triton kernels run on CPU only with TRITON_INTERPRET=1"
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


@needs_interpreter
@pytest.mark.parametrize("shape", [(2, 64, 96), (1, 40, 72), (50, 33)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_xxt_matches_reference(shape, dtype, tol):
    A = torch.randn(shape).to(dtype)
    M = shape[-2]
    out = poisoned((*shape[:-2], M, M), dtype)
    pe.xxt(A, out)
    ref = pe.xxt_reference(A, torch.empty_like(out))
    assert not out.isnan().any()
    assert rel(out, ref) < tol
    # Tiles on the diagonal are stored twice (own + mirror); both copies must agree.
    assert torch.allclose(out.float(), out.mT.float(), rtol=1e-5, atol=1e-4)


@needs_interpreter
@pytest.mark.parametrize("shape", [(2, 96, 64), (1, 72, 40)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_xtx_matches_reference(shape, dtype, tol):
    A = torch.randn(shape).to(dtype)
    K = shape[-1]
    out = poisoned((shape[0], K, K), dtype)
    pe.xtx(A, out)
    ref = pe.xtx_reference(A, torch.empty_like(out))
    assert not out.isnan().any()
    assert rel(out, ref) < tol


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_ba_plus_caa_matches_reference(dtype, tol):
    X = torch.randn(2, 80, 48)
    A = (X @ X.mT / 48).to(dtype)  # symmetric, as in Polar Express
    out = poisoned(A.shape, dtype)
    pe.ba_plus_caa(A, -2.5, 0.75, out)
    ref = pe.ba_plus_caa_reference(A, -2.5, 0.75, torch.empty_like(out))
    assert not out.isnan().any()
    assert rel(out, ref) < tol


@needs_interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_ba_plus_caa_adds_the_diagonal_term(dtype, tol):
    # 80 rows over the interpreter's 32 x 64 tiles: the diagonal crosses partial tiles and mirrors
    X = torch.randn(2, 80, 48)
    A = (X @ X.mT / 48).to(dtype)
    out = poisoned(A.shape, dtype)
    pe.ba_plus_caa(A, 0.5, -2.5, out, diag=8.0)
    ref = pe.ba_plus_caa_reference(A, 0.5, -2.5, torch.empty_like(out), diag=8.0)
    assert not out.isnan().any()
    assert rel(out, ref) < tol
    plain = pe.ba_plus_caa_reference(A, 0.5, -2.5, torch.empty_like(out))
    eye = torch.eye(80).expand(2, 80, 80)
    assert rel(ref.float() - plain.float(), 8.0 * eye) < tol  # the reference adds exactly diag * I


@needs_interpreter
def test_polar_express_iteration_moves_no_extra_bank_bytes():
    """The Triton path folds a X into the polynomial: per step one Gram kernel, one polynomial
    kernel and a plain ``bmm``; no ``baddbmm`` (whose separate output is first filled with a copy of
    X) and no other op writes an X-sized tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # the interpreter moves kernel arguments through ``set_``; allocations write nothing
            if isinstance(out, torch.Tensor) and not any(k in str(func) for k in ("empty", "set_")):
                self.seen.append((str(func.overloadpacket), tuple(out.shape)))
            return out

    for shape in ((2, 64, 32), (2, 32, 64)):  # tall, wide
        X = pe.polar_express_normalize(torch.randn(shape))
        with Ops() as ops:
            pe.polar_express_iterate(X, steps=3, use_triton=True)
        x_sized = [name for name, s in ops.seen if s == shape]
        assert x_sized == ["aten.bmm"] * 3, ops.seen


@needs_interpreter
def test_strided_input_is_honoured():
    base = torch.randn(2, 40, 64)
    A = base[:, :, ::2]  # non-unit column stride
    out = poisoned((2, 40, 40), torch.float32)
    pe.xxt(A, out)
    assert rel(out, A @ A.mT) < 1e-5


@needs_interpreter
@pytest.mark.parametrize("shape", [(2, 32, 64), (1, 64, 32)])
def test_polar_express_triton_matches_torch_path(shape):
    G = torch.randn(shape)
    # One iteration: both paths round at the same points, so they agree to bf16 precision.
    one_t = pe.polar_express(G, steps=1, use_triton=True)
    one_r = pe.polar_express_reference(G, steps=1)
    assert rel(one_t, one_r) < 2e-2
    # Five iterations amplify bf16 rounding differences; the result must still be orthogonal-ish.
    X = pe.polar_express(G, use_triton=True)
    assert X.dtype == torch.bfloat16 and X.shape == G.shape
    assert rel(X, pe.polar_express(G, use_triton=False)) < 0.1
    lo, hi = pe._spectral_bounds(X)
    assert 0.7 < lo and hi < 1.25


@pytest.mark.parametrize("shape", [(3, 24, 56), (2, 56, 24), (32, 32), (2, 2, 16, 24)])
def test_polar_express_orthogonalises(shape):
    G = torch.randn(shape) * 1e3
    X = pe.polar_express(G)  # CPU: torch path
    assert X.shape == G.shape and X.dtype == torch.bfloat16
    s = torch.linalg.svdvals(X.float())
    assert s.max() < 1.25 and 0.8 < s.median() < 1.2
    if shape[-1] != shape[-2]:  # square Gaussians have near-zero singular values 5 steps can't lift
        assert s.min() > 0.7
    # Same singular vectors as G: X is close to the exact polar factor U V^T.
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    assert rel(X, U @ Vh) < 0.2
    assert rel(X, pe.polar_express_reference(G)) < 0.1


def test_polar_express_matrices_are_independent():
    G = torch.randn(4, 24, 40)
    G[1] *= 1e-4  # scale of one matrix must not change another's result
    X = pe.polar_express(G)
    assert torch.equal(X[2], pe.polar_express(G[2:3])[0])


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="at least 2 dims"):
        pe.polar_express(torch.randn(5))
    with pytest.raises(ValueError, match="steps"):
        pe.polar_express(torch.randn(4, 4), steps=6)
    with pytest.raises(ValueError, match="out must have shape"):
        pe.xxt_reference(torch.randn(2, 8, 16), torch.empty(2, 16, 16))
    with pytest.raises(ValueError, match="square"):
        pe.ba_plus_caa_reference(torch.randn(8, 16), 1.0, 1.0, torch.empty(8, 16))
    with pytest.raises(ValueError, match="dtype"):
        pe.xtx_reference(torch.ones(4, 4, dtype=torch.int32), torch.empty(4, 4))
    for bad in (torch.randn(2, 8, 16), torch.randn(8, 16).bfloat16(), torch.randn(2, 16, 8).bfloat16().mT,
                torch.empty(0, 8, 16, dtype=torch.bfloat16)):  # fp32, 2-D, strided, empty
        with pytest.raises(ValueError, match="polar_express_iterate: X must be a non-empty contiguous bf16"):
            pe.polar_express_iterate(bad)
    if not pe.triton_interpreted():
        with pytest.raises(ValueError, match="CUDA"):
            pe.xxt(torch.randn(8, 16), torch.empty(8, 8))


def test_coefficients_are_the_records():
    assert len(pe.POLAR_EXPRESS_COEFFS) == 5
    assert pe.POLAR_EXPRESS_COEFFS[0] == pytest.approx((8.156554524902461, -22.48329292557795, 15.878769915207462))
    assert pe.POLAR_EXPRESS_COEFFS[4] == pytest.approx((2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
    assert (pe.PRE_NORM_SAFETY, pe.PRE_NORM_EPS) == (1.02, 1e-6)
