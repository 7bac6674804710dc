"""Group-level Direct Reward Optimization (GDRO): a Plackett–Luce ranking loss between a pool's explicit rewards and a
Diffusion-DPO implicit reward, fully offline, as one recipe over the shared components. The math, its source and the
choices made where the source is silent: docs/recipes/gdro.md.

    flowrl pool configs/toy/gdro.yaml; flowrl train configs/toy/gdro.yaml

The pool (flowrl.training.pool, made at the run's start where missing): train.pool_size samples of every training
prompt by the reference model with the run's sampler, scored once. A step rolls nothing out:

    # 1. Prompts    the step's B prompts (whole groups on each process)
    # 2. Draw       per prompt k = data.group_size of its pool samples, uniformly without replacement, in random order
    #               (the tie-break of equal rewards); r = Σ weight·raw reward
    # 3. Optimise   per group and draw one (t, ε) (train.share_noise), x_t = (1 − t)·x0 + t·ε; ℓ = mean((v − (ε − x0))²)
    #               of θ and of the reference (adapters off); s = −β·(ℓ_θ − ℓ_ref); the loss L_GDRO(s, r; τ) + γ·ℓ_θ of
    #               the top-ranked sample, groups of equal rewards skipped; AdamW, EMA
    # 4. Log        the pool's work and seconds are billed at the run's first step (perf/offline_s)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import flowrl.trainers.kit as kit
from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.config import RunConfig
from flowrl.losses import GDRO_MODES, dsm_loss, gdro_implicit_reward, gdro_loss
from flowrl.models.conditioning import encode_prompts
from flowrl.samplers._rollout import resolve_size
from flowrl.schedules import GDRO_TIME_DISTRIBUTIONS, gdro_times
from flowrl.training.clock import timed
from flowrl.training.distributed import make_accelerator
from flowrl.training.loop import RecipeConfig, step_metrics
from flowrl.training.pool import build_pool
from flowrl.training.prompts import load_prompt_records
from flowrl.types import select_cond

REDUCTIONS = ("mean", "sum")


@dataclass
class GDROConfig(RecipeConfig):
    beta: float = 12.0
    """β of the implicit reward s = −β·(ℓ_θ − ℓ_ref) (GDRO: OCR 12, GenEval 6; tuned with ℓ mean-reduced)."""
    tau: float = 0.05
    """Temperature of the target q_i(j) = softmax(r/τ) on the rewards' own scale (GDRO: 0.05); 0 is the ranking NLL."""
    gamma: float = 0.5
    """γ of the top-1 regulariser, the flow-matching loss of each group's best sample (GDRO: OCR 0.5, GenEval 1.0)."""
    mode: str = "pl"
    """'pl' (the Plackett–Luce group loss), 'top1' (its first term) or 'rank' (τ → 0)."""
    pool_size: int = 16
    """Samples per training prompt in the offline pool; each step draws data.group_size (GDRO's k) of them."""
    pool_dir: str | None = None
    """The pool's folder (None: <output_dir>/pools/<name>); reused by every run whose pool fields agree."""
    pool_seed: int = 0
    """The pool's own seed (its samples' seeds do not depend on the run's seed)."""
    pool_shard_prompts: int = 8
    """Prompts per pool shard (the unit an interrupted generation redoes)."""
    t_distribution: str = "uniform"
    """'uniform' t ~ U(0, 1) or 'logit_normal' t = sigmoid(N(0, 1)) (SD3's), then time_shift, on the trained σ range."""
    time_shift: float = 1.0  # t ← s·t / (1 + (s − 1)·t) after the draw (1: none)
    share_noise: bool = True
    """One (t, ε) for the whole group (as Diffusion-DPO and DGPO); false: one per sample."""
    num_train_timesteps: int = 1
    """(t, ε) draws per group and step, each one backward."""
    reduce: str = "mean"
    """ℓ over latent elements: 'mean' (what β was tuned with here) or 'sum' (= mean · element count)."""
    ema_decay: float = 0.99


