"""Data contracts shared by samplers, rewards, balancers and trainers.

Letters in shape comments: N local samples, B prompts, G group size, T denoising steps, K rewards,
C/H/W latent or image channels/height/width, F video frames, L tokens, D embedding width.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import torch

from flowrl.sde import StepRule, transition_stds

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
    seeds: torch.Tensor | None = None  # [N] int64 per-sample seeds (None: the sampler's generator decides)
    global_index: torch.Tensor | None = None  # [N] int64 position of each sample in the step's global batch
    group_seeds: torch.Tensor | None = None  # [N] int64 one seed per global group (shared initial noise)

    def __post_init__(self) -> None:
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]
        if len(self.prompts) == 0:
            raise ValueError("PromptBatch.prompts is empty: pass at least one prompt")
        sizes = {"group_ids": len(self.group_ids), "metadata": len(self.metadata)}
        for name in ("seeds", "global_index", "group_seeds"):
            if getattr(self, name) is not None:
                sizes[name] = len(getattr(self, name))
        if any(n != len(self.prompts) for n in sizes.values()):
            listed = " ".join(f"{k}={v}" for k, v in sizes.items())
            raise ValueError(
                f"PromptBatch sizes disagree: prompts={len(self.prompts)} {listed}; give one entry per sample"
            )

    def select(self, rows: slice | torch.Tensor | list[int]) -> PromptBatch:
        """The samples `rows` of this batch (a slice or indices), every field alike."""
        index = list(range(len(self.prompts)))[rows] if isinstance(rows, slice) else [int(i) for i in rows]

        def pick(t):
            return None if t is None else t[index]

        return PromptBatch(
            [self.prompts[i] for i in index],
            self.group_ids[index],
            [self.metadata[i] for i in index],
            seeds=pick(self.seeds),
            global_index=pick(self.global_index),
            group_seeds=pick(self.group_seeds),
        )


@dataclass
class Rollout:
    """Everything a trainer needs to recompute log-probs of a batch of trajectories.

    `rule` says how the stochastic steps were drawn and scored (kind, log-prob mode, first-step rule);
    `transitions` is the flat table of trainable (sample, step) pairs: those whose Gaussian has std > 0.
    A rollout of clean endpoints only (no trajectories) has an empty table.

    Latents are stored one of two ways; read them with `states(rows, steps)`, `paths()` or `final_latents()`:
    per sample, `latents` [N, T+1, ...] (latent_index None), or as a table of distinct states, `latents` [V, ...]
    with `latent_index` [N, T+1] naming each sample's state at each step (a tree's shared prefixes stored once).
    """

    # [N, T+1, *latent_shape] float32, latents[:, 0] the initial noise; or [V, ...] (latent_index)
    latents: torch.Tensor
    log_probs: torch.Tensor  # [N, T] float32 behaviour log-prob of each transition (0 where deterministic)
    sigmas: torch.Tensor  # [T+1] float32, sigmas[0] = 1 (or the start), sigmas[T] = 0
    images: torch.Tensor  # [N, 3, H, W] in [0, 1] (video: [N, F, 3, H, W])
    group_ids: torch.Tensor  # [N] int64
    prompts: list[str]  # [N]
    cond: Cond  # rows [N]: the encoded prompts (reused by the trainer's forward passes)
    noise_levels: torch.Tensor  # [N, T] float32 noise level used at each transition (0 = ODE step)
    rule: StepRule = field(default_factory=StepRule)  # how stochastic steps were drawn and scored
    transitions: torch.Tensor | None = None  # [M, 2] int64 (sample, step) pairs with std > 0; None = derive
    std_scales: torch.Tensor | None = None  # [N, T] float32 multiplier of each transition's std (tree splits); None = 1
    guidance_scale: float = 1.0
    metadata: list[dict[str, Any]] = field(default_factory=list)  # [N]
    extras: dict[str, Any] = field(default_factory=dict)  # sampler-specific records (tree parents, previews...)
    # [N, T+1] int64 rows of a state table `latents` [V, ...]; None = per sample
    latent_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.latent_index is not None:
            expected = (len(self.prompts), self.log_probs.shape[1] + 1)
            if tuple(self.latent_index.shape) != expected or int(self.latent_index.max()) >= len(self.latents):
                raise ValueError(
                    f"Rollout.latent_index has shape {tuple(self.latent_index.shape)}, "
                    f"max {int(self.latent_index.max())}: it needs shape {expected} (samples, steps + 1) with rows of "
                    f"the {len(self.latents)}-state table latents"
                )
        if self.transitions is None:
            stds = transition_stds(self.rule, self.sigmas, self.noise_levels)  # [N, T]
            self.transitions = (stds > 0).nonzero().to(torch.int64).cpu()  # [M, 2], sample-major
        if not self.metadata:
            self.metadata = [{} for _ in self.prompts]

    @property
    def kind(self) -> str:
        return self.rule.kind

    @property
    def num_steps(self) -> int:
        return self.log_probs.shape[1]

    def states(self, rows: torch.Tensor, steps: torch.Tensor | int) -> torch.Tensor:
        """[b, ...] the latent of sample rows[j] at step steps[j] (steps: [b] or one step for all), gathered from
        whichever storage the rollout has; the only copy is of these b states."""
        if self.latent_index is None:
            return self.latents[rows, steps]
        return self.latents[self.latent_index[rows, steps]]

    def paths(self) -> torch.Tensor:
        """[N, T+1, ...] every sample's whole path (a copy per sample where the latents are a shared table)."""
        return self.latents if self.latent_index is None else self.latents[self.latent_index]

    def final_latents(self) -> torch.Tensor:
        """[N, ...] the clean endpoint of every sample."""
        return self.latents[:, -1] if self.latent_index is None else self.latents[self.latent_index[:, -1]]

    def state_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [V, ...], index [N, T+1]) of the latents: the table itself, or the per-sample latents flattened."""
        if self.latent_index is not None:
            return self.latents, self.latent_index
        n, width = self.latents.shape[:2]
        index = torch.arange(n * width, device=self.latents.device).view(n, width)
        return self.latents.flatten(0, 1), index

    @classmethod
    def concat(cls, parts: list[Rollout]) -> Rollout:
        """Rollouts of one sampler (same grid, rule, guidance) stacked along the samples; extras too.

        An extra that is a tensor or list with one row per sample is concatenated; any other extra must be
        equal in every part and is kept once.
        """
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        for p in parts[1:]:
            if (
                p.rule != first.rule
                or p.guidance_scale != first.guidance_scale
                or not torch.equal(p.sigmas, first.sigmas)
            ):
                raise ValueError(
                    "Rollout.concat: parts differ in step rule, guidance or sigma grid; concat one sampler's output"
                )
        offsets = [0]
        for p in parts:
            offsets.append(offsets[-1] + len(p.prompts))
        transitions = torch.cat([p.transitions + torch.tensor([o, 0]) for p, o in zip(parts, offsets)])
        extras = {}
        for key, value in first.extras.items():
            values = [p.extras.get(key) for p in parts]
            rows = [len(p.prompts) for p in parts]
            if isinstance(value, torch.Tensor) and all(
                isinstance(v, torch.Tensor) and len(v) == n for v, n in zip(values, rows)
            ):
                extras[key] = torch.cat(values)
            elif isinstance(value, list) and all(isinstance(v, list) and len(v) == n for v, n in zip(values, rows)):
                extras[key] = [x for v in values for x in v]
            elif all(_same(v, value) for v in values):
                extras[key] = value
            else:
                raise ValueError(f"Rollout.concat: extra {key!r} is neither per-sample nor equal in every part")
        latent_index = None
        if all(p.latent_index is None for p in parts):
            latents = torch.cat([p.latents for p in parts])
        else:  # state tables: one table, each part's index shifted past the tables before it
            tables, indices, start = [], [], 0
            for p in parts:
                table, index = p.state_table()
                tables.append(table)
                indices.append(index + start)
                start += len(table)
            latents, latent_index = torch.cat(tables), torch.cat(indices)
        return cls(
            latents=latents,
            log_probs=torch.cat([p.log_probs for p in parts]),
            sigmas=first.sigmas,
            images=torch.cat([p.images for p in parts]),
            group_ids=torch.cat([p.group_ids for p in parts]),
            prompts=[x for p in parts for x in p.prompts],
            cond=concat_cond([p.cond for p in parts]),
            noise_levels=torch.cat([p.noise_levels for p in parts]),
            rule=first.rule,
            transitions=transitions,
            std_scales=None
            if all(p.std_scales is None for p in parts)
            else torch.cat(
                [p.std_scales if p.std_scales is not None else torch.ones_like(p.noise_levels) for p in parts]
            ),
            guidance_scale=first.guidance_scale,
            metadata=[x for p in parts for x in p.metadata],
            extras=extras,
            latent_index=latent_index,
        )


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    return a == b


@dataclass
class RewardOutput:
    scores: torch.Tensor  # [N] float32; NaN = not applicable to this sample
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # named sub-scores, each [N]


@runtime_checkable
class FlowModel(Protocol):
    """A flow-matching generator behind one interface (models/<family>.py, models/toy.py).

    Time convention (docs/math.md#sigma-time-convention): x_sigma = (1 - sigma) x0 + sigma eps; velocity ~ eps - x0.
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
        self,
        num: int,
        height: int,
        width: int,
        generator: torch.Generator | list[torch.Generator] | None,
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

    def trainable_sigma_range(self) -> tuple[float, float]:
        """[lo, hi]: the σ at which `velocity` runs `transformer` (the trained module); (0, 1) unless a family's
        other module runs part of the trajectory (Wan 2.2 A14B's frozen expert). Nothing trains outside it."""


class Reward(Protocol):
    modalities: tuple[str, ...]  # ("image",), ("video",) or both
    differentiable: bool
    extra_requires: tuple[str, ...]  # pip packages it imports beyond flowrl's own (`flowrl rewards list` checks them)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput: ...


# score_fn handed by trainers to samplers that rank candidates (tree pruning, candidate pools):
# (images [M, ...], prompts [M], metadata [M]) -> scores [M] float32
ScoreFn = Callable[[torch.Tensor, list[str], list[dict[str, Any]]], torch.Tensor]


CARRIES = {  # what a sampler's rollouts may hold (Sampler.carries())
    "clean_endpoints": "the clean endpoint x0 of every sample",
    "log_probs": "behaviour log-probs of stochastic transitions (a policy-gradient ratio can be taken)",
    "per_edge": "transitions shared by several samples (a tree's edges): credit is per edge, not per sample",
    "memoryless": "the memoryless SDE of the current model on a grid short of σ = 1 (adjoint matching's law)",
    "gaussian_steps": "each stochastic transition is scored by the exact density of the Gaussian it was drawn from (a "
    "trainer can recompute its mean and std: GRPO-Guard's RatioNorm, Flow-DPPO's KL mask)",
    "flow_grpo_steps": "the stochastic transitions are Flow-GRPO's SDE steps, g = a·√(σ/(1 − σ)) (what GRPO-Guard's "
    "1/Δσ reweighting equalises)",
}
NEEDS = {  # what a balancer may ask of the trainer (Balancer.needs()), beyond one advantage per sample
    "sample_mask": "the samples the balancer's `keep` masks take no part in the loss",
    "reward_gradients": "each reward's loss is backpropagated on its own (MARBLE balances the K gradients)",
    "per_sample_advantages": "a sample's advantage trains its whole rollout (not fused up a tree's edges)",
    "affine_loss": "the loss's gradient is affine in the advantage, so one backward on Σ α_k A_k = Σ α_k ∇ℓ(A_k)",
}


LOSSES = {  # what a lossy sampler option changes in the transitions it makes (Sampler.lossy())
    "precision": "a low-precision copy of the policy (FP8, FP4, int8, bf16) computed the velocity: the transitions and "
    "their log-probs are not the policy's",
    "cache": "diffusers cache hooks reused earlier features in place of the velocity: the transitions and their "
    "log-probs are not the policy's",
    "steps": "fewer steps than num_steps: each transition is the policy's own (exact log-probs), the sample a coarser "
    "solve than the regenerated one",
}


class Lossy(NamedTuple):
    """A sampler option whose transitions are not the full-precision policy's at the sampler's num_steps."""

    option: str  # the config key and value that make them, e.g. "sampler.preview_backend='fake_nvfp4+few_step'"
    loss: str  # what it changes, a key of LOSSES
    trained: bool  # its transitions are the rollout a trainer trains on (False: previews that only rank seeds)
    fix: str  # how to train on the policy's own transitions instead, e.g. "set sampler.train_on=full (...)"


class Sampler(Protocol):
    """Rollouts for a trainer (samplers/: ode, sde, tree, candidates). What a recipe reads of a sampler is declared
    here, not looked up: what its rollouts carry, the steps of its grid that train on a model, its guidance and its
    metrics."""

    num_steps: int  # denoising steps T of a rollout
    guidance_scale: float | None  # CFG scale; None = the model's `default_guidance_scale`
    # every prompt group is rolled out in one call, on one process (trees, candidate pools)
    whole_groups: ClassVar[bool]
    recipe_variants: ClassVar[dict[str, dict]]  # the rows `flowrl recipes` lists for it: {suffix: its arguments}

    def __call__(
        self,
        model: FlowModel,
        batch: PromptBatch,
        generator: torch.Generator | None = None,
        score_fn: ScoreFn | None = None,
        step: int = 0,
    ) -> Rollout:
        """`step` is the training step (samplers whose schedule moves with training read it)."""

    def carries(self) -> frozenset[str]:
        """What its rollouts hold for a trainer, in the vocabulary of CARRIES."""

    def lossy(self) -> tuple[Lossy, ...]:
        """Its options whose transitions are not the full-precision policy's at num_steps (low-precision, cached or
        few-step previews), each with what it changes (LOSSES) and whether a trainer trains on them; () where every
        transition is the policy's own (docs/recipes/compose.md#lossless-and-lossy-rollouts)."""

    def trained_steps(self, model: FlowModel, stochastic_only: bool = False) -> torch.Tensor | None:
        """[T] bool: the steps of its grid for `model` that carry a trainable transition (the σ the model trains,
        flowrl.schedules); with `stochastic_only`, only those some rollout draws stochastically. None where the grid
        is known only at run time (a pipeline scheduler). Raises where its own settings cannot meet the model's range
        (an SDE window that cannot lie on trained steps)."""

    def check_groups(self, group_size: int, chunk_size: int | None = None, num_chunks: int = 1) -> None:
        """Raise a one-line error where prompt groups of `group_size` samples (rolled out in `num_chunks` chunks of
        `chunk_size` samples per process, once those are known) do not suit the sampler (a tree has one leaf per
        sample of its group)."""

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        """The step's metrics of this sampler's rollout (candidate pools: preview/full rank fidelity; {} for most)."""


@dataclass
class Balance:
    """What a balancer returns, over the M samples of the gathered batch."""

    advantages: torch.Tensor  # [M] float32; 0 for a sample no reward applies to
    keep: torch.Tensor  # [M] bool: samples the method keeps in the loss (all True without a mask)
    per_reward: torch.Tensor | None  # [K, M] float32 per-reward advantages, rows in the order of `scores`; or None
    metrics: dict[str, float]


class Balancer(Protocol):
    """Scores of K rewards -> one advantage per sample (flowrl/balancers/, docs/math.md#multi-reward-balancing)."""

    recipe_variants: ClassVar[dict[str, dict]]  # the rows `flowrl recipes` lists for it: {suffix: its arguments}

    def needs(self) -> frozenset[str]:
        """What it asks of the trainer beyond one advantage per sample, in the vocabulary of NEEDS
        ("reward_gradients": a `GradientBalancer` whose per-reward gradients the recipe balances)."""

    def __call__(self, scores: dict[str, torch.Tensor], group_ids: torch.Tensor, weights: dict[str, float]) -> Balance:
        """scores {name: [M]} (NaN = not applicable), group_ids [M], weights {name: w} -> Balance over the M samples."""


class GradientBalancer(Balancer, Protocol):
    """A balancer whose `needs()` holds "reward_gradients" (MARBLE): the recipe's per-reward gradient plumbing
    (flowrl/training/reward_gradients.py) reads these settings and writes the weights it learns into `alpha`."""

    form: str  # 'full': the min-norm QP every optimizer step; 'amortized': every `refresh_every` steps
    refresh_every: int  # the amortized form's QP cadence, in optimizer steps
    alpha_ema: float  # ρ of the amortized form's ᾱ_t = ρ·ᾱ_{t−1} + (1 − ρ)·α*_t
    alpha: torch.Tensor | None  # [K] ᾱ the advantages are combined with (None: uniform until the recipe sets it)
