"""DiffusionNFT: online RL on the forward process, as one recipe over the shared components. The math is in
docs/math.md#diffusionnft, the recipe and its published settings in docs/recipes/nft.md.

    flowrl train configs/toy/nft.yaml
    accelerate launch scripts/train.py --config configs/sd3/nft_pickscore.yaml

No log-probs, any sampler (ODE by default, CFG 1), only the clean endpoints x0 and the time grid are kept. Two
LoRA adapters on one transformer, both starting at the reference (LoRA B = 0): "default" (θ, trained) and "old"
(θ_old, the sampling policy, soft-updated toward θ after every step). One training step:

    # 1. Prompts    the step's B prompts, G seeds each; this process's slice of the B*G samples
    # 2. Rollout    the sampler with the "old" adapter -> x0 [N, ...] and the sampler's time grid
    # 3. Score      every reward on the decoded images (a worker thread overlaps the next chunk)
    # 4. Gather     scores of all processes -> [B*G] per reward
    # 5. Balance    advantages per sample (balancer); failed samples dropped
    # 6. Optimise   per inner epoch, minibatch, training time: x_t = (1 − t)·x0 + t·ε with a fresh ε, the
    #               velocities of θ (grad), θ_old and the reference, the NFT loss; the optimizer step; EMA.
    #               (A distilled guidance embedding, FLUX.1-dev's, is used at the sampler's scale throughout.)
    #               Then the soft update θ_old ← η·θ_old + (1 − η)·θ
    # 7. Log/Eval   metrics.jsonl + trackers, eval every n steps, checkpoint every n steps

Only stage 6 (and sampling with θ_old) is NFT's own; everything else is a component call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

import flowrl.trainers.kit as kit
from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.losses import ADV_MODES, nft_loss, velocity_kl
from flowrl.schedules import nft_times, trainable_steps
from flowrl.trainers.async_rollout import ROLLOUT, RolloutAhead, check_async
from flowrl.trainers.replay import GROUP, ReplayBuffer, ReplayConfig, check_replay
from flowrl.trainers.replay_nft import nft_replay
from flowrl.training.clock import timed
from flowrl.training.distributed import kept_per_process, make_accelerator
from flowrl.training.loop import RecipeConfig, RecipeParts
from flowrl.types import select_cond

OLD = "old"  # the sampling policy's adapter name; the trained one is "default"
DECAY_TYPES = (0, 1, 2)


@dataclass
class NFTConfig(RecipeConfig):
    nft_beta: float = 1.0
    """β of the implicit policies v± (DiffusionNFT `config.beta`: 1.0 single reward, 0.1 OCR and multi-reward)."""
    kl_coef: float = 1e-4
    """Coefficient of mean((v_θ − v_ref)²), the reference being the adapters switched off (DiffusionNFT
    `train.beta`)."""
    adv_clip_max: float = 5.0
    """A_max: advantages are clipped to ±A_max and mapped to r = A / (2·A_max) + 1/2."""
    adv_mode: str = "all"
    """'all', 'positive_only', 'negative_only', 'one_only' (1[A > 0]) or 'binary' (sign A), applied before the map."""
    timestep_fraction: float = 0.99
    """Train on int(T·fraction) of the sampler's T grid times per sample (a random permutation per sample)."""
    decay_type: int = 1
    """Soft update of θ_old after each step, η_i at optimizer step i: 0 → η = 0 (copy); 1 → min(0.001·i, 0.5);
    2 → 0 for i < 75, then min(0.0075·(i − 75), 0.999)."""
    old_decay_max: float | None = None
    """Cap η at this value instead of the decay type's own cap (DiffusionNFT's multi-reward OCR stage: 0.95)."""
    ema_every_n_steps: int = 1
    """DiffusionNFT evaluates an EMA of θ updated after every optimizer step (decay 0.9)."""
    log_reward_gradients: bool = False
    """Also take every reward's own gradient each optimizer step (K extra backward passes) to log its cosine with the
    update (`marble/cos/<reward>`, `marble/opposed`); MARBLE (balancer: marble) has them on its full steps anyway."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """Replay of past endpoints with truncated importance weights of the sampling policy (keys train.replay.*; off by
    default; flowrl/trainers/replay.py)."""
    async_rollout: bool = False
    """Roll out step k + 1 in a worker thread while step k trains, one step stale as Miles-Diffusion
    (flowrl/trainers/async_rollout.py); `train/staleness` is logged."""
    async_staleness: int = 1
    """1: the batch of step k is sampled by θ_old as it stood at the start of step k − 1; 0: by the current θ_old (the
    synchronous recipe through the asynchronous code)."""


def old_policy_decay(decay_type: int, optimizer_steps: int, cap: float | None = None) -> float:
    """η of the soft update θ_old ← η·θ_old + (1 − η)·θ after `optimizer_steps` optimizer steps
    (docs/math.md#diffusionnft)."""
    i = optimizer_steps
    if decay_type == 0:
        return 0.0
    if decay_type == 1:
        return min(0.001 * i, 0.5 if cap is None else cap)
    if decay_type == 2:
        return 0.0 if i < 75 else min(0.0075 * (i - 75), 0.999 if cap is None else cap)
    raise ValueError(f"train.decay_type={decay_type} must be one of {DECAY_TYPES}")


def nft_parts(cfg: RunConfig, accelerator, recipe: type, teachers: tuple[str, ...] = ()) -> tuple[RecipeParts, float]:
    """(parts, guidance) of a run that trains DiffusionNFT's loss, after NFT's config checks and
    `recipe.composition_error`: θ_old = θ (= the reference while LoRA B = 0), a second adapter on the same transformer
    (saved with the run); `teachers`: more adapters the recipe fills itself (not saved); MARBLE's balancing or the
    probe where asked; the guidance the data is collected and trained at (CFG refused)."""
    t = cfg.train
    if t.adv_mode not in ADV_MODES:
        raise ValueError(f"train.adv_mode={t.adv_mode!r} must be one of {', '.join(ADV_MODES)}")
    old_policy_decay(t.decay_type, 0)  # validates decay_type
    if t.nft_beta <= 0 or t.adv_clip_max <= 0:
        raise ValueError(f"train.nft_beta={t.nft_beta} and train.adv_clip_max={t.adv_clip_max} must be > 0")
    if not cfg.model.use_lora:
        raise ValueError(
            f"trainer: {recipe.name} needs model.use_lora=true (the sampling policy and the reference are adapters)"
        )
    if why := recipe.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards):
        raise ValueError(why)
    if t.async_rollout and recipe.name != "nft":
        raise ValueError(f"train.async_rollout: trainer {recipe.name} rolls out synchronously; use trainer nft")
    acc = accelerator or make_accelerator(cfg)
    adapters = (OLD, ROLLOUT) if t.async_rollout else (OLD,)  # ROLLOUT: what the prefetched batch is sampled with
    parts = kit.build_parts(cfg, acc, recipe, adapters=adapters, frozen_adapters=teachers)
    check_async(parts)
    guidance = kit.refuse_cfg(recipe, parts, "collects data CFG-free and trains the conditional velocity")
    kit.reward_gradients(parts, True, t.adv_clip_max, t.log_reward_gradients)  # MARBLE, the probe
    if t.replay.enabled:
        check_replay(parts, recipe)
        parts.kept[GROUP] = ReplayBuffer(t.replay)  # saved and resumed with the run
    return parts, guidance


