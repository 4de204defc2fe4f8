"""Benchmark the fused QK-prep kernels and the packed FP8 QKV projection on one CUDA GPU.

Prints a table and writes ``$OUT/bench_qk_prep.json`` (``OUT`` defaults to ``./bench_out``):

* ``copy_tbps``: a 1 GiB device-to-device copy (read + write bytes / time), the bandwidth ceiling;
* per QK-prep variant (plain, paired + aux_v, long window key offset + aux_v, key offset + pad to
  128) at T tokens, H heads, Dqk/Dv: median ms of the fused forward kernel, fused backward kernel,
  fused autograd forward+backward, the plain-PyTorch reference (eager) forward and forward+backward,
  and the same reference under ``torch.compile``; compulsory bytes (``qk_prep_bytes``), achieved
  TB/s and the fraction of the copy bandwidth for the fused kernels;
* ``--sweep``: forward/backward kernel times over ``BLOCK_R`` x ``num_warps`` in the layouts the
  candidate launches (``SWEEP_VARIANTS``; edit ``speedrun.kernels.qk_prep.CONFIGS`` from the best);
* QKV projection at (T, D) x (D -> N): bf16 ``F.linear`` forward+backward at the old equal-width
  N = H*3*Dv (2304) and at the packed N = H*(2 Dqk + Dv) (1920), the packed FP8 GEMM
  (``packed_qkv_linear``) forward and forward+backward with bf16 and FP8 weight gradients, and the
  pack kernel (current and delayed scaling).

Usage: ``python benchmarks/bench_qk_prep.py [--tokens 49152] [--heads 6] [--qk-dim 96] [--v-dim 128]
[--dim 768] [--sweep] [--no-compile]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


def _bench(fn, rep_ms=100):
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))


def copy_tbps(dev):
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms * 1e-3) / 1e12


VARIANTS = {  # (paired, key_offset, pad_to, aux)
    "plain": (False, False, None, False),
    "paired_aux": (True, False, None, True),
    "key_offset_aux": (False, True, None, True),
    "key_offset_pad128": (False, True, 128, False),
}


def bench_qk_prep(args, dev, copy_bw):
    from speedrun.kernels import qk_prep as m
    from speedrun.model.yarn import Yarn

    T, H, dqk, dv = args.tokens, args.heads, args.qk_dim, args.v_dim
    yarn = Yarn(dqk, 0.5, 1024.0)
    cos, sin = yarn.tables(2 * T, dev)
    n = cos.shape[1]
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(T, H * (2 * dqk + dv), device=dev, generator=g).bfloat16()
    aux = torch.randn(T, H * dv, device=dev, generator=g).bfloat16()
    out = {}
    for name, (paired, key_offset, pad_to, has_aux) in VARIANTS.items():
        a = aux if has_aux else None
        kw = dict(num_heads=H, qk_dim=dqk, v_dim=dv, paired=paired, key_offset=key_offset, pad_to=pad_to)
        dout = pad_to or dqk
        grads = [torch.randn(T, H, dout, device=dev).bfloat16(), torch.randn(T, H, dout, device=dev).bfloat16(),
                 torch.randn(T, H, dv, device=dev).bfloat16()]
        if paired:
            grads = [x.view(2 * T, H // 2, x.shape[-1]) for x in grads]
        thd = [x.reshape(T, H, x.shape[-1]) for x in grads]
        eps = m.DEFAULT_EPS
        r = {}
        r["fused_fwd_ms"] = _bench(lambda: m._launch_fwd(qkv, cos, sin, a, T, H, dqk, dv, n, dout, paired, key_offset, eps))
        r["fused_bwd_ms"] = _bench(lambda: m._launch_bwd(qkv, cos, sin, *thd, T, H, dqk, dv, n, paired, key_offset, eps))
        # model.qk_prep_fp8_grad: the backward with its e5m2 epilogue, against the backward then the
        # packed QKV GEMM's delayed quantise pass over d qkv (what the switch replaces)
        from speedrun.kernels.fp8_cache import E5M2, quantize_delayed

        q8 = torch.empty(qkv.shape, dtype=E5M2, device=dev)
        s8, a8 = torch.full((), 1e-3, device=dev), torch.zeros((), device=dev)
        r["fused_bwd_e5m2_ms"] = _bench(lambda: m._launch_bwd(qkv, cos, sin, *thd, T, H, dqk, dv, n, paired, key_offset,
                                                              eps, fp8_out=(q8, s8, a8)))
        r["fused_bwd_then_quantize_ms"] = _bench(lambda: quantize_delayed(
            m._launch_bwd(qkv, cos, sin, *thd, T, H, dqk, dv, n, paired, key_offset, eps), s8, a8,
            fp8_dtype=E5M2, transposed=False))
        x = qkv.clone().requires_grad_()

        def fwd_bwd(fn):
            def run():
                outs = fn(x, cos, sin, aux_v=a, **kw)
                torch.autograd.grad(outs, x, grads)  # no .grad accumulation in the timing
            return run

        r["fused_fwd_bwd_ms"] = _bench(fwd_bwd(m.qk_prep))
        r["ref_eager_fwd_ms"] = _bench(lambda: m.qk_prep_reference(qkv, cos, sin, aux_v=a, **kw))
        r["ref_eager_fwd_bwd_ms"] = _bench(fwd_bwd(m.qk_prep_reference))
        if not args.no_compile:
            try:
                comp = torch.compile(m.qk_prep_reference, dynamic=False)
                r["ref_compiled_fwd_ms"] = _bench(lambda: comp(qkv, cos, sin, aux_v=a, **kw))
                r["ref_compiled_fwd_bwd_ms"] = _bench(fwd_bwd(comp))
            except Exception as e:  # report, keep going
                r["ref_compiled_error"] = f"{type(e).__name__}: {e}"[:300]
        fb = m.qk_prep_bytes(T, H, dqk, dv, n, pad_to=pad_to, key_offset=key_offset, aux_v=has_aux)
        bb = m.qk_prep_bytes(T, H, dqk, dv, n, pad_to=pad_to, key_offset=key_offset, backward=True)
        r["fwd_bytes"], r["bwd_bytes"] = fb, bb
        r["fused_fwd_tbps"] = fb / (r["fused_fwd_ms"] * 1e-3) / 1e12
        r["fused_bwd_tbps"] = bb / (r["fused_bwd_ms"] * 1e-3) / 1e12
        r["fused_fwd_frac_copy"] = r["fused_fwd_tbps"] / copy_bw
        r["fused_bwd_frac_copy"] = r["fused_bwd_tbps"] / copy_bw
        out[name] = r
        print(f"{name:18s} fused fwd {r['fused_fwd_ms']:.3f} ms ({r['fused_fwd_tbps']:.2f} TB/s, "
              f"{100 * r['fused_fwd_frac_copy']:.0f}% copy)  bwd {r['fused_bwd_ms']:.3f} ms ({r['fused_bwd_tbps']:.2f} TB/s)  "
              f"bwd+e5m2 {r['fused_bwd_e5m2_ms']:.3f} vs bwd then quantise {r['fused_bwd_then_quantize_ms']:.3f}  "
              f"fwd+bwd {r['fused_fwd_bwd_ms']:.3f} | ref eager {r['ref_eager_fwd_ms']:.3f}/{r['ref_eager_fwd_bwd_ms']:.3f}"
              + (f" | ref compiled {r['ref_compiled_fwd_ms']:.3f}/{r['ref_compiled_fwd_bwd_ms']:.3f}" if "ref_compiled_fwd_ms" in r else ""),
              flush=True)
    return out


# The layouts the candidate launches at stage 3 on the H200 (varlen attention: Q/K padded to the
# V width; value embeddings on half the layers; paired heads and the key offset on others).
SWEEP_VARIANTS = {  # (paired, key_offset, pad_to, aux)
    "key_offset_aux_pad128": (False, True, 128, True),
    "paired_aux_pad128": (True, False, 128, True),
    "key_offset_pad128": (False, True, 128, False),
}


def sweep(args, dev):
    """Kernel times over BLOCK_R x num_warps for each of SWEEP_VARIANTS; the best configuration is
    the one with the least time summed over the variants (forward and backward chosen apart)."""
    from speedrun.kernels import qk_prep as m
    from speedrun.model.yarn import Yarn

    T, H, dqk, dv = args.tokens, args.heads, args.qk_dim, args.v_dim
    cos, sin = Yarn(dqk, 0.5, 1024.0).tables(2 * T, dev)
    n = cos.shape[1]
    qkv = torch.randn(T, H * (2 * dqk + dv), device=dev).bfloat16()
    aux = torch.randn(T, H * dv, device=dev).bfloat16()
    old = {k: dict(v) for k, v in m.CONFIGS.items()}
    res = []
    for br in (8, 16, 32, 64):
        for w in (2, 4, 8):
            m.CONFIGS["fwd"] = {"BLOCK_R": br, "num_warps": w}
            m.CONFIGS["bwd"] = {"BLOCK_R": br, "num_warps": w}
            row = {"BLOCK_R": br, "num_warps": w, "fwd_ms": 0.0, "bwd_ms": 0.0}
            for name, (paired, key_offset, pad_to, has_aux) in SWEEP_VARIANTS.items():
                dout = pad_to or dqk
                a = aux if has_aux else None
                gq, gk, gv = (torch.randn(T, H, d, device=dev).bfloat16() for d in (dout, dout, dv))
                f = _bench(lambda: m._launch_fwd(qkv, cos, sin, a, T, H, dqk, dv, n, dout, paired, key_offset, m.DEFAULT_EPS))
                b = _bench(lambda: m._launch_bwd(qkv, cos, sin, gq, gk, gv, T, H, dqk, dv, n, paired, key_offset, m.DEFAULT_EPS))
                row[f"{name}_fwd_ms"], row[f"{name}_bwd_ms"] = f, b
                row["fwd_ms"] += f
                row["bwd_ms"] += b
            res.append(row)
            print(f"sweep BLOCK_R={br:3d} warps={w}: fwd {row['fwd_ms']:.4f} ms  bwd {row['bwd_ms']:.4f} ms "
                  f"(sums over {', '.join(SWEEP_VARIANTS)})", flush=True)
    m.CONFIGS.update(old)
    best_f = min(res, key=lambda r: r["fwd_ms"])
    best_b = min(res, key=lambda r: r["bwd_ms"])
    now = [r for r in res if r["BLOCK_R"] == old["fwd"]["BLOCK_R"] and r["num_warps"] == old["fwd"]["num_warps"]][0]
    now_b = [r for r in res if r["BLOCK_R"] == old["bwd"]["BLOCK_R"] and r["num_warps"] == old["bwd"]["num_warps"]][0]
    print(f"best fwd BLOCK_R={best_f['BLOCK_R']} warps={best_f['num_warps']} {best_f['fwd_ms']:.4f} ms "
          f"(current {old['fwd']}: {now['fwd_ms']:.4f} ms)")
    print(f"best bwd BLOCK_R={best_b['BLOCK_R']} warps={best_b['num_warps']} {best_b['bwd_ms']:.4f} ms "
          f"(current {old['bwd']}: {now_b['bwd_ms']:.4f} ms)")
    return {"variants": list(SWEEP_VARIANTS), "grid": res, "best_fwd": best_f, "best_bwd": best_b, "current": old}


def bench_qkv_gemm(args, dev):
    import torch.nn.functional as F

    from speedrun.kernels.qkv_pack import delayed_scale, pack_qkv_fp8, packed_qkv_linear

    T, H, dqk, dv, D = args.tokens, args.heads, args.qk_dim, args.v_dim, args.dim
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(T, D, device=dev, generator=g).bfloat16().requires_grad_()
    out = {}
    for label, n_out in (("bf16_equal_width", H * 3 * dv), ("bf16_packed_width", H * (2 * dqk + dv))):
        w = (torch.randn(n_out, D, device=dev, generator=g) * D**-0.5).bfloat16().requires_grad_()
        sa = torch.tensor(0.5, device=dev, requires_grad=True)
        dy = torch.randn(T, n_out, device=dev).bfloat16()

        def run():
            y = F.linear(x, w * sa)
            torch.autograd.grad(y, (x, w, sa), dy)

        out[label] = {"N": n_out, "fwd_ms": _bench(lambda: F.linear(x, w * sa)), "fwd_bwd_ms": _bench(run)}
    N = H * (2 * dqk + dv)
    w_qk = (torch.randn(H, 2 * dqk, D, device=dev, generator=g) * D**-0.5).bfloat16().requires_grad_()
    w_v = (torch.randn(H * dv, D, device=dev, generator=g) * D**-0.5).bfloat16().requires_grad_()
    sa = torch.tensor(0.5, device=dev, requires_grad=True)
    dy = torch.randn(T, N, device=dev).bfloat16()
    packed = pack_qkv_fp8(w_qk.detach(), w_v.detach(), sa)
    ds = delayed_scale(packed.amax)
    out["pack_current_ms"] = _bench(lambda: pack_qkv_fp8(w_qk.detach(), w_v.detach(), sa))
    out["pack_delayed_ms"] = _bench(lambda: pack_qkv_fp8(w_qk.detach(), w_v.detach(), sa, scale=ds))
    for dw_fp8 in (False, True):
        def run():
            y = packed_qkv_linear(x, packed, w_qk, w_v, sa, dw_fp8=dw_fp8)
            torch.autograd.grad(y, (x, w_qk, w_v, sa), dy)

        key = "fp8_packed_dw_fp8" if dw_fp8 else "fp8_packed_dw_bf16"
        out[key] = {"N": N, "fwd_ms": _bench(lambda: packed_qkv_linear(x, packed, w_qk, w_v, sa, dw_fp8=dw_fp8)),
                    "fwd_bwd_ms": _bench(run)}
    for k, v in out.items():
        if isinstance(v, dict):
            flop = 2 * T * D * v["N"]
            v["fwd_tflops"] = flop / (v["fwd_ms"] * 1e-3) / 1e12
            v["fwd_bwd_tflops"] = 3 * flop / (v["fwd_bwd_ms"] * 1e-3) / 1e12
            print(f"qkv {k:20s} N={v['N']}: fwd {v['fwd_ms']:.3f} ms ({v['fwd_tflops']:.0f} TFLOP/s)  "
                  f"fwd+bwd {v['fwd_bwd_ms']:.3f} ms ({v['fwd_bwd_tflops']:.0f} TFLOP/s)", flush=True)
        else:
            print(f"qkv {k:20s} {v:.4f} ms", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=49152)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--qk-dim", type=int, default=96)
    p.add_argument("--v-dim", type=int, default=128)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd reference")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_qk_prep: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    res = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "args": vars(args)}
    res["copy_tbps"] = copy_tbps(dev)
    print(f"copy bandwidth {res['copy_tbps']:.2f} TB/s", flush=True)
    res["qk_prep"] = bench_qk_prep(args, dev, res["copy_tbps"])
    if args.sweep:
        res["sweep"] = sweep(args, dev)
    res["qkv_gemm"] = bench_qkv_gemm(args, dev)
    out_dir = Path(os.environ.get("OUT", "./bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_qk_prep.json").write_text(json.dumps(res, indent=2))
    print(f"wrote {out_dir / 'bench_qk_prep.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
