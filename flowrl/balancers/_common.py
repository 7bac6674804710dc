"""What several balancers share: their argument checks, the weighted sum of the rewards, the per-reward group
advantages and metrics, and the fields and arithmetic of the decoupled family (GDPO, GD²PO, SA-MRPO). Not a registry
entry (its name starts with `_`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.advantages import group_advantages, tail_advantages, whiten, zero_std_groups

PER_REWARD_ESTIMATORS = ("zscore", "tail")


def fail(balancer: str, name: str, value, fix: str) -> None:
    raise ValueError(f"balancer {balancer}: {name}={value!r} {fix}")


def check_common(cfg, name: str) -> None:
    """Checks shared by the fields several balancers have (eps, whiten_eps, clip, per_reward_estimator)."""
    for key in ("eps", "whiten_eps"):
        if hasattr(cfg, key) and not getattr(cfg, key) >= 0:
            fail(name, key, getattr(cfg, key), "must be >= 0 (a small positive number such as 1e-4)")
    if hasattr(cfg, "clip") and not cfg.clip > 0:
        fail(name, "clip", cfg.clip, "must be > 0 (advantages are clipped to [-clip, clip]; 5 in the reference codes)")
    if hasattr(cfg, "per_reward_estimator") and cfg.per_reward_estimator not in PER_REWARD_ESTIMATORS:
        fail(
            name,
            "per_reward_estimator",
            cfg.per_reward_estimator,
            "must be 'zscore' (group z-score) or 'tail' (TailRL)",
        )


def _require(scores: dict[str, torch.Tensor]) -> None:
    if not scores:
        raise ValueError("no reward scores to balance: configure at least one reward")


def stack(scores: dict[str, torch.Tensor]) -> torch.Tensor:
    _require(scores)
    return torch.stack([scores[name].float() for name in scores])  # [K, M]


def weighted_total(scores: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """R_i = Σ_k w_k r_{k,i} over the rewards that apply to sample i; NaN where none does. [M]"""
    _require(scores)
    stacked = torch.stack([scores[name].float() * weights.get(name, 1.0) for name in scores])  # [K, M]
    applicable = torch.isfinite(stacked)
    total = torch.where(applicable, stacked, torch.zeros_like(stacked)).sum(0)  # [M]
    return torch.where(applicable.any(0), total, torch.full_like(total, float("nan")))


def total_metrics(total: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    finite = torch.isfinite(total)
    return {
        "reward/total/mean": float(total[finite].mean()) if finite.any() else float("nan"),
        "train/zero_std_fraction": float(zero_std_groups(total, group_ids).float().mean()),
    }


def all_true(m: int) -> torch.Tensor:
    return torch.ones(m, dtype=torch.bool)


def per_reward_advantages(stacked: torch.Tensor, group_ids: torch.Tensor, estimator: str, eps: float, unbiased: bool):
    """A_{k,i} per reward and group (z-score or TailRL), 0 where r_{k,i} is NaN. stacked [K, M] -> [K, M]."""
    if estimator == "tail":
        return torch.stack([tail_advantages(r, group_ids) for r in stacked])
    return torch.stack(
        [group_advantages(r, group_ids, std="group", eps=eps, unbiased=unbiased, clip=None) for r in stacked]
    )


def no_signal(stacked: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[M] bool: no reward tells the sample apart from its group (NaN, or no spread in the group, for every reward)."""
    flat = torch.stack([~torch.isfinite(r) | zero_std_groups(r, group_ids) for r in stacked])  # [K, M]
    return flat.all(0)


def decoupled_metrics(names: list[str], stacked: torch.Tensor, group_ids: torch.Tensor, no_signal) -> dict[str, float]:
    metrics = {"train/zero_std_fraction": float(no_signal.float().mean())}
    for name, r in zip(names, stacked):
        metrics[f"balancer/{name}/zero_std_fraction"] = float(
            (zero_std_groups(r, group_ids) & torch.isfinite(r)).float().mean()
        )
    return metrics


@dataclass
class Decoupled:
    """The fields and the arithmetic GDPO, GD²PO and SA-MRPO share (not registered)."""

    recipe_variants: ClassVar[dict[str, dict]] = {"": {}}

    eps: float = 1e-4
    """Added to each reward's group std (GDPO's TRL code: 1e-4; verl, GD²PO: 1e-6)."""
    use_unbiased_std: bool = True
    """Group and batch stds divide by n − 1 (torch.std, as the GDPO / GD²PO codes do) instead of n."""
    whiten_eps: float = 1e-4
    """Added to the batch std of the batch whitening."""
    clip: float = 5.0
    """Final advantages are clipped to [−clip, clip]."""
    per_reward_estimator: str = "zscore"
    """Per-reward advantage: 'zscore' (the group z-score of each reward) or 'tail' (TailRL's per reward)."""

    def needs(self) -> frozenset[str]:
        return frozenset()

    def _decouple(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: list[float]):
        """(stacked [K, M], per-reward advantages [K, M], Σ_k w_k A_k [M], no_signal [M], any_finite [M])."""
        stacked = stack(scores)
        per_reward = per_reward_advantages(
            stacked, group_ids, self.per_reward_estimator, self.eps, self.use_unbiased_std
        )
        combined = (torch.tensor(weights, dtype=torch.float32)[:, None] * per_reward).sum(0)  # [M]
        return stacked, per_reward, combined, no_signal(stacked, group_ids), torch.isfinite(stacked).any(0)

    def _finish(self, combined, mask, no_signal) -> torch.Tensor:
        """Whiten over `mask`, zero the samples no reward distinguishes, clip."""
        advantages = whiten(combined, mask, self.whiten_eps, self.use_unbiased_std)
        advantages = torch.where(no_signal, torch.zeros_like(advantages), advantages)
        return advantages.clamp(-self.clip, self.clip)
