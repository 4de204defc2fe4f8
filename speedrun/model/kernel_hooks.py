"""Plug the fused kernels into the record network's hooks (``ce_impl``, ``mlp_impl``).

Modes (``ModelConfig.kernels``):

- ``triton``: fused Triton softcapped multi-token CE (bf16 head GEMMs) and the fused ReLU^2 MLP
  kernel in bf16;
- ``fp8``: the record baseline: FP8 lm_head (static tensorwise scales, e5m2 gradients) and the
  MLP with an FP8 forward (``relu2_mlp(mode="fp8_fwd")``);
- ``fp8_full``: FP8 lm_head and FP8 across all MLP GEMMs (``mode="fp8_full"``).

The MLP keeps one :class:`~speedrun.kernels.mlp.MLPScaleState` per layer (delayed activation
scales) and takes its FP8 weights from the model's per-update cache
(:meth:`RecordGPT.refresh_fp8_weights`); before the first refresh (a bare forward outside
training) it quantises them on the call with current scaling.  The FP8 head takes its quantised
weight from the same refresh (``RecordGPT.head_fp8_weight``).  The kernels want bf16
activations: fp32 inputs (CPU runs) are cast to bf16 around the call and back.  The record's
softmax runs over the padded vocabulary, so the head passes ``vocab_size=None``.
"""

from __future__ import annotations

import torch

from speedrun.errors import ConfigError
from speedrun.kernels.options import KernelOptions

MODES = ("reference", "triton", "fp8", "fp8_full")


class FusedHead:
    """``ce_impl`` with the signature of ``record_parts.softcapped_mtp_ce``.

    ``fp8_weight``: a callable returning the model's per-update
    :class:`~speedrun.kernels.cross_entropy.HeadFP8Weight` of ``lm_head`` (or None before the first
    refresh: the call quantises the weight itself)."""

    def __init__(self, use_fp8: bool, fp8_weight=None, options: KernelOptions = KernelOptions()):
        self.use_fp8 = use_fp8
        self.fp8_weight = fp8_weight
        self.options = options  # ce_sigmoid, ce_grad_layout

    def __call__(self, h, lm_head, targets, mtp_weights, prefix_targets, prefix_weight, *, softcap):
        from speedrun.kernels.cross_entropy import fused_softcapped_ce

        dtype = torch.bfloat16 if (self.use_fp8 or h.device.type == "cuda") else h.dtype
        x = h.to(dtype).contiguous()
        w = lm_head.to(dtype).contiguous()
        cached = self.fp8_weight() if (self.use_fp8 and self.fp8_weight is not None) else None
        # Device tensors pass through (a CUDA-graph step reads each step's weights from a buffer).
        if not isinstance(mtp_weights, torch.Tensor):
            mtp_weights = tuple(float(m) for m in mtp_weights)
        if not isinstance(prefix_weight, torch.Tensor):
            prefix_weight = float(prefix_weight)
        return fused_softcapped_ce(x, w, targets, mtp_weights, prefix_targets, prefix_weight, use_fp8=self.use_fp8,
                                   vocab_size=None, softcap=softcap, fp8_weight=cached, sigmoid=self.options.ce_sigmoid,
                                   grad_layout=self.options.ce_grad_layout)


