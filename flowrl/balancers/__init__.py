"""Multi-reward balancers: scores of K rewards -> one advantage per sample (docs/math.md#multi-reward-balancing).

Signature (DESIGN.md): `balancer(scores: dict[str, Tensor[M]], group_ids [M], weights: dict[str, float])
-> Balance(advantages [M], keep [M], per_reward [K, M] or None, metrics)`, over the gathered global batch.
NaN means "not applicable": a NaN reward takes no part in that sample's group statistics, and a sample no
reward applies to gets advantage 0. Each balancer is a dataclass whose fields are its YAML keys
(`balancer: {name: gdpo, eps: 1.0e-4}`).

    weighted_sum  sum the rewards, then group-normalise the sum (Flow-GRPO)
    gdpo          group-normalise each reward, weighted sum, batch whitening (arXiv 2601.05242)
    gd2po         gdpo + masks on rollouts whose rewards disagree, group keep-ratio reweighting (arXiv 2606.16771)
    sa_mrpo       gdpo with each weight scaled by (1 − saturation)^γ (arXiv 2608.16072)
    tail          TailRL: the gradient of E_τ[log P(R > τ)] on the weighted sum (docs/math.md#tailrl)

`gdpo`, `gd2po` and `sa_mrpo` take `per_reward_estimator: tail` to use TailRL's advantage per reward in place
of the group z-score. Each balancer's `needs()` names what it asks of the trainer beyond one advantage per sample
(docs/recipes/compose.md): `sample_mask` (drop the samples `keep` masks), `reward_gradients` (each reward's loss
backpropagated on its own), `per_sample_advantages` (a sample's advantage trains its whole rollout, not fused per
tree edge), `affine_loss` (a loss whose gradient is affine in the advantage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from flowrl.advantages import group_advantages, tail_advantages, whiten, zero_std_groups
from flowrl.registry import BALANCERS

PER_REWARD_ESTIMATORS = ("zscore", "tail")


@dataclass
class Balance:
    """What a balancer returns, over the M samples of the gathered batch."""

    advantages: torch.Tensor  # [M] float32; 0 for a sample no reward applies to
    keep: torch.Tensor  # [M] bool: samples the method keeps in the loss (all True without a mask)
    per_reward: torch.Tensor | None  # [K, M] float32 per-reward advantages, rows in the order of `scores`; or None
    metrics: dict[str, float]


def _fail(balancer: str, name: str, value, fix: str) -> None:
    raise ValueError(f"balancer {balancer}: {name}={value!r} {fix}")


def _check_common(cfg, name: str) -> None:
    """Checks shared by the fields several balancers have (eps, whiten_eps, clip, per_reward_estimator)."""
    for key in ("eps", "whiten_eps"):
        if hasattr(cfg, key) and not getattr(cfg, key) >= 0:
            _fail(name, key, getattr(cfg, key), "must be >= 0 (a small positive number such as 1e-4)")
    if hasattr(cfg, "clip") and not cfg.clip > 0:
        _fail(name, "clip", cfg.clip, "must be > 0 (advantages are clipped to [-clip, clip]; 5 in the reference codes)")
    if hasattr(cfg, "per_reward_estimator") and cfg.per_reward_estimator not in PER_REWARD_ESTIMATORS:
        _fail(name, "per_reward_estimator", cfg.per_reward_estimator, "must be 'zscore' (group z-score) or 'tail' (TailRL)")


def _require(scores: dict[str, torch.Tensor]) -> None:
    if not scores:
        raise ValueError("no reward scores to balance: configure at least one reward")


def _stack(scores: dict[str, torch.Tensor]) -> torch.Tensor:
    _require(scores)
    return torch.stack([scores[name].float() for name in scores])  # [K, M]


def weighted_total(scores: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """R_i = Σ_k w_k r_{k,i} over the rewards that apply to sample i; NaN where none does. [M]"""
    _require(scores)
    stacked = torch.stack([scores[name].float() * weights.get(name, 1.0) for name in scores])  # [K, M]
    applicable = torch.isfinite(stacked)
    total = torch.where(applicable, stacked, torch.zeros_like(stacked)).sum(0)  # [M]
    return torch.where(applicable.any(0), total, torch.full_like(total, float("nan")))


def _total_metrics(total: torch.Tensor, group_ids: torch.Tensor) -> dict[str, float]:
    finite = torch.isfinite(total)
    return {
        "reward/total/mean": float(total[finite].mean()) if finite.any() else float("nan"),
        "train/zero_std_fraction": float(zero_std_groups(total, group_ids).float().mean()),
    }


def _all_true(m: int) -> torch.Tensor:
    return torch.ones(m, dtype=torch.bool)


@BALANCERS.register("weighted_sum")
@dataclass
class WeightedSumBalancer:
    """Sum then normalize: R = Σ_k w_k r_k (NaN parts skipped), then group advantages of R (Flow-GRPO)."""

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
                _fail("weighted_sum", "unbiased", self.unbiased, "contradicts use_unbiased_std=True; give only use_unbiased_std")
            self.use_unbiased_std, self.unbiased = bool(self.unbiased), None
        if self.std not in ("global", "group", "none"):
            _fail("weighted_sum", "std", self.std, "must be 'global' (whole-batch std), 'group' (per-prompt std) or 'none'")
        _check_common(self, "weighted_sum")

    def needs(self) -> frozenset[str]:
        return frozenset()

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        total = weighted_total(scores, weights)
        advantages = group_advantages(
            total, group_ids, std=self.std, eps=self.eps, unbiased=self.use_unbiased_std, clip=self.clip
        )
        return Balance(advantages, _all_true(total.numel()), None, _total_metrics(total, group_ids))


def _per_reward_advantages(stacked: torch.Tensor, group_ids: torch.Tensor, estimator: str, eps: float, unbiased: bool):
    """A_{k,i} per reward and group (z-score or TailRL), 0 where r_{k,i} is NaN. stacked [K, M] -> [K, M]."""
    if estimator == "tail":
        return torch.stack([tail_advantages(r, group_ids) for r in stacked])
    return torch.stack([group_advantages(r, group_ids, std="group", eps=eps, unbiased=unbiased, clip=None) for r in stacked])


def _no_signal(stacked: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[M] bool: no reward tells the sample apart from its group (NaN, or no spread in the group, for every reward)."""
    flat = torch.stack([~torch.isfinite(r) | zero_std_groups(r, group_ids) for r in stacked])  # [K, M]
    return flat.all(0)


