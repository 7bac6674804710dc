"""Multi-reward balancers: scores of K rewards -> one advantage per sample (docs/math.md#advantages, #multi-reward-balancing).

Signature (DESIGN.md): `balancer(scores: dict[str, Tensor[M]], group_ids [M], weights: dict[str, float])
-> (advantages [M], metrics)`, over the gathered global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.advantages import group_advantages, zero_std_groups
from flowrl.registry import BALANCERS


@BALANCERS.register("weighted_sum")
@dataclass
class WeightedSumBalancer:
    """Sum then normalize: R = Σ_k w_k r_k (NaN parts skipped), then group advantages of R (Flow-GRPO)."""

    std: str = "global"
    """'global' (Flow-GRPO, DiffusionNFT) or 'group' (DanceGRPO) std in the denominator."""
    eps: float = 1e-4
    unbiased: bool = False
    """Divide the variance by n − 1 (DanceGRPO) instead of n."""
    clip: float = 5.0
    """Advantages are clipped to [−clip, clip]."""

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]):
        if not scores:
            raise ValueError("no reward scores to balance: configure at least one reward")
        stacked = torch.stack([scores[name].float() * weights.get(name, 1.0) for name in scores])  # [K, M]
        applicable = torch.isfinite(stacked)
        total = torch.where(applicable, stacked, torch.zeros_like(stacked)).sum(0)  # [M]
        total = torch.where(applicable.any(0), total, torch.full_like(total, float("nan")))  # no reward applied: NaN
        advantages = group_advantages(total, group_ids, std=self.std, eps=self.eps, unbiased=self.unbiased, clip=self.clip)
        zero = zero_std_groups(total, group_ids)
        metrics = {
            "reward/total/mean": float(total[torch.isfinite(total)].mean()) if torch.isfinite(total).any() else float("nan"),
            "train/zero_std_fraction": float(zero.float().mean()),
        }
        return advantages, metrics
