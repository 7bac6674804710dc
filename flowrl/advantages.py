"""Group statistics of rewards and the advantages built from them (docs/math.md#advantages).

All functions take flat tensors over the global batch (B*G samples, gathered from every process) and an
integer group id per sample; samples whose reward is NaN (not applicable / failed) take no part in their
group's statistics and get advantage 0.
"""

from __future__ import annotations

import torch


def group_mean_std(
    rewards: torch.Tensor, group_ids: torch.Tensor, unbiased: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample mean and std of its group's finite rewards. rewards [M] -> (mean [M], std [M]) float32.

    `unbiased=True` divides by n - 1 (torch.std, DanceGRPO); False by n (numpy, Flow-GRPO). A group with a
    single finite reward has std 0. A group whose finite rewards are all equal gets exactly that value as its
    mean and std 0 (a float sum can miss the value by an ulp, which `eps` would then blow up).
    """
    rewards = rewards.float()
    finite = torch.isfinite(rewards)
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [M] dense group index
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    values = torch.where(finite, rewards, torch.zeros_like(rewards))
    count = torch.zeros(num_groups).index_add_(0, inverse, finite.float())  # [G']
    total = torch.zeros(num_groups).index_add_(0, inverse, values)
    lowest = torch.full((num_groups,), float("inf")).scatter_reduce(0, inverse[finite], rewards[finite], "amin")
    highest = torch.full((num_groups,), float("-inf")).scatter_reduce(0, inverse[finite], rewards[finite], "amax")
    flat = lowest == highest  # [G'] every finite reward equal (a group without finite rewards stays inf != -inf)
    mean = torch.where(flat, lowest, total / count.clamp(min=1))
    centred = torch.where(finite, rewards - mean[inverse], torch.zeros_like(rewards))
    square = torch.zeros(num_groups).index_add_(0, inverse, centred**2)
    dof = (count - 1) if unbiased else count
    var = torch.where((dof > 0) & ~flat, square / dof.clamp(min=1), torch.zeros_like(square))
    return mean[inverse], var.sqrt()[inverse]


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    std: str = "group",
    eps: float = 1e-4,
    unbiased: bool = False,
    clip: float | None = 5.0,
) -> torch.Tensor:
    """A_i = (R_i − mean_group) / (std + eps), std per group ("group") or over the whole batch ("global");
    std="none" only centres, A_i = R_i − mean_group (RAM's default, no eps).

    Flow-GRPO: std="global", eps=1e-4, population std; DanceGRPO: std="group", eps=1e-8, unbiased=True.
    Clipped to [−clip, clip] (5 in every reference code); NaN rewards get 0. Returns [M] float32.
    """
    if std not in ("group", "global", "none"):
        raise ValueError(f"std={std!r} must be 'group' (per prompt), 'global' (whole batch) or 'none' (centre only)")
    mean, group_std = group_mean_std(rewards, group_ids, unbiased)
    finite = torch.isfinite(rewards)
    if std == "none":
        scale, eps = torch.ones_like(mean), 0.0
    elif std == "global":
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


def tail_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """TailRL advantages: the score-function weights of E_τ[log P(R > τ)], τ drawn from the group's own rewards.

    Within a group of n finite rewards, sample i gets w_i = Σ_{j: r_j < r_i} 1 / c_j, where c_j is the number
    of the group's rewards strictly above r_j (n / c_j is 1 / the group's share above the threshold r_j, and
    each threshold has probability 1 / n), and A_i = w_i − mean_group(w). With distinct rewards and ascending
    rank ρ this is H_{n−1} − H_{n−ρ} − (n−1)/n (H: harmonic numbers), ≈ −log(1 − quantile) − 1 in a large
    group. Rank-based: any increasing transform of the rewards gives the same advantages. A group of one,
    a group of equal rewards and NaN rewards get 0. Derivation:
    docs/math.md#tailrl-the-log-probability-of-clearing-a-random-bar-tail. Returns [M] float32.
    """
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    finite = torch.isfinite(rewards)
    if not finite.any():
        return out
    r, g = rewards[finite], torch.unique(group_ids[finite], return_inverse=True)[1]  # [F], dense group index
    order = torch.argsort(r, stable=True)
    order = order[torch.argsort(g[order], stable=True)]  # by group, then by reward
    rs, gs = r[order], g[order]
    n = rs.numel()
    new_group = torch.ones(n, dtype=torch.bool)
    new_group[1:] = gs[1:] != gs[:-1]
    new_block = new_group.clone()  # a block: equal rewards inside one group
    new_block[1:] |= rs[1:] != rs[:-1]
    group_of, block_of = torch.cumsum(new_group, 0) - 1, torch.cumsum(new_block, 0) - 1  # [F]
    group_start = torch.nonzero(new_group).squeeze(1)[group_of]  # [F] sorted position where the group starts
    block_start = torch.nonzero(new_block).squeeze(1)[block_of]
    group_end = group_start + torch.bincount(group_of)[group_of]
    block_end = block_start + torch.bincount(block_of)[block_of]
    above = (group_end - block_end).double()  # c_j: the group's rewards strictly above r_j
    inv = torch.where(above > 0, 1.0 / above.clamp(min=1), torch.zeros_like(above))  # the top block is no threshold
    before = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(inv, 0)])  # before[p] = Σ_{q < p} inv[q]
    w = before[block_start] - before[group_start]  # Σ over the thresholds below r_i in its group
    num_groups = int(group_of.max()) + 1
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_of, w) / torch.bincount(group_of).double()
    sorted_adv = (w - mean[group_of]).float()
    sorted_adv = torch.where(group_end - group_start > 1, sorted_adv, torch.zeros_like(sorted_adv))
    values = torch.empty_like(r)
    values[order] = sorted_adv
    out[finite] = values
    return out


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-4, unbiased: bool = True) -> torch.Tensor:
    """(x − mean) / (std + eps), mean and std over the samples in `mask` (the batch whitening of GDPO).

    Samples outside `mask` get 0, and so does everything when fewer than two samples are in it or they are
    all equal. values [M], mask [M] bool -> [M] float32.
    """
    values = values.float()
    out = torch.zeros_like(values)
    selected = values[mask]
    if selected.numel() < 2 or bool(selected.max() == selected.min()):
        return out
    scale = selected.std(unbiased=unbiased) + eps
    return torch.where(mask, (values - selected.mean()) / scale, out)


# ---------------------------------------------------------------------------------------------------------
# Tree rollouts: reward fusion, depth-wise advantages, pruning (BranchGRPO; docs/recipes/grpo.md#tree-rollouts)
#
# A forest is given node-wise, with dense node ids 0..V-1: parent [V] int64 (-1 at a root), depth [V] int64
# (edges from the root), tree [V] int64. The edge parent[c] -> c is named by its child c. The tree sampler
# records root-to-leaf paths instead; `forest_from_paths` turns them into this form.
# ---------------------------------------------------------------------------------------------------------

FUSIONS = ("mean", "path_probability")
WIDTH_PRUNINGS = ("none", "per_branch", "best_worst")


def forest_from_paths(paths: torch.Tensor, tree_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Dense node ids of a forest from the leaves' root-to-leaf paths.

    paths [N, T+1] int64: leaf i's node id at each depth (ids unique within a tree; column d is depth d);
    tree_ids [N]. Returns (parent [V], depth [V], tree [V], node_of [N, T+1]) with node_of the dense id of
    each path entry.
    """
    paths, tree_ids = paths.to(torch.int64).cpu(), tree_ids.to(torch.int64).cpu()
    n, width = paths.shape
    keys = tree_ids[:, None] * (int(paths.max()) + 1) + paths  # [N, T+1] unique over the forest
    unique, node_of = torch.unique(keys, return_inverse=True)  # [V], [N, T+1]
    v = unique.numel()
    depth = torch.zeros(v, dtype=torch.int64).scatter_(0, node_of.flatten(), torch.arange(width).repeat(n))
    tree = torch.zeros(v, dtype=torch.int64).scatter_(0, node_of.flatten(), tree_ids.repeat_interleave(width))
    parent = torch.full((v,), -1, dtype=torch.int64).scatter_(0, node_of[:, 1:].flatten(), node_of[:, :-1].flatten())
    return parent, depth, tree, node_of


def fuse_tree_rewards(
    parent: torch.Tensor,
    depth: torch.Tensor,
    leaf_values: torch.Tensor,
    fusion: str = "mean",
    edge_log_probs: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Every node's value [V] from its leaves' values, bottom-up (BranchGRPO reward fusion).

    "mean": r(n) = mean of the values of the leaves below n. "path_probability": r(n) = Σ_j softmax_j(α·ℓ_j)·r(c_j)
    over n's children c_j, ℓ_j the log-prob [V] of the edge n -> c_j (α = `temperature`); a single child passes
    its value up, and unrolled this weights each leaf by the product of its normalised branch probabilities.
    leaf_values [V] is read at leaves only (nodes without children); NaN leaves (failed rewards) take no part,
    and a node with no finite leaf below is NaN. Returns float32 [V].
    """
    if fusion not in FUSIONS:
        raise ValueError(f"fusion={fusion!r} must be one of {', '.join(FUSIONS)}")
    if fusion == "path_probability" and edge_log_probs is None:
        raise ValueError("fusion='path_probability' needs edge_log_probs (the log-prob of the edge into each node)")
    v = parent.numel()
    is_leaf = torch.ones(v, dtype=torch.bool)
    is_leaf[parent[parent >= 0]] = False
    values = torch.where(is_leaf, leaf_values.float(), torch.full((v,), float("nan")))  # [V]
    finite = torch.isfinite(values)
    total = torch.where(finite, values, torch.zeros_like(values))  # mean: sum of finite leaves below
    count = finite.float()
    for d in range(int(depth.max()), 0, -1):
        nodes = (depth == d).nonzero().flatten()
        up = parent[nodes]
        if fusion == "mean":
            total.index_add_(0, up, total[nodes])
            count.index_add_(0, up, count[nodes])
            continue
        nodes, up = nodes[torch.isfinite(values[nodes])], up[torch.isfinite(values[nodes])]
        logits = temperature * edge_log_probs[nodes].float()
        peak = torch.full((v,), float("-inf")).scatter_reduce(0, up, logits, "amax")
        weights = torch.exp(logits - peak[up])
        norm = torch.zeros(v).index_add_(0, up, weights)
        fused = torch.zeros(v).index_add_(0, up, weights * values[nodes])
        parents = up.unique()
        values[parents] = fused[parents] / norm[parents]
    if fusion == "mean":
        values = torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))
    return values


def depthwise_advantages(
    values: torch.Tensor, depth: torch.Tensor, tree: torch.Tensor, eps: float = 1e-8, min_std: float = 1e-6
) -> torch.Tensor:
    """BranchGRPO's depth-wise advantage [V]: A(n) = (r(n) − mean_d) / (std_d + eps) over the nodes of n's tree at
    n's depth (std unbiased, as torch.std). A depth with one node (the root, a chain before the first split) or
    with std_d < min_std (equal values) gets 0, and so does a NaN value (no finite leaf below)."""
    groups = tree.to(torch.int64) * (int(depth.max()) + 1) + depth.to(torch.int64)  # [V] one group per (tree, depth)
    mean, std = group_mean_std(values, groups, unbiased=True)
    advantages = (values.float() - mean) / (std + eps)
    return torch.where(torch.isfinite(values) & (std >= min_std), advantages, torch.zeros_like(advantages))


def width_prune(
    advantages: torch.Tensor,
    parent_step: torch.Tensor,
    groups: torch.Tensor,
    last_split: int,
    mode: str,
    ratio: float = 0.5,
) -> torch.Tensor:
    """BranchGRPO's width pruning of edges [E] (backward pass only): keep [E] bool.

    Only edges whose parent step is after `last_split` compete; the others are kept. Among the competing edges of
    one group (`groups` [E]: the branch of the last split they descend from for "per_branch", their tree for
    "best_worst"): "per_branch" keeps the max(1, ⌊ratio·n⌋) highest advantages (BranchGRPO mode 1);
    "best_worst" keeps the ⌊k/2⌋ highest and the k − ⌊k/2⌋ lowest, k = max(2, ⌊ratio·n⌋) (mode 2). Ties keep
    the earlier edge. "none" keeps every edge.
    """
    if mode not in WIDTH_PRUNINGS:
        raise ValueError(f"width pruning mode={mode!r} must be one of {', '.join(WIDTH_PRUNINGS)}")
    keep = torch.ones(advantages.numel(), dtype=torch.bool)
    if mode == "none":
        return keep
    competing = parent_step > last_split
    for group in groups[competing].unique().tolist():
        edges = (competing & (groups == group)).nonzero().flatten()
        ranked = edges[torch.argsort(-advantages[edges].float(), stable=True)]  # best first, ties in edge order
        n = ranked.numel()
        keep[ranked] = False
        if mode == "per_branch":
            keep[ranked[: max(1, int(n * ratio))]] = True
        else:
            k = max(2, int(n * ratio))
            keep[ranked[: k // 2]] = True  # the best
            keep[ranked[max(0, n - (k - k // 2)) :]] = True  # the worst
    return keep


def pruned_depths(depths: list[int], step: int, slide_every_n_steps: int = 0, stop_depth: int = 0) -> list[int]:
    """The child depths depth pruning drops at training step `step` (0-based): `depths`, or with a sliding window
    every `slide_every_n_steps` steps one level shallower, D − shift with
    shift = min(step // n, min(D) − stop_depth)."""
    if not depths or not slide_every_n_steps:
        return list(depths)
    shift = max(0, min(step // slide_every_n_steps, min(depths) - stop_depth))
    return [d - shift for d in depths]


def depth_prune(child_depth: torch.Tensor, depths: list[int]) -> torch.Tensor:
    """BranchGRPO's depth pruning (backward pass only): keep [E] = the edge's child depth is not in `depths`."""
    return ~torch.isin(child_depth, torch.tensor(list(depths), dtype=torch.int64))


def tree_edge_advantages(
    paths: torch.Tensor,
    tree_ids: torch.Tensor,
    leaf_values: torch.Tensor,
    log_probs: torch.Tensor,
    transitions: torch.Tensor,
    split_steps: tuple[int, ...],
    *,
    fusion: str = "mean",
    fusion_temperature: float = 1.0,
    width_pruning: str = "none",
    width_pruning_ratio: float = 0.5,
    depth_pruning: tuple[int, ...] | list[int] = (),
    depth_pruning_slide_every_n_steps: int = 0,
    depth_pruning_stop_depth: int | None = None,
    prune: bool = True,
    step: int = 0,
    clip: float | None = 5.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-edge advantages of a tree rollout, and which of its edges train.

    A tree rollout (samplers/tree.py) has one row per leaf: paths [N, T+1] (the row's node id at each depth,
    `extras["tree_nodes"]`), tree_ids [N] (its group), leaf_values [N] (one value per leaf, e.g. the balancer's
    advantage: depth-wise normalisation ignores a per-tree shift and positive scale), log_probs [N, T] and the
    edge table transitions [M, 2] (row, step): edge (i, k) is paths[i, k] -> paths[i, k+1], child depth k + 1.
    Node values are fused from the leaves (`fuse_tree_rewards`), advantages taken depth-wise
    (`depthwise_advantages`, clipped to ±clip) and each edge gets its child's. With `prune`, depth pruning
    (`pruned_depths` at `step`; the stop depth defaults to the last split step) then width pruning (after the last
    split) choose the edges to train. Returns (advantages [N, T] float32, 0 off the table; keep [M] bool).
    """
    parent, depth, tree, node_of = forest_from_paths(paths, tree_ids)
    rows, steps = transitions[:, 0].cpu(), transitions[:, 1].cpu()
    child = node_of[rows, steps + 1]  # [M]
    values = torch.full((parent.numel(),), float("nan"))
    values[node_of[:, -1]] = leaf_values.float().cpu()
    edge_log_probs = torch.zeros(parent.numel())
    edge_log_probs[child] = log_probs.float().cpu()[rows, steps]
    fused = fuse_tree_rewards(parent, depth, values, fusion, edge_log_probs, fusion_temperature)
    node_advantages = depthwise_advantages(fused, depth, tree)
    if clip is not None:
        node_advantages = node_advantages.clamp(-clip, clip)
    advantages = torch.zeros(log_probs.shape)
    advantages[rows, steps] = node_advantages[child]
    keep = torch.ones(len(rows), dtype=torch.bool)
    if not prune:
        return advantages, keep
    last_split = max(split_steps) if split_steps else None
    stop = depth_pruning_stop_depth if depth_pruning_stop_depth is not None else (last_split or 0)
    keep &= depth_prune(steps + 1, pruned_depths(list(depth_pruning), step, depth_pruning_slide_every_n_steps, stop))
    if width_pruning != "none" and last_split is not None:
        if width_pruning == "per_branch":
            groups = node_of[rows, last_split + 1]  # the child of the last split the edge descends from
        else:
            groups = tree[child]
        survivors = keep.nonzero().flatten()
        kept = width_prune(
            node_advantages[child[survivors]],
            steps[survivors],
            groups[survivors],
            last_split,
            width_pruning,
            width_pruning_ratio,
        )
        keep[survivors[~kept]] = False
    return advantages, keep
