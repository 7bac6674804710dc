"""Reinforce Adjoint Matching (RAM): reward-weighted flow matching on the model's own clean samples, as one
recipe over the shared components. The math is in docs/math.md#reinforce-adjoint-matching, the recipe and its
published settings in docs/recipes/ram.md.

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

from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.losses import ram_loss, ram_target
from flowrl.models import build_policy
from flowrl.registry import BALANCERS, SAMPLERS
from flowrl.samplers.candidates import candidate_metrics
from flowrl.trainers.kit import balancer_needs, rollout_carries
from flowrl.training.checkpoint import resume_recipe, save_recipe
from flowrl.training.distributed import Sharding, kept_per_process, make_accelerator
from flowrl.training.evaluation import TrainingEvaluation
from flowrl.training.loop import step_metrics, timed, train_loop
from flowrl.training.optim import EMA, OptimizerConfig, OptimizerStep
from flowrl.training.prompts import step_batches
from flowrl.training.runs import RunFolder
from flowrl.training.scoring import Scorer, balance, build_rewards, rollout_and_score
from flowrl.types import select_cond

OLD = "old"  # the rollout policy's adapter name; the trained one is "default"


@dataclass
class RAMConfig(OptimizerConfig):
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
    change within a step); pays off with num_inner_epochs > 1."""
    num_inner_epochs: int = 1
    num_minibatches: int = 1
    """The step's N·K local items are split into this many minibatches (it must divide N)."""
    gradient_accumulation_steps: int = 1
    """Minibatches per optimizer step (must divide num_minibatches)."""
    num_rollout_batches: int = 1
    use_async_rewards: bool = True
    ema_every_n_steps: int = 1
    max_grad_norm: float = 0.0
    """RAM trains without gradient clipping (0 = off)."""


def old_policy_decay(step: int, ramp: float, cap: float) -> float:
    """d of θ_old ← d·θ_old + (1 − d)·θ after training step `step` (0-based): min(ramp·step, cap)."""
    return min(ramp * step, cap)


def training_draws(
    generators: list[torch.Generator], shape: tuple[int, ...], k: int, alpha: float, sigma_range: tuple[float, float] = (0.0, 1.0)
):
    """Per sample (one generator each) its K training times t ~ p(t) ∝ t^α on (lo, hi] (inverse CDF
    (lo^{α+1} + (hi^{α+1} − lo^{α+1})·u)^{1/(α+1)}, u on (0, 1]; [lo, hi] the model's trainable σ range, (0, 1] for
    one-module models) and K noises. Returns times [N, K] float32 and noises [N, K, *shape]."""
    lo, hi = sigma_range
    low, high = lo ** (alpha + 1.0), hi ** (alpha + 1.0)
    times, noises = [], []
    for g in generators:
        u = 1.0 - torch.rand(k, generator=g)  # (0, 1]
        times.append((low + (high - low) * u).pow(1.0 / (alpha + 1.0)).clamp(lo, hi))  # clamp: rounding at the edges
        noises.append(torch.randn((k, *shape), generator=g))
    return torch.stack(times), torch.stack(noises)


