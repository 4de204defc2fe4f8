"""``speedrun profile``: where the time of a training step goes, and how much of it is recoverable.

:func:`profile_steps` builds one arm (as ``speedrun bench step`` does), warms it up, and records
``steps`` optimizer steps with ``torch.profiler`` (``record_shapes=True``).  Every op call is
grouped by (name, input shapes, input dtypes).  Its time is the time of the device kernels it
launched itself (GPU) or its self CPU time (CPU), so a composite op (``aten::linear``) and its
parts (``aten::addmm``) are never counted twice.

For the ops :func:`op_cost` knows (GEMMs, copies, norms, softmax, elementwise and reductions) the
minimal work is computed from the shapes and dtypes: FLOPs, and bytes = every input read once and
every output written once.  With the two ceilings (dense bf16 matmul TFLOP/s and copy TB/s, both
measured in the same run on a GPU, or given by the user) each group gets a floor time,
``max(FLOPs / peak FLOP/s, bytes / peak B/s)`` for GEMMs and ``bytes / peak B/s`` for the rest,
and a *recoverable* time = measured - floor; groups are ranked by it.  FP8 ``_scaled_mm`` is held
to twice the measured bf16 ceiling (the H100/H200 dense FP8 rate).

Triton kernels launched from Python (ours, and Inductor's under ``torch.compile``) are not aten
ops, so the profiler records no shapes for them: they appear in the kernel table with their time
and, with ``--ncu``, their measured DRAM bytes.  A kernel wrapped as a ``torch.library`` custom op
gets shapes; :func:`register_op_model` then gives it a floor like any aten op.

``--ncu`` reruns the same steps under Nsight Compute (``ncu --clock-control none --metrics
dram__bytes_read.sum,dram__bytes_write.sum``), between ``cudaProfilerStart/Stop``, and compares
the measured DRAM bytes of each kernel with the bytes its ops need.
"""

from __future__ import annotations

import csv
import gc
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from speedrun.kernels.launch_notes import PREFIX as LAUNCH_PREFIX
from speedrun.kernels.launch_notes import parse_launch_note

# ----------------------------------------------------------------------------------------------
# The cost model (pure)

_DTYPE_BYTES = {
    # names as the profiler writes them (c10 scalar type names)
    "double": 8, "float": 4, "c10::half": 2, "c10::bfloat16": 2, "long int": 8, "long": 8, "int": 4,
    "short int": 2, "short": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
    "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "c10::float8_e4m3fnuz": 1, "c10::float8_e5m2fnuz": 1,
    "c10::float8_e8m0fnu": 1, "c10::complex<float>": 8, "c10::complex<double>": 16,
    # torch names, for callers that pass them
    "float64": 8, "float32": 4, "float16": 2, "half": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "bf16": 2, "fp32": 4, "fp16": 2,
}
_NOT_TENSOR = {"scalar", "scalarlist", "tensorlist", "", "none", "genericlist", "string", "device"}

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}
COPY_OPS = {"aten::copy_"}
FILL_OPS = {"aten::fill_", "aten::zero_"}
NORM_FWD = {"aten::native_layer_norm", "aten::_fused_rms_norm", "aten::native_rms_norm"}
NORM_BWD = {"aten::native_layer_norm_backward", "aten::_fused_rms_norm_backward"}
SOFTMAX_FWD = {"aten::_softmax", "aten::_log_softmax"}
SOFTMAX_BWD = {"aten::_softmax_backward_data", "aten::_log_softmax_backward_data"}
REDUCTIONS = {"aten::sum", "aten::mean", "aten::amax", "aten::amin", "aten::max", "aten::min", "aten::norm",
              "aten::linalg_vector_norm", "aten::prod", "aten::var", "aten::std", "aten::argmax"}
ELEMENTWISE = {
    "add", "sub", "mul", "div", "neg", "exp", "exp2", "log", "log1p", "log2", "tanh", "sigmoid", "relu", "gelu",
    "silu", "pow", "rsqrt", "sqrt", "square", "where", "clamp", "clamp_min", "clamp_max", "abs", "sign",
    "maximum", "minimum", "reciprocal", "lerp", "addcmul", "addcdiv", "threshold_backward", "gelu_backward",
    "silu_backward", "sigmoid_backward", "tanh_backward", "softplus", "sin", "cos", "erf", "masked_fill", "fmod",
    "remainder", "floor", "ceil", "round", "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "bitwise_and",
    "fill", "rsub",
}


@dataclass(frozen=True)
class OpCost:
    """Minimal work of one op call: ``kind`` (gemm, copy, norm, softmax, elementwise, reduction),
    ``flops`` (floating-point operations) and ``bytes`` (bytes read + written at least once)."""

    kind: str
    flops: float
    bytes: float


def dtype_bytes(dtype: str | None, default: int | None = None) -> int | None:
    """Bytes per element of a profiler dtype name (``float``, ``c10::BFloat16``, ...) or a torch
    name (``bfloat16``); ``default`` for unknown names, None for non-tensors (Scalar, lists)."""
    if dtype is None:
        return default
    d = str(dtype).strip().lower().removeprefix("torch.")
    if d in _NOT_TENSOR:
        return None
    return _DTYPE_BYTES.get(d, default)


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(int(s) for s in shape))


def _tensors(shapes, dtypes, default_bytes: int) -> list[tuple[list[int], int]]:
    """(shape, bytes per element) of the tensor inputs; scalars and lists dropped."""
    dtypes = list(dtypes) if dtypes else [None] * len(shapes)
    out = []
    for shape, dt in zip(shapes, dtypes + [None] * (len(shapes) - len(dtypes))):
        if not isinstance(shape, (list, tuple)) or any(isinstance(s, (list, tuple)) for s in shape):
            continue
        b = dtype_bytes(dt, default_bytes) if dt is not None else default_bytes
        if b is None or (dt is None and not shape):
            continue
        out.append((list(shape), b))
    return out


