"""GRPO for flow-matching models (Flow-GRPO, DanceGRPO settings by config), as one recipe.

    accelerate launch scripts/train.py --config configs/toy/grpo.yaml
    flowrl train configs/toy/grpo.yaml train.learning_rate=1e-4

One training step = one rollout batch of B prompts x G samples over all processes, then its optimisation:

    # 1. Prompts    the step's B prompts, G seeds each; this process's slice of the B*G samples
    # 2. Rollout    SDE sampler -> latents of every step, behaviour log-probs (in chunks)
    # 3. Score      every reward on the decoded images (a worker thread overlaps the next chunk)
    # 4. Gather     scores of all processes -> [B*G] per reward
    # 5. Balance    advantages per sample (balancer), clipped, zero-std groups counted / filtered
    # 6. Optimise   per inner epoch, minibatch, trained transition: recompute log-prob, clipped ratio loss
    #               + KL to the reference (adapter disabled); all-reduce gradients; clip; step; EMA
    # 7. Log/Eval   metrics.jsonl + trackers, eval every n steps, checkpoint every n steps
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowrl import sde
from flowrl.config import RunConfig, dump_config, load_prompts, to_dict
from flowrl.losses import clipped_policy_loss
from flowrl.registry import BALANCERS, REWARDS, SAMPLERS
from flowrl.types import PromptBatch, Rollout, select_cond


@dataclass
class GRPOConfig:
    learning_rate: float = 3e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-4
    adam_epsilon: float = 1e-8
    lr_warmup_steps: int = 0
    """Linear warm-up over this many optimizer steps, then constant."""
    max_grad_norm: float = 1.0
    clip_range: float = 1e-4
    """PPO ε on the ratio of per-element-mean log-probs (Flow-GRPO 1e-4, Fast 1e-5, Wan 1e-3)."""
    kl_coef: float = 0.0
    """β of the KL to the reference model (the adapter switched off); 0 skips the reference forward."""
    kl_form: str = "code"
    """'code' (mean over elements / 2g², the form published β values assume) or 'paper' (sum / 2s²)."""
    timestep_fraction: float = 1.0
    """Train on this fraction of each sample's stochastic transitions (DanceGRPO 0.6)."""
    shuffle_timesteps: bool = False
    """Pick the trained transitions by a per-sample random permutation (DanceGRPO) instead of in order."""
    num_inner_epochs: int = 1
    num_minibatches: int = 1
    """The step's local samples are split into this many minibatches."""
    gradient_accumulation_steps: int = 1
    """Minibatches per optimizer step (must divide num_minibatches)."""
    num_rollout_batches: int = 1
    """Rollouts are generated in this many chunks; rewards of one chunk are scored while the next is sampled."""
    use_async_rewards: bool = True
    """Score rewards in a worker thread, overlapping the next rollout chunk."""
    filter_zero_std: bool = False
    """Drop samples of groups whose rewards are all equal (they carry no signal) from the loss."""
    use_ema: bool = True
    ema_decay: float = 0.9
    ema_every_n_steps: int = 8
    """EMA update cadence in optimizer steps; the effective decay is min((1 + n) / (10 + n), ema_decay)."""
    max_consecutive_nan_steps: int = 3
    """A non-finite loss skips the optimizer step; this many in a row stops the run."""


