"""Direct Group Preference Optimization (DGPO): a group-level DPO on the policy's own clean samples, with no SDE and no
log-probs, as one recipe over the shared components. The math, its source and the choices made where the source is
silent: docs/recipes/dgpo.md.

    flowrl train configs/toy/dgpo.yaml
    accelerate launch scripts/train.py --config configs/sd3/dgpo_pickscore.yaml

From any sampler's clean endpoints x0 and time grid (ODE or DPM-style rollouts). Two LoRA adapters, both starting at
the reference: "default" (θ, trained) and "ema_ref" (a fast EMA of θ: the PPO-style clip's ℓ_old, optionally the
reference, optionally the sampling policy). Stage 6 is DGPO's, the rest the kit's:

    # 6. Optimise   per inner epoch M grid times shared by every sample and process; minibatches of whole groups; per
    #               minibatch and time one ε per group, x_t = (1 − t)·x0 + t·ε, ℓ = mean((v − (ε − x0))²) of θ, the
    #               reference and ema_ref; S_g = Σ_{i∈g} A_i·β·sg(ℓ_θ − ℓ_ref)_i / G summed over every process, the loss
    #               mean(sg(σ(S_g))·A·ℓ̃) + β_KL·mean((v_θ − v_base)²), ℓ̃ = sg(ℓ_θ) where the clip binds; after each
    #               optimizer step θ_ema_ref ← d·θ_ema_ref + (1 − d)·θ, d = min(0.3, 0.001·optimizer steps)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flowrl.trainers.kit as kit
from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.losses import dgpo_loss, dsm_loss, velocity_kl
from flowrl.schedules import dgpo_times, trainable_steps
from flowrl.training.clock import timed
from flowrl.training.distributed import kept_per_process, make_accelerator
from flowrl.training.loop import RecipeConfig
from flowrl.types import select_cond

EMA_REF = "ema_ref"  # the fast EMA of θ; the trained adapter is "default"


@dataclass
class DGPOConfig(RecipeConfig):
    beta_dpo: float = 100.0
    """β of the DPO implicit reward: the sharpness of σ(S_g) only, not the gradient's scale (DGPO: 100; PickScore 10;
    2000 with the EMA reference)."""
    kl_coef: float = 0.02
    """β_KL of mean((v_θ − v_base)²), v_base the frozen base's at ref_guidance_scale (as DGPO's code); 0: none."""
    use_clip: bool = True
    clip_range: float = 1e-2
    """c of the PPO-style clip on ρ = exp(ℓ_ema_ref − ℓ_θ) (DGPO `clip_dsm`); with use_clip false no ema_ref forward
    unless it is the reference."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to ±adv_clip_max before the loss."""
    num_train_timesteps: int = 4
    """M distinct grid times per inner epoch, drawn from the indices 0..max_timestep_index the model trains (fewer
    where fewer exist), shared by every sample and process."""
    max_timestep_index: int = 6
    """The last grid index a training time may take (DGPO `trunc_steps`: 6 of T = 10, σ ≥ 0.666; GenEval 4)."""
    use_ema_ref: bool = False
    """ℓ_ref from ema_ref, not the frozen base (DGPO `use_ema_ref`, "TDM-R1 style"); the KL stays on the base."""
    ref_guidance_scale: float | None = None
    """Guidance of the frozen reference's velocity (DGPO `kl_cfg`; 4.5 with CFG-free rollouts); None: the policy's."""
    ema_ref_decay: float = 0.3
    ema_ref_decay_ramp: float = 0.001
    """After each optimizer step θ_ema_ref ← d·θ_ema_ref + (1 − d)·θ, d = min(ema_ref_decay, ramp · optimizer steps)."""
    sample_ema_ref_after: int = 0
    """Roll out with ema_ref once this many optimizer steps are taken (DGPO `switch_ema_ref`: 200); 0: never."""
    ema_decay: float = 0.9  # DGPO evaluates an EMA of θ (0.9 every 8 optimizer steps)
    ema_every_n_steps: int = 8


def group_order(group_ids: torch.Tensor, num_groups: int, generator: torch.Generator) -> torch.Tensor:
    """The local rows [N] ordered by a permutation of the step's `num_groups` global groups (the same on every
    process), each group's rows in place: minibatches that are equal slices of it hold whole groups."""
    rank = torch.empty(num_groups, dtype=torch.long)
    rank[torch.randperm(num_groups, generator=generator)] = torch.arange(num_groups)
    return torch.sort(rank[group_ids.cpu()], stable=True).indices


