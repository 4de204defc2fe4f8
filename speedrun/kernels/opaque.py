"""Fused-kernel calls as single opaque ops, so ``torch.compile`` can hold a whole network.

Our fused kernels (FP8 MLP, packed FP8 QKV GEMM, QK-prep) are ``torch.autograd.Function``s whose
Python bodies keep per-layer state (delayed FP8 scales, the per-update FP8 weight cache) and launch
Triton kernels.  Dynamo cannot trace that state, and a graph break inside the network's layer
loop makes Dynamo skip the *whole* frame: the model then runs eagerly, every elementwise op its
own kernel.  This module gives each such call one graph node instead:

- ``speedrun::opaque_fwd(inputs, handle, keep) -> outputs`` runs a registered kernel's forward
  eagerly (at run time, never at trace time: tracing uses the registered shape function);
- ``speedrun::opaque_bwd(grads, handle, meta) -> input grads`` runs its backward (``meta``: the
  input gradients' shapes and dtypes, encoded in a string).

A kernel is registered once, outside compiled code, with :func:`register`; the returned integer
handle is a constant in the graph.  The forward's saved state (a :class:`KernelCtx`, the same
object an autograd.Function's ``forward(ctx, ...)`` / ``backward(ctx, ...)`` receive) waits on a
stack per handle until a backward pops the newest one: backwards run in the reverse order of
their forwards, which is what training (with gradient accumulation) does.  Forwards without
gradients (``keep=False``: no-grad evaluation) keep nothing.  A forward whose loss is dropped
without a backward leaves its state behind: the training step clears the stacks before it starts
(:func:`clear_pending`), and a stack deeper than ``MAX_PENDING`` drops its oldest entry.

Outputs and input gradients are contiguous and have the shapes and dtypes the shape functions
promise (checked at run time): Inductor plans memory from those promises.  Both ops return one
extra empty tensor after the real results (dropped by :func:`call` and the backward): Inductor's
C++ wrapper (``train.compile_cpp_wrapper``) crashes on a custom op whose ``Tensor[]`` result has a
single element (pytorch/pytorch#190551), and the MLP's op has one output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

# dtype codes for opaque_bwd's metadata (custom-op schemas take ints, not dtypes)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class KernelCtx:
    """Stands in for autograd's ``ctx`` when a kernel's forward/backward are called directly:
    ``save_for_backward`` / ``saved_tensors``, ``needs_input_grad`` and free attributes."""

    def __init__(self, needs_input_grad: Sequence[bool] = ()):
        self.needs_input_grad = tuple(needs_input_grad)
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors) -> None:  # noqa: D401 - autograd ctx API
        pass

    def set_materialize_grads(self, value: bool) -> None:
        pass


@dataclass
class OpaqueKernel:
    """A kernel call with explicit forward and backward.

    forward(ctx, inputs) -> list of output tensors; backward(ctx, output grads) -> one gradient
    (or None) per input with ``diff`` True; out_specs(inputs) -> [(shape, dtype)] of the outputs
    (also called on fake tensors while tracing).  ``name`` appears in errors."""

    name: str
    forward: Callable[[KernelCtx, list], list]
    backward: Callable[[KernelCtx, list], list]
    out_specs: Callable[[list], list]
    diff: tuple[bool, ...]


MAX_PENDING = 4
_KERNELS: list[OpaqueKernel] = []
_PENDING: dict[int, list[KernelCtx]] = {}


def register(kernel: OpaqueKernel) -> int:
    """Register ``kernel`` (outside compiled code) and return its handle."""
    _KERNELS.append(kernel)
    return len(_KERNELS) - 1


def clear_pending() -> None:
    """Drop every saved forward state (after an aborted step whose backward never ran)."""
    _PENDING.clear()


def call(handle: int, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Run kernel ``handle`` on ``inputs`` (differentiable through autograd, traceable by Dynamo)."""
    kernel = _KERNELS[handle]
    if len(inputs) != len(kernel.diff):
        raise ValueError(f"{kernel.name}: {len(inputs)} inputs, registered with {len(kernel.diff)}")
    keep = torch.is_grad_enabled() and any(t.requires_grad for t, d in zip(inputs, kernel.diff) if d)
    return list(_OpaqueCall.apply(handle, keep, *inputs))


_MARKERS: dict = {}


def _with_marker(outs: list[torch.Tensor], device) -> list[torch.Tensor]:
    """``outs`` plus the trailing empty tensor every opaque op returns (see the module docstring);
    one cached 0-element tensor per device (an allocation per call costs host time)."""
    marker = _MARKERS.get(device)
    if marker is None:
        marker = _MARKERS[device] = torch.empty(0, device=device)
    return outs + [marker]


