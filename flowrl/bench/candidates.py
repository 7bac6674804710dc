"""`flowrl bench candidates`: does a cheap preview keep the ranking of the full-precision result?

    flowrl bench candidates --json runs/bench/candidates.json

On the toy world (configs/toy/solrl.yaml's sampler and reward) and the tiny SD3 pipeline (configs/sd3/solrl.yaml's
sampler with a tiny random PickScore), per prompt: a pool of P seeds generated twice from the same initial noise, at
full precision (the config's ODE, `num_steps`) and by each preview backend, both scored by the same reward. Per
backend, in one process, side by side:

  preview_cost_ratio  preview seconds per sample / full seconds per sample (generation and decoding; building the
                      preview copy counts to the preview; scoring counts to neither), each prompt's full pool
                      generated again right after its preview so that both see the same machine load
  spearman_median     median over prompts of Spearman's ρ between preview and full scores of the pool (kendall too)
  topk_overlap        mean share of the full top k (k = K // 2, K = the config's group size) in the preview's top k;
                      bottom_intrusion: of the preview's top k, the share in the full bottom k
  capture             Σ_prompts (max full score of the K selected by the preview − pool mean) / Σ_prompts (max full
                      score of the pool − pool mean): how much of the best-of-pool gain the selection keeps

The config's own backend is reported at the top level (a kernel backend this machine lacks is stood in for by its
exact fake-quant emulation, named in "backend", the config's in "config_backend"), every backend under "backends" (a
backend that cannot run here carries its one-line error). Published figures for comparison under "published"
(docs/recipes/candidates.md).
"""

from __future__ import annotations

import platform
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).parents[2]
BACKENDS = (
    "few_step",
    "few_step+int8",
    "fake_nvfp4",
    "fake_nvfp4+few_step",
    "fake_mxfp4",
    "fake_fp8",
    "int8",
    "bf16",
    "cached",
    "nvfp4",
    "fp8",
)
PUBLISHED = {
    "solrl_nvfp4_spearman": 0.927,
    "solrl_nvfp4_kendall": 0.798,
    "cachedsearch_spearman": 0.905,
    "cachedsearch_capture": 0.947,
    "cachedsearch_cost": 0.63,
}


def _world(name: str, folder: Path, num_prompts: int):
    """(model, sampler, score_fn, prompts, kept) of one world, from its Sol-RL config."""
    from flowrl.models import load_flow_model
    from flowrl.registry import REWARDS, SAMPLERS
    from flowrl.trainers import load_config
    from flowrl.training.prompts import load_prompts

    if name == "toy":
        cfg = load_config(REPO / "configs" / "toy" / "solrl.yaml")
        model = load_flow_model("toy")
        reward = REWARDS.get(cfg.rewards[0].name)(device="cpu", **cfg.rewards[0].kwargs)
        prompts = load_prompts(None, None, "heldout", "data")
    else:
        from flowrl.models.tiny import build_tiny_pipeline
        from flowrl.rewards._tiny import TINY_REWARDS

        size = ["sampler.height=32", "sampler.width=32", "sampler.pool_size=8", "sampler.preview_num_steps=4"]
        cfg = load_config(REPO / "configs" / "sd3" / "solrl.yaml", [*size, "data.group_size=4", "sampler.num_steps=8"])
        model = load_flow_model(str(build_tiny_pipeline("sd3", folder / "sd3")))
        reward = REWARDS.get("pickscore")(device="cpu", **TINY_REWARDS["pickscore"](folder / "pickscore"))
        prompts = load_prompts(None, str(REPO / cfg.data.prompts_file), None, "data")
    sampler = SAMPLERS.get("candidates")(**cfg.sampler.kwargs)

    def score_fn(images, texts, metadata):
        return reward(images, texts, metadata).scores.float().cpu()

    return model, sampler, score_fn, prompts[:num_prompts], cfg.data.group_size


def _pools(sampler, prompts: list[str]) -> list[torch.Tensor]:
    from flowrl.seeds import bench_group_seed, pool_generator, pool_seeds

    return [pool_seeds(pool_generator(bench_group_seed(i)), sampler.pool_size) for i in range(len(prompts))]


def _full(model, sampler, prompts, pools, score_fn) -> tuple[list[torch.Tensor], float]:
    """Full-precision scores of every pool (the config's full sampler) and the seconds it took."""
    from flowrl.types import PromptBatch

    scores, seconds = [], 0.0
    for i, (prompt, pool) in enumerate(zip(prompts, pools)):
        batch = PromptBatch([prompt] * len(pool), torch.full((len(pool),), i), seeds=pool)
        tic = time.perf_counter()
        rollout = sampler.full_sampler(model, batch, score_fn=score_fn)
        seconds += time.perf_counter() - tic
        scores.append(score_fn(rollout.images, batch.prompts, batch.metadata))
    return scores, seconds


