"""The hacking panel's held-out reads (`flowrl.report.heldout`): per attribute, the training judge's change against the
gold checker's on the same samples, and the rise of impossible counts, with the panel's paired bootstrap. Reads are
fabricated by hand; the bounds are checked against a direct numpy resample with the same seed and, where every
sample moves alike, against the mean itself."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from fabricated_runs import GOLD, TRAIN, fabricate_run

from flowrl.report import build_report, load_run
from flowrl.report.hacking import HELDOUT, RESAMPLES, SEED, near_misses
from flowrl.report.heldout import HELDOUT_READS, IMPOSSIBLE, heldout_tests

EXACT = "toy_exact"
ATTRIBUTES = ("count", "colour", "shape")


def bits(ones: set[int], n: int) -> str:
    """A read of n samples, "1" on the samples in `ones`."""
    return "".join("1" if i in ones else "0" for i in range(n))


def reads(before: dict[str, dict[str, set[int]]], after: dict[str, dict[str, set[int]]], n: int) -> dict:
    """summary.json's held-out reads from the sets of samples read right (impossible: the impossible ones)."""

    def side(sets):
        return {who: {name: bits(ones, n) for name, ones in sets[who].items()} for who in ("judge", "gold")}

    return {HELDOUT_READS: {"judge": TRAIN, "gold": EXACT, "before": side(before), "after": side(after)}}


def direct_bounds(effects: np.ndarray) -> tuple[float, float]:
    """The 5% and 95% points of the bootstrap means, resampled here with numpy directly: 2000 resamples of the samples
    with replacement from default_rng(0) (one draw of [2000, n] indices), sorted; numpy's "lower" quantile of 2000
    values at 0.05 is the 100th smallest (index floor(0.05 * 1999) = 99), and its mirror image the 100th largest."""
    rng = np.random.default_rng(SEED)
    means = np.sort(effects[rng.integers(0, effects.size, size=(RESAMPLES, effects.size))].mean(axis=1))
    return float(means[99]), float(means[RESAMPLES - 1 - 99])


N = 40
ALL = set(range(N))
FIXED = set(range(20))  # samples whose count was wrong before training and right after, by both readers
WRONG_SHAPE = set(range(10))  # after training the checker finds the wrong shape here; the judge still reads it right


def shape_diverges() -> dict:
    """Training fixes the count on samples 0-19 (judge and checker alike), leaves the colour alone, and breaks the
    shape on samples 0-9 for the checker only: the judge's shape accuracy stays 1, the checker's falls to 0.75."""
    before = {
        "judge": {"count": ALL - FIXED, "colour": ALL, "shape": ALL},
        "gold": {"count": ALL - FIXED, "colour": ALL, "shape": ALL, IMPOSSIBLE: {39}},
    }
    after = {
        "judge": {"count": ALL, "colour": ALL, "shape": ALL},
        "gold": {"count": ALL, "colour": ALL, "shape": ALL - WRONG_SHAPE, IMPOSSIBLE: {39}},
    }
    return reads(before, after, N)


def test_the_panel_flags_exactly_the_attribute_whose_reads_diverge():
    held = heldout_tests(shape_diverges(), margin=0.02)
    assert (held["judge"], held["gold"], held["samples"], held["rising"]) == (TRAIN, EXACT, N, True)
    assert held["accuracy"] == [0.5, 1.0]  # the judge reads all three right on 20, then on 40 of 40 samples
    assert held["flagged"] == [f"{EXACT} shape"]
    count, colour, shape, impossible = (held["tests"][f"{EXACT} {a}"] for a in (*ATTRIBUTES, IMPOSSIBLE))
    assert (count["judge"], count["gold"], count["gap"], count["bound"]) == ([0.5, 1.0], [0.5, 1.0], 0.0, 0.0)
    assert count["verdict"] == colour["verdict"] == "not flagged: no gap"  # every per-sample gap is 0: so is each mean
    assert (shape["judge"], shape["gold"]) == ([1.0, 1.0], [1.0, 0.75])
    effects = np.array([1.0 if i in WRONG_SHAPE else 0.0 for i in range(N)])  # judge change 0 - gold change -1
    lower, _ = direct_bounds(effects)
    assert shape["gap"] == pytest.approx(0.25, abs=1e-15) and shape["bound"] == lower
    assert 0.02 < lower < 0.25 and shape["flagged"] and shape["verdict"] == "flagged"
    assert shape["sentence"] == (
        f"gained 0.25 less than {TRAIN} shape on the same 40 held-out samples (95% lower bound {lower:.3g})"
    )
    assert (impossible["gold"], impossible["rise"], impossible["bound"], impossible["upper"]) == ([1, 1], 0.0, 0.0, 0.0)
    assert not impossible["flagged"] and impossible["verdict"] == "not flagged: no rise"


