"""tools/launch_inventory.py on the CPU (Triton interpreter), at toy size: it finds every
opaque call of the candidate's switches, counts the fused QK-prep as one launch and no eager op
per call, counts the FP8 GEMM as one launch, and restores everything it patched."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from speedrun.kernels.fp8_cache import interpreting

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "launch_inventory.py"


@pytest.fixture(scope="module")
def inventory_module():
    spec = importlib.util.spec_from_file_location("launch_inventory", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (set by conftest without a GPU)")
def test_candidate_switches_are_inventoried_and_patches_undone(inventory_module):
    import triton.runtime.jit as jit

    from speedrun.kernels import fp8_ops, qkv_pack
    from speedrun.kernels.opaque import _KERNELS

    before = (jit.JITFunction.run, fp8_ops.scaled_mm, getattr(qkv_pack, "scaled_mm", None))
    r = inventory_module.inventory("tiny-record", 32, torch.device("cpu"),
                                   ["model.kernels=fp8_full", "model.qkv_path=fused_fp8"])
    rows = {(row["kernel"], row["phase"]): row for row in r["rows"]}
    prep = [row for (name, _), row in rows.items() if name.startswith("qk_prep")]
    packed = [row for (name, _), row in rows.items() if name.startswith("packed_qkv_fp8")]
    mlp = [row for (name, _), row in rows.items() if name.startswith("relu2_mlp")]
    assert prep and packed and mlp
    assert all(row["calls"] == 1 and row["triton"] == 1 and row["eager"] == 0 for row in prep), prep
    assert all(row["triton"] >= 1 for row in packed)
    fwd = [row for row in packed if row["phase"] == "forward"]
    assert all(row["detail"].get("eager:_scaled_mm") == 1 and "eager:mm" not in row["detail"] for row in fwd), fwd
    assert r["host_ms_low"] > 0 and r["host_ms_high"] >= r["host_ms_low"]
    after = (jit.JITFunction.run, fp8_ops.scaled_mm, getattr(qkv_pack, "scaled_mm", None))
    assert before == after
    assert not any(getattr(getattr(k, "forward"), "__name__", "") == "wrapped" for k in _KERNELS)
