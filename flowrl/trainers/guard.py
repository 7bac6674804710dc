"""The GRPO recipe's two options on the policy ratio beyond PPO's clip
(docs/recipes/grpo.md#grpo-options-guard-and-ratio_control).

* GRPO-Guard (`train.guard`; Wang et al., arXiv 2510.22319; code: flow_grpo's train_sd3_GRPO_Guard.py). RatioNorm takes
  the ratio of a transition as `log ρ_guard = (ℓ_θ − ℓ_old + b)·s`, `b = mean((μ_θ − μ_old)²)/(2s²)`, s the transition's
  std, which is `mean(ξ ⊙ (μ_θ − μ_old))` with ξ = (x' − μ_old)/s: zero-mean in the noise, where Flow-GRPO's log-ratio
  has mean −b < 0. The clipped surrogate of ρ_guard is then divided by the transition's Δσ = σ_k − σ_{k+1}, which gives
  every noise level the same gradient scale on Flow-GRPO's SDE.
* Flow-DPPO (`train.ratio_control: dppo`; Ping et al., arXiv 2606.11025; code: UniRL's `_flowdppo_kl_adv_loss`). The
  surrogate is `−A·ρ`, ρ = exp(ℓ_θ − ℓ_old), dropped where the exact Gaussian KL between the old and current transition,
  `mean((μ_θ − μ_old)²)/(2s²)`, is at least τ and the ratio moved the way A pushes it (ρ > 1 with A > 0, ρ < 1 with
  A < 0).

Both need μ_old, the mean of each trained transition's Gaussian under the weights at the start of the step's
optimisation (UniRL freezes it there too). `RatioControl` takes it, for the transitions that the first optimizer step's
minibatches train, from their own forward (the weights have not moved yet: no extra forward), and for the others from
one no-grad pass before the first optimizer step, in the first inner epoch's minibatches.
"""

from __future__ import annotations

from collections import defaultdict
from functools import partial

import torch

from flowrl import sde
from flowrl.losses import clipped_policy_loss
from flowrl.trainers.transitions import TransitionInputs, transition_inputs
from flowrl.training.loop import RecipeParts
from flowrl.types import Rollout

RATIO_CONTROLS = ("clip", "dppo")


def ratio_control_error(train, sampler: str, carries: frozenset[str]) -> str | None:
    """None where the GRPO config `train` can use the rollouts of sampler `sampler` (carrying `carries`), else the
    one-line reason and fix."""
    if train.ratio_control not in RATIO_CONTROLS:
        return f"train.ratio_control={train.ratio_control!r} must be one of {', '.join(RATIO_CONTROLS)}"
    if not train.dppo_kl_threshold >= 0:
        return f"train.dppo_kl_threshold={train.dppo_kl_threshold} must be >= 0 (UniRL: 1e-5)"
    if train.guard and train.ratio_control != "clip":
        return (
            f"train.guard normalises the ratio that PPO's clip bounds and train.ratio_control={train.ratio_control} "
            "replaces the clip by a KL mask; no source combines them: set train.guard=false or train.ratio_control=clip"
        )
    if train.guard and not {"gaussian_steps", "flow_grpo_steps"} <= carries:
        return (
            f"train.guard (GRPO-Guard) needs Flow-GRPO SDE steps scored by their exact Gaussian density, which the "
            f"rollouts of sampler {sampler} are not (its 1/Δσ reweighting equalises g = a·√(σ/(1 − σ)) only): set "
            "sampler.kind: flow_grpo, log_prob_mode: gaussian (a tree: split_log_prob: scaled)"
        )
    if train.ratio_control == "dppo" and "gaussian_steps" not in carries:
        return (
            f"train.ratio_control=dppo masks by the KL of the transition Gaussians, which needs steps scored by their "
            f"exact Gaussian density; the rollouts of sampler {sampler} are not: set sampler.log_prob_mode: gaussian "
            "(a tree: split_log_prob: scaled)"
        )
    return None