class GroupedPromptSampler:
    """The step's B prompts (epoch-wise shuffled, seeded) expanded to B*G samples with agreed seeds.

    Everything is a function of (seed, step), so every process, and a resumed run, sees the same batch.
    """

    def __init__(self, prompts: list[str], num_prompts_per_step: int, group_size: int, seed: int):
        self.prompts, self.b, self.g, self.seed = prompts, num_prompts_per_step, group_size, seed

    def _prompt_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.prompts))
        order = torch.randperm(len(self.prompts), generator=torch.Generator().manual_seed(self.seed * 7919 + epoch))
        return int(order[offset])

    def global_batch(self, step: int) -> PromptBatch:
        indices = [self._prompt_index(step * self.b + i) for i in range(self.b)]
        prompts = [self.prompts[i] for i in indices for _ in range(self.g)]  # [B*G]
        group_ids = torch.arange(self.b).repeat_interleave(self.g)  # [B*G]
        seeds = torch.tensor([(self.seed * 1_000_003 + step * 100_003 + j) % (2**31 - 1) for j in range(self.b * self.g)])
        return PromptBatch(prompts, group_ids, [{} for _ in prompts], seeds=seeds)

    def local_batch(self, step: int, process_index: int, num_processes: int) -> PromptBatch:
        full = self.global_batch(step)
        n = len(full.prompts) // num_processes
        rows = slice(process_index * n, (process_index + 1) * n)
        return PromptBatch(full.prompts[rows], full.group_ids[rows], full.metadata[rows], seeds=full.seeds[rows])


def build_rewards(specs, device) -> dict[str, Any]:
    return {spec.name: REWARDS.get(spec.name)(device=device, **spec.kwargs) for spec in specs}


