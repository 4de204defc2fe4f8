"""The host-side probes on a CUDA GPU: phase events tell a host-bound phase (the GPU reaches its
end right after the host) from a GPU-bound one, torch's sync debug mode finds blocking calls, and
the training loss head issues a whole forward + backward without synchronising (it once made a
blocking copy of its MTP weights per micro-batch)."""

from __future__ import annotations

import time

import pytest
import torch

from speedrun.evidence.host import find_syncs, trace_step
from speedrun.kernels.cross_entropy import fused_softcapped_ce
from speedrun.kernels.fp8_ops import fp8_supported

pytestmark = pytest.mark.gpu

DEV = torch.device("cuda")


def test_leads_tell_host_bound_from_gpu_bound_phases():
    x = torch.ones(1024, device=DEV)

    def step(on_phase):
        on_phase("start")
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU work, issued at once
        on_phase("gpu_heavy")
        time.sleep(0.2)  # the host busy while the GPU finishes and idles
        x.mul_(1.0)
        on_phase("host_heavy")

    step(lambda name: None)  # first launches load their kernels
    t = trace_step(step, DEV).phases
    heavy, idle = t["gpu_heavy"], t["host_heavy"]
    assert heavy.host_ms < 5.0 and heavy.gpu_ms > 10.0 and heavy.lead_min_ms > 10.0
    assert idle.host_ms > 190.0 and idle.lead_min_ms < 2.0  # the GPU reached the end right after the host


def test_sync_scan_names_blocking_calls():
    x = torch.ones(16, device=DEV)

    def run():
        x.sum().item()
        torch.tensor([1.0, 0.5], device=DEV)  # a blocking host-to-device copy

    found = find_syncs(run, DEV)
    assert sum(e["count"] for e in found) >= 2, found
    assert all("test_host_gpu.py" in e["site"] for e in found), found
    assert find_syncs(lambda: x.mul_(2.0), DEV) == []
    assert torch.cuda.get_sync_debug_mode() == 0  # restored


@pytest.mark.parametrize("use_fp8", [False, True])
def test_training_head_does_not_synchronise(use_fp8):
    if use_fp8 and not fp8_supported(DEV):
        pytest.skip("needs FP8 tensor cores (sm89+)")
    n, d, v = 2048, 768, 50304
    g = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(n, d, device=DEV, generator=g) * 0.5).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(d, v, device=DEV, generator=g) * 0.02).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 50257, (n,), device=DEV, generator=g)
    prefix = torch.randint(0, 50257, (n,), device=DEV, generator=g)

    def step(mtp):
        losses = fused_softcapped_ce(x, w, targets, mtp, prefix, 0.25, use_fp8=use_fp8, vocab_size=None)
        (losses.sum() / n).backward()

    step((1.0, 0.5, 0.25))  # first call: Triton compiles; caches fill
    for weights in ((1.0, 0.5, 0.25), (1.0, 0.45, 0.2)):  # a repeated and a new (ramped) tuple
        found = find_syncs(lambda: step(weights), DEV)
        assert found == [], found
