"""Time: the sigma grids of flow-matching samplers, the σ range a model trains, and the training times recipes draw.

Conventions (docs/math.md#sigma-time-convention): `x_σ = (1 − σ)·x0 + σ·ε`, σ = 1 is pure noise, σ = 0 is data, and
a sampling grid runs `1 = σ_0 > σ_1 > … > σ_T = 0`. The steps on a grid, their log-probs and `timesteps_from_sigmas`
are flowrl.sde's.

Contents
  grids            shift_sigmas, calculate_shift, flux2_shift, scheduler_sigmas, dance_sigmas
  trainable range  trainable_steps, on_trainable_steps, describe, range_text, check_trainable (TRAINS_ON)
  training times   nft_times, ram_times, awm_times, gdro_times, dgpo_times, adjoint_loss_times (each recipe's draw, one
                   error where none is left: no_training_time)

The trainable σ range: `FlowModel.trainable_sigma_range()` states it as a closed interval [lo, hi]: every σ for
one-module models, the trained expert's side of `boundary_ratio` for Wan 2.2 A14B, whose frozen expert runs the rest
of every trajectory (docs/models.md#wan-22). A transition or training time outside it has no gradient, so nothing
trains there: the SDE sampler places an SDE window (`sde_window_size` > 0) on such steps (`trainable_steps`), GRPO
trains only such transitions (`on_trainable_steps`), NFT, AWM, DGPO and adjoint matching pick their training times
among such grid times, RAM and GDRO draw theirs inside the range. `check_trainable` refuses, before training, a config
that leaves nothing there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from flowrl.types import FlowModel, Sampler

# ---- Grids -----------------------------------------------------------------------------------------------------------

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
    joined by a line in the step count; above 4,300 tokens the 200-step line alone (diffusers' arithmetic, same
    float)."""
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
            f"scheduler config time_shift_type={settings['time_shift_type']!r} is unknown: use 'exponential' or "
            "'linear'"
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


def dance_sigmas(num_steps: int, shift: float, sigma_max: float = 1.0) -> torch.Tensor:
    """DanceGRPO / BranchGRPO grid [T+1]: `shift(linspace(σ_max, 0, T+1); s)` in float32 (docs/math.md#sigma-grids).
    s = 3 for FLUX, 5 for HunyuanVideo, σ_max = 1 (< 1: adjoint matching's grid stops short of the singular σ = 1)."""
    if not (isinstance(num_steps, (int, np.integer)) and num_steps >= 1) or not 0 < sigma_max <= 1:
        raise ValueError(f"num_steps={num_steps!r} must be an integer >= 1 and sigma_max={sigma_max!r} in (0, 1]")
    return shift_sigmas(torch.linspace(sigma_max, 0, num_steps + 1), shift)  # [T+1]


# ---- The trainable σ range -------------------------------------------------------------------------------------------


def trainable_steps(model: FlowModel, sigmas: torch.Tensor) -> torch.Tensor:
    """[T] bool: the transitions σ_k -> σ_{k+1} of a grid [T+1] whose velocity (at σ_k) runs the trained module."""
    lo, hi = model.trainable_sigma_range()
    start = torch.as_tensor(sigmas, dtype=torch.float32).cpu()[:-1]  # [T]
    return (start >= lo) & (start <= hi)


def describe(steps: torch.Tensor) -> str:
    """'steps 4-5 of 6' / 'no step of 6': the trainable transitions of a [T] mask (contiguous on a monotone grid)."""
    index = steps.nonzero().flatten().tolist()
    if not index:
        return f"no step of {len(steps)}"
    return f"step {index[0]} of {len(steps)}" if len(index) == 1 else f"steps {index[0]}-{index[-1]} of {len(steps)}"


def on_trainable_steps(transitions: torch.Tensor, sigmas: torch.Tensor, model: FlowModel) -> torch.Tensor:
    """The rows of a transition table [M, 2] (sample, step) whose step the model trains."""
    return transitions[trainable_steps(model, sigmas)[transitions[:, 1].cpu()]]


