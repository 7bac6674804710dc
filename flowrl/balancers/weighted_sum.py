"""weighted_sum: sum the rewards, then group-normalise the sum (Flow-GRPO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.advantages import group_advantages
from flowrl.balancers._common import all_true, check_common, fail, total_metrics, weighted_total
from flowrl.registry import BALANCERS
from flowrl.types import Balance


@BALANCERS.register("weighted_sum")
@dataclass
class WeightedSumBalancer:
    """Sum then normalize: R = Σ_k w_k r_k (NaN parts skipped), then group advantages of R (Flow-GRPO)."""

    combines_rewards_linearly: ClassVar[bool] = True  # its training signal is Σ_k w_k r_k alone (adjoint matching)

    recipe_variants: ClassVar[dict[str, dict]] = {"": {}}

    std: str = "global"
    """'global' (Flow-GRPO, DiffusionNFT) or 'group' (DanceGRPO) std in the denominator; 'none' only centres (RAM)."""
    eps: float = 1e-4
    """Added to the std in the denominator (1e-4 Flow-GRPO / DiffusionNFT, 1e-8 DanceGRPO)."""
    use_unbiased_std: bool = False
    """Divide the variance by n − 1 (DanceGRPO) instead of n."""
    clip: float = 5.0
    """Advantages are clipped to [−clip, clip]."""
    unbiased: bool | None = None
    """Old name of use_unbiased_std (run configs written before the balancers shared one name), accepted as an alias."""

    def __post_init__(self):
        if self.unbiased is not None:
            if self.use_unbiased_std and not self.unbiased:
                fail(
                    "weighted_sum",
                    "unbiased",
                    self.unbiased,
                    "contradicts use_unbiased_std=True; give only use_unbiased_std",
                )
            self.use_unbiased_std, self.unbiased = bool(self.unbiased), None
        if self.std not in ("global", "group", "none"):
            fail(
                "weighted_sum",
                "std",
                self.std,
                "must be 'global' (whole-batch std), 'group' (per-prompt std) or 'none'",
            )
        check_common(self, "weighted_sum")

    def needs(self) -> frozenset[str]:
        return frozenset()

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        total = weighted_total(scores, weights)
        advantages = group_advantages(
            total, group_ids, std=self.std, eps=self.eps, unbiased=self.use_unbiased_std, clip=self.clip
        )
        return Balance(advantages, all_true(total.numel()), None, total_metrics(total, group_ids))