def group_noise(seed: int, step: int, epoch: int, j: int, group_id: int, shape) -> torch.Tensor:
    """The ε every sample of group `group_id` shares at time j of inner epoch `epoch` of step `step` (any process)."""
    return torch.randn(shape, generator=seed_formulas.dgpo_noise_generator(seed, step, epoch, j, group_id))


class DGPOTrainer:
    config_class = DGPOConfig
    name = "dgpo"
    adapter_copies = 1  # EMA_REF, the fast EMA of θ
    full_reference_copy = False
    cfg_doubles_train_rows = False  # the policy trains CFG-free (a CFG reference runs without grad)
    trains_on = "endpoints"  # grid times up to max_timestep_index, checked at the step

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        if "clean_endpoints" not in kit.rollout_carries(sampler):
            return (
                f"trainer: dgpo trains on clean endpoints, which the rollouts of sampler {sampler.name} lack: use ode"
            )
        if "reward_gradients" in kit.balancer_needs(balancer):
            return (
                f"balancer {balancer.name} balances per-reward gradients, which dgpo does not take (its group weight "
                "σ(S_g) is not affine in the advantage): use balancer gdpo or weighted_sum with dgpo"
            )
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        t = cfg.train
        positive = {k: getattr(t, k) for k in ("beta_dpo", "clip_range", "adv_clip_max", "num_train_timesteps")}
        if min(positive.values()) <= 0:
            raise ValueError(f"train.{', '.join(f'{k}={v}' for k, v in positive.items())} must all be > 0")
        nonnegative = ("kl_coef", "max_timestep_index", "sample_ema_ref_after", "ema_ref_decay_ramp")
        if min(getattr(t, k) for k in nonnegative) < 0 or not 0 <= t.ema_ref_decay <= 1:
            listed = ", ".join(f"{k}={getattr(t, k)}" for k in nonnegative)
            raise ValueError(f"train.{listed} must all be >= 0 and ema_ref_decay={t.ema_ref_decay} in [0, 1]")
        if not cfg.model.use_lora:
            raise ValueError("trainer: dgpo needs model.use_lora=true (the reference and ema_ref are adapters)")
        if why := self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards):
            raise ValueError(why)
        self.parts = parts = kit.build_parts(cfg, accelerator or make_accelerator(cfg), type(self), adapters=(EMA_REF,))
        n, g, m = parts.local_n, cfg.data.group_size, t.num_minibatches
        if m > 1 and (n % g or (n // g) % m):
            raise ValueError(
                f"train.num_minibatches={m} splits prompt groups ({n} samples a process, group_size={g}): dgpo's group "
                "score needs whole groups in a minibatch; set it to 1 or a divisor of the groups each process holds"
            )
        self.base_used = (
            not t.use_ema_ref or t.kl_coef > 0
        )  # the frozen base: the DGPO reference, the KL anchor or both
        self.guidance = kit.policy_guidance(parts)  # the policy trains CFG-free
        self.ref_guidance = self.guidance if t.ref_guidance_scale is None else t.ref_guidance_scale
        if parts.model.uses_cfg(self.ref_guidance) and getattr(parts.model, "conditioning", None) is not None:
            raise ValueError(
                f"train.ref_guidance_scale={t.ref_guidance_scale}: a CFG reference needs a text-only model"
            )

    def train_step(self) -> dict[str, float]:
        parts, t = self.parts, self.parts.cfg.train
        behind = t.sample_ema_ref_after and parts.opt.optimizer_steps >= t.sample_ema_ref_after
        exp, device = kit.collect(parts, adapter=EMA_REF if behind else None), parts.accelerator.device  # 1-5
        x0 = exp.rollout.final_latents().to(device)  # [N, *latent_shape]: the clean endpoints
        sigmas, cond = exp.rollout.sigmas.to(device), exp.rollout.cond  # [T+1]; rows [N]
        exp.rollout = None  # the endpoints are all DGPO keeps
        ref_cond = cond
        if self.base_used and parts.model.uses_cfg(self.ref_guidance) and not parts.model.uses_cfg(self.guidance):
            with torch.no_grad():  # CFG-free rollouts, a CFG reference: the negative prompt's embeddings too
                ref_cond = parts.model.encode(exp.batch.prompts, guidance_scale=self.ref_guidance)

        # 6. Optimise (ema_ref follows every optimizer step)
        tic = timed(device)
        adv = exp.advantages.clamp(-t.adv_clip_max, t.adv_clip_max)
        metrics = exp.metrics | self._optimise(x0, sigmas, cond, ref_cond, adv, exp.batch.group_ids, exp.keep)
        return kit.finish_step(parts, exp, metrics, tic.seconds())  # 7. Log

    def _follow(self) -> float:
        """θ_ema_ref ← d·θ_ema_ref + (1 − d)·θ after an optimizer step; returns d."""
        t = self.parts.cfg.train
        decay = min(t.ema_ref_decay, t.ema_ref_decay_ramp * self.parts.opt.optimizer_steps)
        self.parts.model.soft_update_adapter(EMA_REF, "default", decay)
        return decay

    def _velocity(self, x_t, sigma, cond, adapter: str | None, guidance: float) -> torch.Tensor:
        """v without gradient, with adapter `adapter` (None: adapters off, the frozen reference)."""
        model = self.parts.model
        with torch.no_grad(), model.adapter_disabled() if adapter is None else model.using_adapter(adapter):
            return model.velocity(x_t, sigma, cond, guidance)

    def _optimise(self, x0, sigmas, cond, ref_cond, advantages, group_ids, keep) -> dict[str, float]:
        parts, t = self.parts, self.parts.cfg.train
        acc, model, shape = parts.accelerator, parts.model, tuple(x0.shape[1:])
        gen, g = seed_formulas.step_generator(parts.cfg.seed, parts.step), parts.cfg.data.group_size
        trainable, epochs = trainable_steps(model, sigmas), t.num_inner_epochs
        times = dgpo_times(gen, sigmas, t.max_timestep_index, t.num_train_timesteps, epochs, trainable)  # [k] each
        k = len(times[0])
        b = parts.cfg.data.num_prompts_per_step  # the step's groups: ids 0..B − 1 on every process
        orders = [group_order(group_ids, b, gen) for _ in range(t.num_inner_epochs)]
        gather, use_old = acc.gather if acc.num_processes > 1 else None, t.use_clip or t.use_ema_ref
        steps, taken, decay = kit.OptimizerSteps(parts), parts.opt.optimizer_steps, 0.0
        for mb in steps(orders):
            if parts.opt.optimizer_steps != taken:
                taken, decay = parts.opt.optimizer_steps, self._follow()
            index, keep_b, ids = mb.index, keep[mb.index].float(), group_ids[mb.rows]  # [b] each
            adv_b, sub_cond, sub_ref = (
                advantages[index] * keep_b,
                select_cond(cond, index),
                select_cond(ref_cond, index),
            )
            norm = kept_per_process(acc, keep_b.sum()) * t.gradient_accumulation_steps * k
            for j, time in enumerate(times[mb.epoch].tolist()):
                noises = {
                    gid: group_noise(parts.cfg.seed, parts.step, mb.epoch, j, gid, shape)
                    for gid in ids.unique().tolist()
                }
                noise = torch.stack([noises[gid] for gid in ids.tolist()]).to(x0.device)  # [b, ...]: one ε per group
                sigma = sigmas[time].expand(len(index))  # [b]
                x_t = sde.forward_noise(x0[index], noise, sigma)
                v = model.velocity(x_t, sigma, sub_cond, self.guidance)
                v_old = self._velocity(x_t, sigma, sub_cond, EMA_REF, self.guidance) if use_old else None
                v_base = self._velocity(x_t, sigma, sub_ref, None, self.ref_guidance) if self.base_used else None
                v_ref = v_old if t.use_ema_ref else v_base  # the DGPO term's reference
                ell, ell_ref = dsm_loss(v, x0[index], noise), dsm_loss(v_ref, x0[index], noise)
                ell_old = dsm_loss(v_old, x0[index], noise) if t.use_clip else None
                args = (adv_b, ids, t.beta_dpo, g, t.clip_range, gather)
                per_sample, s = dgpo_loss(ell, ell_ref, ell_old, *args)  # [b] float64
                kl = velocity_kl(v, v_base) if t.kl_coef > 0 else None  # [b]: always to the frozen base
                per_item = per_sample.float() + (t.kl_coef * kl if kl is not None else 0.0)
                parts.opt.backward((per_item * keep_b).sum() / norm, boundary=j == k - 1 and mb.closes_step)
                steps.losses.append(per_item.detach().mean())
                steps.record({"dsm_loss": ell, "dsm_ref_loss": ell_ref, "kl": kl, "ratio": s["ratio"]})
                steps.record({"group_score": s["group_score"], "group_weight": s["group_weight"]})
                steps.record({"clip_fraction": s["clipped"]})
        if parts.opt.optimizer_steps != taken:
            decay = self._follow()
        return steps.metrics() | {"train/ema_ref_decay": decay}
