"""Upstream f411b3d's own code, loaded from its files on the CPU for the equivalence tests.

``train_gpt.py`` is a script: importing it would start a distributed run.  :func:`exec_upstream`
takes only the definitions a test needs (by name, from the syntax tree), applies anchored text
patches (:data:`PATCHES`: CUDA-only calls, and two spots whose eager CPU semantics differ from the
compiled GPU run), and executes them in a namespace that supplies the script's globals (``args``,
``device``, ``world_size``, ...).  Loaders on top: the model (:func:`load_upstream_gpt`), the
schedule, the optimizer and the data generator.  The model's evaluation forward runs with three
stand-ins:

- FA3's ``flash_attn_varlen_func``: a dense masked attention with FA3's contract (causal, documents
  from ``cu_seqlens``, ``window_size=(left, 0)`` lets query ``i`` see keys ``i - left .. i``);
- the ReLU² MLP's Hopper kernel: ``relu(x @ W1.T)^2 @ W2`` with the square taken in fp32, as the
  kernel's epilogue does;
- the DC correction: upstream's own autograd Function and Triton kernels (they need
  ``TRITON_INTERPRET=1``), called below the wrapper that refuses CPU tensors.

PR #344's model (``load_upstream_gpt(..., pr344=True)``) runs its own fused QK kernel the same way.
The MLP golden runs upstream's own MLP kernel instead (:func:`load_upstream_mlp`,
:func:`run_upstream_mlp`): its persistent Hopper kernel and FP8 scale kernels from
``triton_kernels.py``, in the interpreter made to round as a GPU does
(``tests/interpreter_numerics.py``).

Nothing here is project code: it exists so that tests can run upstream next to ours.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import sys
import uuid
from dataclasses import dataclass
from itertools import accumulate, pairwise
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# The definitions the evaluation forward uses.
NEEDED = ("norm", "CastedLinearT", "Yarn", "AttnArgs", "dc_gate", "CausalSelfAttention",
          "next_multiple_of_n", "ForwardScheduleConfig", "GPT", "get_bigram_hash", "Hyperparameters")

# (anchor, replacement, expected count) in train_gpt.py, applied before anything is kept.
PATCHES = (
    ("torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count", "132", 1),
    ("torch.empty_like(x, pin_memory=True)", "torch.empty_like(x)", 1),
    # The key offset copies between overlapping views of k.  Upstream runs it compiled, where the
    # copy is functionalised and reads k before the write (a shift by one position); eager on the
    # CPU copies row by row and would smear position 0 down the whole sequence.
    ("k[:, 1:, :, self.head_dim // 2:] = k[:, :-1, :, self.head_dim // 2:]",
     "k[:, 1:, :, self.head_dim // 2:] = k[:, :-1, :, self.head_dim // 2:].clone()", 1),
    # The data generator's CUDA transfers and pinned buffers: the CPU keeps the tensors where they are.
    ('device="cuda", non_blocking=True', 'device="cpu"', 4),
    ("torch.empty(num_tokens, dtype=torch.uint16, pin_memory=True)", "torch.empty(num_tokens, dtype=torch.uint16)", 1),
    # NorMuon's mantissa join runs compiled upstream; eager CPU torch has no uint32 shift.  int32
    # holds the same 32 bits (the shift wraps into the sign, the casts back keep the low 16 bits).
    ("(p.to(torch.uint32) << 16) | mantissa.to(torch.uint32)", "(p.to(torch.int32) << 16) | mantissa.to(torch.int32)", 1),
)


def fa3_varlen_reference(q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                         softmax_scale, window_size):
    """FA3's varlen contract on (T, H, D) tensors, dense: fp32 math, output in q's dtype."""
    assert causal and torch.equal(cu_seqlens_q, cu_seqlens_k)
    left, right = window_size
    assert right == 0
    T = q.shape[0]
    doc = torch.bucketize(torch.arange(T), cu_seqlens_q[1:].long(), right=True)
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    allowed = (doc[:, None] == doc[None, :]) & (j <= i)
    if left >= 0:
        allowed &= i - j <= left
    s = torch.einsum("ihd,jhd->hij", q.float(), k.float()) * softmax_scale
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hij,jhd->ihd", s.softmax(-1), v.float()).to(q.dtype).contiguous()


def relu2_mlp_reference(x, w1, w2):
    """Upstream's ``FusedLinearReLUSquareFunction`` without FP8: ``post = relu(x @ w1.T)^2`` stored
    in x's dtype, then ``post @ w2`` (w2 is (hidden, D))."""
    flat = x.reshape(-1, x.shape[-1])
    post = F.relu((flat @ w1.T).float()).square().to(x.dtype)
    return (post @ w2).view(x.shape)


