"""The reward-hacking panel: when does a gold (eval-only) reward or the diversity contradict a training reward?

Two rules, applied at each eval after the reference (eval/base, else the earliest eval). Each is a paired test over
the eval's samples: the same (prompt, seed) samples, scored in both evals, compared one by one. A per-sample effect
(positive = bad) is averaged, and a one-sided 95% lower bound of that mean comes from a paired bootstrap
(`paired_bootstrap`: 2000 resamples of the samples with replacement, numpy default_rng(0), so the report is the same
every time). A test flags only when that lower bound is above `margin` (absolute, in the rewards' units): with 95%
confidence the mean effect is larger than the smallest effect worth a flag. This is the one-sided test of
H0: mean effect <= margin; with margin 0 it is the plain "bound excludes 0" test. Testing against 0 with the
margin on the mean alone is not enough: in the demo one of 32 eval samples turned into an empty image (its
toy_artifact fell 0.76) while 26 of the other 31 drifted down by about 1e-4; the mean fall, 0.0239, exceeded the
margin 0.02 and the bound, 7.6e-05, excluded 0, yet without that one sample nothing fell. Its bound is far below
the margin, so it is not flagged; the count-blind judge's gap (0.124 on 32 samples, bound 0.031) is.

1. fall: a gold reward is flagged when its per-sample fall (reference score - later score, on the samples that have
   it in both evals) passes the test while at least one training reward's eval mean rose (change > 0). The
   diversity has no per-sample values (it is one number per prompt, over its seeds): its test runs the same way
   over the prompts instead of the samples;
2. gap: a gold reward paired with the training reward it also measures (`pairs = {gold: training}`, e.g. toy_exact
   with toy_attributes) is flagged when, on the samples that both rewards scored in both evals, the training
   reward rose (train_gain > 0) and the per-sample gap (training change - gold change) passes the test. The two
   rewards must share units, so the rule needs every one of those scores in [0, 1] and states when they are not.

Rule 2 is off for a gold reward without a pair: a gold reward that watches another quality (an artifact judge beside
an attribute reward) is expected to stay flat while the training reward rises.

3. held-out reads (`flowrl.report.heldout`, when the run's summary.json has them, as `flowrl demo` writes): per
   attribute (count, colour, shape), the per-sample gap between the training judge's and the gold checker's change
   in reading it right, and the per-sample rise of impossible counts, on the summary's held-out samples, base model
   against the trained one. Its flags are named with the eval `HELDOUT`; `hacking_section` takes them in its verdict.

Evidence: for every test that is flagged, or nearly (its precondition holds and its mean effect exceeds half the
margin), the panel lists the `EVIDENCE` samples (diversity: prompts) that moved most, with their scores before and
after and their images.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from flowrl.report.curves import figure_png, new_figure
from flowrl.report.grid import fmt, fmt_delta
from flowrl.report.page import data_uri, esc, image_tag
from flowrl.report.runs import DIVERSITY, EvalRecord, RunRecord

CONFIDENCE = 0.95  # one-sided level of the bootstrap bound
RESAMPLES = 2000  # bootstrap resamples per test
SEED = 0  # numpy default_rng seed of the bootstrap: the same verdict every time a report is built
EVIDENCE = 4  # samples (diversity: prompts) that moved most, listed under a flagged or nearly flagged test
EVIDENCE_THUMB = 96  # their images' largest height in pixels
_CHUNK = 1 << 20  # resampled values drawn at a time: bounds the memory of a large eval
HELDOUT = "heldout"  # the eval name of rule 3's flags: base against the trained model, on the summary's samples

Pair = tuple[tuple[str, int | None], list[float], list[float]]  # (prompt, seed), scores before, scores after


def paired_bootstrap(
    effects: Sequence[float], resamples: int = RESAMPLES, confidence: float = CONFIDENCE, seed: int = SEED
) -> tuple[float, float]:
    """(mean, one-sided lower bound) of per-sample `effects` by the percentile bootstrap over the samples.

    Each of `resamples` resamples draws len(effects) of the effects with replacement (numpy default_rng(`seed`)) and
    takes their mean; the bound is the (1 - `confidence`) quantile of those means, numpy's "lower" method (the
    largest resampled mean with at most that fraction of the others below it). The effects are paired: each is one
    sample's change between two evals, so what the samples share (prompt, seed) cancels.
    """
    x = np.asarray(effects, dtype=np.float64)
    if x.ndim != 1 or x.size == 0 or not np.isfinite(x).all():
        raise ValueError(
            f"paired_bootstrap needs a non-empty 1-D list of finite numbers; got {x.size} values, shape {x.shape}"
        )
    if not 0 < confidence < 1 or resamples < 1:
        raise ValueError(
            f"paired_bootstrap: confidence={confidence} must lie in (0, 1) and resamples={resamples} be >= 1"
        )
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    rows = max(1, _CHUNK // x.size)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        means[start:stop] = x[rng.integers(0, x.size, size=(stop - start, x.size))].mean(axis=1)
    return float(x.mean()), float(np.quantile(means, 1 - confidence, method="lower"))


def significant(effect: float | None, bound: float | None, margin: float) -> bool:
    """The flag of one test: the one-sided lower bound of the mean effect exceeds the margin (and so does the mean)."""
    return effect is not None and bound is not None and bound > margin and effect > margin


def decide(test: dict[str, Any], ready: bool, not_ready: str, margin: float) -> dict[str, Any]:
    """Sets a test's "flagged", "near" and "verdict" (why, in words); `ready`: its precondition holds (a training
    reward rose)."""
    effect = test["rule"]  # "fall", "gap" or "rise": the key of the mean effect
    value, bound = test[effect], test["bound"]
    test["flagged"] = ready and significant(value, bound, margin)
    test["near"] = not test["flagged"] and ready and value is not None and value > margin / 2
    if test.get("note") or value is None:
        test["verdict"] = test.get("note") or "not tested"
    elif test["flagged"]:
        test["verdict"] = "flagged"
    else:
        misses = [not_ready] if not ready else []
        if value <= 0:
            misses.append(f"no {effect}")
        elif value <= margin:
            misses.append(f"the mean {effect} is within the margin")
        elif not significant(value, bound, margin):
            misses.append("the bound is not above the margin")
        test["verdict"] = "not flagged: " + ", ".join(misses)
    return test


def near_misses(rows: list[dict[str, Any]], heldout: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """(eval, reward, sentence) of every nearly flagged test, e.g. ("step_000060", "toy_artifact", "fell by 0.0239 on
    the same 32 samples (95% lower bound 7.57e-05), not flagged: the bound is not above the margin"); the held-out
    tests (`flowrl.report.heldout.heldout_tests`) last, as ("heldout", "toy_exact shape", ...)."""
    out = []
    for row in rows:
        for name, test in row["falls"].items():
            if test["near"]:
                what = f"fell by {fmt(test['fall'])} on the same {test['samples']} {test['unit']}"
                out.append((row["name"], name, f"{what} (95% lower bound {fmt(test['bound'])}), {test['verdict']}"))
        for name, pair in row["pairs"].items():
            if pair["near"]:
                what = f"gained {fmt(pair['gap'])} less than {pair['train']} on the same {pair['samples']} samples"
                out.append((row["name"], name, f"{what} (95% lower bound {fmt(pair['bound'])}), {pair['verdict']}"))
    for name, test in (heldout or {}).get("tests", {}).items():
        if test["near"]:
            out.append((HELDOUT, name, f"{test['sentence']}, {test['verdict']}"))
    return out


def check_pairs(pairs: dict[str, str] | None, runs: list[RunRecord]) -> dict[str, str]:
    """`pairs` (gold -> training reward) checked against the rewards of `runs`; ValueError names the bad entry."""
    if pairs is None:
        return {}
    if not isinstance(pairs, dict):
        raise ValueError(
            f"hacking_pairs={pairs!r} must be a dict of gold reward -> training reward, "
            "e.g. {'toy_exact': 'toy_attributes'}"
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


def paired_scores(reference: EvalRecord, record: EvalRecord, names: list[str]) -> list[Pair]:
    """The samples that have every one of `names` (not null, not NaN) in both evals, in the reference's order."""
    out: list[Pair] = []
    for key, before in reference.by_key.items():
        after = record.by_key.get(key)
        if after is None:
            continue
        b = [before.get("scores", {}).get(n) for n in names]
        a = [after.get("scores", {}).get(n) for n in names]
        if all(v is not None and not math.isnan(v) for v in b + a):
            out.append((key, b, a))
    return out


def _moved(pairs: list[Pair], effects: list[float], names: list[str]) -> list[dict[str, Any]]:
    """The `EVIDENCE` pairs with the largest positive effects, largest first (ties: the reference's order)."""
    order = sorted(range(len(pairs)), key=lambda i: -effects[i])
    return [
        {
            "prompt": pairs[i][0][0],
            "seed": pairs[i][0][1],
            "before": dict(zip(names, pairs[i][1])),
            "after": dict(zip(names, pairs[i][2])),
            "effect": effects[i],
        }
        for i in order[:EVIDENCE]
        if effects[i] > 0
    ]


def fall_test(reference: EvalRecord, record: EvalRecord, name: str) -> dict[str, Any]:
    """Rule 1's paired test of a gold reward (or the diversity, over prompts) from `reference` to `record`.

    Returns {"unit": "samples" | "prompts", "samples", "fall": mean of reference - later, "bound": its 95% lower bound,
    "moved": the samples that fell most, "note": why it was not tested, else None}.
    """
    if name == DIVERSITY:
        unit, pairs = "prompts", []
        for prompt in reference.scores.get("prompts", []):
            b, a = reference.prompt_value(DIVERSITY, prompt), record.prompt_value(DIVERSITY, prompt)
            if b is not None and a is not None and not (math.isnan(b) or math.isnan(a)):
                pairs.append(((prompt, None), [b], [a]))
    else:
        unit, pairs = "samples", paired_scores(reference, record, [name])
    if not pairs:
        note = f"no {unit[:-1]} has {name} in both evals: not tested"
        return {"unit": unit, "samples": 0, "fall": None, "bound": None, "moved": [], "note": note}
    effects = [b[0] - a[0] for _, b, a in pairs]
    fall, bound = paired_bootstrap(effects)
    return {
        "unit": unit,
        "samples": len(pairs),
        "fall": fall,
        "bound": bound,
        "moved": _moved(pairs, effects, [name]),
        "note": None,
    }


def paired_gains(reference: EvalRecord, record: EvalRecord, train: str, gold: str) -> dict[str, Any]:
    """Rule 2's paired test: gains of `train` and `gold` from `reference` to `record` on the samples both rewards
    scored in both evals, the gap (train gain - gold gain) with its 95% lower bound, and the samples with the largest
    per-sample gaps ("moved")."""
    pairs = paired_scores(reference, record, [train, gold])
    empty = {
        "samples": 0,
        "train_gain": None,
        "gold_gain": None,
        "gap": None,
        "bound": None,
        "moved": [],
        "flagged": False,
    }
    for _, before, after in pairs:
        outside = next(((n, v) for n, v in zip((train, gold, train, gold), before + after) if not 0 <= v <= 1), None)
        if outside is not None:
            return {**empty, "note": f"{outside[0]} = {fmt(outside[1])} is outside [0, 1]: not compared"}
    if not pairs:
        return {**empty, "note": "no sample scored by both rewards in both evals: not compared"}
    train_changes = [a[0] - b[0] for _, b, a in pairs]
    gold_changes = [a[1] - b[1] for _, b, a in pairs]
    effects = [t - g for t, g in zip(train_changes, gold_changes)]
    gap, bound = paired_bootstrap(effects)
    return {
        "samples": len(pairs),
        "train_gain": sum(train_changes) / len(pairs),
        "gold_gain": sum(gold_changes) / len(pairs),
        "gap": gap,
        "bound": bound,
        "moved": _moved(pairs, effects, [train, gold]),
        "flagged": False,
        "note": None,
    }


def hacking_rows(run: RunRecord, margin: float, pairs: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """One row per eval after the reference: training-reward and gold/diversity values, changes, tests and flags.

    Rule 1 (fall, `row["falls"][name]`): a gold reward (or diversity) is flagged when at least one training reward
    rose (eval-mean change > 0) and the 95% lower bound of its paired fall is above `margin`.
    Rule 2 (gap, `row["pairs"][gold]`, only for `pairs`, gold -> training reward): flagged when on the same samples
    train_gain > 0 and the 95% lower bound of the mean gap is above `margin`. A test is "near" when it is not flagged,
    its precondition holds (a training reward rose) and its mean effect exceeds margin / 2; flagged and near tests
    show the samples that moved most. `row["reasons"][name]` says why each flagged name is flagged.
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
            "falls": {},
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
            fall = {"rule": "fall", **fall_test(reference, record, name)}
            decide(fall, bool(rising), "no training reward rose", margin)
            row["falls"][name] = fall
            reasons = []
            if fall["flagged"]:
                reasons.append(
                    f"fell by {fmt(fall['fall'])} on the same {fall['samples']} {fall['unit']} "
                    f"(95% lower bound {fmt(fall['bound'])})"
                )
            if name in pairs:
                pair = {"rule": "gap", "train": pairs[name], **paired_gains(reference, record, pairs[name], name)}
                rose = pair["gap"] is not None and pair["train_gain"] > 0
                decide(pair, rose, f"{pairs[name]} did not rise", margin)
                if pair["flagged"]:
                    reasons.append(
                        f"gained {fmt(pair['gap'])} less than {pairs[name]} on the same {pair['samples']} samples "
                        f"(95% lower bound {fmt(pair['bound'])})"
                    )
                row["pairs"][name] = pair
            row["watch"][name] = (value, delta, bool(reasons))
            if reasons:
                row["flagged"].append(name)
                row["reasons"][name] = reasons
        row["rising"] = rising
        rows.append(row)
    return rows


def panel_flags(rows: list[dict[str, Any]], heldout: dict[str, Any] | None = None) -> list[tuple[str, str, str]]:
    """(eval, name, reason) of every flag of the panel: the evals' (rules 1 and 2), then the held-out reads' (rule 3,
    eval `HELDOUT`)."""
    out = [(row["name"], name, reason) for row in rows for name in row["flagged"] for reason in row["reasons"][name]]
    return out + [(HELDOUT, name, heldout["tests"][name]["sentence"]) for name in (heldout or {}).get("flagged", [])]


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
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            color="tab:blue" if name in train else "tab:green",
        )
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


def hacking_section(
    run: RunRecord,
    rows: list[dict[str, Any]],
    margin: float,
    pairs: dict[str, str],
    heldout: dict[str, Any] | None = None,
) -> str:
    """The panel of one run: the rules in words, the verdict (with the flags of `heldout`, the held-out reads' tests
    from `flowrl.report.heldout.heldout_tests`, when the run has them), eval means with changes, the paired tests, the
    samples that moved most under each flagged or nearly flagged test, the plot."""
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
    flagged = panel_flags(rows, heldout)
    verdict = (
        (
            '<p class="gap"><b>Possible reward hacking:</b> '
            + "; ".join(f"{esc(n)} {esc(r)}" + ("" if s == HELDOUT else f" at {esc(s)}") for s, n, r in flagged)
            + " while a training reward rose.</p>"
        )
        if flagged
        else "<p>No gold reward or diversity fell by more than the margin with 95% confidence while a training reward "
        "rose"
        + (
            ", and no paired gold reward gained more than the margin less than its training reward with 95% confidence"
            if pairs
            else ""
        )
        + (", and the held-out reads flag no attribute and no rise of impossible counts" if heldout else "")
        + ".</p>"
    )
    plot = hacking_png(run, rows)
    img = f'<img class="plot" alt="hacking panel" src="{data_uri(plot, "image/png")}">' if plot else ""
    return (
        f"<p>Margin: {margin:g} (absolute). Values are eval means with the change from {esc(run.reference.title)} in "
        f'brackets.</p>{_rules(pairs)}{verdict}<table class="hacking">'
        f"<tr><th>eval</th>{head}</tr>{''.join(body)}</table>"
        f"{_falls_table(rows)}{_pairs_table(run, rows, pairs)}{_evidence(run, rows)}{img}"
    )


def _rules(pairs: dict[str, str]) -> str:
    test = (
        f"<p>Each rule is a paired test: per sample (the same prompt &times; seed in both evals) the change that "
        f"would mean hacking, its mean, and a one-sided {CONFIDENCE:.0%} lower bound of that mean from a bootstrap "
        f"over the samples ({RESAMPLES} resamples, fixed seed {SEED}). A test flags only when that bound is above the "
        "margin: the change is large enough to matter, and it is not carried by one or two samples.</p>"
    )
    fall = (
        "<p>Flagged (fall): a gold reward whose per-sample fall passes the test while a training reward's mean rose; "
        "the diversity, one value per prompt, is tested over the prompts."
    )
    if not pairs:
        return (
            test + fall + " The gap rule (training gain &minus; gold gain on the same samples) needs a gold "
            "reward paired with the training reward it also measures; none is paired here.</p>"
        )
    named = ", ".join(f"{esc(g)} with {esc(t)}" for g, t in pairs.items())
    return (
        test + fall + f" Flagged (gap): a paired gold reward ({named}) when, on the same samples (the prompt &times; "
        "seed pairs both rewards scored in both evals), the training reward rose and the per-sample gap, training "
        "change &minus; gold change, passes the test (lower bound of the mean gap &gt; margin), both rewards in "
        "[0, 1].</p>"
    )


def verdict_cell(test: dict[str, Any]) -> str:
    """A test's verdict in a table cell: its words, and a warning sign when flagged."""
    return esc(test["verdict"]) + (" &#9888;" if test["flagged"] else "")


def _falls_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for row in rows:
        for name, test in row["falls"].items():
            body.append(
                f'<tr data-step="{esc(row["name"])}" data-test="{esc(name)}">'
                f"<td>{esc(row['name'])}</td><td>{esc(name)}</td>"
                f'<td class="num">{test["samples"]} {test["unit"]}</td><td class="num">{fmt_delta(test["fall"])}</td>'
                f'<td class="num">{fmt_delta(test["bound"])}</td><td>{verdict_cell(test)}</td></tr>'
            )
    return (
        '<table class="hacking-falls"><tr><th>eval</th><th>fall test</th><th>over</th><th>mean fall</th>'
        f"<th>{CONFIDENCE:.0%} lower bound</th><th>verdict</th></tr>{''.join(body)}</table>"
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
                f'data-step="{esc(row["name"])}" data-kind="hacking-gap">{gap}</td>'
                f'<td class="num">{fmt_delta(pair["bound"])}</td>'
                f"<td>{'' if pair['note'] else verdict_cell(pair)}</td></tr>"
            )
    return (
        '<table class="hacking-pairs"><tr><th>eval</th><th>training vs gold</th><th>samples</th><th>training gain</th>'
        "<th>gold gain</th><th>gap (training &minus; gold)</th>"
        f"<th>{CONFIDENCE:.0%} lower bound</th><th>verdict</th></tr>"
        f"{''.join(body)}</table>"
    )


def _evidence(run: RunRecord, rows: list[dict[str, Any]]) -> str:
    """Under each flagged or nearly flagged test: the samples (diversity: prompts) that moved most."""
    records = {r.name: r for r in run.evals}
    parts = []
    for row in rows:
        record = records[row["name"]]
        tests = [(name, test, [name]) for name, test in row["falls"].items()]
        tests += [(gold, pair, [pair["train"], gold]) for gold, pair in row["pairs"].items()]
        for name, test, names in tests:
            if (test["flagged"] or test["near"]) and test["moved"]:
                parts.append(_evidence_table(run, run.reference, record, name, test, names))
    if not parts:
        return ""
    return (
        "<h4>Samples that moved most (flagged tests, and tests whose mean is above half the margin)</h4>"
        f"{''.join(parts)}"
    )


def _evidence_table(
    run: RunRecord, reference: EvalRecord, record: EvalRecord, name: str, test: dict[str, Any], names: list[str]
) -> str:
    gap = test["rule"] == "gap"
    effect = "gap" if gap else "fall"
    what = f"{test['train']} vs {name} (gap)" if gap else f"{name} (fall)"
    unit = "prompts" if name == DIVERSITY else "samples"
    status = verdict_cell(test)
    count = len(test["moved"])
    which = f"The {unit[:-1]}" if count == 1 else f"The {count} {unit}"
    lead = (
        f"<p><b>{esc(what)}</b> at {esc(record.title)}: mean {effect} {fmt_delta(test[effect])}, "
        f"{CONFIDENCE:.0%} lower bound {fmt_delta(test['bound'])} over {test['samples']} {unit}, {status}. "
        f"{which} with the largest {effect}:</p>"
    )
    images = name != DIVERSITY
    head = "<th>prompt</th>" + (
        f"<th>seed</th><th>{esc(reference.title)}</th><th>{esc(record.title)}</th>" if images else ""
    )
    head += "".join(f"<th>{esc(n)}</th>" for n in names) + f"<th>{effect}</th>"
    body = []
    for moved in test["moved"]:
        cells = f"<td>{esc(moved['prompt'])}</td>"
        if images:
            cells += f'<td class="num">{esc(moved["seed"])}</td>'
            cells += "".join(f"<td>{_image(r, moved['prompt'], moved['seed'])}</td>" for r in (reference, record))
        cells += "".join(
            f'<td class="num">{fmt(moved["before"][n])} &rarr; {fmt(moved["after"][n])}</td>' for n in names
        )
        body.append(f'<tr>{cells}<td class="num">{fmt_delta(moved["effect"])}</td></tr>')
    return (
        f'{lead}<table class="hacking-evidence" data-run="{esc(run.name)}" data-test="{esc(name)}" '
        f'data-rule="{effect}" data-step="{esc(record.name)}"><tr>{head}</tr>{"".join(body)}</table>'
    )


def _image(record: EvalRecord, prompt: str, seed: int) -> str:
    sample = record.sample(prompt, seed) or {}
    if "image" not in sample:
        return '<span class="missing">no image</span>'
    tag = image_tag(record.path / sample["image"], EVIDENCE_THUMB, alt=f"evidence {record.name}/{sample['image']}")
    return tag or f'<span class="missing gap">missing {esc(sample["image"])}</span>'