def test_the_report_shows_the_held_out_tests_and_flags_the_diverging_attribute(tmp_path):
    # the evals flag nothing (the training reward stays flat), so every flag of the run comes from the held-out reads
    run_dir = fabricate_run(
        tmp_path,
        "shapes",
        prompts=["one red circle"],
        seeds=[0, 1],
        steps=[0, 1],
        scores_fn=lambda k, p, s: {TRAIN: 0.5, GOLD: 0.5},
    )
    (run_dir / "summary.json").write_text(json.dumps(shape_diverges()))
    result = build_report(run_dir, out_dir=tmp_path / "out", hacking_pairs={})
    assert result["flags"] == {"shapes": [(HELDOUT, f"{EXACT} shape")]}
    ((step, name, reason),) = result["flag_reasons"]["shapes"]
    assert reason.startswith(f"gained 0.25 less than {TRAIN} shape on the same 40 held-out samples (95% lower bound")
    page = (tmp_path / "out" / "index.html").read_text()
    assert f"<b>Possible reward hacking:</b> {EXACT} shape {reason} while a training reward rose." in page
    table = re.search(r'<table class="hacking-heldout">.*?</table>', page).group(0)
    cells = re.findall(r'data-flag="(\d)" data-run="shapes" data-reward="([^"]+)" data-step="heldout"', table)
    assert [flag for flag, _ in cells] == ["0", "0", "1", "0"]
    assert [name for _, name in cells] == [f"{EXACT} {a}" for a in (*ATTRIBUTES, IMPOSSIBLE)]
    assert '<td class="num">1 &rarr; 1 (+0)</td><td class="num">1 &rarr; 0.75 (-0.25)</td>' in table
    assert "<td>impossible counts (rise)</td>" in table and "1 &rarr; 1 of 40" in table
    assert "Held-out reads: the base model against the trained one (summary.json, 40 samples)" in page
    assert heldout_tests(load_run(run_dir).summary, 0.02)["flagged"] == [f"{EXACT} shape"]  # what the report read


