"""gdpo: group-normalise each reward, weighted sum, batch whitening (GDPO, arXiv 2601.05242)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.balancers._common import Decoupled, all_true, check_common, decoupled_metrics
from flowrl.registry import BALANCERS
from flowrl.types import Balance


@BALANCERS.register("gdpo")
@dataclass
class GDPOBalancer(Decoupled):
    """Normalize then sum: A_i = whiten_batch(Σ_k w_k · z_group(r_k)_i) (GDPO, arXiv 2601.05242).

    A reward with no spread in a group adds 0 there, so a sample that improves every reward is pushed harder
    than one that improves one (summing first gives both the same). `per_reward` holds the unweighted z rows.
    """

    combines_rewards_linearly: ClassVar[bool] = False  # each reward normalised before the sum

    def __post_init__(self):
        check_common(self, "gdpo")

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        w = [float(weights.get(name, 1.0)) for name in scores]
        stacked, per_reward, combined, no_signal, any_finite = self._decouple(scores, group_ids, w)
        advantages = self._finish(combined, any_finite, no_signal)
        metrics = decoupled_metrics(list(scores), stacked, group_ids, no_signal)
        return Balance(advantages, all_true(advantages.numel()), per_reward, metrics)