class FusedMLP:
    """``mlp_impl(x, w_fc (H, D), w_proj (H, D), layer)`` through :func:`speedrun.kernels.mlp.relu2_mlp`.

    Each layer's call is one opaque op (:mod:`speedrun.kernels.opaque`), so ``torch.compile`` keeps
    the network in one graph around it; :meth:`prepare` registers the layers' ops before compiling.

    ``input_quant="graph"`` (``fp8_fwd`` with current scaling only): the call quantises x with
    :func:`~speedrun.kernels.fp8_cache.quantize_current_graph` before the op, in the traced code,
    and passes the e4m3 copy and its scale in; compiled, the amax joins the norm that made x.

    ``weight_grads`` (a :class:`~speedrun.model.bank_grad.MLPBankGradAccumulator`, modes ``bf16``
    and ``fp8_fwd``): each layer's backward adds its dW1 and dW2 into the accumulator's bank-shaped
    buffer inside the GEMMs, and the op returns no gradient for the weights."""

    def __init__(self, mode: str, weights=None, input_scaling: str = "current", input_quant: str = "kernel",
                 weight_grads=None):
        if input_quant not in ("kernel", "graph"):
            raise ConfigError(f"FusedMLP: input_quant must be 'kernel' or 'graph', got {input_quant!r}")
        if input_quant == "graph" and (mode != "fp8_fwd" or input_scaling != "current"):
            raise ConfigError(f"FusedMLP: input_quant='graph' needs mode 'fp8_fwd' and current input scaling, "
                              f"got mode {mode!r}, input_scaling {input_scaling!r}")
        if weight_grads is not None and mode == "fp8_full":
            raise ConfigError("FusedMLP: weight_grads (model.mlp_weight_grad=accumulate) needs mode 'bf16' or "
                              "'fp8_fwd'; fp8_full's weight gradients are FP8 GEMMs")
        self.mode = mode
        self.options = KernelOptions()  # mlp_gemm (set_kernel_options)
        self.weight_grads = weight_grads
        self.input_scaling = input_scaling  # MLPScaleState.input_scaling of every layer
        self.input_quant = input_quant
        self.weights = weights  # layer -> cached (FP8Weight w1, FP8Weight w2) or None
        self.scales: dict[int, object] = {}
        self._handles: dict[int, int] = {}

    def __setstate__(self, state) -> None:
        """Copies (deepcopy, pickle) register their own ops: the originals' ops run the originals."""
        self.__dict__.update(state)
        layers = [None if k == -1 else k for k in self._handles]
        self._handles = {}
        self.prepare(layers)

    def scale_states(self) -> list:
        """Every layer's :class:`~speedrun.kernels.mlp.MLPScaleState`, in layer order (the same
        order on every rank: :func:`~speedrun.kernels.fp8_cache.end_fp8_step` reduces them)."""
        return [self.scales[k] for k in sorted(self.scales)]

    def state_dict(self) -> dict:
        """Each layer's delayed activation scales (:class:`~speedrun.kernels.mlp.MLPScaleState`)."""
        return {key: st.state_dict() for key, st in self.scales.items()}

    def load_state_dict(self, state: dict) -> None:
        from speedrun.kernels.mlp import MLPScaleState

        # The configured input scaling wins over a checkpoint's (a run may switch it on resume).
        self.scales = {key: MLPScaleState.from_state_dict(fields, input_scaling=self.input_scaling)
                       for key, fields in state.items()}

    def prepare(self, layers) -> None:
        """Register the op of every layer in ``layers`` (call outside compiled code)."""
        for layer in layers:
            self._handle(layer)

    def _handle(self, layer: int | None) -> int:
        from speedrun.kernels import opaque

        key = -1 if layer is None else layer
        if key not in self._handles:
            if torch.compiler.is_compiling():
                raise RuntimeError(f"FusedMLP: layer {layer} was not prepared before torch.compile")
            self._handles[key] = opaque.register(opaque.OpaqueKernel(
                name=f"relu2_mlp[{self.mode}, layer {key}]",
                forward=lambda ctx, ts, key=key, layer=layer: self._forward(ctx, ts, key, layer),
                backward=lambda ctx, gs, layer=layer: self._backward(ctx, gs, layer),
                out_specs=lambda ts: [((*ts[0].shape[:-1], ts[2].shape[1]), ts[0].dtype)],
                # the weights take no gradient through the op when the accumulator takes it;
                # graph: x's e4m3 copy and its scale ride along, without gradients
                diff=(True,) + ((False, False) if self._accumulates(layer) else (True, True))
                + ((False, False) if self.input_quant == "graph" else ()),
            ))
        return self._handles[key]

    def _forward(self, ctx, tensors, key: int, layer: int | None):
        from speedrun.kernels.fp8_cache import FP8Weight, quantize_current
        from speedrun.kernels.mlp import MLPScaleState, relu2_mlp_forward

        x, w1, w_proj = tensors[:3]
        x_fp8 = tuple(tensors[3:]) or None
        scales = cache = None
        if self.mode != "bf16":
            if key not in self.scales:
                self.scales[key] = MLPScaleState.create(x.device, input_scaling=self.input_scaling)
            scales = self.scales[key]
            cache = self.weights(layer) if (self.weights is not None and layer is not None) else None
            if cache is None:
                # Both layouts of each weight from one quantisation; w_proj is stored (H, D), so its
                # (D, H) view is the transposed entry.
                cache = (FP8Weight(*quantize_current(w1.detach())), FP8Weight(*quantize_current(w_proj.detach())).t())
        sink = None
        if self._accumulates(layer):
            acc = self.weight_grads
            sink = lambda which, a, b: acc.add_product(layer, which, a, b)  # noqa: E731
        return [relu2_mlp_forward(ctx, x, w1, w_proj.t(), mode=self.mode, cache=cache, scales=scales, x_fp8=x_fp8,
                                  dw_sink=sink, gemm=self.options.mlp_gemm_route)]

    def _accumulates(self, layer: int | None) -> bool:
        return self.weight_grads is not None and layer is not None

    def _backward(self, ctx, grads, layer: int | None):
        from speedrun.kernels.mlp import relu2_mlp_backward

        dx, dw1, dw2 = relu2_mlp_backward(ctx, grads[0])
        return [dx] if self._accumulates(layer) else [dx, dw1, dw2.t()]

    def __call__(self, x, w_fc, w_proj, layer: int | None = None):
        from speedrun.kernels import opaque

        in_dtype = x.dtype
        dtype = torch.bfloat16 if in_dtype not in (torch.bfloat16, torch.float16) else in_dtype
        inputs = [x.to(dtype), w_fc.to(dtype), w_proj.to(dtype)]
        if self.input_quant == "graph":
            from speedrun.kernels.fp8_cache import quantize_current_graph

            xq, _, scale = quantize_current_graph(inputs[0].detach().reshape(-1, x.shape[-1]), transposed=False)
            inputs += [xq, scale]
        y = opaque.call(self._handle(layer), inputs)[0]
        return y.to(in_dtype)