def _load_file_module(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dc_correction(dc_module: ModuleType):
    """Upstream's ``dc_attention_postonly_nodd_correction_add_base_triton`` below its CUDA-only
    shape check: its own autograd Function, forward and backward Triton kernels."""
    def dc_correction(base_out, q, k, v, dc_weights, softmax_lse, *, scaling, window, seq_lens):
        assert softmax_lse is None
        w1, w2 = dc_weights
        no_lse = torch.empty(0, device=q.device, dtype=torch.float32)
        return dc_module._DCPostOnlyCorrectionAddBaseTriton.apply(
            base_out, q, k, v, w1, w2, seq_lens.to(torch.int32), no_lse, float(scaling), int(window), 16, 32)
    return dc_correction


def exec_upstream(src: Path, names: tuple[str, ...], env: dict, *, strip_compile: bool = False,
                  file: str = "train_gpt.py", patches=PATCHES) -> dict:
    """Execute the top-level definitions ``names`` of upstream's ``file`` (functions, classes, and
    single-name assignments such as ``TRAINING_STAGES = [...]``), in file order, in a namespace
    seeded with ``env``; returns that namespace.  ``patches`` (:data:`PATCHES` for
    ``train_gpt.py``) are applied first.  ``strip_compile`` drops ``@torch.compile(...)``
    decorators (the CPU runs the same code eagerly).
    """
    text = (src / file).read_text()
    for anchor, replacement, count in patches:
        found = text.count(anchor)
        if found != count:
            raise RuntimeError(f"upstream {file}: anchor {anchor!r} found {found}x, expected {count}")
        text = text.replace(anchor, replacement)

    def name_of(node):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            return node.name
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if len(targets) == 1 and isinstance(targets[0], ast.Name):
                return targets[0].id
        return None

    kept = [n for n in ast.parse(text).body if name_of(n) in names]
    missing = set(names) - {name_of(n) for n in kept}
    if missing:
        raise RuntimeError(f"upstream {file} lacks {sorted(missing)}")
    if strip_compile:
        for node in kept:
            for fn in [node, *getattr(node, "body", [])]:
                if isinstance(fn, ast.FunctionDef):
                    fn.decorator_list = [d for d in fn.decorator_list if "torch.compile" not in ast.unparse(d)]
    ns = dict(torch=torch, nn=nn, F=F, Tensor=Tensor, math=math, os=os, uuid=uuid, dataclass=dataclass,
              accumulate=accumulate, pairwise=pairwise, device=torch.device("cpu"))
    ns.update(env)
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(src / file), "exec"), ns)
    return ns


# PR #344 (c4c209d): the key offset moved into its QK kernel, so that patch has no anchor there.
PR344_PATCHES = tuple(p for p in PATCHES if not p[0].startswith("k[:, 1:, :, self.head_dim // 2:]"))
# PR #344's fused QK norm + RoPE + key offset + padding (its eval and bf16 training path), from
# triton_kernels.py; run under the interpreter within interpreter_numerics.gpu_numerics().
PR344_QK_NAMES = ("_qk_norm_rope_pad_forward_kernel", "_qk_norm_rope_pad_backward_kernel", "qk_norm_rope_pad_forward",
                  "qk_norm_rope_pad_backward", "QKNormRoPEPadFunction", "QKNormRoPEPad")
# Launch parameters only: each (token, head) row is computed on its own, so rows per program change
# no value; 256 rows make the interpreter's programs 32-64x fewer.
PR344_QK_PATCHES = (("block_m = 4 if key_offset else 8", "block_m = 256", 1),
                    ("    block_m=8, num_warps=4,\n):\n    tokens, heads2, qk_dim = qk.shape",
                     "    block_m=256, num_warps=4,\n):\n    tokens, heads2, qk_dim = qk.shape", 1))


