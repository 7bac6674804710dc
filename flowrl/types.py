"""Data contracts shared by samplers, rewards, balancers and trainers.

Letters in shape comments: N local samples, B prompts, G group size, T denoising steps, K rewards,
C/H/W latent or image channels/height/width, F video frames, L tokens, D embedding width.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

# A conditioning is a flat dict of batch-first tensors (every value has N rows), e.g.
# {"prompt_embeds": [N, L, D], "pooled_prompt_embeds": [N, D], "negative_prompt_embeds": [N, L, D], ...}.
# Samplers and trainers slice it with `select_cond(cond, index)`; only the model adapter reads the keys.
Cond = dict[str, torch.Tensor]


def select_cond(cond: Cond, index: torch.Tensor | slice | list[int]) -> Cond:
    """Rows `index` of every tensor in a conditioning dict."""
    return {key: value[index] for key, value in cond.items()}


def concat_cond(conds: list[Cond]) -> Cond:
    """Concatenate conditioning dicts along the batch dimension (keys must agree)."""
    keys = conds[0].keys()
    return {key: torch.cat([c[key] for c in conds], dim=0) for key in keys}


@dataclass
class PromptBatch:
    prompts: list[str]  # [N]
    group_ids: torch.Tensor  # [N] int64; equal ids = same prompt group (may span processes)
    metadata: list[dict[str, Any]] = field(default_factory=list)  # [N] free-form per prompt (e.g. GenEval tags)
    seeds: torch.Tensor | None = None  # [N] int64 initial-noise seeds (None: the sampler's generator decides)

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.prompts) == 0:
            raise ValueError("PromptBatch.prompts is empty: pass at least one prompt")
        if len(self.group_ids) != len(self.prompts) or len(self.metadata) != len(self.prompts):
            raise ValueError(
                f"PromptBatch sizes disagree: prompts={len(self.prompts)} group_ids={len(self.group_ids)} "
                f"metadata={len(self.metadata)}; give one entry per sample"
            )


@dataclass
class Rollout:
    """Everything a trainer needs to recompute log-probs of a batch of trajectories."""

    latents: torch.Tensor  # [N, T+1, *latent_shape] float32; latents[:, 0] is the initial noise
    log_probs: torch.Tensor  # [N, T] float32 behaviour log-prob of each transition (0 where deterministic)
    sigmas: torch.Tensor  # [T+1] float32, sigmas[0] = 1 (or the start), sigmas[T] = 0
    images: torch.Tensor  # [N, 3, H, W] in [0, 1] (video: [N, F, 3, H, W])
    group_ids: torch.Tensor  # [N] int64
    prompts: list[str]  # [N]
    cond: Cond  # rows [N]: the encoded prompts (reused by the trainer's forward passes)
    noise_levels: torch.Tensor  # [N, T] float32 noise level used at each transition (0 = ODE step)
    kind: str = "ode"  # sde_step kind used for stochastic transitions
    guidance_scale: float = 1.0
    metadata: list[dict[str, Any]] = field(default_factory=list)  # [N]
    extras: dict[str, Any] = field(default_factory=dict)  # sampler-specific records (tree parents, previews...)

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    @property
    def train_mask(self) -> torch.Tensor:
        """[N, T] bool: transitions that were stochastic (the only ones a policy-gradient step may train on)."""
        return self.noise_levels > 0


@dataclass
class RewardOutput:
    scores: torch.Tensor  # [N] float32; NaN = not applicable to this sample
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # named sub-scores, each [N]


@runtime_checkable
class FlowModel(Protocol):
    """A flow-matching generator behind one interface (models/<family>.py, models/toy.py).

    Time convention (ALGORITHMS §0.1): x_sigma = (1 - sigma) x0 + sigma eps; velocity ~ eps - x0.
    """

    family: str  # "sd3", "flux", "sana", "wan", "toy"
    device: torch.device
    dtype: torch.dtype
    transformer: torch.nn.Module  # the denoiser that training updates (LoRA lives here)
    is_video: bool
    default_guidance_scale: float  # what samplers use when the config leaves guidance_scale unset

    def encode(self, prompts: list[str], negative_prompt: str = "", guidance_scale: float = 1.0) -> Cond:
        """Encode prompts (cached per prompt); rows [N]. Negative embeddings included when CFG is used."""

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        """Shape of one sample's latents, exactly as the diffusers pipeline lays them out."""

    def prepare_latents(
        self, num: int, height: int, width: int, generator: torch.Generator | list[torch.Generator] | None,
        num_frames: int | None = None,
    ) -> torch.Tensor:
        """Initial noise [num, *latent_shape] float32, identical to the pipeline's for the same generator."""

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        """The pipeline's sigma grid [T+1] float32 (computed by flowrl.sde)."""

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        """Velocity [N, *latent_shape] float32 at noise level sigma ([N] or scalar), CFG combined inside."""

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] (video [N, F, 3, H, W]) in [0, 1], float32."""

    def adapter_disabled(self) -> AbstractContextManager:
        """Context in which `velocity` is the reference (base) model."""


class Reward(Protocol):
    modalities: tuple[str, ...]  # ("image",), ("video",) or both
    differentiable: bool

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput: ...


# score_fn handed by trainers to samplers that rank candidates (tree pruning, candidate pools):
# (images [M, ...], prompts [M], metadata [M]) -> scores [M] float32
ScoreFn = Callable[[torch.Tensor, list[str], list[dict[str, Any]]], torch.Tensor]


class Sampler(Protocol):
    def __call__(
        self, model: FlowModel, batch: PromptBatch, generator: torch.Generator | None = None,
        score_fn: ScoreFn | None = None,
    ) -> Rollout: ...
