"""Shared fixtures.

Environment variables (set by .ci/run; tests that need them skip cleanly without):
  SPEEDRUN_TEST_DATA      folder with decompressed webmix shards (webmix_{train,val}_000000.bin)
  SPEEDRUN_TOKENIZER_DIR  folder with GPT-2 encoder.json and vocab.bpe
  SPEEDRUN_UPSTREAM_LOGS  folder with real upstream speedrun logs (shared/upstream-logs)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter (must be set before any kernel module
# is imported, since @triton.jit reads it at decoration time).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's ``-n auto``: one worker per core) each worker computes on one
# intra-op thread, and so do the trainings it starts as subprocesses: more threads than cores fight
# each other (a test that wants a thread count sets it itself, as ``one_thread`` does).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


def _env_dir(name: str) -> Path | None:
    value = os.environ.get(name)
    if value and Path(value).is_dir():
        return Path(value)
    return None


@pytest.fixture
def webmix_dir() -> Path:
    d = _env_dir("SPEEDRUN_TEST_DATA")
    if d is None or not list(d.glob("webmix_*.bin")):
        pytest.skip("SPEEDRUN_TEST_DATA not set to a folder with webmix shards")
    return d


@pytest.fixture
def gpt2_dir() -> Path:
    d = _env_dir("SPEEDRUN_TOKENIZER_DIR")
    if d is None or not (d / "encoder.json").exists():
        pytest.skip("SPEEDRUN_TOKENIZER_DIR not set to a folder with encoder.json and vocab.bpe")
    return d


@pytest.fixture
def upstream_logs_dir() -> Path:
    d = _env_dir("SPEEDRUN_UPSTREAM_LOGS")
    if d is None:
        pytest.skip("SPEEDRUN_UPSTREAM_LOGS not set")
    return d


@pytest.fixture(scope="session")
def builtin_cache(tmp_path_factory) -> Path:
    """One cache folder for the built-in corpus shards, shared by the whole test session."""
    env = os.environ.get("SPEEDRUN_CACHE_DIR")
    return Path(env) if env else tmp_path_factory.mktemp("speedrun-cache")


@pytest.fixture
def use_builtin_cache(builtin_cache, monkeypatch):
    """Point SPEEDRUN_CACHE_DIR at the session's built-in corpus cache (built once per session)."""
    monkeypatch.setenv("SPEEDRUN_CACHE_DIR", str(builtin_cache))


@pytest.fixture
def kernels_use_references(monkeypatch):
    """Off-GPU kernel dispatch as without ``TRITON_INTERPRET``: every fused kernel runs its PyTorch
    reference (same signatures, same FP8 scale bookkeeping), for tests of the training logic that
    the interpreter would make slow.  Triton's own mode is left alone (it is fixed at import)."""
    import importlib

    # Import every module before patching any: a module first imported after fp8_cache is patched
    # would bind the patched function by name, and the undo would restore that.  ``_triton`` too:
    # its ``triton_usable`` (the launchers' "run the kernel here?" test) asks its own
    # ``interpreting``, and patching only the launchers' copies left the interpreter running.
    modules = [importlib.import_module(f"speedrun.kernels.{name}")
               for name in ("_triton", "fp8_cache", "mlp", "qk_prep", "qkv_pack", "cross_entropy")]
    # the optimizer's kernels are not patched (their tests choose Triton themselves), but they bind
    # ``launch`` by name too: imported first here, they never bind the patched one
    for name in ("polar_express", "fused_adam", "row_accumulate"):
        importlib.import_module(f"speedrun.kernels.{name}")
    for module in modules:
        monkeypatch.setattr(module, "interpreting", lambda: False)

    def no_launch(kernel, *args, **kwargs):  # the contract, enforced: no fused kernel reaches Triton
        raise AssertionError(f"kernels_use_references: {getattr(kernel, '__name__', kernel)} was launched "
                             "through Triton instead of running its PyTorch reference")

    for module in modules:
        monkeypatch.setattr(module, "launch", no_launch, raising=False)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine two threads fight other processes (10x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _seed_everything():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    gpu_dir = Path(__file__).parent / "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if gpu_dir in Path(item.fspath).parents:
            item.add_marker(pytest.mark.gpu)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