def _previews(model, sampler, prompts, pools, score_fn, full_sampler) -> tuple[list[torch.Tensor], float]:
    """Preview scores of every pool and the preview cost per sample over the full cost per sample, timed side by side:
    each prompt's full-precision pool is generated again right after its preview (the building of the preview copy
    counts to the preview)."""
    from flowrl.quant import build_preview
    from flowrl.samplers.candidates import previewing
    from flowrl.samplers.sde import resolve_size
    from flowrl.seeds import sample_generators
    from flowrl.types import PromptBatch

    size = resolve_size(sampler, model)
    guidance = sampler.guidance_scale if sampler.guidance_scale is not None else model.default_guidance_scale
    tic = time.perf_counter()
    preview = build_preview(model.transformer, sampler.spec, model.family)
    seconds, full_seconds, scores = time.perf_counter() - tic, 0.0, []
    for i, (prompt, pool) in enumerate(zip(prompts, pools)):
        cond = model.encode([prompt] * len(pool), sampler.negative_prompt, guidance)
        tic = time.perf_counter()
        latents = model.prepare_latents(len(pool), *size[:2], sample_generators(pool, model.device), size[2])
        with previewing(model, preview), torch.no_grad():
            images = model.decode(sampler._preview(model, latents, cond, guidance, size))
        seconds += time.perf_counter() - tic
        tic = time.perf_counter()
        full_sampler(model, PromptBatch([prompt] * len(pool), torch.full((len(pool),), i), seeds=pool))
        full_seconds += time.perf_counter() - tic
        scores.append(score_fn(images, [prompt] * len(pool), [{}] * len(pool)))
    return scores, seconds / full_seconds


def fidelity(preview: list[torch.Tensor], full: list[torch.Tensor], kept: int, selection: str) -> dict[str, float]:
    """Rank fidelity and capture of preview scores against full scores, one pool per prompt (see the module
    docstring)."""
    import statistics

    from flowrl.ranking import bottom_intrusion, kendall, nanmedian, select_indices, spearman, topk_overlap

    k = max(kept // 2, 1)
    gained = best = 0.0
    rho, tau, overlap, intrusion = [], [], [], []
    for p, f in zip(preview, full):
        rho.append(spearman(p, f))
        tau.append(kendall(p, f))
        overlap.append(topk_overlap(p, f, k))
        intrusion.append(bottom_intrusion(p, f, k))
        chosen = select_indices(p, kept, selection)
        gained += float(f[chosen].max() - f.mean())
        best += float(f.max() - f.mean())
    return {
        "spearman_median": nanmedian(rho),
        "kendall_median": nanmedian(tau),
        "topk_overlap": statistics.mean(overlap),
        "bottom_intrusion": statistics.mean(intrusion),
        "capture": gained / best if best > 0 else float("nan"),
    }


def bench_world(name: str, folder: Path, num_prompts: int, backends=BACKENDS) -> dict:
    """One world's JSON entry: the config's backend at the top level, every backend under 'backends'."""
    import dataclasses

    model, sampler, score_fn, prompts, kept = _world(name, folder, num_prompts)
    pools = _pools(sampler, prompts)
    full, full_s = _full(model, sampler, prompts, pools, score_fn)
    default = sampler.preview_backend if isinstance(sampler.preview_backend, str) else "+".join(sampler.preview_backend)
    out = {"backend": default, "pool_size": sampler.pool_size, "kept": kept, "num_prompts": len(prompts)}
    out["num_steps"], out["preview_num_steps"] = sampler.num_steps, sampler.preview_num_steps
    results = {}
    for backend in dict.fromkeys([default, *backends]):
        try:
            variant = dataclasses.replace(sampler, preview_backend=backend)
            preview, ratio = _previews(model, variant, prompts, pools, score_fn, sampler.full_sampler)
        except ValueError as err:
            results[backend] = {"error": str(err)}
            continue
        results[backend] = {"preview_cost_ratio": ratio}
        results[backend].update(fidelity(preview, full, kept, sampler.selection))
    shown = default
    if "error" in results[default]:  # a kernel backend this machine lacks: its exact emulation stands in
        shown = default.replace("nvfp4", "fake_nvfp4").replace("fp8", "fake_fp8")
        shown = shown if shown in results else "fake_nvfp4+few_step"
        out["backend"], out["config_backend"], out["config_backend_error"] = shown, default, results[default]["error"]
    out.update(results[shown])
    out["full_seconds_per_sample"] = full_s / (len(prompts) * sampler.pool_size)
    out["backends"] = results
    return out


def bench_candidates(num_prompts: int = 8, worlds=("toy", "sd3")) -> dict:
    """The JSON of `flowrl bench candidates` (see the module docstring)."""
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in worlds:
            result[name] = bench_world(name, Path(tmp), num_prompts)
    result["published"] = PUBLISHED
    result["machine"] = {"platform": platform.platform(), "threads": torch.get_num_threads()}
    return result
