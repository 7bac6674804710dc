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

from dataclasses import dataclass

import torch

from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.losses import ADV_MODES, nft_loss, velocity_kl
from flowrl.models import build_policy
from flowrl.registry import BALANCERS, SAMPLERS
from flowrl.samplers.candidates import candidate_metrics
from flowrl.sigma_range import check_trainable, trainable_steps
from flowrl.trainers.kit import balancer_needs, rollout_carries
from flowrl.training.checkpoint import resume_recipe, save_recipe
from flowrl.training.distributed import Sharding, kept_per_process, make_accelerator
from flowrl.training.evaluation import TrainingEvaluation
from flowrl.training.loop import step_metrics, timed, train_loop
from flowrl.training.optim import EMA, OptimizerConfig, OptimizerStep
from flowrl.training.prompts import step_batches
from flowrl.training.reward_gradients import RewardGradients
from flowrl.training.runs import RunFolder
from flowrl.training.scoring import Scorer, balance_per_reward, build_rewards, rollout_and_score
from flowrl.types import select_cond

OLD = "old"  # the sampling policy's adapter name; the trained one is "default"
DECAY_TYPES = (0, 1, 2)


@dataclass
class NFTConfig(OptimizerConfig):
    nft_beta: float = 1.0
    """β of the implicit policies v± (DiffusionNFT `config.beta`: 1.0 single reward, 0.1 OCR and multi-reward)."""
    kl_coef: float = 1e-4
    """Coefficient of mean((v_θ − v_ref)²), the reference being the adapters switched off (DiffusionNFT `train.beta`)."""
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
    num_inner_epochs: int = 1
    num_minibatches: int = 1
    """The step's local samples are split into this many minibatches."""
    gradient_accumulation_steps: int = 1
    """Minibatches per optimizer step (must divide num_minibatches); every training time of a minibatch accumulates."""
    num_rollout_batches: int = 1
    """Rollouts are generated in this many chunks; rewards of one chunk are scored while the next is sampled."""
    use_async_rewards: bool = True
    ema_every_n_steps: int = 1
    """DiffusionNFT evaluates an EMA of θ updated after every optimizer step (decay 0.9)."""
    log_reward_gradients: bool = False
    """Also take every reward's own gradient each optimizer step (K extra backward passes) to log its cosine with the
    update (`marble/cos/<reward>`, `marble/opposed`); MARBLE (balancer: marble) has them on its full steps anyway."""


def old_policy_decay(decay_type: int, optimizer_steps: int, cap: float | None = None) -> float:
    """η of the soft update θ_old ← η·θ_old + (1 − η)·θ after `optimizer_steps` optimizer steps (docs/math.md#diffusionnft)."""
    i = optimizer_steps
    if decay_type == 0:
        return 0.0
    if decay_type == 1:
        return min(0.001 * i, 0.5 if cap is None else cap)
    if decay_type == 2:
        return 0.0 if i < 75 else min(0.0075 * (i - 75), 0.999 if cap is None else cap)
    raise ValueError(f"train.decay_type={decay_type} must be one of {DECAY_TYPES}")


def training_times(
    generators: list[torch.Generator], grid: torch.Tensor, fraction: float, trainable: torch.Tensor | None = None
) -> torch.Tensor:
    """Per sample (one generator each), the grid indices trained on: the first int(T·fraction) of a random
    permutation of the T grid times (sigmas[:-1], every time with σ > 0); with `trainable` [T] bool (the times the
    model trains, flowrl.sigma_range), of those times only. Returns [N, K] int64."""
    num_times = len(grid) - 1
    candidates = torch.arange(num_times) if trainable is None else trainable.cpu().nonzero().flatten()  # [T']
    if len(candidates) == 0:
        raise ValueError(
            f"sampler.num_steps={num_times}: no time of the rollout's grid is one the model trains (model.train_expert's "
            "σ range); add steps or train the other expert"
        )
    k = int(len(candidates) * fraction + 1e-6)
    if k < 1:
        raise ValueError(f"train.timestep_fraction={fraction} of {len(candidates)} trainable grid times trains no time; raise it")
    return torch.stack([candidates[torch.randperm(len(candidates), generator=g)[:k]] for g in generators])