def _decoupled_metrics(names: list[str], stacked: torch.Tensor, group_ids: torch.Tensor, no_signal) -> dict[str, float]:
    metrics = {"train/zero_std_fraction": float(no_signal.float().mean())}
    for name, r in zip(names, stacked):
        metrics[f"balancer/{name}/zero_std_fraction"] = float((zero_std_groups(r, group_ids) & torch.isfinite(r)).float().mean())
    return metrics


@dataclass
class _Decoupled:
    """The fields and the arithmetic GDPO, GD²PO and SA-MRPO share (not registered)."""

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
        stacked = _stack(scores)
        per_reward = _per_reward_advantages(stacked, group_ids, self.per_reward_estimator, self.eps, self.use_unbiased_std)
        combined = (torch.tensor(weights, dtype=torch.float32)[:, None] * per_reward).sum(0)  # [M]
        return stacked, per_reward, combined, _no_signal(stacked, group_ids), torch.isfinite(stacked).any(0)

    def _finish(self, combined, mask, no_signal) -> torch.Tensor:
        """Whiten over `mask`, zero the samples no reward distinguishes, clip."""
        advantages = whiten(combined, mask, self.whiten_eps, self.use_unbiased_std)
        advantages = torch.where(no_signal, torch.zeros_like(advantages), advantages)
        return advantages.clamp(-self.clip, self.clip)


