"""Launch our Triton kernels through their compiled handle once they are compiled.

``kernel[grid](*args, **meta)`` (``JITFunction.run``) binds every argument by name, specialises
each one, builds a cache key, asks the driver for the current device and stream, then launches.
On the H200 that costs 19.5 us for a one-pointer kernel and 42 us with the ~30 constexpr keyword
arguments our GEMM and quantise kernels pass; the launch through the ``CompiledKernel`` that the
first call returned takes 8.5-10.5 us (``benchmarks/bench_host.py``, ninth device session).  The
compiled network calls our kernels from Python at run time (each opaque op's body), about 44
launches per micro-batch for the record and 136 for the candidate, so this is host time the GPU
waits for wherever a step is host-bound.

:func:`launch` keeps, per kernel and argument specialisation, the ``CompiledKernel`` and the
trailing constexpr/default values in signature order, and launches through its ``run``.  The key
is Triton's own specialisation of each positional argument (``native_specialize_impl``: dtype,
16-byte alignment of pointers, integer width, divisibility by 16 and the value 1, descriptor block
types) with specialisation and alignment always on, the value of constexprs passed positionally,
the keyword values and the device: a superset of what Triton keys its cache on, so a key never
maps to a kernel compiled for other arguments.

Registered Triton launch hooks are called as ``JITFunction.run`` calls them.  (Triton 3.6 installs
empty ``HookChain``s as its default hooks; the ninth device session's first version took them for
registered hooks, fell back to the plain path and so never took the fast path.)  The plain path
(``kernel[grid](...)``) is taken for a callable grid, while Dynamo traces (it traces
``kernel[grid]`` itself), in the CPU interpreter, with another Triton version than the one this
was written against (3.6), and whenever :func:`set_enabled` turned the cache off
(``train.triton_launch=plain``).  Importing needs no GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["launch", "set_enabled", "enabled", "plain_launches", "clear", "cached_kernels", "stats", "off_reason"]

_ENABLED = True
_CACHE: dict[tuple, tuple[Any, tuple]] = {}
_CONSTEXPR_POS: dict[Any, frozenset] = {}  # kernel -> indices of its constexpr parameters
_STATS = {"cached": 0, "plain": 0, "uncacheable": 0}  # launches per path since the last clear()
_OFF_REASON = ""  # why _api() found the fast path unusable
_API: tuple | None = None  # (native_specialize_impl, backend class, knobs, CompiledKernel) or () if unusable


def set_enabled(on: bool) -> None:
    """Use the compiled-handle launch (True, the default) or always ``kernel[grid](...)``."""
    global _ENABLED
    _ENABLED = bool(on)


def enabled() -> bool:
    return _ENABLED


@contextlib.contextmanager
def plain_launches() -> Iterator[None]:
    """Inside: every launch through ``kernel[grid](...)`` (``JITFunction.run``), e.g. where a tool
    counts launches there; the previous setting is restored after."""
    was = _ENABLED
    set_enabled(False)
    try:
        yield
    finally:
        set_enabled(was)


def clear() -> None:
    """Forget every cached handle (the next launch of each kernel takes the plain path once) and
    zero :func:`stats`."""
    _CACHE.clear()
    _STATS.update(cached=0, plain=0, uncacheable=0)


def stats() -> dict[str, int]:
    """Launches through the compiled handle ("cached") and through ``kernel[grid]`` ("plain"), and
    plain launches not cached (no ``CompiledKernel`` came back, or a tensor was passed by keyword:
    "uncacheable")."""
    return dict(_STATS)


def off_reason() -> str:
    """Why the compiled-handle path is unavailable in this process ("" when it is available)."""
    _api()
    return _OFF_REASON


def cached_kernels() -> int:
    """How many (kernel, specialisation) handles are cached."""
    return len(_CACHE)


def _api() -> tuple:
    """Triton internals the fast path needs, or () where they are not the ones it was written for."""
    global _API, _OFF_REASON
    if _API is None:
        _API = ()
        try:
            import triton
            from triton import knobs
            from triton.backends.compiler import BaseBackend
            from triton.compiler.compiler import CompiledKernel
            from triton.runtime.jit import native_specialize_impl

            from speedrun.kernels.fp8_cache import interpreting

            if not triton.__version__.startswith("3.6"):
                _OFF_REASON = f"Triton {triton.__version__} (written against 3.6)"
            elif interpreting():
                _OFF_REASON = "TRITON_INTERPRET=1"
            elif not torch.cuda.is_available():
                _OFF_REASON = "no CUDA device"
            else:
                _API = (native_specialize_impl, BaseBackend, knobs, CompiledKernel)
        except ImportError as e:
            _OFF_REASON = f"import failed: {e}"
    return _API


def _constexpr_positions(kernel) -> frozenset:
    pos = _CONSTEXPR_POS.get(kernel)
    if pos is None:
        pos = _CONSTEXPR_POS[kernel] = frozenset(i for i, p in enumerate(kernel.params) if p.is_constexpr)
    return pos


def _key(api: tuple, kernel, args: tuple, meta: dict, device: int) -> tuple:
    """Constexpr parameters passed positionally key by value; the others by Triton's
    specialisation of the value."""
    spec, backend = api[0], api[1]
    cpos = _constexpr_positions(kernel)
    specs = tuple([a if i in cpos else spec(backend, a, False, True, True) for i, a in enumerate(args)])
    return (kernel, device, specs, tuple(meta.items()))


def _tail(kernel, n_args: int, meta: dict) -> tuple:
    """The values of the parameters after the positional ones, in signature order (keyword value,
    else the default), as ``JITFunction.run`` passes them to the compiled launcher."""
    out = []
    for p in kernel.params[n_args:]:
        if p.name in meta:
            out.append(meta[p.name])
        elif p.has_default:
            out.append(p.default)
        else:
            raise TypeError(f"{kernel.__name__}: missing argument {p.name!r}")
    return tuple(out)


def _live_hook(hook):
    """``hook``, or None when it is None or an empty ``HookChain`` (nothing registered)."""
    if hook is None or not getattr(hook, "calls", True):
        return None
    return hook


def launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)``, through the cached compiled handle after the first launch
    of this specialisation.  ``grid``: a tuple of 1-3 ints; ``args``: the kernel's leading
    parameters in order; ``meta``: the rest by name (constexprs) and launch options
    (``num_warps``, ``num_stages``), passed the same way at every call of a site."""
    api = _api() if _ENABLED else ()
    # under Dynamo: the form it traces as a user-defined Triton kernel (our handle would be a
    # graph break at native_specialize_impl, seen on the H200)
    if not api or callable(grid) or torch.compiler.is_compiling():
        _STATS["plain"] += 1
        return kernel[grid](*args, **meta)
    device = torch._C._cuda_getDevice()
    key = _key(api, kernel, args, meta, device)
    hit = _CACHE.get(key)
    if hit is None:
        _STATS["plain"] += 1
        compiled = kernel[grid](*args, **meta)
        # a tensor passed by keyword would be keyed (and kept alive) by identity: never cached
        if isinstance(compiled, api[3]) and not any(isinstance(v, torch.Tensor) for v in meta.values()):
            _CACHE[key] = (compiled, _tail(kernel, len(args), meta))
        else:
            _STATS["uncacheable"] += 1
        return compiled
    compiled, tail = hit
    _STATS["cached"] += 1
    stream = torch._C._cuda_getCurrentRawStream(device)
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    # registered launch hooks get what JITFunction.run gives them; Triton 3.6's default hooks are
    # empty HookChains, passed as None (no call, no launch metadata)
    runtime = api[2].runtime
    enter, leave = _live_hook(runtime.launch_enter_hook), _live_hook(runtime.launch_exit_hook)
    md = compiled.launch_metadata(grid, stream, *args, *tail) if enter is not None else None
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, md, enter, leave, *args, *tail)
    return compiled
