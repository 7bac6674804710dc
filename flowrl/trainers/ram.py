"""Reinforce Adjoint Matching (RAM): reward-weighted flow matching on the model's own clean samples, as one
recipe over the shared components. The math is in docs/math.md#reinforce-adjoint-matching, the recipe and its
published settings in docs/recipes/adjoint.md#ram.

    flowrl train configs/toy/ram.yaml
    accelerate launch scripts/train.py --config configs/sd3/ram_pickscore.yaml

No reward gradient, no SDE: any sampler (ODE by default; CFG allowed in the rollout), only the clean endpoints
x0 are kept. Two LoRA adapters on one transformer, both starting at the reference (LoRA B = 0): "default" (θ,
trained) and "old" (θ_old, the rollout policy and the v_old of the target, an EMA of θ stepped once per step with
a linear warm-up of its decay). One training step (one RAM "epoch"):

    # 1. Prompts    the step's B prompts, G seeds each; this process's slice of the B*G samples
    # 2. Rollout    the sampler with the "old" adapter -> x0 [N, ...]
    # 3. Score      every reward on the decoded images
    # 4. Gather     scores of all processes -> [B*G] per reward
    # 5. Balance    advantages per sample (balancer; RAM centres within the group: `std: none`)
    # 6. Optimise   K noisings (t ~ p(t) ∝ t^α, ε) per endpoint; per minibatch of (endpoint, t) items the
    #               conditional velocities of θ (grad), θ_old and the reference (adapters off), the regression
    #               of v_θ onto sg[v_ref + m·A·((ε − x0) − v_old)]; the optimizer step; EMA.
    #               Then θ_old ← d·θ_old + (1 − d)·θ with d = min(ramp·step, decay)
    # 7. Log/Eval   metrics.jsonl + trackers, eval every n steps, checkpoint every n steps

Only stage 6 (and sampling with θ_old) is RAM's own; everything else is a component call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flowrl.trainers.kit as kit
from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.losses import ram_loss, ram_target
from flowrl.schedules import ram_times
from flowrl.training.clock import timed
from flowrl.training.distributed import kept_per_process, make_accelerator
from flowrl.training.loop import RecipeConfig
from flowrl.types import select_cond

OLD = "old"  # the rollout policy's adapter name; the trained one is "default"


@dataclass
class RAMConfig(RecipeConfig):
    reward_multiplier: float = 100.0
    """m: the target is v_ref + m·A·((ε − x0) − v_old); larger m = weaker pull to the reference (RAM: 100 GenEval /
    OCR, 1000 PickScore, with advantages centred on [0, 1]-range rewards)."""
    num_loss_targets_per_sample: int = 8
    """K independent (t, ε) noisings of each clean endpoint per step."""
    time_alpha: float = 1.0
    """Training times t ∈ (0, 1] drawn with density ∝ t^α (α = 1: biased to the noise end)."""
    old_decay: float = 0.9
    """The decay the old policy's EMA ramps up to."""
    old_decay_ramp: float = 0.01
    """The old EMA's decay after step i is min(ramp·i, old_decay) (RAM: 0 → 0.9 at 0.01 per epoch)."""
    cache_targets: bool = False
    """Compute v_ref and v_old (the target) of every item once per step before the first minibatch (they do not
    change within a step); pays off with num_inner_epochs > 1. Minibatches split the N·K items."""
    ema_every_n_steps: int = 1
    max_grad_norm: float = 0.0
    """RAM trains without gradient clipping (0 = off)."""


def old_policy_decay(step: int, ramp: float, cap: float) -> float:
    """d of θ_old ← d·θ_old + (1 − d)·θ after training step `step` (0-based): min(ramp·step, cap)."""
    return min(ramp * step, cap)