@BALANCERS.register("gdpo")
@dataclass
class GDPOBalancer(_Decoupled):
    """Normalize then sum: A_i = whiten_batch(Σ_k w_k · z_group(r_k)_i) (GDPO, arXiv 2601.05242).

    A reward with no spread in a group adds 0 there, so a sample that improves every reward is pushed harder
    than one that improves one (summing first gives both the same). `per_reward` holds the unweighted z rows.
    """

    def __post_init__(self):
        _check_common(self, "gdpo")

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        w = [float(weights.get(name, 1.0)) for name in scores]
        stacked, per_reward, combined, no_signal, any_finite = self._decouple(scores, group_ids, w)
        advantages = self._finish(combined, any_finite, no_signal)
        metrics = _decoupled_metrics(list(scores), stacked, group_ids, no_signal)
        return Balance(advantages, _all_true(advantages.numel()), per_reward, metrics)


@BALANCERS.register("gd2po")
@dataclass
class GD2POBalancer(_Decoupled):
    """GDPO with conflict masks (GD²PO, arXiv 2606.16771): rollouts whose per-reward advantages disagree in sign
    are dropped from the loss; each group's sum is scaled by its kept share κ; whitening over kept rollouts."""

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
        _check_common(self, "gd2po")
        if self.mask not in ("hard", "snr"):
            _fail("gd2po", "mask", self.mask, "must be 'hard' (drop every conflict) or 'snr' (drop balanced conflicts)")
        if not 0 < self.snr_threshold <= 1:
            _fail("gd2po", "snr_threshold", self.snr_threshold, "must be in (0, 1] (0.8 in the released scripts)")
        for key in ("sign_eps", "snr_eps"):
            if not getattr(self, key) >= 0:
                _fail("gd2po", key, getattr(self, key), "must be >= 0 (e.g. 1e-8)")

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
        metrics = _decoupled_metrics(list(scores), stacked, group_ids, no_signal)
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


@BALANCERS.register("sa_mrpo")
@dataclass
class SAMRPOBalancer(_Decoupled):
    """GDPO with saturation-aware weights (SA-MRPO, arXiv 2608.16072): w̃_k = w_k · (1 − s_k)^γ, where
    s_k = (batch mean of r_k − min_k) / (max_k − min_k), clamped to [0, 1]. γ = 0 is GDPO exactly."""

    gamma: float = 0.5
    """γ: how strongly a nearly saturated reward is down-weighted (0.5 recommended; 0 gives GDPO)."""
    bounds: dict[str, list[float]] = field(default_factory=dict)
    """{reward name: [min, max]}, the known range of every reward, e.g. {toy_attributes: [0, 1]}."""

    def __post_init__(self):
        _check_common(self, "sa_mrpo")
        if not self.gamma >= 0:
            _fail("sa_mrpo", "gamma", self.gamma, "must be >= 0 (0.5 recommended; 0 gives GDPO)")
        if not isinstance(self.bounds, dict):
            _fail("sa_mrpo", "bounds", self.bounds, "must map each reward name to [min, max]")
        checked = {}
        for name, pair in self.bounds.items():
            try:
                lo, hi = (float(v) for v in pair)
            except (TypeError, ValueError):
                lo = hi = float("nan")
            if not lo < hi:
                _fail("sa_mrpo", f"bounds.{name}", pair, "must be [min, max] with min < max (the reward's known range)")
            checked[name] = [lo, hi]
        self.bounds = checked

    def saturation(self, scores: dict[str, torch.Tensor]) -> dict[str, float]:
        """s_k per reward from the batch mean of its finite scores (0 where it applies to no sample)."""
        out = {}
        for name, s in scores.items():
            if name not in self.bounds:
                _fail("sa_mrpo", "bounds", self.bounds, f"has no entry for reward {name!r}: add bounds: {{{name}: [min, max]}}")
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
        metrics = _decoupled_metrics(list(scores), stacked, group_ids, no_signal)
        for name, wk in zip(scores, w):
            metrics[f"balancer/{name}/saturation"] = saturation[name]
            metrics[f"balancer/{name}/weight"] = wk
        return Balance(advantages, _all_true(advantages.numel()), per_reward, metrics)