def score_images(rewards: dict, images: torch.Tensor, prompts: list[str], metadata: list[dict], policy: str,
                 offset: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """{name: scores [n]} with the reward-error policy applied; errors counted per reward.

    NaN is "not applicable" (DESIGN.md): the sample takes no part in that reward. An exception, a wrong
    length or an infinite score is an error: raised (policy "raise"), or the samples are dropped
    ("skip_sample"; marked +inf here, removed from the advantages by the trainer).
    """
    from flowrl.rewards.contract import score_checked

    out, errors = {}, {}
    for name, reward in rewards.items():
        n = len(prompts)
        try:
            out[name] = score_checked(reward, images, prompts, metadata).scores.detach().float().cpu()
        except Exception as err:  # noqa: BLE001 - one policy for every reward failure
            if policy == "raise":
                raise RuntimeError(f"reward {name!r} failed on local samples {offset}..{offset + n - 1}: {err}") from err
            out[name], errors[name] = torch.full((n,), float("inf")), n
    return out, errors


def trained_transitions(rollout: Rollout, fraction: float, shuffle: bool, generator: torch.Generator) -> torch.Tensor:
    """[N, J] indices of the transitions to train on, per sample (in order, or a random permutation)."""
    mask = rollout.train_mask.cpu()  # [N, T]
    counts = mask.sum(1)
    if counts.min() != counts.max():
        raise ValueError("samples of one batch have different numbers of stochastic transitions")
    num = int(counts[0])
    if num == 0:
        raise ValueError("the rollout has no stochastic transitions: set sampler.noise_level > 0")
    keep = max(1, int(num * fraction + 1e-6))
    rows = []
    for i in range(mask.shape[0]):
        steps = mask[i].nonzero().flatten()
        if shuffle:
            steps = steps[torch.randperm(num, generator=generator)]
        rows.append(steps[:keep])
    return torch.stack(rows)  # [N, J]


class GRPOTrainer:
    def __init__(self, cfg: RunConfig, accelerator=None):
        from accelerate.utils import set_seed

        from flowrl.distributed import Sharding, make_accelerator
        from flowrl.models import load_flow_model

        self.cfg = cfg
        t = cfg.train
        if t.num_minibatches % t.gradient_accumulation_steps:
            raise ValueError(f"train.gradient_accumulation_steps={t.gradient_accumulation_steps} must divide "
                             f"train.num_minibatches={t.num_minibatches}")
        if t.kl_form not in sde.KL_FORMS:
            raise ValueError(f"train.kl_form={t.kl_form!r} must be one of {', '.join(sde.KL_FORMS)}")
        self.run_dir = cfg.run_dir
        self.accelerator = accelerator or make_accelerator(cfg)
        acc = self.accelerator
        total = cfg.data.num_prompts_per_step * cfg.data.group_size
        if total % acc.num_processes:
            raise ValueError(f"data.num_prompts_per_step * data.group_size = {total} does not divide across "
                             f"{acc.num_processes} processes; make it a multiple of {acc.num_processes}")
        self.local_n = total // acc.num_processes
        if self.local_n % t.num_minibatches or self.local_n % t.num_rollout_batches:
            raise ValueError(f"the {self.local_n} samples per process do not split into train.num_minibatches="
                             f"{t.num_minibatches} and train.num_rollout_batches={t.num_rollout_batches}")
        # the model, its adapter and the optimizer (seeded: every process starts from the same adapter)
        set_seed(cfg.seed)
        self.model = load_flow_model(cfg.model.path, dtype=cfg.model.dtype, device=acc.device)
        if cfg.model.use_lora:
            targets = tuple(cfg.model.lora_target_modules) if cfg.model.lora_target_modules else None
            if cfg.model.init_lora:
                self.model.load_lora(cfg.model.init_lora)
                for name, p in self.model.transformer.named_parameters():
                    p.requires_grad_("lora_" in name)
            else:
                self.model.add_lora(rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha, target_modules=targets)
        else:
            if t.kl_coef > 0:
                raise ValueError("train.kl_coef > 0 needs model.use_lora=true (the reference is the adapter switched off)")
            self.model.transformer.requires_grad_(True)
        if cfg.model.use_gradient_checkpointing:
            self.model.enable_gradient_checkpointing()
        self.names = [n for n, p in self.model.transformer.named_parameters() if p.requires_grad]
        for p in self.model.transformer.parameters():  # trained weights in float32; frozen parts may be bf16
            if p.requires_grad:
                p.data = p.data.float()
        optimizer = torch.optim.AdamW([p for p in self.model.transformer.parameters() if p.requires_grad], lr=t.learning_rate,
                                      betas=(t.adam_beta1, t.adam_beta2), weight_decay=t.adam_weight_decay, eps=t.adam_epsilon)
        warmup = max(t.lr_warmup_steps, 0)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)))
        # data parallel keeps the module and optimizer; FSDP2 shards both in place, ZeRO-2 wraps the optimizer
        self.sharding = Sharding(acc)
        self.optimizer = self.sharding.prepare(self.model.transformer, optimizer, self.local_n // t.num_minibatches, t.max_grad_norm)
        self.params = [p for p in self.model.transformer.parameters() if p.requires_grad]
        self.ema = {n: p.detach().clone() for n, p in zip(self.names, self.params)} if t.use_ema else None
        self._nonfinite_backward = False
        # data, sampler, rewards, balancer
        self.prompts = load_prompts(cfg.data.prompts, cfg.data.prompts_file, cfg.data.toy_split, "data")
        self.prompt_sampler = GroupedPromptSampler(self.prompts, cfg.data.num_prompts_per_step, cfg.data.group_size, cfg.seed)
        self.sampler = SAMPLERS.get(cfg.sampler.name)(**cfg.sampler.kwargs)
        self.rewards = build_rewards(cfg.rewards, acc.device)
        self.weights = {r.name: r.weight for r in cfg.rewards}
        self.balancer = BALANCERS.get(cfg.balancer.name)(**cfg.balancer.kwargs)
        self.step = 0
        self.optimizer_steps = 0
        self.nan_streak = 0
        self.last_grad_norm = 0.0
        self.counters = {"skipped_nan_steps": 0, "reward_errors": 0}
        self._pool = ThreadPoolExecutor(max_workers=1) if t.use_async_rewards else None

    # ------------------------------------------------------------------------------------------ state
    def trainer_state(self) -> dict:
        return {"optimizer_steps": self.optimizer_steps, "prompt_sampler_position": self.step * self.cfg.data.num_prompts_per_step,
                "nan_streak": self.nan_streak, "counters": self.counters}

    def save(self) -> Path:
        return save_state(self)

    def resume(self, path: Path) -> None:
        from flowrl.checkpoint import config_differences, load_checkpoint, set_rng_state

        state = load_checkpoint(path, self.accelerator.process_index)
        diff = config_differences(state["config"], to_dict(self.cfg))
        if diff:
            raise ValueError(f"checkpoint {str(path)!r} comes from another config: keys {', '.join(diff[:6])} differ; "
                             "resume with the config it was written with or start a new run name")
        from flowrl.distributed import like

        self.sharding.load_parameters(self.names, self.params, state["trainable"])
        if self.ema is not None and state["ema"] is not None:
            for name, value in state["ema"].items():
                self.ema[name] = like(value, self.ema[name])
        self.sharding.load_optimizer_state(self.optimizer, self.names, self.params, state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        ts = state["trainer_state"]
        self.step, self.optimizer_steps, self.nan_streak = ts["step"], ts["optimizer_steps"], ts["nan_streak"]
        self.counters = ts["counters"]
        if state["rng"] is not None:
            set_rng_state(state["rng"])
        metrics = self.run_dir / "metrics.jsonl"
        if self.accelerator.is_main_process and metrics.exists():  # forget steps logged after this checkpoint
            kept = [line for line in metrics.read_text().splitlines() if _logged_step(line) <= self.step]
            metrics.write_text("".join(line + "\n" for line in kept))

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        cfg, t, acc, model = self.cfg, self.cfg.train, self.accelerator, self.model
        started = time.perf_counter()
        metrics: dict[str, float] = {}

        # 1. Prompts
        batch = self.prompt_sampler.local_batch(self.step, acc.process_index, acc.num_processes)
        offset = acc.process_index * self.local_n
        if hasattr(self.sampler, "step"):
            self.sampler.step = self.step

        # 2. Rollout (in chunks) and 3. Score (overlapping the next chunk in a worker thread)
        chunk = self.local_n // t.num_rollout_batches
        rollouts, pending = [], []
        rollout_s = 0.0
        model.transformer.eval()
        for c in range(t.num_rollout_batches):
            rows = slice(c * chunk, (c + 1) * chunk)
            part = PromptBatch(batch.prompts[rows], batch.group_ids[rows], batch.metadata[rows], seeds=batch.seeds[rows])
            tic = time.perf_counter()
            rollout = self.sampler(model, part)
            rollout_s += time.perf_counter() - tic
            rollouts.append(rollout)
            args = (self.rewards, rollout.images, rollout.prompts, rollout.metadata, cfg.on_reward_error, offset + c * chunk)
            if self._pool is not None:
                pending.append(self._pool.submit(_timed, score_images, *args).result)
            else:
                result = _timed(score_images, *args)
                pending.append(lambda result=result: result)
        results = [wait() for wait in pending]
        reward_s = sum(r[1] for r in results)
        local_scores = {name: torch.cat([r[0][0][name] for r in results]) for name in self.rewards}  # [N] each
        errors = sum(sum(r[0][1].values()) for r in results)
        rollout = _concat_rollouts(rollouts)

        # 4. Gather
        device = acc.device
        gathered = {name: acc.gather(s.to(device)).cpu() for name, s in local_scores.items()}  # [B*G]
        group_ids = acc.gather(batch.group_ids.to(device)).cpu()
        errors = int(acc.gather(torch.tensor([errors], device=device)).sum())
        self.counters["reward_errors"] += errors

        # 5. Balance
        dropped = torch.zeros(len(group_ids), dtype=torch.bool)
        for s in gathered.values():
            dropped |= torch.isinf(s)
        clean = {name: torch.where(dropped, torch.full_like(s, float("nan")), s) for name, s in gathered.items()}
        advantages, balance_metrics = self.balancer(clean, group_ids, self.weights)
        advantages = torch.where(dropped, torch.zeros_like(advantages), advantages)
        metrics.update(balance_metrics)
        for name, s in clean.items():
            finite = s[torch.isfinite(s)]
            metrics[f"reward/{name}/mean"] = float(finite.mean()) if finite.numel() else float("nan")
            metrics[f"reward/{name}/std"] = float(finite.std(unbiased=False)) if finite.numel() else float("nan")
        metrics["reward/dropped_samples"] = float(dropped.sum())
        local_adv = advantages[offset : offset + self.local_n]  # [N]
        keep = ~dropped[offset : offset + self.local_n]
        if t.filter_zero_std:
            from flowrl.advantages import zero_std_groups

            total = torch.stack([s for s in clean.values()]).nan_to_num(0).sum(0)
            keep &= ~zero_std_groups(total, group_ids)[offset : offset + self.local_n]

        # 6. Optimise (eval mode kept: the recomputed log-probs must equal the rollout's on the first pass)
        tic = time.perf_counter()
        opt_metrics = self._optimise(rollout, local_adv.to(device), keep.to(device))
        optimise_s = time.perf_counter() - tic
        metrics.update(opt_metrics)

        # 7. Log
        wall = time.perf_counter() - started
        metrics.update({
            "perf/step_s": wall, "perf/rollout_s": rollout_s, "perf/reward_s": reward_s, "perf/optimise_s": optimise_s,
            "perf/samples_per_s": self.local_n * acc.num_processes / wall, "train/lr": self.lr_scheduler.get_last_lr()[0],
            "train/reward_errors": float(errors),
        })
        self.step += 1
        return metrics

    def _optimise(self, rollout: Rollout, advantages: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        cfg, t, acc, model = self.cfg, self.cfg.train, self.accelerator, self.model
        n = self.local_n
        gen = torch.Generator().manual_seed(cfg.seed * 31 + self.step)
        transitions = trained_transitions(rollout, t.timestep_fraction, t.shuffle_timesteps, gen).to(acc.device)  # [N, J]
        num_j = transitions.shape[1]
        mb = n // t.num_minibatches
        sigmas = rollout.sigmas.to(acc.device)
        stats: dict[str, list[torch.Tensor]] = {k: [] for k in ("loss", "policy_loss", "kl", "ratio", "clipped", "approx_kl")}
        for _ in range(t.num_inner_epochs):
            order = torch.randperm(n, generator=gen).to(acc.device)
            for m in range(t.num_minibatches):
                rows = order[m * mb : (m + 1) * mb]
                cond = select_cond(rollout.cond, rows)
                for j in range(num_j):
                    k = transitions[rows, j]  # [mb] transition index per sample
                    x = rollout.latents[rows, k]  # [mb, ...]
                    x_next = rollout.latents[rows, k + 1]
                    sigma, sigma_next = sigmas[k], sigmas[k + 1]  # [mb]
                    level = rollout.noise_levels[rows, k]
                    with acc.autocast():
                        v = model.velocity(x, sigma, cond, rollout.guidance_scale)
                    _, log_prob, mean, std = sde.sde_step(v, x, sigma, sigma_next, rollout.kind, level, prev_sample=x_next)
                    old = rollout.log_probs[rows, k]
                    policy_loss, s = clipped_policy_loss(log_prob, old, advantages[rows], t.clip_range)
                    kl = torch.zeros_like(policy_loss)
                    if t.kl_coef > 0:
                        with torch.no_grad(), model.adapter_disabled(), acc.autocast():
                            v_ref = model.velocity(x, sigma, cond, rollout.guidance_scale)
                        _, _, ref_mean, _ = sde.sde_step(v_ref, x, sigma, sigma_next, rollout.kind, level, prev_sample=x_next)
                        dt = (sigma - sigma_next) if rollout.kind in ("flow_grpo", "dance") else None
                        kl = sde.gaussian_kl(mean, ref_mean, std, t.kl_form, dt=dt)
                    weight = keep[rows].float()
                    per_sample = (policy_loss + t.kl_coef * kl) * weight
                    loss = per_sample.sum() / mb / (num_j * t.gradient_accumulation_steps)
                    self._backward(loss, boundary=j == num_j - 1 and (m + 1) % t.gradient_accumulation_steps == 0)
                    stats["loss"].append(per_sample.detach().mean())
                    stats["policy_loss"].append(policy_loss.detach().mean())
                    stats["kl"].append(kl.detach().mean())
                    stats["ratio"].append(s["ratio"])
                    stats["clipped"].append(s["clipped"].float())
                    stats["approx_kl"].append(s["approx_kl"])
                if (m + 1) % t.gradient_accumulation_steps == 0:
                    self._optimizer_step(torch.stack(stats["loss"][-num_j * t.gradient_accumulation_steps :]))
        ratio = torch.cat(stats["ratio"])
        return {
            "train/loss": float(torch.stack(stats["loss"]).mean()), "train/policy_loss": float(torch.stack(stats["policy_loss"]).mean()),
            "train/kl": float(torch.stack(stats["kl"]).mean()), "train/clip_fraction": float(torch.cat(stats["clipped"]).mean()),
            "train/approx_kl": float(torch.cat(stats["approx_kl"]).mean()), "train/ratio_mean": float(ratio.mean()),
            "train/ratio_min": float(ratio.min()), "train/ratio_max": float(ratio.max()),
            "train/grad_norm": self.last_grad_norm, "train/skipped_nan_steps": float(self.counters["skipped_nan_steps"]), "train/optimizer_steps": float(self.optimizer_steps),
        }

    def _backward(self, loss: torch.Tensor, boundary: bool) -> None:
        if self.sharding.kind == "deepspeed":
            # the engine steps inside the boundary backward, so a non-finite loss is caught before it: its
            # backward is replaced by a zero one (the accumulation stays aligned) and the step is counted skipped
            if not self.sharding.all_true(bool(torch.isfinite(loss))):
                self._nonfinite_backward = True
                loss = sum((p * 0).sum() for p in self.params)
        self.sharding.backward(loss, boundary)

    def _optimizer_step(self, losses: torch.Tensor) -> None:
        t, acc = self.cfg.train, self.accelerator
        if self.sharding.kind == "deepspeed":  # the engine has stepped (clipped, updated, zeroed) already
            finite, self._nonfinite_backward = not self._nonfinite_backward, False
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            if self.sharding.kind is None and acc.num_processes > 1:  # data parallel: average all processes' gradients
                flat = acc.reduce(torch.cat([g.flatten() for g in grads]), reduction="mean")
                offset = 0
                for p, g in zip(self.params, grads):
                    p.grad = flat[offset : offset + g.numel()].view_as(g).to(p.dtype)
                    offset += g.numel()
                grads = [p.grad for p in self.params]
            local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]  # FSDP2: this process's shard
            finite = all(bool(torch.isfinite(g).all()) for g in local) and bool(torch.isfinite(losses).all())
            if self.sharding.kind == "fsdp":
                finite = self.sharding.all_true(finite)
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            self.counters["skipped_nan_steps"] += 1
            self.nan_streak += 1
            if self.nan_streak >= t.max_consecutive_nan_steps:
                raise FloatingPointError(
                    f"{self.nan_streak} optimizer steps in a row had a non-finite loss or gradient; lower "
                    "train.learning_rate or train.clip_range, or check the rewards")
            if self.sharding.kind != "deepspeed":
                return
        else:
            self.nan_streak = 0
        if self.sharding.kind == "deepspeed":
            self.last_grad_norm = self.sharding.grad_norm()
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.params, t.max_grad_norm)
            self.last_grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        self.optimizer_steps += 1
        if self.ema is not None and self.optimizer_steps % t.ema_every_n_steps == 0:
            n = self.optimizer_steps // t.ema_every_n_steps
            decay = min((1 + n) / (10 + n), t.ema_decay)
            with torch.no_grad():
                for name, p in zip(self.names, self.params):
                    self.ema[name].mul_(decay).add_(p.detach(), alpha=1 - decay)

    # ------------------------------------------------------------------------------------------ loop
    @contextlib.contextmanager
    def ema_weights(self):
        """Context: the trained parameters temporarily replaced by their EMA (for evaluation)."""
        saved = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            for name, p in zip(self.names, self.params):
                p.copy_(self.ema[name])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self.params, saved):
                    p.copy_(value)

    def train(self) -> dict:
        """Run to cfg.num_steps: resume, base eval, steps with logging/eval/checkpoints, final eval."""
        from flowrl.checkpoint import resolve_resume

        cfg, acc = self.cfg, self.accelerator
        self.run_dir.mkdir(parents=True, exist_ok=True)
        resume = resolve_resume(cfg.checkpoint.resume, self.run_dir)
        if resume is not None:
            self.resume(resume)
        if acc.is_main_process:
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))
            (self.run_dir / "launch.json").write_text(json.dumps({
                "num_processes": acc.num_processes, "distributed_type": acc.distributed_type.name,
                "sharding": self.sharding.kind or "none", "mixed_precision": acc.mixed_precision, "device": str(acc.device),
            }, indent=2))
        acc.init_trackers(cfg.name, config=_scalar_config(cfg))
        evaluator = RunEvaluator(self)
        if self.step == 0:
            evaluator.run("base")
        progress = _progress(cfg, acc, self.step)
        history = []
        while self.step < cfg.num_steps:
            metrics = self.train_step()
            history.append(metrics)
            if acc.is_main_process:
                with open(self.run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({"step": self.step, "time": time.time(), **_finite(metrics)}) + "\n")
            acc.log(_finite(metrics), step=self.step)
            if progress is not None:
                progress.update(1)
                shown = {k.split("/")[-2] if k.startswith("reward/") else k.split("/")[-1]: f"{v:.3g}"
                         for k, v in metrics.items() if k.endswith("/mean") and k.startswith("reward/") or k == "train/loss"}
                progress.set_postfix(shown)
            every = cfg.checkpoint.every_n_steps
            if every and self.step % every == 0 and self.step < cfg.num_steps:
                self.save()
            if cfg.eval.every_n_steps and self.step % cfg.eval.every_n_steps == 0 and self.step < cfg.num_steps:
                evaluator.run(self.step)
        if progress is not None:
            progress.close()
        self.save()
        final = evaluator.run(self.step)
        if self._pool is not None:
            self._pool.shutdown()
        acc.wait_for_everyone()
        acc.end_training()
        return {"history": history, "final_eval": final}


