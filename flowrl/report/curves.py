"""Plots rendered with matplotlib's Agg canvas (no pyplot): the training curves from metrics.jsonl."""

from __future__ import annotations

import io
import math

from flowrl.report.runs import RunRecord


def new_figure(rows: int, cols: int, width: float, height: float):
    """A matplotlib Figure rendered by Agg without pyplot: no global backend switch, no figure registry."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height))
    return figure, figure.subplots(rows, cols, squeeze=False)


def figure_png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=80, bbox_inches="tight")
    return buffer.getvalue()


def curves_png(runs: list[RunRecord]) -> bytes | None:
    """Training curves from metrics.jsonl: every reward/<name>/mean (with a +-std band), train/kl, train/loss."""

    def trained(key: str) -> bool:
        return key.startswith("reward/") and key.endswith("/mean") or key in ("train/kl", "train/loss")

    keys = sorted(metric_keys(runs, trained), key=lambda k: (not k.startswith("reward/"), k))
    return metric_curves_png(runs, keys)


def metric_keys(runs: list[RunRecord], wanted) -> list[str]:
    """The metrics.jsonl keys of any run for which `wanted(key)` holds, in the order they first appear."""
    keys: list[str] = []
    for run in runs:
        for row in run.metrics:
            keys += [key for key in row if wanted(key) and key not in keys]
    return keys


def drift_keys(runs: list[RunRecord]) -> list[str]:
    """The rollout drift metrics any run logged (`drift/...`, flowrl.trainers.drift.RolloutDrift), sorted."""
    return sorted(metric_keys(runs, lambda key: key.startswith("drift/")))


def drift_png(runs: list[RunRecord]) -> bytes | None:
    """The rollout drift curves (`drift_keys`): how far each step's rollout model is from the model it trains."""
    return metric_curves_png(runs, drift_keys(runs))


def metric_curves_png(runs: list[RunRecord], keys: list[str]) -> bytes | None:
    """One panel per metric of `keys` against the step, a line per run (a +-std band where `<key minus mean>std` is
    logged beside a `.../mean`); None without keys."""
    from matplotlib.ticker import MaxNLocator

    if not keys:
        return None
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    figure, axes = new_figure(rows, cols, 4.2 * cols, 3 * rows)
    for ax, key in zip(axes.flat, keys):
        for run in runs:
            points = [
                (r["step"], r[key], r.get(key[: -len("mean")] + "std") if key.endswith("/mean") else None)
                for r in run.metrics
                if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
            ]
            if not points:
                continue
            steps = [p[0] for p in points]
            ax.plot(steps, [p[1] for p in points], label=run.name, marker="." if len(points) < 30 else None)
            if all(isinstance(p[2], (int, float)) for p in points):
                ax.fill_between(steps, [p[1] - p[2] for p in points], [p[1] + p[2] for p in points], alpha=0.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        if len(runs) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys) :]:
        ax.axis("off")
    figure.tight_layout()
    return figure_png(figure)


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point dominates (at least as high on both axes, higher on one), by x."""
    front = [
        i
        for i, (x, y) in enumerate(points)
        if not any(u >= x and v >= y and (u > x or v > y) for j, (u, v) in enumerate(points) if j != i)
    ]
    return sorted(front, key=lambda i: points[i])


def draw_pareto(ax, labelled: dict[str, tuple[float, float]], xlabel: str, ylabel: str, origin=None) -> None:
    """One reward pair: every labelled point, the Pareto front joined by a line, `origin` (the base) as a grey cross."""
    names = list(labelled)
    points = [labelled[n] for n in names]
    front = pareto_front(points)
    for i, (name, (x, y)) in enumerate(zip(names, points)):
        ax.scatter([x], [y], s=28 if i in front else 14, zorder=3)
        ax.annotate(name, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    if len(front) > 1:
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], color="black", linewidth=0.8, zorder=2)
    if origin is not None:
        ax.scatter([origin[0]], [origin[1]], marker="x", color="grey", zorder=3)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)


def pareto_png(runs: list[RunRecord], max_rewards: int = 5) -> bytes | None:
    """With two runs or more: per pair of the rewards every run's last eval has (training, then gold; at most
    `max_rewards`), a scatter of the runs' final means with their Pareto front and the first run's base."""
    import itertools

    finals = [run.evals[-1] for run in runs if run.evals]
    if len(runs) < 2 or len(finals) < len(runs):
        return None
    train, gold = runs[0].reward_names()
    rewards = [r for r in [*train, *gold] if all(isinstance(e.overall(r), (int, float)) for e in finals)][:max_rewards]
    pairs = list(itertools.combinations(rewards, 2))
    if not pairs:
        return None
    cols = min(3, len(pairs))
    rows = math.ceil(len(pairs) / cols)
    figure, axes = new_figure(rows, cols, 4.2 * cols, 3.4 * rows)
    base = runs[0].base
    for ax, (a, b) in zip(axes.flat, pairs):
        labelled = {run.name: (final.overall(a), final.overall(b)) for run, final in zip(runs, finals)}
        origin = (
            (base.overall(a), base.overall(b))
            if base is not None and None not in (base.overall(a), base.overall(b))
            else None
        )
        draw_pareto(ax, labelled, a, b, origin)
    for ax in list(axes.flat)[len(pairs) :]:
        ax.axis("off")
    figure.suptitle("final eval: each run, the Pareto front (line) and the base (x)", fontsize=9)
    figure.tight_layout()
    return figure_png(figure)
