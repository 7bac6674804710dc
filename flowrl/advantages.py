"""Group statistics of rewards and the advantages built from them (docs/math.md#advantages).

All functions take flat tensors over the global batch (B*G samples, gathered from every process) and an
integer group id per sample; samples whose reward is NaN (not applicable / failed) take no part in their
group's statistics and get advantage 0.
"""

from __future__ import annotations

import torch


def group_mean_std(rewards: torch.Tensor, group_ids: torch.Tensor, unbiased: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and std of its group's finite rewards. rewards [M] -> (mean [M], std [M]) float32.

    `unbiased=True` divides by n - 1 (torch.std, DanceGRPO); False by n (numpy, Flow-GRPO). A group with a
    single finite reward has std 0.
    """
    rewards = rewards.float()
    finite = torch.isfinite(rewards)
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [M] dense group index
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    values = torch.where(finite, rewards, torch.zeros_like(rewards))
    count = torch.zeros(num_groups).index_add_(0, inverse, finite.float())  # [G']
    total = torch.zeros(num_groups).index_add_(0, inverse, values)
    mean = total / count.clamp(min=1)
    centred = torch.where(finite, rewards - mean[inverse], torch.zeros_like(rewards))
    square = torch.zeros(num_groups).index_add_(0, inverse, centred**2)
    dof = (count - 1) if unbiased else count
    var = torch.where(dof > 0, square / dof.clamp(min=1), torch.zeros_like(square))
    return mean[inverse], var.sqrt()[inverse]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    std: str = "group",
    eps: float = 1e-4,
    unbiased: bool = False,
    clip: float | None = 5.0,
) -> torch.Tensor:
    """A_i = (R_i − mean_group) / (std + eps), std per group ("group") or over the whole batch ("global").

    Flow-GRPO: std="global", eps=1e-4, population std; DanceGRPO: std="group", eps=1e-8, unbiased=True.
    Clipped to [−clip, clip] (5 in every reference code); NaN rewards get 0. Returns [M] float32.
    """
    if std not in ("group", "global"):
        raise ValueError(f"std={std!r} must be 'group' (per prompt) or 'global' (whole batch)")
    mean, group_std = group_mean_std(rewards, group_ids, unbiased)
    finite = torch.isfinite(rewards)
    if std == "global":
        values = rewards.float()[finite]
        scale = values.std(unbiased=unbiased) if values.numel() > int(unbiased) else torch.tensor(0.0)
        scale = scale.expand_as(mean)
    else:
        scale = group_std
    advantages = (rewards.float() - mean) / (scale + eps)
    advantages = torch.where(finite, advantages, torch.zeros_like(advantages))
    if clip is not None:
        advantages = advantages.clamp(-clip, clip)
    return advantages


def zero_std_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[M] bool: the sample's group has no reward spread (every finite reward equal) — it carries no signal."""
    _, std = group_mean_std(rewards, group_ids)
    return std == 0
