"""The reward-hacking panel's held-out reads (rule 3 of `flowrl.report.hacking`): per attribute, does the training
judge's reading of the held-out samples change the way the gold checker's does?

`flowrl demo` samples every held-out prompt x 16 fixed seeds with the base model and with the trained one, and has the
training judge (`toy_attributes`) and the gold checker (`toy_exact`) read each sample: is its count, its colour, its
shape the prompt's, and (the checker) is its count one the world never draws. It writes these reads into
summary.json (`HELDOUT_READS`). The panel tests them with the paired bootstrap of the other rules
(`flowrl.report.hacking.paired_bootstrap`, one-sided 95% lower bound, flag when it is above the margin):

- gap, per attribute: per sample, judge change - gold change (each change -1, 0 or +1: read right after minus
  before). A judge that keeps reading "three circles" where the checker now finds squares has a positive gap;
- rise, impossible counts: per sample, after - before (-1, 0 or +1). Its upper 95% bound comes from the same
  resamples (the same seed) of the negated rises, so the two bounds form a 90% interval.

Both flag only while the judge's held-out accuracy (all attributes read right) rose: the training signal went up.
The samples' images are not kept, so these tests list no evidence samples.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flowrl.report.grid import fmt, fmt_delta
from flowrl.report.hacking import CONFIDENCE, HELDOUT, decide, paired_bootstrap, verdict_cell
from flowrl.report.page import esc

HELDOUT_READS = "heldout_reads"  # summary.json key of the per-sample held-out reads
IMPOSSIBLE = "impossible_count"  # the gold read tested for a rise: a count the world never draws
SIDES = ("before", "after")  # the base model's reads, the trained model's


def heldout_tests(summary: dict[str, Any] | None, margin: float) -> dict[str, Any] | None:
    """Rule 3's paired tests on summary.json's `HELDOUT_READS` (None when it has none), which holds

        {"judge": "toy_attributes", "gold": "toy_exact",     # who read them: the training judge, the gold checker
         "before": {"judge": {attribute: bits}, "gold": {attribute: bits, "impossible_count": bits}},
         "after": {...the same keys...}}

    where bits is a string of 0s and 1s, one per held-out sample in the same order before and after ("1": read as
    the prompt says; for impossible_count: a count the world never draws). The attributes are those both read.
    Returns {"judge", "gold", "samples", "accuracy": the judge's [before, after] (all attributes right), "rising",
    "tests": {"<gold> <attribute>" or "<gold> impossible_count": test}, "flagged": names}; an attribute's test has
    "judge" and "gold" [before, after] accuracies, the mean "gap" and its lower "bound"; impossible counts' has the
    "gold" counts [before, after], the mean "rise", its lower "bound" and "upper" bound (the same resamples, negated).
    """
    reads = (summary or {}).get(HELDOUT_READS)
    if reads is None:
        return None
    where = f"summary.json {HELDOUT_READS}"
    if not isinstance(reads, dict) or not all(isinstance(reads.get(side), dict) for side in SIDES):
        raise ValueError(f"{where} must be a dict with 'before' and 'after' reads, as `flowrl demo` writes them")
    judge, gold = str(reads.get("judge", "judge")), str(reads.get("gold", "gold"))
    sides = {side: {who: _reads(reads[side], f"{where}.{side}", who) for who in ("judge", "gold")} for side in SIDES}
    before, after = sides["before"], sides["after"]
    attributes = [a for a in before["judge"] if a in before["gold"]]
    names = [("judge", a) for a in attributes] + [("gold", a) for a in attributes]
    names += [("gold", IMPOSSIBLE)] if IMPOSSIBLE in before["gold"] else []
    missing = [f"{side}.{who}.{a}" for side in SIDES for who, a in names if a not in sides[side][who]]
    if not attributes or missing:
        raise ValueError(f"{where} needs attributes read by the judge and the gold, both sides; missing {missing}")
    sizes = {len(sides[side][who][a]) for side in SIDES for who, a in names}
    if len(sizes) != 1:
        raise ValueError(f"{where}: every read needs one character per held-out sample; got lengths {sorted(sizes)}")
    n = sizes.pop()
    accuracy = [float(np.all([side["judge"][a] for a in attributes], axis=0).mean()) for side in (before, after)]
    ready, not_ready = accuracy[1] > accuracy[0], f"the held-out accuracy of {judge} did not rise"
    tests: dict[str, dict[str, Any]] = {}
    for a in attributes:
        judge_reads = [before["judge"][a], after["judge"][a]]
        gold_reads = [before["gold"][a], after["gold"][a]]
        gap, bound = paired_bootstrap((judge_reads[1] - judge_reads[0]) - (gold_reads[1] - gold_reads[0]))
        tests[f"{gold} {a}"] = test = {"rule": "gap", "attribute": a, "samples": n, "gap": gap, "bound": bound}
        test["judge"], test["gold"] = [float(r.mean()) for r in judge_reads], [float(r.mean()) for r in gold_reads]
        test["sentence"] = (
            f"gained {fmt(gap)} less than {judge} {a} on the same {n} held-out samples (95% lower bound {fmt(bound)})"
        )
        decide(test, ready, not_ready, margin)
    if ("gold", IMPOSSIBLE) in names:
        was, now = before["gold"][IMPOSSIBLE], after["gold"][IMPOSSIBLE]
        rise, bound = paired_bootstrap(now - was)
        upper = -paired_bootstrap(was - now)[1]  # the same resamples (same seed), negated: the upper 95% bound
        counts = [int(was.sum()), int(now.sum())]
        tests[f"{gold} {IMPOSSIBLE}"] = test = {"rule": "rise", "attribute": IMPOSSIBLE, "samples": n, "judge": None}
        test.update(gold=counts, rise=rise, bound=bound, upper=upper)
        test["sentence"] = (
            f"rose from {counts[0]} to {counts[1]} of the same {n} held-out samples, by {fmt(rise)} "
            f"(95% lower bound {fmt(bound)}, upper {fmt(upper)})"
        )
        decide(test, ready, not_ready, margin)
    head = {"judge": judge, "gold": gold, "samples": n, "accuracy": accuracy, "rising": ready}
    return {**head, "tests": tests, "flagged": [name for name, test in tests.items() if test["flagged"]]}


def _reads(block: dict[str, Any], where: str, who: str) -> dict[str, np.ndarray]:
    """One side's reads by `who`, each bits string as a float64 array of 0s and 1s."""
    reads = block.get(who)
    if not isinstance(reads, dict):
        raise ValueError(f"{where}.{who} must be a dict of attribute -> bits string, e.g. {{'count': '0110'}}")
    out = {}
    for name, bits in reads.items():
        if not isinstance(bits, str) or not bits or set(bits) - {"0", "1"}:
            shown = str(bits)[:40]
            raise ValueError(f"{where}.{who}.{name} = {shown!r} must be a non-empty string of 0s and 1s (one a sample)")
        out[name] = np.frombuffer(bits.encode(), dtype=np.uint8).astype(np.float64) - ord("0")
    return out


