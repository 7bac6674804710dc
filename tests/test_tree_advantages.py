"""Tree credit assignment (flowrl.advantages, BranchGRPO §3.2-3.4) against values computed by hand on hand-built
trees."""

import math

import pytest
import torch

from flowrl.advantages import (
    depth_prune,
    depthwise_advantages,
    forest_from_paths,
    fuse_tree_rewards,
    pruned_depths,
    tree_edge_advantages,
    width_prune,
)

NAN = float("nan")

# Two trees, node-wise. Tree 0: root 0 splits into 1, 2; 1 splits into leaves 3, 4; 2 into leaves 5, 6.
# Tree 1: root 7 -> 8 (one child) -> leaves 9, 10.
PARENT = torch.tensor([-1, 0, 0, 1, 1, 2, 2, -1, 7, 8, 8])
DEPTH = torch.tensor([0, 1, 1, 2, 2, 2, 2, 0, 1, 2, 2])
TREE = torch.tensor([0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1])
LEAVES = torch.tensor([NAN, NAN, NAN, 1.0, 3.0, 2.0, 6.0, NAN, NAN, 5.0, 5.0])
# edge log-probs (the edge into each node): softmax weights 1/4, 3/4 under node 1, 1/2, 1/2 under node 2,
# 2/3, 1/3 under the root; node 8 is an only child
LOG_PROBS = torch.tensor([0.0, math.log(2.0), 0.0, 0.0, math.log(3.0), -1.3, -1.3, 0.0, -7.0, -0.2, -0.9])


def test_uniform_fusion_is_the_mean_of_the_leaves_below():
    values = fuse_tree_rewards(PARENT, DEPTH, LEAVES, "mean")
    expected = torch.tensor([3.0, 2.0, 4.0, 1.0, 3.0, 2.0, 6.0, 5.0, 5.0, 5.0, 5.0])
    torch.testing.assert_close(values, expected)


def test_path_probability_fusion_weights_children_by_the_softmax_of_their_edge_log_probs():
    values = fuse_tree_rewards(PARENT, DEPTH, LEAVES, "path_probability", LOG_PROBS)
    r1 = 0.25 * 1 + 0.75 * 3  # 2.5
    r2 = 0.5 * 2 + 0.5 * 6  # 4
    root = 2 / 3 * r1 + 1 / 3 * r2  # 3
    tree1 = (math.exp(-0.2) * 5 + math.exp(-0.9) * 5) / (math.exp(-0.2) + math.exp(-0.9))  # 5
    expected = torch.tensor([root, r1, r2, 1.0, 3.0, 2.0, 6.0, tree1, tree1, 5.0, 5.0])
    torch.testing.assert_close(values, expected)
    # temperature 0: every child alike, which is the uniform mean here (equal subtree sizes)
    torch.testing.assert_close(
        fuse_tree_rewards(PARENT, DEPTH, LEAVES, "path_probability", LOG_PROBS, temperature=0.0),
        fuse_tree_rewards(PARENT, DEPTH, LEAVES, "mean"),
    )


def test_a_failed_leaf_takes_no_part_in_fusion():
    leaves = LEAVES.clone()
    leaves[6] = NAN
    values = fuse_tree_rewards(PARENT, DEPTH, leaves, "mean")
    assert values[2] == 2.0 and values[0] == 2.0 and values[6].isnan()
    values = fuse_tree_rewards(PARENT, DEPTH, leaves, "path_probability", LOG_PROBS)
    assert values[2] == 2.0 and values[6].isnan()


