"""The trainable σ range: where a model runs the module that trains, and what rollouts and recipes do with it.

`FlowModel.trainable_sigma_range()` states it as a closed interval [lo, hi]: every σ for one-module models, the
trained expert's side of `boundary_ratio` for Wan 2.2 A14B, whose frozen expert runs the rest of every trajectory
(docs/models.md#wan-22). A transition or training time outside it has no gradient, so nothing trains there: the SDE
sampler places an SDE window (`sde_window_size` > 0) on such steps (`trainable_steps`), GRPO trains only such
transitions (`on_trainable_steps`), NFT, AWM and adjoint matching pick their training times among such grid times, RAM
draws its times inside the range. `check_trainable` refuses, before training, a config that leaves nothing there.
"""

from __future__ import annotations

import torch

from flowrl.types import FlowModel, Sampler


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
