"""ELBO likelihood policy gradient: a policy gradient whose log-likelihood is the flow-matching ELBO of the clean
sample alone, as one recipe over the shared components. The math and its source lines are in
docs/math.md#elbo-likelihood-policy-gradient, the recipe and its published settings in docs/recipes/elbo.md.

    flowrl train configs/toy/elbo.yaml
    accelerate launch scripts/train.py --config configs/reproduce/elbo_sd3_geneval.yaml

Any sampler with clean endpoints (ODE by default, CFG refused). Two LoRA adapters, both starting at the reference:
"default" (θ, trained) and "old" (θ_old, the sampling policy, soft-updated toward θ after every step). Stage 6:

    # 6. Optimise   per sample K = int(T·fraction) of the T grid times (a random permutation) and one fresh ε per
    #               (sample, t); x_t = (1 − t)·x0 + t·ε, x̂0 = x_t − t·v; the ELBO log p = −mean((x̂0 − x0)²) / sg(w),
    #               w = mean|x̂0 − x0| ('adaptive'), for θ (grad) and θ_old; EPG −ρ·A·log p, PEPG −ρ·(A − δ)·log p or
    #               PAR ½·ρ·(A − (log p − log p_old))², δ = sg(log p) − log p_old, ρ = exp(δ) (1 without the ratio),
    #               plus β·mean((v_θ − v_ref)²); then θ_old ← η·θ_old + (1 − η)·θ
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flowrl.trainers.kit as kit
from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.losses import velocity_kl
from flowrl.schedules import nft_times, trainable_steps
from flowrl.trainers.nft import OLD, old_policy_decay
from flowrl.training.clock import timed
from flowrl.training.distributed import kept_per_process, make_accelerator
from flowrl.training.loop import RecipeConfig
from flowrl.types import select_cond

ELBO_WEIGHTINGS = ("adaptive", "t", "uniform", "exact")
OBJECTIVES = ("epg", "pepg", "par")


@dataclass
class ELBOConfig(RecipeConfig):
    objective: str = "pepg"
    """'epg' −ρ·A·log p, 'pepg' (proximal) −ρ·(A − δ)·log p, 'par' ½·ρ·(A − (log p − log p_old))² (the paper's headline
    GenEval run: pepg)."""
    use_ratio: bool = True
    """ρ = exp(sg(log p) − log p_old), a detached weight; False: ρ = 1 (the authors' `*_noratio` objectives)."""
    elbo_weighting: str = "adaptive"
    """The ELBO of x̂0 = x_t − t·v: 'adaptive' −mean((x̂0 − x0)²) / sg(mean|x̂0 − x0| ∨ 1e-5) (the paper's), 't'
    −mean((x̂0 − x0)²), 'uniform' −mean((v − (ε − x0))²), 'exact' −mean((1 − t)/(t + 1e-3)·(v − (ε − x0))²)."""
    advantage_scale: float = 1.0
    """A = scale · the balancer's advantage (the paper's GenEval: balancer std 'none', scale β/α = 1e-4/1e-3 = 0.1)."""
    kl_coef: float = 1e-4
    """β of mean((v_θ − v_ref)²), the reference being the adapters switched off; 0 skips its forward."""
    timestep_fraction: float = 0.99
    """Train on int(T·fraction) of the sampler's T grid times per sample (a random permutation per sample)."""
    decay_type: int = 1
    """Soft update of θ_old after each step, η_i at optimizer step i: 0 → η = 0 (copy); 1 → min(0.001·i, 0.5);
    2 → 0 for i < 75, then min(0.0075·(i − 75), 0.999)."""
    old_decay_max: float | None = None
    """Cap η at this value instead of the decay type's own cap."""
    ema_decay: float = 0.9  # the authors evaluate an EMA of θ (decay 0.9) updated after every optimizer step
    ema_every_n_steps: int = 1


def elbo_log_likelihood(
    v: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor, weighting: str
) -> torch.Tensor:
    """The ELBO surrogate of log p(x0) per sample [n], float64, from the velocity v at x_t = (1 − t)·x0 + t·ε
    (`sigma` t [n]); x̂0 = x_t − t·v, and 'adaptive' divides by the detached w = max(mean|x̂0 − x0|, 1e-5)."""
    dims = tuple(range(1, v.ndim))
    t = sigma.double().view(-1, *([1] * (v.ndim - 1)))
    if weighting in ("adaptive", "t"):
        error = x_t.double() - t * v.double() - x0.double()  # x̂0 − x0
        squared = (error**2).mean(dims)
        if weighting == "t":
            return -squared
        return -squared / error.detach().abs().mean(dims).clamp(min=1e-5)
    error = (noise.double() - x0.double() - v.double()) ** 2  # (ε − x0 − v)²
    if weighting == "uniform":
        return -error.mean(dims)
    if weighting == "exact":
        return -((1 - t) / (t + 1e-3) * error).mean(dims)
    raise ValueError(f"train.elbo_weighting={weighting!r} must be one of {', '.join(ELBO_WEIGHTINGS)}")


def elbo_policy_loss(
    log_p: torch.Tensor, old_log_p: torch.Tensor, advantages: torch.Tensor, objective: str, use_ratio: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy term per sample [n], float64, of ELBO log-likelihoods `log_p` (with grad) and `old_log_p` (θ_old's)
    and advantages A: δ = sg(log p) − log p_old, ρ = exp(δ) or 1; 'epg' −ρ·A·log p, 'pepg' −ρ·(A − δ)·log p, 'par'
    ½·ρ·(A − (log p − log p_old))². Returns (loss [n], {'ratio', 'log_ratio'})."""
    log_p, old, a = log_p.double(), old_log_p.detach().double(), advantages.detach().double()
    delta = log_p.detach() - old
    ratio = delta.exp() if use_ratio else torch.ones_like(delta)
    if objective == "epg":
        loss = -ratio * a * log_p
    elif objective == "pepg":
        loss = -ratio * (a - delta) * log_p
    elif objective == "par":
        loss = 0.5 * ratio * (a - (log_p - old)) ** 2
    else:
        raise ValueError(f"train.objective={objective!r} must be one of {', '.join(OBJECTIVES)}")
    return loss, {"ratio": delta.exp(), "log_ratio": delta}


class ELBOTrainer:
    config_class = ELBOConfig
    name = "elbo"
    adapter_copies = 1  # OLD, the sampling policy
    full_reference_copy = False
    cfg_doubles_train_rows = False  # CFG-free (refused in the rollout)
    trains_on = "rollout_steps"  # training times among the rollout's grid times

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        t = train if train is not None else cls.config_class()
        if "clean_endpoints" not in kit.rollout_carries(sampler):
            return (
                f"trainer: elbo takes the ELBO of clean endpoints, which the rollouts of sampler {sampler.name} lack: "
                "use sampler ode"
            )
        if "affine_loss" in kit.balancer_needs(balancer) and t.objective not in ("epg", "pepg"):
            return (
                f"balancer {balancer.name} form=amortized needs a loss affine in the advantage, which "
                f"train.objective={t.objective!r} is not: use epg or pepg"
            )
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        t = cfg.train
        if t.objective not in OBJECTIVES or t.elbo_weighting not in ELBO_WEIGHTINGS:
            raise ValueError(
                f"train.objective={t.objective!r} must be in {OBJECTIVES}, elbo_weighting={t.elbo_weighting!r} in "
                f"{ELBO_WEIGHTINGS}"
            )
        if not 0 < t.timestep_fraction <= 1 or t.advantage_scale <= 0 or t.kl_coef < 0:
            raise ValueError(
                f"train.timestep_fraction={t.timestep_fraction} must be in (0, 1], advantage_scale="
                f"{t.advantage_scale} > 0 and kl_coef={t.kl_coef} >= 0"
            )
        old_policy_decay(t.decay_type, 0)  # validates decay_type
        if not cfg.model.use_lora:
            raise ValueError(
                "trainer: elbo needs model.use_lora=true (the sampling policy and the reference are adapters)"
            )
        if why := self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards):
            raise ValueError(why)
        self.parts = parts = kit.build_parts(cfg, accelerator or make_accelerator(cfg), type(self), adapters=(OLD,))
        self.guidance = kit.refuse_cfg(type(self), parts, "trains the ELBO of the conditional velocity")
        kit.reward_gradients(parts, t.objective in ("epg", "pepg"))  # MARBLE where asked; affine but for PAR

    def train_step(self) -> dict[str, float]:
        parts, t = self.parts, self.parts.cfg.train
        exp = kit.collect(parts, adapter=OLD)  # 1-5, the rollout with the sampling policy θ_old
        x0 = exp.rollout.final_latents().to(parts.accelerator.device)  # [N, *latent_shape]: the clean endpoints
        sigmas, cond = exp.rollout.sigmas.to(parts.accelerator.device), exp.rollout.cond  # [T+1]; rows [N]
        exp.rollout = None  # the endpoints are all the ELBO needs

        # 6. Optimise, then the soft update of the sampling policy
        tic = timed(parts.accelerator.device)
        draws = seed_formulas.sample_generators(exp.batch.seeds, "cpu", seed_formulas.TRAIN_STREAM)  # t and ε
        metrics = exp.metrics | self._optimise(x0, sigmas, cond, exp.advantages, exp.per_reward, exp.keep, draws)
        decay = old_policy_decay(t.decay_type, parts.opt.optimizer_steps, t.old_decay_max)
        parts.model.soft_update_adapter(OLD, "default", decay)
        return kit.finish_step(parts, exp, metrics | {"train/old_decay": decay}, tic.seconds())  # 7. Log

    def _draw(self, draws, sigmas, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """An epoch's training items from each sample's generator: grid indices [N, K] (the first K of a random
        permutation of the trained grid times), then one ε per (sample, time) [N, K, *shape]."""
        trainable = trainable_steps(self.parts.model, sigmas)
        times = nft_times(draws, sigmas, self.parts.cfg.train.timestep_fraction, trainable)  # [N, K]
        return times, torch.stack([torch.randn((times.shape[1], *shape), generator=g) for g in draws])

    def _velocity(self, x_t, sigma, cond, adapter: str | None = "default") -> torch.Tensor:
        """v of θ ("default", with grad), of θ_old (OLD) or of the reference (None, adapters off), without grad."""
        model = self.parts.model
        if adapter == "default":
            return model.velocity(x_t, sigma, cond, self.guidance)
        with torch.no_grad(), model.adapter_disabled() if adapter is None else model.using_adapter(adapter):
            return model.velocity(x_t, sigma, cond, self.guidance)

    def _optimise(self, x0, sigmas, cond, advantages, per_reward, keep, draws) -> dict[str, float]:
        """The objective at each sample's K times plus β·KL, the mean over the kept items of an optimizer step's
        minibatches. With per-reward gradients (MARBLE; per_reward [K, N]) each reward's policy term is
        backpropagated on its own and the KL outside them."""
        parts, grads = self.parts, self.parts.reward_grads
        t, acc, n = parts.cfg.train, parts.accelerator, parts.local_n
        gen = seed_formulas.step_generator(parts.cfg.seed, parts.step)
        steps, epoch, args = kit.OptimizerSteps(parts), None, (t.objective, t.use_ratio)
        for mb in steps([torch.randperm(n, generator=gen) for _ in range(t.num_inner_epochs)], per_reward):
            if mb.epoch != epoch:
                epoch, (times, noises) = mb.epoch, self._draw(draws, sigmas, tuple(x0.shape[1:]))
            index, rows, k = mb.index, mb.rows, times.shape[1]
            keep_b, per_reward_b, x0_b = keep[index].float(), per_reward[:, index], x0[index]  # [b], [K, b], [b, ...]
            adv_b = t.advantage_scale * grads.advantages(advantages[index], per_reward_b)  # [b]; MARBLE: Σ_k ᾱ_k A_k
            norm = kept_per_process(acc, keep_b.sum()) * t.gradient_accumulation_steps * k  # kept items of the window
            sub_cond = select_cond(cond, index)
            for j in range(k):
                sigma, noise = sigmas[times[rows, j].to(acc.device)], noises[rows, j].to(acc.device)  # [b], [b, ...]
                x_t = sde.forward_noise(x0_b, noise, sigma)
                v = self._velocity(x_t, sigma, sub_cond)
                log_p = elbo_log_likelihood(v, x_t, x0_b, noise, sigma, t.elbo_weighting)  # [b] float64
                needs_old = t.use_ratio or t.objective != "epg"
                v_old = self._velocity(x_t, sigma, sub_cond, OLD) if needs_old else None
                old = elbo_log_likelihood(v_old, x_t, x0_b, noise, sigma, t.elbo_weighting) if needs_old else log_p
                policy, s = elbo_policy_loss(log_p, old, adv_b, *args)  # [b] float64
                kl = velocity_kl(v, self._velocity(x_t, sigma, sub_cond, None)) if t.kl_coef > 0 else None  # [b]
                outside = (t.kl_coef * kl * keep_b).sum() / norm if kl is not None else None

                def policy_of(a, log_p=log_p, old=old):
                    loss_a = elbo_policy_loss(log_p, old, t.advantage_scale * a, *args)[0]
                    return (loss_a.float() * keep_b).sum() / norm

                per_item = policy.float() + (t.kl_coef * kl if kl is not None else 0.0)  # [b]
                loss, boundary = (per_item * keep_b).sum() / norm, j == k - 1 and mb.closes_step
                grads.backward_step(loss, policy_of, per_reward_b, outside, boundary)
                steps.losses.append(per_item.detach().mean())
                steps.record({"policy_loss": policy, "kl": kl, "log_likelihood": log_p, **s})
        return steps.metrics()