def load_upstream_gpt(src: Path, *, bigram_vocab_size: int, val_batch_size: int = 8192, pr344: bool = False,
                      **hyper) -> SimpleNamespace:
    """The namespace of upstream's model definitions (``GPT``, ``ForwardScheduleConfig``,
    ``get_bigram_hash``, ``args``, ...), ready to build a CPU model in evaluation mode.  ``hyper``:
    further ``Hyperparameters`` fields (e.g. ``bigram_dim``, ``bigram_sign_table_rows``).

    ``pr344``: ``src`` holds PR #344's files (c4c209d): its 96-wide Q/K model, whose attention runs
    PR #344's own QK kernel (``QKNormRoPEPad``: run the model inside
    :func:`interpreter_numerics.gpu_numerics`)."""
    sys.path.insert(0, str(src))
    try:
        dc_module = _load_file_module("upstream_dc_triton_kernels", src / "dc_triton_kernels.py")
    finally:
        sys.path.remove(str(src))
    env = dict(
        world_size=1, grad_accum_steps=1, grad_scale=1.0,
        dist=SimpleNamespace(get_world_size=lambda: 1),
        flash_attn_interface=SimpleNamespace(flash_attn_varlen_func=fa3_varlen_reference),
        dc_attention_postonly_nodd_correction_add_base_triton=_dc_correction(dc_module),
        ReLUSqrdMLP=relu2_mlp_reference,
    )
    if pr344:
        import triton
        import triton.language as tl

        qk = exec_upstream(src, PR344_QK_NAMES, dict(triton=triton, tl=tl), file="triton_kernels.py",
                           patches=PR344_QK_PATCHES)
        env.update(QKNormRoPEPad=qk["QKNormRoPEPad"], triton=triton)  # GPT.init_mlp sizes buffers with triton.cdiv
    ns = exec_upstream(src, NEEDED, env, patches=PR344_PATCHES if pr344 else PATCHES)
    ns["args"] = ns["Hyperparameters"](bigram_vocab_size=bigram_vocab_size, val_batch_size=val_batch_size, **hyper)
    return SimpleNamespace(**ns)


def load_upstream_schedule(src: Path, scheduled: int, extension: int) -> SimpleNamespace:
    """Upstream's training schedule for ``scheduled`` + ``extension`` steps: ``training_schedule``
    (``TrainingSchedule``), ``get_muon_momentum`` and ``warmup_steps`` (the steps its compile
    warmup samples), computed by upstream's own code."""
    ns = exec_upstream(src, ("TrainingStage", "TrainingSchedule", "TRAINING_STAGES"), {})
    ns["training_schedule"] = ns["TrainingSchedule"](ns["TRAINING_STAGES"], scheduled, extension, cooldown_frac=0.60)
    ns["transition_steps"] = [start for start, _ in ns["training_schedule"].boundaries[1:]]
    # get_muon_momentum and warmup_steps read the globals set above
    ns = exec_upstream(src, ("get_muon_momentum", "warmup_steps"), ns)
    return SimpleNamespace(**ns)


def _transpose_add(src: Tensor, dst: Tensor) -> None:
    dst.add_(src.T)


def _transpose_copy(src: Tensor, dst: Tensor) -> None:
    dst.copy_(src.T)


def _xxt(A: Tensor, out: Tensor) -> None:  # A @ A^T, as upstream's Triton kernel (bf16 out)
    torch.matmul(A, A.mT, out=out)


def _xtx(A: Tensor, out: Tensor) -> None:
    torch.matmul(A.mT, A, out=out)


def _ba_plus_caa(A: Tensor, alpha: float, beta: float, out: Tensor) -> None:
    """``alpha * A @ A.T + beta * A`` for symmetric A (upstream's kernel computes A Aᵀ)."""
    mm = torch.baddbmm if A.ndim > 2 else torch.addmm
    mm(A, A, A.mT, beta=beta, alpha=alpha, out=out)