class RunEvaluator:
    """Fixed prompts x seeds through the ODE sampler, every reward + gold rewards -> eval/<label>/."""

    def __init__(self, trainer: GRPOTrainer):
        from flowrl.samplers.ode import ODESampler

        e = trainer.cfg.eval
        self.trainer = trainer
        prompts = load_prompts(e.prompts, e.prompts_file, e.toy_split, "eval") if (e.prompts or e.prompts_file or e.toy_split) else trainer.prompts
        self.prompts = prompts[: e.num_prompts] if e.num_prompts else prompts
        s = trainer.sampler
        self.sampler = ODESampler(
            num_steps=e.num_steps, height=e.height or s.height, width=e.width or s.width,
            num_frames=e.num_frames or getattr(s, "num_frames", None),
            guidance_scale=e.guidance_scale if e.guidance_scale is not None else s.guidance_scale, scheduler=e.scheduler,
        )
        self.gold = build_rewards(e.gold_rewards, trainer.accelerator.device)

    def run(self, step: int | str) -> dict | None:
        from flowrl import evaluation
        from flowrl.checkpoint import step_dir_name

        tr, acc = self.trainer, self.trainer.accelerator
        result = None
        # FSDP2 gathers weights inside every forward, so every process runs the evaluation; only the main one keeps it
        if acc.is_main_process or tr.sharding.kind == "fsdp":
            label = "base" if step == "base" else step_dir_name(int(step))
            scratch = None if acc.is_main_process else tempfile.TemporaryDirectory()
            out = tr.run_dir / "eval" / label if scratch is None else Path(scratch.name) / label
            # EMA weights once they exist (before the first EMA update they are still the base weights)
            use_ema = (tr.cfg.eval.use_ema and tr.ema is not None and step != "base"
                       and tr.optimizer_steps >= tr.cfg.train.ema_every_n_steps)
            tr.model.transformer.eval()
            with (tr.ema_weights() if use_ema else contextlib.nullcontext()):
                result = evaluation.evaluate(
                    tr.model, {**tr.rewards, **self.gold}, out, prompts=self.prompts,
                    seeds=list(tr.cfg.eval.seeds), sampler=self.sampler, train_reward_names=list(tr.rewards),
                    step=0 if step == "base" else int(step), label=label, batch_size=tr.cfg.eval.batch_size,
                )
            if scratch is not None:
                scratch.cleanup()
                result = None
        acc.wait_for_everyone()
        return result


