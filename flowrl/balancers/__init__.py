"""Multi-reward balancers: scores of K rewards -> one advantage per sample (docs/math.md#multi-reward-balancing).

Signature (flowrl.types.Balancer): `balancer(scores: dict[str, Tensor[M]], group_ids [M], weights: dict[str, float])
-> Balance(advantages [M], keep [M], per_reward [K, M] or None, metrics)`, over the gathered global batch.
NaN means "not applicable": a NaN reward takes no part in that sample's group statistics, and a sample no
reward applies to gets advantage 0. Each balancer is a dataclass whose fields are its YAML keys
(`balancer: {name: gdpo, eps: 1.0e-4}`).

    weighted_sum  sum the rewards, then group-normalise the sum (Flow-GRPO)
    gdpo          group-normalise each reward, weighted sum, batch whitening (arXiv 2601.05242)
    gd2po         gdpo + masks on rollouts whose rewards disagree, group keep-ratio reweighting (arXiv 2606.16771)
    sa_mrpo       gdpo with each weight scaled by (1 − saturation)^γ (arXiv 2608.16072)
    tail          TailRL: the gradient of E_τ[log P(R > τ)] on the weighted sum
                  (docs/math.md#tailrl-the-log-probability-of-clearing-a-random-bar-tail)
    marble        one advantage row per reward; the recipe balances the per-reward gradients (arXiv 2605.06507)

One file per balancer, its registry key the file stem; what several share is in _common.py. `Balance` and the
`Balancer` protocol are data contracts (flowrl/types.py).

`gdpo`, `gd2po` and `sa_mrpo` take `per_reward_estimator: tail` to use TailRL's advantage per reward in place
of the group z-score. Each balancer's `needs()` names what it asks of the trainer beyond one advantage per sample
(docs/recipes/compose.md): `sample_mask` (drop the samples `keep` masks), `reward_gradients` (each reward's loss
backpropagated on its own), `per_sample_advantages` (a sample's advantage trains its whole rollout, not fused per
tree edge), `affine_loss` (a loss whose gradient is affine in the advantage).
"""

from __future__ import annotations

from flowrl.balancers._common import PER_REWARD_ESTIMATORS, weighted_total
from flowrl.balancers.gd2po import GD2POBalancer
from flowrl.balancers.gdpo import GDPOBalancer
from flowrl.balancers.marble import MARBLE_FORMS, MarbleBalancer
from flowrl.balancers.sa_mrpo import SAMRPOBalancer
from flowrl.balancers.tail import TailBalancer
from flowrl.balancers.weighted_sum import WeightedSumBalancer
from flowrl.types import Balance

__all__ = [
    "MARBLE_FORMS",
    "PER_REWARD_ESTIMATORS",
    "Balance",
    "GD2POBalancer",
    "GDPOBalancer",
    "MarbleBalancer",
    "SAMRPOBalancer",
    "TailBalancer",
    "WeightedSumBalancer",
    "weighted_total",
]