def nft_step(
    parts: RecipeParts, guidance: float, extra_loss=None, ahead: RolloutAhead | None = None
) -> dict[str, float]:
    """One DiffusionNFT training step (stages 1-7): the rollout with the sampling policy θ_old (`ahead`: made by a
    worker thread during the previous step), the NFT loss on its endpoints (`nft_optimise`, with `extra_loss`), then
    the soft update of θ_old."""
    t = parts.cfg.train
    exp = ahead.next(parts.step) if ahead else kit.collect(parts, adapter=OLD)  # 1-5, sampled by θ_old
    kit.start_drift(parts, exp.rollout)  # the rollout's drift, on the live model (once: kit.collect opened it)
    x0 = exp.rollout.final_latents().to(parts.accelerator.device)  # [N, *latent_shape]: the clean endpoints
    sigmas, cond = exp.rollout.sigmas.to(parts.accelerator.device), exp.rollout.cond  # [T+1]; rows [N]
    exp.rollout = None  # the endpoints are all NFT keeps

    # 6. Optimise, then the soft update of the sampling policy
    tic = timed(parts.accelerator.device)
    draws = seed_formulas.sample_generators(exp.batch.seeds, "cpu", seed_formulas.TRAIN_STREAM)  # a sample's t and ε
    data = {"x0": x0, "sigmas": sigmas, "cond": cond, "advantages": exp.advantages, "per_reward": exp.per_reward}
    data |= {"keep": exp.keep, "draws": draws, "weights": None}
    data, replayed = nft_replay(parts, data, exp.batch.seeds, parts.kept.get(GROUP), guidance, OLD)  # replay: + rows
    inputs = [data[key] for key in ("x0", "sigmas", "cond", "advantages", "per_reward", "keep", "draws")]
    metrics = exp.metrics | replayed | nft_optimise(parts, *inputs, guidance, extra_loss, data["weights"])
    decay = old_policy_decay(t.decay_type, parts.opt.optimizer_steps, t.old_decay_max)
    parts.model.soft_update_adapter(OLD, "default", decay)
    metrics = kit.finish_step(parts, exp, metrics, tic.seconds())  # 7. Log
    metrics["train/old_decay"] = decay
    if ahead:
        ahead.pause()  # the worker's CPU until the next step is billed to it
    return metrics