# Models of further ops by exact profiler name (e.g. a Triton kernel wrapped as a torch.library
# custom op "speedrun::ce_fwd_bwd", whose input shapes the profiler then records).
OP_MODELS: dict[str, Callable[[list, list], OpCost | None]] = {}


def register_op_model(name: str, model: Callable[[list, list], OpCost | None]) -> None:
    """Teach :func:`op_cost` an op: ``model(shapes, dtypes) -> OpCost`` (dtypes as the profiler
    names them, or [] when it records none)."""
    OP_MODELS[name] = model


def op_cost(name: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[str] | None = None,
            default_dtype: str = "float32") -> OpCost | None:
    """Minimal FLOPs and bytes of one call of op ``name`` with input ``shapes`` / ``dtypes``.

    GEMMs: ``mm`` (M,K)x(K,N): 2MNK FLOPs, (MK + KN + MN) x element bytes; ``addmm`` adds the
    bias read; ``bmm``/``baddbmm`` are B of those; ``_scaled_mm`` reads FP8 operands and writes a
    2-byte (bf16) output.  Copies read the source and write the destination; elementwise ops read
    every tensor input and write one output of the broadcast size (in-place ops write their first
    input); norms/softmax read x (and weights) and write y (backward: read dy and x, write dx).
    Returns None for ops it has no model of.  ``dtypes`` may be None (then ``default_dtype``).
    """
    if name in OP_MODELS:
        return OP_MODELS[name]([list(x) if isinstance(x, (list, tuple)) else x for x in shapes], list(dtypes or []))
    note = parse_launch_note(name)
    if note is not None:  # one of our Triton launches, its bytes and FLOPs in the range's name
        return OpCost("gemm" if note.flops else "elementwise", float(note.flops), float(note.nbytes))
    default = dtype_bytes(default_dtype, 4) or 4
    t = _tensors(shapes, dtypes, default)
    if name in GEMM_OPS:
        return _gemm_cost(name, t)
    if not t:
        return None
    numel = [_numel(s) for s, _ in t]
    nbytes = [n * b for n, (_, b) in zip(numel, t)]
    if name in COPY_OPS:
        if len(t) < 2:
            return None
        return OpCost("copy", 0.0, float(nbytes[0] + nbytes[1]))
    if name in FILL_OPS:
        return OpCost("elementwise", 0.0, float(nbytes[0]))
    if name in NORM_FWD:
        x = nbytes[0]
        weights = sum(nbytes[1:])
        return OpCost("norm", 4.0 * numel[0], float(2 * x + weights))
    if name in NORM_BWD:
        x = nbytes[0]
        return OpCost("norm", 6.0 * numel[0], float(3 * x))
    if name in SOFTMAX_FWD:
        return OpCost("softmax", 4.0 * numel[0], float(2 * nbytes[0]))
    if name in SOFTMAX_BWD:
        return OpCost("softmax", 4.0 * numel[0], float(3 * nbytes[0]))
    if name in REDUCTIONS:
        return OpCost("reduction", float(numel[0]), float(nbytes[0]))
    base = name.removeprefix("aten::")
    if name.startswith("aten::") and (base in ELEMENTWISE or base.rstrip("_") in ELEMENTWISE):
        out_numel = max(numel)
        out_bytes = out_numel * t[0][1]
        return OpCost("elementwise", float(out_numel), float(sum(nbytes) + out_bytes))
    return None


def _gemm_cost(name: str, t: list[tuple[list[int], int]]) -> OpCost | None:
    if name in ("aten::addmm", "aten::baddbmm"):
        if len(t) < 3:
            return None
        bias, t = t[0], t[1:]
    else:
        bias = None
    if len(t) < 2:
        return None
    (sa, ba), (sb, bb) = t[0], t[1]
    if name in ("aten::bmm", "aten::baddbmm"):
        if len(sa) != 3 or len(sb) != 3 or sa[0] != sb[0] or sa[2] != sb[1]:
            raise ValueError(f"{name}: cannot multiply {sa} by {sb}; expected (B,M,K) x (B,K,N)")
        batch, (m, k), n = sa[0], sa[1:], sb[2]
    else:
        if len(sa) != 2 or len(sb) != 2 or sa[1] != sb[0]:
            raise ValueError(f"{name}: cannot multiply {sa} by {sb}; expected (M,K) x (K,N)")
        batch, (m, k), n = 1, sa, sb[1]
    out_elt = 2 if name == "aten::_scaled_mm" else ba
    nbytes = batch * (m * k * ba + k * n * bb + m * n * out_elt)
    if bias is not None:
        nbytes += _numel(bias[0]) * bias[1]
    return OpCost("gemm", 2.0 * batch * m * n * k, float(nbytes))


@dataclass(frozen=True)
class Ceilings:
    """Roofline ceilings: dense matmul TFLOP/s (bf16) and memory TB/s; None when unknown."""

    tflops: float | None = None
    tbps: float | None = None
    source: str = "none"

    def floor_us(self, cost: OpCost, name: str = "") -> float | None:
        """Least time (µs) one call with ``cost`` can take under these ceilings; None if unknown."""
        if self.tbps is None or (cost.kind == "gemm" and self.tflops is None):
            return None
        mem = cost.bytes / (self.tbps * 1e12) * 1e6
        if cost.kind != "gemm":
            return mem
        note = parse_launch_note(name)
        fp8 = name == "aten::_scaled_mm" or (note is not None and note.kind == "gemm_fp8")
        peak = self.tflops * (2.0 if fp8 else 1.0)
        return max(mem, cost.flops / (peak * 1e12) * 1e6)


# ----------------------------------------------------------------------------------------------
# Grouping profiler events


