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
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from flowrl import sde, work
from flowrl.config import ComponentConfig, RunConfig
from flowrl.models import build_policy
from flowrl.registry import BALANCERS, SAMPLERS
from flowrl.schedules import check_trainable, trainable_steps
from flowrl.trainers.transitions import transition_inputs
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
from flowrl.types import CARRIES, LOSSES, NEEDS, Lossy, PromptBatch, Rollout


def _declared(kind: str, spec: ComponentConfig, component, method: str, vocabulary: dict) -> frozenset[str]:
    if not callable(getattr(component, method, None)):
        raise ValueError(
            f"{kind} {spec.name!r} declares no {method}(): add one returning a subset of {', '.join(vocabulary)} "
            "(docs/recipes/compose.md)"
        )
    out = frozenset(getattr(component, method)())
    unknown = sorted(out - set(vocabulary))
    if unknown:
        raise ValueError(
            f"{kind} {spec.name!r}: {method}() names {unknown}; the known ones are {', '.join(vocabulary)}"
        )
    return out


def rollout_carries(spec: ComponentConfig) -> frozenset[str]:
    """What the rollouts of sampler `spec` (name + kwargs) carry; the sampler's own argument errors raise here."""
    return _declared("sampler", spec, SAMPLERS.get(spec.name)(**spec.kwargs), "carries", CARRIES)


def balancer_needs(spec: ComponentConfig) -> frozenset[str]:
    """What balancer `spec` (name + kwargs) asks of the trainer; the balancer's own argument errors raise here."""
    return _declared("balancer", spec, BALANCERS.get(spec.name)(**spec.kwargs), "needs", NEEDS)


def rollout_lossy(spec: ComponentConfig) -> tuple[Lossy, ...]:
    """The lossy options of sampler `spec` (name + kwargs): what its `lossy()` declares (flowrl.types.Lossy)."""
    sampler = SAMPLERS.get(spec.name)(**spec.kwargs)
    if not callable(getattr(sampler, "lossy", None)):
        raise ValueError(
            f"sampler {spec.name!r} declares no lossy(): add one returning its lossy options (flowrl.types.Lossy; () "
            "where every transition is the full-precision policy's; docs/recipes/compose.md)"
        )
    out = tuple(sampler.lossy())
    unknown = sorted({option.loss for option in out} - set(LOSSES))
    if unknown:
        raise ValueError(f"sampler {spec.name!r}: lossy() names {unknown}; the known ones are {', '.join(LOSSES)}")
    return out


def lossy_rollout_error(recipe: type, sampler: ComponentConfig, train=None) -> str | None:
    """None unless recipe `recipe` takes its ratio to the rollout's behaviour log-probs (`uses_behaviour_log_probs`)
    and an option of sampler `sampler` draws the transitions it trains with another velocity than the policy's (a
    low precision, a cache; a coarser grid keeps the policy's own log-probs): then the one-line reason and fix.
    Adaptive importance sampling (`train.ais.enabled`) takes the ratio to the policy's own log-probs and is let through
    (docs/recipes/compose.md#lossless-and-lossy-rollouts)."""
    if not getattr(recipe, "uses_behaviour_log_probs", False):
        return None
    ais = getattr(train, "ais", None)
    if ais is not None and ais.enabled:
        return None
    lossy = [option for option in rollout_lossy(sampler) if option.trained and option.loss != "steps"]
    if not lossy:
        return None
    return (
        f"trainer: {recipe.name} takes its ratio to the behaviour log-probs of the transitions it trains, which "
        f"{'; '.join(option.option for option in lossy)} draws with a lossy copy of the policy (not the policy's "
        f"log-probs): {lossy[0].fix}, or set train.ais.enabled=true (the ratio to the policy's own log-probs)"
    )


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


# ------------------------------------------------------------------------------------------ stage 6


@dataclass
class Minibatch:
    """One minibatch of a step's local items: its rows (CPU and device) and whether it closes an optimizer step (its
    last backward is the boundary of gradient accumulation)."""

    rows: torch.Tensor  # [b] int64 on the CPU
    index: torch.Tensor  # the same rows on the device
    epoch: int
    closes_step: bool


