"""What the run loop, save and resume need from a recipe (`RecipeParts`, `Recipe`), and the loop itself: every
recipe runs through `train_loop(recipe)` (flowrl.trainers.kit.train); the per-step metrics every recipe logs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from flowrl.training.checkpoint import (
    load_group_into,
    read_group,
    resolve_resume,
    restore_training_state,
    save_training_state,
)
from flowrl.training.evaluation import TrainingEvaluation
from flowrl.training.optim import EMA, OptimizerConfig, OptimizerStep
from flowrl.training.prompts import GroupedPromptSampler
from flowrl.training.reward_gradients import RewardGradients
from flowrl.training.runs import RunFolder
from flowrl.training.scoring import Scorer


@dataclass
class RecipeConfig(OptimizerConfig):
    """How a step's samples split, for the recipes that roll out, score and optimise in chunks (keys train.*)."""

    num_inner_epochs: int = 1
    num_minibatches: int = 1
    """The step's local samples (or items) are split into this many minibatches."""
    gradient_accumulation_steps: int = 1
    """Minibatches per optimizer step (must divide num_minibatches)."""
    num_rollout_batches: int = 1
    """Rollouts are generated in this many chunks; rewards of one chunk are scored while the next is sampled. Keep
    chunk and minibatch the same size (num_rollout_batches = num_minibatches) for exact first-pass ratios on
    accelerators, whose kernels may round differently at another batch size."""
    use_async_rewards: bool = True
    """Score rewards in a worker thread, overlapping the next rollout chunk."""


@dataclass
class RecipeParts:
    """The components one run of any recipe holds (built by `flowrl.trainers.kit.build_parts`), and its clock: the
    training step and the counters that checkpoints keep. What save and resume keep beside the weights, the optimizer
    and the EMA: the LoRA adapters a recipe holds beside the trained one (`adapters`, each a tensor group
    `adapter_<name>`), the per-reward gradient state (`reward_grads`, JSON key `kit.reward_gradients`) and the
    objects a recipe keeps (`kept`: name -> an object with `state()` -> (tensors, JSON state) and `load(tensors,
    JSON state)`, written as tensor group <name> and JSON key <name>, e.g. TAGRPO's memory bank)."""

    cfg: Any  # RunConfig
    accelerator: Any
    run: RunFolder
    sampler: Any  # a Sampler (flowrl.types)
    prompt_sampler: GroupedPromptSampler
    local_n: int  # this process's samples per step
    model: Any  # a FlowModel (flowrl.types)
    opt: OptimizerStep
    ema: EMA | None
    rewards: dict[str, Any]  # the configured rewards (the evaluation's too)
    weights: dict[str, float]  # every scored reward's weight, a recipe's extra rewards too
    scorer: Scorer | None  # None for recipes that score in their own step (adjoint matching: with a gradient)
    balancer: Any  # a Balancer (flowrl.types)
    evaluation: TrainingEvaluation
    base_copy: torch.nn.Module | None = None  # a frozen copy of the starting weights, where a recipe asked for one
    step: int = 0
    counters: dict[str, int] = field(default_factory=lambda: {"reward_errors": 0})
    adapters: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  # name -> live (maybe sharded) tensors
    extra_rewards: dict[str, Any] = field(default_factory=dict)  # a recipe's own scored rewards (Adv-GRPO's RM)
    reward_grads: RewardGradients | None = None
    kept: dict[str, Any] = field(default_factory=dict)
    drift: Any = None  # flowrl.trainers.drift.RolloutDrift: the step's rollout drift, opened by kit.collect


class Recipe(Protocol):
    """What `train_loop`, `save_recipe` and `resume_recipe` need from a recipe: its registry name, its parts (with the
    step and what checkpoints keep) and its step."""

    name: str
    parts: RecipeParts

    def train_step(self) -> dict[str, float]: ...


def progress_bar(enabled: bool, total: int, initial: int, desc: str):
    """A tqdm bar on the main process (None elsewhere or when disabled)."""
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)


def show_progress(bar, metrics: dict) -> None:
    if bar is None:
        return
    bar.update(1)
    shown = {
        k.split("/")[-2] if k.startswith("reward/") else k.split("/")[-1]: f"{v:.3g}"
        for k, v in metrics.items()
        if (k.endswith("/mean") and k.startswith("reward/")) or k == "train/loss"
    }
    bar.set_postfix(shown)


def step_metrics(
    wall: float, rollout_s: float, reward_s: float, optimise_s: float, num_samples: int, errors: int, kept
) -> dict:
    """The `perf/...` timings and sample counts every recipe logs for one step (`num_samples` over all processes)."""
    return {
        "perf/step_s": wall,
        "perf/rollout_s": rollout_s,
        "perf/reward_s": reward_s,
        "perf/optimise_s": optimise_s,
        "perf/samples_per_s": num_samples / wall,
        "train/reward_errors": float(errors),
        "train/kept_samples": float(kept),
    }


