"""MARBLE (arXiv 2605.06507): multi-reward gradient balancing (docs/math.md#marble-balance-the-per-reward-gradients-marble).

Pure math first, then the gradient plumbing a recipe calls with a loss closure (DESIGN.md: "MARBLE needs
per-reward losses from stage 6, so it is a balancer that the trainer calls with a loss closure").

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

import torch

from flowrl.runs import timed

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
        raise ValueError(f"min_norm_weights: K={k} rewards; the exact solver enumerates faces and takes K <= {MAX_REWARDS}")
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


def clamp_active(per_reward: torch.Tensor, alpha: torch.Tensor, adv_clip_max: float) -> bool:
    """Whether some |A_k| or |Σ_k α_k A_k| reaches A_max: then r = clamp(1/2 + A/(2·A_max), 0, 1) is not affine in A
    there and the single backward on Σ α_k A_k is not the combination of the per-reward gradients. per_reward [K, M]."""
    combined = (alpha.to(per_reward.dtype)[:, None] * per_reward).sum(0)
    return bool((per_reward.abs() >= adv_clip_max).any() or (combined.abs() >= adv_clip_max).any())


# --------------------------------------------------------------------------------------------- the recipe's component

SINGLE, PROBE, EXACT, FULL = "single", "probe", "exact", "full"


class RewardGradients:
    """Per-reward gradients for a recipe's stage 6, and MARBLE's combination of them (docs/recipes/marble.md).

    Per optimizer step (a window of accumulated backward calls) the recipe calls `plan(window_rows)` first, then for
    every backward either its usual `opt.backward(loss)` (`single`) or `backward(loss_of, per_reward, kl_loss)`,
    and `finish()` before `opt.step`. The window's mode:

        full    K backward passes into per-reward gradients g_k (all-reduced over processes), α* of the min-norm QP,
                .grad = n̄ · Σ α*_k ĝ_k (+ the KL's own backward, outside the balancing)
        exact   the amortized form's fallback where a clamp is active: .grad = Σ ᾱ_k g_k (K backward passes)
        single  one backward on the recipe's loss at Σ ᾱ_k A_k (amortized steps between refreshes)
        probe   single, plus the K per-reward gradients only to log their cosine with the update (any balancer)

    `marble` is the MarbleBalancer (None: only probe, when `probe` is set). α lives here and is written back to the
    balancer, whose advantages are then Σ ᾱ_k A_k. Every process computes the same α: the QP is solved on the
    all-reduced gradients. Needs data parallel (FSDP2 / ZeRO-2 own the gradients inside backward).
    """

    def __init__(self, marble, opt, accelerator, names: list[str], affine: bool, adv_clip_max: float | None, probe: bool):
        if marble is not None and marble.form == "amortized" and not affine:
            raise ValueError(
                "balancer marble: form='amortized' needs a loss affine in the advantage (the NFT recipe); this recipe's "
                "clipped ratio loss is not affine in the advantage, so Σ α_k ∇ℓ(A_k) ≠ ∇ℓ(Σ α_k A_k): set balancer.form=full"
            )
        if opt.sharding.kind is not None and (marble is not None or probe):
            raise ValueError(
                f"balancer marble / per-reward gradients need data parallel, not {opt.sharding.kind}: the per-reward "
                "gradients are taken outside the sharded backward; launch with multi_gpu.yaml"
            )
        self.marble, self.opt, self.acc, self.names = marble, opt, accelerator, list(names)
        self.adv_clip_max, self.probe = adv_clip_max, probe
        k = len(self.names)
        self.alpha = torch.full((k,), 1.0 / k, dtype=torch.float64)
        self.windows = 0  # optimizer windows planned so far (the refresh clock)
        self.counters = {"fallbacks": 0, "refreshes": 0}
        self.mode = SINGLE
        self._grads: torch.Tensor | None = None
        self._log: dict[str, list[float]] = {}
        self.seconds = 0.0  # time in probe-only work (not part of the algorithm), for benches to take out
        self._publish()

    # ---------------------------------------------------------------------------------- per window
    def plan(self, per_reward: torch.Tensor) -> str:
        """The coming optimizer window's mode; per_reward [K, b] are the advantages of the samples it trains."""
        if self.marble is None:
            self.mode = PROBE if self.probe else SINGLE
        elif self.marble.form == "full" or self.windows % self.marble.refresh_every == 0:
            self.mode = FULL
        else:
            clamped = float(clamp_active(per_reward.cpu(), self.alpha, self.adv_clip_max))
            if self.acc.num_processes > 1:  # every process must take the same path (the all-reduce below)
                clamped = float(self.acc.reduce(torch.tensor([clamped], device=self.acc.device), reduction="sum"))
            self.mode = EXACT if clamped > 0 else (PROBE if self.probe else SINGLE)
        self.windows += 1
        self._grads = None
        return self.mode

    @property
    def single(self) -> bool:
        """Whether the recipe runs its own backward this window (single and probe)."""
        return self.mode in (SINGLE, PROBE)

    def advantages(self, advantages: torch.Tensor, per_reward: torch.Tensor) -> torch.Tensor:
        """The advantage a single backward trains on [b]: MARBLE's Σ_k ᾱ_k A_k (per_reward [K, b]), else the
        balancer's `advantages` [b] unchanged."""
        if self.marble is None:
            return advantages
        return (self.alpha.to(per_reward)[:, None] * per_reward).sum(0)

    def backward(self, loss_of, per_reward: torch.Tensor, kl_loss: torch.Tensor | None = None, boundary: bool = False):
        """Per reward k, ∇θ loss_of(A_k) accumulated into g_k (one shared forward graph; `loss_of` maps advantages
        [b] to this backward's scalar policy loss); then the KL's own backward (`kl_loss`, None = no KL term)."""
        tic = timed(self.acc.device)
        scale = self.opt.scaler.scale if self.opt.scaler.enabled else 1.0
        params = self.opt.params
        if self._grads is None:
            self._grads = torch.zeros(len(self.names), sum(p.numel() for p in params), device=params[0].device)
        for k, row in enumerate(per_reward):
            loss = loss_of(row) * scale
            grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
            self._grads[k] += torch.cat(
                [(g if g is not None else torch.zeros_like(p)).flatten().float() for g, p in zip(grads, params)]
            )
        if self.mode == PROBE:
            self.seconds += tic.seconds()
        if kl_loss is not None and not self.single:
            self.opt.backward(kl_loss, boundary)

    def finish(self) -> None:
        """Before `opt.step`: reduce g_k over processes, combine them into .grad (full, exact) and log the cosines."""
        if self._grads is None:
            return
        tic = timed(self.acc.device)
        grads = self._grads
        if self.acc.num_processes > 1:
            grads = self.acc.reduce(grads, reduction="mean")
        existing = self._flat_grad()  # the KL's (full, exact) or the recipe's whole update (probe)
        if self.mode == FULL:
            out = harmonize(grads)
            self._record_alpha(out.alpha)
            update = out.direction.to(grads.dtype)
        elif self.mode == EXACT:
            self.counters["fallbacks"] += 1
            update = combine(grads, self.alpha)
        else:
            update = torch.zeros_like(existing)
        if self.mode in (FULL, EXACT):
            self._add_to_grad(update)
        cos = cosines(grads, update + existing)
        for name, c in zip(self.names, cos.tolist()):
            self._log.setdefault(f"marble/cos/{name}", []).append(c)
        self._log.setdefault("marble/negative_cos_fraction", []).append(float((cos < 0).double().mean()))
        self._log.setdefault("marble/opposed", []).append(float(bool((cos < 0).any())))
        self._grads = None
        if self.mode == PROBE:
            self.seconds += tic.seconds()

    # ---------------------------------------------------------------------------------- state and logs
    def _record_alpha(self, fresh: torch.Tensor) -> None:
        if self.marble.form == "amortized":
            self.alpha = ema_alpha(self.alpha, fresh, self.marble.alpha_ema)
            self.counters["refreshes"] += 1
        else:
            self.alpha = fresh
        self._publish()

    def _publish(self) -> None:
        if self.marble is not None:
            self.marble.alpha = self.alpha.float()

    def _flat_grad(self) -> torch.Tensor:
        params = self.opt.params
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().float() for p in params])

    def _add_to_grad(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.opt.params:
            piece = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
            p.grad = piece.clone() if p.grad is None else p.grad + piece
            offset += p.numel()

    def metrics(self) -> dict[str, float]:
        """α per reward, the mean cosine of each reward's gradient with the update, the fraction of negative
        cosines and of windows with one (over the windows that had per-reward gradients), the fallback count."""
        if self.marble is None and not self.probe:
            return {}
        out = {f"marble/alpha/{name}": float(a) for name, a in zip(self.names, self.alpha)} if self.marble else {}
        out.update({k: sum(v) / len(v) for k, v in self._log.items()})
        out.update({f"marble/{k}": float(v) for k, v in self.counters.items()})
        out["perf/reward_gradients_probe_s"] = self.seconds
        self._log, self.seconds = {}, 0.0
        return out

    def state_dict(self) -> dict:
        return {"alpha": self.alpha.tolist(), "windows": self.windows, "counters": dict(self.counters)}

    def load_state_dict(self, state: dict) -> None:
        self.alpha = torch.tensor(state["alpha"], dtype=torch.float64)
        self.windows, self.counters = int(state["windows"]), dict(state["counters"])
        self._publish()