def guard_log_ratio(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    means: torch.Tensor,
    old_means: torch.Tensor,
    std: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RatioNorm per sample: (log ρ_guard [n], b [n]) with log ρ_guard = (ℓ_θ − ℓ_old + b)·s and
    b = mean_elements((μ_θ − μ_old)²)/(2s²); ℓ per-element-mean log-densities [n], means [n, ...], std s [n]."""
    bias = sde.gaussian_kl(means, old_means, std, "paper", reduce="mean")  # [n]
    return (log_probs - old_log_probs + bias) * std, bias


def guard_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    means: torch.Tensor,
    old_means: torch.Tensor,
    std: torch.Tensor,
    dt: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GRPO-Guard's loss per sample [n]: max(−A·ρ_guard, −A·clip(ρ_guard, 1 − ε, 1 + ε)) / Δσ, ρ_guard = exp(RatioNorm's
    log-ratio) and Δσ = `dt` [n] the transition's σ_k − σ_{k+1}. Stats as `clipped_policy_loss` (ratio and clipped of
    ρ_guard, approx_kl of ℓ_θ − ℓ_old) plus log_ratio (ℓ_θ − ℓ_old), guard_log_ratio and mean_bias (b)."""
    log_ratio, bias = guard_log_ratio(log_probs, old_log_probs, means, old_means, std)
    ratio = torch.exp(log_ratio)
    surrogate = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range))
    raw = (log_probs - old_log_probs).detach()
    stats = {
        "ratio": ratio.detach(),
        "clipped": (ratio.detach() - 1.0).abs() > clip_range,
        "approx_kl": 0.5 * raw**2,
        "log_ratio": raw,
        "guard_log_ratio": log_ratio.detach(),
        "mean_bias": bias.detach(),
    }
    return surrogate / dt, stats


def dppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    means: torch.Tensor,
    old_means: torch.Tensor,
    std: torch.Tensor,
    advantages: torch.Tensor,
    kl_threshold: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Flow-DPPO's loss per sample [n]: −A·ρ where kept, 0 where dropped; drop = (KL ≥ τ) ∧ ((ρ > 1 ∧ A > 0) ∨ (ρ < 1 ∧
    A < 0)), KL = mean_elements((μ_θ − μ_old)²)/(2s²) (the exact KL of the two transition Gaussians over the element
    count), τ = `kl_threshold`. Stats: ratio, clipped (= dropped), approx_kl, log_ratio, kl, over_threshold (KL ≥ τ)."""
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    kl = sde.gaussian_kl(means, old_means, std, "paper", reduce="mean").detach()  # [n]
    rho, a = ratio.detach(), advantages.detach()
    over = kl >= kl_threshold
    drop = over & (((rho > 1.0) & (a > 0)) | ((rho < 1.0) & (a < 0)))
    loss = torch.where(drop, torch.zeros_like(ratio), -advantages * ratio)  # where: no inf·0 where ρ overflows
    stats = {
        "ratio": rho,
        "clipped": drop,
        "approx_kl": 0.5 * log_ratio.detach() ** 2,
        "log_ratio": log_ratio.detach(),
        "kl": kl,
        "over_threshold": over,
    }
    return loss, stats


class RatioControl:
    """One step's policy surrogate for the GRPO loop: PPO's clip (`train.guard` off, `ratio_control: clip`: exactly
    `clipped_policy_loss`, no extra work) or GRPO-Guard / Flow-DPPO with the old means they need. Call
    `next_minibatch()` at each minibatch, `surrogate(...)` per trained transition and `record(stats)` with the stats of
    the loss that trains; `metrics()` at the end."""

    def __init__(
        self, parts: RecipeParts, rollout: Rollout, steps: list[list[int]], order: torch.Tensor, minibatch_size: int
    ):
        t = parts.cfg.train
        self.t, self.rollout, self.active = t, rollout, t.guard or t.ratio_control != "clip"
        self.name = "guard" if t.guard else t.ratio_control
        self.fresh_minibatches, self.seen, self.fresh = t.gradient_accumulation_steps, 0, True
        self.keep_fresh = t.num_inner_epochs > 1  # later epochs read the first window's means back
        self.stats: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.table: torch.Tensor | None = None
        self.prepass = 0
        if not self.active:
            return
        # the table holds what is read back: the later minibatches' means, and the first window's with more epochs
        fresh_rows = set(order[: self.fresh_minibatches * minibatch_size].tolist())
        pairs = [(i, k) for i, row in enumerate(steps) for k in row if self.keep_fresh or i not in fresh_rows]
        self.slot = torch.full(rollout.log_probs.shape, -1, dtype=torch.int64)  # [N, T] row of (i, k) in the table
        self.slot[[i for i, _ in pairs], [k for _, k in pairs]] = torch.arange(len(pairs))
        self.slot = self.slot.to(parts.accelerator.device)
        self._old_means_after_the_first_window(parts, steps, order, minibatch_size)

    @torch.no_grad()
    def _old_means_after_the_first_window(self, parts, steps, order, size) -> None:
        """μ_old of the transitions that minibatches after the first optimizer step train (first epoch's order), by
        the weights before that step, in the batch shapes of their training forwards."""
        model, rollout, device = parts.model, self.rollout, parts.accelerator.device
        sigmas = rollout.sigmas.to(device)
        for m in range(self.fresh_minibatches, len(order) // size):
            rows = order[m * size : (m + 1) * size].tolist()
            for j in range(max((len(steps[i]) for i in rows), default=0)):
                sel = [i for i in rows if len(steps[i]) > j]
                index = torch.tensor(sel, device=device)
                k = torch.tensor([steps[i][j] for i in sel], device=device)
                inputs = transition_inputs(rollout, sigmas, index, k)
                v = model.velocity(inputs.x, inputs.sigma, inputs.cond, rollout.guidance_scale)
                self._store(index, k, self._step(v, inputs)[0])
                self.prepass += len(sel)

    def _step(self, v: torch.Tensor, inputs: TransitionInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean [b, ...], std [b]) of the transitions' Gaussians under velocity v, by the rollout's step rule."""
        x, sigma, sigma_next, level, scale = inputs.x, inputs.sigma, inputs.sigma_next, inputs.level, inputs.scale
        _, _, mean, std = self.rollout.rule.step(
            v, x, sigma, sigma_next, level, prev_sample=inputs.x_next, std_scale=scale
        )
        return mean, std

    def _store(self, index: torch.Tensor, k: torch.Tensor, mean: torch.Tensor) -> None:
        if self.table is None:
            self.table = torch.zeros(int((self.slot >= 0).sum()), *mean.shape[1:], dtype=mean.dtype, device=mean.device)
        self.table[self.slot[index, k]] = mean.detach()

    def next_minibatch(self) -> None:
        """The loop starts a minibatch: those before the first optimizer step still see the old weights."""
        self.fresh = self.seen < self.fresh_minibatches
        self.seen += 1

    def surrogate(self, v, inputs: TransitionInputs, log_prob, old_log_prob, index, k):
        """The per-sample policy loss of transitions k of rows `index` as a function of the advantages [b] ->
        (loss [b], stats); `log_prob` [b] the current log-probs (re-scored from velocity v), `old_log_prob` the ratio's
        reference."""
        if not self.active:
            return partial(clipped_policy_loss, log_prob, old_log_prob, clip_range=self.t.clip_range)
        mean, std = self._step(v, inputs)
        if self.fresh:
            old_mean = mean.detach()
            if self.keep_fresh:
                self._store(index, k, old_mean)
        else:
            old_mean = self.table[self.slot[index, k]]
        if self.t.guard:
            dt = torch.as_tensor(inputs.sigma, dtype=torch.float32) - torch.as_tensor(
                inputs.sigma_next, dtype=torch.float32
            )
            return partial(
                guard_policy_loss, log_prob, old_log_prob, mean, old_mean, std, dt, clip_range=self.t.clip_range
            )
        return partial(
            dppo_policy_loss, log_prob, old_log_prob, mean, old_mean, std, kl_threshold=self.t.dppo_kl_threshold
        )

    def record(self, stats: dict[str, torch.Tensor]) -> None:
        if self.active:
            for key in ("log_ratio", "guard_log_ratio", "mean_bias", "kl", "over_threshold"):
                if key in stats:
                    self.stats[key].append(stats[key].float())
            self.stats["dropped"].append(stats["clipped"].float())

    def metrics(self) -> dict[str, float]:
        """guard/...: ℓ_θ − ℓ_old before and after RatioNorm (mean, std), b; dppo/...: the mask's fraction, the KL
        (mean, max), the fraction at or over τ, ℓ_θ − ℓ_old; both: transitions re-scored before the first step."""
        if not self.active:
            return {}
        s = {key: torch.cat(values) for key, values in self.stats.items()}
        out = {
            f"{self.name}/log_ratio_mean": float(s["log_ratio"].mean()),
            f"{self.name}/log_ratio_std": _std(s["log_ratio"]),
        }
        if self.t.guard:
            out["guard/norm_log_ratio_mean"] = float(s["guard_log_ratio"].mean())
            out["guard/norm_log_ratio_std"] = _std(s["guard_log_ratio"])
            out["guard/mean_bias"] = float(s["mean_bias"].mean())
        else:
            out["dppo/mask_fraction"] = float(s["dropped"].mean())
            out["dppo/kl_mean"] = float(s["kl"].mean())
            out["dppo/kl_max"] = float(s["kl"].max())
            out["dppo/over_threshold_fraction"] = float(s["over_threshold"].mean())
        out[f"{self.name}/prepass_transitions"] = float(self.prepass)
        return out


def _std(values: torch.Tensor) -> float:
    return float(values.std(correction=0))
