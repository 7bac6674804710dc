"""GRPO for flow-matching models (Flow-GRPO, DanceGRPO settings by config), as one recipe over the shared
components. The math is in docs/math.md, the recipe and its Flow-GRPO / DanceGRPO settings in
docs/recipes/grpo.md.

    accelerate launch scripts/train.py --config configs/toy/grpo.yaml
    flowrl train configs/toy/grpo.yaml train.learning_rate=1e-4

One training step = one rollout batch of B prompts x G samples over all processes, then its optimisation:

    # 1. Prompts    the step's B prompts, G seeds each; this process's slice of the B*G samples
    # 2. Rollout    the configured sampler -> latents of every step, behaviour log-probs (in chunks)
    # 3. Score      every reward on the decoded images (a worker thread overlaps the next chunk)
    # 4. Gather     scores of all processes -> [B*G] per reward
    # 5. Balance    advantages per sample (balancer); failed samples and, on request, zero advantages dropped
    # 6. Optimise   per inner epoch, minibatch, trained transition: recompute the log-prob, clipped ratio
    #               loss + KL to the reference (adapter disabled); the optimizer step; EMA
    # 7. Log/Eval   metrics.jsonl + trackers, eval every n steps, checkpoint every n steps

Only the clipped-ratio optimisation (stage 6) is GRPO's own; everything else is a component call.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.advantages import FUSIONS, WIDTH_PRUNINGS, tree_edge_advantages
from flowrl.balancers import weighted_total
from flowrl.config import RunConfig
from flowrl.experimental.tagrpo import Alignment, MemoryBank, TAGRPOConfig, alignment_loss, start_key
from flowrl.losses import ais_mixture, clipped_policy_loss
from flowrl.models import build_policy
from flowrl.registry import BALANCERS, SAMPLERS
from flowrl.samplers.candidates import candidate_metrics
from flowrl.sigma_range import check_trainable, on_trainable_steps
from flowrl.trainers.kit import balancer_needs, rollout_carries
from flowrl.training.checkpoint import read_group, resume_recipe, save_recipe
from flowrl.training.distributed import Sharding, kept_per_process, make_accelerator
from flowrl.training.evaluation import TrainingEvaluation
from flowrl.training.loop import step_metrics, timed, train_loop
from flowrl.training.optim import EMA, OptimizerConfig, OptimizerStep
from flowrl.training.prompts import step_batches
from flowrl.training.reward_gradients import RewardGradients
from flowrl.training.runs import RunFolder
from flowrl.training.scoring import Scorer, balance_per_reward, build_rewards, rollout_and_score
from flowrl.types import Rollout, select_cond


@dataclass
class TreeCreditConfig:
    """Credit assignment of tree rollouts (sampler `tree`, docs/recipes/grpo.md#tree-rollouts); ignored otherwise."""

    fusion: str = "mean"
    """A node's value from its leaves: 'mean' (BranchGRPO's default) or 'path_probability' (children weighted by
    softmax(fusion_temperature · edge log-prob))."""
    fusion_temperature: float = 1.0
    width_pruning: str = "none"
    """Edges after the last split that train: 'none', 'per_branch' (the best width_pruning_ratio of each branch
    of the last split) or 'best_worst' (the best and worst halves of width_pruning_ratio per tree)."""
    width_pruning_ratio: float = 0.5
    depth_pruning: list[int] = field(default_factory=list)
    """Edges into these depths do not train (e.g. [15, 16, 17, 18] of 20 steps)."""
    depth_pruning_slide_every_n_steps: int = 0
    """> 0: the pruned depths move one level shallower every this many training steps, down to the stop depth."""
    depth_pruning_stop_depth: int | None = None
    """Shallowest pruned depth of the sliding window; None = the last split step."""
    pruning_step_ratio: float = 1.0
    """Prune during the first this fraction of `num_steps` training steps only."""

    def __post_init__(self) -> None:
        if self.fusion not in FUSIONS:
            raise ValueError(f"train.tree.fusion={self.fusion!r} must be one of {', '.join(FUSIONS)}")
        if self.width_pruning not in WIDTH_PRUNINGS:
            raise ValueError(f"train.tree.width_pruning={self.width_pruning!r} must be one of {', '.join(WIDTH_PRUNINGS)}")
        if not 0 < self.width_pruning_ratio <= 1:
            raise ValueError(f"train.tree.width_pruning_ratio={self.width_pruning_ratio} must be in (0, 1]")


@dataclass
class AISConfig:
    """Adaptive importance sampling for rollouts drawn by another policy than the one trained (sampler candidates with
    train_on: previews): the ratio is taken against the policy at rollout time, and the advantage is scaled by
    flowrl.losses.ais_mixture's mixture of the uncorrected and the importance-weighted gradient (docs/math.md)."""

    enabled: bool = False
    max_weight: float = 5.0
    """Truncation of the self-normalised importance weights w / mean(w)."""

    def __post_init__(self) -> None:
        if not self.max_weight >= 1.0:
            raise ValueError(f"train.ais.max_weight={self.max_weight} must be >= 1 (the weights are normalised to mean 1)")


@dataclass
class GRPOConfig(OptimizerConfig):
    clip_range: float = 1e-4
    """PPO ε on the ratio of per-element-mean log-probs (Flow-GRPO 1e-4, Fast 1e-5, Wan 1e-3)."""
    kl_coef: float = 0.0
    """β of the KL to the reference model (the adapter switched off); 0 skips the reference forward."""
    kl_form: str = "code"
    """'code' (mean over elements / 2g², the form published β values assume) or 'paper' (sum / 2s²)."""
    timestep_fraction: float = 1.0
    """Train on this fraction of each sample's *stochastic* transitions (DanceGRPO 0.6). Flow-GRPO's 0.99 of
    T = 10 trains 9 transitions, all but the last: here the sampler already makes the last one deterministic,
    so the same setting is 1.0."""
    shuffle_timesteps: bool = False
    """Pick the trained transitions by a per-sample random permutation (DanceGRPO) instead of in order."""
    num_inner_epochs: int = 1
    num_minibatches: int = 1
    """The step's local samples are split into this many minibatches."""
    gradient_accumulation_steps: int = 1
    """Minibatches per optimizer step (must divide num_minibatches)."""
    num_rollout_batches: int = 1
    """Rollouts are generated in this many chunks; rewards of one chunk are scored while the next is sampled.
    Keep chunk and minibatch the same size (num_rollout_batches = num_minibatches) for exact first-pass ratios
    on accelerators, whose kernels may round differently at another batch size."""
    use_async_rewards: bool = True
    """Score rewards in a worker thread, overlapping the next rollout chunk."""
    filter_zero_std: bool = False
    """Drop samples whose advantage is exactly 0 (a group with no reward spread) from the loss, which is then
    normalised by the kept samples (Flow-GRPO)."""
    tree: TreeCreditConfig = field(default_factory=TreeCreditConfig)
    """Reward fusion, depth-wise advantages and pruning of tree rollouts (keys train.tree.*)."""
    tagrpo: TAGRPOConfig = field(default_factory=TAGRPOConfig)
    """TAGRPO's trajectory alignment and memory bank for image-to-video (keys train.tagrpo.*, flowrl/experimental/tagrpo.py)."""
    ais: AISConfig = field(default_factory=AISConfig)
    """Adaptive importance sampling of preview rollouts (keys train.ais.*; off by default)."""


BANK_GROUP = "tagrpo_bank"  # the checkpoint file of TAGRPO's memory bank (<group>.safetensors)


class Credit(NamedTuple):
    """What stage 6 trains: an advantage per transition and the transitions themselves."""

    advantages: torch.Tensor  # [N, T] float32, per (sample, step)
    transitions: torch.Tensor  # [M, 2] int64 (sample, step) pairs to train
    shared_by: torch.Tensor  # [N] int64: rows with one id share their transitions' weight (a tree's leaves)


def transition_advantages(
    rollout: Rollout, advantages: torch.Tensor, keep: torch.Tensor, cfg: GRPOConfig, step: int, num_steps: int
) -> Credit:
    """Per-transition advantages: a tree rollout's depth-wise edge advantages (its leaves' advantages fused up the
    tree, docs/recipes/grpo.md#tree-rollouts) on its unpruned edges; any other rollout's per-sample advantages on
    every transition of its table."""
    n = len(rollout.prompts)
    if "tree_nodes" not in rollout.extras:
        return Credit(advantages[:, None].expand(-1, rollout.num_steps), rollout.transitions, torch.arange(n))
    leaf_values = torch.where(keep, advantages, torch.full_like(advantages, float("nan")))  # dropped leaves: no value
    prune = step < int(num_steps * cfg.tree.pruning_step_ratio)
    options = {k: v for k, v in asdict(cfg.tree).items() if k != "pruning_step_ratio"}
    extras = rollout.extras
    edge_advantages, train = tree_edge_advantages(
        extras["tree_nodes"],
        rollout.group_ids,
        leaf_values,
        rollout.log_probs,
        rollout.transitions,
        extras["split_steps"],
        prune=prune,
        step=step,
        **options,
    )
    return Credit(edge_advantages.to(advantages.device), rollout.transitions[train], rollout.group_ids.cpu().to(torch.int64))


def trained_transitions(
    table: torch.Tensor, num_samples: int, fraction: float, shuffle: bool, generator: torch.Generator
) -> list[list[int]]:
    """Per sample, the steps to train on: its first `fraction` of the table's transitions, or a random subset."""
    steps: list[list[int]] = [[] for _ in range(num_samples)]  # table [M, 2] (sample, step), sample-major
    for i, k in table.tolist():
        steps[i].append(k)
    out = []
    for row in steps:
        if shuffle:
            row = [row[j] for j in torch.randperm(len(row), generator=generator).tolist()]
        out.append(row[: max(1, int(len(row) * fraction + 1e-6))] if row else [])
    if not any(out):
        raise ValueError("the rollout has no stochastic transitions (std > 0): set sampler.noise_level > 0")
    return out


def shared_counts(steps: list[list[int]], shared_by: torch.Tensor) -> torch.Tensor:
    """[N] the transition count each row's transitions are averaged by: its own, or the mean over the rows that
    share its id (a tree's leaves share its edges, so that every edge of a tree weighs the same)."""
    lengths = torch.tensor([len(s) for s in steps], dtype=torch.float32)  # [N]
    _, unit = torch.unique(shared_by, return_inverse=True)
    total = torch.zeros(int(unit.max()) + 1).index_add_(0, unit, lengths)
    rows = torch.zeros(int(unit.max()) + 1).index_add_(0, unit, torch.ones_like(lengths))
    return (total / rows)[unit]


class TransitionInputs(NamedTuple):
    """What re-scoring transitions k of rows `index` needs, each [b, ...]."""

    cond: dict
    x: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    level: torch.Tensor
    scale: torch.Tensor | None  # a tree's split-noise scale, None for other rollouts


def transition_inputs(rollout: Rollout, sigmas: torch.Tensor, index: torch.Tensor, k: torch.Tensor) -> TransitionInputs:
    """Conditioning, states x_k -> x_{k+1}, σ_k, σ_{k+1}, noise level and std scale of transitions k of rows index."""
    scale = rollout.std_scales[index, k] if rollout.std_scales is not None else None
    states = rollout.states(index, k), rollout.states(index, k + 1)
    return TransitionInputs(
        select_cond(rollout.cond, index), *states, sigmas[k], sigmas[k + 1], rollout.noise_levels[index, k], scale
    )


def same_on_every_process(acc, lengths: list[int]) -> bool:
    """Whether every process has these per-sample transition counts. The minibatch order is the same permutation on
    every process (one step generator), so equal counts mean the same backward calls (what FSDP2 / ZeRO-2 need),
    even where a process's own samples differ (a tree's leaves own different numbers of its edges)."""
    if acc.num_processes == 1:
        return True
    gathered = acc.gather(torch.tensor(lengths, device=acc.device)).view(acc.num_processes, -1)
    return bool((gathered == gathered[0]).all())


class GRPOTrainer:
    config_class = GRPOConfig

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        carries, needs = rollout_carries(sampler), balancer_needs(balancer)
        if "log_probs" not in carries:
            return (
                f"trainer: grpo needs behaviour log-probs, which the rollouts of sampler {sampler.name} lack (deterministic "
                "transitions): use sampler sde or tree with noise_level > 0, or candidates with full: {name: sde}"
            )
        if "affine_loss" in needs:
            return (
                f"balancer {balancer.name}: form='amortized' needs a loss affine in the advantage (trainer nft); GRPO's "
                "clipped ratio loss is not affine in the advantage, so Σ α_k ∇ℓ(A_k) ≠ ∇ℓ(Σ α_k A_k): set balancer.form=full"
            )
        if "per_sample_advantages" in needs and "per_edge" in carries:
            return (
                f"balancer {balancer.name} trains per-sample advantages; the {sampler.name} sampler's are per edge: use "
                "sampler sde"
            )
        tagrpo = getattr(train, "tagrpo", None)
        if tagrpo is not None and tagrpo.enabled:
            if sampler.name != "sde" or not sampler.kwargs.get("same_latent", False):
                return (
                    f"train.tagrpo aligns group members that share their initial noise, which sampler {sampler.name} "
                    f"(same_latent={sampler.kwargs.get('same_latent', False)}) does not give: use sampler sde with "
                    "same_latent: true"
                )
        return None

    def __init__(self, cfg: RunConfig, accelerator=None):
        from accelerate.utils import set_seed

        self.cfg, t = cfg, cfg.train
        if t.kl_form not in sde.KL_FORMS:
            raise ValueError(f"train.kl_form={t.kl_form!r} must be one of {', '.join(sde.KL_FORMS)}")
        if t.kl_coef > 0 and not cfg.model.use_lora:
            raise ValueError("train.kl_coef > 0 needs model.use_lora=true (the reference is the adapter switched off)")
        why = self.composition_error(cfg.sampler, cfg.balancer, t, cfg.rewards)
        if why:
            raise ValueError(why)
        self.accelerator = acc = accelerator or make_accelerator(cfg)
        self.run = RunFolder(cfg.output_dir, cfg.name)
        self.sampler = SAMPLERS.get(cfg.sampler.name)(**cfg.sampler.kwargs)
        # TAGRPO aligns a group's members with each other: every group on one process
        self.prompt_sampler, self.local_n = step_batches(cfg, self.sampler, acc.num_processes, t.tagrpo.enabled)
        if Sharding(acc).kind is not None and cfg.sampler.name == "tree" and t.tree.width_pruning != "none":
            raise ValueError(
                f"train.tree.width_pruning={t.tree.width_pruning!r} prunes each process's edges by its own advantages, so "
                "the processes would run different backward calls, which FSDP2 / ZeRO-2 cannot; set it to 'none'"
            )
        if t.num_minibatches != t.num_rollout_batches:
            warnings.warn(
                f"rollout chunks of {self.local_n // t.num_rollout_batches} samples but minibatches of "
                f"{self.local_n // t.num_minibatches}: on accelerators the first-pass ratio may differ from 1 "
                "by rounding; set train.num_minibatches = train.num_rollout_batches",
                stacklevel=2,
            )
        set_seed(cfg.seed)  # every process starts from the same adapter
        self.model = build_policy(cfg.model, acc.device, sharded=Sharding(acc).kind == "fsdp")  # FSDP2: loaded for sharding
        check_trainable("grpo", self.sampler, self.model)  # a window on a frozen expert's steps trains nothing
        self.opt = OptimizerStep(acc, self.model.transformer, t, self.local_n // t.num_minibatches, cfg.model.mixed_precision)
        self.ema = EMA(self.opt.names, self.opt.params, t.ema_decay, t.ema_every_n_steps, t.ema_mode) if t.use_ema else None
        self.rewards = build_rewards(cfg.rewards, acc.device)
        self.weights = {r.name: r.weight for r in cfg.rewards}
        self.scorer = Scorer(self.rewards, cfg.on_reward_error, t.use_async_rewards)
        self.balancer = BALANCERS.get(cfg.balancer.name)(**cfg.balancer.kwargs)
        marble = self.balancer if cfg.balancer.name == "marble" else None
        # MARBLE's full form only: the clipped ratio loss is not affine in the advantage (RewardGradients says so)
        self.reward_grads = RewardGradients(marble, self.opt, acc, list(self.rewards), False, None, False)
        self.evaluation = TrainingEvaluation(cfg, acc, self.run, self.model, self.rewards, self.opt, self.ema)
        self.step = 0
        self.counters = {"reward_errors": 0}
        self.bank = MemoryBank(t.tagrpo)  # TAGRPO's past rollouts (empty unless train.tagrpo.bank_size > 0)
        if t.tagrpo.enabled and t.tagrpo.bank_size > 0 and acc.num_processes > 1:
            raise ValueError(
                f"train.tagrpo.bank_size={t.tagrpo.bank_size} keeps each process's own rollouts, which one checkpoint "
                f"cannot hold for {acc.num_processes} processes yet; set train.tagrpo.bank_size=0 or run one process"
            )

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        t, acc, model = self.cfg.train, self.accelerator, self.model
        started = timed(acc.device)

        # 1. Prompts
        batch = self.prompt_sampler.local_batch(self.step, acc.process_index, acc.num_processes)

        # 2. Rollout (in chunks) and 3. Score (overlapping the next chunk in a worker thread)
        rollout, local, rollout_s = rollout_and_score(
            self.sampler, model, batch, self.scorer, t.num_rollout_batches, self.step, self.weights
        )

        # 4. Gather and 5. Balance: advantages [N] of this process's samples, failed samples kept out
        local_adv, per_reward, keep, metrics, errors = balance_per_reward(acc, local, batch, self.balancer, self.weights)
        self.counters["reward_errors"] += errors
        metrics.update(candidate_metrics(rollout))
        if t.filter_zero_std:
            keep &= local_adv != 0

        # 6. Optimise (eval mode kept: the recomputed log-probs must equal the rollout's on the first pass)
        tic = timed(acc.device)
        alignment = self._alignment(rollout, batch, local, keep) if t.tagrpo.enabled else None
        metrics.update(
            self._optimise(rollout, local_adv.to(acc.device), keep.to(acc.device), per_reward.to(acc.device), alignment)
        )
        optimise_s = tic.seconds()

        # 7. Log
        wall = started.seconds()
        samples = self.local_n * acc.num_processes
        metrics.update(step_metrics(wall, rollout_s, local.seconds, optimise_s, samples, errors, keep.sum()))
        self.step += 1
        return metrics

    def _alignment(self, rollout: Rollout, batch, local, keep: torch.Tensor) -> Alignment:
        """TAGRPO's targets for this step: the combined training reward of every local sample (whole groups), its
        start key (prompt, source image, shared initial-noise seed) and the bank."""
        combined = weighted_total(local.scores, self.weights)  # [N] Σ_k w_k r_k, NaN where no reward applies
        latent_seeds = batch.group_seeds if batch.group_seeds is not None else batch.seeds
        keys = [start_key(p, m, s) for p, m, s in zip(batch.prompts, batch.metadata, latent_seeds.tolist())]
        alignment = Alignment(self.cfg.train.tagrpo, self.bank)
        alignment.prepare(rollout, combined, keep.cpu() & ~local.failed, keys, self.step)
        return alignment

    def _optimise(
        self,
        rollout: Rollout,
        advantages: torch.Tensor,
        keep: torch.Tensor,
        per_reward: torch.Tensor,
        alignment: Alignment | None = None,
    ) -> dict:
        """Clipped ratio loss (+ β KL) over each sample's trained transitions; every sample weighs 1 / (its
        transition count) within the minibatch's kept samples, averaged over the accumulated minibatches. The
        leaves of a tree share its edges: each edge of a tree weighs 1 / (the tree's mean edge count per leaf).
        MARBLE (per_reward [K, N]): each reward's clipped loss backpropagated on its own, the KL outside them."""
        t, acc, model, grads = self.cfg.train, self.accelerator, self.model, self.reward_grads
        n = self.local_n
        gen = seed_formulas.step_generator(self.cfg.seed, self.step)
        credit = transition_advantages(rollout, advantages, keep, t, self.step, self.cfg.num_steps)
        credit = credit._replace(transitions=on_trainable_steps(credit.transitions, rollout.sigmas, model))
        steps = trained_transitions(credit.transitions, n, t.timestep_fraction, t.shuffle_timesteps, gen)
        counts = shared_counts(steps, credit.shared_by).to(acc.device)  # [N]
        if self.opt.sharding.kind is not None and not same_on_every_process(acc, [len(s) for s in steps]):
            raise ValueError(
                "the processes train different numbers of transitions per sample, which FSDP2 / ZeRO-2 cannot (every "
                "process must run the same backward calls); use equal SDE windows"
            )
        mb, accum = n // t.num_minibatches, t.gradient_accumulation_steps
        sigmas = rollout.sigmas.to(acc.device)
        orders = [torch.randperm(n, generator=gen) for _ in range(t.num_inner_epochs)]
        # AIS: log-probs of the policy at rollout time (the ratio's reference) and the advantage coefficients
        old_log_probs, coef, ais_stats = rollout.log_probs, None, {}
        if t.ais.enabled:
            old_log_probs, coef, ais_stats = self._ais(rollout, steps, keep, orders[0], mb)
        stats: dict[str, list[torch.Tensor]] = {k: [] for k in ("loss", "policy_loss", "kl", "ratio", "clipped", "approx_kl")}
        align = {k: [] for k in ("loss", "attract", "repel", "bank_partners")}  # TAGRPO's terms, where enabled
        ta = t.tagrpo
        for order in orders:
            for m in range(t.num_minibatches):
                if m % accum == 0:
                    window = len(stats["loss"])  # this optimizer step's losses start here
                    grads.plan(per_reward[:, order[m * mb : (m + accum) * mb].to(acc.device)])
                rows = order[m * mb : (m + 1) * mb].tolist()
                kept = kept_per_process(acc, keep[rows].sum())  # the mean over all processes' kept rows
                depth = max((len(steps[i]) for i in rows), default=0)  # a tree row may own no trained edge
                for j in range(depth):
                    sel = [i for i in rows if len(steps[i]) > j]
                    index = torch.tensor(sel, device=acc.device)  # [b]
                    k = torch.tensor([steps[i][j] for i in sel], device=acc.device)  # [b] transition per sample
                    weight = keep[index].float() / counts[index]  # [b]
                    cond, x, x_next, sigma, sigma_next, level, scale = transition_inputs(rollout, sigmas, index, k)
                    v = model.velocity(x, sigma, cond, rollout.guidance_scale)
                    v_ref = None
                    if t.kl_coef > 0:
                        with torch.no_grad(), model.adapter_disabled():
                            v_ref = model.velocity(x, sigma, cond, rollout.guidance_scale)
                    log_prob, kl = sde.rescore_transition(
                        rollout.rule, v, x, x_next, sigma, sigma_next, level, v_ref, t.kl_form, scale
                    )
                    kl = kl if kl is not None else torch.zeros_like(log_prob)
                    regulariser = t.kl_coef * kl  # [b] the terms outside the advantage (and outside MARBLE's balancing)
                    if alignment is not None:  # TAGRPO: the step mean pulled toward better members' next latents
                        _, _, mean, std = rollout.rule.step(v, x, sigma, sigma_next, level, prev_sample=x_next, std_scale=scale)
                        z_pos, has_pos, z_neg, has_neg, partners = alignment.targets(index, k)
                        ta_loss, d_pos, d_neg = alignment_loss(
                            mean, std, z_pos, has_pos, z_neg, has_neg, ta.repel, ta.repel_clip, ta.distance
                        )
                        regulariser = regulariser + ta.coef * ta_loss
                        align["loss"].append(ta_loss.detach().mean())
                        align["attract"].append(d_pos[has_pos].mean() if has_pos.any() else d_pos.new_zeros(()))
                        align["repel"].append(d_neg[has_neg].mean() if has_neg.any() else d_neg.new_zeros(()))
                        align["bank_partners"].append(partners.mean())
                    old = old_log_probs[index, k]
                    c = coef[index, k] if coef is not None else 1.0  # AIS's mixture coefficient per transition
                    policy_loss, s = clipped_policy_loss(log_prob, old, credit.advantages[index, k] * c, t.clip_range)
                    per_sample = policy_loss + regulariser  # [b]
                    boundary = j == depth - 1 and (m + 1) % accum == 0
                    if grads.mode != "single":  # MARBLE: each reward's clipped loss on its own, the KL outside them

                        def policy(a, log_prob=log_prob, old=old, weight=weight, c=c):
                            return (clipped_policy_loss(log_prob, old, a * c, t.clip_range)[0] * weight).sum() / kept / accum

                        outside = t.kl_coef > 0 or alignment is not None
                        kl_loss = (regulariser * weight).sum() / kept / accum if outside else None
                        grads.backward(policy, per_reward[:, index], kl_loss, boundary)
                    if grads.single:
                        self.opt.backward((per_sample * weight).sum() / kept / accum, boundary=boundary)
                    stats["loss"].append(per_sample.detach().mean())
                    stats["policy_loss"].append(policy_loss.detach().mean())
                    stats["kl"].append(kl.detach().mean())
                    for key in ("ratio", "approx_kl"):
                        stats[key].append(s[key])
                    stats["clipped"].append(s["clipped"].float())
                losses = stats["loss"][window:] or [torch.zeros((), device=acc.device)]
                if (m + 1) % accum == 0:
                    grads.finish()  # MARBLE: the per-reward gradients combined into .grad
                    if self.opt.step(torch.stack(losses)) and self.ema is not None:
                        self.ema.update(self.opt.params, self.opt.optimizer_steps)
        ratio = torch.cat(stats["ratio"])
        if alignment is not None:
            alignment.remember(steps)  # after the step: a start's bank partners are always from earlier steps
            tagrpo_metrics = {f"train/tagrpo_{k}": float(torch.stack(v).mean()) for k, v in align.items() if v}
            tagrpo_metrics["train/tagrpo_bank_entries"] = float(len(self.bank))
        else:
            tagrpo_metrics = {}
        return {
            "train/loss": float(torch.stack(stats["loss"]).mean()),
            "train/policy_loss": float(torch.stack(stats["policy_loss"]).mean()),
            "train/kl": float(torch.stack(stats["kl"]).mean()),
            "train/clip_fraction": float(torch.cat(stats["clipped"]).mean()),
            "train/approx_kl": float(torch.cat(stats["approx_kl"]).mean()),
            "train/ratio_mean": float(ratio.mean()),
            "train/ratio_min": float(ratio.min()),
            "train/ratio_max": float(ratio.max()),
            **self.opt.metrics(),
            **grads.metrics(),
            **tagrpo_metrics,
            **ais_stats,
        }

    @torch.no_grad()
    def _ais(self, rollout: Rollout, steps: list[list[int]], keep: torch.Tensor, order: torch.Tensor, mb: int):
        """AIS before any optimizer step: the policy's log-prob of every trained transition, in the first epoch's
        minibatches (the batch shapes of the first pass, so that its ratios are exactly 1), and ais_mixture's
        coefficients from the log-weights (policy − behaviour) of the kept samples' transitions (over all processes)."""
        acc, model = self.accelerator, self.model
        sigmas = rollout.sigmas.to(acc.device)
        prox = rollout.log_probs.clone().to(acc.device)  # [N, T]
        for m in range(len(order) // mb):
            rows = order[m * mb : (m + 1) * mb].tolist()
            for j in range(max((len(steps[i]) for i in rows), default=0)):
                sel = [i for i in rows if len(steps[i]) > j]
                index = torch.tensor(sel, device=acc.device)
                k = torch.tensor([steps[i][j] for i in sel], device=acc.device)
                cond, x, x_next, sigma, sigma_next, level, scale = transition_inputs(rollout, sigmas, index, k)
                v = model.velocity(x, sigma, cond, rollout.guidance_scale)
                log_prob, _ = sde.rescore_transition(rollout.rule, v, x, x_next, sigma, sigma_next, level, None, "code", scale)
                prox[index, k] = log_prob.to(prox.dtype)
        kept = keep.cpu().tolist()  # one transfer, not a device sync per transition
        pairs = [(i, k) for i, row in enumerate(steps) for k in row if kept[i]]
        rows_i = torch.tensor([i for i, _ in pairs], dtype=torch.int64, device=acc.device)
        rows_k = torch.tensor([k for _, k in pairs], dtype=torch.int64, device=acc.device)
        behaviour = rollout.log_probs.to(acc.device)
        log_w = (prox[rows_i, rows_k] - behaviour[rows_i, rows_k]).double()
        reduce = (lambda t: acc.reduce(t, reduction="sum")) if acc.num_processes > 1 else None
        c, stats = ais_mixture(log_w, self.cfg.train.ais.max_weight, reduce)
        coef = torch.ones_like(prox, dtype=torch.float32)
        coef[rows_i, rows_k] = c
        return prox, coef, stats

    # ------------------------------------------------------------------------------------------ state
    def save(self):
        extra, groups = {"reward_gradients": self.reward_grads.state_dict()}, None
        if self.cfg.train.tagrpo.bank_size > 0:  # TAGRPO's memory bank: its latents beside the weights
            tensors, extra["tagrpo_bank"] = self.bank.state()
            groups = {BANK_GROUP: tensors}
        return save_recipe(self, groups=groups, extra=extra)

    def resume(self, path) -> None:
        state = resume_recipe(self, path)
        if "reward_gradients" in state:  # MARBLE's ᾱ and refresh clock
            self.reward_grads.load_state_dict(state["reward_gradients"])
        if self.cfg.train.tagrpo.bank_size > 0:
            self.bank.load(read_group(path, BANK_GROUP), state["tagrpo_bank"])

    def evaluate(self, step: int | None) -> dict | None:
        """The fixed evaluation of the current weights (EMA once an EMA update happened); None = the base model."""
        return self.evaluation(step)

    # ------------------------------------------------------------------------------------------ loop
    def train(self) -> dict:
        """Run to cfg.num_steps: resume, base eval, steps with logging/eval/checkpoints, final eval."""
        return train_loop(self, "grpo")
