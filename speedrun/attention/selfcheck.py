"""The self-check a fused attention backend passes before ``auto`` picks it: a tiny forward and
backward on the GPU against the reference backend."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


def check_against_reference(fn: Callable[..., torch.Tensor], device: torch.device, tol: float = 3e-2) -> str | None:
    """Forward + backward of ``fn`` on a tiny packed batch (D_qk 96 and 128, D_v 128, bf16, a
    window shorter than one document, an empty padding slot) on ``device``, against
    the reference backend in fp32; relative Frobenius error of the output and of dq, dk, dv must
    stay under ``tol``.  Returns a message naming what failed, or None."""
    from speedrun.attention.reference import reference_attention

    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)
    T, H, dv = 200, 2, 128
    cu = torch.tensor([0, 37, 150, 200, 200], dtype=torch.int32, device=dev)
    try:
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            for dqk in (96, 128):
                q, k = (torch.randn(T, H, dqk, generator=g).to(dev) for _ in range(2))
                v = torch.randn(T, H, dv, generator=g).to(dev)
                dy = torch.randn(T, H, dv, generator=g).to(dev)
                xs = [t.bfloat16().requires_grad_() for t in (q, k, v)]
                y = fn(*xs, cu, 128, window=48, scale=0.1)
                y.backward(dy.bfloat16())
                rs = [t.clone().requires_grad_() for t in (q, k, v)]
                ref = reference_attention(*rs, cu, 128, window=48, scale=0.1)
                ref.backward(dy)
                for name, a, b in (("out", y, ref), ("dq", xs[0].grad, rs[0].grad), ("dk", xs[1].grad, rs[1].grad),
                                   ("dv", xs[2].grad, rs[2].grad)):
                    err = ((a.float() - b).norm() / b.norm()).item()
                    if not err < tol:
                        return f"self-check failed: {name} at D_qk={dqk} differs from the reference (rel err {err:.1e})"
    except Exception as e:  # noqa: BLE001 - a backend that imports but fails is reported, not raised
        return f"self-check failed: {type(e).__name__}: {e}"[:300]
    return None
