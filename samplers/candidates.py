"""Candidate pools (Sol-RL, arXiv 2604.06916; CachedSearch): explore many seeds cheaply, regenerate a few exactly.

    sampler = CandidatesSampler(pool_size=16, selection="best_worst", num_steps=10,
                                preview_backend="fake_nvfp4+few_step", preview_num_steps=6, full={"name": "ode"})
    rollout = sampler(model, batch, score_fn=score_fn)  # batch: whole groups of G samples; G of each pool kept

Per prompt group (docs/recipes/candidates.md):
  1. Pool      P seeds drawn from the group's seed (flowrl.seeds.pool_seeds)
  2. Preview   a copy of the live policy at the preview backend (flowrl.quant.build_preview: the active LoRA
               merged, linears quantized, cache hooks), kept by the sampler and refreshed in place when the live
               weights changed (flowrl.quant.PreviewCache: once per training step, not per rollout chunk); one
               deterministic ODE run of the group's pool at `preview_num_steps` (with `few_step`, else
               `num_steps`), decoded and scored by the trainer's `score_fn`
  3. Select    G of the P seeds by the preview scores (flowrl.ranking.select_indices: best_worst, top, ...)
  4. Regenerate the G selected seeds with the full sampler (any registered one: ODE for NFT, SDE for GRPO), at
               full precision and `num_steps`, from the same initial noise; the trainer scores these as usual
The Rollout is the full sampler's (one row per batch sample, the group's rows taking its selected seeds in pool
order); the preview only ranks, its samples are dropped. Extras, one row per sample: seeds (the selected ones),
preview_scores, full_scores (score_fn on the regenerated images, when `score_full`; where the pool's own samples are
kept, naive scaling or train_on previews, their pool scores), pool_seeds [N, P],
pool_preview_scores [N, P], pool_index, preview_seconds and full_seconds (the call's time spread over its rows).
`candidate_metrics(rollout)` turns them into the step's `candidates/...` metrics.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from flowrl import sde, work
from flowrl.models.conditioning import encode_prompts
from flowrl.quant import DEFAULT_SKIP, PreviewCache, PreviewSpec, parse_backend
from flowrl.ranking import bottom_intrusion, kendall, nanmedian, select_indices, spearman, topk_overlap
from flowrl.registry import SAMPLERS
from flowrl.samplers._rollout import batch_seeds, latent_seeds, resolve_size
from flowrl.seeds import pool_generator, pool_seeds, sample_generators
from flowrl.types import FlowModel, Lossy, PromptBatch, Rollout, ScoreFn, select_cond

SHARED = ("num_steps", "height", "width", "num_frames", "guidance_scale", "negative_prompt", "decode")


@contextlib.contextmanager
def previewing(model: FlowModel, preview: torch.nn.Module):
    """`model.velocity` runs the preview transformer inside the block (the pipeline's reference too, for families
    whose adapter calls `pipe.transformer`)."""
    original, pipe = model.transformer, getattr(model, "pipe", None)
    swap_pipe = pipe is not None and getattr(pipe, "transformer", None) is original
    model.transformer = preview
    if swap_pipe:
        pipe.transformer = preview
    try:
        with work.previews():  # the work meter prices these forwards as previews (flowrl.work)
            yield
    finally:
        model.transformer = original
        if swap_pipe:
            pipe.transformer = original


def take_rows(rollout: Rollout, index: list[int], batch: PromptBatch) -> Rollout:
    """Rows `index` of a rollout as the rollout of `batch` (its prompts, group ids and metadata)."""
    i = torch.tensor(index, dtype=torch.int64)
    on = i.to(rollout.latents.device)
    return Rollout(
        latents=rollout.latents[on],
        log_probs=rollout.log_probs[i.to(rollout.log_probs.device)],
        sigmas=rollout.sigmas,
        images=rollout.images[i.to(rollout.images.device)] if len(rollout.images) else rollout.images,
        group_ids=batch.group_ids,
        prompts=list(batch.prompts),
        cond=select_cond(rollout.cond, i.to(next(iter(rollout.cond.values())).device)),
        noise_levels=rollout.noise_levels[i.to(rollout.noise_levels.device)],
        rule=rollout.rule,
        std_scales=None if rollout.std_scales is None else rollout.std_scales[i.to(rollout.std_scales.device)],
        guidance_scale=rollout.guidance_scale,
        metadata=list(batch.metadata),
        extras={"seeds": rollout.extras["seeds"][i]},
    )


@contextlib.contextmanager
def cache_contexts(transformer: torch.nn.Module, num_steps: int):
    """Diffusers' cache hooks keep one state per named context: every transformer call of a step gets its own
    ("cond" for the first, "call1" for a CFG family's second, unconditional pass), as the diffusers pipelines
    name them. Yields the step clock the loop advances ({"step": k, "call": 0} at each step)."""
    transformer._reset_stateful_cache()
    clock, entered = {"step": 0, "call": 0}, []

    def before(module, args, kwargs):
        name = "cond" if clock["call"] == 0 else f"call{clock['call']}"
        context = module.cache_context(name, step_index=clock["step"], num_inference_steps=num_steps)
        context.__enter__()
        entered.append(context)
        clock["call"] += 1

    def after(module, args, kwargs, output):
        entered.pop().__exit__(None, None, None)

    handles = [
        transformer.register_forward_pre_hook(before, with_kwargs=True),
        transformer.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield clock
    finally:
        for handle in handles:
            handle.remove()


@SAMPLERS.register("candidates")
@dataclass
class CandidatesSampler:
    """Two-stage rollouts: a cheap preview of a seed pool per prompt, the selected seeds regenerated exactly."""

    whole_groups: ClassVar[bool] = True  # a group's pool and its selection live on one process
    recipe_variants: ClassVar[dict[str, dict]] = {  # the rows `flowrl recipes` lists: one per stage-2 sampler
        "full=ode": {"full": {"name": "ode"}},
        "full=sde": {"full": {"name": "sde"}},
        "full=tree": {"full": {"name": "tree"}},
        # the previews themselves trained on (lossy trained transitions: a ratio-based trainer refuses them)
        "train_on=previews": {"full": {"name": "sde"}, "train_on": "previews", "preview_backend": "fake_fp8"},
    }

    pool_size: int = 8
    """P seeds explored per prompt (Sol-RL: 96); the group size G of the data config is how many are kept."""
    selection: str = "best_worst"
    """best_worst (Sol-RL), top, mean_deviation, extremes_random or random (flowrl.ranking.select_indices)."""
    num_steps: int = 10
    """Steps of the full-precision regeneration (handed to the full sampler)."""
    preview_backend: str | list[str] = "fake_nvfp4+few_step"
    """'+'-joined preview backends (flowrl.quant.BACKENDS): auto (nvfp4 on sm_100+, fp8 on sm_89+, else fake_nvfp4),
    fake_nvfp4, fake_mxfp4, fake_fp8, nvfp4, fp8, int8, bf16 (at most one of these), few_step (preview_num_steps),
    cached (diffusers cache hooks, preview_cache); or
    'full': the pool generated by the full sampler itself and its selected samples kept (naive rollout scaling)."""
    preview_num_steps: int = 6
    """Preview ODE steps with `few_step` (Sol-RL: 6 of 10), on the model's own grid family."""
    preview_skip: list[str] = field(default_factory=lambda: list(DEFAULT_SKIP))
    """Linears whose name contains one of these stay at full precision (embedders, the final layer)."""
    preview_min_features: int = 0
    """Linears with max(in, out) <= this stay at full precision (Sol-RL on SANA: 2240)."""
    preview_cache: dict = field(default_factory=lambda: {"type": "first_block", "threshold": 0.2})
    """The `cached` backend's diffusers cache: type first_block, mag or taylorseer, plus that config's arguments."""
    full: dict = field(default_factory=lambda: {"name": "ode"})
    """The stage-2 sampler: `name` (any registered sampler but candidates and tree) and its own arguments."""
    preview_batch_size: int | None = None
    """Preview rows per forward, across pools (None: one pool per forward). Larger batches amortize each call's fixed
    cost; a sample changes only by the float rounding of a batched kernel (tested to 1e-6). The step's initial
    latents and conditioning of all pools are held at once."""
    score_full: bool = True
    """Score the regenerated samples with score_fn too (the rollout's full_scores, the rank metrics)."""
    train_on: str = "full"
    """'full': the selected seeds regenerated at full precision are the rollout (Sol-RL). 'previews': the pool is
    run by the full sampler itself (an SDE with its log-probs for GRPO) with the preview model in place, and the
    selected preview samples are the rollout, nothing regenerated (Sol-RL's `naive_quant`; GRPO corrects the
    preview/policy mismatch with `train.ais`)."""
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    guidance_scale: float | None = None
    """CFG scale of both stages; None = the family's default (NFT needs 1)."""
    negative_prompt: str = ""
    decode: bool = True

    def __post_init__(self) -> None:
        if self.pool_size < 1 or self.num_steps < 1 or self.preview_num_steps < 1:
            raise ValueError(
                f"pool_size={self.pool_size}, num_steps={self.num_steps} and "
                f"preview_num_steps={self.preview_num_steps} must be >= 1"
            )
        if self.preview_batch_size is not None and self.preview_batch_size < 1:
            raise ValueError(
                f"sampler.preview_batch_size={self.preview_batch_size} must be >= 1 rows per preview forward "
                "(or null: one pool per forward)"
            )
        select_indices(torch.zeros(2), 1, self.selection)  # validates the name
        backends = parse_backend(self.preview_backend)
        if "full" in backends and backends != ["full"]:
            raise ValueError(
                f"sampler.preview_backend={self.preview_backend!r}: 'full' (naive scaling) combines with nothing"
            )
        skip, cache = tuple(self.preview_skip), dict(self.preview_cache)
        self.spec = None if backends == ["full"] else PreviewSpec(backends, skip, self.preview_min_features, cache)
        self.previews = None if self.spec is None else PreviewCache(self.spec)  # one preview copy, refreshed per step
        spec = dict(self.full or {})
        name = spec.pop("name", None)
        if name is None or name in ("candidates", "tree"):
            raise ValueError(
                f"sampler.full.name={name!r}: name the stage-2 sampler (ode for NFT, sde for GRPO); a tree grows a "
                "whole group from one root and candidates would recurse, so neither can regenerate the selected seeds "
                "one by one"
            )
        for key in SHARED:
            if key in spec:
                raise ValueError(f"sampler.full.{key}: set {key} on the candidates sampler (both stages share it)")
        if spec.get("same_latent"):
            raise ValueError("sampler.full.same_latent=true: regenerated seeds need their own initial noise; drop it")
        self.full_sampler = SAMPLERS.get(name)(**spec, **{k: getattr(self, k) for k in SHARED})
        if self.train_on not in ("full", "previews"):
            raise ValueError(
                f"sampler.train_on={self.train_on!r} must be 'full' (regenerate the selection) or 'previews'"
            )
        self.pool_sampler = self.full_sampler  # runs a whole pool where its samples are kept (naive scaling, previews)
        if self.train_on == "previews":
            if self.spec is None or "cached" in self.spec.backends:
                raise ValueError(
                    f"sampler.train_on=previews with preview_backend={self.preview_backend!r}: training on previews "
                    "needs a preview model (a precision and/or few_step; 'full' is naive scaling and the cache hooks' "
                    "step clock runs in the ODE preview only)"
                )
            steps = self.preview_num_steps if self.few_step else self.num_steps
            shared = {k: getattr(self, k) for k in SHARED}
            self.pool_sampler = SAMPLERS.get(name)(**spec, **{**shared, "num_steps": steps})

    def carries(self) -> frozenset[str]:
        """What its rollouts hold for a trainer (docs/recipes/compose.md): the stage-2 sampler's, except `memoryless`:
        the selected seeds are not the SDE's own draws of the initial noise, so the rollouts do not follow its law."""
        return self.full_sampler.carries() - {"memoryless"}

    def lossy(self) -> tuple[Lossy, ...]:
        """Its preview backends, each lossy (docs/recipes/compose.md#lossless-and-lossy-rollouts): a precision and
        `cached` change the velocity (`precision`, `cache`), `few_step` the grid (`steps`: each transition still the
        policy's own). They make the trained transitions with `train_on: previews`; with `train_on: full` they only
        rank seeds and the trained rollout is the stage-2 sampler's, regenerated at full precision. () for naive
        scaling (`full`: the pool itself at full precision)."""
        if self.spec is None:
            return ()
        trained = self.train_on == "previews"
        fix = "set sampler.train_on=full (the selected seeds regenerated by the full sampler at full precision)"
        where = " with sampler.train_on=previews" if trained else ""
        out = []
        for backend in self.spec.backends:
            if backend == "few_step" and self.preview_num_steps < self.num_steps:
                steps = f"preview_num_steps={self.preview_num_steps} of num_steps={self.num_steps}"
                out.append(Lossy(f"sampler.preview_backend=few_step ({steps}){where}", "steps", trained, fix))
            elif backend == "cached":  # never trained on: train_on=previews refuses it
                out.append(Lossy("sampler.preview_backend=cached", "cache", False, fix))
            elif backend != "few_step":
                out.append(Lossy(f"sampler.preview_backend={backend}{where}", "precision", trained, fix))
        return tuple(out)

    def trained_steps(self, model: FlowModel, stochastic_only: bool = False) -> torch.Tensor | None:
        """The stage-2 sampler's (it regenerates the rollout)."""
        return self.full_sampler.trained_steps(model, stochastic_only)

    def check_groups(self, group_size: int, chunk_size: int | None = None, num_chunks: int = 1) -> None:
        """Any group size: a pool larger than the group is checked per call (pool_size >= the group's rows)."""

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        """The step's `candidates/...` metrics (`candidate_metrics`)."""
        return candidate_metrics(rollout)

    @property
    def pool_rollouts(self) -> bool:
        """Whether a pool is run by a full sampler and its selected rows kept (naive scaling, training on previews)."""
        return self.naive or self.train_on == "previews"

    @property
    def naive(self) -> bool:
        """preview_backend 'full': the pool itself at full precision (naive rollout scaling), no regeneration."""
        return self.spec is None

    @property
    def few_step(self) -> bool:
        return "few_step" in self.spec.backends

    # -- stage 1 ------------------------------------------------------------------------------------------
    def _precision(self, model: FlowModel):
        """The bf16 backend's autocast (the other precisions live in the preview copy's weights)."""
        bf16 = self.spec is not None and self.spec.precision == "bf16"
        return torch.autocast(model.device.type, torch.bfloat16) if bf16 else contextlib.nullcontext()

    def _preview(self, model: FlowModel, latents, cond, guidance: float, size) -> torch.Tensor:
        """Clean endpoints [P, ...] of one pool by the deterministic ODE, with the preview transformer in place."""
        steps = self.preview_num_steps if self.few_step else self.num_steps
        sigmas = model.sigmas(steps, *size).to(model.device)  # [P+1]
        x = latents.float()
        cached = "cached" in self.spec.backends
        with cache_contexts(model.transformer, steps) if cached else contextlib.nullcontext() as clock:
            for k in range(steps):
                if clock is not None:
                    clock.update(step=k, call=0)
                with self._precision(model):
                    v = model.velocity(x, sigmas[k], cond, guidance)
                x, _, _, _ = sde.sde_step(v.float(), x, sigmas[k], sigmas[k + 1], "ode", 0.0)
        return x

    def _preview_pools(
        self, model: FlowModel, preview, prompts, metadata, pools, guidance: float, size
    ) -> torch.Tensor:
        """Decoded previews [sum P, ...] of every pool (pool order), the rows run preview_batch_size at a time: each row
        is its own seed's ODE, so the chunking changes no sample, only how many forwards the pools take."""
        seeds = torch.cat(pools)
        cond = encode_prompts(model, prompts, metadata, self.negative_prompt, guidance, size)
        latents = model.prepare_latents(len(seeds), *size[:2], sample_generators(seeds, model.device), size[2])
        chunk = self.preview_batch_size or self.pool_size
        images = []
        with previewing(model, preview):
            for i in range(0, len(seeds), chunk):
                rows = slice(i, i + chunk)
                images.append(
                    model.decode(self._preview(model, latents[rows], select_cond(cond, rows), guidance, size))
                )
        return torch.cat(images)

    @torch.no_grad()
    def __call__(
        self,
        model: FlowModel,
        batch: PromptBatch,
        generator: torch.Generator | None = None,
        score_fn: ScoreFn | None = None,
        step: int = 0,
    ) -> Rollout:
        if score_fn is None:
            raise ValueError(
                "sampler 'candidates' ranks its pools with the trainer's score_fn; call it with score_fn=..."
            )
        tic = time.perf_counter()
        # 1. Pools: one per prompt group, from the group's seed
        guidance = self.guidance_scale if self.guidance_scale is not None else model.default_guidance_scale
        seeds = batch_seeds(batch, generator)
        group_seeds = latent_seeds(batch, seeds, same_latent=True)  # [N] the group's seed on each of its rows
        groups: dict[int, list[int]] = {}
        for row, gid in enumerate(batch.group_ids.cpu().tolist()):
            groups.setdefault(gid, []).append(row)
        for gid, rows in groups.items():
            if len(rows) > self.pool_size:
                raise ValueError(
                    f"candidates sampler: group {gid} keeps {len(rows)} samples (data.group_size) of a pool of "
                    f"{self.pool_size}; set sampler.pool_size >= data.group_size"
                )
        # 2. The preview model from the live weights, 3. each pool previewed and scored
        size = resolve_size(self, model)
        preview = None if self.naive else self.previews(model.transformer, model.family, step)
        pools, images, prompts, metadata, pool_rollouts = [], [], [], [], []
        for gid, rows in groups.items():
            pool_gen = pool_generator(int(group_seeds[rows[0]]))
            pool = pool_seeds(pool_gen, self.pool_size)  # [P]
            first = rows[0]
            group_prompts = [batch.prompts[first]] * self.pool_size
            group_meta = [batch.metadata[first]] * self.pool_size
            # the pool itself (full precision, or the preview model): its selection is the rollout
            if self.pool_rollouts:
                pool_batch = PromptBatch(group_prompts, torch.full((self.pool_size,), gid), group_meta, seeds=pool)
                in_place = previewing(model, preview) if preview is not None else contextlib.nullcontext()
                with in_place, self._precision(model):
                    pool_rollouts.append(self.pool_sampler(model, pool_batch, score_fn=score_fn, step=step))
                images.append(pool_rollouts[-1].images)
            pools.append((rows, pool, pool_gen))
            prompts += group_prompts
            metadata += group_meta
        if not self.pool_rollouts:  # every pool's preview in one ODE run, preview_batch_size rows per forward
            images = [self._preview_pools(model, preview, prompts, metadata, [p for _, p, _ in pools], guidance, size)]
        del preview
        scores = (
            score_fn(torch.cat(images), prompts, metadata).detach().float().cpu().reshape(len(groups), self.pool_size)
        )
        # 4. Selection: the group's G rows take its selected seeds in pool order
        selected = torch.empty(len(seeds), dtype=torch.int64)  # [N] pool index of each row
        pool_table = torch.empty(len(seeds), self.pool_size, dtype=torch.int64)  # [N, P]
        pool_scores = torch.empty(len(seeds), self.pool_size)  # [N, P]
        for g, (rows, pool, pool_gen) in enumerate(pools):
            chosen = select_indices(scores[g], len(rows), self.selection, generator=pool_gen)
            selected[rows], pool_table[rows], pool_scores[rows] = torch.tensor(chosen), pool, scores[g]
        regen_seeds = pool_table.gather(1, selected[:, None])[:, 0]  # [N]
        preview_s = time.perf_counter() - tic
        # 5. Stage 2: the selected seeds regenerated at full precision by the full sampler
        tic = time.perf_counter()
        regen = PromptBatch(list(batch.prompts), batch.group_ids, list(batch.metadata), regen_seeds, batch.global_index)
        if self.pool_rollouts:
            order = [r for rows, _, _ in pools for r in rows]  # batch rows in group order
            parts = [
                take_rows(part, selected[rows].tolist(), batch.select(rows))
                for part, (rows, _, _) in zip(pool_rollouts, pools)
            ]
            inverse = torch.empty(len(order), dtype=torch.int64)
            inverse[torch.tensor(order)] = torch.arange(len(order))
            rollout = take_rows(Rollout.concat(parts), inverse.tolist(), batch)
        else:
            rollout = self.full_sampler(model, regen, score_fn=score_fn, step=step)
        full_s = time.perf_counter() - tic
        n = len(seeds)
        rollout.extras.update(
            {
                "seeds": regen_seeds,
                "preview_scores": pool_scores.gather(1, selected[:, None])[:, 0],
                "pool_seeds": pool_table,
                "pool_preview_scores": pool_scores,
                "pool_index": selected,
                "preview_seconds": torch.full((n,), preview_s / n),
                "full_seconds": torch.full((n,), full_s / n),
            }
        )
        if self.score_full and self.decode:  # a kept pool sample was scored already: its pool score is its full score
            if self.pool_rollouts:
                rollout.extras["full_scores"] = rollout.extras["preview_scores"].clone()
            else:
                rollout.extras["full_scores"] = (
                    score_fn(rollout.images, rollout.prompts, rollout.metadata).detach().float().cpu()
                )
        return rollout


def candidate_metrics(rollout: Rollout) -> dict[str, float]:
    """The step's `candidates/...` metrics from a candidates rollout ({} for any other): per prompt group, preview
    vs full-precision scores of its regenerated samples (Spearman, Kendall, top-k overlap and bottom intrusion
    with k = G // 2), medians over groups; the share of rollout time spent in previews."""
    extras = rollout.extras
    if "preview_seconds" not in extras:
        return {}
    preview_s, full_s = float(extras["preview_seconds"].sum()), float(extras["full_seconds"].sum())
    metrics = {"candidates/preview_share": preview_s / max(preview_s + full_s, 1e-12)}
    if "full_scores" not in extras:
        return metrics
    group_ids = rollout.group_ids.cpu()
    stats: dict[str, list[float]] = {"spearman": [], "kendall": [], "topk_overlap": [], "bottom_intrusion": []}
    for gid in group_ids.unique().tolist():
        rows = (group_ids == gid).nonzero().flatten()
        p, f = extras["preview_scores"][rows], extras["full_scores"][rows]
        k = max(len(rows) // 2, 1)
        stats["spearman"].append(spearman(p, f))
        stats["kendall"].append(kendall(p, f))
        stats["topk_overlap"].append(topk_overlap(p, f, k))
        stats["bottom_intrusion"].append(bottom_intrusion(p, f, k))
    metrics.update({f"candidates/{name}": nanmedian(values) for name, values in stats.items()})
    full, preview = extras["full_scores"], extras["preview_scores"]
    metrics["candidates/preview_minus_full"] = float((preview - full).mean())
    return metrics
