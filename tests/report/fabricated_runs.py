"""Run folders fabricated in the trainer's layout, with known pixels (one solid colour per cell) and scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image

TRAIN, GOLD = "toy_attributes", "toy_artifact"


def colour(step_index: int, p: int, s: int, frame: int = 0) -> tuple[int, int, int]:
    """The solid colour of fabricated sample (eval, prompt, seed, frame): distinct for every cell."""
    return (30 + 50 * p) % 256, (20 + 70 * s + 25 * frame) % 256, (10 + 90 * step_index) % 256


def fabricate_run(
    root: Path,
    name: str,
    *,
    prompts: list[str],
    seeds: list[int],
    steps: list[int],
    video: bool = False,
    num_frames: int = 3,
    size: int = 16,
    scores_fn=None,
    checkpoints: bool = True,
) -> Path:
    """runs/<name> in the trainer's layout: config.yaml, metrics.jsonl, checkpoints/, eval/base + eval/step_*.

    `scores_fn(step_index, p, s) -> {reward: value or None}`; per-prompt means, overall means and diversity are
    computed here with numpy (the report must show these numbers).
    """
    scores_fn = scores_fn or (
        lambda k, p, s: {TRAIN: 0.5 + 0.1 * k + 0.01 * p + 0.001 * s, GOLD: 0.9 - 0.05 * k - 0.02 * p}
    )
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(
        f"model:\n  path: toy\nrewards:\n  - name: {TRAIN}\neval:\n  gold_rewards: [{GOLD}]\n"
    )
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, max(steps) + 1):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "time": float(step),
                        "train/loss": 1.0 / step,
                        "train/kl": 0.01 * step,
                        f"reward/{TRAIN}/mean": 0.5 + 0.01 * step,
                        f"reward/{TRAIN}/std": 0.05,
                    }
                )
                + "\n"
            )
    for k, step in enumerate(steps):
        folder = run / "eval" / ("base" if step == 0 else f"step_{step:06d}")
        folder.mkdir(parents=True)
        if step and checkpoints:
            (run / "checkpoints" / folder.name).mkdir(parents=True)
        samples = []
        for p in range(len(prompts)):
            for j, seed in enumerate(seeds):
                stem = f"p{p:03d}_s{j:03d}"
                sample = {"prompt_index": p, "seed_index": j, "seed": seed, "scores": scores_fn(k, p, j)}
                if video:
                    frames = [Image.new("RGB", (size, size), colour(k, p, j, f)) for f in range(num_frames)]
                    strip = Image.new("RGB", (size * num_frames, size))
                    for f, frame in enumerate(frames):
                        strip.paste(frame, (f * size, 0))
                    strip.save(folder / f"{stem}_strip.png")
                    frames[0].save(
                        folder / f"{stem}.gif", save_all=True, append_images=frames[1:], duration=125, loop=0
                    )
                    sample.update(image=f"{stem}_strip.png", animation=f"{stem}.gif")
                else:
                    Image.new("RGB", (size, size), colour(k, p, j)).save(folder / f"{stem}.png")
                    sample["image"] = f"{stem}.png"
                samples.append(sample)
        names = list(samples[0]["scores"])
        per_prompt = {
            n: [_mean([x["scores"][n] for x in samples if x["prompt_index"] == p]) for p in range(len(prompts))]
            for n in names
        }
        diversity = [0.3 - 0.1 * k + 0.01 * p for p in range(len(prompts))]
        (folder / "scores.json").write_text(
            json.dumps(
                {
                    "format": "flowrl.eval/1",
                    "step": step,
                    "label": folder.name,
                    "is_video": video,
                    "prompts": prompts,
                    "seeds": seeds,
                    "metadata": [{} for _ in prompts],
                    "rewards": {"train": [n for n in names if n == TRAIN], "gold": [n for n in names if n != TRAIN]},
                    "samples": samples,
                    "per_prompt": per_prompt,
                    "means": {n: _mean([x["scores"][n] for x in samples]) for n in names},
                    "diversity": {"space": "pixel", "per_prompt": diversity, "mean": float(np.mean(diversity))},
                }
            )
        )
    return run


def _mean(values: list[float | None]) -> float | None:
    """numpy mean of the scores that apply (None = not applicable, as scores.json's null); None when none do."""
    present = [v for v in values if v is not None]
    return float(np.mean(present)) if present else None
