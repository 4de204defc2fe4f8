"""``speedrun doctor``: check this machine before a timed run, and say how to fix what is missing.

:func:`run_doctor` gathers checks (each ``ok``, ``warn`` or ``fail`` with a detail line) and
problems ``(what, fix)``.  Problems that make a timed GPU run impossible are *blocking*; with
``require_gpu`` the CLI exits 1 on them.  Everything runs on CPU too, reporting the GPU as absent.
"""

from __future__ import annotations

import glob
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from speedrun.evidence.fingerprint import node_fingerprint

DEFAULT_DATA_GLOB = "data/fineweb10B/fineweb_*.bin"
_FP8_MIN_CAPABILITY = (8, 9)


@dataclass
class DoctorReport:
    """Result of :func:`run_doctor`.

    ``checks``: ``(name, status, detail)`` with status "ok" | "warn" | "fail" | "info";
    ``problems``: ``(what, fix)``; ``blocking``: the subset of problems that block a timed GPU run.
    """

    checks: list[tuple[str, str, str]] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)
    blocking: list[tuple[str, str]] = field(default_factory=list)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    require_gpu: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems

    def add(self, name: str, status: str, detail: str) -> None:
        self.checks.append((name, status, detail))

    def problem(self, what: str, fix: str, blocking: bool = False) -> None:
        self.problems.append((what, fix))
        if blocking:
            self.blocking.append((what, fix))

    def exit_code(self) -> int:
        return 1 if self.require_gpu and self.blocking else 0

    def render(self) -> str:
        mark = {"ok": "[ok]  ", "warn": "[warn]", "fail": "[FAIL]", "info": "[info]"}
        width = max((len(n) for n, _, _ in self.checks), default=10)
        lines = ["speedrun doctor", ""]
        lines += [f"{mark.get(s, s)} {n:<{width}}  {d}" for n, s, d in self.checks]
        fp = {k: v for k, v in self.fingerprint.items() if k != "errors" and v not in (None, [])}
        if fp:
            lines += ["", "node fingerprint:"] + [f"  {k}: {v}" for k, v in fp.items()]
        if self.problems:
            lines += ["", f"{len(self.problems)} problem(s):"]
            for what, fix in self.problems:
                tag = " (blocks a timed GPU run)" if (what, fix) in self.blocking else ""
                lines += [f"  - {what}{tag}", f"    fix: {fix}"]
        else:
            lines += ["", "no problems found"]
        return "\n".join(lines) + "\n"


def _check_versions(rep: DoctorReport) -> None:
    rep.add("python", "ok", platform.python_version())
    rep.add("torch", "ok", f"{torch.__version__} (CUDA build {torch.version.cuda})")
    try:
        import triton

        rep.add("triton", "ok", triton.__version__)
    except ImportError as e:
        rep.add("triton", "fail", f"not importable: {e}")
        rep.problem("Triton is not importable (the fused kernels need it)",
                    "pip install triton==3.6.0", blocking=True)


def _check_gpu(rep: DoctorReport) -> bool:
    if not torch.cuda.is_available():
        status = "fail" if rep.require_gpu else "info"
        rep.add("gpu", status, "no CUDA device visible to torch")
        if rep.require_gpu:
            rep.problem("no CUDA GPU visible to torch",
                        "run on a GPU node with a CUDA build of torch (torch.version.cuda is "
                        f"{torch.version.cuda}); check CUDA_VISIBLE_DEVICES and nvidia-smi",
                        blocking=True)
        return False
    n = torch.cuda.device_count()
    names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
    cap = torch.cuda.get_device_capability(0)
    rep.add("gpu", "ok", f"{n}x {', '.join(names)} (sm{cap[0]}{cap[1]})")
    return True


def fp8_scaled_mm_check(device: str = "cuda") -> tuple[bool, str]:
    """Multiply small FP8 e4m3 matrices with ``torch._scaled_mm`` and compare to a float matmul of
    the same FP8 values.  Returns ``(ok, detail)``."""
    if not hasattr(torch, "_scaled_mm"):
        return False, "torch._scaled_mm is missing in this torch"
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(32, 64, device=device, generator=g).to(torch.float8_e4m3fn)
    b = torch.randn(16, 64, device=device, generator=g).to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device=device, dtype=torch.float32)
    try:
        out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError) as e:
        return False, f"torch._scaled_mm failed: {e}"
    out = out[0] if isinstance(out, tuple) else out  # torch < 2.5 returned (out, amax)
    ref = a.float() @ b.float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    return err < 1e-2, f"torch._scaled_mm e4m3 32x64x16: relative error {err:.1e}"


def _check_fp8(rep: DoctorReport, has_gpu: bool) -> None:
    if not hasattr(torch, "_scaled_mm"):
        rep.add("fp8", "fail", "torch._scaled_mm missing")
        rep.problem("this torch has no torch._scaled_mm (FP8 matmuls)", "install torch >= 2.11",
                    blocking=rep.require_gpu)
        return
    if not has_gpu:
        rep.add("fp8", "info", "torch._scaled_mm present; no GPU to check it on")
        return
    cap = torch.cuda.get_device_capability(0)
    if cap < _FP8_MIN_CAPABILITY:
        rep.add("fp8", "fail", f"sm{cap[0]}{cap[1]} < sm89: no FP8 tensor cores")
        rep.problem(f"GPU is sm{cap[0]}{cap[1]}; FP8 matmuls need sm89+ (Ada/Hopper)",
                    "use an H100/H200-class GPU, or disable the FP8 paths in the config", blocking=True)
        return
    ok, detail = fp8_scaled_mm_check()
    rep.add("fp8", "ok" if ok else "fail", detail)
    if not ok:
        rep.problem(f"FP8 check failed: {detail}",
                    "update torch/driver; see the detail for the failing call", blocking=True)