def _unalias(outs: list[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Custom ops may not return an input or a view of one (e.g. a gradient passed straight
    through): copy those, and outputs sharing storage with an earlier output."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    res = []
    for t in outs:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        res.append(t)
    return res


def _conform(kernel: OpaqueKernel, t: torch.Tensor, shape, dtype, what: str) -> torch.Tensor:
    if t.shape != tuple(shape):
        raise RuntimeError(f"{kernel.name}: {what} has shape {tuple(t.shape)}, promised {tuple(shape)}")
    if t.dtype == dtype and t.is_contiguous():  # the usual case; .to().contiguous() costs host time
        return t
    return t.to(dtype).contiguous()


def _opaque_fwd(inputs: list[torch.Tensor], handle: int, keep: bool) -> list[torch.Tensor]:
    kernel = _KERNELS[handle]
    ctx = KernelCtx()
    outs = kernel.forward(ctx, list(inputs))
    specs = kernel.out_specs(list(inputs))
    if len(outs) != len(specs):
        raise RuntimeError(f"{kernel.name}: forward returned {len(outs)} outputs, promised {len(specs)}")
    outs = _unalias([_conform(kernel, o, *spec, f"output {i}") for i, (o, spec) in enumerate(zip(outs, specs))],
                    inputs)
    if keep:
        stack = _PENDING.setdefault(handle, [])
        stack.append(ctx)
        if len(stack) > MAX_PENDING:
            del stack[0]
    return _with_marker(outs, inputs[0].device)


def _opaque_fwd_fake(inputs, handle, keep):
    dev = inputs[0].device
    return [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in _KERNELS[handle].out_specs(list(inputs))] + [
        torch.empty(0, device=dev)]


def _encode_meta(tensors) -> str:
    """"ndim,*shape,dtype code" per tensor, flattened and comma-joined.  A string, not an int
    list: Inductor's C++ wrapper cannot pass ``int[]`` arguments to a Python custom op
    ("arg type List[int] is not yet supported by custom_op_wrapper")."""
    out: list[int] = []
    for t in tensors:
        out += [t.dim(), *t.shape, _DTYPES.index(t.dtype)]
    return ",".join(map(str, out))


def _decode_meta(text: str) -> list[tuple[tuple[int, ...], torch.dtype]]:
    meta = [int(v) for v in text.split(",")] if text else []
    out, i = [], 0
    while i < len(meta):
        n = meta[i]
        out.append((tuple(meta[i + 1 : i + 1 + n]), _DTYPES[meta[i + 1 + n]]))
        i += n + 2
    return out


def _opaque_bwd(grads: list[torch.Tensor], handle: int, meta: str) -> list[torch.Tensor]:
    kernel = _KERNELS[handle]
    stack = _PENDING.get(handle)
    if not stack:
        raise RuntimeError(f"{kernel.name}: backward without a saved forward (was the forward run under no_grad, "
                           "or dropped by clear_pending()?)")
    ctx = stack.pop()
    out = kernel.backward(ctx, list(grads))
    shapes = _decode_meta(meta)
    if len(out) != len(shapes):
        raise RuntimeError(f"{kernel.name}: backward returned {len(out)} gradients, expected {len(shapes)}")
    res = []
    for i, (g, (shape, dtype)) in enumerate(zip(out, shapes)):
        res.append(torch.zeros(shape, dtype=dtype, device=grads[0].device) if g is None
                   else _conform(kernel, g, shape, dtype, f"gradient {i}"))
    res = _unalias(res, grads)
    return _with_marker(res, grads[0].device)


def _opaque_bwd_fake(grads, handle, meta):
    dev = grads[0].device
    return [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype in _decode_meta(meta)] + [
        torch.empty(0, device=dev)]


# The two ops are defined with torch.library's low-level API, not ``torch.library.custom_op``:
# custom_op's Python layers (its autograd wrapper, which runs even under no_grad inside compiled
# graphs, and the dispatch wrappers around the implementation) cost several times our own host
# time per call (benchmarks/bench_opaque.py measures it).  The autograd lives in
# _OpaqueCall instead, which Dynamo traces into the graph.
_LIB = torch.library.Library("speedrun", "FRAGMENT")
_LIB.define("opaque_fwd(Tensor[] inputs, int handle, bool keep) -> Tensor[]")
_LIB.define("opaque_bwd(Tensor[] grads, int handle, str meta) -> Tensor[]")
_LIB.impl("opaque_fwd", _opaque_fwd, "CompositeExplicitAutograd")
_LIB.impl("opaque_bwd", _opaque_bwd, "CompositeExplicitAutograd")
torch.library.register_fake("speedrun::opaque_fwd", _opaque_fwd_fake, lib=_LIB)
torch.library.register_fake("speedrun::opaque_bwd", _opaque_bwd_fake, lib=_LIB)


class _OpaqueCall(torch.autograd.Function):
    """Autograd of one opaque call: forward runs ``opaque_fwd``, backward ``opaque_bwd`` with the
    differentiable inputs' shapes and dtypes (the gradients' promised metadata)."""

    @staticmethod
    def forward(ctx, handle: int, keep: bool, *inputs):
        kernel = _KERNELS[handle]
        outs = torch.ops.speedrun.opaque_fwd(list(inputs), handle, keep)[:-1]
        ctx.handle = handle
        ctx.meta = _encode_meta([t for t, d in zip(inputs, kernel.diff) if d])
        ctx.out_specs = [(tuple(o.shape), o.dtype, o.device) for o in outs]
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        kernel = _KERNELS[ctx.handle]
        grads = [torch.zeros(shape, dtype=dtype, device=dev) if g is None else g.contiguous()
                 for g, (shape, dtype, dev) in zip(grads, ctx.out_specs)]
        diff_grads = iter(torch.ops.speedrun.opaque_bwd(grads, ctx.handle, ctx.meta)[:-1])
        return (None, None, *[next(diff_grads) if d else None for d in kernel.diff])
