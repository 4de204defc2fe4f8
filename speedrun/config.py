"""Typed run configuration and named presets.

A run is described by one :class:`RunConfig` holding a :class:`ModelConfig`, a :class:`DataConfig`
and a :class:`TrainConfig`.  Presets are plain functions returning a fresh ``RunConfig``; command
line overrides are ``section.field=value`` strings applied by :func:`apply_overrides`, which checks
the field exists and converts the value to the field's declared type.

Units: token counts are tokens (not sequences), times are seconds unless a name says ``_ms``,
learning rates are absolute.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from speedrun.errors import ConfigError

# train.ce_sigmoid's values; speedrun.kernels.cross_entropy takes them from here
CE_SIGMOID_CHOICES = ("exact", "tanh")
# train.ce_grad_layout's values (speedrun.kernels.options.KernelOptions)
CE_GRAD_LAYOUT_CHOICES = ("transpose", "dual")
CUDA_GRAPHS_CHOICES = ("auto", "on", "off")
# model.attention_backend: "auto" or one of speedrun.attention.BACKENDS (a test keeps the two equal)
ATTENTION_BACKEND_CHOICES = ("auto", "reference", "flex", "varlen", "fa3", "cudnn", "fa4")
# train.mlp_gemm's and train.triton_launch's values (speedrun.kernels.options.KernelOptions)
MLP_GEMM_CHOICES = ("auto", "fused", "tma", "split")
TRITON_LAUNCH_CHOICES = ("cached", "plain")
# The model's named switches and their values (ModelConfig.validate, speedrun.config_check)
MODEL_CHOICES = {"kernels": ("reference", "triton", "fp8", "fp8_full"),
                 "qkv_path": ("reference", "fused", "fused_fp8"), "architecture": ("core", "record"),
                 "fp8_input_scaling": ("current", "delayed"), "mlp_input_quant": ("kernel", "graph"),
                 "embedding_grad": ("autograd", "atomic", "atomic_graph"),
                 "mlp_weight_grad": ("autograd", "accumulate")}


@dataclass
class Stage:
    """One stage of the staged schedule (record recipe §2.4/§4).

    A stage starts at ``start_step`` and lasts until the next stage's start.  ``batch_tokens`` is
    the global number of training tokens per optimizer step, ``max_seq_len`` the cap a document is
    cut at, ``window_short``/``window_long`` the sliding attention windows in tokens, and
    ``mtp_weights`` the multi-token-prediction weights (first entry: next token).  A weight given
    as ``(a, b)`` ramps linearly from ``a`` to ``b`` over the stage.
    """

    start_step: int
    batch_tokens: int
    max_seq_len: int
    window_short: int
    window_long: int
    mtp_weights: tuple = (1.0,)
    prefix_weight: tuple = (0.0, 0.0)


@dataclass
class ModelConfig:
    """Shape of the GPT.

    ``qk_head_dim`` (query/key width per head) and ``v_head_dim`` (value/output width per head)
    are separate; the residual width is ``model_dim`` and must equal ``num_heads * v_head_dim``.
    ``vocab_size`` is the tokenizer's vocabulary; embeddings and logits are padded up to a multiple
    of ``vocab_multiple`` (see :attr:`padded_vocab_size`).
    """

    address_leaf = True  # holds no tensor: the CUDA graphs' address watch need not look inside

    vocab_size: int = 257
    num_layers: int = 4
    model_dim: int = 128
    num_heads: int = 4
    qk_head_dim: int = 32
    v_head_dim: int = 32
    mlp_ratio: int = 4
    vocab_multiple: int = 128
    # Rotary embedding: the first ``rope_fraction`` of each q/k head's dims rotate with frequencies
    # (1/rope_base)**linspace(0, 1, n); the rest stay stationary ("half-truncated RoPE").
    rope_base: float = 1024.0
    rope_fraction: float = 0.5
    # Softmax scale; None means 1/sqrt(qk_head_dim).
    attn_scale: float | None = None
    # Logit softcap: logits = A * sigmoid((z + B) / C), as in the record.  A <= 0 disables it.
    softcap_a: float = 23.0
    softcap_b: float = 5.0
    softcap_c: float = 7.5
    # Which network: "core" is the plain GPT of speedrun.model.gpt.
    architecture: str = "core"
    # Attention backend name (see speedrun.attention); "auto" picks the best available.
    attention_backend: str = "auto"
    # Loss head and MLP implementation of the record network: "reference" (plain PyTorch),
    # "triton" (fused Triton CE and ReLU^2 MLP in bf16), "fp8" (the record baseline: FP8 lm_head
    # and FP8 MLP forward), "fp8_full" (FP8 lm_head and FP8 across the MLP forward and backward).
    kernels: str = "reference"
    # Q/K/V projection of the record network: "reference" (one bf16 GEMM over the concatenated
    # bank slices, then norm/RoPE/offset in PyTorch), "fused" (packed [q|k|v]-per-head layout and
    # the fused QK-prep kernel, bf16 GEMM), "fused_fp8" (the same with one packed FP8 GEMM).
    qkv_path: str = "reference"
    # FP8 scaling of the inputs and output gradients of the FP8 MLP (kernels fp8 / fp8_full) and
    # of the packed FP8 QKV GEMM (qkv_path fused_fp8): "current" (an exact amax pass over each
    # tensor first) or "delayed" (the previous optimizer step's amax over all micro-batches and
    # ranks, with headroom, measured inside the quantise kernel: one read fewer per tensor).
    fp8_input_scaling: str = "current"
    # Where the record MLP's current-scaled FP8 input is made (kernels fp8): "kernel" (an amax pass
    # and a quantise kernel inside the MLP op) or "graph" (the same arithmetic as torch ops at the
    # call site, so torch.compile fuses the amax into the RMS norm that produces the input, as
    # upstream f411b3d does: one read of the input fewer per call).
    mlp_input_quant: str = "kernel"
    # qkv_path fused_fp8 with delayed scaling: the QK-prep backward kernel also writes its d qkv as
    # e5m2 with the packed QKV GEMM's delayed dy scale (and measures its amax), so that GEMM's
    # backward skips its quantise pass over d qkv (T x 1920 bf16 read per layer and micro-batch;
    # on in the candidate preset)
    qk_prep_fp8_grad: bool = False
    # Gradient of the record network's embedding tables (embed, value and bigram embeddings):
    # "autograd" (a dense table-sized gradient per micro-batch, added into .grad), or the looked-up
    # rows' gradients added into an fp32 accumulator that the training step hands to .grad before
    # each Adam (odd) step (speedrun.model.embedding_grad), the rows added by "atomic" fp32 adds;
    # "atomic" looks the rows up before the compiled network, "atomic_graph" inside it (Inductor
    # fuses the gathers into the kernels that read the rows, as with autograd's lookups).
    embedding_grad: str = "autograd"
    # Output columns of the record network's MUDD and MUDD-gate projections (5, 12, 14 and 41
    # wide) padded with zero rows of the weight up to a multiple of this, then sliced off: at 1
    # their GEMMs' row strides are not 16-byte aligned and cuBLAS picks its align1 kernels; 8
    # aligns them.  The padded columns are exact zeros, so the result is the same.
    gate_gemm_align: int = 1
    # Weight gradients of the record MLP (kernels triton / fp8): "autograd" (each layer's dW1, dW2
    # returned, stacked into a bank-sized gradient and added into .grad per micro-batch) or
    # "accumulate" (the dW GEMMs write into one bank-shaped buffer, adding into it from the second
    # micro-batch on, handed to .grad once per step: speedrun.model.bank_grad)
    mlp_weight_grad: str = "autograd"

    @property
    def padded_vocab_size(self) -> int:
        m = self.vocab_multiple
        return (self.vocab_size + m - 1) // m * m

    @property
    def mlp_hidden_dim(self) -> int:
        return self.mlp_ratio * self.model_dim

    def validate(self) -> None:
        if self.num_heads * self.v_head_dim != self.model_dim:
            raise ConfigError(
                f"model_dim ({self.model_dim}) must equal num_heads ({self.num_heads}) x "
                f"v_head_dim ({self.v_head_dim})"
            )
        if self.qk_head_dim % 4 != 0:
            raise ConfigError(f"qk_head_dim must be a multiple of 4 (rotary pairs), got {self.qk_head_dim}")
        if not 0.0 <= self.rope_fraction <= 1.0:
            raise ConfigError(f"rope_fraction must lie in [0, 1], got {self.rope_fraction}")
        for name, allowed in MODEL_CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"model.{name}={getattr(self, name)!r}; known: {', '.join(allowed)}")
        if self.architecture == "core" and (self.kernels != "reference" or self.qkv_path != "reference"
                                            or self.embedding_grad != "autograd"):
            raise ConfigError("model.kernels, model.qkv_path and model.embedding_grad apply to architecture=record only")
        if self.mlp_weight_grad == "accumulate" and (self.architecture != "record" or self.kernels not in ("triton", "fp8")):
            raise ConfigError("model.mlp_weight_grad=accumulate needs the record network's fused MLP with bf16 weight "
                              f"gradients (model.kernels triton or fp8); got architecture={self.architecture!r}, "
                              f"kernels={self.kernels!r}")
        if self.mlp_input_quant == "graph" and (self.kernels != "fp8" or self.fp8_input_scaling != "current"):
            raise ConfigError("model.mlp_input_quant=graph quantises the MLP input of model.kernels=fp8 with "
                              f"model.fp8_input_scaling=current; got kernels={self.kernels!r}, "
                              f"fp8_input_scaling={self.fp8_input_scaling!r}")
        if self.qk_prep_fp8_grad and (self.qkv_path != "fused_fp8" or self.fp8_input_scaling != "delayed"):
            raise ConfigError("model.qk_prep_fp8_grad=true quantises the packed FP8 QKV GEMM's output gradient with "
                              "its delayed scale: it needs model.qkv_path=fused_fp8 and model.fp8_input_scaling=delayed; "
                              f"got qkv_path={self.qkv_path!r}, fp8_input_scaling={self.fp8_input_scaling!r}")
        if self.gate_gemm_align not in (1, 2, 4, 8, 16):
            raise ConfigError(f"model.gate_gemm_align must be 1, 2, 4, 8 or 16, got {self.gate_gemm_align}")
        for name in ("vocab_size", "num_layers", "model_dim", "num_heads", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model.{name} must be positive, got {getattr(self, name)}")


@dataclass
class DataConfig:
    """Where tokens come from.

    ``source``: ``"builtin"`` tokenizes text that ships with every Python installation (byte-level,
    no download) into shards under ``cache_dir``; ``"shards"`` reads speedrun-format shards matching
    ``train_files`` / ``val_files`` (glob patterns).  ``tokenizer`` is ``"bytes"`` or ``"gpt2"``;
    ``tokenizer_dir`` may point at a folder holding ``encoder.json`` and ``vocab.bpe`` for offline
    GPT-2 (also read from ``SPEEDRUN_TOKENIZER_DIR``).
    """

    source: str = "builtin"
    train_files: str = ""
    val_files: str = ""
    tokenizer: str = "bytes"
    tokenizer_dir: str = ""
    cache_dir: str = ""
    bos_id: int = 256
    # Train and validation shards must be different files; true accepts shared files (the run
    # then validates on text it trained on).
    allow_val_overlap: bool = False


@dataclass
class TrainConfig:
    """The training loop.

    ``steps`` optimizer steps of ``batch_tokens`` global tokens each (split over ranks and
    ``grad_accum`` micro-batches).  ``warmup_steps`` untimed steps run first (to compile every
    shape) and are then undone by a full state reset.  Validation every ``val_every`` steps over
    ``val_tokens`` tokens (0 disables periodic validation; the final one always runs).
    """

    steps: int = 250
    batch_tokens: int = 4096
    max_seq_len: int = 256
    grad_accum: int = 1  # micro-batches per step on each rank; 0 = 8 // world_size (the record's rule)
    window: int = 0  # sliding attention window in tokens for the core model; 0 = whole document
    max_docs: int = 0  # cu_seqlens entries per micro-batch; 0 = the loader's default for the shape
    # Merge consecutive micro-batches of a rank until each holds at least this many tokens (fewer
    # accumulation steps of more tokens, the same tokens per optimizer step; 0 = the record's
    # split).  A step whose host work per micro-batch outlasts the GPU's (the record's stage 1 on
    # one GPU: 8 micro-batches of 16,384 tokens) then waits less.  See train.loop.micro_batching.
    min_micro_batch_tokens: int = 0
    # "trapezoid": AdamW + warmup/flat/cooldown over `stages`; "record": the record's staged schedule
    # (RecordSchedule) with NorMuon + Adam, `steps` = scheduled + `num_extension`.
    schedule: str = "trapezoid"
    num_extension: int = 15
    window_block: int = 128  # record schedule: windows are multiples of this many tokens
    batch_divisor: int = 1  # record schedule: divide every stage's batch (shrunken runs)
    seq_divisor: int = 1  # record schedule: divide every stage's sequence cap
    optimizer: str = "adam"  # "adam" (trapezoid schedule) or "normuon" (record schedule)
    # NorMuon + Adam's Triton kernels (Polar Express, the one-pass Adam update): "auto" = on CUDA,
    # "reference" = the eager PyTorch paths everywhere (an A/B arm), "triton" = always (on the CPU
    # only under TRITON_INTERPRET=1)
    optimizer_kernels: str = "auto"
    # NorMuon's elementwise work around Polar Express (momentum, normalisation, variance reduction,
    # cautious decay, the bf16 + mantissa split) fused by torch.compile (Inductor), as upstream
    # does, instead of ~34 eager passes over each bank per step.  On in the record presets; off
    # here, where a CPU run would pay
    # Inductor's CPU compile for little.
    optimizer_compile: bool = False
    muon_lr: float = 0.023
    lr: float = 3e-3
    embed_lr: float = 3e-3
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    lr_warmup_steps: int = 20
    cooldown_frac: float = 0.4  # final fraction of steps with linear decay to lr * final_lr_frac
    final_lr_frac: float = 0.1
    grad_clip: float = 1.0  # 0 disables
    warmup_steps: int = 0  # untimed compile warmup steps, undone afterwards
    # After the warmup: one full garbage collection, then gc.freeze(), so the collector no longer
    # walks the compiled graphs and the model during timed steps (a full collection over them
    # stalls the host for tens to hundreds of ms in a random step; speedrun.train.collector).
    # Process-wide: in `speedrun bench step` every arm must agree.
    gc_freeze: bool = True
    # Each step's micro-batches (forward + backward) replayed as one CUDA graph per step key
    # (speedrun.train.graphs): "auto" (on CUDA), "on" (CUDA only) or "off" (the eager loop).
    cuda_graphs: str = "auto"
    # Compare each graph's first replay with an eager run of the same micro-batches (outside the
    # clock); a mismatch stops the run.
    cuda_graph_check: bool = True
    # With cuda_graphs, the optimizer's update replayed as CUDA graphs too (one rank; its host half,
    # which reads the schedule, stays eager: speedrun.train.update_graphs).  Ignored where the
    # update cannot be captured (several ranks, or an optimizer other than NorMuonAndAdam).
    cuda_graph_optimizer: bool = True
    val_every: int = 50
    val_tokens: int = 32768
    # Tokens of each rank's validation batch (contiguous text, cut into documents at BOS; a
    # document crossing a batch edge loses its context there, so the loss depends on this).
    # 0: the largest unmerged training micro-batch.  Divided by ``batch_divisor`` like the stages.
    val_batch_tokens: int = 0
    # A train line every this many steps, read a step late so that logging never stops the GPU
    # (speedrun.train.steplog); the record logs every step, as upstream does.
    log_every: int = 10
    checkpoint_every: int = 0  # every this many steps; 0: by time and stage only (and at the end)
    # Also checkpoint when this many seconds of wall clock have passed since the last checkpoint
    # (checked after each step; 0 disables), and at every stage boundary of a staged schedule.
    # Checkpoints are written with the training clock stopped; SIGINT/SIGTERM write one and stop.
    checkpoint_every_s: float = 600.0
    checkpoint_stages: bool = True
    seed: int = 1337
    device: str = "auto"
    dtype: str = "auto"  # "bf16" | "fp32" | "auto" (bf16 on CUDA, fp32 on CPU)
    compile: bool = False
    # Inductor's C++ wrapper: launches the compiled network's kernels from C++ instead of Python
    # (less host time per launch; longer compile).  An experiment arm, off by default.
    compile_cpp_wrapper: bool = False
    # How our Triton kernels are launched from Python: "cached" = through the compiled kernel's
    # handle after the first launch of each specialisation (speedrun.kernels._triton; a fraction of
    # the plain launch's host time), "plain" = kernel[grid](...) every time (an A/B arm; process-wide)
    triton_launch: str = "cached"
    # Route of the ReLU² MLP's fused GEMMs (speedrun.kernels.mlp.relu2_gemm; per model, through
    # speedrun.kernels.options.KernelOptions): "auto" = the kernel module's choice per direction and dtype, or one
    # of "fused" (pointer-store epilogue), "tma" (epilogue through TMA), "split" (cuBLAS GEMM,
    # then a Triton epilogue pass) for every call: an A/B arm
    mlp_gemm: str = "auto"
    # How the cross-entropy kernel evaluates the softcap's sigmoid: "exact" (exp2 + reciprocal) or
    # "tanh" (the GPU's approximate tanh, one instruction, as upstream's kernel; the record presets'
    # choice, the faster one; training loss and gradient only, the validation loss stays exact;
    # per model, through speedrun.kernels.options.KernelOptions)
    ce_sigmoid: str = "exact"  # one of CE_SIGMOID_CHOICES
    # How the FP8 head's e5m2 logit gradient reaches the weight-gradient GEMM, which wants it
    # transposed: "transpose" (a transpose pass in the backward, as upstream) or "dual" (the CE
    # kernel writes both layouts: one read of N x V_pad bytes fewer per micro-batch;
    # per model, through speedrun.kernels.options.KernelOptions)
    ce_grad_layout: str = "transpose"  # one of CE_GRAD_LAYOUT_CHOICES
    preflight: bool = False  # run `speedrun doctor` checks first and refuse a broken environment
    sample_tokens: int = 200
    sample_prompt: str = "The "
    stages: list = field(default_factory=list)  # list[Stage]; empty = one stage from the fields above


@dataclass
class RunConfig:
    """Everything that defines a run; written to ``config.json`` in the run folder."""

    name: str = "tiny"
    out_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        train = dict(d.get("train", {}))
        train["stages"] = [Stage(**_tuplify(s)) for s in train.get("stages", [])]
        return cls(
            name=d.get("name", "custom"),
            out_dir=d.get("out_dir", "runs"),
            model=ModelConfig(**d.get("model", {})),
            data=DataConfig(**d.get("data", {})),
            train=TrainConfig(**train),
        )


def _tuplify(stage: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in stage.items()}


# ----------------------------------------------------------------------------------------------
# Presets


def tiny() -> RunConfig:
    """A small GPT that trains on 2 CPU cores in a few minutes on the built-in byte-level corpus."""
    return RunConfig(name="tiny")


def small() -> RunConfig:
    """A 124M-class shape for one GPU on GPT-2 tokenized shards (FineWeb or local)."""
    return RunConfig(
        name="small",
        model=ModelConfig(
            vocab_size=50257, num_layers=12, model_dim=768, num_heads=6, qk_head_dim=128, v_head_dim=128
        ),
        data=DataConfig(source="shards", tokenizer="gpt2", bos_id=50256),
        train=TrainConfig(
            steps=2000, batch_tokens=131072, max_seq_len=2048, lr=2e-3, embed_lr=6e-3,
            val_every=250, val_tokens=1048576, sample_prompt="The", warmup_steps=2,
            compile=True, window=1024,
        ),
    )


def record() -> RunConfig:
    """The f411b3d record recipe (recipe spec §1-§6): 11 layers, 768 wide, 6 heads of 128, NorMuon +
    Adam, three stages plus 15 extension steps (1285), 8 micro-batches on one GPU (8 // world_size
    under torchrun), on GPT-2 tokenized FineWeb shards in data/fineweb10B/."""
    return RunConfig(
        name="record",
        model=ModelConfig(
            vocab_size=50257, num_layers=11, model_dim=768, num_heads=6, qk_head_dim=128, v_head_dim=128,
            architecture="record", kernels="fp8", embedding_grad="atomic",
            # the MLP input quantised in the compiled graph (upstream's arithmetic), the MLP bank's
            # gradient summed in place, the MUDD / gate GEMMs aligned: the configuration compared
            # with upstream f411b3d step for step (docs/status.md)
            mlp_input_quant="graph", mlp_weight_grad="accumulate", gate_gemm_align=8,
        ),
        data=DataConfig(
            source="shards", tokenizer="gpt2", bos_id=50256,
            train_files="data/fineweb10B/fineweb_train_*.bin", val_files="data/fineweb10B/fineweb_val_*.bin",
        ),
        train=TrainConfig(
            steps=1285, num_extension=15, schedule="record", optimizer="normuon", grad_accum=0,
            lr=0.008, muon_lr=0.023, val_every=250, val_tokens=10485760, log_every=1, warmup_steps=2,
            val_batch_tokens=262144,  # upstream's val_batch_size 2,097,152 over its 8 ranks x micro-batches
            compile=True, optimizer_compile=True, dtype="bf16", sample_prompt="The", sample_tokens=0,
            preflight=True, ce_sigmoid="tanh",
        ),
    )


def tiny_record() -> RunConfig:
    """The record recipe's code path shrunk for a CPU: 6 layers of 64 wide, 4 heads of 16, byte-level
    built-in corpus, the record's three stages with batches / 64, sequence caps / 8 and windows in
    16-token blocks, 96 + 6 steps."""
    return RunConfig(
        name="tiny-record",
        model=ModelConfig(num_layers=6, model_dim=64, num_heads=4, qk_head_dim=16, v_head_dim=16,
                          architecture="record", embedding_grad="atomic"),
        train=TrainConfig(
            steps=102, num_extension=6, schedule="record", optimizer="normuon", grad_accum=1,
            lr=0.008, muon_lr=0.023, batch_divisor=64, seq_divisor=8, window_block=16,
            val_every=34, val_tokens=16384, log_every=6, sample_tokens=100, ce_sigmoid="tanh",
        ),
    )


def candidate() -> RunConfig:
    """The record recipe with the reduced-width attention routing switched on (issue 4): Q/K heads
    96 wide (V and the residual stay 128; the softmax scale starts at 0.1 * sqrt(128 / 96), PR
    #344's rule, :meth:`~speedrun.model.record.RecordGPT.starting_attn_scale`), one packed FP8 QKV
    GEMM per layer, fused QK-prep, FP8 across the whole MLP with delayed input scaling, and 45
    extension steps (1315).

    Delayed scaling because it is faster per step than current scaling and a shortened loss A/B
    against the record found no loss cost (docs/status.md).  The QK-prep backward writes the packed
    QKV GEMM's e5m2 output gradient itself (``qk_prep_fp8_grad``; the same bytes the GEMM's
    quantise pass would make, so the loss is unchanged), saving that pass."""
    cfg = record()
    cfg.name = "candidate"
    cfg.model.qk_head_dim = 96
    cfg.model.qkv_path = "fused_fp8"
    cfg.model.kernels = "fp8_full"
    cfg.model.fp8_input_scaling = "delayed"
    cfg.model.qk_prep_fp8_grad = True
    # the record's MLP switches need its bf16-gradient FP8 MLP with current input scaling
    cfg.model.mlp_input_quant = "kernel"
    cfg.model.mlp_weight_grad = "autograd"
    cfg.train.num_extension = 45
    cfg.train.steps = 1315
    return cfg


def tiny_candidate() -> RunConfig:
    """The candidate's code path shrunk for a CPU as ``tiny-record`` shrinks the record's: Q/K heads
    12 wide (V 16), the candidate's switches (packed FP8 QKV, fused QK-prep handing its e5m2
    gradient over, FP8 across the MLP, delayed input scaling), and its extension scaled alike
    (96 + 18 steps).  Without a GPU its Triton kernels run in Triton's interpreter
    (``TRITON_INTERPRET=1``): slow, but the candidate's own kernels end to end."""
    cfg = tiny_record()
    cand = candidate().model
    cfg.name = "tiny-candidate"
    cfg.model.qk_head_dim = 12
    for field in ("qkv_path", "kernels", "fp8_input_scaling", "qk_prep_fp8_grad", "mlp_input_quant", "mlp_weight_grad"):
        setattr(cfg.model, field, getattr(cand, field))
    cfg.train.num_extension = 18
    cfg.train.steps = 114
    return cfg


