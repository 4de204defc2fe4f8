"""Patch a copy of upstream modded-nanogpt PR #344 (commit c4c209d) to run a short schedule on one GPU.

The candidate arm re-implements PR #344 ("FP8 MLP backward, packed QKV", record #90: reduced-width
Q/K in one packed FP8 GEMM, fused QK-norm/RoPE/pad, FP8 across the MLP).  This patcher lets #344's
own code run beside our candidate on the same GPU with the same short schedule, so that the two
per-step times can be compared stage by stage.  It holds none of upstream's code: it reads a user's
copy of #344's three files (``git show c4c209d:train_gpt.py`` etc. in a clone of
KellerJordan/modded-nanogpt that fetched ``refs/pull/344/head``) and applies the patches of
``tools/upstream_f411b3d.py`` (its docstring lists and explains each; the same code runs here,
told what differs in #344 by :data:`PR344`):

* every f411b3d patch, unchanged: FA3 -> ``fa3_shim`` (torch ``varlen_attn``: #344 pads its 96-wide
  Q/K to V's 128 before FA3, so the shim sees equal widths), cu_seqlens slots
  (``TRAIN_MAX_NUM_DOCS`` 256 per training shape, validation ``T // 200``), cycling local shards,
  train/val globs, schedule and validation sizes, ``nvidia-smi``, stage marks, optional profile;
* ``extension``: #344 reads ``NUM_EXTENSION_ITERATIONS`` (default 45) from the environment; the
  patch writes ``--extension`` in its place, as for f411b3d's literal 15;
* ``profile-stop``: #344 ends a step by re-quantising both the attention and the MLP weights; the
  profile's stop goes after those two calls of the training loop (not the warmup loop's);
* triton_kernels.py, besides f411b3d's two scale copies (its FP8 MLP of record, still present):
  every ``torch._scaled_mm`` scale that may be a per-layer view into a scale buffer
  (``scales[i:i+1]``, not 16-byte aligned for most layers, refused by torch 2.11's cuBLASLt as for
  f411b3d) is copied into a buffer of its own (:func:`upstream_f411b3d.aligned_copy`): the
  ``_scaled_mm`` helper of the FP8 MLP (both scales), and the packed QKV GEMM's ``x_scale`` (forward
  and weight gradient) and ``grad_scale`` (both backward GEMMs; the same text also occurs once in
  the softcapped cross-entropy's backward, where the scale is already a fresh tensor, so the copy
  costs a tiny kernel and changes nothing).

Not patched: ``QK_HEAD_DIM`` (96), ``TRAIN_SEED`` (unset: random seed, as upstream's record runs),
``DISABLE_FP8`` (unset).

GPU command (one ``run`` call, ``carry=[".carry"]``; ``.carry/pr344/`` holds #344's three files,
``.carry/upstream/tiktoken_cache/`` and the webmix shards as for f411b3d)::

    bash tools/upstream_pr344.sh --scheduled 45 --extension 2 --val-tokens 2097152

Usage:  python tools/upstream_pr344.py --src DIR --out OUTDIR [the options of upstream_f411b3d.py]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _load_base():
    """``tools/upstream_f411b3d.py`` as a module (tools/ is not a package)."""
    name = "_speedrun_upstream_f411b3d"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("upstream_f411b3d.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


base = _load_base()
Patch, TAG, aligned_copy = base.Patch, base.TAG, base.aligned_copy

UPSTREAM_COMMIT = "c4c209d"
_UNALIGNED = ("torch 2.11's cuBLASLt refuses FP8 scale pointers that are not 16-byte aligned "
              "(CUBLAS_STATUS_NOT_SUPPORTED); #344 passes per-layer views (scales[i:i+1]) into one buffer")


def _scale_patch(name: str, arg: str, scale: str, indent: int, count: int, where: str) -> Patch:
    pad = " " * indent
    return Patch(name, f"{pad}{arg}={scale},\n",
                 f"{pad}{arg}={aligned_copy(scale)},  {TAG} upstream {scale} ({where})\n", _UNALIGNED, count)


KERNEL_PATCHES = (
    Patch("aligned-mm-scales", "        scale_a=a_scale,\n        scale_b=b_scale,\n",
          f"        scale_a={aligned_copy('a_scale')},  {TAG} upstream a_scale (FP8 MLP GEMMs)\n"
          f"        scale_b={aligned_copy('b_scale')},  {TAG} upstream b_scale\n", _UNALIGNED),
    _scale_patch("aligned-qkv-x-scale", "scale_a", "x_scale", 16, 3, "packed QKV forward"),
    _scale_patch("aligned-qkv-x-scale-bwd", "scale_b", "x_scale", 12, 1, "packed QKV weight gradient"),
    # the packed QKV backward's two GEMMs only, each anchored with a neighbouring line: the
    # cross-entropy backward's ``scale_a=grad_scale`` is a fresh 0-d tensor, and a 1-element copy
    # beside its 0-d ``scale_b`` fails Inductor's _scaled_mm lowering
    Patch("aligned-grad-scale-wgrad",
          "            grad_f8_t, x_f8_t.T,\n            out_dtype=torch.bfloat16,\n            scale_a=grad_scale,\n",
          "            grad_f8_t, x_f8_t.T,\n            out_dtype=torch.bfloat16,\n"
          f"            scale_a={aligned_copy('grad_scale')},  {TAG} upstream grad_scale (packed QKV weight gradient)\n",
          _UNALIGNED),
    Patch("aligned-grad-scale-dgrad",
          "            scale_a=grad_scale,\n            scale_b=scaled_weight_scale,\n",
          f"            scale_a={aligned_copy('grad_scale')},  {TAG} upstream grad_scale (packed QKV input gradient)\n"
          "            scale_b=scaled_weight_scale,\n", _UNALIGNED),
)

PR344 = base.Upstream(
    commit=UPSTREAM_COMMIT,
    extension_anchor='num_extension_iterations: int = int(os.environ.get("NUM_EXTENSION_ITERATIONS", "45"))',
    extension_default=45,
    step_anchor="    model.quantize_attn_fp8()\n    model.quantize_mlp_fp8()\n\n    # logging\n",
    step_anchor_split=len("    model.quantize_attn_fp8()\n    model.quantize_mlp_fp8()\n"),
    kernel_patches=KERNEL_PATCHES,
)


def main(argv: list[str] | None = None) -> int:
    return base.main(argv, target=PR344, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())