class NFTTrainer:
    config_class = NFTConfig

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        t = train if train is not None else cls.config_class()
        if "clean_endpoints" not in rollout_carries(sampler):
            return f"trainer: nft trains on clean endpoints, which the rollouts of sampler {sampler.name} lack: use sampler ode"
        if "affine_loss" in balancer_needs(balancer) and t.adv_mode != "all":
            return f"balancer {balancer.name} form=amortized needs train.adv_mode='all' (r affine in A), not {t.adv_mode!r}"
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        from accelerate.utils import set_seed

        self.cfg, t = cfg, cfg.train
        if t.adv_mode not in ADV_MODES:
            raise ValueError(f"train.adv_mode={t.adv_mode!r} must be one of {', '.join(ADV_MODES)}")
        old_policy_decay(t.decay_type, 0)  # validates decay_type
        if t.nft_beta <= 0 or t.adv_clip_max <= 0:
            raise ValueError(f"train.nft_beta={t.nft_beta} and train.adv_clip_max={t.adv_clip_max} must be > 0")
        if not cfg.model.use_lora:
            raise ValueError("trainer: nft needs model.use_lora=true (the sampling policy and the reference are adapters)")
        why = self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards)
        if why:
            raise ValueError(why)
        self.accelerator = acc = accelerator or make_accelerator(cfg)
        self.run = RunFolder(cfg.output_dir, cfg.name)
        self.sampler = SAMPLERS.get(cfg.sampler.name)(**cfg.sampler.kwargs)
        self.prompt_sampler, self.local_n = step_batches(cfg, self.sampler, acc.num_processes)
        set_seed(cfg.seed)  # every process starts from the same adapter
        self.model = build_policy(cfg.model, acc.device, sharded=Sharding(acc).kind == "fsdp")  # FSDP2: loaded for sharding
        check_trainable("nft", self.sampler, self.model)  # a grid with no time on the trained expert trains nothing
        self.model.copy_adapter("default", OLD)  # θ_old = θ (= the reference while LoRA B = 0)
        self.opt = OptimizerStep(acc, self.model.transformer, t, self.local_n // t.num_minibatches, cfg.model.mixed_precision)
        self.old_params = self.model.adapter_parameters(OLD)  # after sharding: the live (possibly sharded) tensors
        self.ema = EMA(self.opt.names, self.opt.params, t.ema_decay, t.ema_every_n_steps, t.ema_mode) if t.use_ema else None
        guidance = getattr(self.sampler, "guidance_scale", None)
        self.guidance = self.model.default_guidance_scale if guidance is None else guidance
        if self.model.uses_cfg(self.guidance):
            raise ValueError(
                f"trainer: nft collects data CFG-free and trains the conditional velocity: sampler.guidance_scale="
                f"{self.guidance} is classifier-free guidance for {self.model.family}; set it to 1.0"
            )
        self.rewards = build_rewards(cfg.rewards, acc.device)
        self.weights = {r.name: r.weight for r in cfg.rewards}
        self.scorer = Scorer(self.rewards, cfg.on_reward_error, t.use_async_rewards)
        self.balancer = BALANCERS.get(cfg.balancer.name)(**cfg.balancer.kwargs)
        marble = self.balancer if cfg.balancer.name == "marble" else None
        args = (marble, self.opt, acc, list(self.rewards), True, t.adv_clip_max, t.log_reward_gradients)
        self.reward_grads = RewardGradients(*args)  # per-reward gradients: MARBLE's balancing, or the probe
        self.evaluation = TrainingEvaluation(cfg, acc, self.run, self.model, self.rewards, self.opt, self.ema)
        self.step = 0
        self.counters = {"reward_errors": 0}

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        t, acc, model = self.cfg.train, self.accelerator, self.model
        started = timed(acc.device)

        # 1. Prompts
        batch = self.prompt_sampler.local_batch(self.step, acc.process_index, acc.num_processes)

        # 2. Rollout with the sampling policy θ_old and 3. Score (overlapping the next chunk in a worker thread)
        with model.using_adapter(OLD):
            rollout, local, rollout_s = rollout_and_score(
                self.sampler, model, batch, self.scorer, t.num_rollout_batches, self.step, self.weights
            )
        sampler_metrics = candidate_metrics(rollout)
        x0 = rollout.final_latents().to(acc.device)  # [N, *latent_shape]: the clean endpoints, all NFT keeps
        sigmas, cond = rollout.sigmas.to(acc.device), rollout.cond  # [T+1]; rows [N]
        del rollout

        # 4. Gather and 5. Balance: advantages [N] (and per reward [K, N]) of this process's samples, failed kept out
        advantages, per_reward, keep, metrics, errors = balance_per_reward(acc, local, batch, self.balancer, self.weights)
        self.counters["reward_errors"] += errors
        metrics.update(sampler_metrics)

        # 6. Optimise, then the soft update of the sampling policy
        tic = timed(acc.device)
        draws = seed_formulas.sample_generators(batch.seeds, "cpu", seed_formulas.TRAIN_STREAM)  # a sample's t and ε
        adv = advantages.to(acc.device), per_reward.to(acc.device)
        metrics.update(self._optimise(x0, sigmas, cond, adv, keep.to(acc.device), draws))
        decay = old_policy_decay(t.decay_type, self.opt.optimizer_steps, t.old_decay_max)
        model.soft_update_adapter(OLD, "default", decay)
        optimise_s = tic.seconds()

        # 7. Log
        wall = started.seconds()
        samples = self.local_n * acc.num_processes
        metrics.update(step_metrics(wall, rollout_s, local.seconds, optimise_s, samples, errors, keep.sum()))
        metrics["train/old_decay"] = decay
        self.step += 1
        return metrics

    def _optimise(self, x0, sigmas, cond, adv, keep, draws: list[torch.Generator]) -> dict[str, float]:
        """The NFT loss at each sample's training times; the mean over the minibatch's kept samples, accumulated
        over its times and `gradient_accumulation_steps` minibatches per optimizer step. A sample's training times
        and noises come from its own generator (`draws`), so they do not depend on the batch or process count.
        `adv` = (advantages [N], per-reward advantages [K, N]); with per-reward gradients (MARBLE, the probe) each
        reward's policy loss is backpropagated on its own and the KL outside them (flowrl.training.reward_gradients.RewardGradients)."""
        t, acc, model, grads = self.cfg.train, self.accelerator, self.model, self.reward_grads
        advantages, per_reward = adv
        n = self.local_n
        gen = seed_formulas.step_generator(self.cfg.seed, self.step)
        mb, accum = n // t.num_minibatches, t.gradient_accumulation_steps
        stats: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("loss", "policy_loss", "kl", "r", "positive_loss", "negative_loss")
        }
        for _ in range(t.num_inner_epochs):
            order = torch.randperm(n, generator=gen)
            times = training_times(draws, sigmas, t.timestep_fraction, trainable_steps(model, sigmas))  # [N, K] grid indices
            for m in range(t.num_minibatches):
                if m % accum == 0:
                    window = len(stats["loss"])  # this optimizer step's losses start here
                    grads.plan(per_reward[:, order[m * mb : (m + accum) * mb].to(acc.device)])
                rows = order[m * mb : (m + 1) * mb]
                index = rows.to(acc.device)  # [b]
                x0_b, keep_b, per_reward_b = x0[index], keep[index].float(), per_reward[:, index]  # [b, ...], [b], [K, b]
                adv_b = grads.advantages(advantages[index], per_reward_b)  # [b]; MARBLE: Σ_k ᾱ_k A_k
                kept = kept_per_process(acc, keep_b.sum())  # mean over every process's kept samples,
                per_backward = accum * times.shape[1]  # over times and accumulated minibatches
                sub_cond = select_cond(cond, index)
                for j in range(times.shape[1]):
                    sigma = sigmas[times[rows, j].to(acc.device)]  # [b]
                    noise = torch.stack([torch.randn(x0.shape[1:], generator=draws[i]) for i in rows.tolist()])
                    x_t = sde.forward_noise(x0_b, noise.to(acc.device), sigma)  # one fresh ε per (sample, t)
                    v_theta = model.velocity(x_t, sigma, sub_cond, self.guidance)
                    with torch.no_grad():
                        with model.using_adapter(OLD):
                            v_old = model.velocity(x_t, sigma, sub_cond, self.guidance)
                        v_ref = None
                        if t.kl_coef > 0:
                            with model.adapter_disabled():
                                v_ref = model.velocity(x_t, sigma, sub_cond, self.guidance)
                    args = (t.adv_clip_max, t.nft_beta, t.kl_coef, t.adv_mode)
                    per_sample, s = nft_loss(v_theta, v_old, v_ref, x0_b, x_t, sigma, adv_b, *args)
                    boundary = j == times.shape[1] - 1 and (m + 1) % accum == 0
                    if grads.mode != "single":  # each reward's policy loss on its own, the KL outside them

                        def policy(a, v_theta=v_theta, v_old=v_old, x0_b=x0_b, x_t=x_t, sigma=sigma):
                            loss, _ = nft_loss(v_theta, v_old, None, x0_b, x_t, sigma, a, *args[:2], 0.0, t.adv_mode)
                            return (loss * keep_b).sum() / kept / per_backward

                        kl = (
                            t.kl_coef * (velocity_kl(v_theta, v_ref) * keep_b).sum() / kept / per_backward
                            if v_ref is not None
                            else None
                        )
                        grads.backward(policy, per_reward_b, kl, boundary)
                    if grads.single:
                        self.opt.backward((per_sample * keep_b).sum() / kept / per_backward, boundary=boundary)
                    stats["loss"].append(per_sample.detach().mean())
                    for key in ("policy_loss", "kl", "r", "positive_loss", "negative_loss"):
                        stats[key].append(s[key].mean())
                if (m + 1) % accum == 0:
                    grads.finish()  # MARBLE: the per-reward gradients combined into .grad
                    if self.opt.step(torch.stack(stats["loss"][window:])) and self.ema is not None:
                        self.ema.update(self.opt.params, self.opt.optimizer_steps)
        out = {f"train/{k}": float(torch.stack(v).mean()) for k, v in stats.items()} | self.opt.metrics()
        return out | grads.metrics()

    # ------------------------------------------------------------------------------------------ state
    def save(self):
        return save_recipe(
            self, groups={"adapter_old": self.old_params}, extra={"reward_gradients": self.reward_grads.state_dict()}
        )

    def resume(self, path) -> None:
        state = resume_recipe(self, path, groups={"adapter_old": self.old_params})
        if "reward_gradients" in state:  # MARBLE's ᾱ and refresh clock
            self.reward_grads.load_state_dict(state["reward_gradients"])

    def evaluate(self, step: int | None) -> dict | None:
        """The fixed evaluation of θ (its EMA once an EMA update happened); None = the base model."""
        return self.evaluation(step)

    def train(self) -> dict:
        """Run to cfg.num_steps: resume, base eval, steps with logging/eval/checkpoints, final eval."""
        return train_loop(self, "nft")