class RAMTrainer:
    config_class = RAMConfig
    name = "ram"
    adapter_copies = 1  # OLD, the rollout policy and the target's v_old
    full_reference_copy = False
    cfg_doubles_train_rows = False  # the loss regresses conditional velocities
    trains_on = "endpoints"  # times drawn on the trainable σ range

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md). Any rollout with
        clean endpoints feeds RAM's regression: a tree's leaves and candidate pools' regenerated samples too."""
        if "clean_endpoints" not in kit.rollout_carries(sampler):
            return (
                f"trainer: ram regresses on clean endpoints, which the rollouts of sampler {sampler.name} lack: use "
                "sampler ode"
            )
        if "reward_gradients" in kit.balancer_needs(balancer):
            return (
                f"balancer {balancer.name} balances per-reward gradients, which trainer ram does not take (one "
                "backward on one advantage per sample): use trainer nft or grpo with it, or balancer gdpo with ram"
            )
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        t = cfg.train
        if t.num_loss_targets_per_sample < 1:
            raise ValueError(f"train.num_loss_targets_per_sample={t.num_loss_targets_per_sample} must be >= 1 (RAM: 8)")
        if t.time_alpha <= -1:
            raise ValueError(f"train.time_alpha={t.time_alpha} must be > -1 (p(t) ∝ t^α must be integrable; RAM: 1)")
        if not 0 <= t.old_decay < 1 or t.old_decay_ramp < 0:
            raise ValueError(
                f"train.old_decay={t.old_decay} must be in [0, 1) and train.old_decay_ramp={t.old_decay_ramp} >= 0"
            )
        if not cfg.model.use_lora:
            raise ValueError("trainer: ram needs model.use_lora=true (the old policy and the reference are adapters)")
        why = self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards)
        if why:
            raise ValueError(why)
        acc = accelerator or make_accelerator(cfg)  # minibatches of (endpoint, t) items: K per endpoint
        self.parts = parts = kit.build_parts(
            cfg, acc, type(self), adapters=(OLD,), items_per_sample=t.num_loss_targets_per_sample
        )
        self.guidance = kit.policy_guidance(
            parts
        )  # the loss regresses conditional velocities: CFG stays in the rollout

    def train_step(self) -> dict[str, float]:
        parts, t = self.parts, self.parts.cfg.train
        exp = kit.collect(parts, adapter=OLD)  # 1-5, the rollout with the old policy
        x0, cond = (
            exp.rollout.final_latents().to(parts.accelerator.device),
            exp.rollout.cond,
        )  # [N, *latent_shape]; rows [N]
        exp.rollout = None  # the endpoints are all RAM keeps

        # 6. Optimise, then step the old policy's EMA
        tic = timed(parts.accelerator.device)
        draws = seed_formulas.sample_generators(
            exp.batch.seeds, "cpu", seed_formulas.TRAIN_STREAM
        )  # a sample's t and ε
        shape, sigma_range = tuple(x0.shape[1:]), parts.model.trainable_sigma_range()  # times on the trained side
        times, noises = ram_times(draws, shape, t.num_loss_targets_per_sample, t.time_alpha, sigma_range)
        metrics = exp.metrics | self._optimise(x0, cond, exp.advantages, exp.keep, times, noises)
        decay = old_policy_decay(parts.step, t.old_decay_ramp, t.old_decay)
        parts.model.soft_update_adapter(OLD, "default", decay)
        metrics = kit.finish_step(parts, exp, metrics, tic.seconds())  # 7. Log
        metrics["train/old_decay"] = decay
        return metrics

    def _targets(self, x_t, sigma, cond, x0, noise, advantages) -> torch.Tensor:
        model = self.parts.model
        with torch.no_grad():
            with model.using_adapter(OLD):
                v_old = model.velocity(x_t, sigma, cond, self.guidance)
            with model.adapter_disabled():
                v_ref = model.velocity(x_t, sigma, cond, self.guidance)
        return ram_target(v_ref, v_old, x0, noise, advantages, self.parts.cfg.train.reward_multiplier)

    def _optimise(self, x0, cond, advantages, keep, times, noises) -> dict[str, float]:
        """The RAM regression over the step's N·K (endpoint, t) items in minibatches; the mean over the kept items
        of a minibatch, accumulated over `gradient_accumulation_steps` minibatches per optimizer step."""
        parts = self.parts
        t, acc, model, opt = parts.cfg.train, parts.accelerator, parts.model, parts.opt
        n, k = times.shape
        gen = seed_formulas.step_generator(parts.cfg.seed, parts.step)
        sample_of = torch.arange(n).repeat_interleave(k)  # item -> endpoint; items are (sample, j) in row order
        sigma_all = times.reshape(-1).to(acc.device)  # [N·K]
        noise_all = noises.reshape(n * k, *noises.shape[2:]).to(acc.device)
        items = (sample_of, x0, cond, advantages, sigma_all, noise_all)
        cached = None
        if t.cache_targets:
            cached = torch.cat(
                [
                    self._minibatch_target(rows, *items)[1]
                    for rows in torch.arange(n * k).split(n * k // t.num_minibatches)
                ]
            )
        target_norms = []
        optimizer_steps = kit.OptimizerSteps(parts)
        for mb in optimizer_steps([torch.randperm(n * k, generator=gen) for _ in range(t.num_inner_epochs)]):
            x_t, target = self._minibatch_target(mb.rows, *items, cached)
            samples = sample_of[mb.rows].to(acc.device)
            keep_b = keep[samples].float()  # [b]
            v_theta = model.velocity(x_t, sigma_all[mb.index], select_cond(cond, samples), self.guidance)
            per_item = ram_loss(v_theta, target)  # [b]
            accum = t.gradient_accumulation_steps
            opt.backward(
                (per_item * keep_b).sum() / kept_per_process(acc, keep_b.sum()) / accum, boundary=mb.closes_step
            )
            optimizer_steps.losses.append(per_item.detach().mean())
            target_norms.append(target.pow(2).mean(tuple(range(1, target.ndim))).sqrt().mean())
        loss = float(torch.stack(optimizer_steps.losses).mean())
        return {"train/loss": loss, "train/target_norm": float(torch.stack(target_norms).mean())} | opt.metrics()

    def _minibatch_target(self, rows, sample_of, x0, cond, advantages, sigma_all, noise_all, cached=None):
        """x_t and the (cached or fresh) target of the items `rows`."""
        device = x0.device
        index, samples = rows.to(device), sample_of[rows].to(device)
        x_t = sde.forward_noise(x0[samples], noise_all[index], sigma_all[index])
        if cached is not None:
            return x_t, cached[index]
        target = self._targets(
            x_t, sigma_all[index], select_cond(cond, samples), x0[samples], noise_all[index], advantages[samples]
        )
        return x_t, target
