"""marble: MARBLE (arXiv 2605.06507), multi-reward gradient balancing
(docs/math.md#marble-balance-the-per-reward-gradients-marble).

The balancer (`MarbleBalancer`: per-reward advantages) and its pure math; the gradient plumbing a recipe calls with a
loss closure is flowrl/training/reward_gradients.py (MARBLE needs per-reward losses from stage 6, so it is a balancer
that the trainer calls with a loss closure).

    alpha = min_norm_weights(gram)                  # argmin_{α ∈ simplex} αᵀ M α, exact (active-set enumeration)
    out = harmonize(grads)                          # grads [K, P] -> α, d_final = n̄ · Σ α_k ĝ_k, cosines
    alpha_bar = ema_alpha(alpha_bar, alpha, 0.7)    # amortized form's smoothing
    clamp_active(per_reward, alpha_bar, a_max)      # where Σ α_k ∇ℓ(A_k) = ∇ℓ(Σ α_k A_k) stops holding

The solver: the minimum of a convex quadratic over the simplex lies in the relative interior of some face S
(the coordinates it keeps > 0); with S of minimal size the equality-constrained problem on S (KKT:
[M_S 1; 1ᵀ 0][α; λ] = [0; 1]) has that point as its unique solution. So solving the KKT system on every one
of the 2^K − 1 faces, keeping the feasible solutions (α ≥ 0), and taking the smallest objective finds the exact
minimum. Ties (parallel gradients: a whole segment is optimal) go to the largest face, so identical gradients
share α equally. K ≤ 12 (4095 solves of at most 13 unknowns, in float64).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl.advantages import group_advantages
from flowrl.balancers._common import all_true, check_common, decoupled_metrics, fail, no_signal, stack
from flowrl.registry import BALANCERS
from flowrl.types import Balance

MAX_REWARDS = 12
PARETO_STATIONARY = 1e-9  # ||d*|| of unit gradients at or below this: the batch is Pareto-stationary, no update
_FEASIBLE = -1e-10  # a face's solution counts as inside the simplex above this (float64 round-off)


def min_norm_weights(gram: torch.Tensor) -> torch.Tensor:
    """α* = argmin_{α ≥ 0, Σα = 1} αᵀ M α for a K×K positive semi-definite Gram matrix M. Returns [K] float64."""
    m = gram.double()
    k = m.shape[0]
    if m.shape != (k, k) or k < 1:
        raise ValueError(f"min_norm_weights: gram has shape {tuple(gram.shape)}; it must be a square K x K matrix")
    if k > MAX_REWARDS:
        raise ValueError(
            f"min_norm_weights: K={k} rewards; the exact solver enumerates faces and takes K <= {MAX_REWARDS}"
        )
    m = 0.5 * (m + m.T)
    scale = float(m.diagonal().abs().max()) or 1.0
    best, best_value, best_size = None, math.inf, 0
    for size in range(1, k + 1):
        for face in itertools.combinations(range(k), size):
            idx = torch.tensor(face)
            kkt = torch.zeros(size + 1, size + 1, dtype=torch.float64)
            kkt[:size, :size] = m[idx][:, idx]
            kkt[:size, size] = kkt[size, :size] = 1.0
            rhs = torch.zeros(size + 1, dtype=torch.float64)
            rhs[size] = 1.0
            solution = torch.linalg.lstsq(kkt, rhs[:, None], driver="gelsd").solution[:, 0]
            if float((kkt @ solution - rhs).abs().max()) > 1e-9 * max(scale, 1.0):
                continue  # inconsistent system: no stationary point on this face's affine hull
            alpha = torch.zeros(k, dtype=torch.float64)
            alpha[idx] = solution[:size]
            if float(alpha.min()) < _FEASIBLE:
                continue
            alpha = alpha.clamp(min=0)
            alpha = alpha / alpha.sum()
            value = float(alpha @ m @ alpha)
            if value < best_value - 1e-12 * scale or (value <= best_value + 1e-12 * scale and size > best_size):
                best, best_value, best_size = alpha, min(value, best_value), size
    return best


def ema_alpha(previous: torch.Tensor, fresh: torch.Tensor, rho: float = 0.7) -> torch.Tensor:
    """ᾱ_t = ρ·ᾱ_{t−1} + (1 − ρ)·α*_t: a convex combination of two simplex points stays on the simplex."""
    return rho * previous + (1.0 - rho) * fresh


@dataclass
class Harmonized:
    """One full MARBLE combination of K gradients over P parameters."""

    alpha: torch.Tensor  # [K] float64 on the simplex
    direction: torch.Tensor  # [P] d_final = n̄ · Σ_k α_k ĝ_k (zero if the batch is Pareto-stationary)
    norms: torch.Tensor  # [K] ||g_k||
    cosines: torch.Tensor  # [K] cos(g_k, d_final); 0 where either is zero


def cosines(grads: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """cos(g_k, u) per row of grads [K, P] against u [P]; 0 where either vector is zero."""
    g, u = grads.double(), update.double()
    denominator = g.norm(dim=1) * u.norm()
    return torch.where(denominator > 0, (g @ u) / denominator.clamp(min=1e-300), torch.zeros_like(denominator))


def harmonize(grads: torch.Tensor) -> Harmonized:
    """MARBLE's full form (§5.3): ĝ_k = g_k / ||g_k||, α* the min-norm point of their convex hull, d* = Σ α*_k ĝ_k,
    d_final = d* · n̄ with n̄ = (1/K) Σ_k ||g_k||; ||d*|| ≤ 1e-9 (Pareto-stationary) gives d = 0. A zero gradient
    (a reward with no signal in the batch: all its advantages 0) takes no part: α_k = 0 and the others are
    balanced; all zero gives uniform α and d = 0."""
    g = grads.double()
    k = g.shape[0]
    norms = g.norm(dim=1)
    live = norms > 0
    alpha = torch.full((k,), 1.0 / k, dtype=torch.float64)
    direction = torch.zeros(g.shape[1], dtype=torch.float64)
    if bool(live.any()):
        unit = g[live] / norms[live, None]
        alpha = torch.zeros(k, dtype=torch.float64)
        alpha[live] = min_norm_weights(unit @ unit.T)
        d_star = (alpha[live, None] * unit).sum(0)
        if float(d_star.norm()) > PARETO_STATIONARY:
            direction = d_star * norms.mean()
    return Harmonized(alpha, direction.to(grads.dtype), norms, cosines(g, direction))


def combine(grads: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The exact combination Σ_k α_k g_k of the unnormalized gradients (the amortized form's fallback). [P]"""
    return (alpha.to(grads.dtype)[:, None] * grads).sum(0)


