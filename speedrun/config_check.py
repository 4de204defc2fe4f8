"""Every configuration field's type and allowed values, checked when a run is parsed.

:func:`validate_config` checks each field of :class:`~speedrun.config.RunConfig` (its sections'
dataclasses and the stages) against :data:`RULES` and the cross-field rules of
:meth:`~speedrun.config.ModelConfig.validate`, and raises one :class:`~speedrun.errors.ConfigError`
naming every bad value with its allowed range, so a ``--set`` typo fails before a run folder
exists.  Every field must have a rule (a test enforces it), so a new field cannot go unchecked.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from speedrun.config import (ATTENTION_BACKEND_CHOICES, CE_GRAD_LAYOUT_CHOICES, CE_SIGMOID_CHOICES, CUDA_GRAPHS_CHOICES, MLP_GEMM_CHOICES,
                             MODEL_CHOICES,
                             TRITON_LAUNCH_CHOICES, DataConfig, ModelConfig, RunConfig, Stage, TrainConfig)
from speedrun.errors import ConfigError

_INF = math.inf


@dataclass(frozen=True)
class Rule:
    """A field's type and allowed values.

    ``kind``: int, float, bool or str (a float field takes ints too; bool is never an int).
    ``low``/``high``: inclusive bounds, or exclusive where ``open_low``/``open_high``.
    ``choices``: the allowed values.  ``pattern``: a regular expression a string must match in full.
    ``optional``: None is allowed.  ``what``: the allowed range in words, for patterns."""

    kind: type
    low: float = -_INF
    high: float = _INF
    open_low: bool = False
    open_high: bool = False
    choices: tuple = ()
    pattern: str = ""
    optional: bool = False
    what: str = ""

    def describe(self) -> str:
        """The allowed values in words, e.g. "an int >= 1" or "one of bf16, fp32, auto"."""
        if self.choices:
            text = "one of " + ", ".join(str(c) for c in self.choices)
        elif self.kind is bool:
            text = "true or false"
        elif self.what:
            text = self.what
        else:
            text = {int: "an int", float: "a finite number", str: "a string"}[self.kind]
            lo = "" if self.low == -_INF else f"{'>' if self.open_low else '>='} {_num(self.low)}"
            hi = "" if self.high == _INF else f"{'<' if self.open_high else '<='} {_num(self.high)}"
            if lo and hi:
                text += f" in {'(' if self.open_low else '['}{_num(self.low)}, {_num(self.high)}{')' if self.open_high else ']'}"
            elif lo or hi:
                text += " " + (lo or hi)
        return text + (" (or none)" if self.optional else "")

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not allowed (None when it is)."""
        if value is None:
            return None if self.optional else "must be set"
        if self.kind is bool:
            ok_type = isinstance(value, bool)
        elif self.kind is int:
            ok_type = isinstance(value, int) and not isinstance(value, bool)
        elif self.kind is float:
            ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok_type = isinstance(value, str)
        if not ok_type:
            return f"has type {type(value).__name__}"
        if self.choices:
            return None if value in self.choices else "is not allowed"
        if self.kind is str:
            return None if not self.pattern or re.fullmatch(self.pattern, value) else "is not allowed"
        if self.kind is bool:
            return None
        if not math.isfinite(value):
            return "is not finite"
        below = value <= self.low if self.open_low else value < self.low
        above = value >= self.high if self.open_high else value > self.high
        return "is out of range" if below or above else None


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**63 else repr(x)


def _int(low: float = -_INF, high: float = _INF) -> Rule:
    return Rule(int, low, high)


def _pos_float(optional: bool = False) -> Rule:
    return Rule(float, 0.0, open_low=True, optional=optional)


_ANY_STR = Rule(str)
_BOOL = Rule(bool)
_FRACTION = Rule(float, 0.0, 1.0)

