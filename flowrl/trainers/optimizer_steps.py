"""Stage 6's loop of the kit: a step's items in minibatches, an optimizer step every gradient-accumulation window,
MARBLE's per-reward gradients planned and combined around it, the EMA update, and the fold of the losses and terms
into the step's metrics. Recipes use it as `kit.OptimizerSteps(parts)`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flowrl.training.loop import RecipeParts


@dataclass
class Minibatch:
    """One minibatch of a step's local items: its rows (CPU and device) and whether it closes an optimizer step (its
    last backward is the boundary of gradient accumulation)."""

    rows: torch.Tensor  # [b] int64 on the CPU
    index: torch.Tensor  # the same rows on the device
    epoch: int
    closes_step: bool


class OptimizerSteps:
    """Stage 6's loop: the step's items in minibatches (one permutation per inner epoch, `orders`), an optimizer step
    every `gradient_accumulation_steps` minibatches, then the EMA update. A recipe iterates it, runs its backward calls
    for each minibatch (`closes_step` marks the last) and appends each backward's loss to `losses` (and its terms to
    `record`); the optimizer step receives the losses of its window, `metrics()` folds them. With the parts' per-reward
    gradients (`reward_gradients`) the window is planned over the minibatches it will train (`per_reward` [K, items])
    and combined before the step."""

    def __init__(self, parts: RecipeParts):
        t = parts.cfg.train
        self.parts, self.reward_grads = parts, parts.reward_grads
        self.num_minibatches, self.accumulation = t.num_minibatches, t.gradient_accumulation_steps
        self.losses: list[torch.Tensor] = []
        self.stats: dict[str, list[torch.Tensor]] = {}

    def __call__(self, orders: list[torch.Tensor], per_reward: torch.Tensor | None = None) -> Iterator[Minibatch]:
        opt, ema, grads, device = self.parts.opt, self.parts.ema, self.reward_grads, self.parts.accelerator.device
        m_total, accum = self.num_minibatches, self.accumulation
        for epoch, order in enumerate(orders):
            size = len(order) // m_total
            for m in range(m_total):
                if m % accum == 0:
                    window = len(self.losses)  # this optimizer step's losses start here
                    if grads is not None:
                        grads.plan(per_reward[:, order[m * size : (m + accum) * size].to(device)])
                rows = order[m * size : (m + 1) * size]
                closes = (m + 1) % accum == 0
                yield Minibatch(rows, rows.to(device), epoch, closes)
                if closes:
                    if grads is not None:
                        grads.finish()  # MARBLE: the per-reward gradients combined into .grad
                    losses = self.losses[window:] or [torch.zeros((), device=device)]
                    if opt.step(torch.stack(losses)) and ema is not None:
                        ema.update(opt.params, opt.optimizer_steps)

    def record(self, values: dict[str, torch.Tensor | None], dtype: torch.dtype | None = torch.float64) -> None:
        """Each term's mean over its rows (in `dtype`; None: its own) for `train/<name>`; None values are skipped."""
        for key, value in values.items():
            if value is not None:
                value = value.detach() if dtype is None else value.detach().to(dtype)
                self.stats.setdefault(key, []).append(value.mean())

    def metrics(self) -> dict[str, float]:
        """`train/loss` (the mean of the appended losses), `train/<name>` (the mean of each recorded term), the
        optimizer's metrics and the per-reward gradients' (where the parts hold them)."""
        out = {"train/loss": float(torch.stack(self.losses).mean())}
        out |= {f"train/{key}": float(torch.stack(values).mean()) for key, values in self.stats.items()}
        out |= self.parts.opt.metrics()
        return out | (self.reward_grads.metrics() if self.reward_grads is not None else {})
