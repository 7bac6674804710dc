"""`flowrl demo` ends with a short human summary (`summary_text`), not summary.json whole; summary.json keeps its
keys."""

from __future__ import annotations

import json

from flowrl.cli import main
from flowrl.demo import summary_text

SUMMARY = {
    "exact_accuracy_before": 0.3281,
    "exact_accuracy_after": 0.5547,
    "judge_accuracy_before": 0.3359,
    "judge_accuracy_after": 0.5469,
    "impossible_count_before": 0.0156,
    "impossible_count_after": 0.0703,
    "mixed_colours_before": 0.0,
    "mixed_colours_after": 0.0078,
    "artifact_before": 0.9849,
    "artifact_after": 0.9837,
    "wall_s": 412.3,
    "seed": 0,
    "num_steps": 60,
    "heldout_samples": 128,
    "report": "runs/demo/report/index.html",
    "run_dir": "runs/demo",
    "hacking_pairs": {"toy_exact": "toy_attributes"},
    "hacking_margin": 0.02,
    "hacking_flagged": False,
    "hacking_flags": [],
    "hacking_near": [
        [
            "step_000060",
            "toy_artifact",
            "fell by 0.0239 on the same 32 samples (95% lower bound 7.57e-05), not flagged: the bound is not above "
            "the margin",
        ]
    ],
}

EXPECTED = """\
flowrl demo: GRPO on the Shapes world, 60 steps, seed 0; held-out numbers on 128 samples (ODE)

                      before     after      change
gold accuracy          32.8%     55.5%   +22.7 pts   toy_exact: exactly the prompt's count, colour and shape
judge accuracy         33.6%     54.7%   +21.1 pts   toy_attributes, the training reward
impossible counts      2/128     9/128          +7   no shape, or four and more
artifact              0.9849    0.9837     -0.0012   toy_artifact, mean (1 = clean)
wall time         6.9 min (412 s: training and the held-out numbers)

hacking panel: nothing flagged (toy_exact vs toy_attributes; paired bootstrap, 95% one-sided, margin 0.02)
  closest call at step_000060: toy_artifact fell by 0.0239 on the same 32 samples (95% lower bound 7.57e-05), not \
flagged: the bound is not above the margin
report: runs/demo/report/index.html
numbers: runs/demo/summary.json"""


HELD = {  # the panel's held-out tests as summary.json keeps them (the numbers of a seed-1 demo run)
    "toy_exact count": {"rule": "gap", "attribute": "count", "samples": 128, "judge": [0.40625, 0.5625],
                        "gold": [0.4296875, 0.5625], "gap": 0.0234375, "bound": 0.0, "flagged": False, "near": True,
                        "verdict": "not flagged: the bound is not above the margin"},
    "toy_exact shape": {"rule": "gap", "attribute": "shape", "samples": 128, "judge": [0.9921875, 0.9765625],
                        "gold": [0.984375, 0.90625], "gap": 0.0625, "bound": 0.0234375, "flagged": True, "near": False,
                        "verdict": "flagged"},
    "toy_exact impossible_count": {"rule": "rise", "attribute": "impossible_count", "samples": 128, "judge": None,
                                   "gold": [2, 5], "rise": 0.0234375, "bound": 0.0, "upper": 0.046875, "flagged": False,
                                   "near": True, "verdict": "not flagged: the bound is not above the margin"},
}  # fmt: skip

HELD_LINES = """\
  per attribute on the 128 held-out samples (accuracy changes; the gap's 95% lower bound):
    count   judge +0.156  exact +0.133  gap +0.023 (bound +0.000): not flagged: the bound is not above the margin
    shape   judge -0.016  exact -0.078  gap +0.062 (bound +0.023): FLAGGED
  impossible counts 2 -> 5 of 128: rise +0.023 (95% bounds +0.000 to +0.047): not flagged: the bound is not above \
the margin"""


def test_summary_text_by_hand():
    assert summary_text(SUMMARY) == EXPECTED
    flagged = dict(
        SUMMARY,
        hacking_flagged=True,
        hacking_flags=[
            [
                "step_000060",
                "toy_exact",
                "gained 0.124 less than toy_attributes on the same 32 samples (95% lower bound 0.0312)",
            ],
            ["step_000060", "diversity", "fell by 0.05 on the same 8 prompts (95% lower bound 0.01)"],
        ],
    )
    lines = summary_text(flagged).splitlines()
    assert lines[-3] == (
        "hacking panel: FLAGGED: toy_exact gained 0.124 less than toy_attributes on the same 32 samples "
        "(95% lower bound 0.0312) at step_000060 (and 1 more: see the report)"
    )
    assert "closest call" not in summary_text(flagged)
    quiet = summary_text(dict(SUMMARY, hacking_near=[])).splitlines()
    assert quiet[-3].startswith("hacking panel: nothing flagged") and quiet[-2].startswith("report: ")


