"""The kernels' helper layer: host-side Triton helpers every kernel module shares.

- :func:`interpreting` (whether Triton runs kernels in its CPU interpreter, from this module's own
  probe kernel), :func:`triton_usable`, :func:`cdiv`, :func:`next_pow2`, :func:`sm_count`: grid
  arithmetic and device facts for launchers that run per call.
- :func:`launch`: our kernels' launch path (below).

Imports nothing of ours and needs neither a GPU nor Triton to import (Triton is imported on first
use), so modules with a PyTorch fallback import it on machines without Triton.

Launching: once compiled, our Triton kernels are launched through their compiled handle.

``kernel[grid](*args, **meta)`` (``JITFunction.run``) binds every argument by name, specialises
each one, builds a cache key, asks the driver for the current device and stream, then launches.
That costs several times what a launch through the ``CompiledKernel`` the first call returned
costs (``benchmarks/bench_host.py`` measures both), and the compiled network calls our kernels
from Python at run time (each opaque op's body) dozens of times per micro-batch, so this is host
time the GPU waits for wherever a step is host-bound.

:func:`launch` keeps, per kernel and argument specialisation, the ``CompiledKernel`` and the
trailing constexpr/default values in signature order, and launches through its ``run``.  The key
is Triton's own specialisation of each positional argument (``native_specialize_impl``: dtype,
16-byte alignment of pointers, integer width, divisibility by 16 and the value 1, descriptor block
types) with specialisation and alignment always on, the value of constexprs passed positionally,
the keyword values and the device: a superset of what Triton keys its cache on, so a key never
maps to a kernel compiled for other arguments.

Registered Triton launch hooks are called as ``JITFunction.run`` calls them.  (Triton 3.6 installs
empty ``HookChain``s as its default hooks; taking those for registered hooks would send every
launch down the plain path.)  The plain path
(``kernel[grid](...)``) is taken for a callable grid, while Dynamo traces (it traces
``kernel[grid]`` itself), in the CPU interpreter, with another Triton version than the one this
was written against (3.6), and whenever :func:`set_enabled` turned the cache off
(``train.triton_launch=plain``).  Importing needs no GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["interpreting", "triton_usable", "cdiv", "next_pow2", "sm_count",
           "launch", "set_enabled", "enabled", "plain_launches", "clear", "cached_kernels", "stats", "off_reason"]

import functools

_INTERPRETED: bool | None = None  # the probe's answer (see interpreting()), asked once


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1`` when
    ``triton.jit`` decorated them; Triton decides at decoration).  Answered once, from a probe
    kernel decorated here on the first call, as launchers ask per launch; False without Triton."""
    global _INTERPRETED
    if _INTERPRETED is None:
        try:
            import triton
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:
            _INTERPRETED = False
        else:
            @triton.jit
            def _probe(x_ptr):
                pass

            _INTERPRETED = isinstance(_probe, InterpretedFunction)
    return _INTERPRETED


def triton_usable(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can run on ``t``'s device here (CUDA, or CPU under the interpreter)."""
    return t.is_cuda or (t.device.type == "cpu" and interpreting())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host code (``triton.cdiv`` is a constexpr function, slow to call from
    Python; our launchers compute grids per launch)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1); ``triton.next_power_of_2`` for host code."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device, asked once per device (the kernel launchers
    that size persistent grids by it run hundreds of times a step)."""
    return _sm_count_of(device.index if device.index is not None else torch.cuda.current_device())


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