RULES: dict[str, Rule] = {
    # run
    "name": Rule(str, pattern=r"[A-Za-z0-9][A-Za-z0-9._+-]*", what="a name of letters, digits and ._+- (no path separators)"),
    "out_dir": Rule(str, pattern=r".+", what="a folder path (not empty)"),
    # model
    "model.vocab_size": _int(1),
    "model.num_layers": _int(1),
    "model.model_dim": _int(1),
    "model.num_heads": _int(1),
    "model.qk_head_dim": Rule(int, 4, what="an int >= 4, a multiple of 4"),
    "model.v_head_dim": _int(1),
    "model.mlp_ratio": _int(1),
    "model.vocab_multiple": _int(1),
    "model.rope_base": _pos_float(),
    "model.rope_fraction": _FRACTION,
    "model.attn_scale": _pos_float(optional=True),
    "model.softcap_a": Rule(float),
    "model.softcap_b": Rule(float),
    "model.softcap_c": _pos_float(),
    "model.architecture": Rule(str, choices=MODEL_CHOICES["architecture"]),
    "model.attention_backend": Rule(str, choices=ATTENTION_BACKEND_CHOICES),
    "model.kernels": Rule(str, choices=MODEL_CHOICES["kernels"]),
    "model.qkv_path": Rule(str, choices=MODEL_CHOICES["qkv_path"]),
    "model.fp8_input_scaling": Rule(str, choices=MODEL_CHOICES["fp8_input_scaling"]),
    "model.mlp_input_quant": Rule(str, choices=MODEL_CHOICES["mlp_input_quant"]),
    "model.qk_prep_fp8_grad": _BOOL,
    "model.embedding_grad": Rule(str, choices=MODEL_CHOICES["embedding_grad"]),
    "model.gate_gemm_align": Rule(int, choices=(1, 2, 4, 8, 16)),
    "model.mlp_weight_grad": Rule(str, choices=MODEL_CHOICES["mlp_weight_grad"]),
    # data
    "data.source": Rule(str, choices=("builtin", "shards")),
    "data.train_files": _ANY_STR,
    "data.val_files": _ANY_STR,
    "data.tokenizer": Rule(str, choices=("bytes", "gpt2")),
    "data.tokenizer_dir": _ANY_STR,
    "data.cache_dir": _ANY_STR,
    "data.bos_id": _int(0),
    "data.allow_val_overlap": _BOOL,
    # train
    "train.steps": _int(1),
    "train.batch_tokens": _int(1),
    "train.max_seq_len": _int(1),
    "train.grad_accum": _int(0),
    "train.window": _int(0),
    "train.max_docs": _int(0),
    "train.min_micro_batch_tokens": _int(0),
    "train.schedule": Rule(str, choices=("trapezoid", "record")),
    "train.num_extension": _int(0),
    "train.window_block": _int(1),
    "train.batch_divisor": _int(1),
    "train.seq_divisor": _int(1),
    "train.optimizer": Rule(str, choices=("adam", "normuon")),
    "train.optimizer_kernels": Rule(str, choices=("auto", "reference", "triton")),
    "train.optimizer_compile": _BOOL,
    "train.muon_lr": _pos_float(),
    "train.lr": _pos_float(),
    "train.embed_lr": _pos_float(),
    "train.weight_decay": Rule(float, 0.0),
    "train.beta1": Rule(float, 0.0, 1.0, open_high=True),
    "train.beta2": Rule(float, 0.0, 1.0, open_high=True),
    "train.eps": _pos_float(),
    "train.lr_warmup_steps": _int(0),
    "train.cooldown_frac": _FRACTION,
    "train.final_lr_frac": _FRACTION,
    "train.grad_clip": Rule(float, 0.0),
    "train.warmup_steps": _int(0),
    "train.gc_freeze": _BOOL,
    "train.cuda_graphs": Rule(str, choices=CUDA_GRAPHS_CHOICES),
    "train.cuda_graph_check": _BOOL,
    "train.cuda_graph_optimizer": _BOOL,
    "train.val_every": _int(0),
    "train.val_tokens": _int(1),
    "train.val_batch_tokens": _int(0),
    "train.log_every": _int(1),
    "train.checkpoint_every": _int(0),
    "train.checkpoint_every_s": Rule(float, 0.0),
    "train.checkpoint_stages": _BOOL,
    "train.seed": _int(0, 2**63 - 1),
    "train.device": Rule(str, pattern=r"auto|cpu|cuda(:\d+)?", what="auto, cpu, cuda or cuda:N"),
    "train.dtype": Rule(str, choices=("auto", "bf16", "fp32")),
    "train.compile": _BOOL,
    "train.compile_cpp_wrapper": _BOOL,
    "train.triton_launch": Rule(str, choices=TRITON_LAUNCH_CHOICES),
    "train.mlp_gemm": Rule(str, choices=MLP_GEMM_CHOICES),
    "train.ce_sigmoid": Rule(str, choices=CE_SIGMOID_CHOICES),
    "train.ce_grad_layout": Rule(str, choices=CE_GRAD_LAYOUT_CHOICES),
    "train.preflight": _BOOL,
    "train.sample_tokens": _int(0),
    "train.sample_prompt": _ANY_STR,
    "train.stages": Rule(list, what="a list of stages"),  # each stage: STAGE_RULES
}

