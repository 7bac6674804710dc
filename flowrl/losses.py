"""Losses of the trainers, each a few lines over per-sample tensors (docs/math.md#clipped-surrogate, #kl-to-the-reference)."""

from __future__ import annotations

import torch


def clipped_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO surrogate per sample: max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)), ρ = exp(ℓ_θ − ℓ_old). All [n].

    Returns (loss [n], stats) with stats: ratio [n], clipped [n] bool (|ρ − 1| > ε), approx_kl [n] = ½(ℓ_θ − ℓ_old)².
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    stats = {
        "ratio": ratio.detach(),
        "clipped": ((ratio.detach() - 1.0).abs() > clip_range),
        "approx_kl": 0.5 * log_ratio.detach() ** 2,
    }
    return loss, stats
