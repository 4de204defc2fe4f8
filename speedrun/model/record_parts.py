"""Plain-PyTorch pieces of the record network (recipe §1.3-§1.4, §2, §3.5).

Each function here is the reference a fused kernel must match, with the signature the model
calls it through (``RecordGPT.ce_impl`` / ``mlp_impl`` / ``dc_impl``):

* :func:`bigram_sign_index`: the sign-table row of every position (the bigram-embedding row is
  :func:`speedrun.data.loader.bigram_hash`); both use the previous token even across a document
  boundary, as the record does.
* :func:`relu2_mlp_plain`: ``relu(x W_fcᵀ)² W_proj`` with the record's bank layout (both (H, D)).
* :func:`softcapped_mtp_ce`: per-token multi-token + prefix-token cross entropy on softcapped logits;
  :func:`softcapped_ce_eval_plain`: the validation loss (next token only, fp32, row chunks).
* :func:`xsa`: gated exclusive self-attention, ``y -= tanh(a) (y.v / |v|²) v`` per head.
* :func:`dc_gate_weights`, :func:`dc_postonly_correction`: the lightweight DC attention
  correction of the last layer, banded (memory O(T (B + W) H), never T x T).
* :class:`GateLayout`: where each per-token coefficient sits in the two MUDD-gate outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Bigram sign


def bigram_sign_index(inputs: torch.Tensor, rows: int) -> torch.Tensor:
    """Sign-table row per position, (T,) int64: 0 at t=0, else ``(x[t-1] XOR x[t]) mod rows``."""
    x = inputs.long()
    out = torch.zeros_like(x)
    if x.numel() > 1:
        out[1:] = torch.bitwise_xor(x[:-1], x[1:]) % rows
    return out


# ----------------------------------------------------------------------------------------------
# MLP and loss


def relu2_mlp_plain(x: torch.Tensor, w_fc: torch.Tensor, w_proj: torch.Tensor, layer: int | None = None) -> torch.Tensor:
    """``relu(x @ w_fcᵀ)² @ w_proj``: x (T, D), w_fc (H, D), w_proj (H, D) -> (T, D) in x.dtype.
    ``layer`` (unused here) lets stateful kernels keep per-layer scales.

    Both weights are stored (hidden, model) as in the record's ``mlp_bank``.  A fused kernel taking
    ``w2`` as (D, H) plugs in as ``lambda x, w1, w2: kernel(x, w1, w2.t())``.
    """
    post = torch.relu(F.linear(x, w_fc.type_as(x))).square()
    return post @ w_proj.type_as(x)


def apply_softcap(z: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """``a * sigmoid((z + b) / c)``; ``a <= 0`` leaves z unchanged."""
    if a <= 0:
        return z
    return a * torch.sigmoid((z + b) / c)


def softcapped_mtp_ce(
    h: torch.Tensor,
    lm_head: torch.Tensor,
    targets: torch.Tensor,
    mtp_weights,
    prefix_targets: torch.Tensor | None,
    prefix_weight: float,
    *,
    softcap: tuple[float, float, float] = (23.0, 5.0, 7.5),
) -> torch.Tensor:
    """Per-token training loss of the record, (T,) float32 (nats, not averaged).

    ``loss[t] = sum_k w_k CE(z_t, targets[t+k]) + prefix_weight * CE(z_t, prefix_targets[t])`` with
    ``z_t = softcap(h_t @ lm_head)`` over every (padded) vocabulary column.  Terms whose target is
    past the end of the batch or outside [0, V) are dropped (MTP targets cross documents, as in the
    record; only the batch end is masked).

    Args:
        h: (T, D) final hidden states; lm_head: (D, V) (the record's transposed storage).
        targets: (T,) int64 next-token ids; mtp_weights: sequence of k floats (or 0-d tensors).
        prefix_targets: (T,) int64 or None; entries < 0 disable the prefix term there.
        softcap: (A, B, C).
    Same positional order as ``speedrun.kernels.cross_entropy.fused_softcapped_ce``.
    """
    T = h.shape[0]
    V = lm_head.shape[1]
    z = apply_softcap((h @ lm_head.type_as(h)).float(), *softcap)
    lse = torch.logsumexp(z, dim=-1)
    loss = torch.zeros(T, dtype=torch.float32, device=h.device)

    def term(tgt: torch.Tensor) -> torch.Tensor:
        ok = (tgt >= 0) & (tgt < V)
        zt = z.gather(1, tgt.clamp(0, V - 1)[:, None])[:, 0]
        return torch.where(ok, lse - zt, torch.zeros_like(lse))

    targets = targets.long()
    for k in range(len(mtp_weights)):
        w = mtp_weights[k]
        if isinstance(w, (int, float)) and w == 0:
            continue
        if k == 0:
            tgt = targets
        else:
            tgt = torch.cat((targets[k:], targets.new_full((min(k, T),), -1)))[:T]
        loss = loss + w * term(tgt)
    if prefix_targets is not None and not (isinstance(prefix_weight, (int, float)) and prefix_weight == 0):
        loss = loss + prefix_weight * term(prefix_targets.long())
    return loss


def softcapped_ce_eval_plain(
    h: torch.Tensor,
    lm_head: torch.Tensor,
    targets: torch.Tensor,
    *,
    softcap: tuple[float, float, float] = (23.0, 5.0, 7.5),
    chunk_rows: int = 8192,
) -> torch.Tensor:
    """Validation loss of the record: next-token CE per position, (T,) float32 nats.

    Logits ``h @ lm_head`` in h's dtype (bf16 in training), softcapped, then fp32 cross entropy over
    every (padded) column; targets < 0 give 0.  ``chunk_rows`` rows at a time bound the fp32
    logits to ``chunk_rows * V * 4`` bytes.  h (T, D), lm_head (D, V), targets (T,) int.
    """
    out = []
    w = lm_head.type_as(h)
    for start in range(0, h.shape[0], chunk_rows):
        z = apply_softcap((h[start : start + chunk_rows] @ w).float(), *softcap)
        out.append(F.cross_entropy(z, targets[start : start + chunk_rows].long(), reduction="none", ignore_index=-1))
    return torch.cat(out) if out else h.new_zeros(0, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Attention extras


def xsa(y: torch.Tensor, v: torch.Tensor, alpha: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gated XSA: remove ``tanh(alpha)`` of each head output's component along its own value.

    y, v: (T, H, Dv); alpha: (T, H) raw gate (tanh applied here).  Returns (T, H, Dv) in y.dtype.
    """
    dot = (y * v).sum(-1, keepdim=True)
    denom = v.square().sum(-1, keepdim=True).clamp_min(eps)
    a = torch.tanh(alpha).type_as(y)[..., None]
    return y - a * (dot / denom) * v


def dc_gate_weights(w1: torch.Tensor, w2: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """The DC mixing weights from raw gate outputs: w1 RMS-normalised over heads (in fp32), w2 as is.

    w1, w2: (T, H) -> two (T, H) tensors in w1's dtype.
    """
    w1n = F.rms_norm(w1.float(), (w1.shape[-1],), eps=eps).to(w1.dtype)
    return w1n, w2.to(w1.dtype)


def document_ids(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """(T,) int64: index of the document each position belongs to (empty documents are skipped)."""
    pos = torch.arange(T, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens.long(), pos, right=True) - 1


def dc_postonly_correction(
    base: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    scale: float,
    window: int = 112,
    block: int = 128,
) -> torch.Tensor:
    """Post-only DC correction added to an attention output (recipe §3.5 "Math").

    For every query t and key s of t's document with ``0 <= t - s < window``:
    ``p_h[t, s] = softmax_s(scale * q_h[t].k_h[s])`` (recomputed locally, per head),
    ``a[t, s] = sum_h w1[t, h] p_h[t, s]`` and ``out[t, h] = base[t, h] + w2[t, h] * sum_s a[t, s] v_h[s]``.

    Args:
        base: (T, H, Dv) attention output; q, k: (T, H, Dqk); v: (T, H, Dv).
        w1: (T, H) already RMS-normalised over heads (:func:`dc_gate_weights`); w2: (T, H).
        cu_seqlens: (N+1,) int document starts ending in T (padding repeats of T allowed).
        scale: softmax scale; window: keys per query including itself; block: query block size
            (memory knob only).
    Returns (T, H, Dv) in base's dtype.  Math in float32; memory about (1 + window/block) x (q, k, v).
    """
    T, H, Dqk = q.shape
    Dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:2] != (T, H) or base.shape != v.shape:
        raise ValueError(
            f"dc_postonly_correction: q{tuple(q.shape)} k{tuple(k.shape)} v{tuple(v.shape)} base{tuple(base.shape)}"
            " must be (T, H, Dqk), (T, H, Dqk), (T, H, Dv), (T, H, Dv)"
        )
    if w1.shape != (T, H) or w2.shape != (T, H):
        raise ValueError(f"dc_postonly_correction: w1{tuple(w1.shape)}, w2{tuple(w2.shape)} must be ({T}, {H})")
    if window < 1:
        raise ValueError(f"dc_postonly_correction: window must be >= 1, got {window}")
    W, B = window, block
    nb = -(-T // B)
    Tp = nb * B
    # Keys of query block n: positions n B - W .. n B + B - 1.  The first is never within the
    # window of any query (the band needs B + W - 1 keys), but B + W keeps the batched GEMMs'
    # key dimension a multiple of 8 at the record's shape (128 + 112 = 240): cuBLAS ran the odd
    # 239 on slow alignment-1 kernels.
    K = B + W
    f32 = torch.float32
    dev = q.device

    def keys_band(x: torch.Tensor) -> torch.Tensor:  # (T, H, D) -> (nb, H, D, K)
        pad = torch.cat((x.new_zeros(W, *x.shape[1:]), x, x.new_zeros(Tp - T, *x.shape[1:])))
        return pad.unfold(0, K, B)

    def queries(x: torch.Tensor) -> torch.Tensor:  # (T, ...) -> (nb, B, ...)
        return torch.cat((x, x.new_zeros(Tp - T, *x.shape[1:]))).view(nb, B, *x.shape[1:])

    doc = document_ids(cu_seqlens.to(dev), T)
    doc_k = torch.cat((doc.new_full((W,), -1), doc, doc.new_full((Tp - T,), -2))).unfold(0, K, B)  # (nb, K)
    doc_q = torch.cat((doc, doc.new_full((Tp - T,), -3))).view(nb, B)
    rel = torch.arange(B, device=dev)[:, None] - torch.arange(K, device=dev)[None, :] + W  # query - key position
    band = (rel >= 0) & (rel < W)  # (B, K)
    valid = band[None] & (doc_q[:, :, None] == doc_k[:, None, :])  # (nb, B, K)

    qb = queries(q.to(f32))  # (nb, B, H, Dqk)
    kb = keys_band(k.to(f32))  # (nb, H, Dqk, K)
    vb = keys_band(v.to(f32))  # (nb, H, Dv, K)
    s = torch.einsum("nbhd,nhdk->nhbk", qb, kb) * scale
    s = s.masked_fill(~valid[:, None], -1e30)
    p = torch.softmax(s, dim=-1) * valid[:, None]  # rows with no valid key (padding) become 0
    # The head mix as a broadcast product and sum, not an einsum: einsum made it a batched GEMM
    # whose backward is T outer products (K = 1, slow on any GEMM library), where Inductor
    # fuses this form's backward into the softmax's.
    a = (p * queries(w1.to(f32)).permute(0, 2, 1)[..., None]).sum(1)  # (nb, B, K)
    av = torch.einsum("nbk,nhdk->nbhd", a, vb)  # (nb, B, H, Dv)
    corr = (av * queries(w2.to(f32))[..., None]).reshape(Tp, H, Dv)[:T]
    return (base.to(f32) + corr).to(base.dtype)


# ----------------------------------------------------------------------------------------------
# MUDD-gate coefficient layout


@dataclass
class GateLayout:
    """Column positions of the per-token coefficients in one MUDD-gate output.

    Order (reproduces the record's 26 / 41 layouts at 11 layers and 6 heads): XSA strengths of
    each XSA layer (H each), attention-output gates (H each), then an (x0, bigram) pair per
    injecting layer, then (post gate only) the skip gate and, per DC layer, w1 (H) and w2 (H).
    """

    address_leaf = True  # holds no tensor: the CUDA graphs' address watch need not look inside

    num_heads: int
    xsa: dict[int, slice] = field(default_factory=dict)
    attn_gate: dict[int, slice] = field(default_factory=dict)
    x0: dict[int, int] = field(default_factory=dict)
    bigram: dict[int, int] = field(default_factory=dict)
    skip: int | None = None
    dc_w1: dict[int, slice] = field(default_factory=dict)
    dc_w2: dict[int, slice] = field(default_factory=dict)
    size: int = 0

    @classmethod
    def build(cls, num_heads: int, xsa_layers, attn_gate_layers, inject_layers, *, skip: bool = False,
              dc_layers=()) -> "GateLayout":
        lay = cls(num_heads)
        H, n = num_heads, 0
        for i in sorted(xsa_layers):
            lay.xsa[i] = slice(n, n + H)
            n += H
        for i in sorted(attn_gate_layers):
            lay.attn_gate[i] = slice(n, n + H)
            n += H
        for i in sorted(inject_layers):
            lay.x0[i], lay.bigram[i] = n, n + 1
            n += 2
        if skip:
            lay.skip = n
            n += 1
        for i in sorted(dc_layers):
            lay.dc_w1[i] = slice(n, n + H)
            n += H
        for i in sorted(dc_layers):
            lay.dc_w2[i] = slice(n, n + H)
            n += H
        lay.size = n
        return lay

    def bias_init(self, *, attn_gate: float, bigram: float, skip: float, dc_w1: float) -> torch.Tensor:
        """Effective starting values (before division by the gate scale), (size,) float32."""
        b = torch.zeros(self.size)
        for s in self.attn_gate.values():
            b[s] = attn_gate
        for j in self.bigram.values():
            b[j] = bigram
        if self.skip is not None:
            b[self.skip] = skip
        for s in self.dc_w1.values():
            b[s] = dc_w1
        return b


def mudd_mlp(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor, scale,
             align: int = 1) -> torch.Tensor:
    """``(gelu(x w1ᵀ) w2ᵀ + b2) * scale``: x (T, D), w1 (hidden, D), w2 (n, hidden), b2 (n,) -> (T, n).

    ``align`` > 1 pads w2 and b2 with zeros to a multiple of ``align`` outputs and slices the
    result back to n columns (a view with row stride n + pad): the same values, but the GEMMs
    see 16-byte-aligned row strides (``model.gate_gemm_align``)."""
    n = w2.shape[0]
    pad = -n % align
    if pad:
        w2, b2 = F.pad(w2, (0, 0, 0, pad)), F.pad(b2, (0, pad))
    hdn = F.gelu(F.linear(x, w1.type_as(x)))
    out = F.linear(hdn, w2.type_as(x)) + b2.type_as(x)
    if isinstance(scale, torch.Tensor):
        scale = scale.type_as(x)
    out = out * scale
    return out[:, :n] if pad else out
