"""Credit assignment of tree rollouts (sampler `tree`, BranchGRPO) for the GRPO recipe: the leaves' advantages fused
up each tree into depth-wise edge advantages, pruning, and the weight each edge's transitions carry
(docs/recipes/grpo.md#tree-rollouts; the fusion and pruning math is flowrl.advantages.tree_edge_advantages)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from flowrl.advantages import FUSIONS, WIDTH_PRUNINGS, tree_edge_advantages
from flowrl.types import Rollout


@dataclass
class TreeCreditConfig:
    """Credit assignment of tree rollouts (sampler `tree`, docs/recipes/grpo.md#tree-rollouts); ignored otherwise."""

    fusion: str = "mean"
    """A node's value from its leaves: 'mean' (BranchGRPO's default) or 'path_probability' (children weighted by
    softmax(fusion_temperature · edge log-prob))."""
    fusion_temperature: float = 1.0
    width_pruning: str = "none"
    """Edges after the last split that train: 'none', 'per_branch' (the best width_pruning_ratio of each branch
    of the last split) or 'best_worst' (the best and worst halves of width_pruning_ratio per tree)."""
    width_pruning_ratio: float = 0.5
    depth_pruning: list[int] = field(default_factory=list)
    """Edges into these depths do not train (e.g. [15, 16, 17, 18] of 20 steps)."""
    depth_pruning_slide_every_n_steps: int = 0
    """> 0: the pruned depths move one level shallower every this many training steps, down to the stop depth."""
    depth_pruning_stop_depth: int | None = None
    """Shallowest pruned depth of the sliding window; None = the last split step."""
    pruning_step_ratio: float = 1.0
    """Prune during the first this fraction of `num_steps` training steps only."""

    def __post_init__(self) -> None:
        if self.fusion not in FUSIONS:
            raise ValueError(f"train.tree.fusion={self.fusion!r} must be one of {', '.join(FUSIONS)}")
        if self.width_pruning not in WIDTH_PRUNINGS:
            raise ValueError(
                f"train.tree.width_pruning={self.width_pruning!r} must be one of {', '.join(WIDTH_PRUNINGS)}"
            )
        if not 0 < self.width_pruning_ratio <= 1:
            raise ValueError(f"train.tree.width_pruning_ratio={self.width_pruning_ratio} must be in (0, 1]")


class Credit(NamedTuple):
    """What stage 6 trains: an advantage per transition and the transitions themselves."""

    advantages: torch.Tensor  # [N, T] float32, per (sample, step)
    transitions: torch.Tensor  # [M, 2] int64 (sample, step) pairs to train
    shared_by: torch.Tensor  # [N] int64: rows with one id share their transitions' weight (a tree's leaves)


def transition_advantages(
    rollout: Rollout, advantages: torch.Tensor, keep: torch.Tensor, cfg: TreeCreditConfig, step: int, num_steps: int
) -> Credit:
    """Per-transition advantages: a tree rollout's depth-wise edge advantages (its leaves' advantages fused up the
    tree, docs/recipes/grpo.md#tree-rollouts) on its unpruned edges; any other rollout's per-sample advantages on
    every transition of its table."""
    n = len(rollout.prompts)
    if "tree_nodes" not in rollout.extras:
        return Credit(advantages[:, None].expand(-1, rollout.num_steps), rollout.transitions, torch.arange(n))
    leaf_values = torch.where(keep, advantages, torch.full_like(advantages, float("nan")))  # dropped leaves: no value
    prune = step < int(num_steps * cfg.pruning_step_ratio)
    options = {k: v for k, v in asdict(cfg).items() if k != "pruning_step_ratio"}
    extras = rollout.extras
    edge_advantages, train = tree_edge_advantages(
        extras["tree_nodes"],
        rollout.group_ids,
        leaf_values,
        rollout.log_probs,
        rollout.transitions,
        extras["split_steps"],
        prune=prune,
        step=step,
        **options,
    )
    return Credit(
        edge_advantages.to(advantages.device), rollout.transitions[train], rollout.group_ids.cpu().to(torch.int64)
    )


def shared_counts(steps: list[list[int]], shared_by: torch.Tensor) -> torch.Tensor:
    """[N] the transition count each row's transitions are averaged by: its own, or the mean over the rows that
    share its id (a tree's leaves share its edges, so that every edge of a tree weighs the same)."""
    lengths = torch.tensor([len(s) for s in steps], dtype=torch.float32)  # [N]
    _, unit = torch.unique(shared_by, return_inverse=True)
    total = torch.zeros(int(unit.max()) + 1).index_add_(0, unit, lengths)
    rows = torch.zeros(int(unit.max()) + 1).index_add_(0, unit, torch.ones_like(lengths))
    return (total / rows)[unit]
