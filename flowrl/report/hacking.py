"""The reward-hacking panel: when does a gold (eval-only) reward or the diversity contradict a training reward?

Two rules, applied at each eval after the reference (eval/base, else the earliest eval), with one `margin`
(absolute, in the rewards' units):

1. fall: a gold reward or the diversity is flagged when its eval mean fell by more than `margin` from the
   reference while at least one training reward's eval mean rose (change > 0);
2. gap: a gold reward paired with the training reward it also measures (`pairs = {gold: training}`, e.g.
   toy_exact with toy_attributes) is flagged when, on the same samples, the training reward rose and its
   gain exceeds the gold reward's gain by more than `margin`:  train_gain > 0  and
   train_gain - gold_gain > margin.  The same samples are the (prompt, seed) pairs that both rewards scored
   (not null) in both evals; a gain is the mean of the per-sample changes over them. The two rewards must
   share units, so the rule needs every one of those scores in [0, 1] and states when they are not.

Rule 2 is off for a gold reward without a pair: a gold reward that watches another quality (an artifact
judge beside an attribute reward) is expected to stay flat while the training reward rises.
"""

from __future__ import annotations

import math
from typing import Any

from flowrl.report.curves import figure_png, new_figure
from flowrl.report.grid import fmt, fmt_delta
from flowrl.report.page import data_uri, esc
from flowrl.report.runs import DIVERSITY, EvalRecord, RunRecord


def check_pairs(pairs: dict[str, str] | None, runs: list[RunRecord]) -> dict[str, str]:
    """`pairs` (gold -> training reward) checked against the rewards of `runs`; ValueError names the bad entry."""
    if pairs is None:
        return {}
    if not isinstance(pairs, dict):
        raise ValueError(
            f"hacking_pairs={pairs!r} must be a dict of gold reward -> training reward, e.g. {{'toy_exact': 'toy_attributes'}}"
        )
    train_all: list[str] = []
    gold_all: list[str] = []
    for run in runs:
        train, gold = run.reward_names()
        train_all += [n for n in train if n not in train_all]
        gold_all += [n for n in gold if n not in gold_all]
    for gold, train in pairs.items():
        if gold not in gold_all:
            raise ValueError(
                f"hacking_pairs: {gold!r} is not a gold reward of the run(s); their gold rewards are "
                f"{gold_all} (scores.json rewards.gold); pair one of those with a training reward"
            )
        if train not in train_all:
            raise ValueError(
                f"hacking_pairs[{gold!r}] = {train!r} is not a training reward of the run(s); their training "
                f"rewards are {train_all} (scores.json rewards.train)"
            )
    return dict(pairs)


def run_pairs(run: RunRecord, pairs: dict[str, str]) -> dict[str, str]:
    """The pairs whose two rewards this run scored (compared runs may score different rewards)."""
    train, gold = run.reward_names()
    return {g: t for g, t in pairs.items() if g in gold and t in train}


def paired_gains(reference: EvalRecord, record: EvalRecord, train: str, gold: str) -> dict[str, Any]:
    """Gains of `train` and `gold` from `reference` to `record` on the samples both rewards scored in both evals."""
    changes: list[tuple[float, float]] = []  # (train change, gold change) per sample
    for key, before in reference.by_key.items():
        after = record.by_key.get(key)
        if after is None:
            continue
        values = [s.get("scores", {}).get(n) for s in (before, after) for n in (train, gold)]  # t0, g0, t1, g1
        if any(v is None or math.isnan(v) for v in values):
            continue
        outside = next(((n, v) for n, v in zip((train, gold, train, gold), values) if not 0 <= v <= 1), None)
        if outside is not None:
            return {
                "samples": 0,
                "train_gain": None,
                "gold_gain": None,
                "gap": None,
                "flagged": False,
                "note": f"{outside[0]} = {fmt(outside[1])} is outside [0, 1]: not compared",
            }
        changes.append((values[2] - values[0], values[3] - values[1]))
    if not changes:
        return {
            "samples": 0,
            "train_gain": None,
            "gold_gain": None,
            "gap": None,
            "flagged": False,
            "note": "no sample scored by both rewards in both evals: not compared",
        }
    train_gain = sum(c[0] for c in changes) / len(changes)
    gold_gain = sum(c[1] for c in changes) / len(changes)
    return {
        "samples": len(changes),
        "train_gain": train_gain,
        "gold_gain": gold_gain,
        "gap": train_gain - gold_gain,
        "flagged": False,
        "note": None,
    }


