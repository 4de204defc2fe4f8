"""Triton's CPU interpreter made to compute the way a GPU does, for running *upstream's* Triton
kernels on a CPU (``tools/record_upstream_goldens.py`` runs upstream's ReLU² MLP kernel this way).

Our own kernels avoid the interpreter's inexact corners themselves (fp32 operands to ``tl.dot``,
:data:`speedrun.kernels.mlp.EXACT_CASTS`); upstream's kernels are recorded as written, so the
interpreter is fixed around them instead.  Under :func:`gpu_numerics` (Triton 3.6, numpy 2.x):

- float conversions round to nearest even as a GPU's do (the interpreter truncates fp32 -> bf16
  and rounds fp32 -> fp8 without carrying into the exponent); fp8 conversions saturate to the
  largest finite value (``cvt.rn.satfinite``).  Conversions run through torch's own casts;
- ``tl.dot`` on bf16 or fp8 operands (stored as raw bits by the interpreter, which numpy then
  multiplies as integers) takes their exact fp32 values, accumulating in fp32;
- element-wise arithmetic on bf16 / fp8 values (``a * b``, ``tl.maximum``, ``tl.sqrt``, ...)
  computes in fp32 and rounds the result to the operand type, the result a GPU gives; any other
  bf16 / fp8 operation the interpreter would run on raw bits raises instead of computing garbage;
- a bf16 constant (``2 * x`` for a bf16 ``x``) exists (the interpreter lacks ``get_bf16``);
- a scalar argument or program id bounds a Python ``range`` (numpy 2.x refuses ``int()`` of the
  one-element arrays the interpreter keeps scalars in).

Everything is restored on exit.  ``tests/test_interpreter_numerics.py`` checks each point against
torch and that the unpatched interpreter differs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

_ARITH = (np.add, np.subtract, np.multiply, np.divide, np.minimum, np.maximum, np.fmod)


def _torch_dtypes():
    import triton.language as tl

    return {tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
            tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}


_INT_OF_WIDTH = {8: (np.int8, torch.int8), 16: (np.int16, torch.int16), 32: (np.int32, torch.int32),
                 64: (np.int64, torch.int64)}


def _to_torch(data: np.ndarray, dtype) -> torch.Tensor:
    """The interpreter's storage of ``dtype`` values (native floats, or raw bits) as a torch tensor."""
    td = _torch_dtypes()[dtype]
    np_int, _ = _INT_OF_WIDTH[dtype.primitive_bitwidth]
    return torch.from_numpy(np.ascontiguousarray(data).view(np_int).copy()).view(td)


def _from_torch(t: torch.Tensor, dtype) -> np.ndarray:
    """A torch tensor of ``dtype`` values in the interpreter's storage (raw bits for bf16 / fp8)."""
    from triton.runtime.interpreter import _get_np_dtype

    _, t_int = _INT_OF_WIDTH[dtype.primitive_bitwidth]
    return t.contiguous().view(t_int).numpy().view(_get_np_dtype(dtype))


def convert(data: np.ndarray, src, dst, rounding_mode=None) -> np.ndarray:
    """``data`` (interpreter storage of ``src`` floats) as ``dst`` floats, rounded to nearest even,
    fp8 saturating: the replacement of the interpreter's ``_convert_float``."""
    from triton._C.libtriton import ir

    if rounding_mode not in (None, ir.ROUNDING_MODE.RTNE):
        raise NotImplementedError(f"gpu_numerics: rounding mode {rounding_mode} is not emulated")
    t = _to_torch(data, src).float() if src.primitive_bitwidth < 32 else _to_torch(data, src)
    td = _torch_dtypes()[dst]
    if td in (torch.float8_e4m3fn, torch.float8_e5m2):
        top = torch.finfo(td).max
        t = torch.where(t.isfinite(), t.clamp(-top, top), t)
    return _from_torch(t.to(td), dst)


def _is_emulated(dtype) -> bool:
    import triton.language as tl

    return dtype in (tl.bfloat16, tl.float8e4nv, tl.float8e5)


@contextlib.contextmanager
def gpu_numerics() -> Iterator[None]:
    """Patch Triton's interpreter as the module docstring says, for the ``with`` block."""
    import triton.language as tl
    import triton.runtime.interpreter as ti

    B = ti.InterpreterBuilder
    saved_module = {"_convert_float": ti._convert_float, "_patch_lang_tensor": ti._patch_lang_tensor}
    saved_builder = {name: B.__dict__.get(name) for name in ("binary_op", "unary_op", "create_dot", "get_bf16")}

    def to32(h):
        return ti.TensorHandle(convert(h.data, h.dtype.scalar, tl.float32), tl.float32)

    def binary_op(self, lhs, rhs, op):
        if not (_is_emulated(lhs.dtype.scalar) or _is_emulated(rhs.dtype.scalar)):
            return saved_builder["binary_op"](self, lhs, rhs, op)
        if op not in _ARITH:
            raise NotImplementedError(f"gpu_numerics: {op.__name__} on {lhs.dtype.scalar} is not emulated")
        out = lhs.dtype.scalar
        r = op(to32(lhs).data, to32(rhs).data).astype(np.float32)
        return ti.TensorHandle(convert(r, tl.float32, out), out)

    def unary_op(self, arg, op):
        if not _is_emulated(arg.dtype.scalar):
            return saved_builder["unary_op"](self, arg, op)
        r = op(to32(arg).data).astype(np.float32)
        return ti.TensorHandle(convert(r, tl.float32, arg.dtype.scalar), arg.dtype.scalar)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a32 = to32(a).data if _is_emulated(a.dtype.scalar) else a.data.astype(np.float32)
        b32 = to32(b).data if _is_emulated(b.dtype.scalar) else b.data.astype(np.float32)
        return ti.TensorHandle(np.matmul(a32, b32, dtype=np.float32) + d.data, d.dtype.scalar)

    def get_bf16(self, value):
        return ti.TensorHandle(convert(np.array([value], dtype=np.float32), tl.float32, tl.bfloat16), tl.bfloat16)

    def patch_lang_tensor(tensor, scope):
        saved_module["_patch_lang_tensor"](tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])
                       if np.size(self.handle.data) == 1 else int(self.handle.data))

    ti._convert_float = convert
    ti._patch_lang_tensor = patch_lang_tensor
    B.binary_op, B.unary_op, B.create_dot, B.get_bf16 = binary_op, unary_op, create_dot, get_bf16
    try:
        yield
    finally:
        for name, fn in saved_module.items():
            setattr(ti, name, fn)
        for name, fn in saved_builder.items():
            if fn is None:
                delattr(B, name)
            else:
                setattr(B, name, fn)
