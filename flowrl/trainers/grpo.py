"""GRPO for flow-matching models (Flow-GRPO, DanceGRPO settings by config), as one recipe over the shared
components. The math is in docs/math.md, the recipe and its Flow-GRPO / DanceGRPO settings in
docs/recipes/grpo.md.

    accelerate launch scripts/train.py --config configs/toy/grpo.yaml
    flowrl train configs/toy/grpo.yaml train.learning_rate=1e-4

One training step = one rollout batch of B prompts x G samples over all processes, then its optimisation:

    # 1. Prompts    the step's B prompts, G seeds each; this process's slice of the B*G samples
    # 2. Rollout    the configured sampler -> latents of every step, behaviour log-probs (in chunks)
    # 3. Score      every reward on the decoded images (a worker thread overlaps the next chunk)
    # 4. Gather     scores of all processes -> [B*G] per reward
    # 5. Balance    advantages per sample (balancer); failed samples and, on request, zero advantages dropped
    # 6. Optimise   per inner epoch, minibatch, trained transition: recompute the log-prob, clipped ratio
    #               loss (or GRPO-Guard's / Flow-DPPO's, flowrl/trainers/guard.py) + KL to the reference
    #               (adapter disabled); the optimizer step; EMA
    # 7. Log/Eval   metrics.jsonl + trackers, eval every n steps, checkpoint every n steps

Only the clipped-ratio optimisation (stage 6) is GRPO's own; everything else is a component call.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch

import flowrl.trainers.kit as kit
from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.schedules import on_trainable_steps
from flowrl.sde import StepRule
from flowrl.trainers.ais import AISConfig, ais_coefficients
from flowrl.trainers.guard import RatioControl, ratio_control_error
from flowrl.trainers.replay import GROUP, ReplayBuffer, ReplayConfig, check_replay, grpo_replay
from flowrl.trainers.transitions import (
    TransitionInputs,
    same_on_every_process,
    trained_transitions,
    transition_inputs,
)
from flowrl.trainers.tree_credit import TreeCreditConfig, shared_counts, transition_advantages
from flowrl.training.clock import timed
from flowrl.training.distributed import Sharding, kept_per_process, make_accelerator
from flowrl.training.loop import RecipeConfig, RecipeParts


@dataclass
class GRPOConfig(RecipeConfig):
    clip_range: float = 1e-4
    """PPO ε on the ratio of per-element-mean log-probs (Flow-GRPO 1e-4, Fast 1e-5, Wan 1e-3)."""
    kl_coef: float = 0.0
    """β of the KL to the reference model (the adapter switched off); 0 skips the reference forward."""
    kl_form: str = "code"
    """'code' (mean over elements / 2g², the form published β values assume) or 'paper' (sum / 2s²)."""
    timestep_fraction: float = 1.0
    """Train on this fraction of each sample's *stochastic* transitions (DanceGRPO 0.6). Flow-GRPO's 0.99 of
    T = 10 trains 9 transitions, all but the last: here the sampler already makes the last one deterministic,
    so the same setting is 1.0."""
    shuffle_timesteps: bool = False
    """Pick the trained transitions by a per-sample random permutation (DanceGRPO) instead of in order."""
    filter_zero_std: bool = False
    """Drop samples whose advantage is exactly 0 (a group with no reward spread) from the loss, which is then
    normalised by the kept samples (Flow-GRPO)."""
    tree: TreeCreditConfig = field(default_factory=TreeCreditConfig)
    """Reward fusion, depth-wise advantages and pruning of tree rollouts (keys train.tree.*)."""
    ais: AISConfig = field(default_factory=AISConfig)
    """Adaptive importance sampling of preview rollouts (keys train.ais.*; off by default)."""
    guard: bool = False
    """GRPO-Guard: the ratio through RatioNorm, (ℓ_θ − ℓ_old + b)·s, and each transition's clipped loss divided by its
    Δσ (docs/recipes/grpo.md#grpo-options-guard-and-ratio_control). Flow-GRPO SDE steps only; its published clip_range
    is 2e-6 to 4e-6 (the normalised log-ratio is small)."""
    ratio_control: str = "clip"
    """'clip' (PPO's clipped ratio, ε = clip_range) or 'dppo' (Flow-DPPO: −A·ρ, masked where the old-to-current KL of
    the transition is >= dppo_kl_threshold and ρ moved the way A pushes it)."""
    dppo_kl_threshold: float = 1e-5
    """τ of the dppo mask, on the KL of the transition Gaussians over their element count (UniRL's
    kl_mask_threshold)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """OP-GRPO's replay of past samples with truncated importance weights (keys train.replay.*; off by default;
    flowrl/trainers/replay.py)."""


def grpo_composition_error(recipe: type, sampler, balancer, train=None) -> str | None:
    """GRPO's composition check, for every recipe that trains GRPO's transitions (`recipe`: its class, named in the
    reasons): None where sampler `sampler` feeds it through balancer `balancer`, else the one-line reason and fix."""
    carries, needs = kit.rollout_carries(sampler), kit.balancer_needs(balancer)
    if "log_probs" not in carries:
        return (
            f"trainer: {recipe.name} needs behaviour log-probs, which the rollouts of sampler {sampler.name} lack "
            "(deterministic transitions): use sampler sde or tree with noise_level > 0, or candidates with full: "
            "{name: sde}"
        )
    if "affine_loss" in needs:
        return (
            f"balancer {balancer.name}: form='amortized' needs a loss affine in the advantage (trainer nft); GRPO's "
            "clipped ratio loss is not affine in the advantage, so Σ α_k ∇ℓ(A_k) ≠ ∇ℓ(Σ α_k A_k): set "
            "balancer.form=full"
        )
    if "per_sample_advantages" in needs and "per_edge" in carries:
        return (
            f"balancer {balancer.name} trains per-sample advantages; the {sampler.name} sampler's are per edge: use "
            "sampler sde"
        )
    return ratio_control_error(train, sampler.name, carries) if train is not None else None


def grpo_parts(cfg: RunConfig, accelerator, recipe: type, *, whole_groups=False, extra_rewards=None) -> RecipeParts:
    """The parts of a run that trains GRPO's transitions (kit.build_parts with `whole_groups` and `extra_rewards`),
    after GRPO's config checks and `recipe.composition_error`; MARBLE's full form only (RewardGradients: the clipped
    ratio loss is not affine in the advantage)."""
    t = cfg.train
    if t.kl_form not in sde.KL_FORMS:
        raise ValueError(f"train.kl_form={t.kl_form!r} must be one of {', '.join(sde.KL_FORMS)}")
    if t.kl_coef > 0 and not cfg.model.use_lora:
        raise ValueError("train.kl_coef > 0 needs model.use_lora=true (the reference is the adapter switched off)")
    why = recipe.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards)
    if why:
        raise ValueError(why)
    acc = accelerator or make_accelerator(cfg)
    tree_edges = "per_edge" in kit.rollout_carries(cfg.sampler)
    if Sharding(acc).kind is not None and tree_edges and t.tree.width_pruning != "none":
        raise ValueError(
            f"train.tree.width_pruning={t.tree.width_pruning!r} prunes each process's edges by its own advantages, "
            "so the processes would run different backward calls, which FSDP2 / ZeRO-2 cannot; set it to 'none'"
        )
    parts = kit.build_parts(cfg, acc, recipe, whole_groups=whole_groups, extra_rewards=extra_rewards)
    if t.num_minibatches != t.num_rollout_batches:
        warnings.warn(
            f"rollout chunks of {parts.local_n // t.num_rollout_batches} samples but minibatches of "
            f"{parts.local_n // t.num_minibatches}: on accelerators the first-pass ratio may differ from 1 "
            "by rounding; set train.num_minibatches = train.num_rollout_batches",
            stacklevel=3,
        )
    kit.reward_gradients(parts, affine=False)
    if t.replay.enabled:
        if recipe.name != "grpo":
            raise ValueError(f"train.replay.enabled: trainer {recipe.name} does not replay; use trainer grpo or nft")
        check_replay(parts, recipe)
        parts.kept[GROUP] = ReplayBuffer(t.replay)  # saved and resumed with the run
    return parts


