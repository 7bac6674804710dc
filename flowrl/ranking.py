"""Selection rules of candidate pools (docs/recipes/candidates.md) and the rank-fidelity statistics of a cheap preview.

    idx = select_indices(preview_scores, k=24, mode="best_worst")      # Sol-RL's contrastive subset of a pool
    spearman(preview, full), kendall(preview, full), topk_overlap(preview, full, k), bottom_intrusion(preview, full, k)

Pure functions of 1-D score tensors. The statistics are NaN where they are undefined (fewer than two samples, or a
constant score vector).
"""

from __future__ import annotations

import math
import statistics

import torch

SELECTIONS = ("best_worst", "top", "mean_deviation", "extremes_random", "random")


def _order(scores: torch.Tensor, descending: bool, among: torch.Tensor | None = None) -> list[int]:
    """Indices (of `among`, default all) sorted by score, ties by the lower index (a stable sort)."""
    idx = torch.arange(len(scores)) if among is None else among
    keys = scores[idx].double()
    return idx[torch.sort(-keys if descending else keys, stable=True).indices].tolist()


def select_indices(
    scores: torch.Tensor, k: int, mode: str = "best_worst", generator: torch.Generator | None = None
) -> list[int]:
    """The k pool members to keep, in ascending index order; all of them when the pool has <= k.

    best_worst: the k // 2 best and the k − k // 2 worst (an odd k takes one more worst); top: the k best;
    mean_deviation: the k farthest from the mean; extremes_random: the best, the worst and k − 2 drawn at random
    from the rest (`generator`); random: k drawn at random. Ties go to the lower index."""
    if mode not in SELECTIONS:
        raise ValueError(f"sampler.selection={mode!r} is not one of {', '.join(SELECTIONS)}")
    scores = scores.detach().float().cpu().flatten()
    n = len(scores)
    if k < 1:
        raise ValueError(f"selection size k={k} must be >= 1")
    if n <= k:
        return list(range(n))
    if mode == "best_worst":
        best = _order(scores, True)[: k // 2]
        rest = torch.tensor(sorted(set(range(n)) - set(best)))
        chosen = best + _order(scores, False, rest)[: k - k // 2]
    elif mode == "top":
        chosen = _order(scores, True)[:k]
    elif mode == "mean_deviation":
        chosen = _order((scores - scores.mean()).abs(), True)[:k]
    elif mode == "extremes_random":
        top = _order(scores, True)[0]
        bottom = next(i for i in _order(scores, False) if i != top)
        rest = [i for i in range(n) if i not in (top, bottom)]
        picks = torch.randperm(len(rest), generator=generator)[: max(k - 2, 0)].tolist()
        chosen = [top, bottom][:k] + [rest[i] for i in picks]
    else:
        chosen = torch.randperm(n, generator=generator)[:k].tolist()
    return sorted(chosen)


# ------------------------------------------------------------------------------------------ rank fidelity
def ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks, ties given their average rank."""
    x = x.double().flatten()
    order = torch.sort(x, stable=True).indices
    r = torch.empty_like(x)
    r[order] = torch.arange(1, len(x) + 1, dtype=torch.float64)
    for value in x.unique():
        tied = x == value
        if tied.sum() > 1:
            r[tied] = r[tied].mean()
    return r


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's ρ: the Pearson correlation of the (average-tie) ranks."""
    if len(a) < 2:
        return float("nan")
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = math.sqrt(float((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum()) / denominator if denominator > 0 else float("nan")


def kendall(a: torch.Tensor, b: torch.Tensor) -> float:
    """Kendall's τ-b: (concordant − discordant) / sqrt((n0 − ties_a)(n0 − ties_b)) over all pairs."""
    a, b = a.double().flatten(), b.double().flatten()
    if len(a) < 2:
        return float("nan")
    i, j = torch.triu_indices(len(a), len(a), offset=1)
    da, db = torch.sign(a[i] - a[j]), torch.sign(b[i] - b[j])
    untied_a, untied_b = float((da != 0).sum()), float((db != 0).sum())
    if untied_a == 0 or untied_b == 0:
        return float("nan")
    return float((da * db).sum()) / math.sqrt(untied_a * untied_b)


def topk_overlap(preview: torch.Tensor, full: torch.Tensor, k: int) -> float:
    """|preview's top k ∩ full's top k| / k (ties to the lower index)."""
    k = min(k, len(full))
    return len(set(_order(preview.float(), True)[:k]) & set(_order(full.float(), True)[:k])) / k


def bottom_intrusion(preview: torch.Tensor, full: torch.Tensor, k: int) -> float:
    """Share of the preview's top k that are among the full-precision bottom k (a bad sample taken for a good one)."""
    k = min(k, len(full))
    return len(set(_order(preview.float(), True)[:k]) & set(_order(full.float(), False)[:k])) / k


def nanmedian(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else float("nan")
