"""`flowrl bench train`: the toy GRPO config (the demo's) for a few steps: throughput, peak memory and the share of
each phase of a step, written as JSON.

Timings come from the trainer's own `perf/` metrics after one warm-up step; nothing here is asserted by tests.
"""

from __future__ import annotations

import tempfile

__all__ = ["bench_train"]


def bench_train(repeats: int = 3, overrides: list[str] | None = None) -> dict:
    """The toy GRPO config for `repeats` steps (after one warm-up step): throughput, peak RSS, time shares."""
    import resource
    import shutil

    import torch

    from flowrl.demo import CONFIG
    from flowrl.trainers import build_trainer, load_config

    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(
            CONFIG,
            [
                f"output_dir={root}",
                "name=bench",
                "logging.trackers=[]",
                "logging.progress_bar=false",
                *(overrides or []),
            ],
        )
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        trainer = build_trainer(cfg)
        trainer.train_step()  # warm-up
        steps = [trainer.train_step() for _ in range(repeats)]
    total = sum(m["perf/step_s"] for m in steps)
    rollout = sum(m["perf/rollout_s"] for m in steps)
    reward = sum(m["perf/reward_s"] for m in steps)
    optimise = sum(m["perf/optimise_s"] for m in steps)
    samples = trainer.parts.local_n * len(steps)
    return {
        "settings": {
            "config": str(CONFIG),
            "steps": repeats,
            "samples_per_step": trainer.parts.local_n,
            "threads": torch.get_num_threads(),
            "sampler_steps": cfg.sampler.kwargs.get("num_steps"),
        },
        "rollout_images_per_s": round(samples / rollout, 2),
        "train_samples_per_s": round(samples / optimise, 2),
        "step_samples_per_s": round(samples / total, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "share": {
            "rollout": round(rollout / total, 3),
            "reward": round(reward / total, 3),
            "optimise": round(optimise / total, 3),
            "other": round(1 - (rollout + reward + optimise) / total, 3),
        },
        "note": (
            "reward time runs in a worker thread and overlaps the next rollout chunk; its share is its own wall time"
        ),
    }