def load_upstream_optimizer(src: Path) -> SimpleNamespace:
    """Upstream's ``NorMuonAndAdam`` (with ``polar_express``) on one process, run eagerly: its
    ``torch.compile`` decorators are dropped and its Triton kernels (X Xᵀ, Xᵀ X, bA + cA², the tiled
    transposes) are replaced by the torch calls they compute."""
    return SimpleNamespace(**exec_upstream(
        src, ("polar_express_coeffs", "polar_express", "_sparse_comms_active", "ParamConfig", "NorMuonAndAdam"),
        dict(dist=torch.distributed, world_size=1, grad_accum_steps=1, XXT=_xxt, XTX=_xtx,
             ba_plus_cAA=_ba_plus_caa, transpose_add=_transpose_add, transpose_copy=_transpose_copy),
        strip_compile=True))


def load_upstream_loader(src: Path, *, bigram_vocab_size: int) -> SimpleNamespace:
    """Upstream's data generator (``distributed_data_generator`` with its ``Shard`` and shard
    reader) on one process: batches stay on the CPU."""
    import glob
    import threading

    ns = exec_upstream(src, ("_load_data_shard", "BOS_ID", "TRAIN_MAX_NUM_DOCS", "Shard", "get_bigram_hash",
                             "next_multiple_of_n", "Hyperparameters", "distributed_data_generator"),
                       dict(glob=glob, threading=threading, Path=Path,
                            dist=SimpleNamespace(is_initialized=lambda: False)))
    ns["args"] = ns["Hyperparameters"](bigram_vocab_size=bigram_vocab_size)
    return SimpleNamespace(**ns)


def upstream_optimizer_arguments(manager_cls) -> dict:
    """The keyword arguments upstream's ``TrainingManager.__init__`` builds its optimizer with
    (param table, scatter and work orders, Adam and NorMuon defaults: literals there), captured by
    running it up to that call."""
    captured = {}

    class Captured(Exception):
        pass

    def capture(named_params, **kwargs):
        captured.update(kwargs)
        raise Captured

    init = manager_cls.__init__
    saved = init.__globals__.get("NorMuonAndAdam")
    init.__globals__["NorMuonAndAdam"] = capture
    try:
        init(SimpleNamespace(), SimpleNamespace(named_parameters=lambda: []))
    except Captured:
        pass
    finally:
        init.__globals__["NorMuonAndAdam"] = saved
    return captured


# ----------------------------------------------------------------------------------------------
# Upstream's ReLU² MLP as its training forward runs it (its own Hopper kernel, in Triton's CPU
# interpreter): for the MLP golden fixture, which the presets' MLP kernels are compared against

# The definitions taken from triton_kernels.py (importing it compiles a CUDA C kernel).
MLP_KERNEL_NAMES = ("linear_relu_square_kernel", "_dummy_f32", "_get_dummy_f32", "linear_relu_square",
                    "FusedLinearReLUSquareFunction", "reduce_mlp_activation_scales_kernel",
                    "reduce_mlp_activation_scales", "quantize_transpose_mlp_down_weights_kernel",
                    "quantize_transpose_mlp_down_weights")
MLP_SMS = 8  # the SM count upstream's persistent MLP kernel is told: the CPU runs that many programs
KERNEL_PATCHES = (
    # the persistent grid's size: a GPU's SM count, which the CPU has not
    ('torch.cuda.get_device_properties("cuda").multi_processor_count', str(MLP_SMS), 1),
)
# GPT.__init__'s FP8 MLP state at its initial values (upstream registers these buffers)
MLP_FP8_LAYERS = 12
MLP_DOWN_WEIGHT_TILES = 576  # upstream's (12, 576) partial amax of the down weights: (3072 / 64) * (768 / 64)
ACT_HEADROOM = 1.80  # GPT.forward's reduce_mlp_activation_scales(..., headroom=1.80) at the end of each forward


