"""The reward-hacking panel's gap rule: a gold reward paired with the training reward it also measures is flagged when,
on the same samples, the training reward rose and gained significantly and more than the margin over the gold one.
Every sample here moves by the same amount, so the bootstrap bound equals the mean and the margin decides."""

from __future__ import annotations

import pytest
from fabricated_runs import GOLD, TRAIN, fabricate_run
from test_report import Cells

from flowrl.report import build_report, hacking_rows, load_run

EXACT = "toy_exact"  # the gold reward that measures what the training reward measures, more strictly
PROMPTS = ["one red circle", "two blue squares"]
SEEDS = [0, 7, 9]
PAIRS = {EXACT: TRAIN}


def _run(tmp_path, name, values, steps=(0, 1, 2)):
    return load_run(fabricate_run(tmp_path, name, prompts=PROMPTS, seeds=SEEDS, steps=list(steps), scores_fn=values))


def test_gap_flags_a_gold_reward_that_rises_less_than_its_training_reward(tmp_path):
    # per eval: training +0.25, exact +0.0625 (a gap of 0.1875), artifact flat; fabricated diversity falls 0.1
    values = lambda k, p, s: {TRAIN: 0.5 + 0.25 * k - 0.125 * p, EXACT: 0.25 + 0.0625 * k, GOLD: 0.75}  # noqa: E731
    run = _run(tmp_path, "gap", values)
    rows = hacking_rows(run, margin=0.02, pairs=PAIRS)
    for k, row in enumerate(rows, start=1):
        pair = row["pairs"][EXACT]
        assert pair["train"] == TRAIN and pair["samples"] == len(PROMPTS) * len(SEEDS) and pair["note"] is None
        assert (pair["train_gain"], pair["gold_gain"], pair["gap"]) == pytest.approx((0.25 * k, 0.0625 * k, 0.1875 * k))
        assert pair["flagged"] and row["watch"][EXACT][2] and not row["watch"][GOLD][2]
        assert row["flagged"] == [EXACT, "diversity"]  # the unpaired artifact judge stays flat: not flagged
        gap = f"{0.1875 * k:.3g}"
        assert row["reasons"][EXACT] == [
            f"gained {gap} less than {TRAIN} on the same 6 samples (95% lower bound {gap})"
        ]
        fall = f"{0.1 * k:.3g}"
        assert row["reasons"]["diversity"] == [f"fell by {fall} on the same 2 prompts (95% lower bound {fall})"]
        assert pair["bound"] == pytest.approx(0.1875 * k) and pair["verdict"] == "flagged"
    assert [r["flagged"] for r in hacking_rows(run, margin=0.02)] == [["diversity"]] * 2  # no pair: rule 1 only
    assert hacking_rows(run, margin=0.25, pairs=PAIRS)[0]["pairs"][EXACT]["flagged"] is False  # 0.1875 < 0.25
    assert hacking_rows(run, margin=0.25, pairs=PAIRS)[1]["flagged"] == [EXACT]  # 0.375 > 0.25; diversity fell 0.2 only


def test_gap_needs_the_training_reward_to_rise_by_more_than_the_gold_one(tmp_path):
    together = lambda k, p, s: {TRAIN: 0.5 + 0.125 * k, EXACT: 0.25 + 0.109375 * k}  # noqa: E731  gap 0.015625 per eval
    run = _run(tmp_path, "together", together)
    assert [r["pairs"][EXACT]["flagged"] for r in hacking_rows(run, 0.02, PAIRS)] == [False, True]  # 0.0156, 0.03125
    falling = lambda k, p, s: {TRAIN: 0.75 - 0.125 * k, EXACT: 0.75 - 0.375 * k}  # noqa: E731  both fall: no hacking
    rows = hacking_rows(_run(tmp_path, "falling", falling), 0.02, PAIRS)
    assert [r["pairs"][EXACT]["gap"] for r in rows] == pytest.approx([0.25, 0.5])
    assert all(r["flagged"] == [] for r in rows)