def save_state(trainer: GRPOTrainer) -> Path:
    from flowrl.checkpoint import save_checkpoint

    from flowrl.distributed import full

    tr, sharding = trainer, trainer.sharding
    # whole tensors for the main process, which writes them; under FSDP2 / ZeRO-2 gathering them is a collective
    # every process joins, data-parallel processes other than the main one skip the copy
    gather = sharding.kind is not None or tr.accelerator.is_main_process
    trainable = sharding.full_parameters(tr.names, tr.params) if gather else {}
    optimizer_state = sharding.optimizer_state(tr.optimizer, tr.names, tr.params, tr.optimizer_steps) if gather else {}
    ema = {k: full(v) for k, v in tr.ema.items()} if gather and tr.ema is not None else None
    return save_checkpoint(
        tr.accelerator, tr.run_dir, tr.step, trainable=trainable, optimizer_state=optimizer_state,
        lr_scheduler=tr.lr_scheduler, trainer_state=tr.trainer_state(), config_yaml=dump_config(tr.cfg), ema=ema,
        model=tr.model, keep_last=tr.cfg.checkpoint.keep_last,
    )


# ---------------------------------------------------------------------------------------------- small parts
def _timed(fn, *args):
    tic = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - tic


def _concat_rollouts(parts: list[Rollout]) -> Rollout:
    if len(parts) == 1:
        return parts[0]
    from flowrl.types import concat_cond

    first = parts[0]
    return Rollout(
        latents=torch.cat([p.latents for p in parts]), log_probs=torch.cat([p.log_probs for p in parts]), sigmas=first.sigmas,
        images=torch.cat([p.images for p in parts]), group_ids=torch.cat([p.group_ids for p in parts]),
        prompts=[x for p in parts for x in p.prompts], cond=concat_cond([p.cond for p in parts]),
        noise_levels=torch.cat([p.noise_levels for p in parts]), kind=first.kind, guidance_scale=first.guidance_scale,
        metadata=[x for p in parts for x in p.metadata],
    )


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a line cut by a crash: drop it


def _finite(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def _scalar_config(cfg: RunConfig) -> dict:
    from flowrl.config import flatten

    return {k: v for k, v in flatten(to_dict(cfg)).items() if isinstance(v, (int, float, str, bool))}


def _progress(cfg: RunConfig, acc, start: int):
    if not (cfg.logging.progress_bar and acc.is_main_process):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.num_steps, initial=start, desc=f"grpo {cfg.name}", unit="step", dynamic_ncols=True)
