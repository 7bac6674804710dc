"""`flowrl bench report`: the time to build the report of a fabricated run, and the size of what it writes.

The timing is the best of `repeats` builds; nothing here is asserted by tests.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

__all__ = ["bench_report"]


def bench_report(
    repeats: int = 1, num_prompts: int = 100, num_seeds: int = 8, num_checkpoints: int = 3, size: int = 32
) -> dict:
    """Time to build the report of a fabricated run: base + `num_checkpoints` evals of prompts x seeds, and
    the size of its index.html. Images are smooth random `size`x`size` PNGs (the toy world's resolution)."""
    import json

    import numpy as np
    from PIL import Image

    from flowrl.report import build_report
    from flowrl.training.runs import step_dir_name

    rng = np.random.default_rng(0)
    rewards = {"train": ["toy_attributes"], "gold": ["toy_artifact", "jpeg_compressibility"]}
    names = rewards["train"] + rewards["gold"]
    prompts = [f"{1 + i % 3} {['red', 'green', 'blue'][i % 3]} shapes number {i}" for i in range(num_prompts)]
    seeds = list(range(num_seeds))
    with tempfile.TemporaryDirectory() as root:
        run = Path(root) / "bench_run"
        steps = [0] + [100 * (k + 1) for k in range(num_checkpoints)]
        (run / "checkpoints").mkdir(parents=True)
        (run / "config.yaml").write_text("model:\n  path: toy\nrewards:\n  - name: toy_attributes\n")
        with open(run / "metrics.jsonl", "w") as f:
            for step in range(1, steps[-1] + 1):
                f.write(
                    json.dumps(
                        {
                            "step": step,
                            "time": step * 1.0,
                            "train/loss": float(rng.normal()),
                            "train/kl": step * 1e-4,
                            "reward/toy_attributes/mean": step / steps[-1],
                            "reward/toy_attributes/std": 0.1,
                        }
                    )
                    + "\n"
                )
        for step in steps:
            folder = run / "eval" / step_dir_name(step or None)
            folder.mkdir(parents=True)
            if step:
                (run / "checkpoints" / folder.name).mkdir()
            samples = []
            for p in range(num_prompts):
                for s in seeds:
                    coarse = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)  # [h, w, 3]
                    image = Image.fromarray(coarse).resize((size, size), Image.Resampling.BILINEAR)
                    image.save(folder / f"p{p:03d}_s{s:03d}.png")
                    samples.append(
                        {
                            "prompt_index": p,
                            "seed_index": s,
                            "seed": s,
                            "image": f"p{p:03d}_s{s:03d}.png",
                            "scores": {n: float(rng.random()) for n in names},
                        }
                    )
            per_prompt = {
                n: [
                    float(np.mean([x["scores"][n] for x in samples[p * num_seeds : (p + 1) * num_seeds]]))
                    for p in range(num_prompts)
                ]
                for n in names
            }
            diversity = [float(rng.random()) for _ in prompts]
            (folder / "scores.json").write_text(
                json.dumps(
                    {
                        "format": "flowrl.eval/1",
                        "step": step,
                        "label": folder.name,
                        "is_video": False,
                        "prompts": prompts,
                        "seeds": seeds,
                        "metadata": [{} for _ in prompts],
                        "rewards": rewards,
                        "samples": samples,
                        "per_prompt": per_prompt,
                        "means": {n: float(np.mean(v)) for n, v in per_prompt.items()},
                        "diversity": {"space": "pixel", "per_prompt": diversity, "mean": float(np.mean(diversity))},
                    }
                )
            )
        times = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            result = build_report(run, out_dir=Path(root) / "report")
            times.append(time.perf_counter() - start)
        grid_bytes = sum(Path(g).stat().st_size for g in result["grids"])
    return {
        "settings": {
            "num_prompts": num_prompts,
            "num_seeds": num_seeds,
            "num_checkpoints": num_checkpoints,
            "evals_including_base": len(steps),
            "image_size": size,
            "repeats": repeats,
            "metrics_lines": steps[-1],
        },
        "build_s": round(min(times), 3),
        "index_html_bytes": result["index_bytes"],
        "index_html_mb": round(result["index_bytes"] / 1e6, 2),
        "num_grids": len(result["grids"]),
        "grid_png_bytes": grid_bytes,
    }