def test_gap_is_measured_on_the_same_samples(tmp_path):
    # prompt 1: exact is not applicable at base, so only prompt 0's samples are compared, where both gained 0.25;
    # the eval means would show training +0.125 against exact +0.0625 and flag a gap that the samples do not have
    def values(k, p, s):
        return {TRAIN: [0.25 + 0.25 * k, 0.75][p], EXACT: [0.25 + 0.25 * k, None if k == 0 else 0.125][p]}

    run = _run(tmp_path, "same", values, steps=(0, 1))
    assert run.evals[1].overall(TRAIN) - run.evals[0].overall(TRAIN) == pytest.approx(0.125)
    assert run.evals[1].overall(EXACT) - run.evals[0].overall(EXACT) == pytest.approx(0.0625)
    pair = hacking_rows(run, 0.02, PAIRS)[0]["pairs"][EXACT]
    assert (pair["samples"], pair["train_gain"], pair["gold_gain"], pair["flagged"]) == (3, 0.25, 0.25, False)


def test_gap_is_not_compared_outside_the_unit_interval(tmp_path):
    values = lambda k, p, s: {TRAIN: 1.5 + k, EXACT: 0.5}  # noqa: E731
    pair = hacking_rows(_run(tmp_path, "range", values, steps=(0, 1)), 0.02, PAIRS)[0]["pairs"][EXACT]
    assert (pair["gap"], pair["flagged"], pair["note"]) == (
        None,
        False,
        f"{TRAIN} = 1.5 is outside [0, 1]: not compared",
    )


def test_pairs_name_rewards_of_the_run(tmp_path):
    run = _run(tmp_path, "names", lambda k, p, s: {TRAIN: 0.5, EXACT: 0.5}, steps=(0, 1))
    with pytest.raises(
        ValueError,
        match=r"hacking_pairs: 'toy_exactly' is not a gold reward of the run\(s\); their gold "
        r"rewards are \['toy_exact'\]",
    ):
        hacking_rows(run, 0.02, {"toy_exactly": TRAIN})
    with pytest.raises(
        ValueError,
        match=r"hacking_pairs\['toy_exact'\] = 'toy_exact' is not a training reward of the run\(s\); "
        r"their training rewards are \['toy_attributes'\]",
    ):
        build_report(run.path, hacking_pairs={EXACT: EXACT})
    with pytest.raises(ValueError, match="must be a dict of gold reward -> training reward"):
        build_report(run.path, hacking_pairs=[EXACT, TRAIN])


def test_gap_in_the_page_and_the_result(tmp_path):
    values = lambda k, p, s: {TRAIN: 0.5 + 0.25 * k, EXACT: 0.25 + 0.0625 * k, GOLD: 0.75}  # noqa: E731
    a = fabricate_run(tmp_path, "alpha", prompts=PROMPTS, seeds=SEEDS, steps=[0, 1], scores_fn=values)
    b = fabricate_run(tmp_path, "beta", prompts=PROMPTS, seeds=SEEDS, steps=[0, 1])  # no toy_exact: the pair skips it
    result = build_report(a, [b], tmp_path / "out", hacking_pairs=PAIRS)
    assert result["flags"] == {
        "alpha": [("step_000001", EXACT), ("step_000001", "diversity")],
        "beta": [("step_000001", GOLD), ("step_000001", "diversity")],
    }
    reason = f"gained 0.188 less than {TRAIN} on the same 6 samples (95% lower bound 0.188)"
    assert ("step_000001", EXACT, reason) in result["flag_reasons"]["alpha"]
    page_text = (tmp_path / "out" / "index.html").read_text()
    assert f"Flagged (gap): a paired gold reward ({EXACT} with {TRAIN})" in page_text
    assert "passes the test (lower bound of the mean gap &gt; margin), both rewards in [0, 1]" in page_text
    assert f"{EXACT} {reason} at step_000001" in page_text
    gap_cells = [c for c in Cells(page_text).cells if c.get("kind") == "hacking-gap"]
    assert [(c["run"], c["step"], c["reward"], c["flag"], c["text"]) for c in gap_cells] == [
        ("alpha", "step_000001", EXACT, "1", "+0.188 \u26a0")
    ]
    plain = build_report(a, out_dir=tmp_path / "plain")  # without pairs the panel says the gap rule is off
    assert plain["flags"] == {"alpha": [("step_000001", "diversity")]}
    assert "none is paired here" in (tmp_path / "plain" / "index.html").read_text()