def install_kernels(model, mode: str, input_scaling: str = "current", mlp_input_quant: str = "kernel",
                    mlp_weight_grads=None) -> None:
    """Set ``model.ce_impl`` and ``model.mlp_impl`` for ``mode`` (see the module docstring);
    ``input_scaling`` is the MLP's FP8 scaling of x and g (``ModelConfig.fp8_input_scaling``),
    ``mlp_input_quant`` where its x is quantised (``ModelConfig.mlp_input_quant``),
    ``mlp_weight_grads`` the accumulator of ``model.mlp_weight_grad="accumulate"`` (or None)."""
    if mode not in MODES:
        raise ConfigError(f"model.kernels={mode!r}; known: {', '.join(MODES)}")
    if mode == "reference":
        return
    model.ce_impl = FusedHead(use_fp8=mode != "triton", fp8_weight=getattr(model, "head_fp8_weight", None))
    model.mlp_impl = FusedMLP({"triton": "bf16", "fp8": "fp8_fwd", "fp8_full": "fp8_full"}[mode],
                              weights=getattr(model, "mlp_fp8_weights", None), input_scaling=input_scaling,
                              input_quant=mlp_input_quant, weight_grads=mlp_weight_grads)
    model.mlp_impl.prepare(range(getattr(model, "num_layers", 0)))


def set_kernel_options(impls, options: KernelOptions) -> None:
    """Hand ``options`` to those of a model's loss head / MLP implementations (``impls``) that are
    fused kernels (each passes the values to its kernel calls); references take none."""
    for impl in impls:
        if isinstance(impl, (FusedHead, FusedMLP)):
            impl.options = options
