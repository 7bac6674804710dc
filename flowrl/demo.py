"""`flowrl demo`: align the shipped toy model with GRPO on the CPU, measure before/after, write a report.

The run goes to `<out>/demo/` (replacing an earlier demo run): config, metrics, checkpoints, eval/base and the
final eval, `report/index.html`, and `summary.json` with the held-out numbers before and after (every held-out
prompt x `SUMMARY_SEEDS` fixed seeds, ODE; sampled and graded by `flowrl.heldout`):

- `exact_accuracy` (the headline): the rule-based `toy_exact` checker finds exactly the prompt's count, colour and
  shape in the pixels; nothing learned, so training cannot game it;
- `judge_accuracy`: the attribute judge (`toy_attributes`, the training reward) reads count, colour and shape all as
  the prompt says; it rising while `exact_accuracy` does not is reward hacking;
- `impossible_count` (no shape, or four and more: counts the world never draws), `mixed_colours` (toy_exact parts),
  and `artifact` (the mean `toy_artifact` reward).

The report pairs `toy_exact` (a gold reward of the config's eval) with `toy_attributes`, so its hacking panel
flags a gap between the two on the eval's samples (a paired bootstrap, `flowrl.report.hacking`). summary.json also
keeps, per held-out sample, whether the judge and `toy_exact` read its count, colour and shape as the prompt says
and whether its count is impossible (`heldout_reads`); the panel tests those too (`flowrl.report.heldout`): per
attribute, the judge's change against the checker's, and the rise of impossible counts. `summary.json` says whether
anything was flagged (`hacking_flagged`, `hacking_flags`), which tests came close (`hacking_near`) and the held-out
tests' numbers (`hacking_heldout`). `summary_text` is what `flowrl demo` prints at the end: a before/after table, the
panel's verdict with its held-out tests, and the paths.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

from flowrl.heldout import SUMMARY_SEEDS, heldout_scores, judge_checkpoint

CONFIG = Path(__file__).parent / "toy" / "grpo.yaml"
HACKING_PAIRS = {"toy_exact": "toy_attributes"}  # gold reward -> the training reward it also measures
HACKING_MARGIN = 0.02  # the report's margin (absolute, in the rewards' units)


def hacking_pairs(cfg) -> dict[str, str]:
    """`HACKING_PAIRS` less the pairs whose gold or training reward this config does not score."""
    train = {r.name for r in cfg.rewards}
    gold = {r.name for r in cfg.eval.gold_rewards}
    return {g: t for g, t in HACKING_PAIRS.items() if g in gold and t in train}


def run_demo(overrides: list[str] | None = None, output_dir: str = "runs") -> dict:
    from flowrl.report import build_report, hacking_rows, load_run
    from flowrl.report.hacking import near_misses
    from flowrl.report.heldout import HELDOUT_READS, heldout_tests
    from flowrl.trainers import build_trainer, kit, load_config

    started = time.perf_counter()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = load_config(CONFIG, ["name=demo", f"output_dir={output_dir}", *(overrides or [])])
    if cfg.run_dir.exists():
        shutil.rmtree(cfg.run_dir)
    trainer = build_trainer(cfg)
    steps, guidance, judge = cfg.eval.num_steps, cfg.eval.guidance_scale, judge_checkpoint(cfg)
    with trainer.parts.model.adapter_disabled():
        before = heldout_scores(trainer.parts.model, SUMMARY_SEEDS, steps, guidance, judge)
    kit.train(trainer)
    after = heldout_scores(trainer.parts.model, SUMMARY_SEEDS, steps, guidance, judge)
    reads = {"judge": "toy_attributes", "gold": "toy_exact", "before": before.pop("reads"), "after": after.pop("reads")}
    summary = {
        "exact_accuracy_before": before["exact_accuracy"],
        "exact_accuracy_after": after["exact_accuracy"],
        "judge_accuracy_before": before["judge_accuracy"],
        "judge_accuracy_after": after["judge_accuracy"],
        "impossible_count_before": before["impossible_count_rate"],
        "impossible_count_after": after["impossible_count_rate"],
        "mixed_colours_before": before["mixed_colour_rate"],
        "mixed_colours_after": after["mixed_colour_rate"],
        "artifact_before": before["artifact"],
        "artifact_after": after["artifact"],
        "wall_s": round(time.perf_counter() - started, 1),
        "seed": cfg.seed,
        "num_steps": cfg.num_steps,
        "heldout_samples": before["num_samples"],
        "before": before,
        "after": after,
        HELDOUT_READS: reads,
    }
    run = trainer.parts.run
    run.summary.write_text(json.dumps(summary, indent=2))  # before the report, which shows it and tests the reads
    pairs = hacking_pairs(cfg)
    report = build_report(run.root, out_dir=run.report, hacking_margin=HACKING_MARGIN, hacking_pairs=pairs)
    reasons = report["flag_reasons"][next(iter(report["flag_reasons"]))]  # the one run's (eval, reward, reason)
    held = heldout_tests(summary, HACKING_MARGIN)
    near = near_misses(hacking_rows(load_run(run.root), HACKING_MARGIN, pairs), held)
    summary.update(
        {
            "report": report["index"],
            "run_dir": str(run.root),
            "hacking_pairs": pairs,
            "hacking_margin": HACKING_MARGIN,
            "hacking_flagged": bool(reasons),
            "hacking_flags": [list(r) for r in reasons],
            "hacking_near": [list(r) for r in near],
            "hacking_heldout": {name: _heldout_numbers(test) for name, test in held["tests"].items()},
        }
    )
    run.summary.write_text(json.dumps(summary, indent=2))
    return summary


def _heldout_numbers(test: dict) -> dict:
    """One held-out test of the panel as summary.json keeps it: its numbers, flag and verdict."""
    keys = ("rule", "attribute", "samples", "judge", "gold", test["rule"], "bound", "upper")
    return {k: test[k] for k in (*keys, "flagged", "near", "verdict") if k in test}


def heldout_lines(held: dict, n: int) -> list[str]:
    """The held-out tests of the panel (summary.json's "hacking_heldout"), one line each: per attribute the judge's
    and the exact checker's accuracy change and their gap with its bound; impossible counts before -> after, the
    rise (as a fraction of the samples) and both bounds; each with its verdict."""
    if not held:
        return []
    lines = [f"  per attribute on the {n} held-out samples (accuracy changes; the gap's 95% lower bound):"]
    for test in held.values():
        verdict = "FLAGGED" if test["flagged"] else test["verdict"]
        if test["rule"] == "gap":
            judge, gold = (test[w][1] - test[w][0] for w in ("judge", "gold"))
            what = f"judge {judge:+.3f}  exact {gold:+.3f}  gap {test['gap']:+.3f} (bound {test['bound']:+.3f})"
            lines.append(f"    {test['attribute']:<8}{what}: {verdict}")
        else:
            (b, a), bounds = test["gold"], f"95% bounds {test['bound']:+.3f} to {test['upper']:+.3f}"
            lines.append(f"  impossible counts {b} -> {a} of {n}: rise {test['rise']:+.3f} ({bounds}): {verdict}")
    return lines


def summary_text(summary: dict) -> str:
    """What `flowrl demo` prints at the end: held-out numbers before and after, the wall time, the hacking panel's
    verdict in one line (and its closest call when nothing is flagged), its held-out tests per attribute and of
    impossible counts (`heldout_lines`), and where the report and summary.json are."""
    from flowrl.report.hacking import HELDOUT

    n = summary["heldout_samples"]

    def row(label: str, before: str, after: str, change: str, note: str) -> str:
        return f"{label:<18}{before:>10}{after:>10}{change:>12}   {note}"

    def pct(key: str) -> tuple[str, str, str]:
        b, a = summary[f"{key}_before"], summary[f"{key}_after"]
        return f"{100 * b:.1f}%", f"{100 * a:.1f}%", f"{100 * (a - b):+.1f} pts"

    def count(key: str) -> tuple[str, str, str]:
        b, a = (round(summary[f"{key}_{when}"] * n) for when in ("before", "after"))
        return f"{b}/{n}", f"{a}/{n}", f"{a - b:+d}"

    b, a = summary["artifact_before"], summary["artifact_after"]
    pairs = ", ".join(f"{g} vs {t}" for g, t in summary.get("hacking_pairs", {}).items()) or "no pair"
    margin = summary.get("hacking_margin", HACKING_MARGIN)
    flags, near = summary.get("hacking_flags", []), summary.get("hacking_near", [])
    held = summary.get("hacking_heldout", {})
    if flags:
        step, name, reason = flags[0]
        more = f" (and {len(flags) - 1} more: see the report)" if len(flags) > 1 else ""
        panel = [f"hacking panel: FLAGGED: {name} {reason}{'' if step == HELDOUT else f' at {step}'}{more}"]
    else:
        tested = pairs + (", held-out reads per attribute" if held else "")
        panel = [f"hacking panel: nothing flagged ({tested}; paired bootstrap, 95% one-sided, margin {margin:g})"]
        near = [r for r in near if r[0] != HELDOUT]  # the held-out tests' lines follow, each with its verdict
        if near:
            step, name, sentence = max(near, key=lambda r: r[0])  # the last eval's, if several
            panel.append(f"  closest call at {step}: {name} {sentence}")
    panel += heldout_lines(held, n)
    run_dir = summary.get("run_dir")
    lines = [
        f"flowrl demo: GRPO on the Shapes world, {summary['num_steps']} steps, seed {summary['seed']}; "
        f"held-out numbers on {n} samples (ODE)",
        "",
        row("", "before", "after", "change", ""),
        row("gold accuracy", *pct("exact_accuracy"), "toy_exact: exactly the prompt's count, colour and shape"),
        row("judge accuracy", *pct("judge_accuracy"), "toy_attributes, the training reward"),
        row("impossible counts", *count("impossible_count"), "no shape, or four and more"),
        row("artifact", f"{b:.4f}", f"{a:.4f}", f"{a - b:+.4f}", "toy_artifact, mean (1 = clean)"),
        f"{'wall time':<18}{summary['wall_s'] / 60:.1f} min "
        f"({summary['wall_s']:.0f} s: training and the held-out numbers)",
        "",
        *panel,
        f"report: {summary['report']}",
        *([f"numbers: {Path(run_dir) / 'summary.json'}"] if run_dir else []),
    ]
    return "\n".join(line.rstrip() for line in lines)