def test_depthwise_advantages_by_hand_zero_at_the_root_and_at_equal_depths():
    values = fuse_tree_rewards(PARENT, DEPTH, LEAVES, "mean")
    adv = depthwise_advantages(values, DEPTH, TREE)
    d1 = 1 / math.sqrt(2)  # values 2, 4: mean 3, unbiased std sqrt(2)
    std2 = math.sqrt(14 / 3)  # values 1, 3, 2, 6: mean 3, squares 4 + 0 + 1 + 9
    expected = torch.tensor([0.0, -d1, d1, -2 / std2, 0.0, -1 / std2, 3 / std2, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)
    # tree 1: its root and its single depth-1 node are alone at their depth, its leaves are equal -> all 0
    assert not adv[7:].any() and adv[0] == 0


WIDTH_ADV = torch.tensor([0.1, -0.5, 0.3, 0.9, -0.2, -1.0, 0.4, 0.4])
WIDTH_STEP = torch.tensor([0, 1, 2, 2, 3, 3, 2, 3])  # parent steps; the last split is step 1
BRANCH = torch.tensor(
    [0, 0, 10, 10, 10, 11, 11, 11]
)  # edges 2-4 below one child of the last split, 5-7 below the other


def kept(mask):
    return mask.nonzero().flatten().tolist()


def test_width_pruning_per_branch_keeps_the_best_of_each_branch():
    keep = width_prune(WIDTH_ADV, WIDTH_STEP, BRANCH, last_split=1, mode="per_branch", ratio=0.5)
    assert kept(keep) == [0, 1, 3, 6]  # max(1, floor(1.5)) = 1 per branch; the 0.4 tie keeps the earlier edge
    assert kept(width_prune(WIDTH_ADV, WIDTH_STEP, BRANCH, 1, "per_branch", ratio=0.7)) == [0, 1, 2, 3, 6, 7]


def test_width_pruning_best_worst_keeps_both_ends_of_each_tree():
    trees = torch.zeros(8, dtype=torch.int64)
    keep = width_prune(WIDTH_ADV, WIDTH_STEP, trees, last_split=1, mode="best_worst", ratio=0.5)
    assert kept(keep) == [0, 1, 3, 4, 5]  # k = max(2, 3) = 3: the best one (0.9), the worst two (-0.2, -1.0)
    keep = width_prune(WIDTH_ADV, WIDTH_STEP, trees, last_split=1, mode="best_worst", ratio=0.1)
    assert kept(keep) == [0, 1, 3, 5]  # k = 2: one best, one worst
    assert kept(width_prune(WIDTH_ADV, WIDTH_STEP, trees, 1, "none")) == list(range(8))
    with pytest.raises(ValueError, match="per_branch"):
        width_prune(WIDTH_ADV, WIDTH_STEP, trees, 1, "best")


def test_depth_pruning_fixed_and_sliding():
    child_depth = torch.arange(1, 7)
    assert kept(depth_prune(child_depth, [4, 5])) == [0, 1, 2, 5]  # depths 1, 2, 3, 6 train
    assert pruned_depths([4, 5], step=0, slide_every_n_steps=2, stop_depth=2) == [4, 5]
    assert pruned_depths([4, 5], step=3, slide_every_n_steps=2, stop_depth=2) == [3, 4]
    assert pruned_depths([4, 5], step=100, slide_every_n_steps=2, stop_depth=2) == [2, 3]  # stops at depth 2
    assert pruned_depths([4, 5], step=100) == [4, 5]  # no sliding
    assert kept(depth_prune(child_depth, pruned_depths([4, 5], 3, 2, 2))) == [0, 1, 4, 5]


# The tree sampler's layout: splits at steps 0 and 1, b = 2, T = 3: nodes per depth 1, 2, 4, 4; leaf l's path is
# (0, 1 + l // 2, 3 + l, 7 + l); every step stochastic; edges owned by the first leaf below their child.
PATHS = torch.tensor([[0, 1, 3, 7], [0, 1, 4, 8], [0, 2, 5, 9], [0, 2, 6, 10]])
TABLE = torch.tensor([[0, 0], [0, 1], [0, 2], [1, 1], [1, 2], [2, 0], [2, 1], [2, 2], [3, 1], [3, 2]])


def test_edge_advantages_of_a_sampler_layout_are_the_childrens_depthwise_advantages():
    leaf_values = torch.tensor([1.0, 3.0, 2.0, 6.0])
    log_probs = torch.zeros(4, 3)
    adv, keep = tree_edge_advantages(PATHS, torch.zeros(4), leaf_values, log_probs, TABLE, (0, 1))
    assert keep.all()
    d1 = 1 / math.sqrt(2)
    d2 = [v / math.sqrt(14 / 3) for v in (-2, 0, -1, 3)]  # depths 2 and 3 hold the leaves' values (chains)
    expected = torch.zeros(4, 3)
    expected[0, 0], expected[2, 0] = -d1, d1
    for leaf in range(4):
        expected[leaf, 1] = expected[leaf, 2] = d2[leaf]
    torch.testing.assert_close(adv, expected)
    # the same leaf values shifted and scaled per tree give the same advantages (balancer advantages as leaf values)
    shifted, _ = tree_edge_advantages(PATHS, torch.zeros(4), 10 + 3 * leaf_values, log_probs, TABLE, (0, 1))
    torch.testing.assert_close(shifted, adv)


def test_edge_pruning_of_a_sampler_layout():
    leaf_values = torch.tensor([1.0, 3.0, 2.0, 6.0])
    args = (PATHS, torch.zeros(4), leaf_values, torch.zeros(4, 3), TABLE, (0, 1))
    # depth pruning of depth 2 drops the step-1 edges
    _, keep = tree_edge_advantages(*args, depth_pruning=[2])
    assert TABLE[keep].tolist() == [[0, 0], [0, 2], [1, 2], [2, 0], [2, 2], [3, 2]]
    # sliding from depth 3 to the stop depth 1 (the last split step): step 5 with n = 2 shifts by min(2, 2) = 2
    _, keep = tree_edge_advantages(*args, depth_pruning=[3], depth_pruning_slide_every_n_steps=2, step=5)
    assert TABLE[keep].tolist() == [[0, 1], [0, 2], [1, 1], [1, 2], [2, 1], [2, 2], [3, 1], [3, 2]]
    # width pruning competes only after the last split (the step-2 edges);
    # best_worst: k = 2 -> leaf 3 (best), leaf 0 (worst)
    _, keep = tree_edge_advantages(*args, width_pruning="best_worst")
    assert [e for e in TABLE[~keep].tolist()] == [[1, 2], [2, 2]]
    # per_branch: each branch of the last split holds one step-2 edge -> all kept
    assert tree_edge_advantages(*args, width_pruning="per_branch")[1].all()
    # pruning off (past pruning_step_ratio): every edge trains
    assert tree_edge_advantages(*args, depth_pruning=[2], width_pruning="best_worst", prune=False)[1].all()


def test_forest_from_paths_recovers_parents_and_depths():
    parent, depth, tree, node_of = forest_from_paths(torch.cat([PATHS, PATHS]), torch.tensor([0, 0, 0, 0, 5, 5, 5, 5]))
    assert parent.numel() == 22 and (parent == -1).sum() == 2
    assert depth[node_of].tolist() == [[0, 1, 2, 3]] * 8
    assert (parent[node_of[:, 1:]] == node_of[:, :-1]).all()
    assert tree[node_of[:, 0]].tolist() == [0, 0, 0, 0, 5, 5, 5, 5]
