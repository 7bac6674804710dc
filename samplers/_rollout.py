"""The rollout stages the sampler plugins share (ode, sde, tree, candidates): seeds, initial noise, size, the loop.

Every sample owns its randomness: its initial noise comes from `torch.Generator().manual_seed(seed)` (the same
latents the diffusers pipeline draws for that seed), and `integrate` draws its step noise from that sample's own
generator, so a trajectory does not depend on which other samples share the batch or the process.
"""

from __future__ import annotations

import torch

from flowrl import sde
from flowrl.models.conditioning import encode_prompts
from flowrl.seeds import sample_generators
from flowrl.types import FlowModel, PromptBatch


def batch_seeds(batch: PromptBatch, generator: torch.Generator | None) -> torch.Tensor:
    """The batch's seeds [N], or fresh ones drawn from `generator`."""
    if batch.seeds is not None:
        return batch.seeds.to(torch.int64).cpu()
    return torch.randint(0, 2**31 - 1, (len(batch.prompts),), generator=generator, dtype=torch.int64)


def latent_seeds(batch: PromptBatch, seeds: torch.Tensor, same_latent: bool) -> torch.Tensor:
    """Seeds of the initial noise [N]: each sample's own, or one per prompt group (DanceGRPO's shared noise).

    The group's seed is `batch.group_seeds` (set by the grouped prompt sampler from the *global* group, so a
    group split over rollout chunks or processes still shares one noise); a batch without group seeds (built
    by hand) uses the smallest seed of each group within the batch.
    """
    if not same_latent:
        return seeds
    if batch.group_seeds is not None:
        return batch.group_seeds.to(torch.int64).cpu()
    out = seeds.clone()
    group_ids = batch.group_ids.cpu()
    for gid in group_ids.unique().tolist():
        rows = (group_ids == gid).nonzero().flatten()
        out[rows] = seeds[rows].min()
    return out


def resolve_size(sampler, model: FlowModel) -> tuple[int, int, int | None]:
    """(height, width, num_frames) of a sampler; None fields take the model's native size."""
    native_h, native_w, native_f = model.native_size
    return sampler.height or native_h, sampler.width or native_w, sampler.num_frames or native_f


def start_rollout(sampler, model: FlowModel, batch: PromptBatch, generator: torch.Generator | None):
    """Stages 1-2 shared by the samplers: guidance, encoded prompts, seeds [N], initial noise [N, ...] and size.

    The noise of a sample equals what the diffusers pipeline draws with `Generator().manual_seed(seed)`.
    """
    guidance = sampler.guidance_scale if sampler.guidance_scale is not None else model.default_guidance_scale
    size = resolve_size(sampler, model)
    cond = encode_prompts(model, batch.prompts, batch.metadata, sampler.negative_prompt, guidance, size)
    seeds = batch_seeds(batch, generator)
    init_seeds = latent_seeds(batch, seeds, sampler.same_latent)
    latents = model.prepare_latents(len(seeds), size[0], size[1], sample_generators(init_seeds, model.device), size[2])
    return guidance, cond, seeds, latents, size


def integrate(
    model: FlowModel,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: dict,
    guidance_scale: float,
    noise_levels: torch.Tensor,
    rule: sde.StepRule,
    generators: list[torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the T transitions; noise_levels [N, T] (0 = an Euler step).

    Returns (latents [N, T+1, ...], log_probs [N, T]). Step noise is drawn per sample, from that sample's
    generator, only at the sample's own stochastic steps (std > 0): a trajectory never depends on which other
    samples share the batch.
    """
    n, num_steps = noise_levels.shape
    stds = sde.transition_stds(rule, sigmas, noise_levels).cpu()  # [N, T]
    trajectory = [latents.float()]
    log_probs = torch.zeros(n, num_steps, dtype=torch.float32, device=latents.device)  # [N, T]
    x = latents.float()
    for k in range(num_steps):
        v = model.velocity(x, sigmas[k], cond, guidance_scale)
        stochastic = (stds[:, k] > 0).tolist()
        if not any(stochastic):
            x, _, _, _ = sde.sde_step(v, x, sigmas[k], sigmas[k + 1], "ode", 0.0)
        else:
            noise = torch.zeros_like(x)  # ξ [N, ...]; rows with std 0 keep zeros and draw nothing
            for i in (i for i, s in enumerate(stochastic) if s):
                noise[i] = torch.randn(x.shape[1:], generator=generators[i], device=x.device, dtype=torch.float32)
            x, log_prob, _, _ = rule.step(v, x, sigmas[k], sigmas[k + 1], noise_levels[:, k], noise=noise)
            log_probs[:, k] = log_prob
        trajectory.append(x)
    return torch.stack(trajectory, dim=1), log_probs
