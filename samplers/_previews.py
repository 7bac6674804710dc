"""The candidate pool's preview plumbing (samplers/candidates.py): a preview transformer swapped in for the policy's
forwards (`previewing`, priced as previews by the work meter), a rollout's rows taken as another batch's rollout
(`take_rows`), and diffusers' cache contexts named per transformer call of a step (`cache_contexts`)."""

from __future__ import annotations

import contextlib

import torch

from flowrl import work
from flowrl.types import FlowModel, PromptBatch, Rollout, select_cond


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
