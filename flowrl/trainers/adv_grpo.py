"""Adv-GRPO ("The Image as Its Own Reward"): GRPO's generator updates with an adversarial reward model trained during
RL, reference images its positives and the policy's samples its negatives. The math, its source and the choices made
where the source is silent: docs/recipes/adv_grpo.md.

    flowrl train configs/toy/adv_grpo.yaml
    accelerate launch scripts/train.py --config configs/sd3/adv_grpo_dino.yaml

GRPO's recipe (flowrl/trainers/grpo.py; Flow-GRPO-Fast is its sampler's SDE window) with reward `adversarial`
(flowrl/training/adversarial.py) scored beside the configured rewards, and an RM stage after stage 6:

    # 1-5.          GRPO's, every sample scored by the RM as it is at rollout time (one version per step)
    # 6a. Schedule  every_epoch / every_k_epochs / gate_ref_below_gen -> (update the generator?, step the RM?)
    # 6b. Optimise  GRPO's clipped ratio loss, where the schedule updates the generator
    # 6c. RM step   each sample paired with a reference of its prompt (a prompt without one is left out, counted);
    #               hinge loss over every process's pairs, gradients summed over processes; the version advances
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

import flowrl.trainers.kit as kit
from flowrl import seeds, work
from flowrl.config import RunConfig
from flowrl.trainers.grpo import GRPOConfig, grpo_composition_error, grpo_optimise, grpo_parts
from flowrl.training.adversarial import NAME, AdversarialConfig, AdversarialReward, References, schedule_step, validate
from flowrl.training.clock import timed

RM_GROUP = "adversarial_rm"  # the RM's head and Adam moments beside the weights


@dataclass
class AdvGRPOConfig(GRPOConfig):
    clip_range: float = 1e-5  # Adv-GRPO (Flow-GRPO-Fast): 1e-5
    adversarial: AdversarialConfig = field(default_factory=AdversarialConfig)
    """The adversarial reward model: backbone, references, schedule, head and its optimizer (keys
    train.adversarial.*)."""


class AdvGRPOTrainer:
    config_class = AdvGRPOConfig
    name = "adv_grpo"
    adapter_copies = 0  # the reward model is a head of its own, not an adapter of the policy
    full_reference_copy = False
    cfg_doubles_train_rows = True  # GRPO's transitions at the rollout's guidance: true CFG, both branches
    trains_on = "stochastic_steps"  # GRPO's transitions
    uses_behaviour_log_probs = True  # GRPO's ratio to the rollout's log-probs (kit.lossy_rollout_error)
    shapes_world: ClassVar[str] = (
        "its prompt-blind DINO-head reward lowers the held-out exact accuracy on every seed run (race seeds 0-2: "
        "6.2 / 18.8 / 21.9% from 32.8%; docs/recipes/adv_grpo.md#measured-on-the-shapes-world)"
    )

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        if "reward_gradients" in kit.balancer_needs(balancer):
            return (
                f"balancer {balancer.name} balances per-reward gradients of the configured rewards, and adv_grpo adds "
                "reward adversarial beside them: use balancer weighted_sum or gdpo with adv_grpo"
            )
        return grpo_composition_error(cls, sampler, balancer, train)

    def __init__(self, cfg: RunConfig, accelerator=None):
        a = cfg.train.adversarial
        validate(a)
        if any(r.name == NAME for r in cfg.rewards):
            raise ValueError(f"rewards lists {NAME!r}, the name of adv_grpo's own reward model: remove it from rewards")
        if a.references == "world" and cfg.model.path != "toy":
            raise ValueError(
                f"train.adversarial.references='world' renders the Shapes world, but model.path={cfg.model.path!r}: "
                "pass a JSON file mapping prompt -> reference images"
            )
        # the step's scorer: the configured rewards and the RM (scored, not evaluated)
        rm = {NAME: (lambda acc: AdversarialReward(a, cfg.seed, acc), a.weight)}
        self.parts = parts = grpo_parts(cfg, accelerator, type(self), extra_rewards=rm)
        self.rm = parts.extra_rewards[NAME]
        self.references = References(a.references)
        parts.counters.setdefault("rm_missing_references", 0)
        parts.kept[RM_GROUP] = self.rm  # its head and Adam moments (a tensor group) and version

    def train_step(self) -> dict[str, float]:
        parts, t, a = self.parts, self.parts.cfg.train, self.parts.cfg.train.adversarial
        acc, rm, version = parts.accelerator, self.rm, self.rm.version
        exp = kit.collect(parts)  # 1-5. prompts, rollout, score (the RM at `version`), gather, balance
        tic = timed(acc.device)
        images = exp.rollout.images  # [N, 3, H, W]
        index = exp.batch.global_index  # [N] places in the step's global batch
        keys = [seeds.reference_key(parts.cfg.seed, parts.step, int(i)) for i in index.tolist()]
        refs, rows = self.references(exp.batch.prompts, keys, tuple(images.shape[-2:]))
        missing = torch.tensor([float(len(images) - len(rows))], device=acc.device)
        missing = int(acc.reduce(missing, "sum").item()) if acc.num_processes > 1 else int(missing.item())
        parts.counters["rm_missing_references"] += missing

        # 6a. Schedule (the gate compares the RM's mean reward of every process's references and samples)
        ref_mean = gen_mean = float("nan")
        if a.schedule == "gate_ref_below_gen":
            with work.phase("train"):
                ref_scores = rm.score(refs) if refs is not None else torch.zeros(0, device=acc.device)
                work.METER.add("reward", NAME, len(rows))
            sums = torch.tensor([float(ref_scores.sum()), float(len(rows))], device=acc.device, dtype=torch.float64)
            sums = acc.reduce(sums, "sum") if acc.num_processes > 1 else sums
            ref_mean, gen_mean = (
                float(sums[0] / sums[1]) if sums[1] > 0 else float("inf"),
                exp.metrics[f"reward/{NAME}/mean"],
            )
        update_generator, update_rm = schedule_step(a.schedule, parts.step, a.d_times, ref_mean, gen_mean)

        # 6b. Optimise the generator (GRPO's stage 6) on the advantages of the RM at `version`
        metrics = dict(exp.metrics)
        if update_generator:
            if t.filter_zero_std:
                exp.keep &= exp.advantages != 0
            metrics |= grpo_optimise(parts, exp.rollout, exp.advantages, exp.keep, exp.per_reward)

        # 6c. RM step on (reference, sample) pairs, every process's pairs in one loss
        if update_rm:
            generated = images[rows] if rows else images[:0]
            references = refs if refs is not None else images[:0]
            work.METER.add("reward", NAME, 2 * len(rows))  # the backbone's forwards (the head's backward is negligible)
            total = parts.cfg.data.num_prompts_per_step * parts.cfg.data.group_size
            metrics |= rm.update(references, generated, index[rows], total)
        metrics |= {
            "train/generator_updated": float(update_generator),
            "train/rm_updated": float(update_rm and rm.version > version),
            "train/rm_version_scored": float(version),
            "train/rm_missing_references": float(missing),
            "train/rm_reference_mean": ref_mean,
        }
        return kit.finish_step(parts, exp, metrics, tic.seconds())  # 7. Log
