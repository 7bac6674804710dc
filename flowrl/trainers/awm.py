"""Advantage Weighted Matching (AWM): the pretraining flow-matching loss on the policy's own clean samples, weighted
by their advantages, as one recipe over the shared components. The math, its source and the choices made where the
source is silent: docs/recipes/awm.md.

    flowrl train configs/toy/awm.yaml
    accelerate launch scripts/train.py --config configs/sd3/awm_pickscore.yaml

On policy, from any sampler's clean endpoints x0 and time grid. Two LoRA adapters, both starting at the reference:
"default" (θ, trained) and "kl_ema" (a trailing copy of θ, the EMA-KL anchor). Stage 6 is AWM's, the rest the kit's:

    # 6. Optimise   per sample K grid times t (one per stratum) and noises ε from its own seed; per minibatch and time
    #               x_t = (1 − t)·x0 + t·ε and the loss max(−Â·ρ, −Â·clip(ρ, 1 ± c)) + β·mean((v_θ − v_ref)²) +
    #               γ·mean((v_θ − v_kl_ema)²), log p = −W(ℓ, t), ρ = exp(log p − sg(log p_old)) ≡ 1 until the step's
    #               first optimizer step; then θ_kl_ema ← d·θ_kl_ema + (1 − d)·θ, d = min(0.3, 0.001·optimizer steps)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flowrl.trainers.kit as kit
from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.losses import AWM_WEIGHTINGS, awm_log_prob, awm_policy_loss, velocity_kl
from flowrl.schedules import AWM_TIME_TYPES, awm_times, trainable_steps
from flowrl.training.clock import timed
from flowrl.training.distributed import kept_per_process, make_accelerator
from flowrl.training.loop import RecipeConfig
from flowrl.types import select_cond

KL_EMA = "kl_ema"  # the adapter the EMA-KL term pulls toward; the trained one is "default"


@dataclass
class AWMConfig(RecipeConfig):
    weighting: str = "ghuber"
    ghuber_power: float = 0.25
    """W(ℓ, t) of the flow-matching error ℓ: 'ghuber' (AWM's, (t/p)·((ℓ + 1e-10)^p − 1e-10^p) with p = ghuber_power),
    'huber', 'uniform', 't' or 't2' (flowrl.losses.awm_weighting)."""
    kl_coef: float = 1e-4
    """β of mean((v_θ − v_ref)²), v_ref with the adapters off (AWM: 1e-4 PickScore, 1e-3 GenEval); 0 skips its
    forward."""
    ema_kl_coef: float = 1.0
    """γ of mean((v_θ − v_kl_ema)²), the EMA-KL term (AWM `ema_beta`); 0 skips its forward."""
    ema_kl_decay: float = 0.3
    ema_kl_decay_ramp: float = 0.001
    """After every step θ_kl_ema ← d·θ_kl_ema + (1 − d)·θ, d = min(ema_kl_decay, ramp · optimizer steps taken)."""
    adv_clip_max: float = 5.0
    advantage_max: float = 1.0
    """Â = clip(A, ±adv_clip_max) / adv_clip_max · advantage_max."""
    clip_range: float = 1.0
    """c of the ratio clip; inactive while a step has one optimizer step (ρ ≡ 1)."""
    time_type: str = "discrete"
    """'discrete': strata of the grid indices [0, int(T·fraction)); 'discrete_wo_init': [1, int(T·fraction)) (σ_0
    out)."""
    num_train_timesteps: int = 6
    """K training times per sample and step, one in each of K strata."""
    timestep_fraction: float = 0.9
    ema_decay: float = 0.99  # AWM evaluates an EMA of θ updated after every optimizer step
    ema_every_n_steps: int = 1


def one_optimizer_step(t: AWMConfig) -> bool:
    return t.num_inner_epochs * t.num_minibatches == t.gradient_accumulation_steps  # every ratio is then exactly 1


class AWMTrainer:
    config_class = AWMConfig
    name = "awm"
    adapter_copies = 1  # KL_EMA, the EMA-KL anchor
    full_reference_copy = False
    cfg_doubles_train_rows = True  # CFG rollouts train the guided velocity
    trains_on = "rollout_steps"  # training times among the rollout's grid times

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        t = train if train is not None else cls.config_class()
        if "clean_endpoints" not in kit.rollout_carries(sampler):
            return (
                f"trainer: awm weights the flow-matching loss of clean endpoints, which sampler {sampler.name} lacks: "
                "use ode"
            )
        if "affine_loss" in kit.balancer_needs(balancer) and not one_optimizer_step(t):
            return (
                f"balancer {balancer.name} form=amortized needs a loss affine in the advantage, which awm's is with "
                "one optimizer step per training step only (ρ ≡ 1): set train.gradient_accumulation_steps = "
                "num_minibatches"
            )
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        t = cfg.train
        if t.weighting not in AWM_WEIGHTINGS or t.time_type not in AWM_TIME_TYPES:
            raise ValueError(
                f"train.weighting={t.weighting!r} must be in {AWM_WEIGHTINGS}, time_type={t.time_type!r} in "
                f"{AWM_TIME_TYPES}"
            )
        positive = (
            t.ghuber_power,
            t.adv_clip_max,
            t.advantage_max,
            t.clip_range,
            t.num_train_timesteps,
            t.timestep_fraction,
        )
        if min(positive) <= 0 or t.timestep_fraction > 1 or not 0 <= t.ema_kl_decay <= 1 or t.ema_kl_decay_ramp < 0:
            raise ValueError(
                "train.ghuber_power, adv_clip_max, advantage_max, clip_range, num_train_timesteps "
                f"{positive[:-1]} must be > 0, timestep_fraction={t.timestep_fraction} in (0, 1], "
                f"ema_kl_decay={t.ema_kl_decay} in [0, 1], ramp >= 0"
            )
        if not cfg.model.use_lora:
            raise ValueError(
                "trainer: awm needs model.use_lora=true (the EMA-KL anchor and the reference are adapters)"
            )
        if why := self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards):
            raise ValueError(why)
        self.parts = parts = kit.build_parts(cfg, accelerator or make_accelerator(cfg), type(self), adapters=(KL_EMA,))
        self.guidance = kit.sampler_guidance(parts)  # CFG rollouts train the guided velocity (AWM's `train.cfg`)
        kit.reward_gradients(parts, one_optimizer_step(t), t.adv_clip_max)  # affine where ρ ≡ 1

    def train_step(self) -> dict[str, float]:
        parts, t = self.parts, self.parts.cfg.train
        exp, device = kit.collect(parts), parts.accelerator.device  # 1-5, on policy: θ's own rollout
        x0 = exp.rollout.final_latents().to(device)  # [N, *latent_shape]: the clean endpoints
        sigmas, cond = exp.rollout.sigmas.to(device), exp.rollout.cond  # [T+1]; rows [N]
        exp.rollout = None  # the endpoints are all AWM keeps

        # 6. Optimise, then step the EMA-KL anchor
        tic = timed(device)
        draws = seed_formulas.sample_generators(
            exp.batch.seeds, "cpu", seed_formulas.TRAIN_STREAM
        )  # a sample's t and ε
        args = (tuple(x0.shape[1:]), t.num_train_timesteps, t.timestep_fraction, t.time_type)
        times, noises = awm_times(draws, sigmas, *args, trainable_steps(parts.model, sigmas))  # [N, K], [N, K, ...]
        metrics = exp.metrics | self._optimise(
            x0, sigmas, cond, exp.advantages, exp.per_reward, exp.keep, times, noises
        )
        decay = min(t.ema_kl_decay, t.ema_kl_decay_ramp * parts.opt.optimizer_steps)
        parts.model.soft_update_adapter(KL_EMA, "default", decay)
        return kit.finish_step(parts, exp, metrics | {"train/kl_ema_decay": decay}, tic.seconds())  # 7. Log

    def _log_prob(self, index, j, x0, sigmas, cond, times, noises, grad=True):
        """log p = −W(ℓ, t) [b] of the items (index [b] on the device, time j) and the velocity it came from."""
        t, rows = self.parts.cfg.train, index.cpu()
        sigma, noise = sigmas[times[rows, j].to(x0.device)], noises[rows, j].to(x0.device)  # [b], [b, ...]
        x_t = sde.forward_noise(x0[index], noise, sigma)
        with torch.set_grad_enabled(grad):
            v = self.parts.model.velocity(x_t, sigma, cond, self.guidance)
        return awm_log_prob(v, x0[index], noise, sigma, t.weighting, t.ghuber_power), v, x_t, sigma

    def _kl(self, v, x_t, sigma, cond, adapter: str | None) -> torch.Tensor:
        """mean((v_θ − v_other)²) [b]: v_other without gradient, with adapter `adapter` (None: adapters off, v_ref)."""
        model = self.parts.model
        with torch.no_grad(), model.adapter_disabled() if adapter is None else model.using_adapter(adapter):
            other = model.velocity(x_t, sigma, cond, self.guidance)
        return velocity_kl(v, other)

    def _old_log_probs(self, rows, x0, sigmas, cond, times, noises) -> torch.Tensor:
        """log p_old [N, K]: θ's before the step's first optimizer step, at the items of samples `rows` (NaN
        elsewhere)."""
        out = torch.full(times.shape, float("nan"), dtype=torch.float64, device=x0.device)
        for index in rows.to(x0.device).split(self.parts.local_n // self.parts.cfg.train.num_minibatches):
            for j in range(times.shape[1]):
                out[index, j] = self._log_prob(index, j, x0, sigmas, select_cond(cond, index), times, noises, False)[0]
        return out

    def _optimise(self, x0, sigmas, cond, advantages, per_reward, keep, times, noises) -> dict[str, float]:
        """The AWM loss at each sample's K times, the mean over the kept items of an optimizer step's minibatches. With
        per-reward gradients (MARBLE; per_reward [K, N]) each reward's policy term is backpropagated on its own."""
        parts, grads = self.parts, self.parts.reward_grads
        t, acc, n, k = parts.cfg.train, parts.accelerator, parts.local_n, times.shape[1]
        gen = seed_formulas.step_generator(parts.cfg.seed, parts.step)
        orders = [torch.randperm(n, generator=gen) for _ in range(t.num_inner_epochs)]
        later = torch.cat(orders)[n // t.num_minibatches * t.gradient_accumulation_steps :].unique()  # after step 1
        old = self._old_log_probs(later, x0, sigmas, cond, times, noises) if len(later) else None
        first, args = parts.opt.optimizer_steps, (t.adv_clip_max, t.advantage_max, t.clip_range)
        anchors = ((t.kl_coef, None), (t.ema_kl_coef, KL_EMA))  # β: the reference (adapters off); γ: the EMA-KL anchor
        steps = kit.OptimizerSteps(parts)
        for mb in steps(orders, per_reward):
            index, keep_b, per_reward_b = mb.index, keep[mb.index].float(), per_reward[:, mb.index]  # [b], [b], [K, b]
            adv_b = grads.advantages(advantages[index], per_reward_b)  # [b]; MARBLE: Σ_k ᾱ_k A_k
            norm = kept_per_process(acc, keep_b.sum()) * t.gradient_accumulation_steps * k  # kept items of the window
            on_policy, sub_cond = parts.opt.optimizer_steps == first, select_cond(cond, index)
            for j in range(k):
                log_p, v, x_t, sigma = self._log_prob(index, j, x0, sigmas, sub_cond, times, noises)
                old_b = None if on_policy else old[index, j]  # on policy: sg(log p), ρ ≡ 1
                policy, s = awm_policy_loss(log_p, old_b, adv_b, *args)  # [b] float64
                kl, ema_kl = (self._kl(v, x_t, sigma, sub_cond, a) if c > 0 else None for c, a in anchors)  # [b] each
                terms = [c * d for c, d in ((t.kl_coef, kl), (t.ema_kl_coef, ema_kl)) if d is not None]
                outside = (sum(terms) * keep_b).sum() / norm if terms else None  # outside MARBLE's balancing

                def policy_of(a, log_p=log_p, old_b=old_b):
                    return (awm_policy_loss(log_p, old_b, a, *args)[0].float() * keep_b).sum() / norm

                per_item = policy.float() + (sum(terms) if terms else 0.0)  # [b]
                loss, boundary = (per_item * keep_b).sum() / norm, j == k - 1 and mb.closes_step
                grads.backward_step(loss, policy_of, per_reward_b, outside, boundary)
                steps.losses.append(per_item.detach().mean())
                steps.record(
                    {"policy_loss": policy, "kl": kl, "ema_kl": ema_kl, "ratio": s["ratio"], "weighted_error": -log_p}
                )
        return steps.metrics()
