"""Time, noise schedules, stochastic steps and Gaussian log-probs of flow-matching samplers.

This module owns all sigma / timestep / log-prob arithmetic of flowrl; samplers
loop over steps and call it, trainers re-score stored transitions with it. Conventions
(docs/math.md#sigma-time-convention): `x_σ = (1 − σ)·x0 + σ·ε`, σ = 1 is pure noise, σ = 0 is data, the model predicts
the velocity `v ≈ E[ε − x0 | x_σ]`, and a sampling grid runs `1 = σ_0 > σ_1 > … > σ_T = 0`. Every step and every
log-prob is computed in float32, whatever the dtype of the network (docs/math.md#precision).

Contents
  timesteps      timesteps_from_sigmas (the sigma grids themselves: flowrl/schedules.py)
  estimates      x0_from_velocity, noise_from_velocity
  steps          sde_std, sde_step (kinds "ode", "flow_grpo", "dance", "cps"); divergence: gaussian_kl
  re-scoring     StepRule, transition_stds, rescore_transition (what trainers call on stored transitions)
  memoryless     (flowrl/sde_memoryless.py) adjoint matching's σ_d, lean adjoint and residual
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

KINDS = ("ode", "flow_grpo", "dance", "cps")
LOG_PROB_MODES = ("gaussian", "cps_sq")
REDUCTIONS = ("mean", "sum")
KL_FORMS = ("code", "paper")

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)

# ---- Timesteps -------------------------------------------------------------------------------------------------------


def timesteps_from_sigmas(sigmas: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The timesteps SD3-style transformers receive: `σ·num_train_timesteps`, elementwise, float32.

    Pass `sigmas[:-1]` for diffusers' `scheduler.timesteps` (which has no entry for the terminal 0).
    """
    return torch.as_tensor(sigmas, dtype=torch.float32) * num_train_timesteps


# ---- Clean-sample and noise estimates (exact identities of the linear interpolant, docs/math.md#sigma-time-convention)


def _batch_view(value: torch.Tensor, ndim: int) -> torch.Tensor:
    """A scalar stays a scalar; a per-sample [N] tensor becomes [N, 1, ..., 1] to broadcast over `ndim` dims."""
    return value if value.ndim == 0 else value.reshape(value.shape[0], *([1] * (ndim - 1)))