@dataclass
class OpGroup:
    """One (op, shapes, dtypes) group over the profiled steps; times in µs over all steps."""

    name: str
    shapes: list
    dtypes: list
    calls: int = 0
    time_us: float = 0.0
    kernels: dict = field(default_factory=dict)  # kernel name -> µs
    cost: OpCost | None = None
    floor_us: float | None = None
    sources: dict = field(default_factory=dict)  # call site (with --stacks) -> calls

    def main_source(self) -> str | None:
        """The call site of most of this group's calls (None without stacks)."""
        return max(self.sources, key=self.sources.get) if self.sources else None

    @property
    def recoverable_us(self) -> float | None:
        return None if self.floor_us is None else max(0.0, self.time_us - self.floor_us)

    def achieved(self) -> tuple[float | None, float | None]:
        """(TFLOP/s, TB/s) achieved over the measured time."""
        if self.cost is None or self.time_us <= 0:
            return None, None
        s = self.time_us * 1e-6
        return self.cost.flops * self.calls / s / 1e12, self.cost.bytes * self.calls / s / 1e12


_HOST_COPY = re.compile(r"^Memcpy (HtoD|DtoH|HtoH|PtoP)|^Memcpy .*(Pageable|Pinned)")


def _is_annotation(evt) -> bool:
    """Ranges that mark code, not work: ProfilerStep#N, record_function ranges, and the ranges
    Inductor puts around each compiled graph ("## Call CompiledFxGraph ... ##"), which also show
    on the device timeline spanning all the kernels inside them."""
    if evt.name.startswith(LAUNCH_PREFIX):  # our kernels' launch notes are ops with a cost
        return False
    return (bool(getattr(evt, "is_user_annotation", False)) or evt.name.startswith("ProfilerStep")
            or evt.name.startswith("## "))


_FRAME = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<func>.+)$")


def _python_frames(evt) -> list[str]:
    """The Python frames around an op, innermost first: with ``with_stack`` the profiler records
    each Python call as an event named ``"path(line): func"``, parent of the ops it ran."""
    frames, parent = [], getattr(evt, "cpu_parent", None)
    while parent is not None:
        if _FRAME.match(parent.name):
            frames.append(parent.name)
        parent = parent.cpu_parent
    return frames


def call_site(stack: Sequence[str] | None) -> str | None:
    """The innermost frame of a Python stack (innermost first, ``"path(line): func"``) that is
    ours or an Inductor-generated graph, as ``"speedrun/model/record.py:624 _attend"`` or
    ``"<compiled graph> abc123.py:88 call"``; None when no frame qualifies."""
    for frame in stack or ():
        m = _FRAME.match(frame.strip())
        if not m:
            continue
        path = "/" + m["file"].replace("\\", "/").lstrip("/")  # the profiler may shorten paths
        if "/speedrun/" in path and "/site-packages/torch" not in path:
            rel = path[path.rindex("/speedrun/") + 1:]
            return f"{rel}:{m['line']} {m['func']}"
        if "torchinductor" in path:
            return f"<compiled graph> {path.rsplit('/', 1)[-1]}:{m['line']} {m['func']}"
    return None


def group_events(events: Iterable, device: str, default_dtype: str, ceilings: Ceilings,
                 stacks: bool = False) -> list[OpGroup]:
    """Group profiler FunctionEvents into OpGroups.

    ``device`` "cuda": an op's time is the duration of the kernels it launched itself; "cpu": its
    self CPU time.  Ops with zero time are dropped.  ``stacks`` (a profile recorded
    ``with_stack``): count each group's call sites."""
    from torch.autograd import DeviceType

    groups: dict[tuple, OpGroup] = {}
    for evt in events:
        if (evt.device_type != DeviceType.CPU or getattr(evt, "is_async", False) or _is_annotation(evt)
                or _FRAME.match(evt.name) or evt.name.startswith("<built-in")):  # with_stack's Python calls
            continue
        if device == "cuda":
            kernels = [(k.name, float(k.duration)) for k in evt.kernels]
            t = sum(d for _, d in kernels)
        else:
            kernels, t = [], float(evt.self_cpu_time_total)
        # (a launch note keeps its group even when the profiler linked its kernel to the op around
        # it: the post-pass below moves that kernel's time to the note)
        if t <= 0 and not evt.name.startswith(LAUNCH_PREFIX):
            continue
        shapes = [list(s) if isinstance(s, (list, tuple)) else s for s in (evt.input_shapes or [])]
        dtypes = list(getattr(evt, "input_dtypes", None) or [])
        # Host<->device copies run at PCIe/NVLink-C2C speed, not HBM speed: no HBM floor for them.
        host = any(_HOST_COPY.match(k) for k, _ in kernels)
        key = (evt.name, json.dumps(shapes), json.dumps(dtypes), host)
        g = groups.get(key)
        if g is None:
            g = groups[key] = OpGroup(evt.name + (" (host copy)" if host else ""), shapes, dtypes)
            try:
                g.cost = None if host else op_cost(evt.name, shapes, dtypes or None, default_dtype)
            except ValueError:
                g.cost = None
        g.calls += 1
        g.time_us += t
        site = call_site(getattr(evt, "stack", None) or _python_frames(evt)) if stacks else None
        if site is not None:
            g.sources[site] = g.sources.get(site, 0) + 1
        for kname, d in kernels:
            g.kernels[kname] = g.kernels.get(kname, 0.0) + d
    result = _attribute_noted_kernels(list(groups.values())) if device == "cuda" else list(groups.values())
    for g in result:
        if g.cost is not None:
            one = ceilings.floor_us(g.cost, g.name)
            g.floor_us = None if one is None else one * g.calls
    return result