def clamp_active(per_reward: torch.Tensor, alpha: torch.Tensor, adv_clip_max: float | None) -> bool:
    """Whether some |A_k| or |Σ_k α_k A_k| reaches A_max: then r = clamp(1/2 + A/(2·A_max), 0, 1) is not affine in A
    there and the single backward on Σ α_k A_k is not the combination of the per-reward gradients. per_reward [K, M].
    A loss without a clamp (adv_clip_max None, e.g. the ELBO policy gradient's) never is."""
    if adv_clip_max is None:
        return False
    combined = (alpha.to(per_reward.dtype)[:, None] * per_reward).sum(0)
    return bool((per_reward.abs() >= adv_clip_max).any() or (combined.abs() >= adv_clip_max).any())


MARBLE_FORMS = ("full", "amortized")


@BALANCERS.register("marble")
@dataclass
class MarbleBalancer:
    """MARBLE (arXiv 2605.06507): one advantage row per reward, A_k = z-score of r_k per prompt group; the trainer
    balances the K per-reward gradients (`needs()` holds "reward_gradients": flowrl/training/reward_gradients.py with
    the math above), so `advantages` here is only Σ_k ᾱ_k A_k with the α the trainer holds (uniform until it learns
    one). Weights do not act: each gradient is normalized before the QP."""

    combines_rewards_linearly: ClassVar[bool] = False  # each reward's gradient balanced on its own

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
            fail(
                "marble",
                "form",
                self.form,
                "must be 'full' (QP every step) or 'amortized' (QP every refresh_every steps)",
            )
        if self.std not in ("global", "group"):
            fail("marble", "std", self.std, "must be 'group' (per-prompt std) or 'global' (batch std)")
        check_common(self, "marble")
        if not (isinstance(self.refresh_every, int) and self.refresh_every >= 1):
            fail("marble", "refresh_every", self.refresh_every, "must be an integer >= 1 (10 in the paper)")
        if not 0 <= self.alpha_ema < 1:
            fail("marble", "alpha_ema", self.alpha_ema, "must be in [0, 1) (0.7 in the paper)")
        self.alpha: torch.Tensor | None = None  # ᾱ [K], set by the trainer's gradient balancing

    def needs(self) -> frozenset[str]:
        """The trainer balances the per-reward gradients of per-sample advantages; the amortized form's one backward
        on Σ ᾱ_k A_k stands for Σ ᾱ_k ∇ℓ(A_k) only where the loss's gradient is affine in the advantage."""
        base = {"reward_gradients", "per_sample_advantages"}
        return frozenset(base | ({"affine_loss"} if self.form == "amortized" else set()))

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        stacked = stack(scores)
        per_reward = torch.stack(
            [
                group_advantages(r, group_ids, std=self.std, eps=self.eps, unbiased=self.use_unbiased_std, clip=None)
                for r in stacked
            ]
        )
        k = per_reward.shape[0]
        alpha = self.alpha if self.alpha is not None else torch.full((k,), 1.0 / k)
        advantages = (alpha.float()[:, None] * per_reward).sum(0)
        metrics = decoupled_metrics(list(scores), stacked, group_ids, no_signal(stacked, group_ids))
        return Balance(advantages, all_true(advantages.numel()), per_reward, metrics)