def test_impossible_counts_that_rise_are_flagged_with_both_bounds():
    # 64 samples: 2 with an impossible count before and after, 12 more after training; the judge reads those counts
    # wrong as the checker does (no count gap), and both now read the colour right on samples 20-39: accuracy 42 -> 50
    n, everyone, stay, new = 64, set(range(64)), {62, 63}, set(range(12))
    colour_fixed = set(range(20, 40))
    readers = ("judge", "gold")
    before = {who: {"count": everyone - stay, "colour": everyone - colour_fixed, "shape": everyone} for who in readers}
    after = {who: {"count": everyone - stay - new, "colour": everyone, "shape": everyone} for who in readers}
    before["gold"][IMPOSSIBLE], after["gold"][IMPOSSIBLE] = stay, stay | new
    held = heldout_tests(reads(before, after, n), margin=0.02)
    assert held["accuracy"] == [42 / 64, 50 / 64] and held["flagged"] == [f"{EXACT} {IMPOSSIBLE}"]
    assert [held["tests"][f"{EXACT} {a}"]["gap"] for a in ATTRIBUTES] == [0.0, 0.0, 0.0]
    test = held["tests"][f"{EXACT} {IMPOSSIBLE}"]
    effects = np.array([1.0 if i in new else 0.0 for i in range(n)])
    lower, upper = direct_bounds(effects)
    assert (test["gold"], test["rise"]) == ([2, 14], pytest.approx(12 / 64, abs=1e-15))
    assert (test["bound"], test["upper"]) == (lower, upper) and 0.02 < lower < 12 / 64 < upper and test["flagged"]
    assert test["sentence"] == (
        f"rose from 2 to 14 of the same 64 held-out samples, by 0.188 (95% lower bound {lower:.3g}, upper {upper:.3g})"
    )
    # the same impossible counts while the judge's accuracy does not rise (no colour fixed): shown, not flagged
    before["judge"]["colour"] = before["gold"]["colour"] = everyone
    quiet = heldout_tests(reads(before, after, n), margin=0.02)
    test = quiet["tests"][f"{EXACT} {IMPOSSIBLE}"]
    assert quiet["accuracy"] == [62 / 64, 50 / 64] and (test["bound"], test["upper"]) == (lower, upper)
    assert not test["flagged"] and quiet["flagged"] == []
    assert test["verdict"] == f"not flagged: the held-out accuracy of {TRAIN} did not rise"


def test_degenerate_reads_give_the_mean_as_both_bounds():
    n, everyone = 16, set(range(16))
    right = {a: everyone for a in ATTRIBUTES}
    before = {"judge": {**right, "count": set()}, "gold": {**right, "count": set(), IMPOSSIBLE: set()}}
    after = {"judge": right, "gold": {**right, "shape": set(), IMPOSSIBLE: everyone}}  # every sample: wrong, impossible
    held = heldout_tests(reads(before, after, n), margin=0.02)
    shape, impossible = held["tests"][f"{EXACT} shape"], held["tests"][f"{EXACT} {IMPOSSIBLE}"]
    assert (shape["gap"], shape["bound"]) == (1.0, 1.0)  # every per-sample gap is 0 - (-1): every resample's mean is 1
    assert (impossible["rise"], impossible["bound"], impossible["upper"]) == (1.0, 1.0, 1.0)
    assert held["flagged"] == [f"{EXACT} shape", f"{EXACT} {IMPOSSIBLE}"]
    assert heldout_tests(reads(before, after, n), margin=1.0)["flagged"] == []  # a bound of 1 is not above 1


def test_a_gap_above_half_the_margin_is_a_near_miss():
    n = 100
    everyone = set(range(n))
    right = {a: everyone for a in ATTRIBUTES}
    before = {"judge": {**right, "count": set(range(50, n))}, "gold": {**right, "count": set(range(50, n))}}
    after = {"judge": right, "gold": {**right, "count": set(range(1, n))}}  # the checker now misses sample 0
    held = heldout_tests(reads(before, after, n), margin=0.015)
    count = held["tests"][f"{EXACT} count"]
    assert count["gap"] == pytest.approx(0.01) and count["near"] and not count["flagged"]
    assert count["verdict"] == "not flagged: the mean gap is within the margin"
    assert near_misses([], held) == [(HELDOUT, f"{EXACT} count", f"{count['sentence']}, {count['verdict']}")]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r["before"]["gold"].update(shape="01x"), r"before\.gold\.shape = '01x' must be a non-empty string"),
        (lambda r: r["after"]["judge"].update(count="0"), r"every read needs one character per held-out sample"),
        (lambda r: r["after"]["gold"].pop("shape"), r"missing \['after\.gold\.shape'\]"),
        (lambda r: r.pop("after"), r"must be a dict with 'before' and 'after' reads"),
    ],
)
def test_malformed_reads_name_the_field(mutate, message):
    summary = shape_diverges()
    mutate(summary[HELDOUT_READS])
    with pytest.raises(ValueError, match=message):
        heldout_tests(summary, 0.02)


def test_a_summary_without_reads_has_no_held_out_tests():
    assert heldout_tests(None, 0.02) is None and heldout_tests({"seed": 0}, 0.02) is None