def load_upstream_mlp(src: Path) -> SimpleNamespace:
    """Upstream's MLP kernel and the FP8 state around it: ``FusedLinearReLUSquareFunction`` (its
    ``linear_relu_square`` Hopper kernel, persistent over :data:`MLP_SMS` programs),
    ``reduce_mlp_activation_scales``, ``quantize_transpose_mlp_down_weights`` and
    ``quantize_mlp_fp8`` (``GPT``'s method, run on a stand-in ``self`` holding the MLP bank and the
    buffers it reads).  Run them with ``TRITON_INTERPRET=1`` inside
    :func:`interpreter_numerics.gpu_numerics`."""
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor

    ns = exec_upstream(src, MLP_KERNEL_NAMES, dict(triton=triton, tl=tl, TensorDescriptor=TensorDescriptor),
                       file="triton_kernels.py", patches=KERNEL_PATCHES)
    gpt = next((n for n in ast.parse((src / "train_gpt.py").read_text()).body
                if isinstance(n, ast.ClassDef) and n.name == "GPT"), None)
    method = next((n for n in getattr(gpt, "body", ()) if isinstance(n, ast.FunctionDef) and n.name == "quantize_mlp_fp8"),
                  None)
    if method is None:
        raise RuntimeError("upstream train_gpt.py lacks GPT.quantize_mlp_fp8")
    env = dict(torch=torch, quantize_transpose_mlp_down_weights=ns["quantize_transpose_mlp_down_weights"])
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(src / "train_gpt.py"), "exec"), env)
    ns["quantize_mlp_fp8"] = env["quantize_mlp_fp8"]
    return SimpleNamespace(**ns)


def run_upstream_mlp(up: SimpleNamespace, x: Tensor, w1: Tensor, w2: Tensor, g: Tensor, *, fp8: bool) -> dict:
    """One layer of upstream's MLP, forward and backward: ``x`` (T, D) bf16 (the normed input),
    ``w1`` (H, D) and ``w2`` (H, D) bf16 (c_fc and c_proj as upstream's bank stores them), ``g``
    (T, D) bf16 the gradient of the output.  Returns fp32 ``y`` (T, D), ``dx``, ``dw1`` (H, D),
    ``dw2`` (H, D); with ``fp8`` also ``act_scale``, the activation scale the recorded call used.

    ``fp8``: the training path of the record.  The bank (layer 0 = the weights, the other layers
    zero) goes through ``quantize_mlp_fp8(bootstrap_down=True)``; the layer's arguments are built
    as ``GPT.forward`` builds them (x quantised by its own amax, the dequantisation scale
    ``up_scale * amax / 448``); a first call measures the activation amax, which
    ``reduce_mlp_activation_scales`` turns into the scale of the recorded second call, as a
    training step's forward does for the next one."""
    T, D = x.shape
    H = w1.shape[0]
    bank = torch.zeros(MLP_FP8_LAYERS, 2, H, D, dtype=w1.dtype)
    bank[0, 0], bank[0, 1] = w1, w2
    c_fc, c_proj = w1.clone().requires_grad_(), w2.clone().requires_grad_()
    xg = x.clone().requires_grad_()
    out = {}
    if fp8:
        me = SimpleNamespace(mlp_bank=bank, _mlp_down_proj_next_scales=torch.ones(MLP_FP8_LAYERS),
                             _mlp_down_proj_scales=torch.ones(MLP_FP8_LAYERS),
                             _mlp_down_weight_partial_amax=torch.empty(MLP_FP8_LAYERS, MLP_DOWN_WEIGHT_TILES))
        with torch.no_grad():
            up.quantize_mlp_fp8(me, bootstrap_down=True)
        act_scales = torch.ones(MLP_FP8_LAYERS)
        partial_amax = torch.zeros(MLP_FP8_LAYERS - 1, MLP_SMS)

        def mlp(inp, a, b):
            amax = inp.detach().abs().max().clamp(min=1e-12)
            x_f8 = (inp.detach() * (448.0 / amax)).to(torch.float8_e4m3fn)
            me._mlp_dequant_scale_buf.copy_(me._mlp_up_proj_scales[0:1]).mul_(amax).div_(448.0)
            return up.FusedLinearReLUSquareFunction.apply(
                inp, a, b, me._mlp_up_proj_f8[0], me._mlp_dequant_scale_buf, x_f8, me._mlp_down_proj_f8[0],
                me._mlp_down_proj_scales[0:1], act_scales[0:1], partial_amax[0])

        with torch.no_grad():
            mlp(x, w1, w2)
        up.reduce_mlp_activation_scales(partial_amax, act_scales[:MLP_FP8_LAYERS - 1], headroom=ACT_HEADROOM)
        out["act_scale"] = act_scales[0].item()
        y = mlp(xg, c_fc, c_proj)
    else:
        y = up.FusedLinearReLUSquareFunction.apply(xg, c_fc, c_proj)
    y.backward(g)
    out.update(y=y.detach().float(), dx=xg.grad.float(), dw1=c_fc.grad.float(), dw2=c_proj.grad.float())
    return out
