"""The report opened in a real headless Chromium: no console errors, every image decodes, the tables hold the
numbers of scores.json, gaps are stated; a screenshot is saved in the test's temporary folder."""

from __future__ import annotations

import json
import shutil

import pytest
from chromium_page import PAGE_FACTS
from fabricated_runs import fabricate_run

from flowrl.report import build_report, hacking_rows, load_run


def _number(text: str) -> float:
    return float(text.replace("\u2212", "-"))


def _check_page(chromium, index, shot):
    chromium.open(index)
    facts = chromium.evaluate(PAGE_FACTS)
    assert chromium.console_errors() == []
    # self-contained: the only file fetched is index.html itself; everything else is inline data
    fetched = [u for u in chromium.requested_urls() if not u.startswith("data:")]
    assert fetched == [index.resolve().as_uri()]
    page = index.read_text()
    assert (
        "<script" not in page and '<link rel="stylesheet"' not in page and "@import" not in page and "url(" not in page
    )
    assert facts["images"], "the page shows no image"
    broken = [i for i in facts["images"] if not (i["complete"] and i["w"] > 0 and i["h"] > 0)]
    assert broken == []
    assert chromium.screenshot(shot).stat().st_size > 10_000
    return facts


def test_report_of_a_small_real_run_in_chromium(chromium, evaluated_run, tmp_path):
    run = evaluated_run["run"]
    result = build_report(run, out_dir=tmp_path / "report", hacking_margin=0.02)
    facts = _check_page(chromium, tmp_path / "report" / "index.html", tmp_path / "screenshot.png")
    base = json.loads((run / "eval" / "base" / "scores.json").read_text())
    later = json.loads((run / "eval" / "step_000002" / "scores.json").read_text())
    num_samples = len(base["samples"])
    # every sample of both evals, plus the curves and the hacking plot (and the hacking panel's evidence, if any)
    assert len([i for i in facts["images"] if not i["alt"].startswith("evidence ")]) == 2 * num_samples + 2
    cells = {
        (c.get("kind", "value"), c["step"], c["reward"], c["prompt"]): c["text"]
        for c in facts["cells"]
        if c.get("run") == "tiny_sd3" and c.get("kind") != "hacking"
    }
    checked = 0
    for reward in ("jpeg_compressibility", "jpeg_incompressibility"):
        for p in range(len(base["prompts"])):
            for scores in (base, later):
                shown = _number(cells["value", scores["label"], reward, str(p)])
                assert shown == pytest.approx(scores["per_prompt"][reward][p], rel=5e-3)
                checked += 1
            delta = later["per_prompt"][reward][p] - base["per_prompt"][reward][p]
            assert _number(cells["delta", "step_000002", reward, str(p)]) == pytest.approx(delta, rel=5e-3, abs=1e-6)
        for scores in (base, later):
            assert _number(cells["value", scores["label"], reward, "all"]) == pytest.approx(
                scores["means"][reward], rel=5e-3
            )
            assert _number(cells["overview", scores["label"], reward, "all"]) == pytest.approx(
                scores["means"][reward], rel=5e-3
            )
    for scores in (base, later):
        for p, value in enumerate(scores["diversity"]["per_prompt"]):
            assert _number(cells["value", scores["label"], "diversity", str(p)]) == pytest.approx(value, rel=5e-3)
    assert checked == 8
    # the gold reward is the training reward's negative: flagged exactly when the training reward rose by > margin
    # with 95% confidence: the per-sample fall's bootstrap lower bound is above the margin too
    rise = later["means"]["jpeg_incompressibility"] - base["means"]["jpeg_incompressibility"]
    bound = hacking_rows(load_run(run), 0.02)[0]["falls"]["jpeg_compressibility"]["bound"]
    flagged = {(f["step"], f["reward"]) for f in facts["flags"]}
    assert (("step_000002", "jpeg_compressibility") in flagged) == (rise > 0.02 and bound > 0.02)
    assert set(result["flags"]["tiny_sd3"]) == flagged
    assert rise != 0
    for margin in (abs(rise) * 0.9, abs(rise) * 1.1):  # just under and just over the fall
        rows = hacking_rows(load_run(run), margin)
        assert ("jpeg_compressibility" in rows[0]["flagged"]) == (rise > 0 and abs(rise) > margin and bound > margin)
    for caption in ("a red circle", "two blue squares", "jpeg_compressibility", "Environment", "torch"):
        assert caption in facts["text"]
    assert "path: tiny-sd3" in facts["text"]  # the run's config


def test_gaps_are_stated_in_chromium(chromium, tmp_path):
    run = fabricate_run(
        tmp_path, "gappy", prompts=["one red circle", "two green triangles"], seeds=[0, 1], steps=[0, 3, 6], video=True
    )
    (run / "eval" / "step_000003" / "p000_s001_strip.png").unlink()
    (run / "eval" / "step_000006" / "p001_s000.gif").unlink()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "time": 7.0, "train/k')
    shutil.rmtree(run / "checkpoints" / "step_000006")
    build_report(run, out_dir=tmp_path / "report")
    facts = _check_page(chromium, tmp_path / "report" / "index.html", tmp_path / "screenshot.png")
    gaps = "\n".join(facts["gaps"])
    for text in (
        "eval/step_000003/p000_s001_strip.png is missing",
        "eval/step_000006/p001_s000.gif is missing",
        "metrics.jsonl line 7 is not valid JSON",
        "checkpoints/step_000006/ is missing",
    ):
        assert text in gaps
    assert len(facts["gaps"]) == 4
    assert "missing p000_s001_strip.png" in facts["text"] and "missing p001_s000.gif" in facts["text"]
    # 2 prompts x 2 seeds x 3 evals, strip + GIF each, less the two missing files; plus curves and hacking plot
    # (the hacking panel's evidence images, if a rule came close, are counted apart)
    assert len([i for i in facts["images"] if not i["alt"].startswith("evidence ")]) == 2 * 2 * 3 * 2 - 2 + 2


def test_compare_in_chromium(chromium, tmp_path):
    a = fabricate_run(tmp_path, "alpha", prompts=["one red circle"], seeds=[0, 1], steps=[0, 10])
    b = fabricate_run(
        tmp_path,
        "beta",
        prompts=["one red circle"],
        seeds=[0, 1],
        steps=[0, 10],
        scores_fn=lambda k, p, s: {"toy_attributes": 5.0 + k, "toy_artifact": 7.0 - 3 * k},
    )
    build_report(a, [b], out_dir=tmp_path / "report")
    facts = _check_page(chromium, tmp_path / "report" / "index.html", tmp_path / "screenshot.png")
    for run_dir, name in ((a, "alpha"), (b, "beta")):
        later = json.loads((run_dir / "eval" / "step_000010" / "scores.json").read_text())
        shown = [
            c
            for c in facts["cells"]
            if c.get("run") == name
            and c.get("kind") == "overview"
            and c["step"] == "step_000010"
            and c["reward"] == "toy_artifact"
        ]
        assert len(shown) == 1 and _number(shown[0]["text"]) == pytest.approx(later["means"]["toy_artifact"], rel=5e-3)
    assert "flowrl report: alpha, beta" in facts["text"]
