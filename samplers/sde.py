"""SDE rollouts with per-step log-probs (Flow-GRPO, DanceGRPO, CPS), optional SDE windows.

    sampler = SDESampler(num_steps=10, kind="flow_grpo", noise_level=0.7, height=512, width=512)
    rollout = sampler(model, PromptBatch(prompts, group_ids, seeds=seeds))

Every sample owns its randomness: its initial noise comes from `torch.Generator().manual_seed(seed)` (the same
latents the diffusers pipeline draws for that seed), its step noise from a second generator seeded from the
same seed, so a trajectory does not depend on which other samples share the batch or the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl import schedules, sde
from flowrl.registry import SAMPLERS
from flowrl.samplers._rollout import integrate, resolve_size, start_rollout
from flowrl.schedules import describe, trainable_steps
from flowrl.sde_memoryless import MEMORYLESS_NOISE_LEVEL
from flowrl.seeds import NOISE_STREAM, sample_generators, window_start
from flowrl.types import FlowModel, Lossy, PromptBatch, Rollout, ScoreFn


@SAMPLERS.register("sde")
@dataclass
class SDESampler:
    """Stochastic rollouts that record every latent and the behaviour log-prob of every transition."""

    whole_groups: ClassVar[bool] = False  # every sample owns its randomness: a group may span chunks and processes
    recipe_variants: ClassVar[dict[str, dict]] = {  # the rows `flowrl recipes` lists for this sampler
        "": {},
        "memoryless": {  # adjoint matching's rollout: flow_grpo steps with a = √2 on a uniform grid short of σ = 1
            "kind": "flow_grpo",
            "noise_level": MEMORYLESS_NOISE_LEVEL,
            "sigma_schedule": "dance",
            "sigma_shift": 1.0,
            "sigma_max": 0.975,
        },
    }

    num_steps: int = 10
    """Denoising steps T of a rollout (Flow-GRPO trains SD3.5 with 10, FLUX with 6)."""
    height: int | None = None
    """None = the model's native size (its pipeline's default)."""
    width: int | None = None
    num_frames: int | None = None
    """Video models only: frames per clip (None = the model's default)."""
    guidance_scale: float | None = None
    """CFG scale (FLUX: the guidance embedding); None = the family's default."""
    negative_prompt: str = ""
    kind: str = "flow_grpo"
    """sde_step kind: flow_grpo (g = a·sqrt(σ/(1−σ))), dance (g = η), cps (coefficient-preserving)."""
    noise_level: float = 0.7
    """a for flow_grpo/cps, η for dance."""
    log_prob_mode: str = "gaussian"
    """'gaussian' (exact density) or 'cps_sq' (flow_grpo's CPS quirk, offered for reproduction only)."""
    same_latent: bool = False
    """Share the initial noise within a prompt group (DanceGRPO)."""
    sde_window_size: int = 0
    """W > 0: only W consecutive transitions are stochastic (Flow-GRPO-Fast / MixGRPO); 0 = all but the last."""
    sde_window_range: tuple[int, int] | None = None
    """[r0, r1): where the window may lie; None = (0, T - 1)."""
    sde_window_mode: str = "random"
    """'random': window start ~ UniformInt[r0, r1 - W] per sample; 'sliding': moves with `step` (MixGRPO)."""
    sde_window_shift_every_n_steps: int = 1
    """Sliding windows advance by one transition every this many training steps."""
    sigma_schedule: str = "model"
    """'model' (the pipeline's scheduler grid) or 'dance' (shift(linspace(1, 0, T+1)), DanceGRPO/BranchGRPO)."""
    sigma_shift: float = 3.0
    """Shift of the 'dance' grid."""
    sigma_max: float = 1.0
    """Where the 'dance' grid starts (< 1 stops short of pure noise: adjoint matching's offset)."""
    decode: bool = True

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1")
        if self.noise_level < 0:
            raise ValueError(f"noise_level={self.noise_level} must be >= 0")
        if self.kind not in sde.KINDS:
            raise ValueError(f"kind={self.kind!r} is not one of {', '.join(sde.KINDS)}")
        self.rule = sde.StepRule(self.kind, self.log_prob_mode)
        if self.sde_window_mode not in ("random", "sliding"):
            raise ValueError(f"sde_window_mode={self.sde_window_mode!r} must be 'random' or 'sliding'")
        if self.sigma_schedule not in ("model", "dance"):
            raise ValueError(f"sigma_schedule={self.sigma_schedule!r} must be 'model' or 'dance'")
        if self.sigma_max != 1.0 and self.sigma_schedule != "dance":
            raise ValueError(
                f"sigma_max={self.sigma_max} applies to sigma_schedule='dance' only; set sigma_schedule: dance"
            )
        r0, r1 = self.window_range()
        if self.sde_window_size < 0 or (
            self.sde_window_size and not (0 <= r0 and r0 + self.sde_window_size <= r1 <= self.num_steps)
        ):
            raise ValueError(
                f"sde_window_size={self.sde_window_size} does not fit sde_window_range=({r0}, {r1}) of "
                f"{self.num_steps} steps; need 0 <= r0 and r0 + size <= r1 <= num_steps"
            )

    def carries(self) -> frozenset[str]:
        """What its rollouts hold for a trainer (docs/recipes/compose.md): clean endpoints; behaviour log-probs where
        some transition is stochastic, `gaussian_steps` where they are exact Gaussian densities and `flow_grpo_steps`
        where the steps are Flow-GRPO's; `memoryless` for the memoryless SDE (flow_grpo kind, a = √2, every transition
        stochastic) on a grid that stops short of σ = 1."""
        out = {"clean_endpoints"} | ({"log_probs"} if self.noise_level > 0 else set())
        if self.noise_level > 0 and self.kind != "ode" and self.log_prob_mode == "gaussian":
            out |= {"gaussian_steps"} | ({"flow_grpo_steps"} if self.kind == "flow_grpo" else set())
        memoryless = self.kind == "flow_grpo" and abs(self.noise_level - MEMORYLESS_NOISE_LEVEL) < 1e-6
        if memoryless and not self.sde_window_size and self.sigma_max < 1.0:
            out.add("memoryless")
        return frozenset(out)

    def lossy(self) -> tuple[Lossy, ...]:
        """None of its options is lossy: every transition is the full-precision policy's (docs/recipes/compose.md)."""
        return ()

    def trained_steps(self, model: FlowModel, stochastic_only: bool = False) -> torch.Tensor:
        """[T] bool: the steps of its grid on the σ the model trains; with `stochastic_only`, those some sample draws
        stochastically (every step but the last, or the range its window lies in, which `window_range` places on the
        trained steps and raises where it cannot)."""
        steps = trainable_steps(model, self.grid(model))
        return steps & self.stochastic_steps(steps) if stochastic_only else steps

    def stochastic_steps(self, trainable: torch.Tensor | None = None) -> torch.Tensor:
        """[T] bool: the steps whose transition is stochastic for some sample (`noise_levels` > 0 in some row)."""
        t = self.num_steps
        if self.noise_level == 0:
            return torch.zeros(t, dtype=torch.bool)
        lo, hi = (0, max(t - 1, 1)) if self.sde_window_size == 0 else self.window_range(trainable)
        cols = torch.arange(t)
        return (cols >= lo) & (cols < hi)

    def check_groups(self, group_size: int, chunk_size: int | None = None, num_chunks: int = 1) -> None:
        """Any group size and chunking: a group's shared noise (same_latent) comes from its global group seed."""

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        return {}

    def window_range(self, trainable: torch.Tensor | None = None) -> tuple[int, int]:
        """[r0, r1) where the window may lie; with `trainable` [T] bool, only among the steps the model trains."""
        r0, r1 = (0, max(self.num_steps - 1, 1)) if self.sde_window_range is None else tuple(self.sde_window_range)
        if trainable is None or bool(trainable.all()):
            return r0, r1
        index = trainable.nonzero().flatten().tolist()  # contiguous on a monotone grid
        lo, hi = max(r0, index[0] if index else r1), min(r1, index[-1] + 1 if index else r1)
        if hi - lo < self.sde_window_size:
            raise ValueError(
                f"sampler.sde_window_size={self.sde_window_size} in sde_window_range=({r0}, {r1}) of {self.num_steps} "
                f"steps: the model trains {describe(trainable)} only (model.train_expert's σ range); move the window "
                "there or train the other expert"
            )
        return lo, hi

    def grid(self, model: FlowModel) -> torch.Tensor:
        if self.sigma_schedule == "dance":
            return schedules.dance_sigmas(self.num_steps, self.sigma_shift, self.sigma_max)
        return model.sigmas(self.num_steps, *resolve_size(self, model))

    def noise_levels(self, seeds: torch.Tensor, step: int = 0, trainable: torch.Tensor | None = None) -> torch.Tensor:
        """[N, T] noise level of each transition: the window's steps get `noise_level`, the rest 0 (Euler). `trainable`
        [T] bool: the steps the model trains (flowrl.schedules; None = all): a window lies among them (without a
        window every step but the last stays stochastic, the rollout's law, and a trainer trains the trainable ones)."""
        n, t = len(seeds), self.num_steps
        levels = torch.zeros(n, t, dtype=torch.float32)  # [N, T]
        if self.noise_level == 0:
            return levels
        if self.sde_window_size == 0:
            # every transition but the last (σ_{T-1} -> 0 is a near-degenerate Gaussian), as Flow-GRPO trains
            levels[:, : max(t - 1, 1)] = self.noise_level
            return levels
        r0, r1 = self.window_range(trainable)
        w = self.sde_window_size
        if self.sde_window_mode == "sliding":
            starts = torch.full((n,), r0 + (step // self.sde_window_shift_every_n_steps) % (r1 - w - r0 + 1))
        else:
            starts = torch.tensor([window_start(s, r0, r1 - w) for s in seeds.tolist()])
        cols = torch.arange(t)
        inside = (cols[None] >= starts[:, None]) & (cols[None] < starts[:, None] + w)
        levels[inside] = self.noise_level
        return levels

    @torch.no_grad()
    def __call__(
        self,
        model: FlowModel,
        batch: PromptBatch,
        generator: torch.Generator | None = None,
        score_fn: ScoreFn | None = None,
        step: int = 0,
    ) -> Rollout:
        # 1. Prompts and 2. initial noise, one generator per sample
        guidance, cond, seeds, latents, _ = start_rollout(self, model, batch, generator)
        # 3. Time grid and per-transition noise levels
        sigmas = self.grid(model).to(model.device)  # [T+1]
        levels = self.noise_levels(seeds, step, trainable_steps(model, sigmas)).to(model.device)  # [N, T]
        # 4. Denoising loop
        noise_generators = sample_generators(seeds, model.device, offset=NOISE_STREAM)
        trajectory, log_probs = integrate(model, latents, sigmas, cond, guidance, levels, self.rule, noise_generators)
        # 5. Decode
        images = model.decode(trajectory[:, -1]) if self.decode else torch.empty(0)
        return Rollout(
            latents=trajectory,
            log_probs=log_probs,
            sigmas=sigmas.float(),
            images=images,
            group_ids=batch.group_ids,
            prompts=list(batch.prompts),
            cond=cond,
            noise_levels=levels,
            rule=self.rule,
            guidance_scale=guidance,
            metadata=list(batch.metadata),
            extras={"seeds": seeds},
        )
