"""Adjoint Matching: reward fine-tuning as stochastic optimal control, as one recipe over the shared components. The
math is in docs/math.md#adjoint-matching, the recipe and its published settings in
docs/recipes/adjoint.md#adjoint-matching.

    flowrl train configs/toy/adjoint_matching.yaml
    accelerate launch scripts/train.py --config configs/sd3/adjoint_matching_imagereward.yaml

The rollout is the memoryless SDE of the current model (sampler `sde`, kind `flow_grpo`, noise level √2, a grid
that stops short of σ = 1); the reward must be differentiable. One training step:

    # 1. Prompts    the step's B prompts, G seeds each; this process's slice of the B*G samples
    # 2. Rollout    the memoryless SDE with the current weights, no gradient -> latents [N, T+1, ...]
    # 3. Score      the weighted differentiable rewards of the decoded endpoints and their gradient ∇r(x_T)
    # 4. Adjoint    ã_T = −λ·∇r(x_T), integrated backward along the trajectory with one VJP of the base model
    #               (LoRA switched off, or a frozen copy with full fine-tuning) per step, in sample chunks
    # 5. Times      every grid time with σ ≤ all_loss_times_below_sigma plus num_random_loss_times random others
    # 6. Optimise   the regression ‖(2/σ_d)(v_θ − v_base) + …‖² at those times, each term clipped; step; EMA
    # 7. Log/Eval   metrics.jsonl + trackers, eval every n steps, checkpoint every n steps

Stages 3-6 are adjoint matching's own; prompts, rollout, optimizer, checkpoints and evaluation are components.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

import flowrl.trainers.kit as kit
from flowrl import work
from flowrl.config import RunConfig
from flowrl.losses import adjoint_matching_loss
from flowrl.registry import BALANCERS, REWARDS
from flowrl.schedules import adjoint_loss_times, trainable_steps
from flowrl.sde_memoryless import adjoint_residual, lean_adjoint
from flowrl.seeds import adjoint_order_generator, step_generator
from flowrl.training.clock import timed
from flowrl.training.distributed import make_accelerator
from flowrl.training.loop import step_metrics
from flowrl.training.optim import OptimizerConfig
from flowrl.types import Rollout, select_cond

MEMORYLESS_SAMPLER = (
    "sampler: {name: sde, kind: flow_grpo, noise_level: 1.4142135623730951, sigma_schedule: dance, sigma_shift: 1.0, "
    "sigma_max: 0.975}"
)


@dataclass
class AdjointMatchingConfig(OptimizerConfig):
    reward_multiplier: float = 12500.0
    """λ of the tilted target p_base·exp(λ·r); the terminal adjoint is −λ·∇r (AM: 12500 for ImageReward)."""
    num_random_loss_times: int = 10
    """Grid times drawn at random per step from those with σ > all_loss_times_below_sigma (AM: 10 of τ ≤ 0.725)."""
    all_loss_times_below_sigma: float = 0.25
    """Every grid time with 0 < σ ≤ this is in the loss (AM: all τ ≥ 0.75)."""
    loss_clip_factor: float = 1.6
    """Each term's squared norm is clipped at factor·λ² (AM: 1.6); 0 = no clipping."""
    vjp_chunk_size: int = 0
    """Samples per vector-Jacobian-product chunk of the adjoint (0 = the whole local batch): bounds memory."""
    num_minibatches: int = 1
    """The step's local samples are split into this many minibatches (each trains every loss time)."""
    gradient_accumulation_steps: int = 1
    num_rollout_batches: int = 1
    """Rollouts are generated in this many chunks (bounds the sampler's activation memory)."""
    ema_every_n_steps: int = 1


def not_differentiable(names: list[str]) -> str:
    usable = sorted(n for n in REWARDS.names() if REWARDS.get(n).differentiable)
    return (
        f"trainer: adjoint_matching needs differentiable rewards; {', '.join(names)} is not: use one of "
        f"{', '.join(usable)} (or trainer: ram, which needs no reward gradient)"
    )


