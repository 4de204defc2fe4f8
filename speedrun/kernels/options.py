"""How the fused kernels run: one typed, immutable object instead of module-level switches.

:class:`KernelOptions` is made once per run from the config (:meth:`KernelOptions.from_config`,
called by :func:`speedrun.train.builder.build_run`) and handed to the kernels installed on the
model (``speedrun.model.kernel_hooks``), which pass its values to each kernel call explicitly.
Two runs in one process (the arms of ``speedrun bench step``) each carry their own, so nothing is
re-applied between their steps.  The one process-wide part is the launch path of our Triton
kernels (``triton_launch``, :func:`speedrun.kernels._triton.set_enabled`), which the builder sets
and which every arm of one benchmark must share.
"""

from __future__ import annotations

from dataclasses import dataclass

from speedrun.config import CE_GRAD_LAYOUT_CHOICES, CE_SIGMOID_CHOICES
from speedrun.errors import ConfigError

TRITON_LAUNCH_CHOICES = ("cached", "plain")
MLP_GEMM_CHOICES = ("auto", "fused", "tma", "split")


@dataclass(frozen=True)
class KernelOptions:
    """``triton_launch``: "cached" (launch through the compiled handle) or "plain"
    (``kernel[grid](...)``); ``mlp_gemm``: the ReLU² MLP's GEMM route, "auto" = per direction
    and dtype (:data:`speedrun.kernels.mlp.DEFAULT_GEMM_IMPL`) or one of fused/tma/split for all;
    ``ce_sigmoid``: how the CE kernel evaluates the softcap's sigmoid (exact or tanh);
    ``ce_grad_layout``: whether the FP8 head's CE kernel also writes the transposed logit
    gradient ("dual") or the backward transposes it ("transpose").  The defaults are the
    kernels' own defaults.  Values outside the choices raise :class:`ConfigError` naming the
    ``train.*`` field they come from."""

    address_leaf = True  # holds no tensor: the CUDA graphs' address watch need not look inside

    triton_launch: str = "cached"
    mlp_gemm: str = "auto"
    ce_sigmoid: str = "exact"
    ce_grad_layout: str = "transpose"

    def __post_init__(self) -> None:
        for name, choices in (("triton_launch", TRITON_LAUNCH_CHOICES), ("mlp_gemm", MLP_GEMM_CHOICES),
                              ("ce_sigmoid", CE_SIGMOID_CHOICES), ("ce_grad_layout", CE_GRAD_LAYOUT_CHOICES)):
            value = getattr(self, name)
            if value not in choices:
                raise ConfigError(f"train.{name} must be one of {', '.join(choices)}, got {value!r}")

    @classmethod
    def from_config(cls, train_cfg) -> "KernelOptions":
        """From a :class:`speedrun.config.TrainConfig`'s fields of the same names."""
        return cls(triton_launch=train_cfg.triton_launch, mlp_gemm=train_cfg.mlp_gemm,
                   ce_sigmoid=train_cfg.ce_sigmoid, ce_grad_layout=train_cfg.ce_grad_layout)

    @property
    def mlp_gemm_route(self) -> str | None:
        """``impl`` for :func:`speedrun.kernels.mlp.relu2_gemm` (None: its per-case default)."""
        return None if self.mlp_gemm == "auto" else self.mlp_gemm
