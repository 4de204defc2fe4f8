"""Patch a copy of upstream modded-nanogpt (commit f411b3d) to run a short schedule on one GPU.

Purpose: measure upstream's ms per optimizer step per stage on our H200 with the same attention
backend our package uses (torch's built-in varlen FlashAttention), so the two per-step times can
be compared.  This script holds none of upstream's code: it reads a user's copy of the three
upstream files (``train_gpt.py``, ``triton_kernels.py``, ``dc_triton_kernels.py``; also accepted
as ``upstream_<name>``), applies small textual patches whose anchors must each match exactly once,
and writes the result plus our ``fa3_shim.py`` into ``--out`` (a scratch folder outside the repo,
or an ignored one).  Model, optimizer, kernels and compile settings are left as upstream has them.

Patches (in train_gpt.py, plus one in triton_kernels.py; dc_triton_kernels.py is copied unchanged):

* FA3 from the kernels hub -> ``fa3_shim`` (torch ``varlen_attn``; FA3's window is in tokens, as is
  torch's, so ``window_size=(bm_size, 0)`` passes through unchanged);
* schedule: ``num_scheduled_iterations`` / ``num_extension_iterations`` / ``val_tokens`` /
  ``val_loss_every`` from the command line;
* data: train/val globs from ``--train-files`` / ``--val-files`` (else upstream's ``$DATA_PATH``
  default), and the shard iterator cycles so a single webmix shard suffices (upstream needs a
  second file at start-up and runs out of a 25M-token shard);
* cu_seqlens padding: upstream's ``TRAIN_MAX_NUM_DOCS = {16384: 64, 32768: 96, 49152: 128}``
  overflows on webmix (up to 88 / 154 / 211 entries needed), so it becomes 256 for each
  training shape (what our runs use: ``train.max_docs=256``), and the validation fallback
  ``T // 300`` becomes ``T // 200`` (896 -> 1408 entries for 262,144 tokens; webmix val needs 886);
* ``nvidia-smi`` missing no longer kills the run (it is only logged);
* optional (``--profile START:COUNT``): torch.profiler around those optimizer steps, every CUDA
  kernel's calls and time written to ``upstream_kernels.json`` (compare with our own profile by
  ``tools/compare_kernels.py``); with ``--profile-device-only`` the profiler records CUDA
  activity alone (as ``speedrun profile --device-only``: little host cost, so busy and idle time
  are close to an unprofiled step's) and the file also gets the GPU timeline (span, busy, idle
  gaps) computed by ``speedrun.evidence.profile.gpu_timeline``, imported from this repository;
* triton_kernels.py: the FP8 MLP down projection's two scale tensors are copied into buffers of
  their own before ``torch._scaled_mm``: upstream passes views into per-layer scale buffers
  (``scales[i:i+1]``), which are not 16-byte aligned for most layers, and torch 2.11's cuBLASLt
  refuses those with CUBLAS_STATUS_NOT_SUPPORTED (our own FP8 cache keeps one
  16-byte slot per scale for the same reason).  The copy is a concatenation, not ``.clone()``,
  which Inductor elides (:func:`aligned_copy`).  Cost: two tiny kernels per layer.

Not patched, because they already work on one GPU under torchrun: world size 1 gives 8
gradient-accumulation micro-batches of the same per-GPU shape as 8 GPUs; the optimizer switches
its collectives off; sparse bigram comms are off; ``run_evals`` and ``save_checkpoint`` default to
False; tiktoken's ``get_encoding("gpt2")`` reads ``$TIKTOKEN_CACHE_DIR``; the log goes to
``logs/<uuid>.txt`` under the working directory.

GPU command: one ``run`` call with ``carry=[".carry"]``, the repo tree as the cwd, ``.carry/``
holding the webmix ``webmix_{train,val}_000000.bin.xz`` shards and ``.carry/upstream/`` the three
upstream files plus ``tiktoken_cache/``::

    bash tools/upstream_f411b3d.sh            # extra arguments go to this patcher

It decompresses the shards to /tmp/webmix, patches into /tmp/up, starts upstream there in its own
session and waits up to WAIT_S=540 s; if compilation made it slower than that, the same command
in a second call (machine still warm) waits for that run instead of starting another.  Results
in $OUT: upstream_log.txt (upstream's own log, ``logs/<uuid>.txt`` in its working directory; stdout
gets only the console lines), upstream_stdout.txt, upstream_patch.txt, bench_config.json and
upstream_steps.json.  Its core, inline::

    R=$PWD; python3 tools/upstream_f411b3d.py --src .carry/upstream --out /tmp/up \
        --train-files '/tmp/webmix/webmix_train_*.bin' --val-files '/tmp/webmix/webmix_val_*.bin' &&
    (cd /tmp/up && TIKTOKEN_CACHE_DIR=$R/.carry/upstream/tiktoken_cache timeout -k 15 540 \
        torchrun --standalone --nproc_per_node=1 train_gpt.py 2>&1 | tee $OUT/upstream_stdout.txt)
    cp /tmp/up/logs/*.txt $OUT/upstream_log.txt
    python3 tools/upstream_step_times.py $OUT/upstream_log.txt --config /tmp/up/bench_config.json

``upstream_step_times.py`` prints the median ms per optimizer step of each stage.  Expect minutes
of torch.compile and kernel warmup ("Compiling model and warming up kernels", upstream's README
says ~7 on first execution) before the first timed step.

Usage:  python tools/upstream_f411b3d.py --src DIR --out OUTDIR [--scheduled 105]
        [--extension 30] [--val-tokens 2097152] [--val-every 0] [--train-files GLOB]
        [--val-files GLOB] [--max-docs 256 | --max-docs 16384:128,32768:192,49152:256]
        [--profile START:COUNT [--profile-device-only]]
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

UPSTREAM_COMMIT = "f411b3d"
UPSTREAM_FILES = ("train_gpt.py", "triton_kernels.py", "dc_triton_kernels.py")
SHIM = Path(__file__).with_name("fa3_shim.py")
REPO = Path(__file__).resolve().parents[1]  # the profile patch imports speedrun.evidence.profile from here
# Upstream's Hyperparameters.val_batch_size (an anchor below checks it is still this).
VAL_BATCH_SIZE = 4 * 64 * 1024 * 8
# Tokens per rank of the three training stages: 8/16/24 x 2048 per GPU.
TRAIN_SHAPES = (16384, 32768, 49152)
# Attributes of FA3's flash_attn_interface that fa3_shim provides.
SHIMMED_ATTRS = frozenset({"flash_attn_varlen_func"})
TAG = "# [speedrun bench]"


class PatchError(Exception):
    """Upstream text does not look like f411b3d where a patch needs it, or bad options."""


@dataclass(frozen=True)
class Patch:
    """Replace ``anchor`` (which must occur exactly ``count`` times, once unless stated) by
    ``replacement``.

    ``replacement`` None only checks that the anchor is there: used for values our patches rely on.
    """

    name: str
    anchor: str
    replacement: str | None
    why: str
    count: int = 1


@dataclass(frozen=True)
class Upstream:
    """What differs between the upstream commits this patcher handles (``tools/upstream_pr344.py``
    describes PR #344's; the rest of the patches are common).

    ``extension_anchor``: the ``num_extension_iterations`` line; ``step_anchor``: text at the end
    of a training step, after whose first ``step_anchor_split`` characters the profile's stop is
    inserted (the whole anchor when None); ``kernel_patches``: further patches of
    ``triton_kernels.py``."""

    commit: str = UPSTREAM_COMMIT
    extension_anchor: str = "num_extension_iterations: int = 15"
    extension_default: int = 15
    step_anchor: str = "    model.quantize_mlp_fp8(bootstrap_down=(step < 16))\n"
    step_anchor_split: int | None = None
    kernel_patches: tuple[Patch, ...] = ()


F411B3D = Upstream()


@dataclass
class BenchOptions:
    """What the patched upstream run does differently from a record run."""

    scheduled: int = 105
    extension: int = 30
    val_tokens: int = VAL_BATCH_SIZE
    val_every: int = 0
    train_files: str | None = None
    val_files: str | None = None
    max_docs: dict[int, int] = field(default_factory=lambda: {t: 256 for t in TRAIN_SHAPES})
    val_docs_divisor: int = 200
    profile_start: int = -1  # first optimizer step (0-based) under torch.profiler; -1: none
    profile_steps: int = 0
    profile_device_only: bool = False  # CUDA activity only, plus the GPU timeline

    def stage_starts(self) -> list[int]:
        """First step (0-based) of stages 1, 2, 3 and the extension, as upstream computes them."""
        s = self.scheduled
        return [0, round(s / 3), round(2 * s / 3), s]


def validate(opts: BenchOptions) -> None:
    """Refuse options upstream's schedule cannot run (it would fail minutes into compilation)."""
    if opts.scheduled < 12:
        raise PatchError(f"--scheduled {opts.scheduled}: need >= 12 (4+ steps per stage; 2 are skipped when timing)")
    if opts.extension < 2:
        # warmup samples steps scheduled..scheduled+1, and schedule tables end at the last step
        raise PatchError(f"--extension {opts.extension}: upstream's warmup needs >= 2 extension steps")
    if opts.val_tokens <= 0 or opts.val_tokens % VAL_BATCH_SIZE:
        raise PatchError(f"--val-tokens {opts.val_tokens}: must be a positive multiple of {VAL_BATCH_SIZE:,}")
    if opts.val_every < 0:
        raise PatchError("--val-every must be >= 0 (0 = only the final validation)")
    if set(opts.max_docs) != set(TRAIN_SHAPES) or min(opts.max_docs.values()) < 2:
        raise PatchError(f"--max-docs must give >= 2 entries for each of {TRAIN_SHAPES}, got {opts.max_docs}")
    if opts.val_docs_divisor < 1:
        raise PatchError("val_docs_divisor must be >= 1")
    if opts.profile_device_only and not opts.profile_steps:
        raise PatchError("--profile-device-only needs --profile START:COUNT")
    if opts.profile_steps:
        total = opts.scheduled + opts.extension
        if opts.profile_steps < 1 or not 0 <= opts.profile_start <= total - opts.profile_steps:
            raise PatchError(f"--profile {opts.profile_start}:{opts.profile_steps}: the steps must lie in 0..{total - 1}")


def train_patches(opts: BenchOptions, target: Upstream = F411B3D) -> list[Patch]:
    """The patches for upstream's train_gpt.py, in file order."""
    up_docs = "{16384: 64, 32768: 96, 49152: 128}"
    new_docs = "{" + ", ".join(f"{t}: {opts.max_docs[t]}" for t in TRAIN_SHAPES) + "}"
    patches = [
        Patch("kernels-import", "from kernels import get_kernel\n",
              f"import itertools  {TAG} for the cycling shard iterator\n"
              f"import fa3_shim  {TAG} torch varlen_attn in place of FA3 from the kernels hub\n",
              "no `kernels` package / FA3 / network on the benchmark machine"),
        Patch("fa3-handle",
              "flash_attn_interface = get_kernel('kernels-community/flash-attn3', version=1).flash_attn_interface",
              f"flash_attn_interface = fa3_shim  {TAG} upstream: FA3 (kernels-community/flash-attn3)",
              "same attention backend as our package (torch.nn.attention.varlen.varlen_attn)"),
        Patch("max-docs", f"TRAIN_MAX_NUM_DOCS = {up_docs}",
              f"TRAIN_MAX_NUM_DOCS = {new_docs}  {TAG} upstream {up_docs}",
              "webmix documents are shorter: up to 88/154/211 cu_seqlens entries per 16k/32k/49k micro-batch"),
        Patch("val-docs", "next_multiple_of_n(num_tokens_local // 300, n=128))",
              f"next_multiple_of_n(num_tokens_local // {opts.val_docs_divisor}, n=128))  {TAG} upstream // 300",
              "validation micro-batches (262,144 tokens) hold up to 885 webmix documents; upstream pads to 896"),
        Patch("cycle-shards", "file_iter = iter(files)  # Use itertools.cycle(files) for multi-epoch training",
              f"file_iter = itertools.cycle(files)  {TAG} upstream iter(files)",
              "one 25M-token webmix shard: upstream needs a second file at start-up and more tokens than one shard"),
    ]
    if opts.train_files is not None:
        patches.append(Patch("train-files",
                             'train_files: str = os.path.join(data_path, "data/fineweb10B/fineweb_train_*.bin")',
                             f"train_files: str = {opts.train_files!r}  {TAG} |", "webmix shards"))
    if opts.val_files is not None:
        patches.append(Patch("val-files",
                             'val_files: str = os.path.join(data_path, "data/fineweb10B/fineweb_val_*.bin")',
                             f"val_files: str = {opts.val_files!r}  {TAG} |", "webmix shards"))
    patches += [
        Patch("val-tokens", "val_tokens: int = 10485760",
              f"val_tokens: int = {opts.val_tokens}  {TAG} upstream 10485760 |", "validation is not timed: keep it short"),
        Patch("val-batch-size", "val_batch_size: int = 4 * 64 * 1024 * 8", None,
              f"--val-tokens must be a multiple of it ({VAL_BATCH_SIZE:,})"),
        Patch("scheduled", "num_scheduled_iterations: int = 1270",
              f"num_scheduled_iterations: int = {opts.scheduled}  {TAG} upstream 1270 |", "short schedule"),
        Patch("extension", target.extension_anchor,
              f"num_extension_iterations: int = {opts.extension}  {TAG} upstream {target.extension_default} |",
              "short schedule"),
        Patch("val-every", "val_loss_every: int = 250",
              f"val_loss_every: int = {opts.val_every}  {TAG} upstream 250 |", "no mid-run validations"),
        Patch("nvidia-smi",
              '    return subprocess.run(["nvidia-smi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True).stdout',
              f'    try:  {TAG} a missing nvidia-smi only loses a log section\n'
              '        return subprocess.run(["nvidia-smi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True).stdout\n'
              '    except OSError as e:\n'
              '        return f"nvidia-smi unavailable: {e}"',
              "logging only"),
    ]
    patches.append(stage_marks_patch(opts))
    if opts.profile_steps:
        patches += profile_patches(opts.profile_start, opts.profile_steps, opts.profile_device_only, target)
    return patches


MARKS_FILE = "stage_marks.txt"


def stage_marks_patch(opts: BenchOptions) -> Patch:
    """Rank 0 appends ``upstream_NAME EPOCH_SECONDS`` to ``stage_marks.txt`` when each stage, the
    extension and the final validation begin (host time, before the step's work is queued): the
    phases ``tools/gpu_clocks.py`` splits a clock log by."""
    names = ("stage1", "stage2", "stage3", "extension")
    marks = {start: f"upstream_{name}" for start, name in zip(opts.stage_starts(), names)}
    marks[opts.scheduled + opts.extension] = "upstream_validation"
    anchor = "    last_step = (step == train_steps)\n"
    code = (f"    if master_process and step in {marks!r}:  {TAG} wall-clock marks for gpu_clocks.py\n"
            f"        with open({MARKS_FILE!r}, 'a') as _speedrun_f:\n"
            f"            _speedrun_f.write({marks!r}[step] + ' %.3f\\n' % time.time())\n")
    return Patch("stage-marks", anchor, anchor + code, "SM clocks per stage (tools/gpu_clocks.py)")


PROFILE_FILE = "upstream_kernels.json"


def profile_patches(start: int, count: int, device_only: bool = False, target: Upstream = F411B3D) -> list[Patch]:
    """torch.profiler around optimizer steps ``start .. start+count-1``; rank 0 writes every CUDA
    kernel's calls and total µs to ``upstream_kernels.json`` in the working directory, in the
    format of the ``kernels`` table of ``speedrun profile``'s profile.json (so
    ``tools/compare_kernels.py`` can put the two side by side), built by the same function
    (``speedrun.evidence.profile.kernel_table``, imported from this repository).  ``device_only``:
    CUDA activity alone, and the file also gets ``timeline`` (``gpu_timeline``: span, busy and idle
    µs over the profiled steps).  Those steps' logged times include the profiler's overhead."""
    last = start + count - 1
    activities = "[torch.profiler.ProfilerActivity.CUDA]" if device_only else (
        "[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]")
    begin = (f"    if step == {start}:  {TAG} kernel profile of steps {start}..{last}\n"
             "        torch.cuda.synchronize()\n"
             f"        _speedrun_prof = torch.profiler.profile(activities={activities})\n"
             "        _speedrun_prof.__enter__()\n")
    end = (f"    if step == {last}:  {TAG} end of the kernel profile\n"
           "        torch.cuda.synchronize()\n"
           "        _speedrun_prof.__exit__(None, None, None)\n"
           "        if master_process:\n"
           "            import json as _speedrun_json, sys as _speedrun_sys\n"
           f"            _speedrun_sys.path.insert(0, {str(REPO)!r})\n"
           "            from speedrun.evidence.profile import gpu_timeline, kernel_table\n"
           "            _speedrun_events = _speedrun_prof.events()\n"
           f"            _speedrun_out = {{'arm': 'upstream-{target.commit}', 'steps': {count}, 'first_step': {start},\n"
           f"                             'device_only': {device_only!r}, 'kernels': kernel_table(_speedrun_events)}}\n"
           f"            if {device_only!r}:\n"
           "                _speedrun_out['timeline'] = gpu_timeline(_speedrun_events)\n"
           f"            with open({PROFILE_FILE!r}, 'w') as _f:\n"
           "                _speedrun_json.dump(_speedrun_out, _f)\n"
           "        del _speedrun_prof\n")
    train_anchor = "    # --------------- TRAINING SECTION -----------------\n"
    step_anchor = target.step_anchor
    split = len(step_anchor) if target.step_anchor_split is None else target.step_anchor_split
    return [
        Patch("profile-start", train_anchor, begin + train_anchor, "per-kernel comparison with our profile"),
        Patch("profile-stop", step_anchor, step_anchor[:split] + end + step_anchor[split:],
              "per-kernel comparison with our profile"),
    ]


def aligned_copy(name: str) -> str:
    """Source of a copy of the 1-element scale ``name`` in a buffer of its own (offset 0, so
    16-byte aligned).  Not ``.clone()``: Inductor drops a clone feeding an extern kernel and passes
    the original view (seen on the H200: ``reinterpret_tensor(scales, (1,), (1,), 1)``); a
    concatenation must be materialised, and its first element sits at the buffer's start."""
    return f"torch.cat([{name}.reshape(1), {name}.new_zeros(3)])[:1]"


def kernel_patches(target: Upstream = F411B3D) -> list[Patch]:
    """The patches for upstream's triton_kernels.py."""
    why = ("torch 2.11's cuBLASLt refuses FP8 scale pointers that are not 16-byte aligned "
           "(CUBLAS_STATUS_NOT_SUPPORTED); upstream passes per-layer views (scales[i:i+1]) into one buffer")
    return [
        Patch("aligned-act-scale", "                scale_a=activation_scale,\n",
              f"                scale_a={aligned_copy('activation_scale')},  {TAG} upstream activation_scale (unaligned view)\n", why),
        Patch("aligned-w2-scale", "                scale_b=W2_scale,\n",
              f"                scale_b={aligned_copy('W2_scale')},  {TAG} upstream W2_scale (unaligned view)\n", why),
        *target.kernel_patches,
    ]


def patch_kernels(text: str, target: Upstream = F411B3D) -> tuple[str, list[Patch]]:
    """Patched triton_kernels.py text and the patches applied."""
    patches = kernel_patches(target)
    out = apply_patches(text, patches, "triton_kernels.py", target.commit)
    compile(out, "triton_kernels.py", "exec")
    return out, patches


def apply_patches(text: str, patches: list[Patch], filename: str, commit: str = UPSTREAM_COMMIT) -> str:
    """Apply each patch in turn; raise :class:`PatchError` naming the first anchor not found exactly
    as often as the patch expects (once, unless its ``count`` says otherwise)."""
    for p in patches:
        n = text.count(p.anchor)
        if n != p.count:
            found = "not found" if n == 0 else f"found {n} times"
            expected = "" if p.count == 1 else f" (expected {p.count})"
            raise PatchError(
                f"upstream differs from {commit} at {filename} [{p.name}]: anchor {found}{expected}: {p.anchor!r}"
            )
        if p.replacement is not None:
            text = text.replace(p.anchor, p.replacement)
    return text


def check_attention_uses(text: str, filename: str = "train_gpt.py", commit: str = UPSTREAM_COMMIT) -> None:
    """Fail unless every ``flash_attn_interface.X`` upstream uses is one the shim provides."""
    used = set(re.findall(r"\bflash_attn_interface\.(\w+)", text))
    missing = used - SHIMMED_ATTRS
    if missing:
        raise PatchError(f"{filename} uses flash_attn_interface.{sorted(missing)}, which fa3_shim does not provide")
    if not used:
        raise PatchError(f"upstream differs from {commit} at {filename}: no flash_attn_interface call found")
    for leftover in ("get_kernel", "from kernels import", "import kernels"):
        if leftover in text:
            raise PatchError(f"{filename} still refers to {leftover!r} after patching")


def patch_train(text: str, opts: BenchOptions, target: Upstream = F411B3D) -> tuple[str, list[Patch]]:
    """Patched train_gpt.py text and the patches applied."""
    validate(opts)
    patches = train_patches(opts, target)
    out = apply_patches(text, patches, "train_gpt.py", target.commit)
    check_attention_uses(out, commit=target.commit)
    compile(out, "train_gpt.py", "exec")  # a patch that breaks the syntax fails here, not on the GPU
    return out, patches


def find_sources(src: Path) -> dict[str, Path]:
    """``{upstream name: path}`` for the three files in folder ``src`` (``NAME`` or ``upstream_NAME``)."""
    if not src.is_dir():
        raise PatchError(f"--src {src}: not a folder (it must hold {', '.join(UPSTREAM_FILES)})")
    found = {}
    for name in UPSTREAM_FILES:
        for cand in (src / name, src / f"upstream_{name}"):
            if cand.is_file():
                found[name] = cand
                break
        else:
            raise PatchError(f"--src {src}: no {name} (or upstream_{name}) there")
    return found


def write_outdir(sources: dict[str, Path], out: Path, opts: BenchOptions, target: Upstream = F411B3D) -> list[Patch]:
    """Write the patched train_gpt.py, the two kernel files, fa3_shim.py and bench_config.json."""
    train, patches = patch_train(sources["train_gpt.py"].read_text(), opts, target)
    kernels, kpatches = patch_kernels(sources["triton_kernels.py"].read_text(), target)
    patches = patches + kpatches
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_gpt.py").write_text(train)
    (out / "triton_kernels.py").write_text(kernels)
    for name in UPSTREAM_FILES[1:]:
        if name != "triton_kernels.py":
            shutil.copyfile(sources[name], out / name)
    shutil.copyfile(SHIM, out / SHIM.name)
    config = {
        "upstream_commit": target.commit,
        **{k: v for k, v in asdict(opts).items() if k != "max_docs"},
        "max_docs": {str(k): v for k, v in opts.max_docs.items()},
        "stage_starts": opts.stage_starts(),
        "total_steps": opts.scheduled + opts.extension,
        "patches": [p.name for p in patches if p.replacement is not None],
    }
    (out / "bench_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return patches


def parse_max_docs(spec: str) -> dict[int, int]:
    """``"256"`` (every training shape) or ``"16384:128,32768:192,49152:256"``."""
    try:
        if ":" not in spec:
            return {t: int(spec) for t in TRAIN_SHAPES}
        pairs = (item.split(":") for item in spec.split(","))
        return {int(k): int(v) for k, v in pairs}
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --max-docs {spec!r}: use N or 16384:N,32768:N,49152:N") from None


def summary(patches: list[Patch], opts: BenchOptions, out: Path, target: Upstream = F411B3D) -> str:
    """Human-readable account of what was changed, for the run's log."""
    lines = [f"patched upstream {target.commit} -> {out}"]
    for p in patches:
        if p.replacement is None:
            lines.append(f"  checked  {p.name:15s} {p.why}")
        else:
            kept = set(p.anchor.splitlines())  # context lines an anchor carries are not news
            changed = [ln for ln in p.replacement.splitlines() if ln not in kept and ln.strip()]
            new = (changed or p.replacement.strip().splitlines())[0].strip()
            times = "" if p.count == 1 else f" (x{p.count})"
            lines.append(f"  patched  {p.name:15s} {new}{times}\n           {'':15s} why: {p.why}")
    starts = opts.stage_starts()
    lines.append(f"  schedule: stages start at steps {starts[:3]}, extension at {starts[3]}, "
                 f"{opts.scheduled + opts.extension} steps in all")
    for label, pattern in (("train", opts.train_files), ("val", opts.val_files)):
        if pattern is not None and not glob.glob(pattern):
            lines.append(f"  WARNING: no file matches the {label} glob {pattern!r} yet")
    return "\n".join(lines)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description or __doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, type=Path, help="folder with upstream's three files")
    ap.add_argument("--out", required=True, type=Path, help="folder to write the runnable copy into")
    ap.add_argument("--scheduled", type=int, default=BenchOptions.scheduled, help="num_scheduled_iterations")
    ap.add_argument("--extension", type=int, default=BenchOptions.extension, help="num_extension_iterations")
    ap.add_argument("--val-tokens", type=int, default=BenchOptions.val_tokens)
    ap.add_argument("--val-every", type=int, default=BenchOptions.val_every, help="0: final validation only")
    ap.add_argument("--train-files", help="glob of training shards (default: upstream's $DATA_PATH/data/fineweb10B/...)")
    ap.add_argument("--val-files", help="glob of validation shards")
    ap.add_argument("--max-docs", type=parse_max_docs, default=None,
                    help="cu_seqlens entries per training micro-batch: N for all shapes, or T:N,... (default 256)")
    ap.add_argument("--profile", metavar="START:COUNT", type=parse_profile, default=(-1, 0),
                    help=f"torch.profiler over steps START..START+COUNT-1; kernels to {PROFILE_FILE} (default: off)")
    ap.add_argument("--profile-device-only", action="store_true",
                    help="with --profile: record CUDA activity only (little host cost) and add the GPU timeline")
    return ap


def parse_profile(spec: str) -> tuple[int, int]:
    """``"130:2"`` -> (130, 2)."""
    try:
        start, count = (int(v) for v in spec.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad --profile {spec!r}: use START:COUNT, e.g. 130:2") from None
    return start, count


def main(argv: list[str] | None = None, target: Upstream = F411B3D, description: str | None = None) -> int:
    args = build_parser(description).parse_args(argv)
    opts = BenchOptions(scheduled=args.scheduled, extension=args.extension, val_tokens=args.val_tokens,
                        val_every=args.val_every, train_files=args.train_files, val_files=args.val_files,
                        profile_start=args.profile[0], profile_steps=args.profile[1],
                        profile_device_only=args.profile_device_only)
    if args.max_docs is not None:
        opts.max_docs = args.max_docs
    try:
        patches = write_outdir(find_sources(args.src), args.out, opts, target)
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summary(patches, opts, args.out, target))
    return 0


if __name__ == "__main__":
    sys.exit(main())
