"""The record baseline's attention prep (QK norm, RoPE, key offset, value residual) compiled,
forward + backward: the sliced RoPE formulation, the elementwise one on sliced or split q/k/v, and
upstream's chunked bf16-factor one, on one CUDA GPU.

Why: a kernel inventory (``tools/compare_kernels.py`` of our record profile against upstream
f411b3d's) put several times upstream's time into Inductor pointwise kernels named
``..._fused_rms_norm_backward_..._slice_backward...``.
The record path rotated with slices, ``stack`` and ``cat`` (:func:`speedrun.model.rotary.apply_rotary`,
strided head selects on paired layers, two ``cat``s for the key offset); it now uses factor tables
and a pair swap (:func:`speedrun.model.rotary.rotate_with_factors`, :func:`shift_stationary_keys`).
The slow kernel turned out to be the backward of the q/k/v *slicing* of the
projection output (three summed slice_backwards, one flat loop with three masked regions), which
the ``split`` arm (the record path now) replaces by a cat.
This script times the arms, each compiled with ``torch.compile`` (default mode), per layer kind at
stage-3 shapes: T = 49,152 tokens, H = 6 heads of 128 (qkv (T, 2304) bf16 in the record's
[q | k | v] block layout).

Arms are interleaved (``--reps`` rounds, each timing every arm with ``triton.testing.do_bench``);
prints medians, each arm's ratio to the sliced one, the compulsory bytes and the floor at the
measured copy bandwidth, and the kernels of one forward+backward of each arm (torch.profiler).  Writes
``$OUT/bench_rotary.json``.

Usage: ``python benchmarks/bench_rotary.py [--tokens 49152] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

KINDS = ("plain", "paired", "long_key_offset", "value_residual")


def sliced_prep(qkv, aux_v, cos, sin, *, kind, H, D, rope_dims):
    """The record path before the change: apply_rotary's slices/stack/cat, strided paired selects,
    the key offset as two cats."""
    from speedrun.model.rotary import apply_rotary

    T = qkv.shape[0]
    q = F.rms_norm(qkv[:, : H * D].view(T, H, D), (D,))
    k = F.rms_norm(qkv[:, H * D : 2 * H * D].view(T, H, D), (D,))
    v = qkv[:, 2 * H * D :].view(T, H, D)
    if kind == "paired":
        def rot(x):
            even = apply_rotary(x[:, 0::2], cos[0 : 2 * T : 2], sin[0 : 2 * T : 2])
            odd = apply_rotary(x[:, 1::2], cos[1 : 2 * T : 2], sin[1 : 2 * T : 2])
            return torch.stack((even, odd), dim=2).flatten(1, 2)

        q, k = rot(q), rot(k)
    else:
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kind == "long_key_offset":
            r = rope_dims
            shifted = torch.cat((k[:1, :, r:], k[:-1, :, r:]))
            k = torch.cat((k[:, :, :r], shifted), dim=-1)
    if kind == "value_residual":
        v = v + aux_v.view(T, H, D)
    return q, k, v


def elementwise_prep(qkv, aux_v, yarn, *, kind, H, D, rope_dims, split=False):
    """The model's own Yarn.rotate / rotate_paired and shift_stationary_keys on q, k, v taken from
    qkv by slicing (the record's earlier path: its backward sums three
    zero-padded ``slice_backward``s, which Inductor compiles to one flat loop over (T, 3HD) with
    three masked regions) or, ``split=True``, by ``torch.split`` (the record path now: the backward
    is a ``cat``, which Inductor writes region by region; CPU codegen shows the separate loops)."""
    from speedrun.model.rotary import shift_stationary_keys

    T = qkv.shape[0]
    if split:
        q, k, v = torch.split(qkv, (H * D, H * D, H * D), dim=1)
    else:
        q, k, v = qkv[:, : H * D], qkv[:, H * D : 2 * H * D], qkv[:, 2 * H * D :]
    q = F.rms_norm(q.view(T, H, D), (D,))
    k = F.rms_norm(k.view(T, H, D), (D,))
    v = v.view(T, H, D)
    if kind == "paired":
        q, k = yarn.rotate_paired(q), yarn.rotate_paired(k)
    else:
        q, k = yarn.rotate(q), yarn.rotate(k)
        if kind == "long_key_offset":
            k = shift_stationary_keys(k, rope_dims)
    if kind == "value_residual":
        v = v + aux_v.view(T, H, D)
    return q, k, v


def chunked_prep(qkv, aux_v, f_cos, f_sin, *, kind, H, D, rope_dims):
    """Upstream f411b3d's formulation (re-written here to compare kernels): q, k, v as ``chunk``s of
    a (T, 3H, D) view, the rotation ``x * f_cos + swap_pairs(x) * f_sin`` in the activations' dtype
    against bf16 factor tables (the bench passes them rounded to bf16), the key offset as an
    in-place slice copy.  Our fused backward kernel that assembles dqkv (one flat index over
    (T, 2304) with three regions) ran far below the copy bandwidth; this arm shows whether
    the (T, 3H, D) view with its head-granular regions compiles to a cheaper one."""
    T = qkv.shape[0]
    q, k, v = qkv.view(T, 3 * H, D).chunk(3, dim=1)
    q, k = F.rms_norm(q, (D,)), F.rms_norm(k, (D,))

    def rot(x, c, s):
        swapped = x.view(*x.shape[:-1], x.shape[-1] // 2, 2).flip(-1).view(x.shape)
        return x * c + swapped * s

    if kind == "paired":
        # heads 2i, 2i+1 side by side as one 2D-wide row; factor row t holds positions 2t, 2t+1
        c, s = f_cos[: 2 * T].reshape(T, 1, 2 * D), f_sin[: 2 * T].reshape(T, 1, 2 * D)
        q = rot(q.reshape(T, H // 2, 2 * D), c, s).view(T, H, D)
        k = rot(k.reshape(T, H // 2, 2 * D), c, s).view(T, H, D)
    else:
        c, s = f_cos[:T, None, :], f_sin[:T, None, :]
        q, k = rot(q, c, s), rot(k, c, s)
        if kind == "long_key_offset":
            k[1:, :, rope_dims:] = k[:-1, :, rope_dims:].clone()
    if kind == "value_residual":
        v = v + aux_v.view(T, H, D)
    return q, k, v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=49152)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_rotary: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing

    from speedrun.evidence.fingerprint import measure_copy_tbps
    from speedrun.model.yarn import Yarn

    dev = "cuda"
    T, H, D = args.tokens, args.heads, args.head_dim
    yarn = Yarn(D, 0.5, 1024.0)
    cos, sin = yarn.tables(2 * T, dev)
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(T, 3 * H * D, device=dev, generator=g).bfloat16().requires_grad_()
    aux_v = torch.randn(T, H * D, device=dev, generator=g).bfloat16().requires_grad_()
    grads = [torch.randn(T, H, D, device=dev, generator=g).bfloat16() for _ in range(3)]
    copy_tbps = measure_copy_tbps(1 << 30, device=dev)

    f_cos, f_sin = yarn.factors(2 * T, dev)
    arms = {"sliced": (sliced_prep, (cos, sin)), "elementwise": (elementwise_prep, (yarn,)),
            "split": (functools.partial(elementwise_prep, split=True), (yarn,)),
            "chunked_bf16": (chunked_prep, (f_cos.bfloat16(), f_sin.bfloat16()))}
    # one compiled lambda per (kind, arm) shares a code object: allow them all without falling back to eager
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(KINDS) * len(arms))
    results = []
    for kind in KINDS:
        compiled = {name: torch.compile(lambda a, b, *tabs, fn=fn: fn(a, b, *tabs, kind=kind, H=H, D=D,
                                                                       rope_dims=yarn.rope_dims), dynamic=False)
                    for name, (fn, _) in arms.items()}

        # aux_v only enters value-residual layers (autograd.grad refuses an unused input)
        leaves = (qkv, aux_v) if kind == "value_residual" else (qkv,)

        def step(name):
            q, k, v = compiled[name](qkv, aux_v, *arms[name][1])
            torch.autograd.backward((q, k, v), grads)

        outs = {}
        for name in arms:  # compile, and check the two arms compute the same thing
            q, k, v = compiled[name](qkv, aux_v, *arms[name][1])
            gq = torch.autograd.grad((q, k, v), leaves, grads)
            outs[name] = (q, k, v, *gq)
        # relative difference of each arm's outputs and gradients from the sliced arm's
        errs = {name: [((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                       for a, b in zip(outs[name], outs["sliced"])] for name in arms if name != "sliced"}
        times = {name: [] for name in arms}
        for _ in range(args.reps):
            for name in arms:
                qkv.grad = aux_v.grad = None
                times[name].append(triton.testing.do_bench(lambda: step(name), warmup=5, rep=60,
                                                           grad_to_none=list(leaves), return_mode="median"))
        # compulsory bytes of forward + backward: read qkv, write q, k, v; backward reads dq, dk, dv
        # and qkv (norm recompute), writes dqkv (+ aux_v's read and gradient on value-residual layers)
        act = T * H * D * 2
        nbytes = 3 * act + 3 * act + 3 * act + 3 * act + 3 * act + (2 * act if kind == "value_residual" else 0)
        kernels = {}
        for name in arms:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step(name)
                torch.cuda.synchronize()
            kernels[name] = sorted(
                ({"kernel": e.key[:120], "calls": e.count, "us": round(e.device_time_total, 1)}
                 for e in prof.key_averages() if e.device_time_total > 0), key=lambda r: -r["us"])[:12]
        med = {name: statistics.median(ts) for name, ts in times.items()}
        row = {"kind": kind, "median_ms": med, "times_ms": times,
               "ratio_vs_sliced": {name: med[name] / med["sliced"] for name in arms},
               "rel_diff_vs_sliced": errs, "compulsory_bytes": nbytes, "floor_ms": nbytes / copy_tbps / 1e9,
               "kernels": kernels}
        results.append(row)
        print(f"{kind:16} floor {row['floor_ms']:.3f} ms", flush=True)
        for name in arms:
            diff = f"  max rel diff vs sliced {max(errs[name]):.1e}" if name in errs else ""
            print(f"   {name:13} {med[name]:.3f} ms (spread {min(times[name]):.3f}-{max(times[name]):.3f}, "
                  f"ratio vs sliced {row['ratio_vs_sliced'][name]:.3f}){diff}")
            print("      " + "; ".join(f"{r['kernel'][:70]} x{r['calls']} {r['us']:.0f}us" for r in kernels[name][:5]))
    out = Path(os.environ.get("OUT", "bench_out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_rotary.json").write_text(json.dumps({
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tokens": T, "heads": H,
        "head_dim": D, "copy_tbps": copy_tbps, "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
