"""`flowrl bench ...`: speed measured side by side in one process, written as JSON with ratios.

Timings are best-of-`repeats` wall times after one warm-up call; nothing here is asserted by tests.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable


def best_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each function over `repeats` rounds, after one warm-up call each.

    The functions are interleaved within each round, so that load from other processes hits them alike.
    """
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_rollout(repeats: int = 5, height: int = 64, width: int = 64, num_steps: int = 10, batch_size: int = 4) -> dict:
    """Diffusers pipeline vs flowrl's ODE and SDE samplers on the tiny SD3 and FLUX pipelines."""
    import torch

    from flowrl.models import load_flow_model
    from flowrl.models.tiny import build_tiny_pipeline
    from flowrl.registry import SAMPLERS
    from flowrl.types import PromptBatch

    prompts = [f"a photo of object number {i}" for i in range(batch_size)]
    seeds = list(range(batch_size))
    batch = PromptBatch(prompts, torch.arange(batch_size), seeds=torch.tensor(seeds))
    result: dict = {"settings": {"height": height, "width": width, "num_steps": num_steps, "batch_size": batch_size,
                                 "repeats": repeats, "threads": torch.get_num_threads(), "prompt_cache": "warm"}}
    with tempfile.TemporaryDirectory() as root:
        for family in ("sd3", "flux"):
            model = load_flow_model(str(build_tiny_pipeline(family, Path(root) / family)))
            guidance = model.default_guidance_scale
            common = dict(num_steps=num_steps, height=height, width=width, guidance_scale=guidance)
            ode = SAMPLERS.get("ode")(**common)
            sde = SAMPLERS.get("sde")(**common, kind="flow_grpo", noise_level=0.7)

            def pipeline():
                gens = [torch.Generator().manual_seed(s) for s in seeds]
                return model.pipe(prompts, height=height, width=width, num_inference_steps=num_steps,
                                  guidance_scale=guidance, generator=gens, output_type="pt")

            with torch.no_grad():
                times = best_times({"pipeline": pipeline, "ode": lambda: ode(model, batch), "sde": lambda: sde(model, batch)},
                                   repeats)
            pipeline_s, ode_s, sde_s = times["pipeline"], times["ode"], times["sde"]
            result[family] = {
                "pipeline_s": round(pipeline_s, 5), "ode_s": round(ode_s, 5), "sde_s": round(sde_s, 5),
                "ode_over_pipeline": round(ode_s / pipeline_s, 3), "sde_over_pipeline": round(sde_s / pipeline_s, 3),
            }
    return result
