"""Selection rules of candidate pools (ALGORITHMS §4.1, §11 item 11) and rank statistics, against hand counts."""

import itertools
import math

import pytest
import torch

from flowrl.ranking import bottom_intrusion, kendall, ranks, select_indices, spearman, topk_overlap


def test_best_worst_by_hand():
    r = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0])
    assert select_indices(r, 2, "best_worst") == [0, 1]  # the best (5) and the worst (1)
    assert select_indices(r, 3, "best_worst") == [0, 1, 3]  # odd K: one extra worst (2)
    assert select_indices(r, 4, "best_worst") == [0, 1, 2, 3]
    assert select_indices(r, 9, "best_worst") == [0, 1, 2, 3, 4]  # N <= K keeps everything


def test_best_worst_never_takes_a_sample_twice():
    assert select_indices(torch.ones(4), 2, "best_worst") == [0, 1]  # all tied: best = 0, worst among the rest = 1


def test_other_modes_by_hand():
    r = torch.tensor([5.0, 1.0, 4.0, 2.0, 3.0, 3.1])
    assert select_indices(r, 2, "top") == [0, 2]
    # |r − mean| with mean 3.0167: 1.98, 2.02, 0.98, 1.02, 0.017, 0.083 -> the two largest are 1 and 0
    assert select_indices(r, 2, "mean_deviation") == [0, 1]
    g = torch.Generator().manual_seed(0)
    picked = select_indices(r, 4, "extremes_random", generator=g)
    assert {0, 1} <= set(picked) and len(set(picked)) == 4
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert select_indices(r, 3, "random", g1) == select_indices(r, 3, "random", g2)
    with pytest.raises(ValueError, match="sampler.selection='worst' is not one of best_worst"):
        select_indices(r, 2, "worst")


def brute_spearman(a, b):
    """Pearson correlation of average ranks, counted by hand in plain Python."""

    def rk(x):
        return [sum(1 for y in x if y < v) + (sum(1 for y in x if y == v) + 1) / 2 for v in x]

    ra, rb = rk(a), rk(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def brute_kendall_b(a, b):
    pairs = list(itertools.combinations(range(len(a)), 2))
    num = sum(((a[i] > a[j]) - (a[i] < a[j])) * ((b[i] > b[j]) - (b[i] < b[j])) for i, j in pairs)
    ta = sum(a[i] != a[j] for i, j in pairs)
    tb = sum(b[i] != b[j] for i, j in pairs)
    return num / math.sqrt(ta * tb)


def test_rank_statistics_against_hand_counts():
    a = [0.3, 0.1, 0.9, 0.9, 0.5, 0.2]
    b = [0.2, 0.15, 0.7, 0.8, 0.1, 0.3]
    assert ranks(torch.tensor(a)).tolist() == [3.0, 1.0, 5.5, 5.5, 4.0, 2.0]
    assert spearman(torch.tensor(a), torch.tensor(b)) == pytest.approx(brute_spearman(a, b), abs=1e-12)
    assert kendall(torch.tensor(a), torch.tensor(b)) == pytest.approx(brute_kendall_b(a, b), abs=1e-12)
    assert spearman(torch.tensor(a), torch.tensor(a)) == pytest.approx(1.0)
    assert kendall(torch.tensor(a), -torch.tensor(a)) == pytest.approx(-1.0)
    assert math.isnan(spearman(torch.ones(3), torch.arange(3.0)))


def test_topk_overlap_and_bottom_intrusion():
    preview = torch.tensor([0.9, 0.8, 0.1, 0.7, 0.2, 0.3])  # preview's top 2: {0, 1}
    full = torch.tensor([0.9, 0.0, 0.5, 0.8, 0.4, 0.3])  # full's top 2: {0, 3}; bottom 2: {1, 5}
    assert topk_overlap(preview, full, 2) == 0.5
    assert bottom_intrusion(preview, full, 2) == 0.5  # sample 1 looked good but is the worst
    assert topk_overlap(full, full, 3) == 1.0 and bottom_intrusion(full, full, 3) == 0.0
