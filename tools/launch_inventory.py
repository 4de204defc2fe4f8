"""Count what the fused (opaque) calls launch per micro-batch, forward and backward, per arm.

Under ``torch.compile`` everything outside our opaque ops becomes Inductor-generated code, but an
opaque op's body runs eagerly from Python: each Triton launch and each eager torch op inside it is
host work that Inductor never sees.  This script runs one forward + backward of each arm's
network (the presets' layer structure at a small token count; the counts do not depend on it),
wraps every registered opaque kernel after one warmup step (FP8 weight cache refreshed, delayed
scales ready, as from the second training step on), and counts inside each call:

* Triton launches, by kernel name (``JITFunction.run``; the interpreter's ``InterpretedFunction.run``
  on the CPU),
* eager torch ops that launch a kernel (every aten op that is not a view and not an allocation),
* allocations (``empty*``);

``fp8_ops.scaled_mm`` counts as one launch (its CPU emulation is ~6 eager ops).

It prints per opaque kernel: calls per micro-batch and launches per call, and an estimate of the
host time per micro-batch from per-call costs ``benchmarks/bench_host.py`` measured on the H200
(:data:`HOST_US`; the opaque round trip measured on the CPU).  Runs on the CPU (Triton interpreter,
``TRITON_INTERPRET=1`` set here) or on a GPU; device-dependent branches (TMA descriptors, cuBLAS
``_scaled_mm``) can differ between the two, so the printout names the device.

Usage: ``python tools/launch_inventory.py [--arms record candidate] [--tokens 256]``;
writes ``$OUT/launch_inventory.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
from pathlib import Path

import torch

if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# host microseconds per call, (low, high): benchmarks/bench_host.py's measurements on the H200
# (opaque: on the CPU); inputs of the estimate, refresh them from a new bench_host.py run
HOST_US = {"triton": (22.4, 53.7), "eager": (13.5, 13.5), "alloc": (7.0, 7.0), "opaque": (16.0, 24.0)}


# the layer structure of the presets (11 layers, head dims) with fewer heads, width and vocabulary
CPU_OVERRIDES = ["model.num_heads=2", "model.model_dim=256", "model.vocab_size=1024"]


class _OpCounter(TorchDispatchMode):
    """Counts aten ops: views (no launch), allocations, and the rest (a kernel launch each)."""

    def __init__(self, sink: collections.Counter):
        super().__init__()
        self.sink = sink

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.is_view:
            self.sink["view"] += 1
        elif name.startswith("empty") or name == "new_empty":
            self.sink["alloc"] += 1
        else:
            self.sink["eager"] += 1
            self.sink[f"eager:{name}"] += 1
        return func(*args, **(kwargs or {}))


_ACTIVE: list[collections.Counter] = []


def _counted_launch(original):
    def run(self, *args, **kwargs):
        if not _ACTIVE:
            return original(self, *args, **kwargs)
        fn = getattr(self, "fn", self)
        _ACTIVE[-1]["triton"] += 1
        _ACTIVE[-1][f"triton:{getattr(fn, '__name__', '?')}"] += 1
        with _disable_current_modes():  # the interpreter's own tensor copies are not launcher work
            return original(self, *args, **kwargs)
    return run


def _counted_scaled_mm(original):
    """On the CPU ``fp8_ops.scaled_mm`` emulates the FP8 GEMM with ~6 eager ops; on CUDA it is one
    ``torch._scaled_mm``: count it as one launch on either device."""
    def scaled_mm(*args, **kwargs):
        if not _ACTIVE:
            return original(*args, **kwargs)
        _ACTIVE[-1]["eager"] += 1
        _ACTIVE[-1]["eager:_scaled_mm"] += 1
        with _disable_current_modes():
            return original(*args, **kwargs)
    return scaled_mm


def _counted_phase(inner, key, per_kernel: dict):
    def wrapped(ctx, tensors):
        c = collections.Counter()
        _ACTIVE.append(c)
        try:
            with _OpCounter(c):
                return inner(ctx, tensors)
        finally:
            _ACTIVE.pop()
            per_kernel.setdefault(key, []).append(c)
    return wrapped


@contextlib.contextmanager
def counting(per_kernel: dict):
    """While active: every registered opaque kernel's forward and backward append a Counter per
    call to ``per_kernel[(name, phase)]`` (Triton launches, eager ops, allocations, views).
    Everything patched is restored on exit."""
    import triton.runtime.jit as jit

    from speedrun.kernels import _triton as launch, fp8_ops, opaque

    undo = []

    def patch(obj, attr, value):
        undo.append((obj, attr, getattr(obj, attr)))
        setattr(obj, attr, value)

    classes = [jit.JITFunction]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        classes.append(InterpretedFunction)
    except ImportError:  # pragma: no cover - older layout
        pass
    for cls in classes:
        patch(cls, "run", _counted_launch(cls.run))
    original_mm = fp8_ops.scaled_mm
    counted_mm = _counted_scaled_mm(original_mm)
    for name, module in list(sys.modules.items()):  # modules that imported it by name
        if name.startswith("speedrun") and getattr(module, "scaled_mm", None) is original_mm:
            patch(module, "scaled_mm", counted_mm)
    for k in opaque._KERNELS:
        for phase in ("forward", "backward"):
            patch(k, phase, _counted_phase(getattr(k, phase), (k.name, phase), per_kernel))
    try:
        # every launch through JITFunction.run, where it is counted (the launch cache bypasses it)
        with launch.plain_launches():
            yield per_kernel
    finally:
        for obj, attr, value in reversed(undo):
            setattr(obj, attr, value)


def inventory(arm: str, tokens: int, device: torch.device, overrides=()) -> dict:
    from types import SimpleNamespace

    from speedrun.config import apply_overrides, preset
    from speedrun.model import build_model
    from speedrun.model.interface import ForwardArgs

    cfg = preset(arm)
    apply_overrides(cfg, list(overrides))
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    if device.type == "cuda":
        model.cast_for_training(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    V = cfg.model.vocab_size
    batch = SimpleNamespace(
        inputs=torch.randint(0, V, (tokens,), generator=g, dtype=torch.int32).to(device),
        targets=torch.randint(0, V, (tokens,), generator=g).to(device),
        cu_seqlens=torch.tensor([0, tokens // 2, tokens], dtype=torch.int32, device=device),
        max_seqlen=tokens, bigram=None)
    args = ForwardArgs(window_short=128, window_long=256, mtp_weights=(1.0, 0.5), prefix_weight=0.0)
    per_kernel: dict = {}
    model.after_optimizer_step()  # FP8 weight copies, as training refreshes them once per update
    # One step first, as in training from step 1 on: it registers the kernels and ends an FP8 step,
    # so the delayed scales are ready (before that each call calibrates with an extra GEMM).
    model.loss(batch, args).backward()
    model.end_step()
    model.zero_grad(set_to_none=True)
    with counting(per_kernel), torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):
        loss = model.loss(batch, args)
        loss.backward()
    rows = []
    for (name, phase), counters in sorted(per_kernel.items()):
        total = sum(counters, collections.Counter())
        calls = len(counters)
        lo = sum(total[k] * HOST_US[k][0] for k in ("triton", "eager", "alloc")) + calls * HOST_US["opaque"][0]
        hi = sum(total[k] * HOST_US[k][1] for k in ("triton", "eager", "alloc")) + calls * HOST_US["opaque"][1]
        detail = {k: v for k, v in total.items() if ":" in k}
        rows.append({"kernel": name, "phase": phase, "calls": calls, "triton": total["triton"],
                     "eager": total["eager"], "alloc": total["alloc"], "views": total["view"],
                     "host_us_low": lo, "host_us_high": hi, "detail": detail})
    return {"arm": arm, "tokens": tokens, "device": str(device), "rows": rows,
            "host_ms_low": sum(r["host_us_low"] for r in rows) / 1e3,
            "host_ms_high": sum(r["host_us_high"] for r in rows) / 1e3}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=["record", "candidate"])
    ap.add_argument("--tokens", type=int, default=256, help="tokens in the micro-batch (counts do not depend on it)")
    ap.add_argument("--set", dest="overrides", action="append", default=None, metavar="SECTION.FIELD=VALUE",
                    help="config override (repeatable); default on the CPU: a narrow network with the "
                         "presets' layer structure (" + " ".join(CPU_OVERRIDES) + "), as the interpreter "
                         "needs ~15 min for the full-size record")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    overrides = args.overrides if args.overrides is not None else (CPU_OVERRIDES if device.type == "cpu" else [])
    results = []
    for arm in args.arms:
        r = inventory(arm, args.tokens, device, overrides)
        results.append(r)
        print(f"\n{arm} ({device}): one micro-batch, forward + backward, inside opaque calls")
        print(f"{'kernel':34s} {'phase':8s} {'calls':>5s} {'triton':>6s} {'eager':>6s} {'alloc':>6s}  host ms (est.)")
        for row in r["rows"]:
            print(f"{row['kernel'][:34]:34s} {row['phase']:8s} {row['calls']:5d} {row['triton']:6d} {row['eager']:6d} "
                  f"{row['alloc']:6d}  {row['host_us_low'] / 1e3:5.2f}-{row['host_us_high'] / 1e3:5.2f}")
        print(f"{'total':34s} {'':8s} {sum(x['calls'] for x in r['rows']):5d} "
              f"{sum(x['triton'] for x in r['rows']):6d} {sum(x['eager'] for x in r['rows']):6d} "
              f"{sum(x['alloc'] for x in r['rows']):6d}  {r['host_ms_low']:5.2f}-{r['host_ms_high']:5.2f}")
    out_dir = Path(os.environ.get("OUT", "./bench_out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "launch_inventory.json"
    path.write_text(json.dumps({"host_us_per_call": HOST_US, "arms": results}, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
