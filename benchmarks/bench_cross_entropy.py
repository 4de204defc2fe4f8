"""Time the loss head at record shapes: fused FP8/bf16 head (GEMMs + Triton CE) vs PyTorch references.

Usage (on a CUDA GPU):  python benchmarks/bench_cross_entropy.py [--n 49152] [--compile] [--sweep]

Prints one line per case with the median time (``triton.testing.do_bench``, ms) and the achieved
bandwidth (CE kernel: bytes actually moved, two reads of bf16 logits plus the dlogits write) or
GEMM throughput (head cases: 3 GEMMs of 2*N*D*V FLOPs).  Writes everything to
``$OUT/bench_cross_entropy.json`` (``OUT`` defaults to ``./bench_out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=49152, help="rows (tokens per GPU step)")
    p.add_argument("--d", type=int, default=768)
    p.add_argument("--v-pad", type=int, default=50304)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--compile", action="store_true", help="also time a torch.compile'd reference")
    p.add_argument("--sweep", action="store_true", help="sweep CE kernel block sizes / warps")
    p.add_argument("--skip-eager", action="store_true", help="skip the (memory-hungry) eager reference")
    p.add_argument("--sweep-sigmoid", default="exact,tanh",
                   help="comma-separated sigmoid routes the block-size sweep covers (exact, tanh)")
    p.add_argument("--sweep-persistent", action="store_true",
                   help="also sweep persistent grids (so far slower at every setting)")
    p.add_argument("--sweep-transposed", action="store_true",
                   help="time the CE kernel writing both gradient layouts (train.ce_grad_layout=dual) over "
                        "rows per program x vocabulary chunk x warps, against the kernel then the transpose pass")
    p.add_argument("--ce-only", action="store_true", help="stop after the CE kernel's cases (no GEMMs, no head)")
    p.add_argument("--sm-clock-mhz", type=float, default=1980.0,
                   help="SM clock for the SFU floor (H200 boost: 1980)")
    args = p.parse_args(argv)
    from speedrun.config import CE_SIGMOID_CHOICES

    unknown = set(args.sweep_sigmoid.split(",")) - set(CE_SIGMOID_CHOICES)
    if unknown:
        p.error(f"--sweep-sigmoid: unknown route(s) {', '.join(sorted(unknown))}; known: {', '.join(CE_SIGMOID_CHOICES)}")
    if not torch.cuda.is_available():
        print("bench_cross_entropy: needs a CUDA GPU", file=sys.stderr)
        return 2

    import triton
    from triton.testing import do_bench

    from speedrun.kernels.cross_entropy import (
        GRAD_UNIT_SCALE,
        fused_softcapped_ce,
        softcapped_ce_fwd_bwd,
        softcapped_multitoken_ce_reference,
    )
    from speedrun.kernels.fp8_ops import fp8_supported

    n, d, v, vocab = args.n, args.d, args.v_pad, args.vocab
    dev = torch.device("cuda")
    torch.manual_seed(0)
    x = torch.randn(n, d, device=dev).to(torch.bfloat16)
    w = (torch.randn(d, v, device=dev) * 0.08).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (n,), device=dev)
    prefix = torch.randint(0, vocab, (n,), device=dev)
    prefix[::3] = -1
    mtp = torch.tensor([1.0, 0.5, 0.25], device=dev)
    pw = torch.tensor([0.25], device=dev)
    logits = (x @ w).contiguous()
    gemm_flops = 3 * 2 * n * d * v
    results: dict[str, dict] = {}

    def record(name: str, ms: float, *, bytes_moved: float | None = None, flops: float | None = None, **extra):
        row = {"median_ms": ms, **extra}
        msg = f"{name:34s} {ms:9.3f} ms"
        if bytes_moved is not None:
            row["bytes"] = bytes_moved
            row["GB_per_s"] = bytes_moved / ms / 1e6
            msg += f"  {row['GB_per_s']:8.0f} GB/s"
        if flops is not None:
            row["flops"] = flops
            row["TFLOP_per_s"] = flops / ms / 1e9
            msg += f"  {row['TFLOP_per_s']:8.1f} TFLOP/s (3 GEMMs)"
        results[name] = row
        print(msg, flush=True)

    def bench(fn, grad_to_none=None) -> float:
        return do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")

    # --- the CE kernel alone, on precomputed bf16 logits.  The softcap's sigmoid (train.ce_sigmoid):
    # "exact" costs two special-function-unit (SFU) instructions per logit and pass (ex2, rcp) plus
    # the softmax's ex2, "tanh" one (tanh.approx) plus the ex2: 6 or 4 per logit over both passes.
    # sfu_floor_ms: those instructions at 16 per clock per SM (Hopper) and --sm-clock-mhz.
    # Rounds alternate the two so drifting clocks hit both alike.
    sms_all = torch.cuda.get_device_properties(dev).multi_processor_count
    sfu_rate = sms_all * 16 * args.sm_clock_mhz * 1e6  # instructions per second
    for rnd in range(2):
        for label, gdtype, scale in (("ce_kernel_e5m2", torch.float8_e5m2, 1 / GRAD_UNIT_SCALE),
                                     ("ce_kernel_bf16", torch.bfloat16, 1.0)):
            out_l = torch.empty(n, device=dev)
            out_d = torch.empty(n, v, device=dev, dtype=gdtype)
            for sig, sfu_ops in (("exact", 6), ("tanh", 4)):
                fn = lambda: softcapped_ce_fwd_bwd(  # noqa: E731
                    logits, targets, mtp, prefix, pw, vocab_size=vocab, grad_out_scale=scale, grad_dtype=gdtype,
                    losses_out=out_l, dlogits_out=out_d, sigmoid=sig,
                )
                moved = n * v * 2 * 2 + n * v * out_d.element_size()
                record(f"{label}{'' if sig == 'exact' else '_tanh'}{'' if rnd == 0 else '_again'}", bench(fn),
                       bytes_moved=moved, min_bytes=n * v * (2 + out_d.element_size()),
                       sfu_floor_ms=n * vocab * sfu_ops / sfu_rate * 1e3)

    # --- the CE kernel and the FP8 head's transposed-gradient pass together (what the head's
    # backward runs); min_bytes: one read of the logits + both e5m2 layouts written
    from speedrun.kernels.cross_entropy import transpose_fp8

    out_l = torch.empty(n, device=dev)
    out_d = torch.empty(n, v, device=dev, dtype=torch.float8_e5m2)
    e5m2 = dict(vocab_size=vocab, grad_out_scale=1 / GRAD_UNIT_SCALE, grad_dtype=torch.float8_e5m2,
                losses_out=out_l, dlogits_out=out_d)
    for sig in ("exact", "tanh"):
        record(f"ce_kernel_e5m2{'' if sig == 'exact' else '_tanh'}_then_transpose",
               bench(lambda: transpose_fp8(softcapped_ce_fwd_bwd(logits, targets, mtp, prefix, pw, sigmoid=sig,
                                                                 **e5m2)[1])),
               bytes_moved=n * v * 2 * 2 + n * v * 3, min_bytes=n * v * 4)

    # --- the head's dX times the per-token loss gradient (backward): eager torch (three passes, the
    # earlier route) against the in-place Triton pass; min_bytes: read + write
    from speedrun.kernels.cross_entropy import scale_rows_

    dx = torch.randn(n, d, device=dev).to(torch.bfloat16)
    go = torch.rand(n, 1, device=dev) + 0.5
    for rnd in range(2):
        record(f"dx_row_scale_eager_r{rnd}", bench(lambda: (dx.float() * go).to(torch.bfloat16)),
               bytes_moved=n * d * (2 + 4 + 4 + 4 + 4 + 2), min_bytes=n * d * 4)
        record(f"dx_row_scale_triton_r{rnd}", bench(lambda: scale_rows_(dx, go.reshape(-1))),
               bytes_moved=n * d * 4, min_bytes=n * d * 4)
    del dx

    if args.sweep_transposed:
        # Both e5m2 layouts from the kernel (min_bytes: two reads of the logits + two layouts written)
        # against the kernel then the transpose pass, in alternating rounds; the first round also
        # checks that the two routes give the same bytes.
        from speedrun.kernels.cross_entropy import TRANSPOSED_BLOCK_M, TRANSPOSED_BLOCK_V

        from speedrun.kernels.fp8_cache import sm_count

        out_t = torch.empty(v, n, device=dev, dtype=torch.float8_e5m2)
        # (rows, columns, warps, programs per SM or None): 32-row blocks leave ~1536 programs, a
        # few waves, so persistent grids (whole waves, each program looping) are in the sweep too
        configs = [(None, None, 4, None)] + [(m, bv, w, None) for m in (16, 32, 64) for bv in (64, 128, 256)
                                             for w in (4, 8) if (m, bv, w) != (TRANSPOSED_BLOCK_M, TRANSPOSED_BLOCK_V, 4)]
        configs += [(TRANSPOSED_BLOCK_M, TRANSPOSED_BLOCK_V, 4, k) for k in (2, 4, 8)]
        sms = sm_count(torch.device(dev))
        for rnd in range(3):
            record(f"transposed_baseline_tanh_r{rnd}",
                   bench(lambda: transpose_fp8(softcapped_ce_fwd_bwd(logits, targets, mtp, prefix, pw, sigmoid="tanh",
                                                                     **e5m2)[1])),
                   bytes_moved=n * v * 2 * 2 + n * v * 3, min_bytes=n * v * 4)
            for block_m, block_v, warps, per_sm in configs:
                fn = lambda: softcapped_ce_fwd_bwd(  # noqa: E731
                    logits, targets, mtp, prefix, pw, sigmoid="tanh", dlogits_t_out=out_t, block_m=block_m,
                    block_v=block_v, num_warps=warps, max_programs=None if per_sm is None else per_sm * sms, **e5m2)
                label = (f"transposed_dual_m{block_m or TRANSPOSED_BLOCK_M}_v{block_v or TRANSPOSED_BLOCK_V}_w{warps}"
                         f"{'' if per_sm is None else f'_{per_sm}perSM'}{'_default' if block_m is None else ''}_r{rnd}")
                try:
                    ms = bench(fn)
                except Exception as e:  # a config may not compile (registers, shared memory)
                    print(f"{label}: failed {type(e).__name__}", flush=True)
                    continue
                if rnd == 0 and block_m is None:
                    ref = transpose_fp8(softcapped_ce_fwd_bwd(  # the same tiling, so the same row sums
                        logits, targets, mtp, prefix, pw, sigmoid="tanh", block_m=TRANSPOSED_BLOCK_M,
                        block_v=TRANSPOSED_BLOCK_V, **{**e5m2, "dlogits_out": None})[1])
                    fn()
                    same = bool(torch.equal(out_t.view(torch.uint8), ref.view(torch.uint8)))
                    print(f"transposed layout equals the transpose pass's: {same}", flush=True)
                    results["transposed_bits_equal"] = {"value": same}
                    del ref
                record(label, ms, bytes_moved=n * v * 2 * 2 + n * v * 2, min_bytes=n * v * 4)
        del out_t

    if args.sweep:
        for sig in args.sweep_sigmoid.split(","):
            for block_m in (1, 2):
                for block_v in (512, 1024, 2048, 4096):
                    for warps in (2, 4, 8):
                        if block_v // (32 * warps) < 2:
                            continue
                        fn = lambda: softcapped_ce_fwd_bwd(  # noqa: E731
                            logits, targets, mtp, prefix, pw, vocab_size=vocab, grad_out_scale=1 / GRAD_UNIT_SCALE,
                            grad_dtype=torch.float8_e5m2, losses_out=out_l, dlogits_out=out_d,
                            block_m=block_m, block_v=block_v, num_warps=warps, sigmoid=sig,
                        )
                        label = f"sweep_{sig}_m{block_m}_v{block_v}_w{warps}"
                        try:
                            ms = bench(fn)
                        except Exception as e:  # a config may not compile (registers, shared memory)
                            print(f"{label}: failed {type(e).__name__}", flush=True)
                            continue
                        record(label, ms, bytes_moved=n * v * 5)
    if args.sweep_persistent:
        # Persistent grids: at most k programs per SM, each looping over rows, so fewer 100 KB
        # rows are in flight and the gradient pass can re-read them from L2 (ncu measured 2.0x
        # the logits' bytes read with one program per row).  min_bytes: one read + the e5m2 write.
        from speedrun.kernels.fp8_cache import sm_count

        sms = sm_count(torch.device(dev))
        for sig in args.sweep_sigmoid.split(","):
            for block_v, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16)):
                for per_sm in (1, 2, 4, 8, 16):
                    fn = lambda: softcapped_ce_fwd_bwd(  # noqa: E731
                        logits, targets, mtp, prefix, pw, vocab_size=vocab, grad_out_scale=1 / GRAD_UNIT_SCALE,
                        grad_dtype=torch.float8_e5m2, losses_out=out_l, dlogits_out=out_d,
                        block_v=block_v, num_warps=warps, max_programs=per_sm * sms, sigmoid=sig,
                    )
                    label = f"persistent_{sig}_v{block_v}_w{warps}_{per_sm}perSM"
                    try:
                        ms = bench(fn)
                    except Exception as e:
                        print(f"{label}: failed {type(e).__name__}", flush=True)
                        continue
                    record(label, ms, bytes_moved=n * v * 3, min_bytes=n * v * 3)
    del logits

    # --- pieces of the FP8 head, to see where its time goes
    if fp8_supported(dev) and not args.ce_only:
        from speedrun.kernels.cross_entropy import W_SCALE, X_SCALE
        from speedrun.kernels.fp8_ops import quantize_tensorwise, scaled_mm

        x8 = quantize_tensorwise(x, X_SCALE, torch.float8_e4m3fn)
        w8 = quantize_tensorwise(w, W_SCALE, torch.float8_e4m3fn)
        w8c = w8.t().contiguous().t()
        g8 = torch.randn(n, v, device=dev).to(torch.float8_e5m2)
        x8t = x8.t().contiguous()
        g8c = g8.t().contiguous().t()
        record("fp8_quantize_x_and_w", bench(lambda: (quantize_tensorwise(x, X_SCALE, torch.float8_e4m3fn),
                                                      quantize_tensorwise(w, W_SCALE, torch.float8_e4m3fn).t().contiguous())))
        record("fp8_gemm_fwd", bench(lambda: scaled_mm(x8, w8c, X_SCALE, W_SCALE, torch.bfloat16, True)), flops=gemm_flops / 3)
        record("fp8_gemm_dx", bench(lambda: scaled_mm(g8, w8.t(), GRAD_UNIT_SCALE, W_SCALE, torch.bfloat16)), flops=gemm_flops / 3)
        record("fp8_gemm_dw", bench(lambda: scaled_mm(x8t, g8c, X_SCALE, GRAD_UNIT_SCALE, torch.bfloat16)), flops=gemm_flops / 3)
        from speedrun.kernels.cross_entropy import transpose_fp8

        record("transpose_dlogits_e5m2_torch", bench(lambda: g8.t().contiguous()), bytes_moved=2 * n * v)
        record("transpose_dlogits_e5m2_triton", bench(lambda: transpose_fp8(g8)), bytes_moved=2 * n * v)
        del g8, g8c

    # --- the whole head, forward + backward
    xr = x.clone().requires_grad_(True)
    wr = w.clone().requires_grad_(True)
    modes = [("head_bf16", False)] + ([("head_fp8", True)] if fp8_supported(dev) else [])
    for label, use_fp8 in ([] if args.ce_only else modes):
        def fwd():
            return fused_softcapped_ce(xr, wr, targets, mtp, prefix, pw, use_fp8=use_fp8, vocab_size=vocab)

        def fwd_bwd():
            fwd().sum().backward()

        with torch.no_grad():
            record(f"{label}_fwd_only", bench(fwd), flops=gemm_flops / 3)
        record(f"{label}_fwd_bwd", bench(fwd_bwd, grad_to_none=[xr, wr]), flops=gemm_flops)

    # --- plain PyTorch: bf16 GEMM, fp32 softcap/log-softmax, autograd
    def ref_fwd_bwd(loss_fn):
        def run():
            loss_fn(xr, wr).sum().backward()
        return run

    def ref_loss(xx, ww):
        return softcapped_multitoken_ce_reference(xx @ ww, targets, mtp, prefix, pw, vocab_size=vocab)

    if not (args.skip_eager or args.ce_only):
        try:
            record("reference_eager_fwd_bwd", bench(ref_fwd_bwd(ref_loss), grad_to_none=[xr, wr]), flops=gemm_flops)
        except torch.OutOfMemoryError:
            print("reference_eager_fwd_bwd: out of memory", flush=True)
            results["reference_eager_fwd_bwd"] = {"error": "out of memory"}
        torch.cuda.empty_cache()
    if args.compile:
        t0 = time.perf_counter()
        compiled = torch.compile(ref_loss)
        try:
            ref_fwd_bwd(compiled)()
            torch.cuda.synchronize()
            results["compile_seconds"] = {"value": time.perf_counter() - t0}
            record("reference_compiled_fwd_bwd", bench(ref_fwd_bwd(compiled), grad_to_none=[xr, wr]), flops=gemm_flops)
        except Exception as e:  # report, don't hide the other numbers
            print(f"reference_compiled_fwd_bwd: failed: {type(e).__name__}: {e}", flush=True)
            results["reference_compiled_fwd_bwd"] = {"error": f"{type(e).__name__}: {e}"}

    out_dir = Path(os.environ.get("OUT", "./bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "shape": {"n": n, "d": d, "v_pad": v, "vocab": vocab, "mtp_weights": mtp.tolist(), "prefix_weight": 0.25},
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "peak_memory_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
    }
    path = out_dir / "bench_cross_entropy.json"
    path.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
