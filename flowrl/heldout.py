"""Held-out grading of a toy model: sample every prompt of a split at fixed seeds, grade them by the exact checker
and the attribute judge. The demo's before/after numbers and the race's curves come from here (`heldout_scores`).

    python -m flowrl.heldout                      # the shipped model, both splits, the demo's T and CFG
    python -m flowrl.heldout --checkpoint /tmp/run/checkpoints/step_001000.safetensors --grid grid.png

Two graders: `exact_accuracy` (the headline) counts a sample right when the rule-based `toy_exact` checker finds
exactly the prompt's count, colour and shape in its pixels; `judge_accuracy` when the learned attribute judge's argmax
of count, colour and shape all equal the prompt's (the judge is also the training reward, so it can be gamed).
Sampling is the "ode" sampler (Euler steps over `model.sigmas()`), one generator per sample seeded by
(seed, prompt index, sample index), so results do not depend on the batch size.

This module measures; `flowrl.report.heldout` is the report's side: the hacking panel's tests of the per-sample reads
that `heldout_scores` records.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from flowrl.seeds import split_seeds
from flowrl.toy.world import parse_prompt, split_prompts

HEADS = ("count", "colour", "shape")
SUMMARY_SEEDS = 16  # held-out prompts x this many seeds for the before/after numbers


@torch.no_grad()
def sample_images(
    model,
    prompts: list[str],
    seeds: list[int],
    num_steps: int,
    guidance_scale: float,
    batch_size: int = 64,
    metadata: list[dict] | None = None,
) -> torch.Tensor:
    """ODE-sampler images [N, 3, 32, 32] in [0, 1], the initial noise of sample i seeded by seeds[i]; `metadata` [N]
    (None: none) reaches the sampler per sample, e.g. the source images of the toy image-to-video model."""
    from flowrl.samplers.ode import ODESampler
    from flowrl.types import PromptBatch

    sampler = ODESampler(num_steps=num_steps, height=32, width=32, guidance_scale=guidance_scale)
    out = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        batch = PromptBatch(
            prompts=chunk,
            group_ids=torch.arange(len(chunk)),
            metadata=list(metadata[start : start + batch_size]) if metadata is not None else [],
            seeds=torch.tensor(seeds[start : start + batch_size]),
        )
        out.append(sampler(model, batch).images)
    return torch.cat(out)


@torch.no_grad()
def judge_accuracy(judge, images: torch.Tensor, prompts: list[str], per_sample: bool = False) -> dict:
    """Fraction of images whose count, colour and shape (and all three) the judge reads as the prompt's; `per_sample`
    adds "reads": per head, a string with one character per image, "1" where the judge reads it as the prompt's."""
    labels = torch.tensor([parse_prompt(p).labels for p in prompts])  # [N, 3]
    logits = judge(images)
    hits = torch.stack([logits[h].argmax(1) == labels[:, i] for i, h in enumerate(HEADS)], 1)  # [N, 3]
    probs = torch.stack(
        [logits[h].softmax(1).gather(1, labels[:, i : i + 1]).squeeze(1) for i, h in enumerate(HEADS)], 1
    )
    result = {"accuracy": hits.all(1).float().mean().item(), "reward_mean": probs.prod(1).mean().item()}
    result.update({f"{h}_accuracy": hits[:, i].float().mean().item() for i, h in enumerate(HEADS)})
    result = {k: round(v, 4) for k, v in result.items()}
    return {**result, "reads": {h: _bits(hits[:, i]) for i, h in enumerate(HEADS)}} if per_sample else result


@torch.no_grad()
def exact_accuracy(images: torch.Tensor, prompts: list[str], per_sample: bool = False) -> dict:
    """The `toy_exact` checker's reading of images [N, 3, H, W]: the fraction exactly right (count, colour and shape),
    each part's accuracy, and how often a scene has a count the world never draws (none, four or more) or mixed colours;
    `per_sample` adds "reads": per part (count, colour, shape, impossible_count, mixed_colours), a string with one
    character per image, "1" where the part holds."""
    from flowrl.registry import REWARDS

    out = REWARDS.build("toy_exact")(images, prompts, [{} for _ in prompts])
    parts = {name: values.float().mean().item() for name, values in out.parts.items()}
    result = {
        "accuracy": out.scores.float().mean().item(),
        "impossible_count_rate": parts["impossible_count"],
        "mixed_colour_rate": parts["mixed_colours"],
    }
    result.update({f"{h}_accuracy": parts[h] for h in HEADS})
    result = {k: round(v, 4) for k, v in result.items()}
    return {**result, "reads": {name: _bits(values) for name, values in out.parts.items()}} if per_sample else result


def _bits(values: torch.Tensor) -> str:
    """[N] of 0/1 (or bool) -> "0110...": one character per sample."""
    return "".join("1" if v else "0" for v in values.tolist())


