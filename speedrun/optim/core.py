"""The optimizer of the core model: AdamW in three parameter groups with a trapezoid LR schedule.

The training loop talks to every optimizer through the same small interface:
``step(step_index)`` (applies the schedule for that step, updates, and clears the gradients it
used), ``zero_grad()``,
``state_dict()`` / ``load_state_dict()``.  NorMuon + Adam of the record recipe implements the same.
"""

from __future__ import annotations

import torch

from speedrun.config import TrainConfig


def trapezoid_lr(step: int, total: int, warmup: int, cooldown_frac: float, final_frac: float) -> float:
    """LR multiplier at ``step`` (0-based): linear warmup over ``warmup`` steps, flat, then a linear
    decay over the last ``cooldown_frac * total`` steps down to ``final_frac``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    cooldown = int(total * cooldown_frac)
    start = total - cooldown
    if cooldown <= 0 or step < start:
        return 1.0
    progress = (step - start) / cooldown
    return 1.0 - progress * (1.0 - final_frac)


class CoreOptimizer:
    """AdamW over ``model.parameter_groups()`` (embed / head / matrix)."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig):
        self.cfg = cfg
        groups = model.parameter_groups()
        self.params = [p for ps in groups.values() for p in ps]
        param_groups = [
            {"params": groups["embed"], "lr": cfg.embed_lr, "weight_decay": 0.0},
            {"params": groups["head"], "lr": cfg.lr, "weight_decay": 0.0},
            {"params": groups["matrix"], "lr": cfg.lr, "weight_decay": cfg.weight_decay},
        ]
        for g in param_groups:
            g["base_lr"] = g["lr"]
        fused = all(p.device.type == "cuda" for p in self.params)
        self.adam = torch.optim.AdamW(
            param_groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None,
            foreach=None if fused else True,
        )

    def lr_multiplier(self, step: int) -> float:
        c = self.cfg
        return trapezoid_lr(step, c.steps, c.lr_warmup_steps, c.cooldown_frac, c.final_lr_frac)

    def step(self, step: int) -> None:
        mult = self.lr_multiplier(step)
        for g in self.adam.param_groups:
            g["lr"] = g["base_lr"] * mult
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        self.adam.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        self.adam.zero_grad(set_to_none=True)

    def state_dict(self) -> dict:
        return self.adam.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.adam.load_state_dict(state)