PRESETS: dict[str, typing.Callable[[], RunConfig]] = {
    "tiny": tiny, "small": small, "record": record, "tiny-record": tiny_record, "candidate": candidate,
    "tiny-candidate": tiny_candidate,
}


def preset(name: str) -> RunConfig:
    """Return a fresh copy of the named preset; raises ``KeyError`` listing the known names."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


# ----------------------------------------------------------------------------------------------
# Overrides


class OverrideError(ConfigError):
    """A ``section.field=value`` override names no field or has a value of the wrong type."""


def _convert(raw: str, typ: Any, where: str) -> Any:
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw.lower() in ("none", "null", ""):
            return None
        typ = args[0]
    try:
        if typ is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if typ is int:
            return int(raw.replace("_", ""))
        if typ is float:
            return float(raw)
        if typ in (list, tuple) or typing.get_origin(typ) in (list, tuple):
            return json.loads(raw)
        return raw
    except (ValueError, json.JSONDecodeError):
        raise OverrideError(f"{where}: cannot read {raw!r} as {getattr(typ, '__name__', typ)}") from None


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.field=value`` strings (e.g. ``train.steps=50``) to ``cfg`` in place."""
    hints = {
        "model": typing.get_type_hints(ModelConfig),
        "data": typing.get_type_hints(DataConfig),
        "train": typing.get_type_hints(TrainConfig),
        "": typing.get_type_hints(RunConfig),
    }
    for item in overrides:
        if "=" not in item:
            raise OverrideError(f"override {item!r} is not of the form section.field=value")
        key, raw = item.split("=", 1)
        section, _, name = key.strip().rpartition(".")
        if section not in hints or name not in hints[section] or name in ("model", "data", "train"):
            known = ", ".join(
                f"{s}.{n}" if s else n for s in hints for n in hints[s] if n not in ("model", "data", "train")
            )
            raise OverrideError(f"unknown setting {key!r}; known settings: {known}")
        target = getattr(cfg, section) if section else cfg
        value = _convert(raw.strip(), hints[section][name], key)
        if section == "train" and name == "stages":
            value = _stages_from_json(value, key)
        setattr(target, name, value)
    return cfg


def _stages_from_json(value: Any, key: str) -> list[Stage]:
    """``train.stages`` from JSON: a list of objects with Stage's fields, or of positional lists."""
    if not isinstance(value, list):
        raise OverrideError(f"{key}: want a JSON list of stages, got {value!r}")
    stages = []
    for item in value:
        try:
            stage = Stage(**_tuplify(item)) if isinstance(item, dict) else Stage(*item)
        except TypeError as e:
            raise OverrideError(f"{key}: bad stage {item!r}: {e}") from None
        stages.append(stage)
    return stages