def split_accuracy(model, judge, split: str, num_per_prompt: int, num_steps: int, guidance_scale: float, seed: int = 0):
    """(metrics, images [N, 3, 32, 32], prompts [N]) for every prompt of a split x `num_per_prompt` seeds: the judge's
    metrics, and the exact checker's under `exact`."""
    base = split_prompts(split)
    prompts = [p for p in base for _ in range(num_per_prompt)]
    seeds = split_seeds(seed, len(base), num_per_prompt)
    images = sample_images(model, prompts, seeds, num_steps, guidance_scale)
    return {**judge_accuracy(judge, images, prompts), "exact": exact_accuracy(images, prompts)}, images, prompts


@torch.no_grad()
def heldout_scores(
    model, num_seeds: int, num_steps: int, guidance_scale: float, judge_checkpoint: str | None = None
) -> dict:
    """Exact and judge accuracy, impossible-count and mixed-colour rates, the mean artifact reward and the diversity
    (per prompt the mean pairwise RMS pixel distance of its seeds' images, `flowrl.training.evaluation`'s pixel space,
    averaged over prompts; None for one seed) over every held-out prompt x `num_seeds` fixed seeds (the judge:
    `judge_checkpoint`, default the shipped one), and "reads": per sample, whether the judge and the exact checker
    read its count, colour and shape as the prompt's and whether the checker finds an impossible count (strings of
    0s and 1s, which the hacking panel tests: `flowrl.report.heldout`). A model conditioned on a source image (the
    toy image-to-video model) samples each prompt from its toy source image (flowrl/toy/sources.py)."""
    from flowrl.models.conditioning import conditioning_kind
    from flowrl.registry import REWARDS
    from flowrl.report.heldout import IMPOSSIBLE
    from flowrl.seeds import heldout_seeds
    from flowrl.toy.judges import load_judge
    from flowrl.toy.world import split_prompts
    from flowrl.training.evaluation import mean_pairwise_distance, pixel_features

    base = split_prompts("heldout")
    prompts = [p for p in base for _ in range(num_seeds)]
    seeds = heldout_seeds(len(base), num_seeds)
    metadata = None
    if conditioning_kind(model) == "image":
        from flowrl.toy.sources import source_records

        metadata = source_records(prompts)
    images = sample_images(model, prompts, seeds, num_steps, guidance_scale, metadata=metadata)
    exact = exact_accuracy(images, prompts, per_sample=True)
    judge = judge_accuracy(load_judge("attributes", judge_checkpoint), images, prompts, per_sample=True)
    gold_reads = exact.pop("reads")
    reads = {"judge": judge.pop("reads"), "gold": {k: gold_reads[k] for k in (*HEADS, IMPOSSIBLE)}}
    artifact = REWARDS.build("toy_artifact")(images, prompts, [{} for _ in prompts]).scores
    per_prompt = [
        mean_pairwise_distance(pixel_features(images[i : i + num_seeds])) for i in range(0, len(prompts), num_seeds)
    ]
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
        "reads": reads,  # per sample (prompt-major, as `prompts`): "1" where the judge / the checker read it so
    }


def judge_checkpoint(cfg) -> str | None:
    """The attribute judge the config trains on (a `toy_attributes` reward's `checkpoint`), default the shipped one."""
    return next((r.kwargs.get("checkpoint") for r in cfg.rewards if r.name == "toy_attributes"), None)


def main(argv: list[str] | None = None) -> dict:
    from flowrl.models.toy import DEFAULT_GUIDANCE_SCALE, DEFAULT_NUM_STEPS, load_toy_model
    from flowrl.toy.judges import load_judge

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="model file (default: the shipped weights)")
    p.add_argument("--judge-checkpoint", default=None, help="attribute judge file (default: the shipped weights)")
    p.add_argument("--splits", default="heldout,train")
    p.add_argument("--num-per-prompt", type=int, default=16)
    p.add_argument("--num-steps", type=int, default=DEFAULT_NUM_STEPS)
    p.add_argument("--guidance-scale", type=float, default=DEFAULT_GUIDANCE_SCALE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared CPU (no spin-waiting)")
    p.add_argument("--grid", default=None, help="write a PNG grid of the held-out samples here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_toy_model(checkpoint=args.checkpoint)
    judge = load_judge("attributes", args.judge_checkpoint)
    result = {"num_steps": args.num_steps, "guidance_scale": args.guidance_scale, "num_per_prompt": args.num_per_prompt}
    for split in args.splits.split(","):
        start = time.time()
        metrics, images, _ = split_accuracy(
            model, judge, split, args.num_per_prompt, args.num_steps, args.guidance_scale, args.seed
        )
        metrics["seconds"] = round(time.time() - start, 1)
        result[split] = metrics
        if args.grid and split == args.splits.split(",")[0]:
            from torchvision.utils import save_image

            save_image(images, args.grid, nrow=args.num_per_prompt, padding=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