@BALANCERS.register("tail")
@dataclass
class TailBalancer:
    """TailRL on the weighted sum R = Σ_k w_k r_k: A_i = Σ_{j: R_j < R_i} 1 / #{l: R_l > R_j} − the group mean
    of that sum, the score-function weight of E_τ[log P(R > τ)] with τ drawn from the group's own rewards
    (docs/math.md#tailrl). Rank-based, so the reward scale does not matter; rare high rewards weigh most."""

    clip: float = 5.0
    """Advantages are clipped to [−clip, clip] (the top of a group of n gets about ln n − 1)."""

    def __post_init__(self):
        _check_common(self, "tail")

    def needs(self) -> frozenset[str]:
        return frozenset()

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        total = weighted_total(scores, weights)
        advantages = tail_advantages(total, group_ids).clamp(-self.clip, self.clip)
        return Balance(advantages, _all_true(total.numel()), None, _total_metrics(total, group_ids))


MARBLE_FORMS = ("full", "amortized")


@BALANCERS.register("marble")
@dataclass
class MarbleBalancer:
    """MARBLE (arXiv 2605.06507): one advantage row per reward, A_k = z-score of r_k per prompt group; the trainer
    balances the K per-reward gradients (flowrl/balancers/marble.py), so `advantages` here is only Σ_k ᾱ_k A_k with the α the
    trainer holds (uniform until it learns one). Weights do not act: each gradient is normalized before the QP."""

    recipe_variants: ClassVar[dict[str, dict]] = {"full": {"form": "full"}, "amortized": {"form": "amortized"}}

    form: str = "amortized"
    """'full': K backward passes per optimizer step, α from the min-norm QP every step; 'amortized' (NFT only): α
    refreshed every `refresh_every` optimizer steps, EMA-smoothed, one backward on Σ ᾱ_k A_k in between."""
    std: str = "group"
    """'group' (per-prompt std, MARBLE's tracker) or 'global' (the batch std of each reward)."""
    eps: float = 1e-4
    """Added to each reward's std."""
    use_unbiased_std: bool = False
    """Divide the variance by n − 1 instead of n."""
    refresh_every: int = 10
    """N of the amortized form: the full QP every N optimizer steps (10 in the paper; 20 degrades)."""
    alpha_ema: float = 0.7
    """ρ of ᾱ_t = ρ·ᾱ_{t−1} + (1 − ρ)·α*_t (0.7 best of {0.1, 0.3, 0.5, 0.7, 0.9})."""

    def __post_init__(self):
        if self.form not in MARBLE_FORMS:
            _fail("marble", "form", self.form, "must be 'full' (QP every step) or 'amortized' (QP every refresh_every steps)")
        if self.std not in ("global", "group"):
            _fail("marble", "std", self.std, "must be 'group' (per-prompt std) or 'global' (batch std)")
        _check_common(self, "marble")
        if not (isinstance(self.refresh_every, int) and self.refresh_every >= 1):
            _fail("marble", "refresh_every", self.refresh_every, "must be an integer >= 1 (10 in the paper)")
        if not 0 <= self.alpha_ema < 1:
            _fail("marble", "alpha_ema", self.alpha_ema, "must be in [0, 1) (0.7 in the paper)")
        self.alpha: torch.Tensor | None = None  # ᾱ [K], set by the trainer's gradient balancing

    def needs(self) -> frozenset[str]:
        """The trainer balances the per-reward gradients of per-sample advantages; the amortized form's one backward
        on Σ ᾱ_k A_k stands for Σ ᾱ_k ∇ℓ(A_k) only where the loss's gradient is affine in the advantage."""
        base = {"reward_gradients", "per_sample_advantages"}
        return frozenset(base | ({"affine_loss"} if self.form == "amortized" else set()))

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        stacked = _stack(scores)
        per_reward = torch.stack(
            [
                group_advantages(r, group_ids, std=self.std, eps=self.eps, unbiased=self.use_unbiased_std, clip=None)
                for r in stacked
            ]
        )
        k = per_reward.shape[0]
        alpha = self.alpha if self.alpha is not None else torch.full((k,), 1.0 / k)
        advantages = (alpha.float()[:, None] * per_reward).sum(0)
        no_signal = _no_signal(stacked, group_ids)
        metrics = _decoupled_metrics(list(scores), stacked, group_ids, no_signal)
        return Balance(advantages, _all_true(advantages.numel()), per_reward, metrics)