def nft_optimise(
    parts: RecipeParts, x0, sigmas, cond, advantages, per_reward, keep, draws, guidance, extra_loss=None, weights=None
) -> dict[str, float]:
    """Stage 6 of DiffusionNFT: the NFT loss at each sample's training times; the mean over the minibatch's kept
    samples, accumulated over its times and `gradient_accumulation_steps` minibatches per optimizer step. A sample's
    training times and noises come from its own generator (`draws`), so they do not depend on the batch or process
    count. With per-reward gradients (MARBLE, the probe; per_reward [K, N]) each reward's policy loss is
    backpropagated on its own and the KL outside them (flowrl.training.reward_gradients.RewardGradients).
    `extra_loss(x_t, sigma, cond, v_theta)` -> [b] (e.g. SMOPD's distillation) is added beside it, reduced as it and
    kept outside the per-reward balancing like the KL. `weights` [N] (replay's importance weights; None = 1) multiply
    each sample's terms."""
    grads = parts.reward_grads
    t, acc, model, n = parts.cfg.train, parts.accelerator, parts.model, len(x0)
    gen = seed_formulas.step_generator(parts.cfg.seed, parts.step)
    names = ("policy_loss", "kl", "r", "positive_loss", "negative_loss")
    optimizer_steps, epoch = kit.OptimizerSteps(parts), None
    for mb in optimizer_steps([torch.randperm(n, generator=gen) for _ in range(t.num_inner_epochs)], per_reward):
        if mb.epoch != epoch:  # each epoch's training times, [N, K] grid indices
            trainable = trainable_steps(model, sigmas)
            epoch, times = mb.epoch, nft_times(draws, sigmas, t.timestep_fraction, trainable)
        rows, index = mb.rows, mb.index  # [b]
        x0_b, keep_b, per_reward_b = x0[index], keep[index].float(), per_reward[:, index]  # [b, ...], [b], [K, b]
        adv_b = grads.advantages(advantages[index], per_reward_b)  # [b]; MARBLE: Σ_k ᾱ_k A_k
        kept = kept_per_process(acc, keep_b.sum())  # mean over every process's kept samples,
        keep_b = keep_b if weights is None else keep_b * weights[index]  # replayed rows: their importance weight
        per_backward = t.gradient_accumulation_steps * times.shape[1]  # over times and accumulated minibatches
        sub_cond = select_cond(cond, index)
        for j in range(times.shape[1]):
            sigma = sigmas[times[rows, j].to(acc.device)]  # [b]
            noise = torch.stack([torch.randn(x0.shape[1:], generator=draws[i]) for i in rows.tolist()])
            x_t = sde.forward_noise(x0_b, noise.to(acc.device), sigma)  # one fresh ε per (sample, t)
            v_theta = model.velocity(x_t, sigma, sub_cond, guidance)
            with torch.no_grad():
                with model.using_adapter(OLD):
                    v_old = model.velocity(x_t, sigma, sub_cond, guidance)
                v_ref = None
                if t.kl_coef > 0:
                    with model.adapter_disabled():
                        v_ref = model.velocity(x_t, sigma, sub_cond, guidance)
            args = (t.adv_clip_max, t.nft_beta, t.kl_coef, t.adv_mode)
            per_sample, s = nft_loss(v_theta, v_old, v_ref, x0_b, x_t, sigma, adv_b, *args)

            def policy(a, v_theta=v_theta, v_old=v_old, x0_b=x0_b, x_t=x_t, sigma=sigma):
                loss, _ = nft_loss(v_theta, v_old, None, x0_b, x_t, sigma, a, *args[:2], 0.0, t.adv_mode)
                return (loss * keep_b).sum() / kept / per_backward

            kl = None
            if v_ref is not None:
                kl = t.kl_coef * (velocity_kl(v_theta, v_ref) * keep_b).sum() / kept / per_backward
            loss = (per_sample * keep_b).sum() / kept / per_backward
            if extra_loss is not None:  # [b] beside NFT's loss, outside the per-reward balancing as the KL
                extra = (extra_loss(x_t, sigma, sub_cond, v_theta) * keep_b).sum() / kept / per_backward
                loss, kl = loss + extra, extra if kl is None else kl + extra
            boundary = j == times.shape[1] - 1 and mb.closes_step
            grads.backward_step(loss, policy, per_reward_b, kl, boundary=boundary)
            optimizer_steps.losses.append(per_sample.detach().mean())
            optimizer_steps.record({key: s[key] for key in names}, dtype=None)
    return optimizer_steps.metrics()


class NFTTrainer:
    config_class = NFTConfig
    name = "nft"
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
                f"trainer: nft trains on clean endpoints, which the rollouts of sampler {sampler.name} lack: use "
                "sampler ode"
            )
        if "affine_loss" in kit.balancer_needs(balancer) and t.adv_mode != "all":
            return (
                f"balancer {balancer.name} form=amortized needs train.adv_mode='all' (r affine in A), not "
                f"{t.adv_mode!r}"
            )
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        self.parts, self.guidance = nft_parts(cfg, accelerator, type(self))
        t = cfg.train
        self.ahead = RolloutAhead(self.parts, OLD, t.async_staleness) if t.async_rollout else None

    def train_step(self) -> dict[str, float]:
        return nft_step(self.parts, self.guidance, ahead=self.ahead)
