"""The recipe kit: what every recipe calls, so that a recipe file holds only its config, its declarations, its
`composition_error` and its loss stage. A recipe on the kit reads:

    class MyTrainer:
        config_class = MyConfig                   # extends training.loop.RecipeConfig (optimizer, EMA, splits)
        name = "my"                               # its TRAINERS key; then what other modules read instead of names:
        adapter_copies = 1                        # LoRA adapters beside the policy (flowrl plan's memory)
        full_reference_copy = False               # a frozen copy of the model without LoRA (`build_parts`)
        cfg_doubles_train_rows = False            # training forwards carry both CFG branches with grad
        trains_on = "endpoints"                   # or "stochastic_steps", "rollout_steps" (flowrl.schedules)
        uses_behaviour_log_probs = False          # True: a ratio to the rollout's log-probs (GRPO): lossy trained
                                                  # transitions refused, drift from the recipe's own log-probs

        def __init__(self, cfg, accelerator=None):
            ... validate cfg.train, raise self.composition_error(...) ...
            acc = accelerator or make_accelerator(cfg)
            self.parts = kit.build_parts(cfg, acc, type(self), adapters=("old",))  # saved and restored by the kit

        def train_step(self):
            exp = kit.collect(self.parts)         # 1-5: prompts, rollout, score, gather, balance
            tic = timed(self.parts.accelerator.device)
            steps = kit.OptimizerSteps(self.parts)  # 6: minibatches, accumulation, clipping, EMA
            for mb in steps([torch.randperm(...)]):
                loss = ...                        # the recipe's own loss on rows mb.rows
                self.parts.opt.backward(loss, boundary=mb.closes_step)
                steps.losses.append(loss.detach())
                steps.record({"my_term": ...})
            return kit.finish_step(self.parts, exp, exp.metrics | steps.metrics(), tic.seconds())  # 7: step metrics

    kit.train(MyTrainer(cfg))                     # resume, evaluations, checkpoints, the steps

What a component offers a recipe is declared, not looked up by name: a sampler states what its rollouts carry
(`carries()`), a balancer what it asks of the trainer (`needs()`), in the vocabularies of flowrl.types (CARRIES,
NEEDS); a recipe's `composition_error` judges a (sampler, balancer) pair by them (`flowrl recipes` lists every pair).
Their readers live in flowrl.trainers.declarations, stage 6's loop in flowrl.trainers.optimizer_steps and the rollout
drift monitor in flowrl.trainers.drift; the kit hands them on (`kit.rollout_carries`, `kit.OptimizerSteps`, ...).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from flowrl import work
from flowrl.config import RunConfig
from flowrl.models import build_policy
from flowrl.registry import BALANCERS, SAMPLERS
from flowrl.schedules import check_trainable
from flowrl.trainers.declarations import (  # noqa: F401 (kit.rollout_carries and the others, for recipes)
    balancer_needs,
    lossy_rollout_error,
    rollout_carries,
    rollout_lossy,
)
from flowrl.trainers.drift import RolloutDrift, rollout_drift, start_drift  # noqa: F401 (kit.rollout_drift for recipes)
from flowrl.trainers.optimizer_steps import Minibatch, OptimizerSteps  # noqa: F401 (kit.OptimizerSteps for recipes)
from flowrl.training.clock import Clock, timed
from flowrl.training.distributed import Sharding
from flowrl.training.evaluation import TrainingEvaluation
from flowrl.training.loop import RecipeParts, step_metrics, train_loop
from flowrl.training.optim import EMA, OptimizerStep
from flowrl.training.prompts import step_batches
from flowrl.training.reward_gradients import RewardGradients
from flowrl.training.runs import RunFolder
from flowrl.training.scoring import (
    MeteredReward,
    Scorer,
    Scores,
    balance_per_reward,
    build_rewards,
    rollout_and_score,
)
from flowrl.types import PromptBatch, Rollout

# ------------------------------------------------------------------------------------------ building a run


def build_parts(
    cfg: RunConfig,
    accelerator,
    recipe: type,
    *,
    adapters: tuple[str, ...] = (),
    frozen_adapters: tuple[str, ...] = (),
    items_per_sample: int = 1,
    whole_groups: bool = False,
    scored: bool = True,
    extra_rewards: dict[str, tuple] | None = None,
) -> RecipeParts:
    """Every component of one run of `recipe` (a recipe class), in the order that fixes its random state: the run
    folder, the sampler, the grouped prompt sampler (every group on one process with `whole_groups`), the model
    (seeded by cfg.seed, so every process starts from the same adapter) checked against the sampler's trainable steps
    (the recipe's `trains_on`), copies of its adapter named `adapters` (a recipe's old policy; saved and restored
    with the run) and `frozen_adapters` (filled by the recipe from elsewhere, e.g. SMOPD's teachers; not saved), a
    frozen copy of the starting weights (the recipe's `full_reference_copy`, without LoRA), the optimizer step over
    minibatches of local_n · `items_per_sample` / num_minibatches items, the EMA, the rewards, the balancer, the
    evaluation, the recipe's `extra_rewards` (name -> (factory(accelerator) -> reward, weight), scored beside the
    configured ones but not evaluated, e.g. Adv-GRPO's reward model) and the scorer of them all (`scored`; a recipe
    that scores with a gradient scores itself)."""
    from accelerate.utils import set_seed

    t, acc = cfg.train, accelerator
    if why := lossy_rollout_error(recipe, cfg.sampler, t):
        raise ValueError(why)
    run = RunFolder(cfg.output_dir, cfg.name)
    sampler = SAMPLERS.get(cfg.sampler.name)(**cfg.sampler.kwargs)
    prompt_sampler, local_n = step_batches(cfg, sampler, acc.num_processes, whole_groups)
    set_seed(cfg.seed)  # every process starts from the same adapter
    model = build_policy(cfg.model, acc.device, sharded=Sharding(acc).kind == "fsdp")  # FSDP2: loaded for sharding
    check_trainable(recipe.trains_on, sampler, model)  # a grid with nothing on the trained σ range trains nothing
    for name in (*adapters, *frozen_adapters):
        model.copy_adapter("default", name)  # = the reference while LoRA B = 0
    frozen = None
    if recipe.full_reference_copy and not cfg.model.use_lora:  # full fine-tuning: a frozen copy of the start
        frozen = copy.deepcopy(model.transformer).requires_grad_(False).eval().to(acc.device)
    items = local_n * items_per_sample // t.num_minibatches
    opt = OptimizerStep(acc, model.transformer, t, items, cfg.model.mixed_precision)
    ema = EMA(opt.names, opt.params, t.ema_decay, t.ema_every_n_steps, t.ema_mode) if t.use_ema else None
    rewards = build_rewards(cfg.rewards, acc.device)
    weights = {r.name: r.weight for r in cfg.rewards}
    balancer = BALANCERS.get(cfg.balancer.name)(**cfg.balancer.kwargs)
    evaluation = TrainingEvaluation(cfg, acc, run, model, rewards, opt, ema)
    extra = {name: make(acc) for name, (make, _) in (extra_rewards or {}).items()}
    weights |= {name: weight for name, (_, weight) in (extra_rewards or {}).items()}
    scored_rewards = rewards | {name: MeteredReward(reward, name) for name, reward in extra.items()}
    scorer = Scorer(scored_rewards, cfg.on_reward_error, t.use_async_rewards) if scored else None
    parts = RecipeParts(
        cfg, acc, run, sampler, prompt_sampler, local_n, model, opt, ema, rewards, weights, scorer, balancer, evaluation
    )
    parts.base_copy, parts.extra_rewards = frozen, extra
    parts.adapters = {name: model.adapter_parameters(name) for name in adapters}  # after sharding: the live tensors
    parts.drift = RolloutDrift(getattr(recipe, "uses_behaviour_log_probs", False))
    return parts


def train(recipe) -> dict:
    """Run a recipe to cfg.num_steps: resume, the base evaluation, its steps with logging, evaluations and
    checkpoints on their cadences, the final evaluation (flowrl.training.loop.train_loop)."""
    return train_loop(recipe)


def sampler_guidance(parts: RecipeParts) -> float:
    """The guidance scale the sampler rolls out with (the model's default where the sampler sets none)."""
    guidance = parts.sampler.guidance_scale
    return parts.model.default_guidance_scale if guidance is None else guidance


def policy_guidance(parts: RecipeParts) -> float:
    """The guidance scale a recipe trains the policy's velocity at: the sampler's, or 1.0 where that is
    classifier-free guidance for this model (the policy trains CFG-free; a distilled guidance embedding, FLUX.1-dev's,
    is part of the conditional model and is kept)."""
    guidance = sampler_guidance(parts)
    return 1.0 if parts.model.uses_cfg(guidance) else guidance


def refuse_cfg(recipe: type, parts: RecipeParts, why: str) -> float:
    """The sampler's guidance scale, refused where it is classifier-free guidance for this model (`why`: what the
    recipe does that CFG would break)."""
    guidance = sampler_guidance(parts)
    if parts.model.uses_cfg(guidance):
        raise ValueError(
            f"trainer: {recipe.name} {why}: sampler.guidance_scale={guidance} is classifier-free guidance for "
            f"{parts.model.family}; set it to 1.0"
        )
    return guidance


def reward_gradients(parts: RecipeParts, affine: bool, adv_clip_max: float | None = None, probe: bool = False):
    """The per-reward gradient plumbing of a recipe's stage 6, held by the parts (OptimizerSteps plans its windows;
    checkpoints keep its state): MARBLE's balancing where the balancer needs per-reward gradients (`affine`: the
    recipe's loss is affine in the advantage), the cosine probe on request, else one plain backward per minibatch
    (flowrl/training/reward_gradients.py)."""
    balancer = parts.balancer if "reward_gradients" in parts.balancer.needs() else None
    names = list(parts.rewards)
    grads = RewardGradients(balancer, parts.opt, parts.accelerator, names, affine, adv_clip_max, probe)
    parts.reward_grads = grads
    return grads


# ------------------------------------------------------------------------------------------ stages 1-5


@dataclass
class Experience:
    """What stages 1-5 hand to a recipe's loss: this process's samples, their rollout and their advantages."""

    batch: PromptBatch
    rollout: Rollout | None  # a recipe that keeps only the endpoints sets it to None once it has them
    advantages: torch.Tensor  # [N] on the device; 0 for failed samples
    per_reward: torch.Tensor  # [K, N] on the device: each reward's own advantages (rows in reward order)
    keep: torch.Tensor  # [N] bool on the device: not failed and kept by the balancer's mask
    scores: Scores  # this process's scores
    metrics: dict[str, float]  # the balancer's, the rewards' and the sampler's
    errors: int  # reward errors over all processes this step
    started: Clock
    rollout_s: float


def collect(parts: RecipeParts, adapter: str | None = None) -> Experience:
    """Stages 1-5 of a step: the step's prompts, the rollout (with adapter `adapter`, e.g. an old policy) in chunks with
    each chunk's rewards scored beside the next one, every process's scores gathered and balanced."""
    acc, model, t = parts.accelerator, parts.model, parts.cfg.train
    started = timed(acc.device)

    # 1. Prompts
    batch = parts.prompt_sampler.local_batch(parts.step, acc.process_index, acc.num_processes)

    # 2. Rollout (in chunks) and 3. Score (overlapping the next chunk in a worker thread)
    with model.using_adapter(adapter) if adapter is not None else contextlib.nullcontext(), work.phase("rollout"):
        rollout, local, rollout_s = rollout_and_score(
            parts.sampler, model, batch, parts.scorer, t.num_rollout_batches, parts.step, parts.weights
        )

    # 4. Gather and 5. Balance: advantages [N] (and per reward [K, N]) of this process's samples, failed ones kept out
    advantages, per_reward, keep, metrics, errors = balance_per_reward(acc, local, batch, parts.balancer, parts.weights)
    parts.counters["reward_errors"] += errors
    metrics.update(parts.sampler.rollout_metrics(rollout))  # candidate pools: preview/full rank fidelity; else none
    start_drift(parts, rollout)  # before the first optimizer step: the velocity path measures now
    device = acc.device
    return Experience(
        batch,
        rollout,
        advantages.to(device),
        per_reward.to(device),
        keep.to(device),
        local,
        metrics,
        errors,
        started,
        rollout_s,
    )


def bill_offline(parts: RecipeParts, manifest: dict) -> dict[str, float]:
    """Work made before the first step (an offline pool, SMOPD's teachers), billed once: its `work/...` counts added to
    the step's meter by one process (the step's counts are summed over processes), its seconds as metrics."""
    if parts.accelerator.is_main_process:
        for key, value in manifest["work"].items():
            phase, kind, detail = key.split("/", 3)[1:]
            work.METER.add(kind, detail, value, phase)
    return {"perf/offline_s": manifest["seconds"], "perf/offline_cpu_s": manifest["cpu_seconds"]}


def finish_step(parts: RecipeParts, exp: Experience, metrics: dict, optimise_s: float) -> dict[str, float]:
    """Stage 7's step metrics (the `perf/...` timings, sample counts) added to `metrics`; the step counted."""
    samples = parts.local_n * parts.accelerator.num_processes
    wall = exp.started.seconds()
    metrics.update(
        step_metrics(wall, exp.rollout_s, exp.scores.seconds, optimise_s, samples, exp.errors, exp.keep.sum())
    )
    metrics.update(parts.drift.close() if parts.drift is not None else {})
    parts.step += 1
    return metrics
