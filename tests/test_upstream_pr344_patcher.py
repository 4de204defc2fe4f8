"""CPU tests of ``tools/upstream_pr344.py``: the f411b3d patcher told what differs in PR #344.

Pure tests of the patch logic on small strings always run; ``SPEEDRUN_PR344_SRC`` (a folder with
#344's ``train_gpt.py``, ``triton_kernels.py`` and ``dc_triton_kernels.py`` at c4c209d) also
patches the real files.  The real files are never stored here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


pr = _load("upstream_pr344")
base = pr.base
SHORT = dict(scheduled=45, extension=2, val_tokens=2097152, train_files="/d/webmix_train_*.bin",
             val_files="/d/webmix_val_*.bin")


def _anchor_text(patches) -> str:
    """A stand-in file holding each anchor as often as its patch expects (not runnable)."""
    return "".join(p.anchor if p.anchor.endswith("\n") else p.anchor + "\n" for p in patches for _ in range(p.count))


def test_pr344_reuses_the_f411b3d_patches_but_the_extension_line():
    opts = base.BenchOptions(**SHORT)
    ours = {p.name: p for p in base.train_patches(opts, pr.PR344)}
    theirs = {p.name: p for p in base.train_patches(opts)}
    assert ours.keys() == theirs.keys()
    differ = {n for n in ours if ours[n].anchor != theirs[n].anchor}
    assert differ == {"extension"}
    out = base.apply_patches(_anchor_text(ours.values()), list(ours.values()), "train_gpt.py", "c4c209d")
    assert "num_extension_iterations: int = 2  # [speedrun bench] upstream 45 |" in out
    assert "NUM_EXTENSION_ITERATIONS" not in out and "num_scheduled_iterations: int = 45" in out


def test_profile_stop_goes_between_the_requantisation_and_the_logging():
    opts = base.BenchOptions(**SHORT, profile_start=30, profile_steps=2)
    patches = base.train_patches(opts, pr.PR344)
    stop = next(p for p in patches if p.name == "profile-stop")
    assert stop.anchor == pr.PR344.step_anchor
    head, tail = "    model.quantize_attn_fp8()\n    model.quantize_mlp_fp8()\n", "\n    # logging\n"
    assert stop.replacement.startswith(head) and stop.replacement.endswith(tail)
    assert "if step == 31:" in stop.replacement and "_speedrun_prof.__exit__" in stop.replacement
    assert "'arm': 'upstream-c4c209d'" in stop.replacement
    # the warmup loop's requantisation (no logging after it) is not an anchor match
    warmup = head + 'print0("Resetting Model", console=True)\n'
    assert (warmup + pr.PR344.step_anchor).count(stop.anchor) == 1


def test_scale_patches_copy_every_view_they_name():
    # each anchor in a call of its own, so that the stand-in compiles
    text = "".join(f"torch._scaled_mm(\n{p.anchor})\n" for p in base.kernel_patches(pr.PR344) for _ in range(p.count))
    out, patches = base.patch_kernels(text, pr.PR344)
    assert [p.name for p in patches][:2] == ["aligned-act-scale", "aligned-w2-scale"]  # f411b3d's, kept
    for scale in ("a_scale", "b_scale", "x_scale", "grad_scale", "activation_scale", "W2_scale"):
        assert f"={base.aligned_copy(scale)}," in out, scale
    # no bare scale left in the stand-in but the fresh one an anchor names as context
    assert not re.search(r"scale_[ab]=(?!scaled_weight_scale,)\w+,", out)


def test_the_cross_entropy_backward_scale_is_left_alone():
    """Of the three ``scale_a=grad_scale`` lines only the packed QKV backward's two are copied: the
    cross-entropy backward's scale is a fresh 0-d tensor beside a 0-d ``scale_b``, and a
    1-element copy there fails Inductor's ``_scaled_mm`` lowering (seen on an H100)."""
    ce = ("        grad_scale = grad_input.new_tensor(grad_s, dtype=torch.float32)\n"
          "        grad_x = torch._scaled_mm(\n            grad_input,\n            w_f8.T,\n"
          "            out_dtype=torch.bfloat16,\n            scale_a=grad_scale,\n            scale_b=w_scale,\n")
    qkv = ("        grad_weight = torch._scaled_mm(\n            grad_f8_t, x_f8_t.T,\n"
           "            out_dtype=torch.bfloat16,\n            scale_a=grad_scale,\n            scale_b=x_scale,\n"
           "        grad_input = torch._scaled_mm(\n            grad_f8, weight_f8_t.T,\n"
           "            out_dtype=torch.bfloat16,\n            scale_a=grad_scale,\n"
           "            scale_b=scaled_weight_scale,\n")
    patches = [p for p in pr.KERNEL_PATCHES if p.name.startswith("aligned-grad-scale")]
    out = base.apply_patches(ce + qkv, patches, "triton_kernels.py", "c4c209d")
    assert out.startswith(ce)  # untouched
    assert out[len(ce):].count(f"scale_a={base.aligned_copy('grad_scale')},") == 2
    assert "scale_b=x_scale," in out and "scale_b=scaled_weight_scale," in out