class OptimizerSteps:
    """Stage 6's loop: the step's items in minibatches (one permutation per inner epoch, `orders`), an optimizer step
    every `gradient_accumulation_steps` minibatches, then the EMA update. A recipe iterates it, runs its backward calls
    for each minibatch (`closes_step` marks the last) and appends each backward's loss to `losses` (and its terms to
    `record`); the optimizer step receives the losses of its window, `metrics()` folds them. With the parts' per-reward
    gradients (`reward_gradients`) the window is planned over the minibatches it will train (`per_reward` [K, items])
    and combined before the step."""

    def __init__(self, parts: RecipeParts):
        t = parts.cfg.train
        self.parts, self.reward_grads = parts, parts.reward_grads
        self.num_minibatches, self.accumulation = t.num_minibatches, t.gradient_accumulation_steps
        self.losses: list[torch.Tensor] = []
        self.stats: dict[str, list[torch.Tensor]] = {}

    def __call__(self, orders: list[torch.Tensor], per_reward: torch.Tensor | None = None) -> Iterator[Minibatch]:
        opt, ema, grads, device = self.parts.opt, self.parts.ema, self.reward_grads, self.parts.accelerator.device
        m_total, accum = self.num_minibatches, self.accumulation
        for epoch, order in enumerate(orders):
            size = len(order) // m_total
            for m in range(m_total):
                if m % accum == 0:
                    window = len(self.losses)  # this optimizer step's losses start here
                    if grads is not None:
                        grads.plan(per_reward[:, order[m * size : (m + accum) * size].to(device)])
                rows = order[m * size : (m + 1) * size]
                closes = (m + 1) % accum == 0
                yield Minibatch(rows, rows.to(device), epoch, closes)
                if closes:
                    if grads is not None:
                        grads.finish()  # MARBLE: the per-reward gradients combined into .grad
                    losses = self.losses[window:] or [torch.zeros((), device=device)]
                    if opt.step(torch.stack(losses)) and ema is not None:
                        ema.update(opt.params, opt.optimizer_steps)

    def record(self, values: dict[str, torch.Tensor | None], dtype: torch.dtype | None = torch.float64) -> None:
        """Each term's mean over its rows (in `dtype`; None: its own) for `train/<name>`; None values are skipped."""
        for key, value in values.items():
            if value is not None:
                value = value.detach() if dtype is None else value.detach().to(dtype)
                self.stats.setdefault(key, []).append(value.mean())

    def metrics(self) -> dict[str, float]:
        """`train/loss` (the mean of the appended losses), `train/<name>` (the mean of each recorded term), the
        optimizer's metrics and the per-reward gradients' (where the parts hold them)."""
        out = {"train/loss": float(torch.stack(self.losses).mean())}
        out |= {f"train/{key}": float(torch.stack(values).mean()) for key, values in self.stats.items()}
        out |= self.parts.opt.metrics()
        return out | (self.reward_grads.metrics() if self.reward_grads is not None else {})


# ------------------------------------------------------------------------------------------ rollout drift

DRIFT_ROWS = 2  # rows of this process's batch whose transition at one step the velocity path runs again
DRIFT_LOG_PROB_LIMIT = 1e-4  # |Δ log p| beyond Flow-GRPO's clip range ε = 1e-4: a first-pass ratio outside [1 ± ε]


class RolloutDrift:
    """How far the model that made a step's rollout is from the model its first optimizer step trains
    (docs/math.md#rollout-drift), over this process's samples: `drift/logprob_abs_mean`, `drift/logprob_abs_max` and
    `drift/logprob_beyond` (the share of |Δ log p| > DRIFT_LOG_PROB_LIMIT) for stochastic transitions, where Δ log p is
    the trained model's log-prob of a recorded transition minus the rollout's; `drift/velocity_rel` and
    `drift/velocity_rel_max`, ||v_rollout − v_trained|| / ||v_trained||, for deterministic ones. A recipe that takes
    its ratio to the rollout's log-probs (`from_log_probs`, GRPO) hands its first pass's log-probs to `rollout_drift`
    at no cost; for the others `start_drift` runs DRIFT_ROWS rows at one step again (counted by the work meter as
    training forwards)."""

    def __init__(self, from_log_probs: bool):
        self.from_log_probs = from_log_probs
        self.opened_for = None  # a weak reference to the rollout the window is open for (measured once, not kept)
        self.window: int | None = None  # the optimizer step count at the rollout; observed until it moves
        self.log_prob: list[torch.Tensor] = []  # |Δ log p| [b] per observation
        self.velocity: list[torch.Tensor] = []  # ||Δv|| / ||v|| [b] per observation

    def open(self, optimizer_steps: int | None, rollout: Rollout | None = None) -> None:
        self.window, self.log_prob, self.velocity = optimizer_steps, [], []
        self.opened_for = None if rollout is None else weakref.ref(rollout)

    def is_open_for(self, rollout: Rollout) -> bool:
        return self.opened_for is not None and self.opened_for() is rollout

    def close(self) -> dict[str, float]:
        """The step's metrics, then nothing observed until the next rollout opens the window again."""
        out = self.metrics()
        self.open(None)
        return out

    def metrics(self) -> dict[str, float]:
        out = {}
        if self.log_prob:
            delta = torch.cat(self.log_prob).double()
            out["drift/logprob_abs_mean"] = float(delta.mean())
            out["drift/logprob_abs_max"] = float(delta.max())
            out["drift/logprob_beyond"] = float((delta > DRIFT_LOG_PROB_LIMIT).double().mean())
        if self.velocity:
            relative = torch.cat(self.velocity).double()
            out["drift/velocity_rel"] = float(relative.mean())
            out["drift/velocity_rel_max"] = float(relative.max())
        return out