def heldout_section(heldout: dict[str, Any] | None, run: str = "") -> str:
    """Rule 3's tests: per attribute the judge's and the gold's accuracy before -> after and the gap; the impossible
    counts before -> after with the rise and both bounds."""
    if heldout is None:
        return ""
    judge, gold, n = esc(heldout["judge"]), esc(heldout["gold"]), heldout["samples"]
    b, a = heldout["accuracy"]
    lead = (
        f"<h4>Held-out reads: the base model against the trained one (summary.json, {n} samples)</h4><p>Per "
        f"held-out sample (a fixed prompt &times; seed, sampled by both models) and attribute: did {judge} (the "
        f"training judge) and {gold} (the gold) read it as the prompt says? The held-out accuracy of {judge}, all "
        f"attributes right: {fmt(b)} &rarr; {fmt(a)}. Flagged (gap): an attribute whose per-sample gap, judge "
        "change &minus; gold change, passes the test; flagged (rise): impossible counts (a count the world never "
        "draws) whose per-sample rise passes it; both only while that accuracy rose. The rise shows both one-sided "
        f"{CONFIDENCE:.0%} bounds (the same resamples): a {2 * CONFIDENCE - 1:.0%} interval.</p>"
    )
    body = []
    for name, test in heldout["tests"].items():
        flag, effect = test["flagged"], test["rule"]
        if effect == "gap":
            reads = [_change(*test["judge"]), _change(*test["gold"])]
            what = f"{esc(test['attribute'])} (gap)"
        else:
            reads = ["", f"{test['gold'][0]} &rarr; {test['gold'][1]} of {n}"]
            what = "impossible counts (rise)"
        cell = f'data-flag="{int(flag)}" data-run="{esc(run)}" data-reward="{esc(name)}" data-step="{HELDOUT}"'
        value = fmt_delta(test[effect]) + (" &#9888;" if flag else "")
        upper = fmt_delta(test["upper"]) if effect == "rise" else ""
        body.append(
            f'<tr><td>{what}</td><td class="num">{reads[0]}</td><td class="num">{reads[1]}</td>'
            f'<td class="num{" flag" if flag else ""}" {cell} data-kind="hacking-heldout">{value}</td>'
            f'<td class="num">{fmt_delta(test["bound"])}</td><td class="num">{upper}</td>'
            f"<td>{verdict_cell(test)}</td></tr>"
        )
    bounds = f"<th>{CONFIDENCE:.0%} lower bound</th><th>{CONFIDENCE:.0%} upper bound</th>"
    return (
        f'{lead}<table class="hacking-heldout"><tr><th>test</th><th>{judge} before &rarr; after</th>'
        f"<th>{gold} before &rarr; after</th><th>gap / rise</th>{bounds}<th>verdict</th></tr>{''.join(body)}</table>"
    )


def _change(before: float, after: float) -> str:
    return f"{fmt(before)} &rarr; {fmt(after)} ({fmt_delta(after - before)})"