STAGE_RULES: dict[str, Rule] = {
    "start_step": _int(0),
    "batch_tokens": _int(1),
    "max_seq_len": _int(1),
    "window_short": Rule(int, 1, optional=True),
    "window_long": Rule(int, 1, optional=True),
    "mtp_weights": Rule(tuple, what="a list of weights, each a number or a [start, end] pair"),
    "prefix_weight": Rule(tuple, what="a [start, end] pair of numbers"),
}


def field_names() -> list[str]:
    """Every configuration field as ``section.field`` (run-level fields bare), in declaration order."""
    names = [f.name for f in dataclasses.fields(RunConfig) if f.name not in ("model", "data", "train")]
    for section, cls in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
        names += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return names


def _value(cfg: RunConfig, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _stage_problems(stages: Any) -> list[str]:
    if not isinstance(stages, (list, tuple)):
        return [f"train.stages={stages!r}: must be a list of stages"]
    out = []
    for i, stage in enumerate(stages):
        where = f"train.stages[{i}]"
        if not isinstance(stage, Stage):
            out.append(f"{where}={stage!r}: must be a stage ({', '.join(STAGE_RULES)})")
            continue
        for name, rule in STAGE_RULES.items():
            value = getattr(stage, name)
            if rule.kind is tuple:
                if not _weights_ok(value, pairs_only=name == "prefix_weight"):
                    out.append(f"{where}.{name}={value!r}: must be {rule.describe()}")
                continue
            why = rule.problem(value)
            if why:
                out.append(f"{where}.{name}={value!r} {why}: must be {rule.describe()}")
    starts = [s.start_step for s in stages if isinstance(s, Stage)]
    if starts and (sorted(starts) != starts or len(set(starts)) != len(starts) or starts[0] != 0):
        out.append(f"train.stages start steps {starts}: must rise strictly from 0")
    return out


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _weights_ok(value: Any, pairs_only: bool) -> bool:
    if not isinstance(value, (tuple, list)):
        return False
    if pairs_only:
        return len(value) == 2 and all(_is_number(v) for v in value)
    return len(value) >= 1 and all(_is_number(v) or (isinstance(v, (tuple, list)) and len(v) == 2
                                                     and all(_is_number(x) for x in v)) for v in value)


def config_problems(cfg: RunConfig) -> list[str]:
    """Every field of ``cfg`` whose value breaks its rule, one line each ("key=value ...: must be ...")."""
    out = []
    for key in field_names():
        rule = RULES.get(key)
        if rule is None:  # a field added without a rule: tests/test_config_check.py catches this
            continue
        value = _value(cfg, key)
        if key == "train.stages":
            out += _stage_problems(value)
            continue
        why = rule.problem(value)
        if why:
            out.append(f"{key}={value!r} {why}: must be {rule.describe()}")
    if not out:
        t, m, d = cfg.train, cfg.model, cfg.data
        if m.qk_head_dim % 4:
            out.append(f"model.qk_head_dim={m.qk_head_dim}: must be {RULES['model.qk_head_dim'].describe()} (rotary pairs)")
        if d.bos_id >= m.vocab_size:
            out.append(f"data.bos_id={d.bos_id}: must be below model.vocab_size ({m.vocab_size})")
        if t.schedule == "record" and t.num_extension >= t.steps:
            out.append(f"train.num_extension={t.num_extension}: must be below train.steps ({t.steps}) with the "
                       "record schedule (steps = scheduled + extension)")
    return out


def validate_config(cfg: RunConfig) -> RunConfig:
    """Raise one ConfigError listing every bad field of ``cfg`` with its allowed values, then the
    model's cross-field rules (:meth:`ModelConfig.validate`); returns ``cfg``."""
    problems = config_problems(cfg)
    if problems:
        head = "bad configuration value" + ("s" if len(problems) > 1 else "")
        raise ConfigError(f"{head}: " + "; ".join(problems))
    cfg.model.validate()
    return cfg