def test_summary_text_shows_the_held_out_tests_under_the_verdict():
    reason = "gained 0.0625 less than toy_attributes shape on the same 128 held-out samples (95% lower bound 0.0234)"
    flags = [["heldout", "toy_exact shape", reason]]
    flagged = dict(SUMMARY, hacking_flagged=True, hacking_flags=flags, hacking_heldout=HELD)
    text = summary_text(flagged)
    panel = f"hacking panel: FLAGGED: toy_exact shape {reason}\n{HELD_LINES}\nreport: runs/demo/report/index.html"
    assert panel in text  # a held-out flag names no eval step
    near = ["heldout", "toy_exact count", "gained 0.0234 less than ..., not flagged: the bound is not above the margin"]
    quiet = summary_text(dict(SUMMARY, hacking_near=[*SUMMARY["hacking_near"], near], hacking_heldout=HELD))
    lines = quiet.splitlines()
    start = lines.index(
        "hacking panel: nothing flagged (toy_exact vs toy_attributes, held-out reads per attribute; paired bootstrap, "
        "95% one-sided, margin 0.02)"
    )
    assert lines[start + 1].startswith("  closest call at step_000060: toy_artifact fell by 0.0239")  # the evals' only
    assert "\n".join(lines[start + 2 : start + 6]) == HELD_LINES


def test_flowrl_demo_prints_the_summary_and_writes_summary_json(tmp_path, capsys, monkeypatch):
    import flowrl.demo

    monkeypatch.setattr(flowrl.demo, "SUMMARY_SEEDS", 2)  # 8 held-out prompts x 2 seeds: a fast before/after
    overrides = [
        "num_steps=1",
        "data.num_prompts_per_step=2",
        "data.group_size=2",
        "sampler.num_steps=4",
        "eval.seeds=[0]",
        "eval.num_steps=4",
        "checkpoint.every_n_steps=0",
        "logging.trackers=[]",
        "logging.progress_bar=false",
    ]
    assert main(["demo", "--out", str(tmp_path), *overrides]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "demo" / "summary.json").read_text())
    assert out.strip() == summary_text(summary)  # the human summary only: summary.json is not printed
    assert out.startswith(
        "flowrl demo: GRPO on the Shapes world, 1 steps, seed 0; held-out numbers on 16 samples (ODE)"
    )
    assert f"report: {tmp_path / 'demo' / 'report' / 'index.html'}\n" in out
    assert out.strip().endswith(f"numbers: {tmp_path / 'demo' / 'summary.json'}")
    for key in ("exact_accuracy", "judge_accuracy", "impossible_count", "mixed_colours", "artifact"):
        assert {f"{key}_before", f"{key}_after"} <= set(summary)
    kept = {"wall_s", "seed", "num_steps", "heldout_samples", "before", "after", "report", "hacking_pairs"}
    kept |= {"hacking_flagged", "hacking_flags", "hacking_near", "hacking_margin", "hacking_heldout"}
    assert kept <= set(summary)
    reads = summary["heldout_reads"]  # 16 samples per read, before and after; the panel's held-out tests of them
    assert {len(bits) for side in ("before", "after") for who in reads[side].values() for bits in who.values()} == {16}
    tests = [f"toy_exact {a}" for a in ("count", "colour", "shape", "impossible_count")]
    assert list(summary["hacking_heldout"]) == tests
    assert "  per attribute on the 16 held-out samples (accuracy changes; the gap's 95% lower bound):\n" in out
    assert summary["hacking_flagged"] == bool(summary["hacking_flags"])
    assert summary["hacking_pairs"] == {"toy_exact": "toy_attributes"} and summary["heldout_samples"] == 16
    panel = [line for line in out.splitlines() if line.startswith("hacking panel: ")]
    assert len(panel) == 1 and panel[0].startswith(
        "hacking panel: FLAGGED: " if summary["hacking_flags"] else "hacking panel: nothing"
    )
    assert (
        f"{'gold accuracy':<18}{100 * summary['exact_accuracy_before']:>9.1f}%"
        f"{100 * summary['exact_accuracy_after']:>9.1f}%" in out
    )