class AdjointMatchingTrainer:
    config_class = AdjointMatchingConfig
    name = "adjoint_matching"
    adapter_copies = 0  # the base is the adapter switched off
    full_reference_copy = True  # without LoRA the base is a frozen copy of the starting weights
    cfg_doubles_train_rows = False  # CFG refused (the model's own memoryless SDE)
    trains_on = "rollout_steps"  # the loss times among the rollout's grid times

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each) and
        `rewards` (RewardConfig entries; () = not checked), else the one-line reason and fix; the constructor raises
        the same (docs/recipes/compose.md). The guidance scale needs the model's family and is checked once it loads."""
        if "memoryless" not in kit.rollout_carries(sampler):
            return (
                "trainer: adjoint_matching needs the memoryless SDE on a grid that stops short of σ = 1, which "
                f"sampler {sampler.name} with these settings is not; use {MEMORYLESS_SAMPLER}"
            )
        if not BALANCERS.get(balancer.name).combines_rewards_linearly:
            return (
                "trainer: adjoint_matching regresses on the gradient of Σ_k w_k r_k and takes no advantages, so "
                f"balancer {balancer.name} would not act: use balancer weighted_sum (the reward weights are the "
                "combination)"
            )
        flat = [r.name for r in rewards if not REWARDS.get(r.name).differentiable]
        return not_differentiable(flat) if flat else None

    def __init__(self, cfg: RunConfig, accelerator=None):
        t = cfg.train
        if t.reward_multiplier <= 0 or t.loss_clip_factor < 0 or t.num_random_loss_times < 0:
            raise ValueError(
                f"train.reward_multiplier={t.reward_multiplier} must be > 0, train.loss_clip_factor="
                f"{t.loss_clip_factor} and train.num_random_loss_times={t.num_random_loss_times} >= 0"
            )
        why = self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards)
        if why:
            raise ValueError(why)
        # the base velocity: LoRA switched off, or (full fine-tuning) a frozen copy of the starting weights; scored in
        # the recipe's own step (with the reward's gradient)
        acc = accelerator or make_accelerator(cfg)
        self.parts = parts = kit.build_parts(cfg, acc, type(self), scored=False)
        flat = [name for name, r in parts.rewards.items() if not r.differentiable]
        if flat:  # a reward whose instance is not differentiable (a backend choice, e.g. artifact's vlm)
            raise ValueError(not_differentiable(flat))
        self.guidance = kit.refuse_cfg(type(self), parts, "rolls out the model's own memoryless SDE")

    @contextlib.contextmanager
    def base_model(self):
        """The base velocity: LoRA switched off, or the frozen copy swapped in (full fine-tuning)."""
        model = self.parts.model
        if self.parts.base_copy is None:
            with model.adapter_disabled():
                yield
            return
        trained, model.transformer = model.transformer, self.parts.base_copy
        try:
            yield
        finally:
            model.transformer = trained

    def train_step(self) -> dict[str, float]:
        parts = self.parts
        t, acc, model = parts.cfg.train, parts.accelerator, parts.model
        started = timed(acc.device)

        # 1. Prompts
        batch = parts.prompt_sampler.local_batch(parts.step, acc.process_index, acc.num_processes)

        # 2. Rollout: the memoryless SDE of the current weights, no gradient
        tic = timed(acc.device)
        model.transformer.eval()
        size = parts.local_n // t.num_rollout_batches
        chunks = [batch.select(slice(c * size, (c + 1) * size)) for c in range(t.num_rollout_batches)]
        with work.phase("rollout"):
            rollout = Rollout.concat([parts.sampler(model, chunk, step=parts.step) for chunk in chunks])
        latents, sigmas, cond = rollout.latents.to(acc.device), rollout.sigmas.to(acc.device), rollout.cond
        rollout_s = tic.seconds()
        kit.start_drift(parts, rollout)  # the rollout's drift before the step (docs/math.md#rollout-drift)

        # 3. Score: the weighted reward and its gradient at the clean endpoint, through the decoder
        tic = timed(acc.device)
        x_end = latents[:, -1].detach().requires_grad_(True)
        with torch.enable_grad():
            images = model.decode(x_end)
            scores = {
                name: r(images, batch.prompts, batch.metadata).scores.float() for name, r in parts.rewards.items()
            }
            total = sum(parts.weights[name] * score for name, score in scores.items())  # [N]
            (grad,) = torch.autograd.grad(total.sum(), x_end)
        reward_s = tic.seconds()
        metrics = {f"reward/{name}/mean": float(acc.reduce(s.detach().mean(), "mean")) for name, s in scores.items()}
        metrics["reward/total/mean"] = float(acc.reduce(total.detach().mean(), "mean"))

        # 4. Adjoint and 5. loss times (the same on every process: the step's own generator)
        tic = timed(acc.device)
        gen, trainable = step_generator(parts.cfg.seed, parts.step), trainable_steps(model, sigmas)
        keep = adjoint_loss_times(sigmas.cpu(), t.all_loss_times_below_sigma, t.num_random_loss_times, gen, trainable)
        adjoints, v_base = self._adjoint(latents, sigmas, cond, -t.reward_multiplier * grad.detach(), keep)

        # 6. Optimise
        metrics.update(self._optimise(latents, sigmas, cond, adjoints, v_base, keep))
        optimise_s = tic.seconds()

        # 7. Log
        n = parts.local_n
        metrics.update(
            step_metrics(started.seconds(), rollout_s, reward_s, optimise_s, n * acc.num_processes, 0, torch.tensor(n))
        )
        metrics["train/grad_reward_norm"] = float(grad.flatten(1).norm(dim=1).mean())
        metrics["train/loss_times"] = len(keep)
        metrics.update(parts.drift.close())
        parts.step += 1
        return metrics

    def _adjoint(self, latents, sigmas, cond, terminal, keep):
        """The lean adjoint over sample chunks of `vjp_chunk_size` (the base model's VJPs bound the memory)."""
        n = latents.shape[0]
        size = self.parts.cfg.train.vjp_chunk_size or n
        adjoints: dict[int, list] = {k: [] for k in keep}
        v_base: dict[int, list] = {k: [] for k in keep}
        with self.base_model():
            for start in range(0, n, size):
                rows = torch.arange(start, min(start + size, n), device=latents.device)
                sub = select_cond(cond, rows)

                def velocity(x, sigma, sub=sub):
                    return self.parts.model.velocity(x, sigma, sub, self.guidance)

                a, v = lean_adjoint(velocity, latents[rows], sigmas, terminal[rows], keep)
                for k in keep:
                    adjoints[k].append(a[k])
                    v_base[k].append(v[k])
        return {k: torch.cat(v) for k, v in adjoints.items()}, {k: torch.cat(v) for k, v in v_base.items()}

    def _optimise(self, latents, sigmas, cond, adjoints, v_base, keep) -> dict[str, float]:
        parts = self.parts
        t, model, n = parts.cfg.train, parts.model, parts.local_n
        clip = t.loss_clip_factor * t.reward_multiplier**2 if t.loss_clip_factor > 0 else None
        clipped, accum = [], t.gradient_accumulation_steps
        optimizer_steps = kit.OptimizerSteps(parts)
        for mb in optimizer_steps([torch.randperm(n, generator=adjoint_order_generator(parts.cfg.seed, parts.step))]):
            rows = mb.index
            sub = select_cond(cond, rows)
            for j, k in enumerate(keep):
                sigma = sigmas[k].expand(len(rows))
                v_theta = model.velocity(latents[rows, k], sigma, sub, self.guidance)
                residual = adjoint_residual(v_theta, v_base[k][rows], adjoints[k][rows], sigma)
                per_sample = adjoint_matching_loss(residual, clip)  # [b]
                parts.opt.backward(
                    per_sample.mean() / len(keep) / accum, boundary=j == len(keep) - 1 and mb.closes_step
                )
                optimizer_steps.losses.append(per_sample.detach().mean())
                if clip is not None:
                    clipped.append((residual.detach().pow(2).flatten(1).sum(1) > clip).float().mean())
        metrics = {"train/loss": float(torch.stack(optimizer_steps.losses).mean())}
        if clipped:
            metrics["train/clipped_fraction"] = float(torch.stack(clipped).mean())
        return metrics | parts.opt.metrics()