def range_text(model: FlowModel) -> str:
    lo, hi = model.trainable_sigma_range()
    return f"the trained σ range [{lo:.4g}, {hi:.4g}] (model.train_expert)"


TRAINS_ON = ("stochastic_steps", "rollout_steps", "endpoints")  # what a recipe declares it trains (`trains_on`)


def check_trainable(trains_on: str, sampler: Sampler, model: FlowModel) -> None:
    """Raise a one-line error where the rollouts of `sampler` leave a recipe that trains on `trains_on` (its
    declaration: 'stochastic_steps', the rollout's stochastic transitions; 'rollout_steps', times among the rollout's
    grid times; 'endpoints', times drawn on the range) nothing on the model's trainable σ range (the steps the sampler
    states, `Sampler.trained_steps`). A no-op for one-module models (every σ trains)."""
    if trains_on not in TRAINS_ON:
        raise ValueError(f"a recipe's trains_on={trains_on!r} must be one of {', '.join(TRAINS_ON)}")
    if model.trainable_sigma_range() == (0.0, 1.0):
        return
    stochastic = trains_on == "stochastic_steps"
    steps = sampler.trained_steps(model, stochastic_only=stochastic)  # raises where a window cannot lie there
    if steps is None:
        return  # the checkpoint's own scheduler sets the grid at run time; NFT checks it there
    if trains_on != "endpoints" and not steps.any():
        raise ValueError(
            f"sampler.num_steps={sampler.num_steps}: no {'stochastic ' if stochastic else ''}step of the rollout "
            f"is on {range_text(model)}; add steps or train the other expert"
        )


# ---- Training times --------------------------------------------------------------------------------------------------


def no_training_time(setting: str, fix: str) -> ValueError:
    """The one error of a time draw that finds nothing to train: the `setting` that left no time, and the `fix`."""
    return ValueError(f"{setting} leaves no training time on the model's trained σ range (model.train_expert); {fix}")


def nft_times(
    generators: list[torch.Generator], grid: torch.Tensor, fraction: float, trainable: torch.Tensor | None = None
) -> torch.Tensor:
    """DiffusionNFT's training times: per sample (one generator each), the first int(T·fraction) of a random
    permutation of the T grid times (sigmas[:-1], every time with σ > 0); with `trainable` [T] bool (the times the
    model trains), of those times only. Returns grid indices [N, K] int64."""
    num_times = len(grid) - 1
    candidates = torch.arange(num_times) if trainable is None else trainable.cpu().nonzero().flatten()  # [T']
    if len(candidates) == 0:
        raise no_training_time(f"sampler.num_steps={num_times}", "add steps or train the other expert")
    k = int(len(candidates) * fraction + 1e-6)
    if k < 1:
        raise no_training_time(
            f"train.timestep_fraction={fraction} of {len(candidates)} trainable grid times", "raise it"
        )
    return torch.stack([candidates[torch.randperm(len(candidates), generator=g)[:k]] for g in generators])


