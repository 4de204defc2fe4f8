"""The compiled-handle launch cache (speedrun.kernels.launch) with a stand-in Triton API.

The fast path needs a CUDA build of Triton; here a fake kernel and a fake ``CompiledKernel``
record what would be launched, and Triton's own argument specialisation
(``native_specialize_impl``, present in the CPU build) decides the keys.  The real kernels
through the real handle: ``tests/gpu/test_launch_gpu.py``.
"""

from __future__ import annotations

import types

import pytest
import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from speedrun.config import ConfigError
from speedrun.kernels import _triton as L


class FakeCompiled:
    def __init__(self):
        self.function, self.packed_metadata = "fn", "meta"
        self.runs = []

    def run(self, *a):
        self.runs.append(a)

    def launch_metadata(self, grid, stream, *args):
        return ("md", grid, stream, args)


class FakeKernel:
    """Parameters (x, n, BLOCK, FLAG=False) like a @triton.jit function's; ``[grid]`` launches
    plainly and returns one compiled object per specialisation, as JITFunction.run does."""

    __name__ = "fake_kernel"

    def __init__(self):
        def P(name, default=None, has=False, constexpr=False):
            return types.SimpleNamespace(name=name, default=default, has_default=has, is_constexpr=constexpr)
        self.params = [P("x"), P("n"), P("BLOCK", constexpr=True), P("FLAG", False, True, True)]
        self.plain = []
        self.compiled = {}

    def __getitem__(self, grid):
        def runner(*args, **meta):
            self.plain.append((grid, args, meta))
            key = tuple(native_specialize_impl(BaseBackend, a, False, True, True) for a in args)
            return self.compiled.setdefault(key, FakeCompiled())
        return runner


@pytest.fixture
def fake_api(monkeypatch):
    runtime = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    monkeypatch.setattr(L, "_API", (native_specialize_impl, BaseBackend, types.SimpleNamespace(runtime=runtime),
                                    FakeCompiled))
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 1234, raising=False)
    L.clear()
    L.set_enabled(True)
    yield runtime
    L.clear()
    L.set_enabled(True)


def test_second_launch_goes_through_the_compiled_handle(fake_api):
    k, x = FakeKernel(), torch.zeros(64)
    first = L.launch(k, (3,), x, 32, BLOCK=16, num_warps=4)
    assert len(k.plain) == 1 and first.runs == [] and L.cached_kernels() == 1
    second = L.launch(k, (5, 2), x, 48, BLOCK=16, num_warps=4)
    assert second is first and len(k.plain) == 1
    # grid padded to 3 dims, the stream, handles, no hooks, then every parameter in signature
    # order: positional, keyword, then the default of the one not passed
    assert first.runs == [(5, 2, 1, 1234, "fn", "meta", None, None, None, x, 48, 16, False)]
    assert L.stats() == {"cached": 1, "plain": 1, "uncacheable": 0}
    L.clear()
    assert L.stats() == {"cached": 0, "plain": 0, "uncacheable": 0} and L.cached_kernels() == 0


def test_a_new_specialisation_takes_the_plain_path_once(fake_api):
    k = FakeKernel()
    buf = torch.zeros(64)
    L.launch(k, (1,), buf, 32, BLOCK=16)
    L.launch(k, (1,), buf[1:], 32, BLOCK=16)  # 4-byte offset: not 16-byte aligned
    L.launch(k, (1,), buf, 1, BLOCK=16)  # the value 1 is specialised
    L.launch(k, (1,), buf, 33, BLOCK=16)  # not a multiple of 16
    L.launch(k, (1,), buf, 32, BLOCK=32)  # another constexpr
    L.launch(k, (1,), buf, 32, BLOCK=16, FLAG=True)
    L.launch(k, (1,), buf.double(), 32, BLOCK=16)  # another dtype
    assert len(k.plain) == 7 and L.cached_kernels() == 7
    L.launch(k, (1,), buf, 64, BLOCK=16)  # same specialisation as the first (64 % 16 == 0)
    L.launch(k, (1,), buf[4:], 17, BLOCK=16)  # aligned view, and 17 like 33
    assert len(k.plain) == 7
    L.launch(k, (1,), buf, 32, 16)  # BLOCK positionally: keyed by its value, not by 16's divisibility
    L.launch(k, (1,), buf, 32, 32)
    assert len(k.plain) == 9
    L.launch(k, (1,), buf, 48, 32)
    assert len(k.plain) == 9