def save_recipe(recipe: Recipe) -> Path:
    """A full checkpoint of a recipe: the kit's state (weights, optimizer, EMA, step, counters, RNG, config), the
    adapters beside the trained one, the per-reward gradient state and the recipe's kept objects (RecipeParts)."""
    from flowrl.config import dump_config

    parts = recipe.parts
    groups = {f"adapter_{name}": tensors for name, tensors in parts.adapters.items()}
    state = {"counters": parts.counters}
    if parts.reward_grads is not None:
        state["kit.reward_gradients"] = parts.reward_grads.state_dict()
    for name, kept in parts.kept.items():
        groups[name], state[name] = kept.state()
    return save_training_state(
        parts.accelerator,
        parts.run.root,
        parts.step,
        parts.opt,
        parts.ema,
        parts.model,
        state,
        dump_config(parts.cfg),
        parts.cfg.checkpoint.keep_last,
        groups=groups or None,
    )


def resume_recipe(recipe: Recipe, path: str | Path) -> None:
    """Restore what `save_recipe` wrote: the kit's state, the adapters, the per-reward gradient state and the kept
    objects; metric lines logged after the checkpoint's step are forgotten."""
    parts = recipe.parts
    state = restore_training_state(path, parts.accelerator, parts.opt, parts.ema, parts.cfg)
    parts.step, parts.counters = int(state["step"]), dict(state["counters"])
    for name, tensors in parts.adapters.items():
        load_group_into(path, f"adapter_{name}", tensors)
    if parts.reward_grads is not None and "kit.reward_gradients" in state:
        parts.reward_grads.load_state_dict(state["kit.reward_gradients"])
    for name, kept in parts.kept.items():
        kept.load(read_group(path, name), state[name])
    if parts.accelerator.is_main_process:
        parts.run.forget_after(parts.step)


def metered_step(recipe: Recipe) -> dict[str, float]:
    """`recipe.train_step()` with its work counted (flowrl.work): the metrics gain `work/<phase>/<kind>/<detail>`,
    the step's counts summed over processes. Work outside the step (evaluation, checkpoints) is not counted."""
    from flowrl import work

    work.METER.reset()
    metrics = recipe.train_step()
    counts = work.METER.metrics()
    acc = recipe.parts.accelerator
    if acc.num_processes > 1:
        from accelerate.utils import gather_object

        total: dict[str, float] = {}
        for each in gather_object([counts]):
            for key, value in each.items():
                total[key] = total.get(key, 0.0) + value
        counts = dict(sorted(total.items()))
    metrics.update(counts)
    return metrics


def train_loop(recipe: Recipe) -> dict:
    """Run a recipe to cfg.num_steps: resume (checkpoint.resume), the run folder and trackers, the base eval, then
    `recipe.train_step()` with logging, evals and checkpoints on their cadences, a last checkpoint and eval."""
    from flowrl.config import dump_config, flatten, to_dict

    parts = recipe.parts
    cfg, acc = parts.cfg, parts.accelerator
    resume = resolve_resume(cfg.checkpoint.resume, parts.run.root)
    if resume is not None:
        resume_recipe(recipe, resume)
    parts.run.start(acc, dump_config(cfg), parts.opt.sharding.kind, cfg.model.mixed_precision)
    scalars = {k: v for k, v in flatten(to_dict(cfg)).items() if isinstance(v, (int, float, str, bool))}
    acc.init_trackers(cfg.name, config=scalars)
    if parts.step == 0:
        parts.evaluation(None)
    bar = progress_bar(
        cfg.logging.progress_bar and acc.is_main_process, cfg.num_steps, parts.step, f"{recipe.name} {cfg.name}"
    )
    history = []
    while parts.step < cfg.num_steps:
        metrics = metered_step(recipe)
        history.append(metrics)
        parts.run.log(acc, parts.step, metrics)
        show_progress(bar, metrics)
        step, last = parts.step, parts.step >= cfg.num_steps
        if cfg.checkpoint.every_n_steps and step % cfg.checkpoint.every_n_steps == 0 and not last:
            save_recipe(recipe)
        if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0 and not last:
            parts.evaluation(step)
    if bar is not None:
        bar.close()
    save_recipe(recipe)
    final = parts.evaluation(parts.step)
    if parts.scorer is not None:
        parts.scorer.close()
    acc.wait_for_everyone()
    acc.end_training()
    return {"history": history, "final_eval": final}
