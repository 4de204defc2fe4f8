"""Benchmark the ReLU² MLP kernels and the FP8 weight cache on one CUDA GPU.

Prints a table and writes ``$OUT/bench_mlp.json`` (``OUT`` defaults to ``./bench_out``):

* ceilings measured in the same run: bf16 ``torch.matmul`` and FP8 ``torch._scaled_mm`` at
  8192³ (TFLOP/s), and a device-to-device copy (TB/s, read + write bytes);
* every GEMM of the MLP per mode (bf16 / fp8_fwd / fp8_full) at T x D x H (median ms via
  ``triton.testing.do_bench``, TFLOP/s), plus the quantise kernels (TB/s vs the copy);
* the cost of emitting the transposed FP8 layouts (epilogue with vs without the (N, M) store),
  and, per weight-gradient GEMM, bf16 time vs FP8 time + transposes (the keep-bf16 test);
* the whole MLP forward+backward per mode, and a plain torch bf16 autograd MLP;
* the FP8 weight-cache refresh of an (L, 3072, 768) W1 and W2 bank (one read, two layouts);
* the fused ReLU² GEMM against the split path (cuBLAS GEMM + epilogue pass), per call and for
  the whole FP8 MLP, in interleaved rounds (``split_vs_fused`` in the JSON).

Usage: ``python benchmarks/bench_mlp.py [--tokens 49152] [--dim 768] [--hidden 3072] [--layers 11] [--sweep]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import torch


def _bench(fn, rep_ms=200):
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def _host_ms(fn) -> float:
    """Milliseconds of host time per ``fn()`` call, timed while the GPU spins (bench_host.host_us)."""
    from bench_host import host_us  # a sibling script: benchmarks/ is on sys.path when run

    return host_us(fn)[0] / 1e3


def _tflops(flop, ms):
    return flop / (ms * 1e-3) / 1e12


def ceilings(dev):
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = _bench(lambda: a @ b)
    out = {"bf16_matmul_8192_tflops": _tflops(2 * n**3, ms)}
    a8 = a.to(torch.float8_e4m3fn)
    b8 = b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=dev)
    for fast in (True, False):
        ms = _bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast))
        out[f"fp8_scaled_mm_8192_tflops{'_fast_accum' if fast else ''}"] = _tflops(2 * n**3, ms)
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    out["copy_tbps"] = 2 * src.numel() / (ms * 1e-3) / 1e12
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=49152)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--layers", type=int, default=11)
    p.add_argument("--sweep", action="store_true", help="also time alternative Triton block configurations")
    p.add_argument("--sweep-filter", metavar="REGEX", default="",
                   help="with --sweep: only the GEMMs whose 'KIND WHAT ROUTE' matches (e.g. 'fp8 dpre.*tma-epilogue'), "
                        "and no quantise or abs_max sweep unless it matches 'quant' or 'amax'")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_mlp: needs a CUDA GPU", file=sys.stderr)
        return 2
    from speedrun.kernels import mlp as M
    from speedrun.kernels.fp8_cache import E4M3, E5M2, FP8WeightCache, end_fp8_step, quantize_current, quantize_dual_layout

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda"
    T, D, H = args.tokens, args.dim, args.hidden
    torch.manual_seed(0)
    x = torch.randn(T, D, device=dev).bfloat16()
    w1 = (torch.randn(H, D, device=dev) / D**0.5).bfloat16()
    w2 = (torch.randn(D, H, device=dev) / H**0.5).bfloat16()
    g = torch.randn(T, D, device=dev).bfloat16()
    gemm_flop = 2 * T * D * H
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"T": T, "D": D, "H": H},
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "gemm_configs": {k: list(v) for k, v in M.GPU_CONFIGS.items()},
        "tma_configs": {k: list(v) for k, v in M.TMA_CONFIGS.items()} if M.USE_TMA else None,
    }
    res["ceilings"] = ceilings(dev)
    copy_tbps = res["ceilings"]["copy_tbps"]
    rows = []

    def rec(group, name, fn, flop=None, nbytes=None):
        ms = _bench(fn)
        row = {"group": group, "name": name, "ms": ms}
        if flop:
            row["tflops"] = _tflops(flop, ms)
        if nbytes:
            row["tbps"] = nbytes / (ms * 1e-3) / 1e12
            row["frac_of_copy"] = row["tbps"] / copy_tbps
        rows.append(row)
        return ms

    # ---- bf16 GEMMs
    post = M.relu2_gemm(x, w1).out
    dpre = M.relu2_gemm(g, w2.t(), aux=post).out
    rec("bf16", "up: torch x@w1^T (no epilogue)", lambda: x @ w1.t(), gemm_flop)
    rec("bf16", "up: triton relu2 fwd", lambda: M.relu2_gemm(x, w1), gemm_flop)
    rec("bf16", "down: post@w2^T", lambda: post @ w2.t(), gemm_flop)
    rec("bf16", "dpre: torch g@w2 (no epilogue)", lambda: g @ w2, gemm_flop)
    rec("bf16", "dpre: triton (g@w2)*2sqrt(post)", lambda: M.relu2_gemm(g, w2.t(), aux=post), gemm_flop)
    t_dw2_bf16 = rec("bf16", "dW2: g^T@post", lambda: g.t() @ post, gemm_flop)
    t_dw1_bf16 = rec("bf16", "dW1: dpre^T@x", lambda: dpre.t() @ x, gemm_flop)
    rec("bf16", "dx: dpre@w1", lambda: dpre @ w1, gemm_flop)

    # ---- FP8 pieces
    xq, xqt, xs = quantize_current(x)
    w1q, w1qt, w1s = quantize_current(w1)
    w2q, w2qt, w2s = quantize_current(w2)
    ps = post.float().amax() * 1.8 / 448
    amax = torch.zeros((), device=dev)
    r = M.relu2_gemm(xq, w1q, a_scale=xs, b_scale=w1s, store_out=False, q_dtype=E4M3, q_scale=ps, emit_transposed=True, amax=amax)
    pq, pqt = r.q, r.qt
    gq, gqt, gs = quantize_current(g, fp8_dtype=E5M2)
    ds = dpre.float().abs().amax() * 2 / 57344
    r = M.relu2_gemm(gq, w2qt, aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, store_out=False, q_dtype=E5M2, q_scale=ds, emit_transposed=True, amax=amax)
    dq, dqt = r.q, r.qt
    act_bytes = T * D * (2 + 1 + 1)
    rec("fp8", "quantize x e4m3 row-major only (amax + kernel)", lambda: quantize_current(x, transposed=False), nbytes=T * D * 3)
    rec("fp8", "quantize x e4m3 both layouts (amax + kernel)", lambda: quantize_current(x), nbytes=act_bytes)
    rows.append({"group": "host", "name": "host ms/call (GPU kept busy): quantize_current x both",
                 "ms": _host_ms(lambda: quantize_current(x))})
    rec("fp8", "quantize g e5m2 both layouts (amax + kernel)", lambda: quantize_current(g, fp8_dtype=E5M2), nbytes=act_bytes)
    rec("fp8", "quantize kernel alone, x both layouts", lambda: quantize_dual_layout(x, xs), nbytes=act_bytes)
    from speedrun.kernels.fp8_cache import abs_max, abs_max_reference

    rec("fp8", "amax of x: torch linalg.vector_norm(inf)", lambda: abs_max_reference(x), nbytes=T * D * 2)
    rec("fp8", "amax of x: triton abs_max", lambda: abs_max(x), nbytes=T * D * 2)
    rec("fp8", "up fp8: bf16 post + e4m3 post (fp8_fwd)",
        lambda: M.relu2_gemm(xq, w1q, a_scale=xs, b_scale=w1s, q_dtype=E4M3, q_scale=ps, amax=amax), gemm_flop)
    t_up_q = rec("fp8", "up fp8: e4m3 post row-major only",
                 lambda: M.relu2_gemm(xq, w1q, a_scale=xs, b_scale=w1s, store_out=False, q_dtype=E4M3, q_scale=ps, amax=amax), gemm_flop)
    t_up_qt = rec("fp8", "up fp8: e4m3 post both layouts (fp8_full)",
                  lambda: M.relu2_gemm(xq, w1q, a_scale=xs, b_scale=w1s, store_out=False, q_dtype=E4M3, q_scale=ps, emit_transposed=True, amax=amax), gemm_flop)
    rec("fp8", "down: scaled_mm post@w2^T (fast accum)",
        lambda: M.scaled_mm(pq, w2q.t(), ps, w2s, use_fast_accum=True), gemm_flop)
    t_dp_q = rec("fp8", "dpre fp8: e5m2 dpre row-major only",
                 lambda: M.relu2_gemm(gq, w2qt, aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, store_out=False, q_dtype=E5M2, q_scale=ds, amax=amax), gemm_flop)
    t_dp_qt = rec("fp8", "dpre fp8: e5m2 dpre both layouts (fp8_full)",
                  lambda: M.relu2_gemm(gq, w2qt, aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, store_out=False, q_dtype=E5M2, q_scale=ds, emit_transposed=True, amax=amax), gemm_flop)
    t_dp_bf16q = rec("fp8", "dpre fp8: bf16 dpre + e5m2 row-major (bf16-wgrad variant)",
                     lambda: M.relu2_gemm(gq, w2qt, aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, q_dtype=E5M2, q_scale=ds, amax=amax), gemm_flop)
    if M.USE_TMA:  # the same two fused kernels on the pointer path, for comparison
        M.USE_TMA = False
        rec("fp8", "up fp8: e4m3 both layouts, pointer kernel",
            lambda: M.relu2_gemm(xq, w1q, a_scale=xs, b_scale=w1s, store_out=False, q_dtype=E4M3, q_scale=ps, emit_transposed=True, amax=amax), gemm_flop)
        rec("fp8", "dpre fp8: e5m2 both layouts, pointer kernel",
            lambda: M.relu2_gemm(gq, w2qt, aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, store_out=False, q_dtype=E5M2, q_scale=ds, emit_transposed=True, amax=amax), gemm_flop)
        rec("bf16", "up: triton relu2 fwd, pointer kernel", lambda: M.relu2_gemm(x, w1), gemm_flop)
        M.USE_TMA = True
    # ---- fused Triton GEMM + epilogue vs the split path (cuBLAS GEMM, then the epilogue pass),
    # interleaved rounds (fused, split, fused, split, ...), medians and the split/fused ratio
    import statistics

    def ab(name, make, flop, rounds=7):
        # "tma" (epilogue through TMA) runs as "fused" where it cannot (transposed FP8 output)
        impls = M.GEMM_IMPLS
        times = {impl: [] for impl in impls}
        for _ in range(rounds):
            for impl in impls:
                times[impl].append(_bench(make(impl), rep_ms=60))
        med = {k: statistics.median(v) for k, v in times.items()}
        for impl in impls:
            rows.append({"group": "split", "name": f"{name} [{impl}]", "ms": med[impl], "tflops": _tflops(flop, med[impl]),
                         "range_ms": [min(times[impl]), max(times[impl])]})
        res.setdefault("split_vs_fused", {})[name] = {"fused_ms": med["fused"], "split_ms": med["split"],
                                                       "tma_ms": med["tma"], "ratio": med["split"] / med["fused"],
                                                       "tma_ratio": med["tma"] / med["fused"], "times": times}

    ab("up fp8 e4m3 both layouts", lambda impl: lambda: M.relu2_gemm(
        xq, w1q, a_scale=xs, b_scale=w1s, store_out=False, q_dtype=E4M3, q_scale=ps, emit_transposed=True, amax=amax,
        impl=impl), gemm_flop)
    ab("up fp8 bf16 + e4m3 row-major (fp8_fwd)", lambda impl: lambda: M.relu2_gemm(
        xq, w1q, a_scale=xs, b_scale=w1s, q_dtype=E4M3, q_scale=ps, amax=amax, impl=impl), gemm_flop)
    ab("dpre fp8 e5m2 both layouts", lambda impl: lambda: M.relu2_gemm(
        gq, w2qt, aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, store_out=False, q_dtype=E5M2, q_scale=ds,
        emit_transposed=True, amax=amax, impl=impl), gemm_flop)
    ab("up bf16", lambda impl: lambda: M.relu2_gemm(x, w1, impl=impl), gemm_flop)
    w2_hd = w2.t().contiguous()  # the record's bank layout: K-major for the dpre GEMM, TMA-ready
    ab("dpre bf16 (record backward)", lambda impl: lambda: M.relu2_gemm(g, w2_hd, aux=post, impl=impl), gemm_flop)

    # The split route's epilogue pass against its byte floor, per block configuration: its time is
    # (split call) - (the cuBLAS GEMM alone to bf16); bytes = read the bf16 GEMM output (2 MN), read
    # the e4m3 post for dpre (MN), write the FP8 layouts (2 MN).
    t_cublas_up = _bench(lambda: M.scaled_mm(xq, w1q.t(), xs, w1s, out_dtype=torch.bfloat16, use_fast_accum=True))
    t_cublas_dp = _bench(lambda: M.scaled_mm(gq, w2qt.t(), gs, w2s, out_dtype=torch.bfloat16, use_fast_accum=True))
    saved_epi = M.EPILOGUE_CONFIG
    epi = []
    for cfg_e in [saved_epi, (128, 128, 8), (128, 64, 4), (256, 64, 8), (128, 256, 8), (64, 256, 8), (256, 128, 8)]:
        M.EPILOGUE_CONFIG = cfg_e
        for what, fn, t_gemm, nbytes in (
            ("up e4m3 both layouts", lambda: M.relu2_gemm(xq, w1q, a_scale=xs, b_scale=w1s, store_out=False, q_dtype=E4M3,
                                                         q_scale=ps, emit_transposed=True, amax=amax, impl="split"),
             t_cublas_up, 4 * T * H),
            ("dpre e5m2 both layouts", lambda: M.relu2_gemm(gq, w2qt, aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s,
                                                           store_out=False, q_dtype=E5M2, q_scale=ds, emit_transposed=True,
                                                           amax=amax, impl="split"),
             t_cublas_dp, 5 * T * H),
        ):
            try:
                ms = _bench(fn, rep_ms=60) - t_gemm
                epi.append({"what": what, "config": list(cfg_e), "epilogue_ms": ms, "tbps": nbytes / (ms * 1e-3) / 1e12})
            except Exception as e:  # a config that does not compile (shared memory) is reported, not fatal
                epi.append({"what": what, "config": list(cfg_e), "error": f"{type(e).__name__}: {str(e)[:120]}"})
    M.EPILOGUE_CONFIG = saved_epi
    res["split_epilogue"] = {"cublas_up_ms": t_cublas_up, "cublas_dpre_ms": t_cublas_dp, "configs": epi}

    fp8_w = {}
    for fast in (False, True):
        sfx = " (fast accum)" if fast else ""
        fp8_w[("dW2", fast)] = rec("fp8", "dW2: scaled_mm g^T@post" + sfx, lambda: M.scaled_mm(gqt, pqt.t(), gs, ps, use_fast_accum=fast), gemm_flop)
        fp8_w[("dW1", fast)] = rec("fp8", "dW1: scaled_mm dpre^T@x" + sfx, lambda: M.scaled_mm(dqt, xqt.t(), ds, xs, use_fast_accum=fast), gemm_flop)
        rec("fp8", "dx: scaled_mm dpre@w1" + sfx, lambda: M.scaled_mm(dq, w1qt.t(), ds, w1s, use_fast_accum=fast), gemm_flop)
    t_x_both = [r_["ms"] for r_ in rows if r_["name"].startswith("quantize x e4m3 both")][0]
    t_x_row = [r_["ms"] for r_ in rows if r_["name"].startswith("quantize x e4m3 row-major")][0]
    t_up_bf16q = [r_["ms"] for r_ in rows if r_["name"].startswith("up fp8: bf16 post + e4m3")][0]
    # Each weight-gradient GEMM compared as the two routes it implies:
    #   FP8:  fp8 GEMM + the extra cost of emitting the transposed FP8 operand(s) in the producer;
    #   bf16: bf16 GEMM + the extra cost of the producer also writing the bf16 operand.
    verdict = {
        "dW2": {
            "fp8_route_ms": fp8_w[("dW2", False)] + (t_up_qt - t_up_q),
            "bf16_route_ms": t_dw2_bf16 + (t_up_bf16q - t_up_q),
            "parts": {"fp8_gemm": fp8_w[("dW2", False)], "post_T_emit": t_up_qt - t_up_q,
                      "bf16_gemm": t_dw2_bf16, "post_bf16_emit": t_up_bf16q - t_up_q},
            "note": "g^T comes from the e5m2 quantise that dpre needs anyway (both layouts, one kernel)",
        },
        "dW1": {
            "fp8_route_ms": fp8_w[("dW1", False)] + (t_dp_qt - t_dp_q) + max(0.0, t_x_both - t_x_row),
            "bf16_route_ms": t_dw1_bf16 + (t_dp_bf16q - t_dp_q),
            "parts": {"fp8_gemm": fp8_w[("dW1", False)], "dpre_T_emit": t_dp_qt - t_dp_q,
                      "x_T_emit": t_x_both - t_x_row, "bf16_gemm": t_dw1_bf16, "dpre_bf16_emit": t_dp_bf16q - t_dp_q},
        },
    }
    for k, v in verdict.items():
        v["fp8_wins"] = v["fp8_route_ms"] < v["bf16_route_ms"]
    res["wgrad_verdict"] = verdict

    # ---- whole MLP forward + backward
    cache = FP8WeightCache()
    cache.refresh({"w1": w1, "w2": w2})
    wc = (cache.get("w1"), cache.get("w2"))
    mlp_ms = {}
    # (name, mode, input scaling); the delayed row drops the amax passes of x and g.
    cases = [(mode, mode, "current") for mode in M.MODES] + [("fp8_full_delayed_inputs", "fp8_full", "delayed")]
    for name, mode, scaling in cases:
        xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
        state = M.MLPScaleState.create(dev, input_scaling=scaling)

        def step(mode=mode, xr=xr, w1r=w1r, w2r=w2r, state=state):
            xr.grad = w1r.grad = w2r.grad = None
            y = M.relu2_mlp(xr, w1r, w2r, mode=mode, cache=None if mode == "bf16" else wc, scales=state)
            y.backward(g)

        step()
        end_fp8_step([state])  # delayed scales ready, as after the first optimizer step
        mlp_ms[name] = rec("mlp", f"fwd+bwd {name}", step, 6 * gemm_flop)
        mlp_ms[name + "_fwd_only"] = rec(
            "mlp", f"fwd only {name}",
            lambda mode=mode, state=state: M.relu2_mlp(x, w1, w2, mode=mode, cache=None if mode == "bf16" else wc, scales=state),
            2 * gemm_flop,
        )
    xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))

    def torch_step():
        xr.grad = w1r.grad = w2r.grad = None
        (torch.relu(xr @ w1r.t()).square() @ w2r.t()).backward(g)

    mlp_ms["torch_bf16"] = rec("mlp", "fwd+bwd plain torch bf16 autograd", torch_step, 6 * gemm_flop)
    # Interleaved rounds: one route (relu2_mlp's gemm) for every relu2_gemm ("fused", "tma",
    # "split") and the per-case default ("default": a choice per direction and dtype).  Then the host (Python +
    # launch) time of one call, measured while the GPU is held busy so nothing waits on it: a
    # call whose host time is near its GPU time is launch-bound wherever it runs eagerly (the
    # compiled network calls these kernels as opaque ops, i.e. eagerly).
    impls = {"fused": "fused", "tma": "tma", "split": "split", "default": None}
    host_ms = {}
    for mode in ("fp8_fwd", "fp8_full"):
        xr, w1r, w2r = (t.clone().requires_grad_() for t in (x, w1, w2))
        state = M.MLPScaleState.create(dev)

        def step(mode=mode, xr=xr, w1r=w1r, w2r=w2r, state=state, gemm=None):
            xr.grad = w1r.grad = w2r.grad = None
            M.relu2_mlp(xr, w1r, w2r, mode=mode, cache=wc, scales=state, gemm=gemm).backward(g)

        step()
        end_fp8_step([state])
        times = {name: [] for name in impls}
        for _ in range(7):
            for name, impl in impls.items():
                times[name].append(_bench(lambda impl=impl: step(gemm=impl), rep_ms=60))
        for name in impls:
            mlp_ms[f"{mode}_{name}_interleaved"] = statistics.median(times[name])
            rows.append({"group": "mlp", "name": f"fwd+bwd {mode} gemm={name} (interleaved)",
                         "ms": statistics.median(times[name]), "tflops": _tflops(6 * gemm_flop, statistics.median(times[name]))})
        host_ms[mode] = _host_ms(step)
        rows.append({"group": "host", "name": f"host ms/call (GPU kept busy): fwd+bwd {mode}", "ms": host_ms[mode]})
    res["host_ms"] = host_ms
    res["mlp_ms"] = mlp_ms

    # ---- FP8 weight cache refresh over a bank
    L = args.layers
    bank = (torch.randn(L, 2, H, D, device=dev) * 0.02).bfloat16()
    wc2 = FP8WeightCache(bootstrap_refreshes=1)
    wc2.refresh({"w1": bank[:, 0], "w2": bank[:, 1]})  # bootstrap refresh (extra amax read)
    n_el = bank.numel()
    rec("cache", f"refresh W1+W2 banks ({L}x2x{H}x{D}), delayed scale", lambda: wc2.refresh({"w1": bank[:, 0], "w2": bank[:, 1]}), nbytes=n_el * 4)
    s = torch.tensor(1e-4, device=dev)
    rec("cache", f"quantize_dual_layout one matrix ({H}x{D})", lambda: quantize_dual_layout(bank[0, 0], s), nbytes=H * D * 4)
    rec("cache", f"quantize_dual_layout batched ({2 * L}x{H}x{D})", lambda: quantize_dual_layout(bank.flatten(0, 1), s), nbytes=n_el * 4)

    # ---- optional block-config sweep for the Triton GEMM
    if args.sweep:
        sweep = []
        # (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages); GROUP_M 1 rows: upstream f411b3d's
        # grouping (its FP8 forward runs 128x256x128, 3 stages, against our fp8_fwd 128x128x128, 4)
        cands = [(128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 4),
                 (128, 256, 128, 8, 8, 3), (128, 256, 128, 8, 8, 4), (128, 128, 128, 8, 4, 4),
                 (128, 256, 128, 1, 8, 3), (128, 128, 128, 1, 8, 4), (128, 256, 64, 1, 8, 3),
                 (128, 128, 128, 8, 8, 3), (128, 256, 128, 8, 8, 2), (256, 128, 128, 8, 8, 3),
                 (128, 256, 128, 4, 8, 3)]
        wanted = re.compile(args.sweep_filter) if args.sweep_filter else None
        kernels = (
            ("bf16", "up", lambda: M.relu2_gemm(x, w1)),
            ("bf16", "dpre (pointer only: w2.t() is not K-major)", lambda: M.relu2_gemm(g, w2.t(), aux=post)),
            ("fp8", "up q+qt", lambda: M.relu2_gemm(xq, w1q, a_scale=xs, b_scale=w1s, store_out=False, q_dtype=E4M3, q_scale=ps, emit_transposed=True, amax=amax)),
            # the record's FP8 forward (bf16 post for the backward + e4m3 post for the down GEMM):
            # TMA only, its config is TMA_CONFIGS["fp8_fwd"]
            ("fp8_fwd", "up out+q (record)", lambda: M.relu2_gemm(xq, w1q, a_scale=xs, b_scale=w1s, q_dtype=E4M3, q_scale=ps, amax=amax)),
            ("fp8", "dpre q+qt", lambda: M.relu2_gemm(gq, w2qt, aux=pq, aux_scale=ps, a_scale=gs, b_scale=w2s, store_out=False, q_dtype=E5M2, q_scale=ds, emit_transposed=True, amax=amax)),
        )
        # routes: the pointer kernel (GPU_CONFIGS), TMA loads + pointer epilogue (impl "fused",
        # TMA_CONFIGS), TMA loads + TMA epilogue (impl "tma", TMA_STORE_CONFIGS)
        saved = (dict(M.GPU_CONFIGS), dict(M.TMA_CONFIGS), dict(M.TMA_STORE_CONFIGS), M.USE_TMA, M.TMA_FLATTEN,
                 M.DEFAULT_GEMM_IMPL)
        routes = (("pointer", False, True), ("tma-load", True, True), ("tma-load", True, False),
                  ("tma-epilogue", True, True))
        for kind, what, fn in kernels:
            for route, use_tma, flatten in routes:
                if (use_tma and what.startswith("dpre (pointer")) or (kind == "fp8_fwd" and not use_tma):
                    continue
                if wanted is not None and not wanted.search(f"{kind} {what} {route}"):
                    continue
                table = {"pointer": M.GPU_CONFIGS, "tma-load": M.TMA_CONFIGS, "tma-epilogue": M.TMA_STORE_CONFIGS}[route]
                for c in cands:
                    if kind == "bf16" and c[2] == 128 and c[1] == 256:
                        continue
                    M.USE_TMA, M.TMA_FLATTEN = use_tma, flatten
                    # the kernels below call relu2_gemm without impl: route them through the default table
                    M.DEFAULT_GEMM_IMPL = dict.fromkeys(saved[5], "tma" if route == "tma-epilogue" else "fused")
                    base_kind = "fp8" if kind == "fp8_fwd" else kind
                    table[base_kind] = c
                    table.pop(base_kind + "_fwd", None)
                    try:
                        ms = _bench(fn, rep_ms=100)
                        sweep.append({"kernel": f"{kind} {what}", "route": route, "flatten": flatten, "config": list(c), "ms": ms, "tflops": _tflops(gemm_flop, ms)})
                    except Exception as e:  # out of shared memory etc.
                        sweep.append({"kernel": f"{kind} {what}", "route": route, "flatten": flatten, "config": list(c), "error": type(e).__name__})
                    for t_, orig in zip((M.GPU_CONFIGS, M.TMA_CONFIGS, M.TMA_STORE_CONFIGS), saved[:3]):
                        t_.clear()
                        t_.update(orig)
                    M.USE_TMA, M.TMA_FLATTEN, M.DEFAULT_GEMM_IMPL = saved[3], saved[4], saved[5]
        import speedrun.kernels.fp8_cache as FC

        saved_q = FC.QUANT_CONFIG
        flat = bank.flatten(0, 1)
        quant_configs = [(64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (64, 256, 8), (32, 128, 4)]
        for c in quant_configs if wanted is None or wanted.search("quant") else []:
            FC.QUANT_CONFIG = c
            for what, t in (("x", x), ("bank", flat)):
                ms = _bench(lambda t=t: quantize_dual_layout(t, s), rep_ms=100)
                sweep.append({"kind": f"quant {what}", "config": list(c), "ms": ms, "tbps": t.numel() * 4 / (ms * 1e-3) / 1e12})
        FC.QUANT_CONFIG = saved_q
        # abs_max (current scaling's amax pass, 88 per record stage-3 step): its block config sweep
        saved_a = FC.ABS_MAX_CONFIG
        amax_configs = [(b, w, p) for b in (2048, 4096, 8192) for w in (4, 8, 16) for p in (2, 4, 8)]
        for c in amax_configs if wanted is None or wanted.search("amax") else []:
            FC.ABS_MAX_CONFIG = c
            ms = _bench(lambda: FC.abs_max(x), rep_ms=100)
            sweep.append({"kind": "amax x", "config": list(c), "ms": ms, "tbps": x.numel() * 2 / (ms * 1e-3) / 1e12})
        FC.ABS_MAX_CONFIG = saved_a
        amax_rows = [r_ for r_ in sweep if r_.get("kind") == "amax x"]
        if amax_rows:
            best = min(amax_rows, key=lambda r_: r_["ms"])
            now = [r_ for r_ in amax_rows if tuple(r_["config"]) == tuple(saved_a)]
            print(f"abs_max sweep (BLOCK, warps, programs per SM): best {best['config']} {best['ms']:.4f} ms "
                  f"({best['tbps']:.2f} TB/s); current {list(saved_a)}"
                  + (f" {now[0]['ms']:.4f} ms" if now else ""), flush=True)
        res["sweep"] = sweep

    res["rows"] = rows
    # ---- print
    c = res["ceilings"]
    print(f"device {res['device']}  torch {res['torch']}  T={T} D={D} H={H}")
    print(f"ceilings: bf16 matmul {c['bf16_matmul_8192_tflops']:.0f} TFLOP/s, fp8 scaled_mm "
          f"{c['fp8_scaled_mm_8192_tflops_fast_accum']:.0f} (fast accum) / {c['fp8_scaled_mm_8192_tflops']:.0f} TFLOP/s, copy {c['copy_tbps']:.2f} TB/s")
    print(f"{'group':6} {'what':58} {'ms':>8} {'TFLOP/s':>8} {'TB/s':>6} {'%copy':>6}")
    for r_ in rows:
        tf = f"{r_['tflops']:.0f}" if "tflops" in r_ else ""
        tb = f"{r_['tbps']:.2f}" if "tbps" in r_ else ""
        fc = f"{100 * r_['frac_of_copy']:.0f}" if "frac_of_copy" in r_ else ""
        print(f"{r_['group']:6} {r_['name'][:58]:58} {r_['ms']:8.3f} {tf:>8} {tb:>6} {fc:>6}")
    for k, v in verdict.items():
        parts = ", ".join(f"{n} {t:.3f}" for n, t in v["parts"].items())
        print(f"{k}: FP8 route {v['fp8_route_ms']:.3f} ms vs bf16 route {v['bf16_route_ms']:.3f} ms "
              f"-> {'FP8' if v['fp8_wins'] else 'keep bf16'}   ({parts})")
    for k, v in res["split_vs_fused"].items():
        print(f"{k}: fused {v['fused_ms']:.3f}, tma {v['tma_ms']:.3f} (x{v['tma_ratio']:.3f}), split {v['split_ms']:.3f} ms "
              f"(x{v['ratio']:.3f}) (medians of 7 interleaved rounds; fused range "
              f"{min(v['times']['fused']):.3f}-{max(v['times']['fused']):.3f}, tma range "
              f"{min(v['times']['tma']):.3f}-{max(v['times']['tma']):.3f})")
    if args.sweep:
        for s_ in res["sweep"]:
            print(s_)
    out_dir = Path(os.environ.get("OUT", "./bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_mlp.json").write_text(json.dumps(res, indent=2))
    se = res["split_epilogue"]
    print(f"split route: cuBLAS FP8 GEMM to bf16 up {se['cublas_up_ms']:.3f} ms, dpre {se['cublas_dpre_ms']:.3f} ms; "
          f"epilogue pass per config (BLOCK_M, BLOCK_N, warps), copy ceiling {c['copy_tbps']:.2f} TB/s:")
    for e in se["configs"]:
        print(f"  {e['what']:24} {str(tuple(e['config'])):16} "
              + (f"{e['epilogue_ms']:.3f} ms  {e['tbps']:.2f} TB/s" if "error" not in e else e["error"]))
    print(f"wrote {out_dir / 'bench_mlp.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