def _attribute_noted_kernels(groups: list[OpGroup]) -> list[OpGroup]:
    """Give each kernel named in launch notes to the notes, wherever the profiler linked it (it
    links a device kernel to the op around its launch, which for our Triton launches may be the
    opaque custom op rather than the note's range): its time is split over the kernel's note
    groups by their call counts.  Groups left without time are dropped."""
    notes: dict[str, list[OpGroup]] = {}
    for g in groups:
        note = parse_launch_note(g.name)
        if note is not None:
            notes.setdefault(note.kernel, []).append(g)
    if not notes:
        return groups
    moved: dict[str, dict[str, float]] = {}  # kernel -> {full device name: µs}
    for g in groups:
        own = parse_launch_note(g.name)
        for full in list(g.kernels):
            base = kernel_key(full)
            if base in notes and (own is None or own.kernel != base):
                us = g.kernels.pop(full)
                g.time_us -= us
                moved.setdefault(base, {})[full] = moved.get(base, {}).get(full, 0.0) + us
    for base, by_name in moved.items():
        targets = notes[base]
        calls = sum(t.calls for t in targets) or 1
        for t in targets:
            for full, us in by_name.items():
                share = us * t.calls / calls
                t.kernels[full] = t.kernels.get(full, 0.0) + share
                t.time_us += share
    return [g for g in groups if g.time_us > 1e-9 or parse_launch_note(g.name) is not None]


def kernel_table(events: Iterable) -> list[dict]:
    """Device kernels grouped by name: calls and total µs (every kernel, attributed or not)."""
    from torch.autograd import DeviceType

    out: dict[str, dict] = {}
    for evt in events:
        if evt.device_type != DeviceType.CUDA or _is_annotation(evt):
            continue
        d = out.setdefault(evt.name, {"kernel": evt.name, "calls": 0, "time_us": 0.0})
        d["calls"] += 1
        d["time_us"] += float(evt.time_range.elapsed_us())
    return sorted(out.values(), key=lambda r: -r["time_us"])


# Gap lengths the timeline sorts idle time into (µs, lower bounds): the first buckets are the
# launch latency between dependent kernels in a full queue, the last ones host work or waits.
GAP_BUCKETS_US = (0.0, 5.0, 20.0, 100.0, 1000.0)


def gpu_timeline(events: Iterable, top: int = 12) -> dict[str, Any] | None:
    """Busy and idle time of the device over the profiled window, and where it idles.

    Every device interval (kernels, memcpy, memset; not annotations) on any stream goes into one
    union; ``span_us`` runs from the first start to the last end, ``busy_us`` is the union's length
    and ``idle_us`` the rest.  Each gap is charged to the pair (kernel that ended last before it,
    kernel that starts it), by base name: a large total at one pair points at host work between
    two launches (Python, small ops, a sync); ``by_length`` sorts the gaps by length
    (:data:`GAP_BUCKETS_US`), which separates the latency between back-to-back kernels from
    host stalls.  Returns None without device events.  Times in µs over all profiled steps."""
    from torch.autograd import DeviceType

    iv = sorted((float(e.time_range.start), float(e.time_range.end), e.name) for e in events
                if e.device_type == DeviceType.CUDA and not _is_annotation(e))
    if not iv:
        return None
    first, cur_end, prev = iv[0][0], iv[0][1], iv[0][2]
    busy, block_start = 0.0, first
    gaps: dict[tuple[str, str], list] = {}
    by_length = [[lo, hi, 0, 0.0] for lo, hi in zip(GAP_BUCKETS_US, GAP_BUCKETS_US[1:] + (float("inf"),))]
    n_gaps = 0
    for start, end, name in iv[1:]:
        if start > cur_end:
            busy += cur_end - block_start
            gap = start - cur_end
            g = gaps.setdefault((kernel_key(prev)[:70], kernel_key(name)[:70]), [0.0, 0])
            g[0] += gap
            g[1] += 1
            n_gaps += 1
            bucket = next(b for b in by_length if gap < b[1])
            bucket[2] += 1
            bucket[3] += gap
            block_start = start
        if end >= cur_end:
            cur_end, prev = end, name
    busy += cur_end - block_start
    span = cur_end - first
    ranked = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "gaps": n_gaps,
            "top_gaps": [{"before": b, "after": a, "idle_us": us, "count": c} for (b, a), (us, c) in ranked],
            "by_length": [{"min_us": lo, "max_us": hi, "count": c, "idle_us": us} for lo, hi, c, us in by_length]}


def kernel_needed_bytes(groups: Sequence[OpGroup]) -> dict[str, float]:
    """Bytes each kernel name needs, from the modeled ops that launched it (an op's bytes split
    over its kernels in proportion to their time).  Our Triton kernels take theirs from their
    launch notes by name (:mod:`speedrun.kernels.launch_notes`), whether or not the profiler
    linked the device kernel to the note's range."""
    need: dict[str, float] = {}
    noted: dict[str, float] = {}
    for g in groups:
        note = parse_launch_note(g.name)
        if note is not None:
            noted[note.kernel] = noted.get(note.kernel, 0.0) + note.nbytes * g.calls
            continue
        if g.cost is None or not g.kernels:
            continue
        total = sum(g.kernels.values()) or 1.0
        for k, us in g.kernels.items():
            need[k] = need.get(k, 0.0) + g.cost.bytes * g.calls * us / total
    need.update(noted)
    return need


# ----------------------------------------------------------------------------------------------
# Nsight Compute


_UNITS = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
          "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30}
NCU_METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum")


def kernel_key(name: str) -> str:
    """A kernel's base name, comparable between the torch profiler and ncu: no ``void``, no
    argument list, no template arguments (``void at::native::f<4, float>(int)`` -> ``at::native::f``)."""
    s = name.strip()
    s = re.sub(r"^void\s+", "", s)
    depth, out = 0, []
    for ch in s:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip()


