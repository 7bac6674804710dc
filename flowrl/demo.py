"""`flowrl demo`: align the shipped toy model with GRPO on the CPU, measure before/after, write a report.

The run goes to `<out>/demo/` (replacing an earlier demo run): config, metrics, checkpoints, eval/base and the
final eval, `report/index.html`, and `summary.json` with the held-out numbers before and after (every held-out
prompt x `SUMMARY_SEEDS` fixed seeds, ODE):

- `exact_accuracy` (the headline): the rule-based `toy_exact` checker finds exactly the prompt's count, colour and
  shape in the pixels; nothing learned, so training cannot game it;
- `judge_accuracy`: the attribute judge (`toy_attributes`, the training reward) reads count, colour and shape all as
  the prompt says; it rising while `exact_accuracy` does not is reward hacking;
- `impossible_count` (no shape, or four and more: counts the world never draws), `mixed_colours` (toy_exact parts),
  and `artifact` (the mean `toy_artifact` reward).

The report pairs `toy_exact` (a gold reward of the config's eval) with `toy_attributes`, so its hacking panel
flags a gap between the two on the eval's samples; `summary.json` says whether it did (`hacking_flagged`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import torch

CONFIG = Path(__file__).parent / "toy" / "grpo.yaml"
SUMMARY_SEEDS = 16  # held-out prompts x this many seeds for the before/after numbers
HACKING_PAIRS = {"toy_exact": "toy_attributes"}  # gold reward -> the training reward it also measures


@torch.no_grad()
def heldout_scores(model, num_seeds: int, num_steps: int, guidance_scale: float, judge_checkpoint: str | None = None) -> dict:
    """Exact and judge accuracy, impossible-count and mixed-colour rates, the mean artifact reward and the diversity
    (per prompt the mean pairwise RMS pixel distance of its seeds' images, `flowrl.evaluation`'s pixel space, averaged
    over prompts; None for one seed) over every held-out prompt x `num_seeds` fixed seeds (the judge:
    `judge_checkpoint`, default the shipped one). A model conditioned on a source image (the toy image-to-video
    model) samples each prompt from its toy source image (flowrl/toy/sources.py)."""
    from flowrl.evaluation import mean_pairwise_distance, pixel_features
    from flowrl.models.conditioning import conditioning_kind
    from flowrl.registry import REWARDS
    from flowrl.toy.accuracy import exact_accuracy, judge_accuracy, sample_images
    from flowrl.toy.judges import load_judge
    from flowrl.toy.world import split_prompts

    base = split_prompts("heldout")
    prompts = [p for p in base for _ in range(num_seeds)]
    seeds = [10_000 + i * 100 + k for i in range(len(base)) for k in range(num_seeds)]
    metadata = None
    if conditioning_kind(model) == "image":
        from flowrl.toy.sources import source_records

        metadata = source_records(prompts)
    images = sample_images(model, prompts, seeds, num_steps, guidance_scale, metadata=metadata)
    exact = exact_accuracy(images, prompts)
    judge = judge_accuracy(load_judge("attributes", judge_checkpoint), images, prompts)
    artifact = REWARDS.build("toy_artifact")(images, prompts, [{} for _ in prompts]).scores
    per_prompt = [mean_pairwise_distance(pixel_features(images[i : i + num_seeds])) for i in range(0, len(prompts), num_seeds)]
    return {
        "exact_accuracy": exact["accuracy"],
        "judge_accuracy": judge["accuracy"],
        "impossible_count_rate": exact["impossible_count_rate"],
        "mixed_colour_rate": exact["mixed_colour_rate"],
        "artifact": round(float(artifact.mean()), 4),
        "diversity": None if num_seeds < 2 else round(sum(per_prompt) / len(per_prompt), 4),  # RMS pixel distance
        "num_samples": len(prompts),
        "exact": exact,
        "judge": judge,
    }


def hacking_pairs(cfg) -> dict[str, str]:
    """`HACKING_PAIRS` less the pairs whose gold or training reward this config does not score."""
    train = {r.name for r in cfg.rewards}
    gold = {r.name for r in cfg.eval.gold_rewards}
    return {g: t for g, t in HACKING_PAIRS.items() if g in gold and t in train}


def judge_checkpoint(cfg) -> str | None:
    """The attribute judge the config trains on (a `toy_attributes` reward's `checkpoint`), default the shipped one."""
    return next((r.kwargs.get("checkpoint") for r in cfg.rewards if r.name == "toy_attributes"), None)


def run_demo(overrides: list[str] | None = None, output_dir: str = "runs") -> dict:
    from flowrl.report import build_report
    from flowrl.trainers import build_trainer, load_config

    started = time.perf_counter()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = load_config(CONFIG, ["name=demo", f"output_dir={output_dir}", *(overrides or [])])
    if cfg.run_dir.exists():
        shutil.rmtree(cfg.run_dir)
    trainer = build_trainer(cfg)
    steps, guidance, judge = cfg.eval.num_steps, cfg.eval.guidance_scale, judge_checkpoint(cfg)
    with trainer.model.adapter_disabled():
        before = heldout_scores(trainer.model, SUMMARY_SEEDS, steps, guidance, judge)
    trainer.train()
    after = heldout_scores(trainer.model, SUMMARY_SEEDS, steps, guidance, judge)
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
    }
    run = trainer.run
    run.summary.write_text(json.dumps(summary, indent=2))  # before the report, which shows it
    pairs = hacking_pairs(cfg)
    report = build_report(run.root, out_dir=run.report, hacking_pairs=pairs)
    reasons = report["flag_reasons"][next(iter(report["flag_reasons"]))]  # the one run's (eval, reward, reason)
    summary.update(
        {
            "report": report["index"],
            "hacking_pairs": pairs,
            "hacking_flagged": bool(reasons),
            "hacking_flags": [list(r) for r in reasons],
        }
    )
    run.summary.write_text(json.dumps(summary, indent=2))
    return summary