class GDROTrainer:
    config_class = GDROConfig
    name = "gdro"
    adapter_copies = 0  # the reference is the adapter switched off
    full_reference_copy = False
    cfg_doubles_train_rows = False  # the policy trains CFG-free
    trains_on = "endpoints"  # times drawn on the trainable σ range
    shapes_world = "ends below the base on race seeds 0-2: docs/recipes/gdro.md#measured-on-the-shapes-world"

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` makes this recipe's pool and balancer `balancer` may stand by (ComponentConfig
        each), else the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        carries = kit.rollout_carries(sampler)
        if "clean_endpoints" not in carries:
            return (
                f"trainer: gdro trains on a pool of clean endpoints, which sampler {sampler.name}'s rollouts lack: use "
                "ode"
            )
        if "per_edge" in carries:
            return (
                f"trainer: gdro's pool needs independent samples; sampler {sampler.name}'s share their edges: use ode"
            )
        if needs := kit.balancer_needs(balancer):
            return (
                f"balancer {balancer.name} asks the trainer for {', '.join(sorted(needs))}, but gdro ranks the raw "
                "weighted rewards and uses no advantage: use balancer weighted_sum (unused) with gdro"
            )
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        t, d = cfg.train, cfg.data
        if t.mode not in GDRO_MODES or t.t_distribution not in GDRO_TIME_DISTRIBUTIONS or t.reduce not in REDUCTIONS:
            raise ValueError(
                f"train.mode={t.mode!r} must be in {GDRO_MODES}, t_distribution={t.t_distribution!r} in "
                f"{GDRO_TIME_DISTRIBUTIONS}, reduce={t.reduce!r} in {REDUCTIONS}"
            )
        listed = ", ".join(
            f"{k}={getattr(t, k)}" for k in ("beta", "time_shift", "num_train_timesteps", "pool_shard_prompts")
        )
        if min(t.beta, t.time_shift, t.num_train_timesteps, t.pool_shard_prompts) <= 0 or min(t.tau, t.gamma) < 0:
            raise ValueError(f"train.{listed} must all be > 0 and tau={t.tau}, gamma={t.gamma} >= 0")
        if not 2 <= d.group_size <= t.pool_size:
            raise ValueError(
                f"data.group_size={d.group_size} is gdro's k, the pool samples ranked together: set it in [2, "
                f"train.pool_size={t.pool_size}]"
            )
        if not cfg.model.use_lora:
            raise ValueError(
                "trainer: gdro needs model.use_lora=true (the reference is the model with its adapter off)"
            )
        if why := self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards):
            raise ValueError(why)
        acc = accelerator or make_accelerator(cfg)
        self.parts = parts = kit.build_parts(cfg, acc, type(self), whole_groups=True, scored=False)
        groups = parts.local_n // d.group_size
        if groups % t.num_minibatches:
            raise ValueError(
                f"train.num_minibatches={t.num_minibatches} must divide the {groups} prompt groups each process holds "
                "(gdro ranks whole groups); set it to 1 or a divisor"
            )
        sources = (d.prompts, d.prompts_file, d.toy_split, "data", d.toy_sources, d.prompt_set)
        prompts, self.metadata = load_prompt_records(*sources)
        self.prompt_index = {p: i for i, p in reversed(list(enumerate(prompts)))}  # a repeated prompt: its first pool
        self.pool = build_pool(cfg, acc, parts.model, parts.sampler, parts.rewards, prompts, self.metadata)
        self.offline_work = dict(self.pool.manifest["work"])  # billed at the first step (flowrl plan leaves it out)
        self.guidance = kit.policy_guidance(parts)  # the policy trains CFG-free

    def train_step(self) -> dict[str, float]:
        parts, t, cfg = self.parts, self.parts.cfg.train, self.parts.cfg
        acc, model, device, k = parts.accelerator, parts.model, parts.accelerator.device, cfg.data.group_size
        started = timed(device)
        # 1. Prompts: this process's whole groups (global ids), every group's prompt
        batch = parts.prompt_sampler.local_batch(parts.step, acc.process_index, acc.num_processes)
        local_ids, every_prompt = batch.group_ids[::k], parts.prompt_sampler.global_batch(parts.step).prompts[::k]
        pool_rows = torch.tensor([self.prompt_index[p] for p in every_prompt])  # [B]
        # 2. Draw k pool samples per group, in random order (the same on every process); r = Σ weight · raw reward
        gen = seed_formulas.step_generator(cfg.seed, parts.step)
        slots = torch.stack([torch.randperm(t.pool_size, generator=gen)[:k] for _ in every_prompt])  # [B, k]
        raw = {name: scores[pool_rows[:, None], slots] for name, scores in self.pool.rewards.items()}  # [B, k] each
        rewards = sum(parts.weights[name] * value.double() for name, value in raw.items())  # [B, k]
        x0 = torch.stack([self.pool.x0(int(pool_rows[g]), slots[g]) for g in local_ids.tolist()]).to(
            device
        )  # [b, k, ...]
        prompts = [every_prompt[g] for g in local_ids.tolist()]
        meta = [dict(self.metadata[self.prompt_index[p]]) for p in prompts]
        size, negative = resolve_size(parts.sampler, model), parts.sampler.negative_prompt
        cond = encode_prompts(model, prompts, meta, negative, self.guidance, size)

        # 3. Optimise
        tic = timed(device)
        metrics = self._optimise(x0, cond, rewards[local_ids].to(device), local_ids, gen)
        metrics |= {f"reward/{name}/mean": float(v.mean()) for name, v in raw.items()}
        metrics["train/zero_std_fraction"] = float((rewards.max(1).values == rewards.min(1).values).double().mean())

        # 4. Log (the pool's work and seconds billed once, at the first step, by one process)
        if parts.step == 0:
            metrics |= kit.bill_offline(parts, self.pool.manifest)
        samples = cfg.data.num_prompts_per_step * k
        metrics |= step_metrics(started.seconds(), 0.0, 0.0, tic.seconds(), samples, 0, samples)
        parts.step += 1
        return metrics

    def _optimise(self, x0, cond, rewards, group_ids, gen) -> dict[str, float]:
        """L_GDRO + γ·L_reg over the local groups in minibatches; the mean over the step's groups per optimizer step."""
        parts, t, model = self.parts, self.parts.cfg.train, self.parts.model
        b, k, shape = x0.shape[0], x0.shape[1], tuple(x0.shape[2:])
        sigma_range, draws, seed = model.trainable_sigma_range(), t.num_train_timesteps, parts.cfg.seed
        steps = kit.OptimizerSteps(parts)
        for mb in steps([torch.randperm(b, generator=gen)]):
            rows, m = mb.index, len(mb.rows)
            items, sub_cond = x0[rows].flatten(0, 1), select_cond(cond, rows.repeat_interleave(k))  # [m·k, ...]
            norm = m * t.gradient_accumulation_steps * draws
            for j in range(draws):
                count = 1 if t.share_noise else k
                generators = [
                    seed_formulas.gdro_draw_generator(seed, parts.step, j, int(g)) for g in group_ids[mb.rows]
                ]
                got = [
                    gdro_times(draw, count, shape, t.t_distribution, t.time_shift, sigma_range) for draw in generators
                ]
                sigma = torch.cat([s for s, _ in got]).to(x0.device)  # [m·count]
                noise = torch.cat([e for _, e in got]).to(x0)  # [m·count, ...]
                if t.share_noise:
                    sigma, noise = sigma.repeat_interleave(k), noise.repeat_interleave(k, 0)  # one (t, ε) per group
                x_t = sde.forward_noise(items, noise, sigma)
                v = model.velocity(x_t, sigma, sub_cond, self.guidance)
                with torch.no_grad(), model.adapter_disabled():
                    v_ref = model.velocity(x_t, sigma, sub_cond, self.guidance)
                scale = float(items[0].numel()) if t.reduce == "sum" else 1.0
                ell, ell_ref = scale * dsm_loss(v, items, noise), scale * dsm_loss(v_ref, items, noise)  # [m·k]
                s = gdro_implicit_reward(ell, ell_ref, t.beta).view(m, k)
                group, st = gdro_loss(s, rewards[rows], t.tau, t.mode)  # [m]
                reg = ell.view(m, k).gather(1, st["top"][:, None])[:, 0]  # ℓ_θ of each group's top-ranked sample
                per_group = torch.where(st["signal"], group + t.gamma * reg, torch.zeros_like(group))
                parts.opt.backward(per_group.sum() / norm, boundary=j == draws - 1 and mb.closes_step)
                steps.losses.append(per_group.detach().mean())
                signal = st["signal"].double()
                steps.record(
                    {"dsm_loss": ell, "dsm_ref_loss": ell_ref, "implicit_reward": s, "signal_fraction": signal}
                )
                steps.record({"gdro_loss": group, "reg_loss": reg, "top1_match": (s.argmax(1) == st["top"]).double()})
        return steps.metrics()
