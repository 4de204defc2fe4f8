"""Floors of one attention layer's projection path and one MLP, baseline vs candidate, from shapes.

For each kernel of the forward and backward pass: the fewest bytes it must move through HBM (each
input read once, each output written once) and its FLOPs; its floor is the larger of
FLOPs / matmul rate and bytes / copy bandwidth.  Rates default to the H200 ceilings measured with
``benchmarks/`` (see the defaults of the command line; docs/status.md).

Scope: the part of the attention layer the candidate changes (QKV projection, QK-norm + RoPE +
key offset + layout, and the attention kernel's Q/K inputs) and the ReLU^2 MLP.  The attention
kernel itself and the O projection are identical in both arms except for reading 96- instead of
128-wide Q/K (or zero-padded 128 with backends that need one width).

Usage: python benchmarks/byte_floor.py [--tokens 49152] [--bf16-tflops 785] [--fp8-tflops 1263] [--tbps 4.2]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass
class Kernel:
    name: str
    bytes: float
    flops: float = 0.0
    fp8: bool = False

    def floor_us(self, bf16: float, fp8: float, tbps: float) -> float:
        rate = (fp8 if self.fp8 else bf16) * 1e12
        return max(self.flops / rate, self.bytes / (tbps * 1e12)) * 1e6


def gemm(name, m, n, k, a_bytes, b_bytes, out_bytes, fp8=False) -> Kernel:
    """out (m, n) = a (m, k) @ b (k, n) with the given bytes per element."""
    return Kernel(name, m * k * a_bytes + k * n * b_bytes + m * n * out_bytes, 2.0 * m * n * k, fp8)


def attention_projection(T: int, D: int, H: int, dqk: int, dv: int, fp8: bool, pad_to: int | None) -> list[Kernel]:
    """QKV projection + QK-prep (+ reading Q/K in attention), forward and backward, per layer."""
    N = H * (2 * dqk + dv)
    w = 1 if fp8 else 2  # bytes per operand element of the GEMMs
    qk_out = pad_to or dqk  # width of the q/k the attention kernel reads
    ks = []
    if fp8:
        ks.append(Kernel("quantise x -> e4m3 (amax pass + cast)", T * D * 2 * 2 + T * D * 1))
    ks.append(gemm("QKV GEMM forward", T, N, D, w, w, 2, fp8))
    ks.append(Kernel("QK-prep forward: read qkv, write q, k, v", T * N * 2 + T * H * (2 * qk_out + dv) * 2))
    ks.append(Kernel("attention reads q, k (fwd + bwd)", 2 * 2 * T * H * qk_out * 2))
    ks.append(Kernel("QK-prep backward: read dq, dk, dv, qkv; write dqkv", T * H * (2 * qk_out + dv) * 2 + 2 * T * N * 2))
    if fp8:
        ks.append(Kernel("quantise dqkv -> e5m2", T * N * 2 + T * N * 1))
    ks.append(gemm("dX GEMM (dqkv @ W)", T, D, N, w, w, 2, fp8))
    ks.append(gemm("dW GEMM (dqkv^T @ x)", N, D, T, 2, 2, 4))  # bf16 dW (dw_fp8=False), fp32 out
    return ks


def mlp(T: int, D: int, Hd: int, mode: str) -> list[Kernel]:
    """ReLU^2 MLP forward and backward, per layer, for 'bf16', 'fp8_fwd' and 'fp8_full'."""
    f = mode != "bf16"
    full = mode == "fp8_full"
    ks = []
    if f:
        ks.append(Kernel("quantise x -> e4m3", T * D * 2 * 2 + T * D * (2 if full else 1)))
    ks.append(gemm("up GEMM + ReLU^2 (writes post)", T, Hd, D, 1 if f else 2, 1 if f else 2,
                   (2 if full else 3) if f else 2, f))  # fp8_full: e4m3 post in both layouts only; fp8_fwd: bf16 post + e4m3
    ks.append(gemm("down GEMM", T, D, Hd, 1 if f else 2, 1 if f else 2, 2, f))
    if full:
        ks.append(Kernel("quantise g -> e5m2 (both layouts)", T * D * 2 * 2 + 2 * T * D))
    gb = 1 if full else 2
    ks.append(gemm("dW2 GEMM (g^T @ post)", D, Hd, T, gb, gb, 4, full))
    ks.append(Kernel("dpre epilogue reads post", T * Hd * gb))
    ks.append(gemm("dpost GEMM + dpre epilogue", T, Hd, D, gb, gb, (2 * 1) if full else 2, full))
    ks.append(gemm("dW1 GEMM (dpre^T @ x)", Hd, D, T, gb, gb, 4, full))
    ks.append(gemm("dx GEMM (dpre @ W1)", T, D, Hd, gb, gb, 2, full))
    return ks


def report(title: str, ks: list[Kernel], bf16: float, fp8: float, tbps: float) -> float:
    print(f"\n{title}")
    print(f"  {'kernel':55s} {'MB':>9s} {'GFLOP':>9s} {'floor us':>9s}")
    total = 0.0
    for k in ks:
        us = k.floor_us(bf16, fp8, tbps)
        total += us
        print(f"  {k.name:55s} {k.bytes / 1e6:9.1f} {k.flops / 1e9:9.1f} {us:9.1f}")
    mb = sum(k.bytes for k in ks) / 1e6
    print(f"  {'total':55s} {mb:9.1f} {sum(k.flops for k in ks) / 1e9:9.1f} {total:9.1f}")
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=49152)
    ap.add_argument("--bf16-tflops", type=float, default=785.0)
    ap.add_argument("--fp8-tflops", type=float, default=1263.0)
    ap.add_argument("--tbps", type=float, default=4.2)
    a = ap.parse_args()
    T, D, H = a.tokens, 768, 6
    rates = (a.bf16_tflops, a.fp8_tflops, a.tbps)
    base = report("baseline attention projection path (bf16, Q/K 128)", attention_projection(T, D, H, 128, 128, False, None), *rates)
    cand = report("candidate (FP8 packed GEMM, Q/K 96, padded to 128 for the attention kernel)",
                  attention_projection(T, D, H, 96, 128, True, 128), *rates)
    cand_np = report("candidate with a backend taking 96-wide Q/K (no padding)",
                     attention_projection(T, D, H, 96, 128, True, None), *rates)
    print(f"\nper attention layer: baseline {base:.0f} us, candidate {cand:.0f} us (padded) / {cand_np:.0f} us; "
          f"x10 layers x 8 micro-batches per step: {10 * 8 * (base - cand) / 1000:.2f} ms saved per step at the floor")
    m = {mode: report(f"MLP ({mode})", mlp(T, D, 4 * D, mode), *rates) for mode in ("bf16", "fp8_fwd", "fp8_full")}
    print(f"\nper MLP: bf16 {m['bf16']:.0f} us, fp8_fwd {m['fp8_fwd']:.0f} us, fp8_full {m['fp8_full']:.0f} us; "
          f"fp8_full vs fp8_fwd x11 layers x 8 micro-batches: {11 * 8 * (m['fp8_fwd'] - m['fp8_full']) / 1000:.2f} ms per step")


if __name__ == "__main__":
    main()