class RAMTrainer:
    config_class = RAMConfig

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md). Any rollout with
        clean endpoints feeds RAM's regression: a tree's leaves and candidate pools' regenerated samples too."""
        if "clean_endpoints" not in rollout_carries(sampler):
            return (
                f"trainer: ram regresses on clean endpoints, which the rollouts of sampler {sampler.name} lack: use sampler ode"
            )
        if "reward_gradients" in balancer_needs(balancer):
            return (
                f"balancer {balancer.name} balances per-reward gradients, which trainer ram does not take (one backward on "
                "one advantage per sample): use trainer nft or grpo with it, or balancer gdpo with ram"
            )
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        from accelerate.utils import set_seed

        self.cfg, t = cfg, cfg.train
        if t.num_loss_targets_per_sample < 1:
            raise ValueError(f"train.num_loss_targets_per_sample={t.num_loss_targets_per_sample} must be >= 1 (RAM: 8)")
        if t.time_alpha <= -1:
            raise ValueError(f"train.time_alpha={t.time_alpha} must be > -1 (p(t) ∝ t^α must be integrable; RAM: 1)")
        if not 0 <= t.old_decay < 1 or t.old_decay_ramp < 0:
            raise ValueError(f"train.old_decay={t.old_decay} must be in [0, 1) and train.old_decay_ramp={t.old_decay_ramp} >= 0")
        if not cfg.model.use_lora:
            raise ValueError("trainer: ram needs model.use_lora=true (the old policy and the reference are adapters)")
        why = self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards)
        if why:
            raise ValueError(why)
        self.accelerator = acc = accelerator or make_accelerator(cfg)
        self.run = RunFolder(cfg.output_dir, cfg.name)
        self.sampler = SAMPLERS.get(cfg.sampler.name)(**cfg.sampler.kwargs)
        self.prompt_sampler, self.local_n = step_batches(cfg, self.sampler, acc.num_processes)
        items = self.local_n * t.num_loss_targets_per_sample  # step_batches checked that num_minibatches divides N
        set_seed(cfg.seed)  # every process starts from the same adapter
        self.model = build_policy(cfg.model, acc.device, sharded=Sharding(acc).kind == "fsdp")  # FSDP2: loaded for sharding
        self.model.copy_adapter("default", OLD)
        self.opt = OptimizerStep(acc, self.model.transformer, t, items // t.num_minibatches, cfg.model.mixed_precision)
        self.old_params = self.model.adapter_parameters(OLD)
        self.ema = EMA(self.opt.names, self.opt.params, t.ema_decay, t.ema_every_n_steps, t.ema_mode) if t.use_ema else None
        guidance = getattr(self.sampler, "guidance_scale", None)
        self.rollout_guidance = self.model.default_guidance_scale if guidance is None else guidance
        # the loss regresses conditional velocities: true CFG stays in the rollout; a distilled guidance embedding
        # (FLUX.1-dev) is part of the conditional model and is kept at the sampler's scale
        self.guidance = 1.0 if self.model.uses_cfg(self.rollout_guidance) else self.rollout_guidance
        self.rewards = build_rewards(cfg.rewards, acc.device)
        self.weights = {r.name: r.weight for r in cfg.rewards}
        self.scorer = Scorer(self.rewards, cfg.on_reward_error, t.use_async_rewards)
        self.balancer = BALANCERS.get(cfg.balancer.name)(**cfg.balancer.kwargs)
        self.evaluation = TrainingEvaluation(cfg, acc, self.run, self.model, self.rewards, self.opt, self.ema)
        self.step = 0
        self.counters = {"reward_errors": 0}

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        t, acc, model = self.cfg.train, self.accelerator, self.model
        started = timed(acc.device)

        # 1. Prompts
        batch = self.prompt_sampler.local_batch(self.step, acc.process_index, acc.num_processes)

        # 2. Rollout with the old policy and 3. Score
        with model.using_adapter(OLD):
            rollout, local, rollout_s = rollout_and_score(
                self.sampler, model, batch, self.scorer, t.num_rollout_batches, self.step, self.weights
            )
        sampler_metrics = candidate_metrics(rollout)  # candidate pools: preview/full rank fidelity; else empty
        x0, cond = rollout.final_latents().to(acc.device), rollout.cond  # [N, *latent_shape]; rows [N]
        del rollout

        # 4. Gather and 5. Balance: advantages [N] of this process's samples, failed samples kept out
        advantages, keep, metrics, errors = balance(acc, local, batch, self.balancer, self.weights)
        self.counters["reward_errors"] += errors
        metrics.update(sampler_metrics)

        # 6. Optimise, then step the old policy's EMA
        tic = timed(acc.device)
        draws = seed_formulas.sample_generators(batch.seeds, "cpu", seed_formulas.TRAIN_STREAM)  # a sample's t and ε
        shape, sigma_range = tuple(x0.shape[1:]), model.trainable_sigma_range()  # times on the trained expert's side
        times, noises = training_draws(draws, shape, t.num_loss_targets_per_sample, t.time_alpha, sigma_range)
        metrics.update(self._optimise(x0, cond, advantages.to(acc.device), keep.to(acc.device), times, noises))
        decay = old_policy_decay(self.step, t.old_decay_ramp, t.old_decay)
        model.soft_update_adapter(OLD, "default", decay)
        optimise_s = tic.seconds()

        # 7. Log
        wall = started.seconds()
        samples = self.local_n * acc.num_processes
        metrics.update(step_metrics(wall, rollout_s, local.seconds, optimise_s, samples, errors, keep.sum()))
        metrics["train/old_decay"] = decay
        self.step += 1
        return metrics

    def _targets(self, x_t, sigma, cond, x0, noise, advantages) -> torch.Tensor:
        model = self.model
        with torch.no_grad():
            with model.using_adapter(OLD):
                v_old = model.velocity(x_t, sigma, cond, self.guidance)
            with model.adapter_disabled():
                v_ref = model.velocity(x_t, sigma, cond, self.guidance)
        return ram_target(v_ref, v_old, x0, noise, advantages, self.cfg.train.reward_multiplier)

    def _optimise(self, x0, cond, advantages, keep, times, noises) -> dict[str, float]:
        """The RAM regression over the step's N·K (endpoint, t) items in minibatches; the mean over the kept items
        of a minibatch, accumulated over `gradient_accumulation_steps` minibatches per optimizer step."""
        t, acc, model = self.cfg.train, self.accelerator, self.model
        n, k = times.shape
        gen = seed_formulas.step_generator(self.cfg.seed, self.step)
        sample_of = torch.arange(n).repeat_interleave(k)  # item -> endpoint; items are (sample, j) in row order
        sigma_all = times.reshape(-1).to(acc.device)  # [N·K]
        noise_all = noises.reshape(n * k, *noises.shape[2:]).to(acc.device)
        mb, accum = n * k // t.num_minibatches, t.gradient_accumulation_steps
        cached = None
        if t.cache_targets:
            cached = torch.cat(
                [
                    self._minibatch_target(rows, sample_of, x0, cond, advantages, sigma_all, noise_all)[1]
                    for rows in torch.arange(n * k).split(mb)
                ]
            )
        stats: dict[str, list[torch.Tensor]] = {"loss": [], "target_norm": []}
        for _ in range(t.num_inner_epochs):
            order = torch.randperm(n * k, generator=gen)
            for m in range(t.num_minibatches):
                if m % accum == 0:
                    window = len(stats["loss"])
                rows = order[m * mb : (m + 1) * mb]
                x_t, target = self._minibatch_target(rows, sample_of, x0, cond, advantages, sigma_all, noise_all, cached)
                index = rows.to(acc.device)
                keep_b = keep[sample_of[rows].to(acc.device)].float()  # [b]
                v_theta = model.velocity(x_t, sigma_all[index], select_cond(cond, sample_of[rows].to(acc.device)), self.guidance)
                per_item = ram_loss(v_theta, target)  # [b]
                self.opt.backward(
                    (per_item * keep_b).sum() / kept_per_process(acc, keep_b.sum()) / accum, boundary=(m + 1) % accum == 0
                )
                stats["loss"].append(per_item.detach().mean())
                stats["target_norm"].append(target.pow(2).mean(tuple(range(1, target.ndim))).sqrt().mean())
                if (m + 1) % accum == 0 and self.opt.step(torch.stack(stats["loss"][window:])) and self.ema is not None:
                    self.ema.update(self.opt.params, self.opt.optimizer_steps)
        return {f"train/{key}": float(torch.stack(v).mean()) for key, v in stats.items()} | self.opt.metrics()

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

    # ------------------------------------------------------------------------------------------ state
    def save(self):
        return save_recipe(self, groups={"adapter_old": self.old_params})

    def resume(self, path) -> None:
        resume_recipe(self, path, groups={"adapter_old": self.old_params})

    def evaluate(self, step: int | None) -> dict | None:
        """The fixed evaluation of θ (its EMA once an EMA update happened); None = the base model."""
        return self.evaluation(step)

    def train(self) -> dict:
        """Run to cfg.num_steps: resume, base eval, steps with logging/eval/checkpoints, final eval."""
        return train_loop(self, "ram")
