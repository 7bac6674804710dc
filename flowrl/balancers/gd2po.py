"""gd2po: GDPO with masks on rollouts whose rewards disagree and group keep-ratio reweighting (GD²PO, arXiv
2606.16771)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.balancers._common import Decoupled, check_common, decoupled_metrics, fail
from flowrl.registry import BALANCERS
from flowrl.types import Balance


@BALANCERS.register("gd2po")
@dataclass
class GD2POBalancer(Decoupled):
    """GDPO with conflict masks (GD²PO, arXiv 2606.16771): rollouts whose per-reward advantages disagree in sign
    are dropped from the loss; each group's sum is scaled by its kept share κ; whitening over kept rollouts."""

    combines_rewards_linearly: ClassVar[bool] = False  # each reward normalised and masked before the sum

    eps: float = 1e-6
    """Added to each reward's group std (GD²PO runs on verl's GRPO helper: 1e-6)."""
    mask: str = "snr"
    """'hard': drop every conflicting rollout; 'snr': drop only conflicts with |agreement ratio| < snr_threshold."""
    snr_threshold: float = 0.8
    """τ of the 'snr' mask (0.8 in the released GD²PO scripts; the code's default argument is 0.2)."""
    sign_eps: float = 1e-8
    """A per-reward advantage counts as positive above sign_eps, negative below −sign_eps."""
    snr_eps: float = 1e-6
    """ε' in the agreement ratio Σ_k a_k / (Σ_k |a_k| + ε')."""
    use_group_keep_ratio: bool = True
    """Scale each group's advantages by κ = kept / group size before whitening (the reference always does)."""

    def __post_init__(self):
        check_common(self, "gd2po")
        if self.mask not in ("hard", "snr"):
            fail("gd2po", "mask", self.mask, "must be 'hard' (drop every conflict) or 'snr' (drop balanced conflicts)")
        if not 0 < self.snr_threshold <= 1:
            fail("gd2po", "snr_threshold", self.snr_threshold, "must be in (0, 1] (0.8 in the released scripts)")
        for key in ("sign_eps", "snr_eps"):
            if not getattr(self, key) >= 0:
                fail("gd2po", key, getattr(self, key), "must be >= 0 (e.g. 1e-8)")

    def needs(self) -> frozenset[str]:
        return frozenset({"sample_mask"})  # conflicting rollouts are masked out of the loss

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        w = [float(weights.get(name, 1.0)) for name in scores]
        stacked, per_reward, combined, no_signal, any_finite = self._decouple(scores, group_ids, w)
        conflict = (per_reward > self.sign_eps).any(0) & (per_reward < -self.sign_eps).any(0)  # [M]
        agreement = per_reward.sum(0) / (per_reward.abs().sum(0) + self.snr_eps)  # s_i in [−1, 1]
        masked = conflict if self.mask == "hard" else conflict & (agreement.abs() < self.snr_threshold)
        keep = ~masked
        kept_share = torch.ones_like(combined)
        if self.use_group_keep_ratio:  # κ over the samples some reward applies to
            _, inverse = torch.unique(group_ids, return_inverse=True)
            size = torch.zeros(int(inverse.max()) + 1).index_add_(0, inverse, any_finite.float())
            kept = torch.zeros_like(size).index_add_(0, inverse, (keep & any_finite).float())
            kept_share = (kept / size.clamp(min=1))[inverse]
        combined = torch.where(keep, kept_share * combined, torch.zeros_like(combined))
        advantages = self._finish(combined, keep & any_finite, no_signal)
        metrics = decoupled_metrics(list(scores), stacked, group_ids, no_signal)
        real = any_finite.float().sum().clamp(min=1)
        metrics.update(
            {
                "balancer/conflict_fraction": float((conflict & any_finite).float().sum() / real),
                "balancer/masked_fraction": float((masked & any_finite).float().sum() / real),
                "balancer/group_keep_ratio/mean": float(kept_share[any_finite].mean()) if any_finite.any() else 1.0,
                "balancer/group_keep_ratio/min": float(kept_share[any_finite].min()) if any_finite.any() else 1.0,
            }
        )
        return Balance(advantages, keep, per_reward, metrics)
