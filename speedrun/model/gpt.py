"""The core GPT: the plain network every preset without the record's extras uses.

token embedding -> L x [RMSNorm -> attention -> residual; RMSNorm -> ReLU^2 MLP -> residual]
-> RMSNorm -> lm_head -> softcapped logits.

Attention projects one packed matrix to per-head ``[q (qk_head_dim) | k (qk_head_dim) | v
(v_head_dim)]`` columns, so Q/K and V widths are independent; Q and K are RMS-normalised (QK-norm)
and rotated (:mod:`speedrun.model.rotary`), then handed to an attention backend
(:mod:`speedrun.attention`) over one packed, document-masked sequence.  Output projections are
zero-initialised so every block starts as the identity.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from speedrun.attention import get_backend
from speedrun.config import ModelConfig
from speedrun.model.interface import ForwardArgs, TrainableModel
from speedrun.model.rotary import Rotary


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim without a learned gain."""
    return F.rms_norm(x, (x.shape[-1],))


def softcap(logits: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """``a * sigmoid((z + b) / c)``: logits bounded to (0, a); a <= 0 leaves them unchanged."""
    if a <= 0:
        return logits
    return a * torch.sigmoid((logits + b) / c)


class Attention(nn.Module):
    """Packed QKV projection, QK-norm, RoPE, varlen attention, output projection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qk_dim = cfg.qk_head_dim
        self.v_dim = cfg.v_head_dim
        per_head = 2 * cfg.qk_head_dim + cfg.v_head_dim
        self.qkv = nn.Linear(cfg.model_dim, cfg.num_heads * per_head, bias=False)
        self.proj = nn.Linear(cfg.num_heads * cfg.v_head_dim, cfg.model_dim, bias=False)
        self.rotary = Rotary(cfg.qk_head_dim, cfg.rope_fraction, cfg.rope_base)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.qk_head_dim**-0.5
        self.backend_name = cfg.attention_backend
        self._attend: dict = {}

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None) -> torch.Tensor:
        """x: (T, model_dim) -> (T, model_dim)."""
        T = x.shape[0]
        qkv = self.qkv(x).view(T, self.num_heads, 2 * self.qk_dim + self.v_dim)
        q, k, v = qkv.split((self.qk_dim, self.qk_dim, self.v_dim), dim=-1)
        q = self.rotary(rms_norm(q))
        k = self.rotary(rms_norm(k))
        attend = self._attend.get(x.device)
        if attend is None:  # resolved once per device: keeps the backend check out of compiled graphs
            attend = self._attend[x.device] = get_backend(self.backend_name, x.device)
        y = attend(q, k, v.contiguous(), cu_seqlens, max_seqlen, window=window, scale=self.scale)
        return self.proj(y.reshape(T, self.num_heads * self.v_dim))


class MLP(nn.Module):
    """``W2 relu(W1 x)^2``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.model_dim, cfg.mlp_hidden_dim, bias=False)
        self.proj = nn.Linear(cfg.mlp_hidden_dim, cfg.model_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.relu(self.fc(x)).square())


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x, cu_seqlens, max_seqlen, window):
        x = x + self.attn(rms_norm(x), cu_seqlens, max_seqlen, window)
        return x + self.mlp(rms_norm(x))


class GPT(TrainableModel):
    """The core model.  See the module docstring; ``cfg`` is validated on construction."""

    generates_text = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.padded_vocab_size, cfg.model_dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.lm_head = nn.Linear(cfg.model_dim, cfg.padded_vocab_size, bias=False)
        self._hidden_fn = None  # torch.compile'd hidden (compile_body), else the eager method
        self.reset_parameters()

    def __setstate__(self, state) -> None:
        """A copy (deepcopy, pickle) is uncompiled: the original's compiled function runs the original."""
        super().__setstate__(state)
        self._hidden_fn = None

    def compile_body(self, **compile_kwargs) -> None:
        """Run :meth:`hidden` through ``torch.compile`` from now on (the head and loss stay eager),
        with ``fullgraph=True``: a graph break inside the block loop would make Dynamo skip the whole
        network and run it eagerly, so it is an error instead."""
        device = self.lm_head.weight.device
        for block in self.blocks:  # resolved here: backend checks are not traceable
            if device not in block.attn._attend:
                block.attn._attend[device] = get_backend(block.attn.backend_name, device)
        self._hidden_fn = torch.compile(self.hidden, fullgraph=True, **compile_kwargs)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        d = self.cfg.model_dim
        bound = (3**0.5) * 0.5 * d**-0.5
        nn.init.normal_(self.embed.weight, std=1.0)
        for block in self.blocks:
            for lin in (block.attn.qkv, block.mlp.fc):
                nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.zeros_(block.attn.proj.weight)
            nn.init.zeros_(block.mlp.proj.weight)
        nn.init.normal_(self.lm_head.weight, std=0.02)

    def hidden(self, inputs: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None) -> torch.Tensor:
        """inputs: (T,) int token ids -> final normalised hidden states (T, model_dim)."""
        x = self.embed(inputs.long())
        x = rms_norm(x)
        for block in self.blocks:
            x = block(x, cu_seqlens, max_seqlen, window)
        return rms_norm(x)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(T, model_dim) -> softcapped logits over the real vocabulary (T, vocab_size), float32."""
        z = self.lm_head(h)[..., : self.cfg.vocab_size].float()
        return softcap(z, self.cfg.softcap_a, self.cfg.softcap_b, self.cfg.softcap_c)

    def per_token_loss(self, batch, args: ForwardArgs = ForwardArgs()) -> torch.Tensor:
        """Next-token cross entropy per position, (T,) float32 (nats)."""
        h = (self._hidden_fn or self.hidden)(batch.inputs, batch.cu_seqlens, batch.max_seqlen, args.window_short)
        return F.cross_entropy(self.logits(h), batch.targets.long(), reduction="none")

    def loss(self, batch, args: ForwardArgs = ForwardArgs()) -> torch.Tensor:
        """Mean next-token cross entropy over the batch (scalar); what training differentiates."""
        return self.per_token_loss(batch, args).mean()

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by role: ``embed`` (embedding table), ``head`` (lm_head), ``matrix`` (the rest)."""
        return {
            "embed": [self.embed.weight],
            "head": [self.lm_head.weight],
            "matrix": [p for b in self.blocks for p in b.parameters()],
        }

    @torch.no_grad()
    def generate(self, prompt: list[int], new_tokens: int, *, temperature: float = 0.8, top_k: int = 40,
                 generator: torch.Generator | None = None, window: int | None = None,
                 max_context: int = 1024) -> list[int]:
        """Sample ``new_tokens`` continuation ids after ``prompt`` (one document, full recompute per token)."""
        device = self.embed.weight.device
        ids = list(prompt)
        for _ in range(new_tokens):
            context = ids[-max_context:]
            inputs = torch.tensor(context, dtype=torch.int32, device=device)
            cu = torch.tensor([0, len(context)], dtype=torch.int32, device=device)
            h = self.hidden(inputs, cu, len(context), window)
            z = self.logits(h[-1:])[0] / max(temperature, 1e-5)
            if top_k:
                kth = torch.topk(z, min(top_k, z.numel())).values[-1]
                z = z.masked_fill(z < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(z, -1), 1, generator=generator).item()
            ids.append(int(nxt))
        return ids[len(prompt):]
