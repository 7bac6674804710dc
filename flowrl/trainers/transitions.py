"""The transition table a policy-gradient recipe trains: which (sample, step) transitions train, and what
re-scoring one needs (GRPO's stage 6 and AIS's policy log-probs share them)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from flowrl.types import Rollout, select_cond


def trained_transitions(
    table: torch.Tensor, num_samples: int, fraction: float, shuffle: bool, generator: torch.Generator
) -> list[list[int]]:
    """Per sample, the steps to train on: its first `fraction` of the table's transitions, or a random subset."""
    steps: list[list[int]] = [[] for _ in range(num_samples)]  # table [M, 2] (sample, step), sample-major
    for i, k in table.tolist():
        steps[i].append(k)
    out = []
    for row in steps:
        if shuffle:
            row = [row[j] for j in torch.randperm(len(row), generator=generator).tolist()]
        out.append(row[: max(1, int(len(row) * fraction + 1e-6))] if row else [])
    if not any(out):
        raise ValueError("the rollout has no stochastic transitions (std > 0): set sampler.noise_level > 0")
    return out


class TransitionInputs(NamedTuple):
    """What re-scoring transitions k of rows `index` needs, each [b, ...]."""

    cond: dict
    x: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    level: torch.Tensor
    scale: torch.Tensor | None  # a tree's split-noise scale, None for other rollouts


def transition_inputs(rollout: Rollout, sigmas: torch.Tensor, index: torch.Tensor, k: torch.Tensor) -> TransitionInputs:
    """Conditioning, states x_k -> x_{k+1}, σ_k, σ_{k+1}, noise level and std scale of transitions k of rows index."""
    scale = rollout.std_scales[index, k] if rollout.std_scales is not None else None
    states = rollout.states(index, k), rollout.states(index, k + 1)
    return TransitionInputs(
        select_cond(rollout.cond, index), *states, sigmas[k], sigmas[k + 1], rollout.noise_levels[index, k], scale
    )


def same_on_every_process(acc, lengths: list[int]) -> bool:
    """Whether every process has these per-sample transition counts. The minibatch order is the same permutation on
    every process (one step generator), so equal counts mean the same backward calls (what FSDP2 / ZeRO-2 need),
    even where a process's own samples differ (a tree's leaves own different numbers of its edges)."""
    if acc.num_processes == 1:
        return True
    gathered = acc.gather(torch.tensor(lengths, device=acc.device)).view(acc.num_processes, -1)
    return bool((gathered == gathered[0]).all())