def test_plain_path_when_disabled_or_grid_callable(fake_api):
    k, x = FakeKernel(), torch.zeros(16)
    L.launch(k, (1,), x, 16, BLOCK=16)
    L.set_enabled(False)
    L.launch(k, (1,), x, 16, BLOCK=16)
    L.set_enabled(True)
    L.launch(k, lambda meta: (1,), x, 16, BLOCK=16)
    assert len(k.plain) == 3
    L.launch(k, (1,), x, 16, BLOCK=16)
    assert len(k.plain) == 3 and L.stats()["cached"] == 1


def test_plain_path_while_dynamo_traces(fake_api, monkeypatch):
    k, x = FakeKernel(), torch.zeros(16)
    L.launch(k, (1,), x, 16, BLOCK=16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    L.launch(k, (1,), x, 16, BLOCK=16)
    assert len(k.plain) == 2 and L.stats()["cached"] == 0


def test_launch_hooks_are_passed_through_with_metadata(fake_api):
    """Registered launch hooks get what JITFunction.run gives them; empty chains are skipped."""
    k, x = FakeKernel(), torch.zeros(16)
    compiled = L.launch(k, (2,), x, 16, BLOCK=16)
    from triton.knobs import HookChain

    # Triton's defaults: empty chains, passed as None (no metadata)
    fake_api.launch_enter_hook, fake_api.launch_exit_hook = HookChain(), HookChain(reversed=True)
    L.launch(k, (2,), x, 16, BLOCK=16)
    enter, leave = HookChain(), HookChain(reversed=True)
    enter.add(lambda *a: None)
    leave.add(lambda *a: None)
    fake_api.launch_enter_hook, fake_api.launch_exit_hook = enter, leave
    L.launch(k, (2,), x, 16, BLOCK=16)
    assert len(k.plain) == 1
    md = ("md", (2,), 1234, (x, 16, 16, False))
    assert compiled.runs == [(2, 1, 1, 1234, "fn", "meta", None, None, None, x, 16, 16, False),
                             (2, 1, 1, 1234, "fn", "meta", md, enter, leave, x, 16, 16, False)]


def test_a_tensor_passed_by_keyword_is_not_cached(fake_api):
    k = FakeKernel()
    L.launch(k, (1,), torch.zeros(4), 4, BLOCK=torch.ones(1))
    assert L.cached_kernels() == 0 and L.stats()["uncacheable"] == 1


def test_plain_launches_context(fake_api):
    k, x = FakeKernel(), torch.zeros(16)
    L.launch(k, (1,), x, 16, BLOCK=16)
    with L.plain_launches():
        assert not L.enabled()
        L.launch(k, (1,), x, 16, BLOCK=16)
    assert L.enabled() and len(k.plain) == 2
    L.launch(k, (1,), x, 16, BLOCK=16)
    assert len(k.plain) == 2


def test_missing_parameter_is_a_clear_error(fake_api):
    with pytest.raises(TypeError, match="missing argument 'BLOCK'"):
        L.launch(FakeKernel(), (1,), torch.zeros(4), 4)


def test_interpreter_and_cpu_use_the_plain_launch():
    """Under TRITON_INTERPRET=1 (how the suite runs) the fast path is off: kernels launch as
    kernel[grid](...)."""
    L._API = None
    assert L._api() == () and L.off_reason() in ("TRITON_INTERPRET=1", "no CUDA device")
    k = FakeKernel()
    out = L.launch(k, (2,), torch.zeros(4), 4, BLOCK=4)
    assert len(k.plain) == 1 and isinstance(out, FakeCompiled) and L.cached_kernels() == 0
    L._API = None


def test_config_switch():
    from speedrun.config import preset
    from speedrun.train.builder import kernel_options

    cfg = preset("tiny")
    cfg.train.triton_launch = "plain"
    assert kernel_options(cfg).triton_launch == "plain"
    assert not L.enabled()
    cfg.train.triton_launch = "cached"
    kernel_options(cfg)
    assert L.enabled()
    cfg.train.triton_launch = "fast"
    with pytest.raises(ConfigError, match="train.triton_launch must be one of cached, plain"):
        kernel_options(cfg)
