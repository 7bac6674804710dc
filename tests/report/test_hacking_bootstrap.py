"""The hacking panel's paired bootstrap (`paired_bootstrap`) against an exact enumeration of every resample, its
verdicts on a large shift and on one outlier, and the samples that moved most shown under a flagged or nearly flagged
test."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from fabricated_runs import GOLD, TRAIN, fabricate_run

from flowrl.report import build_report, hacking_rows, load_run
from flowrl.report.hacking import CONFIDENCE, EVIDENCE, RESAMPLES, SEED, paired_bootstrap, significant

EXACT = "toy_exact"
PROMPTS = ["three red circles", "three blue squares", "two green triangles", "one yellow circle"]
SEEDS = list(range(8))  # 4 prompts x 8 seeds = 32 samples, as the demo test's eval


def exact_bootstrap_means(effects: list[float]) -> np.ndarray:
    """The mean of every one of the n^n equally likely resamples (index tuples) of `effects`."""
    x = np.asarray(effects, dtype=np.float64)
    return np.array([x[list(idx)].mean() for idx in itertools.product(range(len(x)), repeat=len(x))])


@pytest.mark.parametrize(
    "effects", [[0.3, -0.1, 0.05, 0.2, -0.25, 0.4], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0], [0.5, 0.1, 0.2, 0.3, 0.05]]
)
def test_the_bound_is_the_exact_bootstrap_quantile(effects):
    exact = exact_bootstrap_means(effects)  # 6^6 = 46656 resamples: the bootstrap distribution itself
    q = 1 - CONFIDENCE
    for resamples, tol in ((RESAMPLES, 0.015), (200_000, 0.002)):  # Monte Carlo error of a 5% quantile: 0.005, 0.0005
        mean, bound = paired_bootstrap(effects, resamples=resamples)
        assert mean == pytest.approx(float(np.mean(effects)), abs=1e-12)
        assert np.any(np.isclose(exact, bound, rtol=0, atol=1e-12))  # the bound is one of the resample means
        below, at_or_below = np.mean(exact < bound - 1e-12), np.mean(exact <= bound + 1e-12)
        assert below <= q + tol and at_or_below >= q - tol, (resamples, bound, below, at_or_below)


def test_the_bootstrap_is_deterministic_and_checks_its_input():
    effects = np.random.default_rng(5).normal(0.01, 0.1, 40).tolist()
    assert paired_bootstrap(effects) == paired_bootstrap(effects)  # numpy default_rng(SEED), RESAMPLES resamples
    assert (RESAMPLES, SEED, CONFIDENCE) == (2000, 0, 0.95)
    assert paired_bootstrap(effects, seed=1) != paired_bootstrap(effects)
    assert paired_bootstrap([0.25] * 7) == pytest.approx((0.25, 0.25))  # no spread: the bound is the mean
    for bad in ([], [0.1, float("nan")], [[0.1, 0.2]]):
        with pytest.raises(ValueError, match="paired_bootstrap needs a non-empty 1-D list of finite numbers"):
            paired_bootstrap(bad)


def test_a_large_shift_flags_and_a_single_outlier_does_not():
    rng = np.random.default_rng(1)
    shift = (0.5 + rng.normal(0, 0.2, 32)).tolist()  # every sample fell about 0.5
    mean, bound = paired_bootstrap(shift)
    assert bound > 0.4 and significant(mean, bound, margin=0.02)
    # the demo's false alarm: 1 of 32 samples turned to an empty image (0.765 -> 0), the others did not move
    outlier = [0.765] + [0.0] * 31
    mean, bound = paired_bootstrap(outlier)
    assert mean == pytest.approx(0.0239, abs=1e-4) and mean > 0.02  # the old rule (mean > margin) flagged this
    assert bound == 0.0 and not significant(mean, bound, margin=0.02)  # (31/32)^32 = 36% of resamples miss it
    jitter = (np.array(outlier) + rng.normal(0, 0.003, 32)).tolist()  # the others jitter a little, as a judge does
    assert not significant(*paired_bootstrap(jitter), margin=0.02)
    # as measured in the demo: the others all drift down by ~1e-4, which excludes 0 from the bound; only the
    # margin keeps that one sample from flagging the run (a bound above 0 and a mean above the margin would)
    drift = [0.7616] + np.abs(rng.normal(0, 2e-4, 31)).tolist()
    mean, bound = paired_bootstrap(drift)
    assert mean > 0.02 and 0 < bound < 0.001 and not significant(mean, bound, margin=0.02)
    assert significant(0.03, 0.021, margin=0.02) and not significant(0.03, 0.019, margin=0.02)  # the bound decides
    assert not significant(0.019, 0.021, margin=0.02) and not significant(None, None, margin=0.02)


def test_a_wide_gap_on_32_samples_flags():
    # the count-blind judge's case: per-sample gaps spread widely (sd 0.3) around a mean of 0.12, six margins
    gaps = (np.random.default_rng(2).normal(0, 0.3, 32) + 0.12).tolist()
    gaps = (np.array(gaps) - np.mean(gaps) + 0.12).tolist()  # exactly 0.12 on average
    mean, bound = paired_bootstrap(gaps)
    assert mean == pytest.approx(0.12) and 0.02 < bound < 0.12 and significant(mean, bound, margin=0.02)


def _outlier_run(tmp_path):
    # training +0.25 everywhere; the artifact judge flat at 0.765 except one sample that drops to 0 at step 1
    def values(k, p, s):
        return {TRAIN: 0.5 + 0.25 * k, GOLD: 0.0 if (k, p, s) == (1, 2, 5) else 0.765}

    return fabricate_run(tmp_path, "outlier", prompts=PROMPTS, seeds=SEEDS, steps=[0, 1], scores_fn=values)


def test_one_sample_that_turned_empty_is_shown_not_flagged(tmp_path):
    run_dir = _outlier_run(tmp_path)
    (row,) = hacking_rows(load_run(run_dir), margin=0.02)
    fall = row["falls"][GOLD]
    assert row["watch"][GOLD][1] == pytest.approx(-0.765 / 32)  # the eval mean fell 0.0239 > margin ...
    assert (fall["samples"], fall["bound"], fall["flagged"], fall["near"]) == (32, 0.0, False, True)  # ... by chance
    assert fall["verdict"] == "not flagged: the bound is not above the margin" and GOLD not in row["flagged"]
    assert fall["moved"] == [
        {"prompt": PROMPTS[2], "seed": 5, "before": {GOLD: 0.765}, "after": {GOLD: 0.0}, "effect": pytest.approx(0.765)}
    ]  # only samples that fell are listed
    result = build_report(run_dir, out_dir=tmp_path / "out")
    assert result["flags"] == {"outlier": [("step_000001", "diversity")]}  # fabricated diversity falls 0.1 per prompt
    page = (tmp_path / "out" / "index.html").read_text()
    evidence = re.search(
        rf'<table class="hacking-evidence" data-run="outlier" data-test="{GOLD}".*?</table>', page
    ).group(0)
    assert "<td>two green triangles</td>" in evidence and "0.765 &rarr; 0</td>" in evidence and "+0.765" in evidence
    assert re.findall(r'alt="(evidence [^"]+)"', evidence) == [
        "evidence base/p002_s005.png",
        "evidence step_000001/p002_s005.png",
    ]
    lead = (
        f"<b>{GOLD} (fall)</b> at step 1: mean fall +0.0239, 95% lower bound +0 over 32 samples, not flagged: the bound"
    )
    assert lead + " is not above the margin. The sample with the largest fall:" in page


def test_a_flagged_gap_shows_the_samples_whose_gap_is_largest(tmp_path):
    # training rises 0.1 + 0.02 * (p * 8 + s) per sample, exact rises 0.05 everywhere: per-sample gaps 0.05 ... 0.67
    def values(k, p, s):
        return {TRAIN: 0.2 + k * (0.1 + 0.02 * (p * 8 + s)), EXACT: 0.1 + 0.05 * k}

    run_dir = fabricate_run(tmp_path, "gap", prompts=PROMPTS, seeds=SEEDS, steps=[0, 1], scores_fn=values)
    (row,) = hacking_rows(load_run(run_dir), 0.02, {EXACT: TRAIN})
    pair = row["pairs"][EXACT]
    assert pair["flagged"] and pair["bound"] > 0.2 and len(pair["moved"]) == EVIDENCE
    assert [(m["prompt"], m["seed"]) for m in pair["moved"]] == [(PROMPTS[3], s) for s in (7, 6, 5, 4)]
    top = pair["moved"][0]
    assert top["before"] == pytest.approx({TRAIN: 0.2, EXACT: 0.1}) and top["after"] == pytest.approx(
        {TRAIN: 0.92, EXACT: 0.15}
    )
    assert top["effect"] == pytest.approx(0.67)
    build_report(run_dir, out_dir=tmp_path / "out", hacking_pairs={EXACT: TRAIN})
    page = (tmp_path / "out" / "index.html").read_text()
    evidence = re.search(rf'<table class="hacking-evidence" data-run="gap" data-test="{EXACT}".*?</table>', page).group(
        0
    )
    assert evidence.count("<tr>") == 1 + EVIDENCE and len(re.findall(r'alt="evidence ', evidence)) == 2 * EVIDENCE
    assert '<td>one yellow circle</td><td class="num">7</td>' in evidence
    assert (
        '<td class="num">0.2 &rarr; 0.92</td><td class="num">0.1 &rarr; 0.15</td><td class="num">+0.67</td>' in evidence
    )


def test_a_quiet_run_shows_no_evidence(tmp_path):
    run_dir = fabricate_run(
        tmp_path,
        "quiet",
        prompts=PROMPTS[:2],
        seeds=SEEDS[:3],
        steps=[0, 1],
        scores_fn=lambda k, p, s: {TRAIN: 0.5, GOLD: 0.5},
    )
    (row,) = hacking_rows(load_run(run_dir), 0.02)
    assert not row["rising"] and row["falls"][GOLD]["verdict"] == "not flagged: no training reward rose, no fall"
    build_report(run_dir, out_dir=tmp_path / "out")
    assert 'class="hacking-evidence"' not in (tmp_path / "out" / "index.html").read_text()


def test_a_fall_within_the_margin_is_near_above_half_of_it(tmp_path):
    for name, fall, near in (("small", 0.015, True), ("smaller", 0.005, False)):
        run_dir = fabricate_run(
            tmp_path,
            name,
            prompts=PROMPTS[:2],
            seeds=SEEDS[:3],
            steps=[0, 1],
            scores_fn=lambda k, p, s, fall=fall: {TRAIN: 0.5 + 0.25 * k, GOLD: 0.5 - fall * k},
        )
        (row,) = hacking_rows(load_run(run_dir), 0.02)
        test = row["falls"][GOLD]
        assert test["fall"] == pytest.approx(fall) and test["bound"] == pytest.approx(fall)  # every sample fell alike
        assert (test["flagged"], test["near"], test["verdict"]) == (
            False,
            near,
            "not flagged: the mean fall is within the margin",
        )
        build_report(run_dir, out_dir=tmp_path / f"out_{name}")
        page = (tmp_path / f"out_{name}" / "index.html").read_text()
        assert (f'<table class="hacking-evidence" data-run="{name}" data-test="{GOLD}"' in page) == near
