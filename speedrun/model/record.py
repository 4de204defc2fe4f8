"""The record network (recipe §1-§2 at f411b3d) in plain PyTorch, shrinkable to a CPU-sized toy.

Shape comes from :class:`~speedrun.config.ModelConfig` (vocabulary, layers, width, heads, separate
``qk_head_dim`` / ``v_head_dim``, RoPE, softcap, attention backend); the record's wiring (which
layer does what, gate layouts, init constants) from :class:`RecordArchConfig`, whose defaults are
the record at 11 layers.  :func:`scaled_record_arch` gives a layout for 4, 5 or 6 layers.

Forward (one packed sequence of documents, ``T`` tokens, ``cu_seqlens`` document starts):

1. ``x = embed[inputs]``; bigram term ``xb = bigram_embed[hash] * sign_table[(x[t-1] ^ x[t]) % 8192]``;
   value embeddings ``ve_j = value_embeds[j][inputs]``.
2. Smear: ``x[t] += smear_lambda * sigmoid(smear_gate . x[t, :12]) * x[t-1]``; ``x0 = norm(x)``.
3. Pre MUDD-gate from x0 (XSA strengths, attention gates, x0/bigram gates of the early layers);
   ``x = x0 + g_bigram[0] * xb`` is the stream entering layer 0 (``x_in``).
4. Layers.  At ``post_gate_layer`` the post MUDD-gate is computed from x (gates of later layers,
   the skip gate and the DC weights).  An attention-less layer adds
   ``sigmoid(skip_lambda) * g_skip * cache[skip_from]``.  Other layers attend over ``norm(x)``
   (``norm(cache[saved_layer])`` after the saved layer) and update
   ``x = r_a x + p_a attn + g_x0 x0 (+ g_bigram xb)``; the last layer instead runs MUDD block 0
   (V-side mix, residual re-mix, VE gate, dynamic lambdas).  Then ``x = r_m x + p_m mlp(norm(x))``.
5. Post-loop MUDD block 1 mixes ``x_in, cache[saved], x at last-layer entry, ve_0, cache[skip_from]``
   into x (its cache[saved] bias starts at -0.5: the "backout"); ``h = norm(x)``.
6. Logits ``A sigmoid((h lm_head + B) / C)`` over the padded vocabulary; training loss = mean over
   tokens of multi-token + prefix-token CE (the record recipe backpropagates it times the
   micro-batch's tokens: upstream's sum), eval = plain next-token CE in fp32.

Attention (per layer): one GEMM with ``[Q | K | V]`` rows (``sa_lambda0`` times the weights), QK-norm,
half-truncated RoPE with YaRN (:mod:`speedrun.model.yarn`), key offset (stationary q/k dims of each
key taken from the previous token) on long-window layers, ``v += aux_v``, the backend call with
window short/long, DC correction, gated XSA, output gate, O projection times ``sa_lambda1``.

Paired-head layers follow the record's memory layout exactly: q/k/v (T, H, D) are reshaped to
(2T, H/2, D), so doubled position ``2t`` holds heads ``0..H/2-1`` of token t and ``2t+1`` holds heads
``H/2..H-1``; head h is rotated as position ``2t + h % 2``; ``cu_seqlens`` and ``max_seqlen`` are
doubled and the window counts doubled positions.  (The recipe's prose says heads 2j and 2j+1 share
keys; the record's reshape in fact lets head h and head h + H/2 attend to each other's keys.)

What crosses document boundaries, by design of the record: smear (x[t-1]), the bigram hash and sign
(x[t-1]), the key offset (the previous position's key content, so a document's first key carries the
previous document's last key), and the MTP targets of the training loss.  Attention, the DC window
and everything else stay inside a document.

Fused kernels plug in through ``ce_impl``, ``eval_ce_impl``, ``mlp_impl`` and ``dc_impl`` (instance
attributes with the signatures of :func:`record_parts.softcapped_mtp_ce`,
:func:`record_parts.softcapped_ce_eval_plain`, :func:`record_parts.relu2_mlp_plain` and
:func:`record_parts.dc_postonly_correction`).  FP8 is for training only: in evaluation mode the
MLP is :func:`record_parts.relu2_mlp_plain` and the packed QKV GEMM bf16, as upstream validates.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from speedrun.attention import get_backend
from speedrun.config import ModelConfig
from speedrun.data.loader import bigram_hash
from speedrun.errors import ConfigError
from speedrun.kernels.device_work import DeviceWork
from speedrun.model.embedding_grad import EmbeddingGradAccumulator
from speedrun.model.interface import ForwardArgs, TrainableModel
from speedrun.model.record_parts import (
    GateLayout,
    bigram_sign_index,
    dc_gate_weights,
    dc_postonly_correction,
    mudd_mlp,
    apply_softcap,
    relu2_mlp_plain,
    softcapped_ce_eval_plain,
    softcapped_mtp_ce,
    xsa,
)
from speedrun.model.rotary import shift_stationary_keys
from speedrun.model.yarn import Yarn

# Coefficients of MUDD block 0 (last layer entry) and block 1 (post-loop).
MUDD0_COEFS = 14
MUDD1_COEFS = 5

# Labels of parameter_groups(), in the record's param_table order.
PARAM_LABELS = (
    "qk_bank", "vo_bank", "mlp_bank", "scalars", "smear_gate", "ve_gate_bank", "lm_head", "embed",
    "bigram_embed", "value_embeds", "post_lambdas", "resid_lambdas", "mudd_w1", "mudd_w2", "mudd_b2",
    "mudd_gate_w1", "mudd_gate_w2", "mudd_gate_b2", "mudd_gate_scale",
)
# Parameters the record keeps in fp32 when everything else is cast to bf16.
FP32_LABELS = ("scalars", "post_lambdas", "resid_lambdas", "mudd_gate_scale")


@dataclass
class RecordArchConfig:
    """Which layer does what, and the record's constants.  Defaults: the record (11 layers, 6 heads).

    Layer lists are layer indices.  ``skip_to`` must be attention-less; attention in layers after
    ``saved_layer`` reads ``norm(cache[saved_layer])``; the post MUDD-gate is computed at the entry of
    ``post_gate_layer`` and serves every layer from there on; the last layer always runs MUDD block
    0.  Windows: layers in ``long_window_layers`` use ``ForwardArgs.window_long``, others
    ``window_short``.  ``pad_world_size``: bank matrix counts (and ``scalars``) are padded to a
    multiple of it, as the record pads to 8 ranks.
    """

    address_leaf = True  # holds no tensor: the CUDA graphs' address watch need not look inside

    attnless_layers: tuple[int, ...] = (6,)
    paired_head_layers: tuple[int, ...] = (0, 2, 5, 9)
    xsa_layers: tuple[int, ...] = (1, 3, 4, 7)
    dc_layers: tuple[int, ...] = (10,)
    attn_gate_layers: tuple[int, ...] = (3, 10)
    ve_layers: tuple[int, ...] = (1, 2, 8, 9, 10)
    long_window_layers: tuple[int, ...] = (3, 10)
    key_offset: bool = True  # shift stationary key dims on the long-window layers
    skip_from: int = 3
    skip_to: int = 6
    saved_layer: int = 7
    post_gate_layer: int = 4
    # Bigram hash embedding
    bigram_vocab_num: int = 15  # bigram rows = padded_vocab * num // den
    bigram_vocab_den: int = 2
    bigram_dim: int | None = None  # None: model_dim
    bigram_sign_rows: int = 8192
    sign_table_seed: int = 0
    # Small input widths of gates
    smear_width: int = 12
    ve_gate_width: int = 6  # ve gate input = attn_in[:w] ++ ve[:w]
    # MUDD / MUDD-gate
    mudd_hidden: int = 64
    mudd_scale: float = 0.1
    mudd_gate_hidden: int = 64
    mudd_gate_scale: float = 0.1
    # Attention
    # Starting softmax scale at equal Q/K and V widths; narrower Q/K heads start at
    # attn_scale * sqrt(v_head_dim / qk_head_dim) (PR #344's rule for its 96-wide Q/K: the scores of
    # unit-RMS q and k shrink with their width).  ModelConfig.attn_scale overrides both when set.
    attn_scale: float = 0.1
    dc_window: int = 112
    yarn_alpha: float = 1.0
    yarn_beta: float = 32.0
    yarn_positions: int = 4096  # RoPE table rows built on first use (grown on demand)
    # Init constants
    bank_init_std: float = 0.5  # times model_dim**-0.5; uniform with the same std
    lm_head_std: float = 0.005
    value_embed_std: float = 0.01
    resid_lambda_init: float = 1.1**0.5
    sa_lambda_init: tuple[float, float] = (0.5, 1.0)
    skip_lambda_init: float = -1.5
    attn_gate_init: float = 0.25
    bigram_gate_init: float = 0.05
    skip_gate_init: float = 0.5
    dc_w1_init: float = 1.0
    mudd_ve_gate_init: float = 2.0
    backout_init: float = -0.5
    pad_world_size: int = 1

    # ------------------------------------------------------------------------------------------
    def attention_layers(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if i not in self.attnless_layers]

    def validate(self, num_layers: int, num_heads: int, model_dim: int) -> None:
        """Raise ConfigError naming the first inconsistency."""
        L = num_layers
        last = L - 1

        def check(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(f"record arch ({L} layers, {num_heads} heads): {msg}")

        lists = {
            "attnless_layers": self.attnless_layers, "paired_head_layers": self.paired_head_layers,
            "xsa_layers": self.xsa_layers, "dc_layers": self.dc_layers,
            "attn_gate_layers": self.attn_gate_layers, "ve_layers": self.ve_layers,
            "long_window_layers": self.long_window_layers,
        }
        for name, ls in lists.items():
            check(all(0 <= i < L for i in ls), f"{name}={list(ls)} has a layer outside [0, {L})")
            check(len(set(ls)) == len(ls), f"{name}={list(ls)} repeats a layer")
            if name != "attnless_layers":
                check(not set(ls) & set(self.attnless_layers), f"{name} uses attention-less layer(s) {self.attnless_layers}")
        check(L >= 4, "needs at least 4 layers")
        check(num_heads % 2 == 0, "needs an even number of heads (Q/K banks and VE gates work in head pairs)")
        check(last not in self.attnless_layers and last not in self.paired_head_layers,
              "the last layer (MUDD block 0) needs unpaired attention")
        check(self.skip_to in self.attnless_layers, f"skip_to={self.skip_to} must be attention-less")
        check(0 <= self.skip_from < self.skip_to, f"skip_from={self.skip_from} must precede skip_to={self.skip_to}")
        check(self.skip_from < self.saved_layer < last, f"saved_layer={self.saved_layer} must lie in ({self.skip_from}, {last})")
        check(0 < self.post_gate_layer <= self.skip_to,
              f"post_gate_layer={self.post_gate_layer} must lie in [1, skip_to={self.skip_to}]")
        check(not set(self.xsa_layers) & set(self.paired_head_layers), "XSA is not defined on paired-head layers")
        check(not set(self.dc_layers) & set(self.paired_head_layers), "DC is not defined on paired-head layers")
        check(all(i >= self.post_gate_layer for i in self.dc_layers), "DC layers take their weights from the post gate")
        check(len(self.ve_layers) >= 1, "the post-loop MUDD needs at least one value-embedding layer")
        check(model_dim >= max(self.smear_width, self.ve_gate_width), f"model_dim={model_dim} is below the gate input widths")
        bd = self.bigram_dim if self.bigram_dim is not None else model_dim
        check(0 < bd <= model_dim, f"bigram_dim={bd} must lie in [1, model_dim={model_dim}]")
        check(self.pad_world_size >= 1, "pad_world_size must be >= 1")
        check(self.dc_window >= 1, "dc_window must be >= 1")


def scaled_record_arch(num_layers: int, **overrides) -> RecordArchConfig:
    """The record layout for ``num_layers`` layers: 11 gives the record; 4, 5, 6 give toy layouts that
    keep every mechanism (paired heads, XSA, long windows + key offset, attention-less skip layer,
    saved activation, VE on a paired layer, post gate, DC, MUDD) at least once.

    ``overrides`` replace fields of the result (e.g. ``dc_window=16``).
    """
    tables = {
        11: RecordArchConfig(),
        6: RecordArchConfig(
            attnless_layers=(3,), paired_head_layers=(0, 4), xsa_layers=(1, 2), dc_layers=(5,),
            attn_gate_layers=(1, 5), ve_layers=(1, 4, 5), long_window_layers=(1, 5),
            skip_from=1, skip_to=3, saved_layer=4, post_gate_layer=2,
        ),
        5: RecordArchConfig(
            attnless_layers=(2,), paired_head_layers=(3,), xsa_layers=(0, 1), dc_layers=(4,),
            attn_gate_layers=(0, 4), ve_layers=(1, 3, 4), long_window_layers=(0, 4),
            skip_from=0, skip_to=2, saved_layer=3, post_gate_layer=1,
        ),
        4: RecordArchConfig(
            attnless_layers=(2,), paired_head_layers=(1,), xsa_layers=(0,), dc_layers=(3,),
            attn_gate_layers=(0, 3), ve_layers=(1, 3), long_window_layers=(0, 3),
            skip_from=0, skip_to=2, saved_layer=2, post_gate_layer=1,
        ),
    }
    if num_layers not in tables:
        raise ConfigError(
            f"no record layout for {num_layers} layers (have {sorted(tables)}); write a RecordArchConfig explicitly"
        )
    return replace(tables[num_layers], **overrides)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],))


def _next_multiple(n: int, m: int) -> int:
    return -(-n // m) * m


class RecordGPT(TrainableModel):
    """The record GPT.  See the module docstring.

    Args:
        model_cfg: shape (validated); ``attn_scale`` (if set) replaces the starting softmax scale
            (:meth:`starting_attn_scale`).
        arch: wiring and constants; None uses ``model_cfg.record`` if that field exists and is set,
            else ``scaled_record_arch(model_cfg.num_layers)``.

    Parameters (named by their optimizer label, see :meth:`parameter_groups`), with
    ``Lq = attention layers``, ``G = Lq * H`` head-pair groups (``H/2`` Q then ``H/2`` K per layer):
    ``qk_bank (G_pad, 2 qk_head_dim, D)``, ``vo_bank (2 Lq _pad, D, D)`` (V then O per layer),
    ``mlp_bank (L_pad, 2, 4D, D)`` (c_fc then c_proj, both (hidden, D)), ``lm_head (D, V)``,
    ``embed (V, D)``, ``value_embeds (n_ve V, D)``, ``bigram_embed (V 15/2, bigram_dim)``,
    ``scalars (2L + 2 [+pad])`` (sa_lambdas per layer, smear_lambda, skip_lambda),
    ``resid_lambdas / post_lambdas (L, 2)``, ``ve_gate_bank (n_ve, H, 2 ve_gate_width)``,
    ``smear_gate (1, smear_width)``, ``mudd_w1 (2, 64, D)``, ``mudd_w2 (2, 14, 64)``,
    ``mudd_b2 (2, 14)``, ``mudd_gate_w1 (2, 64, D)``, ``mudd_gate_w2 (2, n_gate, 64)``,
    ``mudd_gate_b2 (2, n_gate)``, ``mudd_gate_scale ()``.
    """

    def __init__(self, model_cfg: ModelConfig, arch: RecordArchConfig | None = None):
        super().__init__()
        model_cfg.validate()
        if arch is None:  # ModelConfig may carry it as ``record`` (planned field)
            arch = getattr(model_cfg, "record", None) or scaled_record_arch(model_cfg.num_layers)
        L, H, D = model_cfg.num_layers, model_cfg.num_heads, model_cfg.model_dim
        arch.validate(L, H, D)
        self.cfg, self.arch = model_cfg, arch
        self.num_layers, self.num_heads, self.model_dim = L, H, D
        self.qk_dim, self.v_dim = model_cfg.qk_head_dim, model_cfg.v_head_dim
        self.vocab = model_cfg.padded_vocab_size
        self.hidden_dim = model_cfg.mlp_hidden_dim
        self.bigram_dim = arch.bigram_dim if arch.bigram_dim is not None else D
        self.bigram_vocab = self.vocab * arch.bigram_vocab_num // arch.bigram_vocab_den
        self.attn_layers = arch.attention_layers(L)
        self.attn_index = {layer: j for j, layer in enumerate(self.attn_layers)}
        self.num_ve = len(arch.ve_layers)
        self.ve_index = {layer: j for j, layer in enumerate(sorted(arch.ve_layers))}
        self.last = L - 1

        # MUDD-gate layouts: layers before post_gate_layer read the pre gate, the rest the post gate.
        inject = [i for i in self.attn_layers if i != self.last]
        pre = lambda ls: [i for i in ls if i < arch.post_gate_layer]  # noqa: E731
        post = lambda ls: [i for i in ls if i >= arch.post_gate_layer]  # noqa: E731
        self.pre_layout = GateLayout.build(H, pre(arch.xsa_layers), pre(arch.attn_gate_layers), pre(inject))
        self.post_layout = GateLayout.build(
            H, post(arch.xsa_layers), post(arch.attn_gate_layers), post(inject), skip=True, dc_layers=arch.dc_layers
        )
        self.gate_coefs = max(self.pre_layout.size, self.post_layout.size)

        # Parameters (values are set in reset_parameters).
        V, n_ve, hm, hg = self.vocab, self.num_ve, arch.mudd_hidden, arch.mudd_gate_hidden
        self.lm_head = nn.Parameter(torch.empty(D, V))
        self.embed = nn.Parameter(torch.empty(V, D))
        self.value_embeds = nn.Parameter(torch.empty(n_ve * V, D))
        self.bigram_embed = nn.Parameter(torch.empty(self.bigram_vocab, self.bigram_dim))
        self.ve_gate_bank = nn.Parameter(torch.empty(n_ve, H, 2 * arch.ve_gate_width))
        self.smear_gate = nn.Parameter(torch.empty(1, arch.smear_width))
        self.post_lambdas = nn.Parameter(torch.empty(L, 2))
        self.resid_lambdas = nn.Parameter(torch.empty(L, 2))
        self.mudd_w1 = nn.Parameter(torch.empty(2, hm, D))
        self.mudd_w2 = nn.Parameter(torch.empty(2, MUDD0_COEFS, hm))
        self.mudd_b2 = nn.Parameter(torch.empty(2, MUDD0_COEFS))
        self.mudd_gate_w1 = nn.Parameter(torch.empty(2, hg, D))
        self.mudd_gate_w2 = nn.Parameter(torch.empty(2, self.gate_coefs, hg))
        self.mudd_gate_b2 = nn.Parameter(torch.empty(2, self.gate_coefs))
        self.mudd_gate_scale = nn.Parameter(torch.empty(()))
        self._make_padded(arch.pad_world_size)
        self.register_buffer("bigram_sign_table", torch.empty(arch.bigram_sign_rows, self.bigram_dim))
        self.register_buffer("prefix_table", torch.full((V,), -1, dtype=torch.int64), persistent=False)
        self.reset_parameters()

        self.yarn = Yarn(
            self.qk_dim, model_cfg.rope_fraction, model_cfg.rope_base,
            attn_scale=self.starting_attn_scale(model_cfg, arch),
            max_positions=arch.yarn_positions,
        )
        self.ce_impl = softcapped_mtp_ce
        self.eval_ce_impl = softcapped_ce_eval_plain
        self.mlp_impl = relu2_mlp_plain
        self.dc_impl = dc_postonly_correction
        self._mlp_fp8 = None  # FP8WeightCache of mlp_bank, refreshed once per optimizer update
        self._head_fp8 = None  # HeadFP8Weight of lm_head, refreshed once per optimizer update
        self._head_fp8_version: int | None = None  # lm_head._version at that refresh
        self._qkv_fp8: dict[int, object] = {}  # attention index -> PackedQKV, same cadence
        self._qkv_inputs: dict[int, object] = {}  # attention index -> InputScaling of x and dy
        self._qkv_replay: dict[int, torch.Tensor] = {}  # raw scales the next refresh reuses (resume)
        # the banks' and scalars' version counters at the last refresh (a list kept and rewritten:
        # state objects keep their identity from step to step, see speedrun.train.addresses)
        self._qkv_fp8_versions: list[int] = []
        self._mlp_weight_grads = None
        if model_cfg.mlp_weight_grad == "accumulate":
            from speedrun.model.bank_grad import MLPBankGradAccumulator

            self._mlp_weight_grads = MLPBankGradAccumulator(self.mlp_bank)
        if model_cfg.kernels != "reference":
            from speedrun.model.kernel_hooks import install_kernels

            install_kernels(self, model_cfg.kernels, model_cfg.fp8_input_scaling, model_cfg.mlp_input_quant,
                            mlp_weight_grads=self._mlp_weight_grads)
        self._backends: dict[torch.device, object] = {}
        self._hidden_fn = None  # torch.compile'd hidden (compile_body), else the eager method
        self._kernel_handles: dict[tuple, int] = {}
        self._embedding_grads = (None if model_cfg.embedding_grad == "autograd"
                                 else EmbeddingGradAccumulator())
        if model_cfg.qkv_path != "reference":
            self._register_qkv_kernels()

    # ------------------------------------------------------------------------------------------
    # Parameters

    def _make_padded(self, world_size: int) -> None:
        """(Re)create the padded banks and scalars; real rows keep their values, padding is 0 (1 for scalars)."""
        L, H, D = self.num_layers, self.num_heads, self.model_dim
        Lq = len(self.attn_layers)
        shapes = {
            "qk_bank": (_next_multiple(Lq * H, world_size), 2 * self.qk_dim, D),
            "vo_bank": (_next_multiple(2 * Lq, world_size), D, D),
            "mlp_bank": (_next_multiple(2 * L, math.lcm(2, world_size)) // 2, 2, self.hidden_dim, D),
            "scalars": (2 * L + 2 + (-2 * L - 2) % world_size,),
        }
        reals = {"qk_bank": Lq * H, "vo_bank": 2 * Lq, "mlp_bank": L, "scalars": 2 * L + 2}
        for name, shape in shapes.items():
            old = getattr(self, name, None)
            new = torch.zeros(shape, device=None if old is None else old.device, dtype=None if old is None else old.dtype)
            if name == "scalars":
                new.fill_(1.0)
            if old is not None:
                with torch.no_grad():
                    n = reals[name]
                    new[:n].copy_(old.detach()[:n])
            setattr(self, name, nn.Parameter(new))
        self.bank_world_size = world_size
        # Matrix view of each bank for the optimizer (the record's ``.reshape`` attribute).
        self.qk_bank.bank_shape = self.qk_bank.shape
        self.vo_bank.bank_shape = self.vo_bank.shape
        self.mlp_bank.bank_shape = (2 * self.mlp_bank.shape[0], self.hidden_dim, D)

    def bank_padding(self, world_size: int) -> dict[str, tuple[int, int]]:
        """Pad ``qk_bank``, ``vo_bank``, ``mlp_bank`` (matrix counts) and ``scalars`` to multiples of
        ``world_size`` in place (call before building the optimizer).  Returns, per label,
        ``(real, padded)`` counts of matrices (entries for ``scalars``)."""
        if world_size < 1:
            raise ValueError(f"bank_padding: world_size must be >= 1, got {world_size}")
        self._make_padded(world_size)
        return self.bank_layout()

    def bank_layout(self) -> dict[str, tuple[int, int]]:
        """``label -> (real, padded)`` matrix counts of the banks (entries for ``scalars``)."""
        Lq, L, H = len(self.attn_layers), self.num_layers, self.num_heads
        return {
            "qk_bank": (Lq * H, self.qk_bank.shape[0]),
            "vo_bank": (2 * Lq, self.vo_bank.shape[0]),
            "mlp_bank": (2 * L, 2 * self.mlp_bank.shape[0]),
            "scalars": (2 * L + 2, self.scalars.shape[0]),
        }

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The record's initialisation (recipe §1.4, init constants in :class:`RecordArchConfig`).

        A no-op on the meta device (build there, then ``to_empty(device=...)`` and call this)."""
        if self.lm_head.is_meta:
            return
        a, D, L = self.arch, self.model_dim, self.num_layers
        Lq, H = len(self.attn_layers), self.num_heads
        bound = math.sqrt(3) * a.bank_init_std * D**-0.5
        for bank, real in ((self.qk_bank, Lq * H), (self.vo_bank, 2 * Lq)):
            bank.zero_()
            bank[:real].uniform_(-bound, bound)
        self.mlp_bank.zero_()
        self.mlp_bank[:L, 0].uniform_(-bound, bound)  # c_proj stays 0: every MLP starts as a no-op
        self.lm_head.normal_(0.0, a.lm_head_std)
        self.embed.copy_(self.lm_head.T)  # tied at init; the optimizer keeps them tied until the split
        self.value_embeds.normal_(0.0, a.value_embed_std)
        self.bigram_embed.zero_()
        self.ve_gate_bank.zero_()
        self.smear_gate.zero_()
        self.post_lambdas.fill_(1.0)
        self.resid_lambdas.fill_(a.resid_lambda_init)
        self.scalars.fill_(1.0)
        self.scalars[0 : 2 * L : 2] = a.sa_lambda_init[0]
        self.scalars[1 : 2 * L : 2] = a.sa_lambda_init[1]
        self.scalars[2 * L] = 0.0  # smear_lambda
        self.scalars[2 * L + 1] = a.skip_lambda_init
        # MUDD: gelu MLPs with zero output weights, so they start at their biases.
        for w1 in (self.mudd_w1, self.mudd_gate_w1):
            for j in range(2):
                nn.init.kaiming_uniform_(w1[j], a=math.sqrt(5))
        self.mudd_w2.zero_()
        self.mudd_gate_w2.zero_()
        s = a.mudd_scale
        b = torch.zeros(2, MUDD0_COEFS)
        b[0, 6] = b[0, 7] = a.mudd_ve_gate_init / s  # VE gate, both head halves
        b[0, 8] = a.resid_lambda_init / s  # resid_attn
        b[0, 9] = 1.0 / s  # post_attn
        b[0, 11] = a.bigram_gate_init / s  # bigram injection
        b[0, 12] = a.resid_lambda_init / s  # resid_mlp
        b[0, 13] = 1.0 / s  # post_mlp
        b[1, 1] = a.backout_init / s  # post-loop cache[saved] coefficient: the backout
        self.mudd_b2.copy_(b)
        gs = a.mudd_gate_scale
        init = dict(attn_gate=a.attn_gate_init, bigram=a.bigram_gate_init, skip=a.skip_gate_init, dc_w1=a.dc_w1_init)
        gb = torch.zeros(2, self.gate_coefs)
        gb[0, : self.pre_layout.size] = self.pre_layout.bias_init(**init) / gs
        gb[1, : self.post_layout.size] = self.post_layout.bias_init(**init) / gs
        self.mudd_gate_b2.copy_(gb)
        self.mudd_gate_scale.fill_(gs)
        g = torch.Generator().manual_seed(a.sign_table_seed)
        signs = torch.randn(self.bigram_sign_table.shape, generator=g).sign()
        signs[signs == 0] = 1.0
        self.bigram_sign_table.copy_(signs)

    def parameter_groups(self) -> dict[str, nn.Parameter]:
        """``label -> parameter`` for the optimizer's per-label table (record param_table labels)."""
        return {label: getattr(self, label) for label in PARAM_LABELS}

    def unused_parameter_slices(self) -> dict[str, list[tuple]]:
        """Index tuples of parameter entries that never receive gradient by design (bank padding,
        the VE gate of the MUDD layer, unused MUDD/MUDD-gate rows, sa_lambdas of attention-less layers)."""
        out: dict[str, list[tuple]] = {}
        Lq, H, L = len(self.attn_layers), self.num_heads, self.num_layers
        out["qk_bank"] = [(slice(Lq * H, None),)]
        out["vo_bank"] = [(slice(2 * Lq, None),)]
        out["mlp_bank"] = [(slice(L, None),)]
        sc = [(slice(2 * L + 2, None),)] + [(slice(2 * i, 2 * i + 2),) for i in self.arch.attnless_layers]
        out["scalars"] = sc
        if self.last in self.ve_index:
            out["ve_gate_bank"] = [(self.ve_index[self.last],)]
        out["mudd_w2"] = [(1, slice(MUDD1_COEFS, None))]
        out["mudd_b2"] = [(1, slice(MUDD1_COEFS, None))]
        out["mudd_gate_w2"] = [(0, slice(self.pre_layout.size, None)), (1, slice(self.post_layout.size, None))]
        out["mudd_gate_b2"] = list(out["mudd_gate_w2"])
        lam = [(i, 0) for i in self.arch.attnless_layers] + [(self.last, 0), (self.last, 1)]
        out["resid_lambdas"] = list(lam)
        out["post_lambdas"] = list(lam)
        return out

    @torch.no_grad()
    def cast_to_record_dtypes(self, dtype: torch.dtype = torch.bfloat16) -> "RecordGPT":
        """Cast every parameter and the sign table to ``dtype`` except the fp32 scalars
        (``scalars``, ``post_lambdas``, ``resid_lambdas``, ``mudd_gate_scale``), as the record does."""
        for label, p in self.parameter_groups().items():
            if label not in FP32_LABELS:
                p.data = p.data.to(dtype)
        self.bigram_sign_table = self.bigram_sign_table.to(dtype)
        return self

    def cast_for_training(self, dtype: torch.dtype) -> "RecordGPT":
        """:class:`TrainableModel` hook: :meth:`cast_to_record_dtypes` (bf16 weights, fp32 scalars,
        as NorMuon tracks the scalars' mantissas)."""
        return self.cast_to_record_dtypes(dtype)

    @torch.no_grad()
    def sync_embed_from_lm_head(self) -> None:
        """``embed <- lm_headᵀ`` (what the optimizer does after each step while the two are tied)."""
        self.embed.copy_(self.lm_head.T)

    def set_prefix_table(self, table: torch.Tensor) -> None:
        """Install the prefix-token table: (padded_vocab,) integer ids, -1 = no prefix."""
        if table.dim() != 1 or table.shape[0] != self.vocab:
            raise ValueError(f"set_prefix_table: want shape ({self.vocab},), got {tuple(table.shape)}")
        if table.dtype.is_floating_point or table.dtype == torch.bool:
            raise ValueError(f"set_prefix_table: want an integer tensor, got {table.dtype}")
        if bool(((table < -1) | (table >= self.vocab)).any()):
            raise ValueError(f"set_prefix_table: entries must lie in [-1, {self.vocab})")
        self.prefix_table.copy_(table.to(self.prefix_table.device, torch.int64))

    # ------------------------------------------------------------------------------------------
    # YaRN (driven by the training loop, as in the record)

    def apply_yarn(self, old_window: int, new_window: int) -> None:
        """Extend RoPE from ``old_window`` to ``new_window`` tokens (call when the long window changes
        between stages; the record skips this for the final-evaluation window)."""
        self.yarn.apply(old_window, new_window, self.arch.yarn_alpha, self.arch.yarn_beta)

    def reset_yarn(self) -> None:
        self.yarn.reset()

    @property
    def attn_scale(self) -> float:
        return self.yarn.attn_scale

    @staticmethod
    def starting_attn_scale(model_cfg: ModelConfig, arch: RecordArchConfig) -> float:
        """The softmax scale before any YaRN extension: ``model_cfg.attn_scale`` when set, else
        ``arch.attn_scale * sqrt(v_head_dim / qk_head_dim)`` (the record's 0.1 at equal widths;
        0.1155 for the candidate's 96-wide Q/K, as PR #344 starts)."""
        if model_cfg.attn_scale is not None:
            return float(model_cfg.attn_scale)
        return arch.attn_scale * math.sqrt(model_cfg.v_head_dim / model_cfg.qk_head_dim)

    @property
    def bigram_mod(self) -> int:
        """The modulus loaders must hash bigrams with (``bigram_hash(inputs, bigram_mod)``)."""
        return self.bigram_vocab - 1

    def warm_tables(self, max_tokens: int, device: torch.device | str) -> None:
        """Build the RoPE tables for batches of up to ``max_tokens`` tokens on ``device`` now (do this
        before ``torch.compile`` and after every :meth:`apply_yarn` / :meth:`reset_yarn`)."""
        self.yarn.tables(2 * max_tokens, device)

    # ------------------------------------------------------------------------------------------
    # Forward

    def set_attention_backend(self, name: str) -> None:
        """Switch the attention backend (a :mod:`speedrun.attention` name, or ``auto``)."""
        self.cfg.attention_backend = name
        self._backends = {}

    # ------------------------------------------------------------------------------------------
    # FP8 weight cache (once per optimizer update)

    @property
    def uses_fp8_weights(self) -> bool:
        return self.cfg.kernels in ("fp8", "fp8_full") or self.cfg.qkv_path == "fused_fp8"

    def refresh_fp8_weights(self) -> None:
        """Re-quantise every FP8 weight the forward and backward use, once per optimizer update
        (call right after ``optimizer.step`` and after any load of weights):
        :meth:`prepare_fp8_refresh`, then its launch.

        MLP: one dual-layout kernel over each half of ``mlp_bank`` (c_fc current-scaled, c_proj
        delayed after a bootstrap: :meth:`_new_mlp_weight_cache`).  Attention
        (``qkv_path=fused_fp8``): one packed [q|k|v] FP8 weight per layer, read straight from the
        Q/K and V/O banks with ``sa_lambda`` folded into its scale, delayed-scaled from the previous
        update's amax once the first update has measured one.  FP8 head: ``lm_head`` in both e4m3
        layouts (static scale), so the micro-batches of a step quantise it once instead of each.
        A forward that finds the weights changed since the last refresh raises instead of using
        stale FP8 copies."""
        work = self.prepare_fp8_refresh()
        if work is not None:
            work.launch()
            work.settle()

    @torch.no_grad()
    def prepare_fp8_refresh(self):
        """The host half of :meth:`refresh_fp8_weights` (each weight's scaling rule, the caches'
        counters and the version numbers the staleness checks compare), returning its kernels as
        a :class:`~speedrun.kernels.device_work.DeviceWork` (None when the model has no FP8
        weight copies).  Launch it, and settle it once the step's update is issued, before the
        next forward."""
        from speedrun.kernels.device_work import DeviceWorkChain

        parts = []
        if self.cfg.kernels in ("fp8", "fp8_full"):
            if self._mlp_fp8 is None:
                self._mlp_fp8 = self._new_mlp_weight_cache()
            L = self.num_layers
            parts.append(self._mlp_fp8.prepare_refresh({"fc": self.mlp_bank[:L, 0], "proj": self.mlp_bank[:L, 1]}))
        if getattr(self.ce_impl, "use_fp8", False):
            parts.append(_HeadRefresh(self))
        if self.cfg.qkv_path == "fused_fp8":
            parts.append(_QKVRefresh(self))
        return DeviceWorkChain(parts) if parts else None

    def _pack_qkv_one_by_one(self, sources: dict) -> None:
        """The packed QKV weights layer by layer: the first update (current scales), or the first
        after a resume (the saved scales replayed); ``sources``: attention index -> (w_qk, w_v,
        sa_lambda).  Every later update repacks all layers at once (:class:`_QKVRefresh`)."""
        from speedrun.kernels.qkv_pack import delayed_scale, pack_qkv_fp8

        for j, (w_qk, w_v, sa) in sources.items():
            prev = self._qkv_fp8.get(j)
            if j in self._qkv_replay:
                scale = self._qkv_replay.pop(j)
            else:
                scale = None if prev is None else delayed_scale(prev.amax)
            packed = pack_qkv_fp8(w_qk, w_v, sa, num_heads=self.num_heads, scale=scale,
                                  out=None if prev is None else (prev.data, prev.data_t))
            if prev is not None:  # every tensor keeps its address (CUDA graphs read them)
                for name in ("scale", "raw_scale", "amax"):
                    getattr(prev, name).copy_(getattr(packed, name))
                packed = prev
            self._qkv_fp8[j] = packed

    def _fp8_scale_states(self) -> list:
        states = self.mlp_impl.scale_states() if hasattr(self.mlp_impl, "scale_states") else []
        return states + [self._qkv_inputs[j] for j in sorted(self._qkv_inputs)]

    @staticmethod
    def _new_mlp_weight_cache():
        """The MLP bank's FP8 cache: c_fc current-scaled at every update, c_proj delayed after
        16 bootstrap updates, as upstream f411b3d's ``quantize_mlp_fp8``."""
        from speedrun.kernels.fp8_cache import FP8WeightCache

        return FP8WeightCache(current_names=("fc",))

    def reset_fp8_state(self) -> None:
        """Forget every FP8 scale: the weight caches (so c_proj bootstraps again), the packed QKV
        weights' delayed scales and the activation scales of the MLP and QKV inputs.  The next
        refresh and forward scale as a fresh model's do.  The training loop calls this when it
        restores the weights after the untimed warmup, so the timed run takes the steps of a run
        without warmup (upstream's scales are buffers, restored with its weights)."""
        self._mlp_fp8 = None
        self._head_fp8 = None
        self._head_fp8_version = None
        self._qkv_fp8 = {}
        self._qkv_inputs = {}
        self._qkv_replay = {}
        self._qkv_fp8_versions = []
        if hasattr(self.mlp_impl, "scales"):
            self.mlp_impl.scales = {}

    def end_fp8_step(self) -> None:
        """Close an optimizer step of the step-synchronous FP8 activation scales (MLP post/dpre,
        delayed x/g of the MLP and the packed QKV GEMM): next step's scales from this step's
        amaxes, max-reduced over ranks (:func:`speedrun.kernels.fp8_cache.end_fp8_step`)."""
        states = self._fp8_scale_states()
        if states:
            from speedrun.kernels.fp8_cache import end_fp8_step

            end_fp8_step(states)

    # ------------------------------------------------------------------------------------------
    # CUDA-graph capture (speedrun.train.graphs)

    def graph_signature(self) -> tuple:
        """What decides which kernels a training micro-batch launches besides its shapes and
        arguments: the FP8 scales' readiness (current scaling until a slot's first step end,
        then delayed) and which per-update caches exist.  A captured step is replayed only
        while this is unchanged."""
        states = tuple((type(st).__name__, st.input_scaling, st.x_ready, st.g_ready,
                        getattr(st, "post_ready", None), getattr(st, "dpre_ready", None))
                       for st in self._fp8_scale_states())
        return (self.training, states, self._mlp_fp8 is not None, self._head_fp8 is not None,
                tuple(sorted(self._qkv_fp8)))

    def graph_host_state(self) -> dict:
        """The Python-side bookkeeping a training micro-batch changes (accumulators' pending
        flags, the FP8 scales' used slots), as a copy that :meth:`set_graph_host_state` restores."""
        return {
            "embedding": None if self._embedding_grads is None else self._embedding_grads.host_state(),
            "bank": None if self._mlp_weight_grads is None else self._mlp_weight_grads.host_state(),
            "scales": [st.host_state() for st in self._fp8_scale_states()],
        }

    def set_graph_host_state(self, state: dict) -> None:
        if state["embedding"] is not None:
            self._embedding_grads.set_host_state(state["embedding"])
        if state["bank"] is not None:
            self._mlp_weight_grads.set_host_state(state["bank"])
        states = self._fp8_scale_states()
        if len(states) != len(state["scales"]):
            raise RuntimeError(f"set_graph_host_state: {len(state['scales'])} FP8 scale states saved, the model "
                               f"has {len(states)}")
        for st, saved in zip(states, state["scales"]):
            st.set_host_state(saved)

    def discard_fp8_step(self) -> None:
        """Drop the amaxes accumulated since the last step end (an evaluation's)."""
        for st in self._fp8_scale_states():
            st.discard_step()

    def fp8_state_dict(self) -> dict:
        """The FP8 delayed-scaling state a checkpoint needs for an exact resume: the MLP weight
        cache's and each packed QKV weight's scales, and the MLP activation scales.  Empty when
        nothing runs in FP8.  Tensors are on the model's device."""
        state = {}
        if self._mlp_fp8 is not None:
            state["mlp_weights"] = self._mlp_fp8.state_dict()
        if self._qkv_fp8:
            state["qkv"] = {j: {"raw_scale": p.raw_scale.clone()} for j, p in self._qkv_fp8.items()}
        if self.cfg.fp8_input_scaling == "delayed" and self._qkv_inputs:
            state["qkv_inputs"] = {j: st.state_dict() for j, st in self._qkv_inputs.items()}
        if hasattr(self.mlp_impl, "state_dict"):
            state["mlp_activations"] = self.mlp_impl.state_dict()
        return {k: v for k, v in state.items() if v}

    def load_fp8_state_dict(self, state: dict) -> None:
        """Restore :meth:`fp8_state_dict` (after loading the weights it was saved with); the next
        :meth:`refresh_fp8_weights` rebuilds the saved FP8 weights exactly."""
        unknown = set(state) - {"mlp_weights", "qkv", "qkv_inputs", "mlp_activations"}
        if unknown:
            raise ValueError(f"unknown FP8 state sections {sorted(unknown)}")
        if "mlp_weights" in state:
            if self.cfg.kernels not in ("fp8", "fp8_full"):
                raise ValueError(f"checkpoint has FP8 MLP weight scales but model.kernels={self.cfg.kernels!r}")
            if self._mlp_fp8 is None:
                self._mlp_fp8 = self._new_mlp_weight_cache()
            self._mlp_fp8.load_state_dict(state["mlp_weights"])
        if "qkv" in state:
            if self.cfg.qkv_path != "fused_fp8":
                raise ValueError(f"checkpoint has packed FP8 QKV scales but model.qkv_path={self.cfg.qkv_path!r}")
            self._qkv_replay = {int(j): v["raw_scale"].clone() for j, v in state["qkv"].items()}
        if "qkv_inputs" in state:
            if self.cfg.qkv_path != "fused_fp8":
                raise ValueError(f"checkpoint has packed FP8 QKV input scales but model.qkv_path={self.cfg.qkv_path!r}")
            from speedrun.kernels.fp8_cache import InputScaling

            # The configured scaling wins over the checkpoint's (a run may switch it on resume).
            self._qkv_inputs = {int(j): InputScaling.from_state_dict(fields, input_scaling=self.cfg.fp8_input_scaling)
                                for j, fields in state["qkv_inputs"].items()}
        if "mlp_activations" in state:
            if not hasattr(self.mlp_impl, "load_state_dict"):
                raise ValueError(f"checkpoint has FP8 MLP activation scales but model.kernels={self.cfg.kernels!r}")
            self.mlp_impl.load_state_dict(state["mlp_activations"])

    # ------------------------------------------------------------------------------------------
    # TrainableModel hooks (the training loop's calls; see speedrun.model.interface)

    def set_kernel_options(self, options) -> None:
        """The fused loss head's and MLP's options (CE sigmoid and gradient layout, GEMM route)."""
        from speedrun.model.kernel_hooks import set_kernel_options

        set_kernel_options((self.ce_impl, self.mlp_impl), options)

    def after_optimizer_step(self) -> None:
        """Re-quantise the FP8 weight copies (:meth:`refresh_fp8_weights`) when any are used."""
        if self.uses_fp8_weights:
            self.refresh_fp8_weights()

    def prepare_after_optimizer_step(self):
        """:meth:`prepare_fp8_refresh` when FP8 weight copies are used, else None."""
        return self.prepare_fp8_refresh() if self.uses_fp8_weights else None

    def end_step(self) -> None:
        """:meth:`end_fp8_step`."""
        self.end_fp8_step()

    def after_evaluation(self) -> None:
        """:meth:`discard_fp8_step`: evaluation amaxes must not steer training's FP8 scales."""
        self.discard_fp8_step()

    def reset_after_warmup(self) -> None:
        """The warmup's FP8 scales belong to weights that are gone (:meth:`reset_fp8_state`), and
        gradients of a warmup step not yet flushed (an even step's embeddings, the MLP bank's sum)
        are dropped."""
        self.reset_fp8_state()
        self.discard_embedding_grads()
        self.discard_weight_grads()

    def extra_state(self) -> dict:
        """``{"fp8": fp8_state_dict(), "embedding_grads": embedding_grad_state()}``."""
        return {"fp8": self.fp8_state_dict(), "embedding_grads": self.embedding_grad_state()}

    def load_extra_state(self, state: dict) -> None:
        """Restore :meth:`extra_state` (after the weights, before the next FP8 refresh, which replays
        the saved scales)."""
        unknown = set(state) - {"fp8", "embedding_grads"}
        if unknown:
            raise ValueError(f"unknown extra state sections {sorted(unknown)}")
        if state.get("fp8"):
            self.load_fp8_state_dict(state["fp8"])
        self.load_embedding_grad_state(state.get("embedding_grads") or {})

    def _qkv_sources_version(self) -> list[int]:
        return [self.qk_bank._version, self.vo_bank._version, self.scalars._version]

    def mlp_fp8_weights(self, layer: int):
        """(FP8Weight of c_fc (H, D), FP8Weight of c_proj seen as (D, H)) for ``layer``, or None
        before the first refresh.  Raises StaleFP8CacheError if the bank changed since."""
        if self._mlp_fp8 is None:
            return None
        return self._mlp_fp8.get("fc")[layer], self._mlp_fp8.get("proj")[layer].t()

    def head_fp8_weight(self):
        """The FP8 lm_head of this optimizer update (:func:`~speedrun.kernels.cross_entropy.quantize_head_weight`),
        or None before the first refresh.  Raises StaleFP8CacheError if lm_head was changed in place
        (through autograd-visible ops, e.g. a checkpoint load) since the refresh."""
        if self._head_fp8 is None:
            return None
        if self.lm_head._version != self._head_fp8_version:
            from speedrun.kernels.fp8_cache import StaleFP8CacheError

            raise StaleFP8CacheError("FP8 lm_head read after lm_head changed; call refresh_fp8_weights() once per "
                                     "optimizer update")
        return self._head_fp8

    def qkv_fp8_weight(self, j: int):
        """The packed FP8 QKV weight of attention layer ``j`` (None before the first refresh)."""
        if not self._qkv_fp8:
            return None
        if self._qkv_sources_version() != self._qkv_fp8_versions:
            from speedrun.kernels.fp8_cache import StaleFP8CacheError

            raise StaleFP8CacheError("packed FP8 QKV weights read after the banks or sa_lambdas changed; call "
                                     "refresh_fp8_weights() once per optimizer update")
        return self._qkv_fp8[j]

    def _backend(self, device: torch.device):
        fn = self._backends.get(device)
        if fn is None:
            fn = get_backend(self.cfg.attention_backend, device)
            self._backends[device] = fn
        return fn

    def _attend(self, q, k, v, cu_seqlens, max_seqlen, window):
        fn = self._backend(q.device)
        return fn(q, k, v, cu_seqlens, max_seqlen, window=window, scale=self.yarn.attn_scale)

    def _attention(self, i, h, aux_v, gates, cu_seqlens, max_seqlen, args: ForwardArgs, banks):
        """Attention sublayer of layer ``i``: h (T, D) normalised input -> (T, D).  ``banks``: the
        per-layer views (qk_bank split by layer, vo_bank unbound) that :meth:`hidden` takes once."""
        a, H, dqk, dv = self.arch, self.num_heads, self.qk_dim, self.v_dim
        T = h.shape[0]
        j = self.attn_index[i]
        sa = self.scalars[2 * i : 2 * i + 2]
        paired = i in a.paired_head_layers
        long = i in a.long_window_layers
        window = args.window_long if long else args.window_short
        if self.cfg.qkv_path != "reference":
            # QK-prep writes Q/K at the backend's width when the backend would pad them anyway.
            padded = dqk < dv and getattr(self._backend(h.device), "pads_qk_to_v", False)
            q, k, v = self._packed_qkv(h, j, sa[0], aux_v, paired, long and a.key_offset and not paired, padded, banks)
            if paired:
                y = self._attend(q, k, v, 2 * cu_seqlens, 2 * max_seqlen, window).reshape(T, H, dv)
            else:
                y = self._attend(q, k, v, cu_seqlens, max_seqlen, window)
            if padded:  # the DC correction reads the real Dqk columns (views, no copy)
                q, k = q[..., :dqk], k[..., :dqk]
            return self._attention_out(i, j, y, q, k, v, sa, gates, cu_seqlens, paired, banks)
        qk_w, vo_w = banks
        w = torch.cat((qk_w[j].reshape(2 * H * dqk, -1), vo_w[2 * j])).type_as(h) * sa[0]
        # split, not slicing: the backward is then a cat that Inductor writes region by region,
        # where three slice_backwards summed compiled to one flat loop over (T, 2304) with three
        # masked regions, bound by its index arithmetic
        q, k, v = torch.split(F.linear(h, w), (H * dqk, H * dqk, H * dv), dim=1)
        q, k, v = _norm(q.view(T, H, dqk)), _norm(k.view(T, H, dqk)), v.view(T, H, dv)
        if paired:
            q, k = self.yarn.rotate_paired(q), self.yarn.rotate_paired(k)
        else:
            q, k = self.yarn.rotate(q), self.yarn.rotate(k)
            if long and a.key_offset:
                k = shift_stationary_keys(k, self.yarn.rope_dims)
        if aux_v is not None:
            v = v + aux_v.view(T, H, dv)
        if paired:
            y = self._attend(
                q.reshape(2 * T, H // 2, dqk), k.reshape(2 * T, H // 2, dqk), v.reshape(2 * T, H // 2, dv),
                2 * cu_seqlens, 2 * max_seqlen, window,
            ).reshape(T, H, dv)
        else:
            y = self._attend(q, k, v, cu_seqlens, max_seqlen, window)
        return self._attention_out(i, j, y, q, k, v, sa, gates, cu_seqlens, paired, banks)

    def _attention_out(self, i, j, y, q, k, v, sa, gates, cu_seqlens, paired, banks):
        """DC correction, XSA, output gate and O projection: y (T, H, Dv) -> (T, D)."""
        a, H, dv = self.arch, self.num_heads, self.v_dim
        T = y.shape[0]
        if not paired:
            if i in gates["dc"]:
                w1, w2 = dc_gate_weights(*gates["dc"][i])
                y = self.dc_impl(y, q, k, v, w1, w2, cu_seqlens, scale=self.yarn.attn_scale, window=a.dc_window)
            if i in gates["xsa"]:
                y = xsa(y, v, gates["xsa"][i])
        if i in gates["attn"]:
            y = y * gates["attn"][i].type_as(y)[..., None]
        return F.linear(y.reshape(T, H * dv), banks[1][2 * j + 1].type_as(y) * sa[1])

    def _packed_qkv(self, h, j, sa0, aux_v, paired: bool, key_offset: bool, padded: bool, banks):
        """The candidate's projection: one packed [q|k|v]-per-head GEMM (FP8 with ``qkv_path=fused_fp8``)
        read straight from the banks, then the fused QK-prep kernel (norm, RoPE, key offset, layout).
        Returns q, k (T, H, Dqk) and v (T, H, Dv), or (2T, H/2, D) views on paired layers; with
        ``padded`` q and k are (T, H, Dv) with zero columns past Dqk.  The FP8 GEMM and QK-prep
        each run as one opaque op (:mod:`speedrun.kernels.opaque`)."""
        from speedrun.kernels import opaque
        from speedrun.kernels.qk_prep import attach_value_residual_grad, qk_prep_reference
        from speedrun.kernels.qkv_pack import packed_qkv_linear_reference

        H, dqk, dv = self.num_heads, self.qk_dim, self.v_dim
        T = h.shape[0]
        w_qk, w_v = banks[0][j], banks[1][2 * j]
        if self.cfg.qkv_path == "fused_fp8" and self.training:  # evaluation: the bf16 GEMM
            qkv = opaque.call(self._kernel_handles[("qkv", j)], [h, w_qk, w_v, sa0])[0]
        else:
            qkv = packed_qkv_linear_reference(h, None, w_qk.type_as(h), w_v.type_as(h), sa0.type_as(h), num_heads=H)
        cos, sin = self.yarn.tables(2 * T if paired else T, h.device)
        aux = None if aux_v is None else aux_v.type_as(qkv)
        if not (h.is_cuda or self._triton_on_cpu):
            return qk_prep_reference(qkv, cos, sin, num_heads=H, qk_dim=dqk, v_dim=dv, paired=paired,
                                     key_offset=key_offset, aux_v=aux, pad_to=dv if padded else None)
        ins = [qkv, cos, sin] + ([] if aux is None else [aux])
        q, k, v = opaque.call(self._kernel_handles[("qk_prep", j, aux is not None, padded)], ins)
        if aux is not None:  # the op takes aux without a gradient: see attach_value_residual_grad
            v = attach_value_residual_grad(v, aux)
        return q, k, v

    def _qkv_input_scaling(self, j: int):
        """Attention layer ``j``'s :class:`~speedrun.kernels.fp8_cache.InputScaling` (x and dy of
        the packed FP8 QKV GEMM; ``model.fp8_input_scaling``), created on first use."""
        st = self._qkv_inputs.get(j)
        if st is None:
            from speedrun.kernels.fp8_cache import InputScaling

            st = self._qkv_inputs[j] = InputScaling(input_scaling=self.cfg.fp8_input_scaling)
        return st

    def _register_qkv_kernels(self) -> None:
        """One opaque op per attention layer for the packed FP8 GEMM and two for QK-prep (with and
        without a value residual), registered here because compiled code cannot register them."""
        from speedrun.kernels import opaque
        from speedrun.kernels.fp8_cache import interpreting
        from speedrun.kernels.qk_prep import qk_prep_forward, qk_prep_out_shapes
        from speedrun.kernels.qkv_pack import packed_qkv_backward, packed_qkv_forward

        H, dqk, dv, a = self.num_heads, self.qk_dim, self.v_dim, self.arch
        self._triton_on_cpu = interpreting()
        for i in self.attn_layers:
            j = self.attn_index[i]
            paired = i in a.paired_head_layers
            key_offset = i in a.long_window_layers and a.key_offset and not paired

            def qkv_forward(ctx, ts, j=j):
                h, w_qk, w_v, sa0 = ts
                return [packed_qkv_forward(ctx, h, self.qkv_fp8_weight(j), w_qk, w_v, sa0, num_heads=H,
                                           inputs=self._qkv_input_scaling(j))]

            self._kernel_handles[("qkv", j)] = opaque.register(opaque.OpaqueKernel(
                name=f"packed_qkv_fp8[attention {j}]", forward=qkv_forward,
                backward=lambda ctx, gs: list(packed_qkv_backward(ctx, gs[0])),
                out_specs=lambda ts: [((ts[0].shape[0], H * (2 * dqk + dv)), ts[0].dtype)],
                diff=(True, True, True, True),
            ))
            for has_aux, padded in itertools.product((False, True), (False, True) if dqk < dv else (False,)):
                pad_to = dv if padded else None

                def prep_forward(ctx, ts, paired=paired, key_offset=key_offset, pad_to=pad_to):
                    return list(qk_prep_forward(ctx, ts[0], ts[1], ts[2], num_heads=H, qk_dim=dqk, v_dim=dv,
                                                paired=paired, key_offset=key_offset, pad_to=pad_to,
                                                aux_v=ts[3] if len(ts) > 3 else None))

                def prep_backward(ctx, gs, j=j):
                    return [self._qk_prep_backward(ctx, gs, j)]

                self._kernel_handles[("qk_prep", j, has_aux, padded)] = opaque.register(opaque.OpaqueKernel(
                    name=f"qk_prep[attention {j}{', value residual' if has_aux else ''}{', padded' if padded else ''}]",
                    forward=prep_forward, backward=prep_backward,
                    out_specs=lambda ts, paired=paired, pad_to=pad_to: [
                        (shape, ts[0].dtype)
                        for shape in qk_prep_out_shapes(ts[0].shape[0], H, dqk, dv, paired=paired, pad_to=pad_to)],
                    # aux (the value residual) gets its gradient from attach_value_residual_grad
                    diff=(True, False, False, False) if has_aux else (True, False, False),
                ))

    def _qk_prep_backward(self, ctx, grads, j: int):
        """QK-prep's backward for attention layer ``j``: d qkv.  With ``model.qk_prep_fp8_grad`` (and the
        layer's delayed dy scale ready), the kernel also writes d qkv as e5m2 and hands it to the
        packed QKV GEMM's backward, which runs next and then skips its quantise pass."""
        from speedrun.kernels.fp8_cache import E5M2
        from speedrun.kernels.qk_prep import qk_prep_backward

        args = None
        qkv = ctx.saved_tensors[0]
        if self.cfg.qk_prep_fp8_grad and qkv.dtype in (torch.bfloat16, torch.float16):  # (fp32: CPU runs)
            st = self._qkv_input_scaling(j)
            args = st.g_epilogue_args(qkv.device)
        if args is None:
            return qk_prep_backward(ctx, *grads)[0]
        g_fp8 = torch.empty(qkv.shape, dtype=E5M2, device=qkv.device)
        dqkv = qk_prep_backward(ctx, *grads, fp8_out=(g_fp8, *args))[0]
        st.hand_over_g(dqkv, g_fp8, args[0])
        return dqkv

    def __setstate__(self, state) -> None:
        """A copy (deepcopy, pickle) is uncompiled and registers its own fused-kernel ops: the
        original's compiled function and ops belong to the original."""
        super().__setstate__(state)
        self._hidden_fn = None
        self._kernel_handles = {}
        if self._embedding_grads is not None:  # the original's accumulators belong to its parameters
            self._embedding_grads = EmbeddingGradAccumulator()
        if self.cfg.qkv_path != "reference":
            self._register_qkv_kernels()

    def compile_body(self, **compile_kwargs) -> None:
        """Run :meth:`hidden` (the whole network but the loss head) through ``torch.compile`` from
        now on, with ``fullgraph=True``: a graph break inside the layer loop would make Dynamo skip
        the whole network and run it eagerly, so it is an error instead.  The fused loss heads run
        eagerly after it (they are single fused kernels already)."""
        device = self.lm_head.device
        if device not in self._backends:  # resolved here: backend checks are not traceable
            self._backends[device] = get_backend(self.cfg.attention_backend, device)
        self._hidden_fn = torch.compile(self.hidden, fullgraph=True, **compile_kwargs)

    def _unpack_gate(self, g: torch.Tensor, layout: GateLayout, gates: dict) -> None:
        for i, s in layout.xsa.items():
            gates["xsa"][i] = g[:, s]
        for i, s in layout.attn_gate.items():
            gates["attn"][i] = g[:, s]
        for i, c in layout.x0.items():
            gates["x0"][i] = g[:, c : c + 1]
        for i, c in layout.bigram.items():
            gates["bigram"][i] = g[:, c : c + 1]
        if layout.skip is not None:
            gates["skip"] = g[:, layout.skip : layout.skip + 1]
        for i in layout.dc_w1:
            gates["dc"][i] = (g[:, layout.dc_w1[i]], g[:, layout.dc_w2[i]])

    def _add_bigram(self, x: torch.Tensor, xb: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if self.bigram_dim == self.model_dim:
            return x + xb * g
        bd = self.bigram_dim
        return torch.cat((x[:, :bd] + xb * g, x[:, bd:]), dim=-1)

    def _bigram_rows(self, batch, inputs: torch.Tensor) -> torch.Tensor:
        bigram_idx = getattr(batch, "bigram", None)
        return (bigram_hash(inputs, self.bigram_mod) if bigram_idx is None else bigram_idx).long()

    def embedding_lookups(self, batch, traced: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embedding tables' rows for ``batch`` whose gradient accumulates in place
        (``model.embedding_grad="atomic"`` or ``"atomic_graph"``): ``embed[inputs]`` (T, D),
        ``bigram_embed[bigram]`` (T, bigram_dim) before its signs, and the value embeddings
        (n_ve, T, D).  ``traced``: inside the compiled network ("atomic_graph"; the accumulators
        come from :meth:`prepare_embedding_grads`); else before it.  :meth:`flush_embedding_grads`
        moves the gradients to ``.grad``."""
        if self._embedding_grads is None:
            raise RuntimeError("embedding_lookups needs model.embedding_grad='atomic' or 'atomic_graph'")
        inputs = batch.inputs.long()
        if inputs.dim() != 1:
            raise ValueError(f"RecordGPT: batch.inputs must be (T,), got {tuple(inputs.shape)}")
        acc, T = self._embedding_grads, inputs.shape[0]
        offsets = torch.arange(0, self.num_ve * self.vocab, self.vocab, device=inputs.device)
        rows = {"embed": inputs, "bigram_embed": self._bigram_rows(batch, inputs),
                "value_embeds": (offsets[:, None] + inputs).reshape(-1)}
        tables = self.embedding_grad_params()
        looked = {name: (acc.traced_lookup(name, tables[name], r) if traced else acc.lookup(tables[name], r))
                  for name, r in rows.items()}
        return looked["embed"], looked["bigram_embed"], looked["value_embeds"].view(self.num_ve, T, -1)

    def prepare_embedding_grads(self) -> None:
        """Ready the tables' accumulators for lookups inside the compiled network (outside it)."""
        self._embedding_grads.prepare(self.embedding_grad_params())

    def embedding_grad_params(self) -> dict[str, nn.Parameter]:
        """The tables whose gradients :meth:`embedding_lookups` accumulates in place, by name (none
        with ``model.embedding_grad="autograd"``)."""
        if self._embedding_grads is None:
            return {}
        return {"embed": self.embed, "bigram_embed": self.bigram_embed, "value_embeds": self.value_embeds}

    def embedding_grad_state(self) -> dict[str, torch.Tensor]:
        """The tables' gradient sums since the last flush, by table name (references; {} when
        nothing is pending): a checkpoint after an even step carries them."""
        acc = self._embedding_grads
        if acc is None or not acc.pending():
            return {}
        sums = {n: acc.pending_sum(p) for n, p in self.embedding_grad_params().items()}
        return {n: s for n, s in sums.items() if s is not None}

    def load_embedding_grad_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`embedding_grad_state` (anything pending before is dropped first)."""
        self.discard_embedding_grads()
        if not state:
            return
        if self._embedding_grads is None:
            raise ValueError("checkpoint holds pending embedding gradients, but this model runs "
                             "model.embedding_grad='autograd'")
        tables = self.embedding_grad_params()
        for name, total in state.items():
            if name not in tables:
                raise ValueError(f"checkpoint holds pending gradients of an unknown table {name!r}")
            self._embedding_grads.restore(tables[name], total.to(tables[name].device))

    def discard_embedding_grads(self) -> None:
        """Drop the embedding gradients accumulated since the last flush (a discarded step)."""
        if self._embedding_grads is not None:
            self._embedding_grads.discard()

    def prepare_embedding_flush(self):
        """The host half of handing the embedding tables' gradients accumulated since the last
        flush to their ``.grad`` (:meth:`EmbeddingGradAccumulator.prepare_flush
        <speedrun.model.embedding_grad.EmbeddingGradAccumulator.prepare_flush>`); the training
        step flushes before each optimizer step that reads them (the record's Adam steps).  None
        with ``model.embedding_grad="autograd"`` or nothing pending."""
        if self._embedding_grads is None:
            return None
        return self._embedding_grads.prepare_flush()

    def flush_weight_grads(self) -> None:
        """Hand the MLP bank's gradient summed in place over the step's micro-batches
        (``model.mlp_weight_grad="accumulate"``) to ``mlp_bank.grad``; the training step calls
        this after its last backward.  No-op with ``"autograd"``."""
        if self._mlp_weight_grads is not None:
            self._mlp_weight_grads.flush()

    def discard_weight_grads(self) -> None:
        """Drop the MLP bank's gradient summed since the last flush (a discarded step)."""
        if self._mlp_weight_grads is not None:
            self._mlp_weight_grads.discard()

    def hidden(self, batch, args: ForwardArgs = ForwardArgs(), lookups=None) -> torch.Tensor:
        """Final normalised hidden states (T, D) of ``batch`` (fields inputs, cu_seqlens, max_seqlen,
        optional bigram).  ``lookups``: :meth:`embedding_lookups` of the batch, when done outside."""
        a, L, H, D, dv = self.arch, self.num_layers, self.num_heads, self.model_dim, self.v_dim
        inputs = batch.inputs.long()
        if inputs.dim() != 1:
            raise ValueError(f"RecordGPT: batch.inputs must be (T,), got {tuple(inputs.shape)}")
        T = inputs.shape[0]
        cu_seqlens, max_seqlen = batch.cu_seqlens, int(batch.max_seqlen)

        if lookups is not None:
            x, bigram_rows, ve_all = lookups
        elif self.cfg.embedding_grad == "atomic_graph" and torch.is_grad_enabled():
            x, bigram_rows, ve_all = self.embedding_lookups(batch, traced=True)
        else:
            x = F.embedding(inputs, self.embed)
            bigram_rows = F.embedding(self._bigram_rows(batch, inputs), self.bigram_embed)
            ve_all = self.value_embeds.view(self.num_ve, self.vocab, D)[:, inputs]
        signs = self.bigram_sign_table[bigram_sign_index(inputs, a.bigram_sign_rows)]
        xb = bigram_rows * signs.type_as(self.bigram_embed)
        xb = xb.type_as(x)
        # n_ve tensors (T, D), unbound once: their gradient is then one stack (per-layer ve[j] indexing
        # summed zero-padded select_backwards over the whole (n_ve, T, D), a pass per table)
        ve = ve_all.type_as(x).unbind(0)

        smear_lambda = self.scalars[2 * L]
        skip_lambda = self.scalars[2 * L + 1]
        if T > 1:
            g = smear_lambda * torch.sigmoid(F.linear(x[1:, : a.smear_width], self.smear_gate.type_as(x)))
            x = torch.cat((x[:1], x[1:] + g.type_as(x) * x[:-1]))
        x0 = _norm(x)

        gates: dict = {"xsa": {}, "attn": {}, "x0": {}, "bigram": {}, "dc": {}, "skip": None}
        scale, align = self.mudd_gate_scale, self.cfg.gate_gemm_align
        pre = mudd_mlp(x0, self.mudd_gate_w1[0], self.mudd_gate_w2[0, : self.pre_layout.size],
                       self.mudd_gate_b2[0, : self.pre_layout.size], scale, align)
        self._unpack_gate(pre, self.pre_layout, gates)
        x = self._add_bigram(x0, xb, gates["bigram"][0]) if 0 in gates["bigram"] else x0
        x_in = x
        cache_skip = cache_saved = x_last = None
        ra, rm = self.resid_lambdas[:, 0].type_as(x), self.resid_lambdas[:, 1].type_as(x)
        pa, pm = self.post_lambdas[:, 0].type_as(x), self.post_lambdas[:, 1].type_as(x)
        # Each layer's (fc, proj) by unbind, not bank[i, 0] indexing: the gradient of 2L selects
        # was one pointwise kernel over the whole bank loading all 2L per-layer gradients for every
        # element (about ten times its bytes); unbind's
        # backward is a stack, written region by region.
        mlp_w = [layer.unbind(0) for layer in self.mlp_bank.unbind(0)]
        # Evaluation runs without FP8, as upstream's does: its MLP in plain bf16 (so do the packed
        # QKV GEMM, :meth:`_packed_qkv`, and the head, ``eval_ce_impl``).
        mlp = self.mlp_impl if self.training else relu2_mlp_plain
        # the same for the attention banks (their gradients summed 2-3 slice/select_backwards per layer)
        banks = (self.qk_bank.split(H, dim=0), self.vo_bank.unbind(0))

        for i in range(L):
            mu = None
            if i == a.post_gate_layer:
                post = mudd_mlp(x, self.mudd_gate_w1[1], self.mudd_gate_w2[1, : self.post_layout.size],
                                self.mudd_gate_b2[1, : self.post_layout.size], scale, align)
                self._unpack_gate(post, self.post_layout, gates)
            if i in a.attnless_layers:
                if i == a.skip_to:
                    x = x + (torch.sigmoid(skip_lambda) * gates["skip"]).type_as(x) * cache_skip
            else:
                src = cache_saved if (cache_saved is not None and i > a.saved_layer) else x
                h = _norm(src)
                aux_v = None
                if i == self.last:
                    x_last = x
                    mu = mudd_mlp(x, self.mudd_w1[0], self.mudd_w2[0], self.mudd_b2[0], a.mudd_scale, align).unbind(-1)
                    mu = [m[:, None] for m in mu]
                    aux_v = mu[0] * x_in + mu[1] * cache_saved + mu[2] * x
                    x = (1 + mu[5]) * x + mu[3] * x_in + mu[4] * cache_saved
                    if i in self.ve_index:
                        halves = torch.cat((mu[6], mu[7]), dim=-1).repeat_interleave(H // 2, dim=-1)  # (T, H)
                        aux_v = aux_v + (halves[..., None] * ve[self.ve_index[i]].view(T, H, dv)).view(T, D)
                elif i in self.ve_index:
                    jv = self.ve_index[i]
                    w = a.ve_gate_width
                    gate_in = torch.cat((h[:, :w], ve[jv][:, :w]), dim=-1)
                    vg = 2 * torch.sigmoid(F.linear(gate_in, self.ve_gate_bank[jv].type_as(h)))  # (T, H)
                    aux_v = (vg[..., None] * ve[jv].view(T, H, dv)).view(T, D)
                y = self._attention(i, h, aux_v, gates, cu_seqlens, max_seqlen, args, banks)
                if mu is not None:
                    x = mu[8] * x + mu[9] * y + mu[10] * x_in
                    x = self._add_bigram(x, xb, mu[11])
                else:
                    x = ra[i] * x + pa[i] * y + x0 * gates["x0"][i]
                    if i != 0:
                        x = self._add_bigram(x, xb, gates["bigram"][i])
            h = _norm(x)
            if mu is not None:
                x = mu[12] * x + mu[13] * mlp(h, *mlp_w[i], layer=i)
            else:
                x = rm[i] * x + pm[i] * mlp(h, *mlp_w[i], layer=i)
            if i == a.skip_from:
                cache_skip = x
            if i == a.saved_layer:
                cache_saved = x

        m = mudd_mlp(x, self.mudd_w1[1], self.mudd_w2[1, :MUDD1_COEFS], self.mudd_b2[1, :MUDD1_COEFS], a.mudd_scale, align)
        m = [c[:, None] for c in m.unbind(-1)]
        ve0 = ve[0]
        x = x + m[0] * x_in + m[1] * cache_saved + m[2] * x_last + m[3] * ve0 + m[4] * cache_skip
        return _norm(x)

    def _softcap(self) -> tuple[float, float, float]:
        return (self.cfg.softcap_a, self.cfg.softcap_b, self.cfg.softcap_c)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(T, D) -> softcapped logits (T, padded_vocab) float32 (the eval path's logits)."""
        return apply_softcap((h @ self.lm_head.type_as(h)).float(), *self._softcap())

    def per_token_training_loss(self, batch, args: ForwardArgs = ForwardArgs()) -> torch.Tensor:
        """(T,) float32: multi-token + prefix-token CE per position (before averaging)."""
        lookups = None
        if self._embedding_grads is not None and torch.is_grad_enabled():
            if self.cfg.embedding_grad == "atomic_graph":
                self.prepare_embedding_grads()  # the network looks the rows up itself
            else:
                lookups = self.embedding_lookups(batch)
        h = (self._hidden_fn or self.hidden)(batch, args, lookups)
        targets = batch.targets.long()
        prefix = None
        if not (isinstance(args.prefix_weight, (int, float)) and args.prefix_weight == 0):
            prefix = torch.where(targets >= 0, self.prefix_table[targets.clamp(min=0)], targets.new_full((), -1))
        return self.ce_impl(h, self.lm_head, targets, args.mtp_weights, prefix, args.prefix_weight,
                            softcap=self._softcap())

    def loss(self, batch, args: ForwardArgs = ForwardArgs()) -> torch.Tensor:
        """Training loss: mean over the batch's T tokens of the MTP + prefix softcapped CE (scalar)."""
        per_tok = self.per_token_training_loss(batch, args)
        return per_tok.sum() / per_tok.shape[0]

    def per_token_loss(self, batch, args: ForwardArgs = ForwardArgs()) -> torch.Tensor:
        """Eval loss: plain next-token softcapped CE per position over the padded vocabulary, (T,)
        float32 (targets < 0 give 0)."""
        h = (self._hidden_fn or self.hidden)(batch, args)
        return self.eval_ce_impl(h, self.lm_head, batch.targets, softcap=self._softcap())


class _HeadRefresh(DeviceWork):
    """``lm_head`` in both e4m3 layouts (:func:`~speedrun.kernels.cross_entropy.quantize_head_weight`)
    into the model's cached head weight; capturable once that exists."""

    def __init__(self, model: RecordGPT):
        self.model = model
        self.key = ("head",) if model._head_fp8 is not None else None

    @torch.no_grad()
    def launch(self) -> None:
        from speedrun.kernels.cross_entropy import W_SCALE, quantize_head_weight

        m = self.model
        # as FusedHead feeds the head: bf16, so the cached bits equal a per-call quantisation
        head = quantize_head_weight(m.lm_head.to(torch.bfloat16).contiguous(), W_SCALE, out=m._head_fp8)
        if m._head_fp8 is None:
            m._head_fp8 = head

    def settle(self) -> None:
        self.model._head_fp8_version = self.model.lm_head._version

    def written(self) -> list[tuple[str, torch.Tensor]]:
        h = self.model._head_fp8
        return [] if h is None else [("lm_head.fp8", h.data), ("lm_head.fp8_cm", h.data_cm)]


class _QKVRefresh(DeviceWork):
    """Every attention layer's packed FP8 QKV weight (``qkv_path="fused_fp8"``).  Capturable in
    the steady state: all layers packed before and no saved scale to replay, so one
    :func:`~speedrun.kernels.qkv_pack.repack_qkv_fp8` rewrites them in place, delayed-scaled."""

    def __init__(self, model: RecordGPT):
        self.model = model
        H = model.num_heads
        self.sources = {}  # attention index j -> (w_qk, w_v, sa_lambda)
        for i in model.attn_layers:
            j = model.attn_index[i]
            self.sources[j] = (model.qk_bank[j * H : (j + 1) * H], model.vo_bank[2 * j], model.scalars[2 * i])
        self.order = sorted(self.sources)
        steady = not model._qkv_replay and sorted(model._qkv_fp8) == self.order
        self.key = ("qkv", tuple(self.order)) if steady else None

    @torch.no_grad()
    def launch(self) -> None:
        m = self.model
        if self.key is None:
            m._pack_qkv_one_by_one(self.sources)
            return
        from speedrun.kernels.qkv_pack import repack_qkv_fp8

        repack_qkv_fp8([m._qkv_fp8[j] for j in self.order], [self.sources[j] for j in self.order])

    def settle(self) -> None:
        self.model._qkv_fp8_versions[:] = self.model._qkv_sources_version()

    def written(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for j in self.order:
            pk = self.model._qkv_fp8.get(j)
            if pk is not None:
                out += [(f"qkv{j}.{name}", getattr(pk, name)) for name in ("data", "data_t", "scale", "raw_scale", "amax")]
        return out

