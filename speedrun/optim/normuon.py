"""NorMuon + Adam: the record's combined optimizer, driven by a per-parameter table (recipe §4.1).

Matrix weights live in "banks" of independent matrices, e.g. ``qk_bank`` (64, 256, 768): one
(256, 768) matrix per head pair.  NorMuon treats every matrix of a bank separately:

1. fp32 Nesterov momentum: ``buf <- lerp(buf, g, 1-mu)``, ``g <- lerp(g, buf, mu)``;
2. bf16 Polar Express orthogonalisation (:func:`speedrun.kernels.polar_express.polar_express`);
3. NorMuon variance reduction: an Adafactor-like second moment per row (tall/square matrices) or
   per column (wide ones), ``beta2`` = 0.9, rescaled so each matrix keeps its Frobenius norm;
4. cautious weight decay + update on an fp32 master weight, where the master is the bf16 weight
   plus a 16-bit "mantissa" buffer holding the low half of the fp32 bits:
   ``p <- p - p*[v*p >= 0]*(wd*wd_mul*lr)*(lr*lr_mul) - v*(lr*lr_mul)``;
   ``lr_mul`` includes the shape factor ``max(1, rows/cols)**0.5`` and, for the MLP bank, 2x on
   matrices with an odd index (c_proj).

Everything else uses Adam (:mod:`speedrun.optim.adam`) and only steps on odd steps; its gradients
are left in ``.grad`` on even steps so that they sum over two steps.

Distribution (torch.distributed, any world size; a single-process path when it is not
initialised): "sharded" parameters are reduce-scattered (banks split along their matrix index,
padded with zero matrices up to a multiple of the world size), each rank updates its own shard,
then all-gathered; "replicated" parameters are all-reduced and updated everywhere;
"sharded_sparse" (the bigram table) sends only the rows each rank touched since the last Adam
step to their owners (all_to_all) and adds them into the owner's shard; the touched rows are
marked on the host (:meth:`NorMuonAndAdam.mark_rows`) and the message sizes exchanged by a CPU
collective, so the exchange never makes the host wait for the device.  NCCL uses
reduce_scatter/all_gather with AVG; other backends (gloo, for CPU tests) fall back to all_reduce
SUM + slice and list all_gather.

Optimizer state is per rank (each rank holds only its shard's state).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from speedrun.kernels.step_values import StepValues
from speedrun.optim.adam import adam_apply_auto_, adam_scalars, new_adam_state

__all__ = [
    "ParamGroupSpec",
    "OptimizerHyper",
    "record_param_table",
    "RECORD_WORK_ORDER",
    "NorMuonAndAdam",
    "StepPlan",
    "split_fp32",
    "join_bf16",
    "normuon_variance_reduction_",
    "normuon_momentum_",
    "normuon_apply_",
    "normuon_update_",
]

_OPTIMS = ("normuon", "adam")
_COMMS = ("sharded", "replicated", "sharded_sparse", "none")


@dataclass(frozen=True)
class ParamGroupSpec:
    """How one parameter (identified by ``label``) is optimised and communicated.

    optim: "normuon" (matrix banks) or "adam".
    comms: "sharded" | "replicated" | "sharded_sparse" | "none"; forced to "none" when the world
        size is 1.
    betas: Adam (beta1, beta2); ignored by NorMuon.
    lr_mul / wd_mul: multipliers on the base learning rate and weight decay.
    odd_matrix_lr_mul: NorMuon only; extra lr factor on matrices with an odd index in the bank
        (the record's MLP bank stores (c_fc, c_proj) pairs, and c_proj gets 2x).
    matrix_shape: NorMuon only; (rows, cols) of one matrix; default: the parameter's last two
        dims.  The bank is viewed as (numel // (rows*cols), rows, cols).
    """

    label: str
    optim: str
    comms: str = "replicated"
    betas: tuple[float, float] | None = None
    lr_mul: float = 1.0
    wd_mul: float = 1.0
    odd_matrix_lr_mul: float = 1.0
    matrix_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.optim not in _OPTIMS:
            raise ValueError(f"ParamGroupSpec {self.label!r}: optim must be one of {_OPTIMS}, got {self.optim!r}")
        if self.comms not in _COMMS:
            raise ValueError(f"ParamGroupSpec {self.label!r}: comms must be one of {_COMMS}, got {self.comms!r}")
        if self.optim == "adam" and self.betas is None:
            raise ValueError(f"ParamGroupSpec {self.label!r}: Adam parameters need betas")
        if self.optim == "normuon" and self.comms == "sharded_sparse":
            raise ValueError(f"ParamGroupSpec {self.label!r}: sharded_sparse is for Adam tables only")


@dataclass
class OptimizerHyper:
    """Base hyperparameters (record recipe §4.1 defaults).  Learning rates are absolute, before the
    schedule's multiplier and each parameter's ``lr_mul``."""

    adam_lr: float = 0.008
    adam_eps: float = 1e-10
    adam_weight_decay: float = 0.005
    muon_lr: float = 0.023
    muon_momentum: float = 0.95
    muon_beta2: float = 0.9
    muon_weight_decay: float = 1.2


def record_param_table() -> list[ParamGroupSpec]:
    """The record's per-parameter table, in its reduce ("scatter") order (recipe §4.1)."""
    b99, b95 = (0.9, 0.99), (0.9, 0.95)
    return [
        ParamGroupSpec("qk_bank", "normuon", "sharded"),
        ParamGroupSpec("vo_bank", "normuon", "sharded"),
        ParamGroupSpec("mlp_bank", "normuon", "sharded", odd_matrix_lr_mul=2.0),
        ParamGroupSpec("scalars", "adam", "replicated", b99, lr_mul=5.0, wd_mul=0.0),
        ParamGroupSpec("smear_gate", "adam", "replicated", b99, lr_mul=0.01, wd_mul=0.0),
        ParamGroupSpec("ve_gate_bank", "adam", "replicated", b99),
        ParamGroupSpec("lm_head", "adam", "sharded", (0.5, 0.95), wd_mul=150.0),
        ParamGroupSpec("bigram_embed", "adam", "sharded_sparse", (0.75, 0.95), lr_mul=75.0, wd_mul=5.0),
        ParamGroupSpec("post_lambdas", "adam", "replicated", b95, lr_mul=1.0, wd_mul=0.0),
        ParamGroupSpec("resid_lambdas", "adam", "replicated", b95, lr_mul=5.0, wd_mul=0.0),
        ParamGroupSpec("value_embeds", "adam", "sharded", (0.75, 0.95), lr_mul=75.0, wd_mul=5.0),
        ParamGroupSpec("embed", "adam", "sharded", (0.5, 0.95), wd_mul=150.0),
        ParamGroupSpec("mudd_w1", "adam", "replicated", b99, lr_mul=0.25),
        ParamGroupSpec("mudd_w2", "adam", "replicated", b99, lr_mul=0.25),
        ParamGroupSpec("mudd_b2", "adam", "replicated", b99, lr_mul=0.25, wd_mul=0.0),
        ParamGroupSpec("mudd_gate_w1", "adam", "replicated", b99, lr_mul=0.1),
        ParamGroupSpec("mudd_gate_w2", "adam", "replicated", b99, lr_mul=0.1),
        ParamGroupSpec("mudd_gate_b2", "adam", "replicated", b99, lr_mul=0.1, wd_mul=0.0),
        ParamGroupSpec("mudd_gate_scale", "adam", "replicated", b99, lr_mul=0.1, wd_mul=0.0),
    ]


# Update order: small parameters first while the large reductions are still in flight; lm_head
# before embed (tied copy); the Polar Express banks last.
RECORD_WORK_ORDER: tuple[str, ...] = (
    "scalars", "smear_gate", "ve_gate_bank", "mudd_b2", "mudd_gate_b2", "mudd_gate_scale",
    "post_lambdas", "resid_lambdas", "mudd_w2", "mudd_gate_w2", "value_embeds", "bigram_embed",
    "mudd_w1", "mudd_gate_w1", "lm_head", "embed", "qk_bank", "vo_bank", "mlp_bank",
)


# ------------------------------------------------------------------------------------------------
# Mantissa tracking: a bf16 weight plus the low 16 bits of its fp32 master


def join_bf16(hi: Tensor, lo: Tensor) -> Tensor:
    """fp32 tensor whose upper 16 bits are ``hi`` and lower 16 bits int16 ``lo`` (same shape).

    hi: the bf16 weights, or their bits viewed as int16 (how the compiled update passes them)."""
    h = hi if hi.dtype == torch.int16 else hi.view(torch.int16)
    bits = (h.to(torch.int32) << 16) | (lo.to(torch.int32) & 0xFFFF)
    return bits.view(torch.float32)


def split_fp32(x: Tensor, hi_out: Tensor, lo_out: Tensor) -> None:
    """Write the upper half of fp32 ``x``'s bits to ``hi_out`` (bf16, or its int16 bits; truncation,
    not rounding, so that ``join_bf16(hi_out, lo_out)`` equals ``x`` exactly) and the lower half to
    int16 ``lo_out``."""
    bits = x.contiguous().view(torch.int32)
    h = hi_out if hi_out.dtype == torch.int16 else hi_out.view(torch.int16)
    h.copy_((bits >> 16).to(torch.int16))
    lo_out.copy_(bits.to(torch.int16))


# ------------------------------------------------------------------------------------------------
# NorMuon math on one rank's shard


def _variance_reduction_scale(v: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """The factor :func:`normuon_variance_reduction_` multiplies ``v`` by (fp32, broadcastable to
    v); updates ``second_moment`` in place."""
    red = -1 if v.size(-2) >= v.size(-1) else -2
    n = v.size(red)
    ms = v.float().square().mean(dim=red, keepdim=True)
    norm_before = (ms.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    second_moment.lerp_(ms, 1.0 - beta2)
    inv_rms = second_moment.clamp_min(1e-10).rsqrt()
    norm_after = (ms * n * inv_rms.square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    return inv_rms * (norm_before / norm_after.clamp_min(1e-10))


def normuon_variance_reduction_(v: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """NorMuon's per-row/column normalisation of orthogonalised updates, in place; returns ``v``.

    v: (G, rows, cols) bf16 (or fp32).  second_moment: fp32 (G, rows, 1) when rows >= cols,
    else (G, 1, cols); an EMA (``beta2``) of the mean square of v over the other dimension.
    Each row (column) is divided by the root of its second moment, then the matrix is scaled back
    to the Frobenius norm it had before.
    """
    return v.mul_(_variance_reduction_scale(v, second_moment, beta2).to(v.dtype))


def normuon_momentum_(grad: Tensor, momentum_buffer: Tensor, momentum: Tensor | float) -> Tensor:
    """Step 1 of the update and Polar Express's normalisation, on a shard of G matrices.

    grad: (G, rows, cols) any float dtype (read only).  momentum_buffer: fp32 (G, rows, cols),
    ``lerp(buf, g, 1 - momentum)`` in place.  momentum: a float or a 0-dim fp32 tensor.  Returns
    the Nesterov look-ahead ``lerp(g, buf, momentum)`` normalised for Polar Express: contiguous bf16
    (G, rows, cols) (:func:`speedrun.kernels.polar_express.polar_express_normalize`).
    """
    from speedrun.kernels.polar_express import polar_express_normalize

    g = grad.float()
    momentum_buffer.lerp_(g, 1.0 - momentum)
    return polar_express_normalize(g.lerp(momentum_buffer, momentum))


def normuon_apply_(v: Tensor, p: Tensor, mantissa: Tensor | None, second_moment: Tensor,
                   lr: Tensor | float, wd: Tensor | float, beta2: float) -> None:
    """Steps 3-4 of the update on a shard of G matrices: variance reduction, then cautious weight
    decay and the step on the fp32 master weight, written back in place.

    v: bf16 (G, rows, cols), Polar Express's output (read only).  p: fp32 weights (``mantissa``
    None), or bf16 weights as their int16 bits with ``mantissa`` their int16 low halves (bits,
    because the compiled update cannot write through a dtype view of its input).  second_moment:
    see :func:`normuon_variance_reduction_`.  lr: float or fp32 tensor broadcastable to (G, 1, 1);
    wd: float or 0-dim fp32 tensor (see :func:`normuon_update_`).
    """
    v = (v * _variance_reduction_scale(v, second_moment, beta2).to(v.dtype)).float()
    master = p.float() if mantissa is None else join_bf16(p, mantissa)
    keep_sign = (v * master >= 0).to(torch.float32)  # cautious WD: decay only where v agrees with p
    new = master - master * keep_sign * (wd * lr) - v * lr
    if mantissa is None:
        p.copy_(new)
    else:
        split_fp32(new, p, mantissa)


# One compiled pair per backend, made on first use (compiling is not an import-time side effect).
_COMPILED_PARTS: dict[str | Callable, tuple[Callable, Callable]] = {}


def _compiled_parts(backend: str | Callable) -> tuple[Callable, Callable]:
    parts = _COMPILED_PARTS.get(backend)
    if parts is None:
        opts = {"dynamic": False, "fullgraph": True, "backend": backend}
        parts = _COMPILED_PARTS[backend] = (torch.compile(normuon_momentum_, **opts),
                                            torch.compile(normuon_apply_, **opts))
    return parts


def normuon_update_(
    p: Tensor,
    mantissa: Tensor | None,
    grad: Tensor,
    momentum_buffer: Tensor,
    second_moment: Tensor,
    *,
    lr: Tensor | float,
    wd: Tensor | float,
    momentum: Tensor | float,
    beta2: float,
    use_triton: bool | None = None,
    compile_backend: str | Callable | None = None,
) -> Tensor:
    """One NorMuon step on a shard of G matrices, in place; returns ``p``.

    p: (G, rows, cols) weights, bf16 (then ``mantissa`` is an int16 (G, rows, cols) buffer of the
    low fp32 bits) or fp32 (``mantissa`` None).  grad: (G, rows, cols) any float dtype (read only).
    momentum_buffer: fp32 (G, rows, cols).  second_moment: see :func:`normuon_variance_reduction_`.
    lr: effective step size ``base_lr * schedule * lr_mul``, a float or an fp32 (G, 1, 1) tensor of
    per-matrix values.  wd: ``weight_decay * wd_mul * base_lr * schedule``, so the applied decay
    is wd * lr (quadratic in the learning rate, as in the record).
    compile_backend: None runs the elementwise parts eagerly (~34 passes over each bank);
    a ``torch.compile`` backend ("inductor") fuses them before and after Polar Express, as the
    record does (one graph per bank shape, compiled on the first call).
    """
    from speedrun.kernels.polar_express import polar_express_iterate

    if p.dtype == torch.bfloat16:
        if mantissa is None:
            raise ValueError("normuon_update_: bf16 weights need a mantissa buffer")
        weights = p.view(torch.int16)
    else:
        weights, mantissa = p, None
    if compile_backend is None:
        momentum_fn, apply_fn = normuon_momentum_, normuon_apply_
    else:
        momentum_fn, apply_fn = _compiled_parts(compile_backend)
        # A float argument is a constant of the compiled graph (a new value compiles a new graph);
        # the schedule changes these every step, so they travel as device tensors.
        momentum, wd, lr = (x if isinstance(x, Tensor) else torch.full((), float(x), device=p.device)
                            for x in (momentum, wd, lr))
    v = polar_express_iterate(momentum_fn(grad, momentum_buffer, momentum), use_triton=use_triton)
    apply_fn(v, weights, mantissa, second_moment, lr, wd, beta2)
    return p


# ------------------------------------------------------------------------------------------------
# Communication helpers (NCCL fast path; generic fallback for gloo)


class _Pending:
    """An async collective plus what to do when it finishes; ``wait()`` returns the result."""

    def __init__(self, work: Any, finish: Callable[[], Tensor]):
        self.work, self.finish = work, finish

    def wait(self) -> Tensor:
        if self.work is not None:
            self.work.wait()
        return self.finish()


def _to_device(a: np.ndarray, device: torch.device) -> Tensor:
    """Host array ``a`` on ``device`` without the host waiting: on CUDA from pinned memory,
    non-blocking (the caching host allocator keeps the pinned copy until the transfer has run)."""
    t = torch.from_numpy(a)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _host_mask(saved: Any, label: str, rows: int) -> np.ndarray:
    """A saved sparse row mark as the optimizer keeps it: a fresh (rows,) bool numpy array.
    Checkpoints hold a bool CPU tensor, older ones a bool tensor on the device they ran on."""
    mask = np.array(saved.detach().cpu() if isinstance(saved, Tensor) else saved, dtype=np.bool_)
    if mask.shape != (rows,):
        raise ValueError(f"state_dict touched rows of {label}: shape {mask.shape} does not match ({rows},)")
    return mask


def _finish(gather: tuple[_Pending | None, Callable[[], None] | None]) -> None:
    fut, fin = gather
    if fut is not None:
        fut.wait()
    if fin is not None:
        fin()


class _Comms:
    """``group``: the ranks' process group (None: the world's).  ``host_group``: a gloo group over
    the same ranks for host tensors, where the caller has one (``DistInfo.host_group`` for the
    world); else :meth:`_cpu_group` makes one."""

    def __init__(self, group: Any = None, host_group: Any = None):
        self.group = group
        self.active = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size(group) if self.active else 1
        self.rank = dist.get_rank(group) if self.active else 0
        self.nccl = self.active and dist.get_backend(group) == "nccl"
        self._cpu = host_group  # the gloo group beside an NCCL one (see _cpu_group)

    def all_reduce_avg(self, t: Tensor) -> _Pending:
        if self.nccl:
            return _Pending(dist.all_reduce(t, op=dist.ReduceOp.AVG, group=self.group, async_op=True), lambda: t)
        work = dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Pending(work, lambda: t.div_(self.world))

    def reduce_scatter_avg(self, full: Tensor) -> _Pending:
        """Average ``full`` (dim 0 divisible by world) over ranks; result: this rank's dim-0 chunk."""
        chunk = full.size(0) // self.world
        full = full.contiguous()
        if self.nccl:
            out = torch.empty((chunk, *full.shape[1:]), dtype=full.dtype, device=full.device)
            work = dist.reduce_scatter_tensor(out, full, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
            return _Pending(work, lambda: out)
        buf = full.clone()
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        return _Pending(work, lambda: buf[self.rank * chunk:(self.rank + 1) * chunk].div_(self.world))

    def all_gather(self, out: Tensor, shard: Tensor) -> _Pending:
        """Gather every rank's ``shard`` into contiguous ``out`` (dim 0 = world * shard dim 0)."""
        shard = shard.contiguous()
        if self.nccl:
            return _Pending(dist.all_gather_into_tensor(out, shard, group=self.group, async_op=True), lambda: out)
        parts = list(out.chunk(self.world, dim=0))
        work = dist.all_gather(parts, shard, group=self.group, async_op=True)
        return _Pending(work, lambda: out)

    def all_to_all(self, out: Tensor, inp: Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=self.group)

    def exchange_counts(self, send_counts: Tensor) -> Tensor:
        """int64 (world,) CPU tensors: how many items every rank sends this rank, given what this
        rank sends each.  A collective on the host (:meth:`_cpu_group`): it waits for the other
        ranks' hosts, never for a device."""
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self._cpu_group())
        return recv_counts

    def _cpu_group(self) -> Any:
        """The group for CPU tensors: ``group`` itself unless it is NCCL (GPU tensors only), else a
        gloo group over the same ranks, made on first use.  Making it is collective over the whole
        world: every rank asks at the same step (the first sparse exchange)."""
        if not self.nccl:
            return self.group
        if self._cpu is None:
            ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
            self._cpu = dist.new_group(ranks=ranks, backend="gloo")
        return self._cpu


# ------------------------------------------------------------------------------------------------
# The optimizer


@dataclass
class _Entry:
    spec: ParamGroupSpec
    param: Tensor
    comms: str
    # NorMuon bank layout
    groups: int = 0
    rows: int = 0
    cols: int = 0
    padded_groups: int = 0
    chunk: int = 0  # matrices (NorMuon) or dim-0 rows (sharded Adam) owned by this rank
    lr_mul: Tensor | None = None  # NorMuon: fp32 (chunk, 1, 1) per-matrix multipliers
    state: dict = field(default_factory=dict)


@dataclass(frozen=True)
class StepPlan:
    """What one optimizer step does, decided on the host before any kernel runs
    (:meth:`NorMuonAndAdam.prepare`).  ``stepping``, ``fold_embed`` and ``split_embed`` decide
    which kernels the step launches (a captured step is replayed only for the same ones); the
    step's changing values (learning rates, momentum, Adam's bias corrections) are not here: they
    are in the optimizer's device buffer of step values, written by ``prepare``."""

    step_index: int
    do_adam: bool
    stepping: tuple[str, ...]  # labels updated this step, in table order
    fold_embed: bool  # while tied: embed's gradient is added into lm_head's
    split_embed: bool  # embed and lm_head are separate parameters (after untie)
    untie: bool  # untie right after this step (a host-side change of the optimizer's layout)

    @property
    def structure(self) -> tuple:
        """The kernel-deciding part: equal for steps a captured step may stand for."""
        return (self.do_adam, self.stepping, self.fold_embed, self.split_embed, self.untie)


class NorMuonAndAdam:
    """The record's combined optimizer.

    params: mapping label -> parameter (each needs a spec in ``table``; specs without a parameter
        are ignored, so a model may use a subset of the record table).
    table: the :class:`ParamGroupSpec` list; its order is the reduce order.
    work_order: labels in the order updates run (default: table order); unknown labels ignored.
    hyper: base hyperparameters.  schedule: optional object with ``at(step)`` returning something
        with ``lr_mult``, ``muon_momentum``, ``adam_step`` and ``untie`` attributes (e.g.
        :class:`speedrun.optim.schedule.RecordSchedule`); then ``step(i)`` needs nothing else.
    tied: optional (lm_head_label, embed_label) whose weights start tied: lm_head is (D, V), embed
        (V, D); embed's gradient is folded into lm_head's and embed gets lm_head^T until
        :meth:`untie`.
    group: process group (default: the world when torch.distributed is initialised).
    host_group: a gloo group over ``group``'s ranks for the sparse exchange's host-side counts
        beside NCCL (``DistInfo.host_group``); None: one is made at the first exchange.
    comms: the communicator itself instead of ``group``'s (e.g.
        :class:`speedrun.optim.simcomms.SimulatedComms`: one rank of N, collectives as no-ops).
    use_triton: Triton kernels for Polar Express and the Adam update (None: on CUDA; True on CPU
        needs TRITON_INTERPRET=1).
    compile_backend: None, or the ``torch.compile`` backend that fuses NorMuon's elementwise work
        around Polar Express (see :func:`normuon_update_`; "inductor" on the GPU).

    Usage per training step: backward, then ``opt.step(step_index)``.  ``step`` clears the grads it
    consumed (set to None); Adam grads are kept on even steps so the next backward adds to them.
    Do not call :meth:`zero_grad` between steps.  ``step`` is :meth:`prepare` (host: the plan, Adam's
    step counts, the step's values written to ``step_values``) then :meth:`launch` (the kernels,
    which read those values from the device): a CUDA graph of ``launch`` replays any step with the
    same :attr:`StepPlan.structure` after its own ``prepare``.
    """

    def __init__(
        self,
        params: Mapping[str, Tensor] | Iterable[tuple[str, Tensor]],
        table: Sequence[ParamGroupSpec] | None = None,
        *,
        work_order: Sequence[str] | None = None,
        hyper: OptimizerHyper | None = None,
        schedule: Any = None,
        tied: tuple[str, str] | None = None,
        group: Any = None,
        host_group: Any = None,
        use_triton: bool | None = None,
        compile_backend: str | None = None,
        comms: _Comms | None = None,
    ):
        params = dict(params)
        table = list(record_param_table() if table is None else table)
        specs = {s.label: s for s in table}
        missing = sorted(set(params) - set(specs))
        if missing:
            raise ValueError(f"NorMuonAndAdam: no ParamGroupSpec for parameter(s) {missing}; "
                             f"known labels: {sorted(specs)}")
        self.hyper = hyper or OptimizerHyper()
        self.schedule = schedule
        self.use_triton = use_triton
        self.compile_backend = compile_backend
        self.comms = comms if comms is not None else _Comms(group, host_group)
        self.order = [s.label for s in table if s.label in params]
        wo = list(work_order) if work_order is not None else list(self.order)
        self.work_order = [lab for lab in wo if lab in params] + [lab for lab in self.order if lab not in wo]
        self.entries: dict[str, _Entry] = {}
        for label in self.order:
            self.entries[label] = self._build_entry(specs[label], params[label])
        if tied is not None:
            for lab in tied:
                if lab not in self.entries or self.entries[lab].spec.optim != "adam":
                    raise ValueError(f"NorMuonAndAdam: tied label {lab!r} must be an Adam parameter present in params")
            lm, em = (self.entries[lab].param for lab in tied)
            if lm.ndim != 2 or tuple(em.shape) != (lm.shape[1], lm.shape[0]):
                raise ValueError(f"NorMuonAndAdam: tied weights must be (D, V) and (V, D), got "
                                 f"{tuple(lm.shape)} and {tuple(em.shape)}")
        self.tied = tied
        self.split_embed = False
        self.lr_mult = 1.0
        self.muon_momentum = self.hyper.muon_momentum
        # "sharded_sparse" label -> (rows,) bool host mask: rows marked since the last Adam step
        self._touched: dict[str, np.ndarray] = {}
        # the step's values on the device: slots 0, 1 NorMuon's base lr and momentum, then one slot
        # (weight decay) per NorMuon label and two (step size, decay) per Adam label, table order
        self._slots: dict[str, int] = {}
        n = 2
        for label in self.order:
            self._slots[label] = n
            n += 1 if self.entries[label].spec.optim == "normuon" else 2
        device = next(iter(params.values())).device if params else torch.device("cpu")
        self.step_values = StepValues(device, n)
        self.reset()

    # -- construction ---------------------------------------------------------------------------

    def _build_entry(self, spec: ParamGroupSpec, p: Tensor) -> _Entry:
        W, rank = self.comms.world, self.comms.rank
        comms = "none" if W == 1 else spec.comms
        e = _Entry(spec=spec, param=p, comms=comms)
        if spec.optim == "normuon":
            if not p.is_contiguous():
                raise ValueError(f"NorMuon parameter {spec.label!r} must be contiguous")
            rows, cols = spec.matrix_shape or (tuple(p.shape[-2:]) if p.ndim >= 2 else (0, 0))
            if p.ndim < 2 or rows * cols == 0 or p.numel() % (rows * cols):
                raise ValueError(f"NorMuon parameter {spec.label!r} of shape {tuple(p.shape)} cannot be "
                                 f"viewed as matrices of {(rows, cols)}")
            e.groups, e.rows, e.cols = p.numel() // (rows * cols), rows, cols
            shards = W if comms == "sharded" else 1
            e.padded_groups = -(-e.groups // shards) * shards
            e.chunk = e.padded_groups // shards
            first = rank * e.chunk if comms == "sharded" else 0
            shape_mul = max(1.0, rows / cols) ** 0.5
            muls = [shape_mul * spec.lr_mul * (spec.odd_matrix_lr_mul if (first + i) % 2 else 1.0)
                    for i in range(e.chunk)]
            e.lr_mul = torch.tensor(muls, dtype=torch.float32, device=p.device).view(-1, 1, 1)
        else:
            if comms in ("sharded", "sharded_sparse") and (p.ndim == 0 or p.shape[0] % W):
                warnings.warn(f"Adam parameter {spec.label!r} of shape {tuple(p.shape)} cannot be split "
                              f"over {W} ranks along dim 0; all-reducing it instead", stacklevel=3)
                comms = "replicated"
            e.comms = comms
            e.chunk = p.shape[0] // W if comms in ("sharded", "sharded_sparse") else (p.shape[0] if p.ndim else 1)
        return e

    def _init_state(self, e: _Entry) -> None:
        p = e.param
        if e.spec.optim == "adam":
            shard = self._adam_shard(e)
            e.state = new_adam_state(shard)
            return
        shape = (e.chunk, e.rows, e.cols)
        red_shape = (e.chunk, e.rows, 1) if e.rows >= e.cols else (e.chunk, 1, e.cols)
        e.state = {
            "momentum_buffer": torch.zeros(shape, dtype=torch.float32, device=p.device),
            "second_moment": torch.zeros(red_shape, dtype=torch.float32, device=p.device),
        }
        if p.dtype == torch.bfloat16:
            e.state["mantissa"] = torch.zeros(shape, dtype=torch.int16, device=p.device)

    def reset(self) -> None:
        """Zero all optimizer state (moments, step counts, mantissas), re-tie embed/lm_head and
        forget touched sparse rows.  Use after an untimed warmup together with restoring weights."""
        for e in self.entries.values():
            self._init_state(e)
        self.split_embed = False
        self._touched.clear()

    # -- shards -----------------------------------------------------------------------------------

    def _adam_shard(self, e: _Entry) -> Tensor:
        if e.comms in ("sharded", "sharded_sparse"):
            r = self.comms.rank
            return e.param.data[r * e.chunk:(r + 1) * e.chunk]
        return e.param.data

    def _bank(self, t: Tensor, e: _Entry) -> Tensor:
        """(G, rows, cols) view of a bank-shaped tensor, zero-padded to ``padded_groups``."""
        v = t.reshape(e.groups, e.rows, e.cols)
        if e.padded_groups == e.groups:
            return v
        pad = torch.zeros((e.padded_groups - e.groups, e.rows, e.cols), dtype=v.dtype, device=v.device)
        return torch.cat([v, pad])

    # -- public controls --------------------------------------------------------------------------

    def set_lr_momentum(self, lr_mult: float, muon_momentum: float | None = None) -> None:
        """Set the schedule's lr multiplier (applies to every base lr) and the NorMuon momentum."""
        self.lr_mult = float(lr_mult)
        if muon_momentum is not None:
            self.muon_momentum = float(muon_momentum)

    def mark_rows(self, label: str, rows: Tensor | np.ndarray) -> None:
        """Record that this rank's ``label`` gradient may be non-zero in ``rows``: dim-0 indices
        (any integer dtype and shape) or a (table rows,) bool mask, on the host, a CPU tensor or a
        numpy array.  A mask is OR-ed in, a pass over the table's rows; indices are scattered, a
        random write per index: the loader builds the mask ahead, off the step's thread.

        For "sharded_sparse" tables: call once per micro-batch with the rows its forward looks up
        (the loader's mask of the rows its bigram ids look up, ``Batch.bigram_rows``); the next Adam step
        exchanges only the rows marked since the last one.  A table with no marked rows falls back
        to the dense reduce-scatter, which is always correct.  Host work only, outside any CUDA
        graph.  Rows on a GPU are refused, since reading them would make the host wait for the
        device, at any world size (a mistake shows on one GPU too); apart from that check, nothing
        happens for tables not exchanged sparsely (one rank: nothing is exchanged).
        """
        if isinstance(rows, Tensor):
            if rows.device.type != "cpu":
                raise ValueError(f"NorMuonAndAdam.mark_rows({label!r}): rows must be on the host (a CPU tensor "
                                 f"or a numpy array), got a tensor on {rows.device}; reading it would make "
                                 "the host wait for the device (pass the loader's host mask, Batch.bigram_rows)")
            rows = rows.numpy()
        e = self.entries[label]
        if e.comms != "sharded_sparse":
            return
        rows = np.asarray(rows)
        n = e.param.shape[0]
        if rows.dtype == np.bool_ and rows.shape != (n,):
            raise ValueError(f"NorMuonAndAdam.mark_rows({label!r}): a bool mask must have one entry per row "
                             f"({n}), got shape {rows.shape}")
        mask = self._touched.get(label)
        if mask is None:
            mask = self._touched[label] = np.zeros(n, dtype=np.bool_)
        if rows.dtype == np.bool_:
            np.logical_or(mask, rows, out=mask)
        else:
            mask[rows.reshape(-1)] = True

    def zero_grad(self) -> None:
        """Drop every gradient (including Adam's accumulated ones)."""
        for e in self.entries.values():
            e.param.grad = None

    # -- the step -----------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, step_index: int, *, lr_mult: float | None = None, muon_momentum: float | None = None,
             do_adam: bool | None = None) -> None:
        """Update all parameters for training step ``step_index`` (0-based): :meth:`prepare` then
        :meth:`launch` (see there for the arguments)."""
        self.launch(self.prepare(step_index, lr_mult=lr_mult, muon_momentum=muon_momentum, do_adam=do_adam))

    def prepare(self, step_index: int, *, lr_mult: float | None = None, muon_momentum: float | None = None,
                do_adam: bool | None = None) -> StepPlan:
        """The host half of a step: which labels update (those holding a gradient, Adam ones on
        Adam steps, embed not while tied to lm_head), Adam's step counts advanced, and the step's
        values queued into ``step_values`` (one host-to-device copy).  Values not given come from
        the schedule (if one was passed), else from :meth:`set_lr_momentum`; ``do_adam`` defaults
        to ``step_index`` being odd."""
        settings = self.schedule.at(step_index) if self.schedule is not None else None
        if lr_mult is None:
            lr_mult = settings.lr_mult if settings is not None else self.lr_mult
        if muon_momentum is None:
            muon_momentum = settings.muon_momentum if settings is not None else self.muon_momentum
        if do_adam is None:
            do_adam = settings.adam_step if settings is not None else step_index % 2 == 1
        untie = bool(settings is not None and getattr(settings, "untie", False) and self.tied and not self.split_embed)
        lm_label, em_label = self.tied if (self.tied and not self.split_embed) else (None, None)
        stepping = tuple(lab for lab in self.order
                         if not (self.entries[lab].spec.optim == "adam" and not do_adam)
                         and self.entries[lab].param.grad is not None and lab != em_label)
        fold = lm_label in stepping and self.entries[em_label].param.grad is not None
        h = self.hyper
        base_lr = h.muon_lr * lr_mult
        values = [0.0] * self.step_values.buffer.numel()
        values[0], values[1] = base_lr, muon_momentum
        for label in stepping:
            e, slot = self.entries[label], self._slots[label]
            if e.spec.optim == "normuon":
                values[slot] = h.muon_weight_decay * e.spec.wd_mul * base_lr
            else:
                e.state["step"] += 1
                values[slot], values[slot + 1] = adam_scalars(
                    e.state["step"], lr=h.adam_lr * lr_mult * e.spec.lr_mul, betas=e.spec.betas,
                    weight_decay=h.adam_weight_decay * e.spec.wd_mul)
        self.step_values.write(values)
        return StepPlan(step_index, do_adam, stepping, fold, self.split_embed, untie)

    @torch.no_grad()
    def launch(self, plan: StepPlan) -> None:
        """The device half of a step: :meth:`launch_kernels`, then :meth:`release_grads`; with
        ``plan.untie``, :meth:`untie` after the update."""
        self.launch_kernels(plan)
        self.release_grads(plan)
        if plan.untie:
            self.untie()

    def release_grads(self, plan: StepPlan) -> None:
        """Set the gradients the step consumed to None (NorMuon's always, Adam's on Adam steps;
        Adam's are kept on other steps so the next backward adds to them) and, on Adam steps,
        clear the sparse row marks that went with Adam's.  Host-side only."""
        for e in self.entries.values():
            if e.spec.optim == "normuon" or plan.do_adam:
                e.param.grad = None
        if plan.do_adam:
            for mask in self._touched.values():
                mask.fill(False)

    @torch.no_grad()
    def launch_kernels(self, plan: StepPlan) -> None:
        """Reductions, updates (reading the values :meth:`prepare` wrote) and gathers in the order
        of the table and work order: every kernel of the step (so a CUDA graph of it replays the
        whole update on one rank; on several, the sparse exchange sizes its messages on the host)."""
        lm_label, em_label = self.tied if (self.tied and not plan.split_embed) else (None, None)
        vals = self.step_values.buffer
        base_lr, momentum = vals[0], vals[1]

        # Phase 1: launch every reduction in table order.
        pending: dict[str, Any] = {}
        for label in plan.stepping:
            e = self.entries[label]
            if label == lm_label and plan.fold_embed:
                e.param.grad.add_(self.entries[em_label].param.grad.mT)
            pending[label] = self._launch_reduce(e)

        # Phase 2: updates in work order, each followed by its gather.
        gathers: list[tuple[_Pending | None, Callable[[], None] | None]] = []
        for label in self.work_order:
            if label not in pending:
                continue
            e, slot = self.entries[label], self._slots[label]
            grad = pending[label]() if callable(pending[label]) else pending[label].wait()
            gather: tuple[_Pending | None, Callable[[], None] | None] = (None, None)
            if e.spec.optim == "adam":
                shard = self._adam_shard(e)
                adam_apply_auto_(shard, grad, e.state["exp_avg"], e.state["exp_avg_sq"], betas=e.spec.betas,
                                 eps=self.hyper.adam_eps, step_size=vals[slot], decay=vals[slot + 1],
                                 use_triton=self.use_triton)
                if e.comms in ("sharded", "sharded_sparse"):
                    gather = (self.comms.all_gather(e.param.data, shard), None)
            else:
                gather = self._normuon_step(e, grad, base_lr, vals[slot], momentum)
            if label == lm_label:  # the embed copy needs the full lm_head now
                _finish(gather)
                self.entries[em_label].param.data.copy_(e.param.data.mT)
            else:
                gathers.append(gather)

        # Phase 3: finish gathers.
        for gather in gathers:
            _finish(gather)

    def _launch_reduce(self, e: _Entry):
        g = e.param.grad
        if e.spec.optim == "normuon":
            if e.comms == "sharded":
                return self.comms.reduce_scatter_avg(self._bank(g, e))
            if e.comms == "replicated":
                return self.comms.all_reduce_avg(g)  # reshaped at update time
            return _Pending(None, lambda: g)
        if e.comms == "replicated":
            return self.comms.all_reduce_avg(g)
        if e.comms == "sharded":
            return self.comms.reduce_scatter_avg(g)
        if e.comms == "sharded_sparse":
            if e.spec.label in self._touched:
                return lambda: self._sparse_reduce(e)
            return self.comms.reduce_scatter_avg(g)
        return _Pending(None, lambda: g)

    def _sparse_reduce(self, e: _Entry) -> Tensor:
        """Average the touched rows of a row-sharded table's gradient into this rank's shard.

        Sized on the host: the rows come from the host marks (:meth:`mark_rows`), the counts each
        rank receives from a CPU collective, so the host never waits for the device here."""
        g, W, rank, chunk = e.param.grad, self.comms.world, self.comms.rank, e.chunk
        rows = np.flatnonzero(self._touched[e.spec.label])  # ascending, so grouped by owner
        owner = rows // chunk
        away = owner != rank  # our own rows are already in our shard of g
        send_counts = np.bincount(owner[away], minlength=W).astype(np.int64)
        rc = self.comms.exchange_counts(torch.from_numpy(send_counts)).tolist()
        sc = send_counts.tolist()
        send = _to_device(rows[away], g.device)
        recv_rows = torch.empty(sum(rc), dtype=torch.int64, device=g.device)
        self.comms.all_to_all(recv_rows, send, rc, sc)
        width = g[0].numel()
        recv_vals = torch.empty((sum(rc), width), dtype=g.dtype, device=g.device)
        self.comms.all_to_all(recv_vals.view(-1), g[send].reshape(-1), [c * width for c in rc], [c * width for c in sc])
        shard = g[rank * chunk:(rank + 1) * chunk]
        shard.index_add_(0, recv_rows - rank * chunk, recv_vals.view(-1, *g.shape[1:]))
        return shard.mul_(1.0 / W)

    def _normuon_step(self, e: _Entry, grad: Tensor, base_lr: Tensor, wd: Tensor, momentum: Tensor):
        """``base_lr``, ``wd`` and ``momentum``: 0-d fp32 device tensors (the step values)."""
        sharded = e.comms == "sharded"
        grad = grad.reshape(e.chunk, e.rows, e.cols)
        first = self.comms.rank * e.chunk if sharded else 0
        full = e.param.data.view(e.groups, e.rows, e.cols)
        if first + e.chunk <= e.groups:
            local, copy_back = full[first:first + e.chunk], None
        else:  # this shard reaches into the zero padding: work on a padded copy
            local = torch.zeros((e.chunk, e.rows, e.cols), dtype=full.dtype, device=full.device)
            n_real = max(0, e.groups - first)
            local[:n_real] = full[first:first + n_real]
            copy_back = n_real
        normuon_update_(local, e.state.get("mantissa"), grad, e.state["momentum_buffer"], e.state["second_moment"],
                        lr=e.lr_mul * base_lr, wd=wd, momentum=momentum, beta2=self.hyper.muon_beta2, use_triton=self.use_triton,
                        compile_backend=self.compile_backend)
        if not sharded:
            if copy_back is not None:
                full[:copy_back] = local[:copy_back]
            return (None, None)
        if e.padded_groups == e.groups:
            return (self.comms.all_gather(full.view(e.padded_groups, e.rows, e.cols), local), None)
        out = torch.empty((e.padded_groups, e.rows, e.cols), dtype=full.dtype, device=full.device)
        fut = self.comms.all_gather(out, local)
        return (fut, lambda: full.copy_(out[: e.groups]))

    # -- untying ---------------------------------------------------------------------------------

    @torch.no_grad()
    def untie(self) -> None:
        """Stop tying embed to lm_head: embed's Adam state becomes lm_head's state transposed (the
        record does this right after the step at the split step)."""
        if not self.tied or self.split_embed:
            return
        lm, em = (self.entries[lab] for lab in self.tied)
        em.state["step"] = lm.state["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            src = lm.state[key]
            if lm.comms in ("sharded", "sharded_sparse"):
                full = torch.empty(lm.param.shape, dtype=src.dtype, device=src.device)
                self.comms.all_gather(full, src).wait()
            else:
                full = src
            full_t = full.mT
            if em.comms in ("sharded", "sharded_sparse"):
                r = self.comms.rank
                full_t = full_t[r * em.chunk:(r + 1) * em.chunk]
            em.state[key].copy_(full_t)
        self.split_embed = True

    # -- state ---------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's state: {"labels": {label: {name: tensor|int}}, "split_embed", "world_size",
        "rank", "pending_grads", "touched"}.  ``pending_grads``: the Adam gradients summed since the
        last Adam step (after an even step they carry a step's worth of signal, so a resume needs
        them); ``touched``: the rows marked for the sparse exchange since then, (rows,) bool CPU
        tensors.  Tensors are references; deep-copy to snapshot."""
        return {
            "labels": {lab: dict(e.state) for lab, e in self.entries.items()},
            "split_embed": self.split_embed,
            "world_size": self.comms.world,
            "rank": self.comms.rank,
            "pending_grads": {lab: e.param.grad for lab, e in self.entries.items()
                              if e.spec.optim == "adam" and e.param.grad is not None},
            "touched": {lab: torch.from_numpy(mask) for lab, mask in self._touched.items()},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Copy a :meth:`state_dict` from the same world size and rank back in (in place)."""
        if sd.get("world_size", 1) != self.comms.world:
            raise ValueError(f"state_dict was saved with world size {sd.get('world_size')}, "
                             f"this optimizer runs with {self.comms.world}")
        for lab, saved in sd["labels"].items():
            if lab not in self.entries:
                raise ValueError(f"state_dict has unknown label {lab!r}")
            st = self.entries[lab].state
            for k, v in saved.items():
                if isinstance(v, Tensor):
                    if k not in st or st[k].shape != v.shape:
                        raise ValueError(f"state_dict {lab}.{k}: shape {tuple(v.shape)} does not match")
                    st[k].copy_(v)
                else:
                    st[k] = v
        self.split_embed = bool(sd.get("split_embed", False))
        if "pending_grads" in sd:
            for lab, e in self.entries.items():
                g = sd["pending_grads"].get(lab)
                if g is not None and g.shape != e.param.shape:
                    raise ValueError(f"state_dict pending gradient of {lab}: shape {tuple(g.shape)} does not match")
                e.param.grad = None if g is None else g.detach().to(e.param.device, e.param.dtype).clone()
            self._touched = {lab: _host_mask(m, lab, self.entries[lab].param.shape[0])
                             for lab, m in sd.get("touched", {}).items()}

