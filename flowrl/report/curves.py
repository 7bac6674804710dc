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
    from matplotlib.ticker import MaxNLocator

    keys: list[str] = []
    for run in runs:
        for row in run.metrics:
            for key in row:
                if (key.startswith("reward/") and key.endswith("/mean") or key in ("train/kl", "train/loss")) and key not in keys:
                    keys.append(key)
    if not keys:
        return None
    keys.sort(key=lambda k: (not k.startswith("reward/"), k))
    cols = min(3, len(keys))
    rows = math.ceil(len(keys) / cols)
    figure, axes = new_figure(rows, cols, 4.2 * cols, 3 * rows)
    for ax, key in zip(axes.flat, keys):
        for run in runs:
            points = [
                (r["step"], r[key], r.get(key[: -len("mean")] + "std"))
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
