"""Adaptive importance sampling (AIS) for GRPO rollouts drawn by another policy than the one trained (sampler
candidates with train_on: previews): the ratio is taken against the policy at rollout time, and each transition's
advantage is scaled by flowrl.losses.ais_mixture's coefficient (docs/math.md#adaptive-importance-sampling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl import sde
from flowrl.losses import ais_mixture
from flowrl.trainers.transitions import transition_inputs
from flowrl.training.loop import RecipeParts
from flowrl.types import Rollout


@dataclass
class AISConfig:
    """Keys train.ais.* of the GRPO recipe (off by default)."""

    enabled: bool = False
    max_weight: float = 5.0
    """Truncation of the self-normalised importance weights w / mean(w)."""

    def __post_init__(self) -> None:
        if not self.max_weight >= 1.0:
            raise ValueError(
                f"train.ais.max_weight={self.max_weight} must be >= 1 (the weights are normalised to mean 1)"
            )


@torch.no_grad()
def ais_coefficients(
    parts: RecipeParts,
    cfg: AISConfig,
    rollout: Rollout,
    steps: list[list[int]],
    keep: torch.Tensor,
    order: torch.Tensor,
    mb: int,
):
    """AIS before any optimizer step: the policy's log-prob of every trained transition, in the first epoch's
    minibatches (the batch shapes of the first pass, so that its ratios are exactly 1), and ais_mixture's
    coefficients from the log-weights (policy − behaviour) of the kept samples' transitions (over all processes)."""
    acc, model = parts.accelerator, parts.model
    sigmas = rollout.sigmas.to(acc.device)
    prox = rollout.log_probs.clone().to(acc.device)  # [N, T]
    for m in range(len(order) // mb):
        rows = order[m * mb : (m + 1) * mb].tolist()
        for j in range(max((len(steps[i]) for i in rows), default=0)):
            sel = [i for i in rows if len(steps[i]) > j]
            index = torch.tensor(sel, device=acc.device)
            k = torch.tensor([steps[i][j] for i in sel], device=acc.device)
            cond, x, x_next, sigma, sigma_next, level, scale = transition_inputs(rollout, sigmas, index, k)
            v = model.velocity(x, sigma, cond, rollout.guidance_scale)
            log_prob, _ = sde.rescore_transition(
                rollout.rule, v, x, x_next, sigma, sigma_next, level, None, "code", scale
            )
            prox[index, k] = log_prob.to(prox.dtype)
    kept = keep.cpu().tolist()  # one transfer, not a device sync per transition
    pairs = [(i, k) for i, row in enumerate(steps) for k in row if kept[i]]
    rows_i = torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=acc.device)
    rows_k = torch.tensor([k for _, k in pairs], dtype=torch.int64, device=acc.device)
    behaviour = rollout.log_probs.to(acc.device)
    log_w = (prox[rows_i, rows_k] - behaviour[rows_i, rows_k]).double()
    reduce = (lambda t: acc.reduce(t, reduction="sum")) if acc.num_processes > 1 else None
    c, stats = ais_mixture(log_w, cfg.max_weight, reduce)
    coef = torch.ones_like(prox, dtype=torch.float32)
    coef[rows_i, rows_k] = c
    return prox, coef, stats
