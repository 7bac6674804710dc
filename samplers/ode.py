"""Deterministic rollouts: the flow ODE with Euler steps (what evaluation and reward-only rollouts use).

`scheduler="euler"` steps on the model's flow-matching grid through `flowrl.sde` (identical to the diffusers
pipeline with FlowMatchEulerDiscreteScheduler); `scheduler="pipeline"` steps with the pipeline's own
scheduler (UniPC, DPM-Solver, ...) so that evaluation images match what users get from diffusers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl import sde
from flowrl.registry import SAMPLERS
from flowrl.samplers._rollout import integrate, resolve_size, start_rollout
from flowrl.schedules import trainable_steps
from flowrl.types import FlowModel, Lossy, PromptBatch, Rollout, ScoreFn


@SAMPLERS.register("ode")
@dataclass
class ODESampler:
    whole_groups: ClassVar[bool] = False  # every sample is its own ODE: a group may span chunks and processes
    recipe_variants: ClassVar[dict[str, dict]] = {"": {}}

    num_steps: int = 20
    height: int | None = None
    """None = the model's native size (its pipeline's default)."""
    width: int | None = None
    num_frames: int | None = None
    guidance_scale: float | None = None
    """CFG scale; None = the family's default."""
    negative_prompt: str = ""
    same_latent: bool = False
    scheduler: str = "euler"
    """'euler' (flow-matching Euler on the model's grid) or 'pipeline' (the checkpoint's own scheduler)."""
    decode: bool = True

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1")
        if self.scheduler not in ("euler", "pipeline"):
            raise ValueError(f"scheduler={self.scheduler!r} must be 'euler' or 'pipeline'")

    def carries(self) -> frozenset[str]:
        """What its rollouts hold for a trainer (docs/recipes/compose.md): clean endpoints, no behaviour log-probs."""
        return frozenset({"clean_endpoints"})

    def lossy(self) -> tuple[Lossy, ...]:
        """None of its options is lossy: every transition is the full-precision policy's (docs/recipes/compose.md)."""
        return ()

    def trained_steps(self, model: FlowModel, stochastic_only: bool = False) -> torch.Tensor | None:
        """[T] bool: the steps of the Euler grid on the σ the model trains (none with `stochastic_only`: every step is
        deterministic); None for scheduler='pipeline', whose grid the checkpoint's own scheduler sets at run time."""
        if self.scheduler != "euler":
            return None
        steps = trainable_steps(model, model.sigmas(self.num_steps, *resolve_size(self, model)))
        return torch.zeros_like(steps) if stochastic_only else steps

    def check_groups(self, group_size: int, chunk_size: int | None = None, num_chunks: int = 1) -> None:
        """Any group size and chunking: every sample is rolled out on its own."""

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        return {}

    @torch.no_grad()
    def __call__(
        self,
        model: FlowModel,
        batch: PromptBatch,
        generator: torch.Generator | None = None,
        score_fn: ScoreFn | None = None,
        step: int = 0,
    ) -> Rollout:
        # 1. Prompts and 2. initial noise, one generator per sample (= the pipeline called with that seed)
        guidance, cond, seeds, latents, size = start_rollout(self, model, batch, generator)
        # 3-4. Denoising loop
        if self.scheduler == "pipeline":
            trajectory, sigmas = self._pipeline_scheduler_loop(model, latents, cond, guidance, size)
        else:
            sigmas = model.sigmas(self.num_steps, *size).to(model.device)  # [T+1]
            levels = torch.zeros(len(seeds), self.num_steps, device=model.device)  # [N, T]
            trajectory, _ = integrate(model, latents, sigmas, cond, guidance, levels, sde.StepRule("ode"), None)
        # 5. Decode
        images = model.decode(trajectory[:, -1]) if self.decode else torch.empty(0)
        n, t = len(seeds), trajectory.shape[1] - 1
        return Rollout(
            latents=trajectory,
            log_probs=torch.zeros(n, t),
            sigmas=sigmas.float().cpu(),
            images=images,
            group_ids=batch.group_ids,
            prompts=list(batch.prompts),
            cond=cond,
            noise_levels=torch.zeros(n, t),
            rule=sde.StepRule("ode"),
            guidance_scale=guidance,
            metadata=list(batch.metadata),
            extras={"seeds": seeds},
        )

    def _pipeline_scheduler_loop(self, model, latents, cond, guidance, size):
        """Step with a fresh copy of the checkpoint's own scheduler (multistep solvers keep state)."""
        pipe = getattr(model, "pipe", None)
        if pipe is None:
            raise ValueError(
                f"scheduler='pipeline' needs a diffusers-backed model; {model.family!r} has no pipeline scheduler"
            )
        scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
        kwargs = {}
        accepted = inspect.signature(scheduler.set_timesteps).parameters
        custom = model.custom_sigmas(self.num_steps)
        if custom is not None and "sigmas" in accepted:
            kwargs["sigmas"] = custom
        if scheduler.config.get("use_dynamic_shifting", False) and "mu" in accepted:
            kwargs["mu"] = model.shift_mu(self.num_steps, *size)
        scheduler.set_timesteps(self.num_steps, device=model.device, **kwargs)
        x = latents
        trajectory = [x.float()]
        for t in scheduler.timesteps:
            sigma = t.float() / scheduler.config.num_train_timesteps
            v = model.velocity(x, sigma, cond, guidance)
            x = scheduler.step(v, t, x, return_dict=False)[0].float()
            trajectory.append(x)
        sigmas = torch.cat([scheduler.timesteps.float().cpu() / scheduler.config.num_train_timesteps, torch.zeros(1)])
        return torch.stack(trajectory, dim=1), sigmas