def hacking_rows(run: RunRecord, margin: float, pairs: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per eval after the reference: training-reward and gold/diversity values, changes and flags.

    Rule 1 (fall): a gold reward (or diversity) is flagged when it fell by more than `margin` from the
    reference while at least one training reward rose (change > 0). Rule 2 (gap, only for `pairs`, gold ->
    training reward): flagged when on the same samples train_gain > 0 and train_gain - gold_gain > margin.
    `row["reasons"][name]` says why each flagged name is flagged.
    """
    pairs = check_pairs(pairs, [run])
    reference = run.reference
    if reference is None:
        return []
    train, gold = run.reward_names()
    rows = []
    for record in run.evals[1:]:
        row: dict[str, Any] = {
            "name": record.name,
            "step": record.step,
            "train": {},
            "watch": {},
            "pairs": {},
            "flagged": [],
            "reasons": {},
        }
        for name in train:
            value, base = record.overall(name), reference.overall(name)
            row["train"][name] = (value, None if value is None or base is None else value - base)
        rising = [n for n, (_, d) in row["train"].items() if d is not None and d > 0]
        for name in gold + [DIVERSITY]:
            value, base = record.overall(name), reference.overall(name)
            delta = None if value is None or base is None else value - base
            reasons = [f"fell by {fmt(-delta)}"] if rising and delta is not None and delta < -margin else []
            if name in pairs:
                pair = {"train": pairs[name], **paired_gains(reference, record, pairs[name], name)}
                pair["flagged"] = pair["gap"] is not None and pair["train_gain"] > 0 and pair["gap"] > margin
                if pair["flagged"]:
                    reasons.append(f"gained {fmt(pair['gap'])} less than {pairs[name]} on the same {pair['samples']} samples")
                row["pairs"][name] = pair
            row["watch"][name] = (value, delta, bool(reasons))
            if reasons:
                row["flagged"].append(name)
                row["reasons"][name] = reasons
        row["rising"] = rising
        rows.append(row)
    return rows


def hacking_png(run: RunRecord, rows: list[dict[str, Any]]) -> bytes | None:
    """Eval means over steps: training rewards, gold rewards and diversity; flagged points in red."""
    from matplotlib.ticker import MaxNLocator

    train, gold = run.reward_names()
    names = train + gold + [DIVERSITY]
    if len(run.evals) < 2:
        return None
    figure, axes = new_figure(1, len(names), 3.4 * len(names), 2.8)
    flagged = {(row["step"], name) for row in rows for name in row["flagged"]}
    for ax, name in zip(axes.flat, names):
        points = [(r.step, r.overall(name)) for r in run.evals if r.overall(name) is not None]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color="tab:blue" if name in train else "tab:green")
        bad = [p for p in points if (p[0], name) in flagged]
        if bad:
            ax.scatter([p[0] for p in bad], [p[1] for p in bad], color="red", zorder=3, s=60, label="flagged")
            ax.legend(fontsize=7)
        kind = "training" if name in train else ("diversity" if name == DIVERSITY else "gold")
        ax.set_title(f"{name} ({kind})", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
    figure.tight_layout()
    return figure_png(figure)


def hacking_section(run: RunRecord, rows: list[dict[str, Any]], margin: float, pairs: dict[str, str]) -> str:
    """The panel of one run: the rules in words, the verdict, eval means with changes, paired gains, the plot."""
    if not rows:
        return "<p>Needs at least two evaluations (base and a later step).</p>"
    train, gold = run.reward_names()
    watch = gold + [DIVERSITY]
    head = "".join(f"<th>{esc(n)} (training)</th>" for n in train) + "".join(f"<th>{esc(n)}</th>" for n in watch)
    body = []
    for row in rows:
        cells = []
        for name in train:
            value, delta = row["train"][name]
            cells.append(f'<td class="num">{fmt(value)} ({fmt_delta(delta)})</td>')
        for name in watch:
            value, delta, flagged = row["watch"][name]
            cells.append(
                f'<td class="num{" flag" if flagged else ""}" data-flag="{int(flagged)}" data-run="{esc(run.name)}" '
                f'data-reward="{esc(name)}" data-step="{esc(row["name"])}" data-kind="hacking">'
                f"{fmt(value)} ({fmt_delta(delta)}){' &#9888;' if flagged else ''}</td>"
            )
        body.append(f"<tr><td>{esc(row['name'])}</td>{''.join(cells)}</tr>")
    flagged = [(row["name"], name, reason) for row in rows for name in row["flagged"] for reason in row["reasons"][name]]
    verdict = (
        (
            '<p class="gap"><b>Possible reward hacking:</b> '
            + "; ".join(f"{esc(n)} {esc(r)} at {esc(s)}" for s, n, r in flagged)
            + " while a training reward rose.</p>"
        )
        if flagged
        else "<p>No gold reward or diversity fell by more than the margin while a training reward rose"
        + (", and no paired gold reward gained more than the margin less than its training reward" if pairs else "")
        + ".</p>"
    )
    plot = hacking_png(run, rows)
    img = f'<img class="plot" alt="hacking panel" src="{data_uri(plot, "image/png")}">' if plot else ""
    return (
        f"<p>Margin: {margin:g} (absolute). Values are eval means with the change from "
        f'{esc(run.reference.title)} in brackets.</p>{_rules(pairs)}{verdict}<table class="hacking"><tr><th>eval</th>{head}</tr>'
        f"{''.join(body)}</table>{_pairs_table(run, rows, pairs)}{img}"
    )


def _rules(pairs: dict[str, str]) -> str:
    fall = (
        "<p>Flagged (fall): a gold reward or the diversity whose mean fell by more than the margin while a "
        "training reward's mean rose."
    )
    if not pairs:
        return (
            fall + " The gap rule (training gain &minus; gold gain &gt; margin on the same samples) needs a gold "
            "reward paired with the training reward it also measures; none is paired here.</p>"
        )
    named = ", ".join(f"{esc(g)} with {esc(t)}" for g, t in pairs.items())
    return (
        fall + f" Flagged (gap): a paired gold reward ({named}) when, on the same samples (the prompt &times; seed "
        "pairs both rewards scored in both evals), the training reward rose and its gain exceeds the gold reward's "
        "gain by more than the margin: training gain &minus; gold gain &gt; margin, both rewards in [0, 1].</p>"
    )


def _pairs_table(run: RunRecord, rows: list[dict[str, Any]], pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    body = []
    for row in rows:
        for gold, pair in row["pairs"].items():
            flag = pair["flagged"]
            gap = fmt_delta(pair["gap"]) + (" &#9888;" if flag else "") if pair["note"] is None else esc(pair["note"])
            body.append(
                f"<tr><td>{esc(row['name'])}</td><td>{esc(pair['train'])} vs {esc(gold)}</td>"
                f'<td class="num">{pair["samples"]}</td><td class="num">{fmt_delta(pair["train_gain"])}</td>'
                f'<td class="num">{fmt_delta(pair["gold_gain"])}</td><td class="num{" flag" if flag else ""}" '
                f'data-flag="{int(flag)}" data-run="{esc(run.name)}" data-reward="{esc(gold)}" '
                f'data-step="{esc(row["name"])}" data-kind="hacking-gap">{gap}</td></tr>'
            )
    return (
        '<table class="hacking-pairs"><tr><th>eval</th><th>training vs gold</th><th>samples</th><th>training gain</th>'
        f"<th>gold gain</th><th>gap (training &minus; gold)</th></tr>{''.join(body)}</table>"
    )
