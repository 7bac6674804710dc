"""sa_mrpo: GDPO with each reward's weight scaled by (1 − saturation)^γ (SA-MRPO, arXiv 2608.16072)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from flowrl.balancers._common import Decoupled, all_true, check_common, decoupled_metrics, fail
from flowrl.registry import BALANCERS
from flowrl.types import Balance


@BALANCERS.register("sa_mrpo")
@dataclass
class SAMRPOBalancer(Decoupled):
    """GDPO with saturation-aware weights (SA-MRPO, arXiv 2608.16072): w̃_k = w_k · (1 − s_k)^γ, where
    s_k = (batch mean of r_k − min_k) / (max_k − min_k), clamped to [0, 1]. γ = 0 is GDPO exactly."""

    combines_rewards_linearly: ClassVar[bool] = False  # each reward normalised and scaled before the sum

    gamma: float = 0.5
    """γ: how strongly a nearly saturated reward is down-weighted (0.5 recommended; 0 gives GDPO)."""
    bounds: dict[str, list[float]] = field(default_factory=dict)
    """{reward name: [min, max]}, the known range of every reward, e.g. {toy_attributes: [0, 1]}."""

    def __post_init__(self):
        check_common(self, "sa_mrpo")
        if not self.gamma >= 0:
            fail("sa_mrpo", "gamma", self.gamma, "must be >= 0 (0.5 recommended; 0 gives GDPO)")
        if not isinstance(self.bounds, dict):
            fail("sa_mrpo", "bounds", self.bounds, "must map each reward name to [min, max]")
        checked = {}
        for name, pair in self.bounds.items():
            try:
                lo, hi = (float(v) for v in pair)
            except (TypeError, ValueError):
                lo = hi = float("nan")
            if not lo < hi:
                fail("sa_mrpo", f"bounds.{name}", pair, "must be [min, max] with min < max (the reward's known range)")
            checked[name] = [lo, hi]
        self.bounds = checked

    def saturation(self, scores: dict[str, torch.Tensor]) -> dict[str, float]:
        """s_k per reward from the batch mean of its finite scores (0 where it applies to no sample)."""
        out = {}
        for name, s in scores.items():
            if name not in self.bounds:
                fail(
                    "sa_mrpo",
                    "bounds",
                    self.bounds,
                    f"has no entry for reward {name!r}: add bounds: {{{name}: [min, max]}}",
                )
            lo, hi = self.bounds[name]
            finite = s[torch.isfinite(s)].float()
            mean = float(finite.mean()) if finite.numel() else lo
            out[name] = min(max((mean - lo) / (hi - lo), 0.0), 1.0)
        return out

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        saturation = self.saturation(scores)
        w = [float(weights.get(name, 1.0)) * (1.0 - saturation[name]) ** self.gamma for name in scores]
        stacked, per_reward, combined, no_signal, any_finite = self._decouple(scores, group_ids, w)
        advantages = self._finish(combined, any_finite, no_signal)
        metrics = decoupled_metrics(list(scores), stacked, group_ids, no_signal)
        for name, wk in zip(scores, w):
            metrics[f"balancer/{name}/saturation"] = saturation[name]
            metrics[f"balancer/{name}/weight"] = wk
        return Balance(advantages, all_true(advantages.numel()), per_reward, metrics)