def x0_from_velocity(x: torch.Tensor, v: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """Clean-sample estimate `x̂0 = x − σ·v` (float32); `sigma` is a float or a per-sample Tensor [N]."""
    x, v = x.float(), v.float()
    sigma = _batch_view(_as_float32(sigma, "sigma", x.shape[0], x.device), x.ndim)
    return x - sigma * v


def noise_from_velocity(x: torch.Tensor, v: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """Noise estimate `ε̂ = x + (1 − σ)·v` (float32); the score estimate is `−ε̂/σ`."""
    x, v = x.float(), v.float()
    sigma = _batch_view(_as_float32(sigma, "sigma", x.shape[0], x.device), x.ndim)
    return x + (1 - sigma) * v


def forward_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: float | torch.Tensor) -> torch.Tensor:
    """The forward process `x_σ = (1 − σ)·x0 + σ·ε` (float32); `sigma` a float or per-sample [N] (DiffusionNFT)."""
    sigma = _batch_view(_as_float32(sigma, "sigma", x0.shape[0], x0.device), x0.ndim)
    return (1 - sigma) * x0.float() + sigma * noise.float()


# ---- Stochastic steps ------------------------------------------------------------------------------------------------


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is unknown: use one of {', '.join(KINDS)}")


def _check_noise_level(noise_level: float | torch.Tensor, kind: str) -> None:
    """Refuse negative (or NaN) noise levels; tensors are checked only on the CPU, to avoid a device sync."""
    if isinstance(noise_level, torch.Tensor):
        if noise_level.device.type != "cpu":
            return
        bad = ~(noise_level >= 0)
        if bool(bad.any()):
            value = noise_level[bad].flatten()[0].item()
            raise ValueError(f"noise_level contains {value}: noise levels must be >= 0 (0 gives the Euler step)")
        too_big = kind == "cps" and bool((noise_level > 1).any())
        largest = float(noise_level.max()) if too_big else 0.0
    else:
        if not noise_level >= 0:
            raise ValueError(f"noise_level={noise_level} must be >= 0 (0 gives the Euler step)")
        too_big = kind == "cps" and noise_level > 1
        largest = float(noise_level)
    if too_big:
        raise ValueError(f"noise_level={largest} for kind='cps' must be in [0, 1] (the paper recommends 0.8)")


def _as_float32(value: float | torch.Tensor, name: str, num_samples: int, device) -> torch.Tensor:
    """A float or a Tensor [] / [N] as float32; a wrong length raises.

    Scalars stay scalars where they are (a python float becomes a CPU 0-dim tensor, which torch passes to
    accelerator kernels as an argument, so no host-to-device copy or sync happens per step); per-sample
    Tensors [N] move to `device` (keep them there to avoid the copy).
    """
    tensor = torch.as_tensor(value, dtype=torch.float32)
    if tensor.ndim > 1 or (tensor.ndim == 1 and tensor.shape[0] != num_samples):
        raise ValueError(
            f"{name} has shape {tuple(tensor.shape)} but the batch has N={num_samples} samples: pass a float or a "
            "Tensor [N]"
        )
    return tensor.to(device) if tensor.ndim == 1 else tensor


def _per_sample(value: torch.Tensor, num_samples: int, device) -> torch.Tensor:
    """A scalar or [N] tensor as a contiguous [N] tensor on `device`, reading no accelerator memory."""
    if value.ndim == 0 and value.device.type == "cpu":
        return torch.full((num_samples,), float(value), dtype=torch.float32, device=device)
    return torch.broadcast_to(value.to(device), (num_samples,)).contiguous()


def _step_coefficients(
    sigma: torch.Tensor, sigma_next: torch.Tensor, kind: str, noise_level: torch.Tensor, first_step_threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(std s_k, noise-estimate coefficient c_k) of one transition, broadcast over the inputs' shapes.

    Every kind's mean is written as the Euler step plus a correction along the noise estimate,
    `μ = x + Δ·v + c_k·ε̂`, with c_k = 0 exactly when the noise level is 0, so that a zero noise level
    reproduces Euler bit for bit:
      flow_grpo  g² = a²·σ/(1 − σ̃), σ̃ = σ' where σ ≥ first_step_threshold else σ;  s = g·√h;  c = −g²h/(2σ)
      dance      g = η;                                                  s = η·√h;  c = −η²h/(2σ)
      cps        s = σ'·sin(aπ/2);  c = σ'·(cos(aπ/2) − 1) = −2σ'·sin²(aπ/4)
      ode        s = 0;  c = 0
    Steps with h = σ − σ' ≤ 0 get s = c = 0 (an empty step leaves x unchanged).
    """
    h = sigma - sigma_next
    moving = h > 0
    zeros = torch.zeros_like(h * noise_level)
    if kind == "ode":
        return zeros, zeros
    if kind == "flow_grpo":
        # First-step rule (docs/math.md#sde-steps): at σ = 1 the denominator uses σ' instead, so that s_0 = a exactly.
        sigma_tilde = torch.where(sigma >= first_step_threshold, sigma_next, sigma)
        denominator = 1 - sigma_tilde
        denominator = torch.where(moving & (denominator > 0), denominator, torch.ones_like(denominator))
        ratio = torch.where(moving, sigma * h / denominator, torch.zeros_like(h))  # g²·h / a²
        std = noise_level * torch.sqrt(ratio)
        coefficient = -(noise_level * noise_level) * torch.where(moving, h / (2 * denominator), torch.zeros_like(h))
        return std, coefficient
    if kind == "dance":
        safe_sigma = torch.where(sigma > 0, sigma, torch.ones_like(sigma))
        std = noise_level * torch.sqrt(torch.clamp(h, min=0))
        coefficient = -(noise_level * noise_level) * torch.where(moving, h / (2 * safe_sigma), torch.zeros_like(h))
        return std, coefficient
    # cps
    angle = noise_level * (math.pi / 2)
    sigma_next = torch.where(moving, sigma_next, torch.zeros_like(sigma_next))
    std = sigma_next * torch.sin(angle)
    coefficient = -2 * sigma_next * torch.sin(angle / 2) ** 2
    return std, coefficient


def sde_std(
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    kind: str,
    noise_level: float | torch.Tensor,
    first_step_threshold: float = 1.0,
) -> torch.Tensor:
    """Transition std s_k of one step (float32), elementwise over broadcastable inputs.

    E.g. `sde_std(sigmas[:-1], sigmas[1:], "flow_grpo", 0.7)` gives the [T] stds of a whole grid.
    Formulas as in `sde_step`; `first_step_threshold` is the σ at and above which flow_grpo's first-step rule applies.
    """
    _check_kind(kind)
    _check_noise_level(noise_level, kind)
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    device = sigma.device
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=device)
    noise_level = torch.as_tensor(noise_level, dtype=torch.float32, device=device)
    std, _ = _step_coefficients(sigma, sigma_next, kind, noise_level, first_step_threshold)
    return std


def _standard_normal(shape: torch.Size, generator, device) -> torch.Tensor:
    """ξ ~ N(0, I) in float32; a list of generators draws row i from generator i (diffusers' per-sample seeds)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for {shape[0]} samples: pass one generator per sample")
        return torch.stack([torch.randn(shape[1:], generator=g, device=device, dtype=torch.float32) for g in generator])
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)


def sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    kind: str,
    noise_level: float | torch.Tensor,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | list[torch.Generator] | None = None,
    *,
    reduce: str = "mean",
    log_prob_mode: str = "gaussian",
    first_step_threshold: float = 1.0,
    noise: torch.Tensor | None = None,
    std_scale: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One transition x_σ → x_σ' of a flow sampler, with the log-density of the Gaussian it draws from.

    Args:
      v, x: velocity and current latents [N, ...], any float dtype; all arithmetic is float32.
      sigma, sigma_next: σ and σ' < σ, floats or per-sample Tensors [N] (tree and window samplers).
      kind: "ode" (Euler, deterministic), "flow_grpo" (g = a·√(σ/(1 − σ̃))), "dance" (g ≡ η)
        or "cps" (coefficients-preserving); docs/math.md#sde-steps. See `_step_coefficients` for the exact formulas.
      noise_level: a (flow_grpo, cps) or η (dance), float or Tensor [N], >= 0 (cps: <= 1); 0 gives the
        Euler step exactly for every kind. CPU tensors are validated; tensors on an accelerator are not (no sync).
      prev_sample: None to sample `x' = μ + s·ξ`, ξ ~ N(0, I) in float32 (drawn for every kind but
        "ode", also where s = 0); a Tensor [N, ...] to score that sample (detached) instead, which is then
        returned unchanged (same object, same dtype).
      generator: one torch.Generator for the whole batch, or a list of N generators, where row i of ξ comes
        from generator i (diffusers' per-image seeds; one randn call per sample), or None.
      reduce: "mean" (default, the reference codes' convention) or "sum" of the per-element log-density
        over all non-batch elements.
      log_prob_mode: "gaussian" (exact log-density, default) or "cps_sq", flow_grpo's CPS quirk
        `−mean((x' − μ)²)` (kind "cps" only; docs/math.md#log-probabilities).
      first_step_threshold: flow_grpo's first-step rule applies where σ >= this value (σ̃ = σ' there). It is a
        threshold on σ, not a substituted value: flow_grpo substitutes σ_1 for σ = 1 in g's denominator.
      noise: ξ [N, ...] to use instead of drawing it (samplers that draw per sample only where that sample's
        step is stochastic, so that a trajectory never depends on its batch-mates); ignored with prev_sample.
      std_scale: a float or [N] scaling the std of the draw and the log-density, mean unchanged (tree splits).

    Returns (prev_sample [N, ...], log_prob [N], mean [N, ...], std [N]), float32 on x's device (a given
    prev_sample comes back as it was). Scalars (floats, 0-dim tensors) for sigma, sigma_next and noise_level
    keep the step free of host-device copies and syncs; per-sample [N] tensors should live on x's device.
    Where the std is 0
    (kind "ode", a zero noise level, the cps step to σ' = 0) the log_prob is 0 and a drawn prev_sample
    equals the mean. The log_prob is differentiable through `mean` (v and x), never through prev_sample.
    """
    _check_kind(kind)
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce={reduce!r} is unknown: use 'mean' or 'sum'")
    if log_prob_mode not in LOG_PROB_MODES:
        raise ValueError(f"log_prob_mode={log_prob_mode!r} is unknown: use 'gaussian' or 'cps_sq'")
    if log_prob_mode == "cps_sq" and kind != "cps":
        raise ValueError(f"log_prob_mode='cps_sq' is flow_grpo's CPS quirk but kind={kind!r}: use 'gaussian'")
    if x.ndim < 2:
        raise ValueError(f"x has shape {tuple(x.shape)}: latents must be [N, ...] with at least one non-batch dim")
    if v.shape != x.shape:
        raise ValueError(
            f"v has shape {tuple(v.shape)} but x has {tuple(x.shape)}: the velocity must match the latents"
        )
    if prev_sample is not None and prev_sample.shape != x.shape:
        raise ValueError(
            f"prev_sample has shape {tuple(prev_sample.shape)} but x has {tuple(x.shape)}: pass the stored next latents"
        )
    _check_noise_level(noise_level, kind)

    num_samples, device = x.shape[0], x.device
    x, v = x.float(), v.float()
    sigma_t = _as_float32(sigma, "sigma", num_samples, device)  # [] or [N]
    sigma_next_t = _as_float32(sigma_next, "sigma_next", num_samples, device)  # [] or [N]
    noise_t = _as_float32(noise_level, "noise_level", num_samples, device)  # [] or [N]

    std, coefficient = _step_coefficients(sigma_t, sigma_next_t, kind, noise_t, first_step_threshold)
    std = _per_sample(std, num_samples, device)  # [N]
    if std_scale is not None:
        std = std * _per_sample(_as_float32(std_scale, "std_scale", num_samples, device), num_samples, device)

    sigma_b = _batch_view(sigma_t, x.ndim)
    step = _batch_view(sigma_next_t - sigma_t, x.ndim)  # Δ = σ' − σ < 0
    mean = x + step * v  # [N, ...] Euler
    if kind != "ode":
        noise_estimate = x + (1 - sigma_b) * v  # ε̂ [N, ...]
        mean = mean + _batch_view(coefficient, x.ndim) * noise_estimate

    std_b = _batch_view(std, x.ndim)
    if prev_sample is None:
        if kind == "ode":
            prev_sample = mean
        else:
            if noise is None:
                noise = _standard_normal(x.shape, generator, device)  # ξ [N, ...]
            prev_sample = mean + std_b * noise.float()
        target = prev_sample.detach()
    else:
        target = prev_sample.detach().float()

    if kind == "ode":
        log_prob = torch.zeros(num_samples, device=device)  # [N]
        return prev_sample, log_prob, mean, std

    stochastic = std > 0  # [N]
    squared = (target - mean).flatten(1).square()  # [N, D]
    # Reduce first, then scale: the per-element log-density −r²/(2s²) − log s − ½log 2π has one s per sample.
    squared = squared.mean(dim=1) if reduce == "mean" else squared.sum(dim=1)  # [N]
    if log_prob_mode == "gaussian":
        safe_std = torch.where(stochastic, std, torch.ones_like(std))  # [N]
        count = 1 if reduce == "mean" else math.prod(x.shape[1:])  # elements per sample
        log_prob = -0.5 * squared / safe_std.square() - count * (torch.log(safe_std) + _HALF_LOG_2PI)  # [N]
    else:
        log_prob = -squared  # [N]
    log_prob = torch.where(stochastic, log_prob, torch.zeros_like(log_prob))
    return prev_sample, log_prob, mean, std


# ---- KL between the policy's and the reference's transition Gaussians (common std) -----------------------------------


def gaussian_kl(
    mean: torch.Tensor,
    ref_mean: torch.Tensor,
    std: float | torch.Tensor,
    form: str = "code",
    *,
    dt: float | torch.Tensor | None = None,
    reduce: str | None = None,
) -> torch.Tensor:
    """KL(N(mean, s²) || N(ref_mean, s²)) per sample [N] (float32), in one of two normalizations
    (docs/math.md#kl-to-the-reference).

    form="paper": `Σ_elements (μ − μ_ref)² / (2 s²)`, the true KL (s = the `std` returned by sde_step).
    form="code":  `mean_elements (μ − μ_ref)² / (2 g²)`, what flow_grpo computes and what the published β
      values assume (docs/math.md#kl-to-the-reference). g is the step's diffusion coefficient before the √dt factor:
        * flow_grpo and dance steps: pass `dt = h = σ − σ'`, then g² = std²/dt;
        * cps steps (flow_grpo divides by its std directly): pass `dt=None`, then g = std.
    `dt` is ignored by the paper form. `reduce` ("mean" or "sum") overrides the form's own reduction
    (paper: sum, code: mean). `std` and `dt` are floats or per-sample Tensors [N]; where std is 0 (a
    deterministic step, on which no policy gradient trains) the KL is returned as 0.
    """
    if form not in KL_FORMS:
        raise ValueError(f"form={form!r} is unknown: use 'code' or 'paper'")
    if reduce is not None and reduce not in REDUCTIONS:
        raise ValueError(f"reduce={reduce!r} is unknown: use 'mean', 'sum' or None (the form's own)")
    if mean.shape != ref_mean.shape:
        raise ValueError(
            f"ref_mean has shape {tuple(ref_mean.shape)} but mean has {tuple(mean.shape)}: compute both on the same "
            "batch"
        )
    if mean.ndim < 2:
        raise ValueError(f"mean has shape {tuple(mean.shape)}: means must be [N, ...] with at least one non-batch dim")
    num_samples, device = mean.shape[0], mean.device
    std_t = _per_sample(_as_float32(std, "std", num_samples, device), num_samples, device)  # [N]
    variance = std_t * std_t  # [N]
    if form == "code" and dt is not None:
        dt_t = _per_sample(_as_float32(dt, "dt", num_samples, device), num_samples, device)  # [N]
        variance = variance / torch.where(dt_t > 0, dt_t, torch.ones_like(dt_t))
    reduce = reduce or ("sum" if form == "paper" else "mean")
    squared = (mean.float() - ref_mean.float()).flatten(1) ** 2  # [N, D]
    distance = squared.mean(dim=1) if reduce == "mean" else squared.sum(dim=1)  # [N]
    positive = variance > 0
    safe_variance = torch.where(positive, variance, torch.ones_like(variance))
    return torch.where(positive, distance / (2 * safe_variance), torch.zeros_like(distance))


# ---- Re-scoring stored transitions (the trainer side of a rollout) ---------------------------------------------------


@dataclass(frozen=True)
class StepRule:
    """How a sampler drew its stochastic transitions; a Rollout records it so the trainer re-scores alike.

    kind: the sde_step kind of the stochastic steps ("flow_grpo", "dance", "cps"; "ode" for none).
    log_prob_mode: "gaussian" (exact) or "cps_sq" (flow_grpo's CPS quirk, kind "cps" only).
    first_step_threshold: σ at and above which flow_grpo's first-step rule applies.
    """

    kind: str = "ode"
    log_prob_mode: str = "gaussian"
    first_step_threshold: float = 1.0

    def __post_init__(self) -> None:
        _check_kind(self.kind)
        if self.log_prob_mode not in LOG_PROB_MODES:
            raise ValueError(f"log_prob_mode={self.log_prob_mode!r} is unknown: use 'gaussian' or 'cps_sq'")
        if self.log_prob_mode == "cps_sq" and self.kind != "cps":
            raise ValueError(f"log_prob_mode='cps_sq' is flow_grpo's CPS quirk but kind={self.kind!r}: use 'gaussian'")

    def step(self, v, x, sigma, sigma_next, noise_level, prev_sample=None, generator=None, noise=None, std_scale=None):
        """sde_step under this rule (see sde_step for arguments and returns)."""
        rule = {"log_prob_mode": self.log_prob_mode, "first_step_threshold": self.first_step_threshold, "noise": noise}
        return sde_step(
            v, x, sigma, sigma_next, self.kind, noise_level, prev_sample, generator, std_scale=std_scale, **rule
        )


def transition_stds(rule: StepRule, sigmas: torch.Tensor, noise_levels: torch.Tensor) -> torch.Tensor:
    """[N, T] std of every transition of a rollout (sigmas [T+1], noise_levels [N, T]); 0 = deterministic.

    A transition is trainable exactly where its std is > 0: a zero noise level, the "ode" kind and the cps
    step to σ' = 0 all have std 0, and their log-density is a point mass no policy gradient can use.
    """
    sigmas = sigmas.float().to(noise_levels.device)
    return sde_std(sigmas[:-1][None], sigmas[1:][None], rule.kind, noise_levels.float(), rule.first_step_threshold)


def rescore_transition(
    rule: StepRule,
    v: torch.Tensor,
    x: torch.Tensor,
    x_next: torch.Tensor,
    sigma: torch.Tensor,
    sigma_next: torch.Tensor,
    noise_level: torch.Tensor,
    v_ref: torch.Tensor | None = None,
    kl_form: str = "code",
    std_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob [N] of stored transitions x -> x_next under velocity v, and the KL [N] to v_ref's Gaussian.

    The log-prob uses the rollout's own rule (so re-scoring with the rollout's weights gives the stored value
    exactly); the KL (None without v_ref) is `gaussian_kl` in `kl_form`, with the diffusion coefficient the
    kind defines: g² = s²/h for flow_grpo and dance (the code form divides by g², not s²), g = s for cps;
    `std_scale` (None = 1) scales the std as in sde_step.
    """
    _, log_prob, mean, std = rule.step(v, x, sigma, sigma_next, noise_level, prev_sample=x_next, std_scale=std_scale)
    if v_ref is None:
        return log_prob, None
    _, _, ref_mean, _ = rule.step(v_ref, x, sigma, sigma_next, noise_level, prev_sample=x_next)
    h = torch.as_tensor(sigma, dtype=torch.float32) - torch.as_tensor(sigma_next, dtype=torch.float32)
    dt = h if rule.kind in ("flow_grpo", "dance") else None
    return log_prob, gaussian_kl(mean, ref_mean, std, kl_form, dt=dt)