def parse_ncu_csv(text: str) -> dict[str, dict]:
    """Per-kernel (by :func:`kernel_key`) launches and DRAM bytes read/written from ncu ``--csv``
    output (lines before the CSV header, such as ``==PROF==`` messages, are skipped)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        raise ValueError("no ncu CSV header (a line starting with '\"ID\"') in the ncu output")
    rows = csv.DictReader(io.StringIO("\n".join(lines[start:])))
    out: dict[str, dict] = {}
    seen: dict[str, set] = {}
    for r in rows:
        metric = r.get("Metric Name")
        if metric not in NCU_METRICS:
            continue
        key = kernel_key(r.get("Kernel Name") or r.get("Function Name") or "?")
        raw = (r.get("Metric Value") or "0").replace(",", "")
        try:
            value = float(raw) * _UNITS.get((r.get("Metric Unit") or "byte").strip().lower(), 1)
        except ValueError:
            continue
        d = out.setdefault(key, {"kernel": key, "launches": 0, "dram_read_bytes": 0.0, "dram_write_bytes": 0.0})
        d["dram_read_bytes" if metric.endswith("read.sum") else "dram_write_bytes"] += value
        seen.setdefault(key, set()).add(r.get("ID"))
    for k, ids in seen.items():
        out[k]["launches"] = len(ids)
    return out


@dataclass(frozen=True)
class NcuOptions:
    """What Nsight Compute measures.  ncu replays every kernel it profiles (tens of ms each), so a
    record step (~7,000 kernels) takes many minutes: ``kernel_regex`` keeps kernels whose name
    matches (ncu ``--kernel-name regex:``; e.g. ``_relu2|_dual_layout|_ce_`` for our Triton
    kernels), ``max_launches`` stops after that many profiled launches, ``timeout_s`` bounds the
    whole child run (seconds)."""

    kernel_regex: str | None = None
    max_launches: int | None = None
    timeout_s: float | None = None


def ncu_command(ncu: str, log_file: Path, child: list[str], options: NcuOptions = NcuOptions()) -> list[str]:
    """The ncu command line that measures DRAM bytes of the kernels run between
    cudaProfilerStart/Stop (all of them, or those ``options`` selects)."""
    select = []
    if options.kernel_regex:
        select += ["--kernel-name", "regex:" + options.kernel_regex]
    if options.max_launches:
        select += ["--launch-count", str(options.max_launches)]
    return [ncu, "--clock-control", "none", "--metrics", ",".join(NCU_METRICS), "--csv", "--print-units", "base",
            "--profile-from-start", "off", "--target-processes", "all", *select, "--log-file", str(log_file), *child]


def find_ncu() -> str:
    from speedrun.errors import EnvironmentProblem

    exe = shutil.which("ncu")
    if exe is None:
        raise EnvironmentProblem("--ncu needs Nsight Compute's 'ncu' on PATH (it ships with the CUDA toolkit, "
                                 "e.g. /usr/local/cuda/bin/ncu); add it to PATH or drop --ncu")
    return exe


def run_ncu(arm_spec: str, common: Sequence[str], stage: int, steps: int, warmup: int,
            options: NcuOptions = NcuOptions()) -> dict[str, dict]:
    """Run the same steps in a child process under ncu; returns :func:`parse_ncu_csv` of its CSV.
    The caller should have released its own GPU memory: the child builds the model again."""
    from speedrun.errors import EnvironmentProblem

    ncu = find_ncu()
    with tempfile.TemporaryDirectory(prefix="speedrun-ncu-") as tmp:
        log = Path(tmp) / "ncu.csv"
        child = [sys.executable, "-m", "speedrun.evidence.profile", "--ncu-child",
                 json.dumps({"arm": arm_spec, "common": list(common), "stage": stage, "steps": steps,
                             "warmup": warmup})]
        what = "every kernel" if not (options.kernel_regex or options.max_launches) else \
            f"kernels matching {options.kernel_regex or '.*'!r}, at most {options.max_launches or 'all'} launches"
        print(f"ncu: replaying {what} of {steps} step(s) in a child process"
              + (f" (timeout {options.timeout_s:g} s)" if options.timeout_s else ""), file=sys.stderr, flush=True)
        try:
            proc = subprocess.run(ncu_command(ncu, log, child, options), capture_output=True, text=True,
                                  timeout=options.timeout_s)
        except subprocess.TimeoutExpired:
            raise EnvironmentProblem(
                f"ncu did not finish in {options.timeout_s:g} s (it replays every profiled kernel); profile "
                "fewer: --ncu-kernels REGEX (e.g. '_relu2|_dual_layout|_ce_'), --ncu-launches N, or --steps 1"
            ) from None
        text = log.read_text() if log.exists() else ""
        if '"ID"' not in text:  # some ncu versions keep the CSV on stdout
            text = proc.stdout or text
        if proc.returncode != 0 or '"ID"' not in text:
            tail = (proc.stderr or proc.stdout or text)[-2000:]
            raise EnvironmentProblem(f"ncu failed (exit {proc.returncode}); its output ends with:\n{tail}")
    return parse_ncu_csv(text)


def _ncu_child(spec_json: str) -> int:
    """Inside ncu: warm up, then run the profiled steps between cudaProfilerStart and Stop."""
    import torch

    from speedrun import distributed
    from speedrun.evidence.arms import parse_arm
    from speedrun.evidence.bench import build_session

    spec = json.loads(spec_json)
    arm = parse_arm(spec["arm"])
    info = distributed.setup(arm.config(spec["common"]).train.device)
    session = build_session(arm.name, arm.config(spec["common"]), spec["stage"], info)
    try:
        for _ in range(session.warmup_steps(spec["warmup"])):
            session.step()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for _ in range(spec["steps"]):
            session.step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    finally:
        session.close()
    return 0


# ----------------------------------------------------------------------------------------------
# The profile


@dataclass
class ProfileReport:
    arm: str
    device: str
    steps: int
    ceilings: Ceilings
    groups: list[OpGroup]
    kernels: list[dict]
    ncu: dict[str, dict] | None = None
    total_us: float = 0.0
    notes: list[str] = field(default_factory=list)
    timeline: dict[str, Any] | None = None  # gpu_timeline() of the profiled steps
    wall_us: float | None = None  # host wall clock over the profiled steps (synchronized at both ends)
    device_only: bool = False  # recorded device activity only (no ops, shapes or host-side events)

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for g in self.groups:
            tf, tb = g.achieved()
            rows.append({"op": g.name, "shapes": g.shapes, "dtypes": g.dtypes, "calls": g.calls,
                         "time_us": g.time_us, "kind": g.cost.kind if g.cost else None,
                         "flops": g.cost.flops * g.calls if g.cost else None,
                         "bytes": g.cost.bytes * g.calls if g.cost else None,
                         "achieved_tflops": tf, "achieved_tbps": tb, "floor_us": g.floor_us,
                         "recoverable_us": g.recoverable_us, "kernels": g.kernels, "sources": g.sources})
        return {"arm": self.arm, "device": self.device, "steps": self.steps, "ceilings": asdict(self.ceilings),
                "total_us": self.total_us, "ops": rows, "kernels": self.kernels, "ncu": self.ncu,
                "timeline": self.timeline, "wall_us": self.wall_us, "device_only": self.device_only,
                "notes": self.notes}


def measure_ceilings(device) -> Ceilings:
    """bf16 matmul TFLOP/s and copy TB/s measured now on ``device`` (CUDA only)."""
    from speedrun.evidence.fingerprint import measure_copy_tbps, measure_matmul_tflops

    return Ceilings(measure_matmul_tflops(device=device), measure_copy_tbps(nbytes=2**30, device=device), "measured")


def profile_steps(arm, *, common: Sequence[str] = (), stage: int = 0, steps: int = 3, warmup: int = 2,
                  ceilings: Ceilings | None = None, measure: bool = True, ncu: bool = False,
                  stacks: bool = False, ncu_options: NcuOptions | None = None,
                  device_only: bool = False) -> ProfileReport:
    """Profile ``steps`` optimizer steps of ``arm`` (an ArmSpec or ``NAME=PRESET[:overrides]``).

    Ceilings: ``ceilings`` if given, else measured on a GPU when ``measure``, else none (then no
    floors).  ``ncu``: also measure DRAM bytes per kernel under Nsight Compute (GPU only), with
    ``ncu_options`` (which kernels, how many launches, timeout).
    ``stacks``: record Python stacks, so each op group names the line that called it (slower).
    ``device_only``: record device activity only (kernels, copies; GPU only): no op table, but the
    profiler adds little host time, so the timeline's idle gaps are close to an unprofiled step's
    (with host events recorded the step takes ~1.6x as long and every gap grows).
    """
    import torch
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    from speedrun import distributed
    from speedrun.errors import ConfigError
    from speedrun.evidence.arms import ArmSpec, parse_arm
    from speedrun.evidence.bench import build_session
    from speedrun.train.collector import freeze_long_lived, thaw

    spec = arm if isinstance(arm, ArmSpec) else parse_arm(arm)
    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0, got {steps} and {warmup}")
    cfg = spec.config(common)
    if ncu:
        find_ncu()  # fail before the work when ncu is missing
    info = distributed.setup(cfg.train.device)
    on_gpu = info.device.type == "cuda"
    if ncu and not on_gpu:
        raise ConfigError("--ncu needs a CUDA GPU (Nsight Compute measures GPU kernels)")
    if device_only and (not on_gpu or stacks or ncu):
        raise ConfigError("--device-only records GPU activity alone: it needs a CUDA GPU and excludes --stacks and --ncu")
    session = build_session(spec.name, cfg, stage, info)
    notes = []
    frozen = 0
    try:
        if session.warmup_steps(warmup) > warmup:
            notes.append(f"warmup raised from {warmup} to {session.warmup_steps(warmup)} steps so that the "
                         "profiled steps replay their CUDA graphs (no capture or self-check among them)")
        for _ in range(session.warmup_steps(warmup)):
            session.step()
        # as in `bench step`: a full collection inside a profiled step would show as idle GPU time
        frozen = freeze_long_lived() if cfg.train.gc_freeze else 0
        if ceilings is None:
            if on_gpu and measure:
                ceilings = measure_ceilings(info.device)
            else:
                ceilings = Ceilings()
                notes.append("no ceilings (--no-measure): no floors" if on_gpu else
                             "no ceilings: pass --peak-tflops and --peak-tbps for floors on the CPU")
        activities = ([] if device_only else [ProfilerActivity.CPU]) + ([ProfilerActivity.CUDA] if on_gpu else [])
        if on_gpu:
            torch.cuda.synchronize(info.device)
        # verbose: torch 2.11 attaches the Python stack to each op only then (2.13 also records
        # the frames as parent events); without it 2.11's profiles named no call site
        extra = {"experimental_config": _ExperimentalConfig(verbose=True)} if stacks else {}
        with profile(activities=activities, record_shapes=not device_only, with_stack=stacks, **extra) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                session.step()
            if on_gpu:
                torch.cuda.synchronize(info.device)
            wall_us = (time.perf_counter() - t0) * 1e6
    finally:
        if frozen:
            thaw()
        session.close()
    events = prof.events()
    default_dtype = str(session.dtype).removeprefix("torch.")
    groups = group_events(events, "cuda" if on_gpu else "cpu", default_dtype, ceilings, stacks=stacks)
    kernels = kernel_table(events) if on_gpu else []
    total = sum(k["time_us"] for k in kernels) if on_gpu else sum(g.time_us for g in groups)
    report = ProfileReport(spec.name, str(info.device), steps, ceilings, groups, kernels, total_us=total, notes=notes,
                           timeline=gpu_timeline(events) if on_gpu else None, wall_us=wall_us,
                           device_only=device_only)
    if device_only:
        report.notes.append("device activity only: kernels and the timeline, no op rows (run without "
                            "--device-only for those)")
    if on_gpu:
        need = kernel_needed_bytes(groups)
        for k in kernels:
            k["needed_bytes"] = need.get(k["kernel"])
    if ncu:
        # The child builds its own model: give it this process's GPU memory first.
        del session, prof, events
        gc.collect()
        torch.cuda.empty_cache()
        opts = ncu_options or NcuOptions()
        report.ncu = run_ncu(str(spec), common, stage, steps, warmup, opts)
        if opts.kernel_regex or opts.max_launches:
            report.notes.append(f"ncu measured only kernels matching {opts.kernel_regex or '.*'!r}"
                                f"{f', the first {opts.max_launches} launches' if opts.max_launches else ''}: "
                                "its per-step columns count those launches only")
    distributed.teardown()
    return report


# ----------------------------------------------------------------------------------------------
# Output


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= div:
            return f"{b / div:.2f} {unit}"
    return f"{b:.0f} B"


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _shape_str(g: OpGroup, limit: int = 60) -> str:
    parts = [str(s) for s in g.shapes if s]
    s = " ".join(parts).replace(" ", "")
    return s if len(s) <= limit else s[: limit - 1] + "…"


def render_markdown(report: ProfileReport, roofline_png: str | None = None, top: int = 30) -> str:
    """The per-op and per-kernel inventory as markdown; times are per step (ms)."""
    n = report.steps
    c = report.ceilings
    per = lambda us: us / n / 1000.0  # noqa: E731  µs over all steps -> ms per step
    lines = [
        f"# Profile: {report.arm} on {report.device}, {n} step(s)",
        "",
        f"Ceilings ({c.source}): matmul {_fmt(c.tflops, '.1f')} TFLOP/s (bf16; FP8 counted at 2x), "
        f"memory {_fmt(c.tbps, '.2f')} TB/s.  Profiled time: {per(report.total_us):.3f} ms per step.",
        "Floor = max(FLOPs / peak, bytes / bandwidth) for GEMMs and bytes / bandwidth otherwise; "
        "recoverable = measured - floor.  Bytes are the minimum (inputs read once, outputs written once).",
        "",
    ]
    lines += [f"- {x}" for x in report.notes]
    modeled = [g for g in report.groups if g.cost is not None]
    modeled.sort(key=lambda g: -(g.recoverable_us if g.recoverable_us is not None else g.time_us))
    lines += ["## Known ops, ranked by recoverable time", "",
              "| op | shapes | kind | calls/step | ms/step | GFLOP/step | bytes/step | TFLOP/s | TB/s "
              "| % of ceiling | floor ms | recoverable ms |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for g in modeled[:top]:
        tf, tb = g.achieved()
        if g.floor_us is not None and g.time_us > 0:
            pct = f"{100.0 * g.floor_us / g.time_us:.1f}%"
        else:
            pct = "-"
        lines.append(
            f"| {g.name} | {_shape_str(g)} | {g.cost.kind} | {g.calls / n:g} | {per(g.time_us):.4f} "
            f"| {g.cost.flops * g.calls / n / 1e9:.4f} | {_fmt_bytes(g.cost.bytes * g.calls / n)} "
            f"| {_fmt(tf, '.3f')} | {_fmt(tb, '.3f')} | {pct} "
            f"| {_fmt(None if g.floor_us is None else per(g.floor_us), '.4f')} "
            f"| {_fmt(None if g.recoverable_us is None else per(g.recoverable_us), '.4f')} |")
    if any(g.sources for g in modeled):
        lines += ["", "Called from (the line behind most calls of each row above):", "",
                  "| op | shapes | ms/step | call site |", "| --- | --- | ---: | --- |"]
        for g in modeled[:top]:
            lines.append(f"| {g.name} | {_shape_str(g)} | {per(g.time_us):.4f} | {g.main_source() or '-'} |")
    rec = [g.recoverable_us for g in modeled if g.recoverable_us is not None]
    known = sum(g.time_us for g in modeled)
    lines += ["", f"Known ops: {per(known):.3f} ms/step"
              + (f", recoverable {per(sum(rec)):.3f} ms/step." if rec else ".")]
    other: dict[str, list] = {}
    for g in report.groups:
        if g.cost is None:
            o = other.setdefault(g.name, [0, 0.0])
            o[0] += g.calls
            o[1] += g.time_us
    lines += ["", "## Ops without a model, by time", "", "| op | calls/step | ms/step |", "| --- | ---: | ---: |"]
    for name, (calls, us) in sorted(other.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"| {name} | {calls / n:g} | {per(us):.4f} |")
    if report.kernels:
        lines += ["", "## Kernels, by time", "", "| kernel | calls/step | ms/step | share | bytes needed/step |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for k in report.kernels[:top]:
            share = 100.0 * k["time_us"] / report.total_us if report.total_us else 0.0
            nb = k.get("needed_bytes")
            lines.append(f"| `{k['kernel'][:90]}` | {k['calls'] / n:g} | {per(k['time_us']):.4f} | {share:.1f}% "
                         f"| {_fmt_bytes(None if nb is None else nb / n)} |")
    if report.ncu is not None:
        need: dict[str, float] = {}
        for k in report.kernels:
            if k.get("needed_bytes") is not None:
                key = kernel_key(k["kernel"])
                need[key] = need.get(key, 0.0) + k["needed_bytes"]
        lines += ["", "## Nsight Compute: DRAM bytes measured vs needed (per step)", "",
                  "| kernel | launches/step | read | written | measured | needed | measured / needed |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        rows = sorted(report.ncu.values(), key=lambda r: -(r["dram_read_bytes"] + r["dram_write_bytes"]))
        for r in rows[:top]:
            meas = r["dram_read_bytes"] + r["dram_write_bytes"]
            nb = need.get(r["kernel"])
            ratio = f"{meas / nb:.2f}" if nb else "-"
            lines.append(f"| `{r['kernel'][:90]}` | {r['launches'] / n:g} | {_fmt_bytes(r['dram_read_bytes'] / n)} "
                         f"| {_fmt_bytes(r['dram_write_bytes'] / n)} | {_fmt_bytes(meas / n)} "
                         f"| {_fmt_bytes(None if nb is None else nb / n)} | {ratio} |")
    t = report.timeline
    if t:
        under = ("device activity only recorded: little profiler host cost" if report.device_only
                 else "under the profiler, whose host overhead lengthens gaps")
        wall = f"; host wall {per(report.wall_us):.3f} ms/step" if report.wall_us else ""
        lines += ["", "## GPU timeline: busy and idle", "",
                  f"Span {per(t['span_us']):.3f} ms/step{wall}, busy {per(t['busy_us']):.3f} ms/step "
                  f"({100.0 * t['busy_us'] / t['span_us']:.1f}%), idle {per(t['idle_us']):.3f} ms/step in "
                  f"{t['gaps'] / n:g} gaps/step ({under}).", "",
                  "| idle after | idle before | gaps/step | idle ms/step |", "| --- | --- | ---: | ---: |"]
        for g in t["top_gaps"]:
            lines.append(f"| `{g['before']}` | `{g['after']}` | {g['count'] / n:g} | {per(g['idle_us']):.4f} |")
        if t.get("by_length"):
            lines += ["", "Gaps by length (short ones: latency between back-to-back kernels; long ones: "
                      "the device waited for the host):", "",
                      "| gap length | gaps/step | idle ms/step |", "| --- | ---: | ---: |"]
            for b in t["by_length"]:
                hi = "" if b["max_us"] == float("inf") else f"{b['max_us']:g}"
                label = f">= {b['min_us']:g} us" if not hi else f"{b['min_us']:g}-{hi} us"
                lines.append(f"| {label} | {b['count'] / n:g} | {per(b['idle_us']):.4f} |")
    if roofline_png:
        lines += ["", "## Roofline", "", f"![roofline]({roofline_png})"]
    return "\n".join(lines) + "\n"


def plot_roofline(report: ProfileReport, path: str | Path) -> Path:
    """Log-log roofline: arithmetic intensity (FLOP/byte) vs achieved TFLOP/s per op group, marker
    area by time, with the bandwidth slope and the matmul ceiling when known.  Returns ``path``."""
    from speedrun.evidence.plots import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=100)
    pts: dict[str, list] = {}
    for g in report.groups:
        if g.cost is None or g.cost.flops <= 0 or g.cost.bytes <= 0 or g.time_us <= 0:
            continue
        tf, _ = g.achieved()
        pts.setdefault(g.cost.kind, []).append((g.cost.flops / g.cost.bytes, tf, g.time_us))
    xs_all = [p[0] for v in pts.values() for p in v]
    total = max((p[2] for v in pts.values() for p in v), default=1.0)
    for i, (kind, v) in enumerate(sorted(pts.items())):
        ax.scatter([p[0] for p in v], [p[1] for p in v], s=[10 + 300 * p[2] / total for p in v],
                   color=f"C{i}", alpha=0.6, label=kind)
    c = report.ceilings
    lo = min(xs_all + [0.1]) / 2
    hi = max(xs_all + [1000.0]) * 2
    if c.tbps is not None:
        x = [lo, hi]
        y = [xi * c.tbps for xi in x]  # FLOP/byte x TB/s = TFLOP/s
        if c.tflops is not None:
            knee = c.tflops / c.tbps
            x = [lo, knee, hi] if lo < knee < hi else x
            y = [min(xi * c.tbps, c.tflops) for xi in x]
        label = f"roof: {c.tbps:.2f} TB/s" + (f", {c.tflops:.0f} TFLOP/s" if c.tflops else "")
        ax.plot(x, y, "k-", lw=1.2, label=label)
    elif c.tflops is not None:
        ax.axhline(c.tflops, color="k", lw=1.2, label=f"matmul {c.tflops:.0f} TFLOP/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte, minimal bytes)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"Roofline: {report.arm} on {report.device}")
    ax.grid(alpha=0.3, which="both")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def write_profile(report: ProfileReport, out_dir: str | Path) -> dict[str, Path]:
    """Write ``profile.md``, ``roofline.png`` and ``profile.json`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = plot_roofline(report, out / "roofline.png")
    md = out / "profile.md"
    md.write_text(render_markdown(report, png.name))
    js = out / "profile.json"
    js.write_text(json.dumps(report.to_dict(), indent=2, default=str) + "\n")
    return {"markdown": md, "roofline": png, "json": js}


def cli_profile(args) -> int:
    """``speedrun profile`` (arguments from speedrun.cli.evidence)."""
    from speedrun.errors import ConfigError
    from speedrun.evidence.arms import data_overrides, parse_arm

    arm = parse_arm(args.arm)
    common = data_overrides(args.data, args.val_data, validates=False) + (["train.device=" + args.device] if args.device else []) \
        + list(args.overrides)
    given = (args.peak_tflops, args.peak_tbps)
    if (given[0] is None) != (given[1] is None):
        raise ConfigError("give both --peak-tflops and --peak-tbps, or neither")
    ceilings = Ceilings(*given, "given") if given[0] is not None else None
    report = profile_steps(arm, common=common, stage=args.stage, steps=args.steps, warmup=args.warmup,
                           ceilings=ceilings, measure=not args.no_measure, ncu=args.ncu, stacks=args.stacks,
                           ncu_options=NcuOptions(args.ncu_kernels, args.ncu_launches, args.ncu_timeout),
                           device_only=args.device_only)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    paths = write_profile(report, args.out or f"profile-{arm.name}")
    print(render_markdown(report, top=args.top), end="")
    print(f"written: {paths['markdown']}  {paths['roofline']}  {paths['json']}")
    return 0


if __name__ == "__main__":  # the ncu child: python -m speedrun.evidence.profile --ncu-child JSON
    if len(sys.argv) == 3 and sys.argv[1] == "--ncu-child":
        sys.exit(_ncu_child(sys.argv[2]))
    sys.exit("usage: python -m speedrun.evidence.profile --ncu-child JSON (internal; use 'speedrun profile')")