def ram_times(
    generators: list[torch.Generator],
    shape: tuple[int, ...],
    k: int,
    alpha: float,
    sigma_range: tuple[float, float] = (0.0, 1.0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """RAM's training times: per sample (one generator each) its K times t ~ p(t) ∝ t^α on (lo, hi] (inverse CDF
    (lo^{α+1} + (hi^{α+1} − lo^{α+1})·u)^{1/(α+1)}, u on (0, 1]; [lo, hi] the model's trainable σ range, (0, 1] for
    one-module models) and K noises. Returns times [N, K] float32 and noises [N, K, *shape]."""
    lo, hi = sigma_range
    low, high = lo ** (alpha + 1.0), hi ** (alpha + 1.0)
    times, noises = [], []
    for g in generators:
        u = 1.0 - torch.rand(k, generator=g)  # (0, 1]
        times.append((low + (high - low) * u).pow(1.0 / (alpha + 1.0)).clamp(lo, hi))  # clamp: rounding at the edges
        noises.append(torch.randn((k, *shape), generator=g))
    return torch.stack(times), torch.stack(noises)


AWM_TIME_TYPES = ("discrete", "discrete_wo_init")  # AWM's strata start at grid index 0, or 1 (σ_0 left out)


def awm_times(generators, grid, shape, k, fraction, time_type, trainable=None) -> tuple[torch.Tensor, torch.Tensor]:
    """AWM's training times: per sample (one generator each) K grid indices, one uniform draw in each of K strata
    (bounds linspace(0, count, K + 1) truncated; an empty one gives its bound) of the indices [lo, int(T·fraction))
    that the model trains (`trainable` [T] bool), lo = 0 'discrete' or 1 'discrete_wo_init'; then K noises of
    `shape`. Returns [N, K], [N, K, *shape]."""
    num_times, lo = len(grid) - 1, AWM_TIME_TYPES.index(time_type)
    candidates = torch.arange(lo, min(int(num_times * fraction + 1e-6), num_times))
    if trainable is not None:
        candidates = candidates[trainable.cpu()[candidates]]
    if len(candidates) == 0:
        setting = f"train.timestep_fraction={fraction} of sampler.num_steps={num_times} ({time_type}: from index {lo})"
        raise no_training_time(setting, "raise train.timestep_fraction or add steps")
    bounds = torch.linspace(0, len(candidates), k + 1).long()
    lower, width = bounds[:-1], bounds[1:] - bounds[:-1]
    draws = [(torch.rand(k, generator=g), torch.randn((k, *shape), generator=g)) for g in generators]
    return torch.stack([candidates[lower + (u * width).long()] for u, _ in draws]), torch.stack([e for _, e in draws])


GDRO_TIME_DISTRIBUTIONS = ("uniform", "logit_normal")


def gdro_times(generator: torch.Generator, count: int, shape, distribution: str, shift: float, sigma_range):
    """GDRO's training times: `count` times [count] and noises [count, *shape] from `generator` (a group's,
    flowrl.seeds.gdro_group_generator): t from `distribution` ('uniform' U(0, 1) or 'logit_normal' sigmoid(N(0, 1)),
    SD3's), shifted by `shift` (shift_sigmas), mapped onto the trained σ range [lo, hi]."""
    gen = generator
    u = (
        torch.rand(count, generator=gen)
        if distribution == "uniform"
        else torch.sigmoid(torch.randn(count, generator=gen))
    )
    u = shift_sigmas(u, shift)
    return sigma_range[0] + (sigma_range[1] - sigma_range[0]) * u, torch.randn((count, *shape), generator=gen)


def dgpo_times(generator, sigmas, max_index: int, count: int, epochs: int, trainable) -> list[torch.Tensor]:
    """DGPO's training times: per inner epoch, `count` distinct grid indices (fewer where fewer exist) drawn from
    0..max_index that the model trains (`trainable` [T] bool), shared by every sample and process. [k] per epoch."""
    candidates = torch.arange(min(max_index, len(sigmas) - 2) + 1)
    candidates = candidates[trainable[candidates]]  # the σ the model trains
    if len(candidates) == 0:
        raise no_training_time(f"train.max_timestep_index={max_index}", "raise it or add steps")
    k = min(count, len(candidates))
    return [candidates[torch.randperm(len(candidates), generator=generator)[:k]] for _ in range(epochs)]


def adjoint_loss_times(
    sigmas: torch.Tensor,
    below: float,
    num_random: int,
    generator: torch.Generator,
    trainable: torch.Tensor | None = None,
) -> list[int]:
    """Adjoint matching's loss times: grid indices k (σ_k > 0) trained this step, all with σ_k ≤ `below`, plus
    `num_random` of the others at random; with `trainable` [T] bool (the times the model trains), among those only."""
    indices = [k for k in range(len(sigmas) - 1) if float(sigmas[k]) > 0 and (trainable is None or bool(trainable[k]))]
    late = [k for k in indices if float(sigmas[k]) <= below]
    early = [k for k in indices if float(sigmas[k]) > below]
    picked = torch.randperm(len(early), generator=generator)[: min(num_random, len(early))].tolist()
    times = sorted(late + [early[i] for i in picked])
    if not times:
        setting = f"train.all_loss_times_below_sigma={below} with train.num_random_loss_times={num_random}"
        raise no_training_time(setting, "raise either")
    return times