class Regulariser(Protocol):
    """A term beside GRPO's clipped ratio loss, outside the advantage and MARBLE's balancing (TAGRPO's alignment)."""

    def term(self, rule: StepRule, v: torch.Tensor, inputs: TransitionInputs, index, k) -> torch.Tensor:
        """[b] the term of the transitions k of rows `index` (v: the policy's velocity there, with grad)."""
        ...

    def finish(self, steps: list[list[int]]) -> dict[str, float]:
        """After the step (`steps`: each sample's trained transitions): its metrics."""
        ...


def grpo_optimise(
    parts: RecipeParts, rollout, advantages, keep, per_reward, regulariser=None, sample_weights=None
) -> dict[str, float]:
    """Stage 6 of GRPO: the clipped ratio loss (+ β KL, + the `regulariser`'s term) over each sample's trained
    transitions; every sample weighs 1 / (its transition count) within the minibatch's kept samples, averaged over
    the accumulated minibatches. The leaves of a tree share its edges: each edge of a tree weighs 1 / (the tree's mean
    edge count per leaf). MARBLE (per_reward [K, N]): each reward's clipped loss backpropagated on its own, the KL
    and the regulariser outside them. Eval mode kept: the recomputed log-probs equal the rollout's on the first pass.
    `sample_weights` [N] (replay's importance weights; None = 1) multiply each sample's terms."""
    grads = parts.reward_grads
    t, acc, model, n = parts.cfg.train, parts.accelerator, parts.model, len(rollout.prompts)
    gen = seed_formulas.step_generator(parts.cfg.seed, parts.step)
    credit = transition_advantages(rollout, advantages, keep, t.tree, parts.step, parts.cfg.num_steps)
    credit = credit._replace(transitions=on_trainable_steps(credit.transitions, rollout.sigmas, model))
    steps = trained_transitions(credit.transitions, n, t.timestep_fraction, t.shuffle_timesteps, gen)
    counts = shared_counts(steps, credit.shared_by).to(acc.device)  # [N]
    if parts.opt.sharding.kind is not None and not same_on_every_process(acc, [len(s) for s in steps]):
        raise ValueError(
            "the processes train different numbers of transitions per sample, which FSDP2 / ZeRO-2 cannot (every "
            "process must run the same backward calls); use equal SDE windows"
        )
    accum, sigmas = t.gradient_accumulation_steps, rollout.sigmas.to(acc.device)
    orders = [torch.randperm(n, generator=gen) for _ in range(t.num_inner_epochs)]
    # AIS: log-probs of the policy at rollout time (the ratio's reference) and the advantage coefficients
    old_log_probs, coef, ais_stats = rollout.log_probs, None, {}
    if t.ais.enabled:
        old_log_probs, coef, ais_stats = ais_coefficients(
            parts, t.ais, rollout, steps, keep, orders[0], n // t.num_minibatches
        )
    stats: dict[str, list[torch.Tensor]] = {k: [] for k in ("policy_loss", "kl", "ratio", "clipped", "approx_kl")}
    control = RatioControl(parts, rollout, steps, orders[0], n // t.num_minibatches)  # clip, or guard / dppo
    optimizer_steps = kit.OptimizerSteps(parts)
    for mb in optimizer_steps(orders, per_reward):
        control.next_minibatch()
        rows = mb.rows.tolist()
        kept = kept_per_process(acc, keep[rows].sum())  # the mean over all processes' kept rows
        depth = max((len(steps[i]) for i in rows), default=0)  # a tree row may own no trained edge
        for j in range(depth):
            sel = [i for i in rows if len(steps[i]) > j]
            index = torch.tensor(sel, device=acc.device)  # [b]
            k = torch.tensor([steps[i][j] for i in sel], device=acc.device)  # [b] transition per sample
            weight = keep[index].float() / counts[index]  # [b]
            if sample_weights is not None:
                weight = weight * sample_weights[index]
            inputs = transition_inputs(rollout, sigmas, index, k)
            cond, x, x_next, sigma, sigma_next, level, scale = inputs
            v = model.velocity(x, sigma, cond, rollout.guidance_scale)
            v_ref = None
            if t.kl_coef > 0:
                with torch.no_grad(), model.adapter_disabled():
                    v_ref = model.velocity(x, sigma, cond, rollout.guidance_scale)
            log_prob, kl = sde.rescore_transition(
                rollout.rule, v, x, x_next, sigma, sigma_next, level, v_ref, t.kl_form, scale
            )
            kit.rollout_drift(parts, log_prob, rollout, index, k)  # the first pass before a step: the rollout's drift
            kl = kl if kl is not None else torch.zeros_like(log_prob)
            outside_terms = t.kl_coef * kl  # [b] the terms outside the advantage (and outside MARBLE's balancing)
            if regulariser is not None:  # e.g. TAGRPO: the step mean pulled toward better members' next latents
                outside_terms = outside_terms + regulariser.term(rollout.rule, v, inputs, index, k)
            old = old_log_probs[index, k]
            c = coef[index, k] if coef is not None else 1.0  # AIS's mixture coefficient per transition
            surrogate = control.surrogate(v, inputs, log_prob, old, index, k)  # advantages -> (loss [b], stats)
            policy_loss, s = surrogate(credit.advantages[index, k] * c)
            control.record(s)
            per_sample = policy_loss + outside_terms  # [b]

            def policy(a, surrogate=surrogate, weight=weight, c=c):
                return (surrogate(a * c)[0] * weight).sum() / kept / accum

            outside = None
            if t.kl_coef > 0 or regulariser is not None:
                outside = (outside_terms * weight).sum() / kept / accum
            loss = (per_sample * weight).sum() / kept / accum
            boundary = j == depth - 1 and mb.closes_step
            grads.backward_step(loss, policy, per_reward[:, index], outside, boundary=boundary)
            optimizer_steps.losses.append(per_sample.detach().mean())
            stats["policy_loss"].append(policy_loss.detach().mean())
            stats["kl"].append(kl.detach().mean())
            for key in ("ratio", "approx_kl"):
                stats[key].append(s[key])
            stats["clipped"].append(s["clipped"].float())
    ratio = torch.cat(stats["ratio"])
    # after the step: e.g. TAGRPO's bank remembers this step's latents (a start's partners are from earlier steps)
    regulariser_metrics = regulariser.finish(steps) if regulariser is not None else {}
    return {
        "train/loss": float(torch.stack(optimizer_steps.losses).mean()),
        "train/policy_loss": float(torch.stack(stats["policy_loss"]).mean()),
        "train/kl": float(torch.stack(stats["kl"]).mean()),
        "train/clip_fraction": float(torch.cat(stats["clipped"]).mean()),
        "train/approx_kl": float(torch.cat(stats["approx_kl"]).mean()),
        "train/ratio_mean": float(ratio.mean()),
        "train/ratio_min": float(ratio.min()),
        "train/ratio_max": float(ratio.max()),
        **parts.opt.metrics(),
        **grads.metrics(),
        **regulariser_metrics,
        **ais_stats,
        **control.metrics(),
    }


class GRPOTrainer:
    config_class = GRPOConfig
    name = "grpo"
    adapter_copies = 0  # LoRA adapters beside the policy: none (the reference is the adapter switched off)
    full_reference_copy = False
    cfg_doubles_train_rows = True  # the trained transitions run at the rollout's guidance: true CFG, both branches
    trains_on = "stochastic_steps"  # the rollout's stochastic transitions
    uses_behaviour_log_probs = True  # the clipped ratio to the rollout's log-probs (kit.lossy_rollout_error)
    recipe_variants: ClassVar[dict[str, dict]] = {"": {}, "guard": {"guard": True}, "dppo": {"ratio_control": "dppo"}}

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        return grpo_composition_error(cls, sampler, balancer, train)

    def __init__(self, cfg: RunConfig, accelerator=None):
        self.parts = grpo_parts(cfg, accelerator, type(self))

    def train_step(self) -> dict[str, float]:
        t, parts = self.parts.cfg.train, self.parts
        exp = kit.collect(parts)  # 1-5. prompts, rollout, score, gather, balance
        if t.filter_zero_std:
            exp.keep &= exp.advantages != 0

        # 6. Optimise (with replay: beside this step's samples, earlier ones under truncated importance weights)
        tic = timed(parts.accelerator.device)
        exp, weights, replayed = grpo_replay(parts, exp, parts.kept.get(GROUP))
        inputs = (exp.rollout, exp.advantages, exp.keep, exp.per_reward)
        metrics = exp.metrics | replayed | grpo_optimise(parts, *inputs, sample_weights=weights)
        return kit.finish_step(parts, exp, metrics, tic.seconds())  # 7. Log
