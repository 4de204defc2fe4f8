"""The fa4 backend's calls into the real FlashAttention-4, compiled without a GPU: under a fake
tensor mode FA4 builds (CuTe DSL, just in time) each kernel our calls ask for and launches none,
so the arguments we pass and the Hopper (sm90) kernels for the record's and the candidate's head
widths (Q/K 128 or 96, V 128; causal and windowed; forward and backward) are checked on a CPU.

Runs only where ``flash-attn-4`` and the CuTe DSL are installed (``pip install -e ".[fa4]"``,
Python 3.12 for the DSL's libraries); skipped elsewhere (CI).  Each case runs in a fresh process:
FA4 fixes its target architecture from the environment at first use.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def _installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None and importlib.util.find_spec("cutlass") is not None
    except (ImportError, ValueError):
        return False


pytestmark = pytest.mark.skipif(not _installed(), reason="flash-attn-4 and the CuTe DSL are not installed")

PROGRAM = r"""
import json, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from speedrun.attention import fa4

dqk, window = int(sys.argv[1]), int(sys.argv[2])
T, H, dv = 3001, 6, 128
fa4._capturing = lambda t: False  # no CUDA runtime to ask (a fake tensor's device is cuda)
with FakeTensorMode(allow_non_fake_inputs=True):
    q, k = (torch.empty(T, H, dqk, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    v = torch.empty(T, H, dv, dtype=torch.bfloat16, device="cuda")
    cu = torch.empty(17, dtype=torch.int32, device="cuda")
    out, lse = fa4._fwd_impl(q, k, v, cu, 2048, window, 0.1)
    dq, dk, dv_ = fa4._bwd_impl(torch.empty_like(out), q, k, v, out, lse, cu, 2048, window, 0.1)
print(json.dumps({"out": list(out.shape), "out_dtype": str(out.dtype), "lse": list(lse.shape),
                  "lse_dtype": str(lse.dtype), "grads": [list(t.shape) for t in (dq, dk, dv_)],
                  "configs": sorted(str(c[:5]) for c in fa4._SEEN_CONFIGS)}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("dqk", [96, 128])
@pytest.mark.parametrize("window", [-1, 640])
def test_fa4_builds_the_sm90_kernels_our_calls_ask_for(dqk, window):
    env = dict(os.environ, FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
    run = subprocess.run([sys.executable, "-c", PROGRAM, str(dqk), str(window)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    # the shapes the ops' fake functions promise (speedrun.attention.fa4._fwd_fake / _bwd_fake)
    assert got["out"] == [3001, 6, 128] and got["out_dtype"] == "torch.bfloat16"
    assert got["lse"] == [6, 3001] and got["lse_dtype"] == "torch.float32"
    assert got["grads"] == [[3001, 6, dqk], [3001, 6, dqk], [3001, 6, 128]]
    assert len(got["configs"]) == 2  # one forward and one backward configuration noted