def rollout_drift(parts: RecipeParts, log_prob: torch.Tensor, rollout: Rollout, index, k) -> None:
    """Called by a recipe on each pass of its trained transitions: before the first optimizer step after the rollout,
    |log_prob − the rollout's log-prob| of transitions k of rows `index` (this step's own samples; replayed rows past
    local_n are left out) joins the step's drift; later passes are ignored. Costs no forward."""
    drift = parts.drift
    if drift is None or drift.window != parts.opt.optimizer_steps:
        return
    fresh = index < parts.local_n
    behaviour = rollout.log_probs.to(log_prob.device)[index[fresh], k[fresh]]
    drift.log_prob.append((log_prob.detach()[fresh].float() - behaviour.float()).abs().cpu())


@torch.no_grad()
def start_drift(parts: RecipeParts, rollout: Rollout) -> None:
    """At a step's rollout (kit.collect; a recipe whose rollout comes from elsewhere, NFT's async thread, calls it on
    the live parts): open the drift window, once per rollout. A recipe without the rollout's log-probs in its loss
    (the velocity path) measures now, before its first optimizer step: the first DRIFT_ROWS rows' transitions at the
    middle of the steps on the trained σ range run through the trained model (no grad, the rollout's guidance); a
    deterministic transition gives ||x̂' − x'|| / (|Δσ|·||v||), x̂' its Euler step with the trained velocity v (=
    ||v_rollout − v|| / ||v||), a stochastic one |Δ log p| under the rollout's step rule."""
    drift, model = parts.drift, parts.model
    trained = parts.opt.params[0] if parts.opt.params else None
    if drift is None or drift.is_open_for(rollout) or not any(p is trained for p in model.transformer.parameters()):
        return  # opened already, or a rollout on another copy of the transformer (NFT's async rollout thread)
    drift.open(parts.opt.optimizer_steps, rollout)
    if drift.from_log_probs:
        return
    device = parts.accelerator.device
    steps = trainable_steps(model, rollout.sigmas).nonzero().flatten().tolist()
    rows = min(DRIFT_ROWS, len(rollout.prompts))
    if not steps or rows == 0:
        return
    sigmas = rollout.sigmas.to(device)
    index = torch.arange(rows, device=device)
    k = torch.full((rows,), steps[len(steps) // 2], device=device)
    cond, x, x_next, sigma, sigma_next, level, scale = transition_inputs(rollout, sigmas, index, k)
    v = model.velocity(x, sigma, cond, rollout.guidance_scale).float()
    stochastic = level > 0
    if stochastic.any():
        log_prob, _ = sde.rescore_transition(rollout.rule, v, x, x_next, sigma, sigma_next, level, None, "code", scale)
        behaviour = rollout.log_probs.to(device)[index, k]
        drift.log_prob.append((log_prob - behaviour)[stochastic].abs().cpu())
    if not stochastic.all():
        euler, _, _, _ = sde.sde_step(v, x.float(), sigma, sigma_next, "ode", 0.0)
        step = (sigma - sigma_next).abs().float()
        relative = (euler - x_next).flatten(1).norm(dim=1) / (step * v.flatten(1).norm(dim=1))
        drift.velocity.append(relative[~stochastic].cpu())