def test_a_count_patch_names_the_expected_count():
    patches = list(pr.KERNEL_PATCHES)
    text = _anchor_text(patches).replace("                scale_a=x_scale,\n", "", 1)  # 2 of the 3 left
    with pytest.raises(base.PatchError, match=r"differs from c4c209d at triton_kernels.py \[aligned-qkv-x-scale\]: "
                                              r"anchor found 2 times \(expected 3\)"):
        base.apply_patches(text, patches, "triton_kernels.py", "c4c209d")


def test_summary_names_the_commit_and_repeated_patches(tmp_path):
    opts = base.BenchOptions(**SHORT)
    patches = base.train_patches(opts, pr.PR344) + base.kernel_patches(pr.PR344)
    text = base.summary(patches, opts, tmp_path, pr.PR344)
    assert text.startswith(f"patched upstream c4c209d -> {tmp_path}")
    assert "aligned-qkv-x-scale" in text and "(x3)" in text


def test_f411b3d_defaults_unchanged():
    """The generalisation leaves the f411b3d patcher's own patches as they were."""
    assert base.F411B3D.commit == "f411b3d" and base.F411B3D.kernel_patches == ()
    assert [p.name for p in base.kernel_patches()] == ["aligned-act-scale", "aligned-w2-scale"]
    ext = next(p for p in base.train_patches(base.BenchOptions()) if p.name == "extension")
    assert ext.anchor == "num_extension_iterations: int = 15"


@pytest.fixture
def pr344_src() -> Path:
    d = os.environ.get("SPEEDRUN_PR344_SRC")
    if not d or not (Path(d) / "train_gpt.py").is_file():
        pytest.skip("SPEEDRUN_PR344_SRC not set to a folder with PR #344's three files (c4c209d)")
    return Path(d)


def test_real_pr344_patches_cleanly(pr344_src, tmp_path):
    out = tmp_path / "up344"
    rc = pr.main(["--src", str(pr344_src), "--out", str(out), "--scheduled", "45", "--extension", "2",
                  "--val-tokens", "2097152", "--train-files", "/x/webmix_train_*.bin",
                  "--val-files", "/x/webmix_val_*.bin", "--profile", "30:2"])
    assert rc == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([*base.UPSTREAM_FILES, "fa3_shim.py", "bench_config.json"])
    for name in ("train_gpt.py", "triton_kernels.py"):
        py_compile.compile(str(out / name), doraise=True)
    train = (out / "train_gpt.py").read_text()
    assert "flash_attn_interface = fa3_shim" in train and "num_extension_iterations: int = 2" in train
    assert train.count("_speedrun_prof.__exit__") == 1
    config = json.loads((out / "bench_config.json").read_text())
    assert config["upstream_commit"] == "c4c209d" and config["total_steps"] == 47
    assert config["stage_starts"] == [0, 15, 30, 45]
    # every _scaled_mm scale is now a copy of its own or a tensor made on the spot
    kernels = (out / "triton_kernels.py").read_text()
    assert kernels.count(f"scale_a={base.aligned_copy('grad_scale')},") == 2  # not the CE backward's
    fresh = {"scaled_weight_scale"}  # weight_scale * qkv_scale: a new tensor
    for m in re.finditer(r"scale_[ab]=([^,\n]+),", kernels + train):
        expr = m.group(1)
        assert expr.startswith("torch.cat([") or ".new_tensor(" in expr or expr in fresh or \
            _made_fresh_in_its_function(kernels + train, m.start(), expr), expr


def _made_fresh_in_its_function(text: str, at: int, name: str) -> bool:
    """``name`` is assigned a ``new_tensor`` in the function that holds position ``at``."""
    start = text.rfind("\n    def ", 0, at)
    start = max(start, text.rfind("\ndef ", 0, at))
    return re.search(rf"\b{name}\s*=\s*\w+\.new_tensor\(", text[start:at]) is not None
