"""tail: TailRL, the gradient of E_τ[log P(R > τ)] on the weighted sum of the rewards
(docs/math.md#tailrl-the-log-probability-of-clearing-a-random-bar-tail)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.advantages import tail_advantages
from flowrl.balancers._common import all_true, check_common, total_metrics, weighted_total
from flowrl.registry import BALANCERS
from flowrl.types import Balance


@BALANCERS.register("tail")
@dataclass
class TailBalancer:
    """TailRL on the weighted sum R = Σ_k w_k r_k: A_i = Σ_{j: R_j < R_i} 1 / #{l: R_l > R_j} − the group mean
    of that sum, the score-function weight of E_τ[log P(R > τ)] with τ drawn from the group's own rewards
    (docs/math.md#tailrl-the-log-probability-of-clearing-a-random-bar-tail). Rank-based, so the reward scale does not
    matter; rare high rewards weigh most."""

    combines_rewards_linearly: ClassVar[bool] = False  # ranks of the weighted sum: not linear in the rewards

    recipe_variants: ClassVar[dict[str, dict]] = {"": {}}

    clip: float = 5.0
    """Advantages are clipped to [−clip, clip] (the top of a group of n gets about ln n − 1)."""

    def __post_init__(self):
        check_common(self, "tail")

    def needs(self) -> frozenset[str]:
        return frozenset()

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        total = weighted_total(scores, weights)
        advantages = tail_advantages(total, group_ids).clamp(-self.clip, self.clip)
        return Balance(advantages, all_true(total.numel()), None, total_metrics(total, group_ids))
