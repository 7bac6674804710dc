"""The rollout drift monitor of the kit (docs/math.md#rollout-drift): how far the model that made a step's rollout is
from the model its first optimizer step trains. `kit.build_parts` opens a `RolloutDrift` on the parts, `kit.collect`
calls `start_drift`, a recipe with the rollout's log-probs in its loss hands them to `rollout_drift`."""

from __future__ import annotations

import weakref

import torch

from flowrl import sde
from flowrl.schedules import trainable_steps
from flowrl.trainers.transitions import transition_inputs
from flowrl.training.loop import RecipeParts
from flowrl.types import Rollout

DRIFT_ROWS = 2  # rows of this process's batch whose transition at one step the velocity path runs again
DRIFT_LOG_PROB_LIMIT = 1e-4  # |Δ log p| beyond Flow-GRPO's clip range ε = 1e-4: a first-pass ratio outside [1 ± ε]


class RolloutDrift:
    """How far the model that made a step's rollout is from the model its first optimizer step trains
    (docs/math.md#rollout-drift), over this process's samples: `drift/logprob_abs_mean`, `drift/logprob_abs_max` and
    `drift/logprob_beyond` (the share of |Δ log p| > DRIFT_LOG_PROB_LIMIT) for stochastic transitions, where Δ log p is
    the trained model's log-prob of a recorded transition minus the rollout's; `drift/velocity_rel` and
    `drift/velocity_rel_max`, ||v_rollout − v_trained|| / ||v_trained||, for deterministic ones. A recipe that takes
    its ratio to the rollout's log-probs (`from_log_probs`, GRPO) hands its first pass's log-probs to `rollout_drift`
    at no cost; for the others `start_drift` runs DRIFT_ROWS rows at one step again (counted by the work meter as
    training forwards)."""

    def __init__(self, from_log_probs: bool):
        self.from_log_probs = from_log_probs
        self.opened_for = None  # a weak reference to the rollout the window is open for (measured once, not kept)
        self.window: int | None = None  # the optimizer step count at the rollout; observed until it moves
        self.log_prob: list[torch.Tensor] = []  # |Δ log p| [b] per observation
        self.velocity: list[torch.Tensor] = []  # ||Δv|| / ||v|| [b] per observation

    def open(self, optimizer_steps: int | None, rollout: Rollout | None = None) -> None:
        self.window, self.log_prob, self.velocity = optimizer_steps, [], []
        self.opened_for = None if rollout is None else weakref.ref(rollout)

    def is_open_for(self, rollout: Rollout) -> bool:
        return self.opened_for is not None and self.opened_for() is rollout

    def close(self) -> dict[str, float]:
        """The step's metrics, then nothing observed until the next rollout opens the window again."""
        out = self.metrics()
        self.open(None)
        return out

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.log_prob:
            delta = torch.cat(self.log_prob).double()
            out["drift/logprob_abs_mean"] = float(delta.mean())
            out["drift/logprob_abs_max"] = float(delta.max())
            out["drift/logprob_beyond"] = float((delta > DRIFT_LOG_PROB_LIMIT).double().mean())
        if self.velocity:
            relative = torch.cat(self.velocity).double()
            out["drift/velocity_rel"] = float(relative.mean())
            out["drift/velocity_rel_max"] = float(relative.max())
        return out


def rollout_drift(parts: RecipeParts, log_prob: torch.Tensor, rollout: Rollout, index, k) -> None:
    """Called by a recipe on each pass of its trained transitions: before the first optimizer step after the rollout,
    |log_prob − the rollout's log-prob| of transitions k of rows `index` (this step's own samples; replayed rows past
    local_n are left out) joins the step's drift; later passes are ignored. Costs no forward."""
    drift = parts.drift
    if drift is None or drift.window != parts.opt.optimizer_steps:
        return
    fresh = index < parts.local_n
    behaviour = rollout.log_probs.to(log_prob.device)[index[fresh], k[fresh]]
    drift.log_prob.append((log_prob.detach()[fresh].float() - behaviour.float()).abs().cpu())


@torch.no_grad()
def start_drift(parts: RecipeParts, rollout: Rollout) -> None:
    """At a step's rollout (kit.collect; a recipe whose rollout comes from elsewhere, NFT's async thread, calls it on
    the live parts): open the drift window, once per rollout. A recipe without the rollout's log-probs in its loss
    (the velocity path) measures now, before its first optimizer step: the first DRIFT_ROWS rows' transitions at the
    middle of the steps on the trained σ range run through the trained model (no grad, the rollout's guidance); a
    deterministic transition gives ||x̂' − x'|| / (|Δσ|·||v||), x̂' its Euler step with the trained velocity v (=
    ||v_rollout − v|| / ||v||), a stochastic one |Δ log p| under the rollout's step rule."""
    drift, model = parts.drift, parts.model
    trained = parts.opt.params[0] if parts.opt.params else None
    if drift is None or drift.is_open_for(rollout) or not any(p is trained for p in model.transformer.parameters()):
        return  # opened already, or a rollout on another copy of the transformer (NFT's async rollout thread)
    drift.open(parts.opt.optimizer_steps, rollout)
    if drift.from_log_probs:
        return
    device = parts.accelerator.device
    steps = trainable_steps(model, rollout.sigmas).nonzero().flatten().tolist()
    rows = min(DRIFT_ROWS, len(rollout.prompts))
    if not steps or rows == 0:
        return
    sigmas = rollout.sigmas.to(device)
    index = torch.arange(rows, device=device)
    k = torch.full((rows,), steps[len(steps) // 2], device=device)
    cond, x, x_next, sigma, sigma_next, level, scale = transition_inputs(rollout, sigmas, index, k)
    v = model.velocity(x, sigma, cond, rollout.guidance_scale).float()
    stochastic = level > 0
    if stochastic.any():
        log_prob, _ = sde.rescore_transition(rollout.rule, v, x, x_next, sigma, sigma_next, level, None, "code", scale)
        behaviour = rollout.log_probs.to(device)[index, k]
        drift.log_prob.append((log_prob - behaviour)[stochastic].abs().cpu())
    if not stochastic.all():
        euler, _, _, _ = sde.sde_step(v, x.float(), sigma, sigma_next, "ode", 0.0)
        step = (sigma - sigma_next).abs().float()
        relative = (euler - x_next).flatten(1).norm(dim=1) / (step * v.flatten(1).norm(dim=1))
        drift.velocity.append(relative[~stochastic].cpu())
