"""Time, noise schedules, stochastic steps and Gaussian log-probs of flow-matching samplers.

This module owns all sigma / timestep / log-prob arithmetic of flowrl; samplers
loop over steps and call it, trainers re-score stored transitions with it. Conventions
(docs/math.md#sigma-time-convention): `x_σ = (1 − σ)·x0 + σ·ε`, σ = 1 is pure noise, σ = 0 is data, the model predicts the velocity
`v ≈ E[ε − x0 | x_σ]`, and a sampling grid runs `1 = σ_0 > σ_1 > … > σ_T = 0`. Every step and every
log-prob is computed in float32, whatever the dtype of the network (docs/math.md#precision).

Contents
  schedules      shift_sigmas, calculate_shift, flux2_shift, scheduler_sigmas, timesteps_from_sigmas, dance_sigmas
  estimates      x0_from_velocity, noise_from_velocity
  steps          sde_std, sde_step (kinds "ode", "flow_grpo", "dance", "cps"); divergence: gaussian_kl
  re-scoring     StepRule, transition_stds, rescore_transition (what trainers call on stored transitions)
  memoryless     (flowrl/sde_memoryless.py) adjoint matching's σ_d, lean adjoint and residual
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("ode", "flow_grpo", "dance", "cps")
LOG_PROB_MODES = ("gaussian", "cps_sq")
REDUCTIONS = ("mean", "sum")
KL_FORMS = ("code", "paper")

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)

# ---- Schedules -------------------------------------------------------------------------------------------------------

# FlowMatchEulerDiscreteScheduler's constructor arguments and their defaults (diffusers 0.35 - 0.42).
_SCHEDULER_DEFAULTS: dict[str, object] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": False,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
    "invert_sigmas": False,
    "shift_terminal": None,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "time_shift_type": "exponential",
    "stochastic_sampling": False,  # changes diffusers' step, never its sigmas
}
_UNSUPPORTED_SCHEDULER_KEYS = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")
_SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"


def shift_sigmas(sigmas: torch.Tensor | Sequence[float], shift: float) -> torch.Tensor:
    """Static SD3 timestep shift `s·σ / (1 + (s − 1)·σ)` (docs/math.md#sigma-grids), elementwise, float32.

    `shift` > 1 moves the grid towards the noise end; shift(0) = 0 and shift(1) = 1 for any s > 0.
    """
    if not shift > 0:
        raise ValueError(f"shift={shift} must be > 0 (SD3.5 uses 3.0, Wan 5.0; 1.0 means no shift)")
    sigmas = torch.as_tensor(sigmas, dtype=torch.float32)
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """FLUX's dynamic-shift exponent μ, linear in the number of image tokens.

    μ = base_shift at `base_seq_len` tokens and max_shift at `max_seq_len` tokens (extrapolated outside);
    the same arithmetic as diffusers' FLUX pipeline, so the float is identical.
    """
    if max_seq_len == base_seq_len:
        raise ValueError(f"max_seq_len={max_seq_len} equals base_seq_len: give two different token counts")
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


def flux2_shift(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's dynamic-shift exponent μ (fitted by Black Forest Labs): lines in the token count at 10 and at 200 steps,
    joined by a line in the step count; above 4,300 tokens the 200-step line alone (diffusers' arithmetic, same float)."""
    at_200 = 0.00016927 * image_seq_len + 0.45666666
    if image_seq_len > 4300:
        return float(at_200)
    at_10 = 8.73809524e-05 * image_seq_len + 1.89833333
    per_step = (at_200 - at_10) / 190.0
    return float(per_step * num_steps + (at_200 - 200.0 * per_step))


def _scheduler_settings(config: Mapping, allow_inverted: bool) -> dict:
    """Merge `config` over the scheduler defaults and refuse what `scheduler_sigmas` does not reproduce.

    A multistep-solver config (DPM-Solver, UniPC: it has `use_flow_sigmas` / `flow_shift`) with
    `use_flow_sigmas=True`, as SANA and Wan checkpoints ship, is read as the Euler config with
    shift=flow_shift; any other scheduler class is refused.
    """
    class_name = config.get("_class_name")
    solver_config = "use_flow_sigmas" in config or "flow_shift" in config
    if solver_config and not config.get("use_flow_sigmas"):
        raise ValueError(
            "scheduler config use_flow_sigmas is off: this DPM-Solver/UniPC config is not a flow-matching schedule; "
            f"pass a {_SCHEDULER_CLASS} config"
        )
    if class_name not in (None, _SCHEDULER_CLASS) and not solver_config:
        raise ValueError(
            f"scheduler config _class_name={class_name!r} is not supported: flowrl reproduces {_SCHEDULER_CLASS} "
            f"only; pass a {_SCHEDULER_CLASS} config (e.g. shift=<the flow_shift of {class_name}>)"
        )
    settings = dict(_SCHEDULER_DEFAULTS)
    settings.update({key: value for key, value in config.items() if key in _SCHEDULER_DEFAULTS})
    if solver_config:
        settings["shift"] = float(config.get("flow_shift") or 1.0)
    for key in _UNSUPPORTED_SCHEDULER_KEYS:
        if settings[key]:
            raise ValueError(f"scheduler config {key}={settings[key]!r} is not supported: set it to False")
    if settings["time_shift_type"] not in ("exponential", "linear"):
        raise ValueError(
            f"scheduler config time_shift_type={settings['time_shift_type']!r} is unknown: use 'exponential' or 'linear'"
        )
    if settings["invert_sigmas"] and not allow_inverted:
        raise ValueError(
            "scheduler config invert_sigmas=True gives an inverted (Mochi) grid ending at 1, not flowrl's σ-time: "
            "set it to False, or pass allow_inverted=True to get diffusers' inverted sigmas anyway"
        )
    if not int(settings["num_train_timesteps"]) >= 1:
        raise ValueError(f"scheduler config num_train_timesteps={settings['num_train_timesteps']} must be >= 1")
    return settings


def scheduler_sigmas(
    config: Mapping,
    num_steps: int,
    *,
    sigmas: Sequence[float] | None = None,
    mu: float | None = None,
    allow_inverted: bool = False,
) -> torch.Tensor:
    """The sigmas [T+1] (float32, CPU, last element 0) of diffusers' FlowMatchEulerDiscreteScheduler.

    Equals `FlowMatchEulerDiscreteScheduler.from_config(config)` followed by
    `set_timesteps(num_steps, sigmas=sigmas, mu=mu)`, then `.sigmas`, bit for bit, without building the
    scheduler. Reproduced: the static shift, dynamic shifting (`use_dynamic_shifting`, `time_shift_type`
    "exponential" or "linear", which needs `mu`, e.g. `calculate_shift(image_seq_len)`), `shift_terminal`,
    and custom `sigmas` (FLUX pipelines pass `np.linspace(1, 1/T, T)`). Diffusers' default grid is spaced
    linearly from 1 to shift(1/num_train_timesteps) and then shifted again (docs/math.md#sigma-grids); with dynamic
    shifting the spacing runs from 1 to 1/num_train_timesteps. Karras, exponential and beta sigmas raise a
    ValueError; keys that do not change sigmas (`_class_name` aside) are ignored.

    SANA and Wan checkpoints ship DPM-Solver / UniPC configs (`use_flow_sigmas=True`, `flow_shift`); such a
    config gives the Euler grid above with shift = flow_shift (and its dynamic-shift / shift_terminal keys),
    which is the grid flowrl's Euler and SDE samplers walk. It is close to, not equal to, those solvers' own
    grids (UniPC starts at 1 − 1e-6, DPM-Solver at shift(1 − 1/N)); a config without flow sigmas raises.

    Keyword-only extras:
      allow_inverted: accept `invert_sigmas=True` and return diffusers' inverted grid `1 − σ` with a trailing
        1 (Mochi); refused by default because such a grid does not end at σ = 0.
    """
    settings = _scheduler_settings(config, allow_inverted)
    if not (isinstance(num_steps, (int, np.integer)) and num_steps >= 1):
        raise ValueError(f"num_steps={num_steps!r} must be an integer >= 1")
    if settings["use_dynamic_shifting"] and mu is None:
        raise ValueError(
            "mu=None but the scheduler config has use_dynamic_shifting=True: pass mu=calculate_shift(image_seq_len)"
        )
    if sigmas is not None and len(sigmas) != num_steps:
        raise ValueError(f"sigmas has {len(sigmas)} values but num_steps={num_steps}: pass one sigma per step")
    if settings["shift_terminal"] and num_steps == 1:
        raise ValueError(
            "num_steps=1 with scheduler config shift_terminal set gives NaN sigmas (0/0): use num_steps >= 2"
        )

    num_train = int(settings["num_train_timesteps"])
    shift = settings["shift"]

    if sigmas is None:
        # The constructor's training grid is σ_j = j/N (float32); its ends, shifted unless shifting is dynamic,
        # bound the inference grid, which is then spaced in float64 (as numpy's linspace of python floats).
        ends = torch.tensor([num_train, 1], dtype=torch.float32) / num_train  # [2]
        if not settings["use_dynamic_shifting"]:
            ends = shift * ends / (1 + (shift - 1) * ends)
        sigma_max, sigma_min = (float(value) for value in ends)
        grid = np.linspace(sigma_max * num_train, sigma_min * num_train, num_steps) / num_train  # [T] float64
    else:
        grid = np.array(sigmas).astype(np.float32)  # [T]; the arithmetic below then stays in float32

    if settings["use_dynamic_shifting"]:
        if settings["time_shift_type"] == "exponential":
            scale = math.exp(mu)
        else:
            scale = mu
        grid = scale / (scale + (1 / grid - 1))
    else:
        grid = shift * grid / (1 + (shift - 1) * grid)

    if settings["shift_terminal"]:
        # Stretch so that the last value equals shift_terminal (LTX-Video).
        one_minus = 1 - grid
        stretch = one_minus[-1] / (1 - settings["shift_terminal"])
        grid = 1 - one_minus / stretch

    result = torch.from_numpy(np.asarray(grid)).to(torch.float32)  # [T]
    if settings["invert_sigmas"]:
        return torch.cat([1.0 - result, torch.ones(1)])  # [T+1]
    return torch.cat([result, torch.zeros(1)])  # [T+1]


def timesteps_from_sigmas(sigmas: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The timesteps SD3-style transformers receive: `σ·num_train_timesteps`, elementwise, float32.

    Pass `sigmas[:-1]` for diffusers' `scheduler.timesteps` (which has no entry for the terminal 0).
    """
    return torch.as_tensor(sigmas, dtype=torch.float32) * num_train_timesteps


def dance_sigmas(num_steps: int, shift: float, sigma_max: float = 1.0) -> torch.Tensor:
    """DanceGRPO / BranchGRPO grid [T+1]: `shift(linspace(σ_max, 0, T+1); s)` in float32 (docs/math.md#sigma-grids).
    s = 3 for FLUX, 5 for HunyuanVideo, σ_max = 1 (< 1: adjoint matching's grid stops short of the singular σ = 1)."""
    if not (isinstance(num_steps, (int, np.integer)) and num_steps >= 1) or not 0 < sigma_max <= 1:
        raise ValueError(f"num_steps={num_steps!r} must be an integer >= 1 and sigma_max={sigma_max!r} in (0, 1]")
    return shift_sigmas(torch.linspace(sigma_max, 0, num_steps + 1), shift)  # [T+1]


# ---- Clean-sample and noise estimates (exact identities of the linear interpolant, docs/math.md#sigma-time-convention) ---


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
            f"{name} has shape {tuple(tensor.shape)} but the batch has N={num_samples} samples: pass a float or a Tensor [N]"
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
    """KL(N(mean, s²) || N(ref_mean, s²)) per sample [N] (float32), in one of two normalizations (docs/math.md#kl-to-the-reference).

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
            f"ref_mean has shape {tuple(ref_mean.shape)} but mean has {tuple(mean.shape)}: compute both on the same batch"
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