def _check_attention(rep: DoctorReport, timed: bool = False) -> None:
    """Each backend's self-check; with ``timed`` (a GPU and measurements on) also its forward +
    backward time at the record's stage-3 shape."""
    try:
        from speedrun.attention import available_backends
    except ImportError:
        rep.add("attention", "info", "speedrun.attention.available_backends not available in this build")
        return
    try:
        backends = available_backends()
    except Exception as e:  # noqa: BLE001 - a broken backend must not stop the other checks
        rep.add("attention", "fail", f"available_backends() raised {type(e).__name__}: {e}")
        rep.problem("attention backend probe crashed", "run python -c 'import speedrun.attention as a; "
                    "print(a.available_backends())' to see the traceback", blocking=True)
        return
    working = [name for name, (ok, _) in backends.items() if ok]
    times = {}
    if timed and working:
        try:
            from speedrun.evidence.attention_timing import doctor_timings

            times = doctor_timings(working)
        except Exception as e:  # noqa: BLE001 - timing is extra information, never a failure
            rep.add("attention", "info", f"stage-3 timing failed: {type(e).__name__}: {e}"[:200])
    for name, (ok, detail) in backends.items():
        rep.add(f"attention:{name}", "ok" if ok else "warn", detail + (f"; {times[name]}" if name in times else ""))
    if not working:
        rep.problem("no attention backend passes its check",
                    "see the attention:* lines above; the pure-torch reference should always work",
                    blocking=True)


def _check_data(rep: DoctorReport, data_glob: str | None) -> None:
    pattern = data_glob or DEFAULT_DATA_GLOB
    files = sorted(glob.glob(pattern))
    if files:
        size = sum(os.path.getsize(f) for f in files)
        empty = [f for f in files if os.path.getsize(f) == 0]
        rep.add("data", "warn" if empty else "ok", f"{len(files)} shard(s), {size / 2**30:.2f} GiB match {pattern}")
        if empty:
            rep.problem(f"{len(empty)} empty shard(s), e.g. {empty[0]}", "re-create or re-download them",
                        blocking=data_glob is not None)
        return
    rep.add("data", "warn" if data_glob else "info", f"no shards match {pattern}")
    if data_glob:
        rep.problem(f"no data shards match {pattern}",
                    "check the glob (quote it), or generate/download shards: see `speedrun data --help`",
                    blocking=True)


def _check_tokenizer(rep: DoctorReport) -> None:
    d = os.environ.get("SPEEDRUN_TOKENIZER_DIR")
    if d:
        p = Path(d)
        missing = [f for f in ("encoder.json", "vocab.bpe") if not (p / f).is_file()]
        if missing:
            rep.add("tokenizer", "warn", f"SPEEDRUN_TOKENIZER_DIR={d} lacks {', '.join(missing)}")
            rep.problem(f"SPEEDRUN_TOKENIZER_DIR={d} lacks {', '.join(missing)}",
                        "point it at a folder holding GPT-2 encoder.json and vocab.bpe")
        else:
            rep.add("tokenizer", "ok", f"GPT-2 files in SPEEDRUN_TOKENIZER_DIR={d}")
        return
    c = os.environ.get("TIKTOKEN_CACHE_DIR")
    if c and Path(c).is_dir() and any(Path(c).iterdir()):
        rep.add("tokenizer", "ok", f"tiktoken cache TIKTOKEN_CACHE_DIR={c}")
        return
    rep.add("tokenizer", "warn", "neither SPEEDRUN_TOKENIZER_DIR nor a filled TIKTOKEN_CACHE_DIR is set")
    rep.problem("no offline GPT-2 tokenizer (tiktoken would try the network)",
                "export SPEEDRUN_TOKENIZER_DIR=/path/to/folder/with/encoder.json+vocab.bpe")


def run_doctor(require_gpu: bool = False, data_glob: str | None = None, measure: bool = True) -> DoctorReport:
    """Run every check.  ``data_glob`` names the shards to look for (default
    ``data/fineweb10B/fineweb_*.bin``, then missing data is only noted); ``measure`` runs the
    fingerprint's matmul/copy measurements when a GPU is present."""
    rep = DoctorReport(require_gpu=require_gpu)
    _check_versions(rep)
    has_gpu = _check_gpu(rep)
    _check_fp8(rep, has_gpu)
    _check_attention(rep, timed=measure and has_gpu)
    _check_data(rep, data_glob)
    _check_tokenizer(rep)
    rep.fingerprint = node_fingerprint(measure=measure and has_gpu)
    for err in rep.fingerprint.get("errors", []):
        rep.add("fingerprint", "warn", err)
    return rep
