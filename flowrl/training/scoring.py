"""Reward scoring for every recipe: build the configured rewards, score chunks (optionally in a worker thread
overlapping the next rollout chunk), apply the one reward-error policy, gather over processes.

    scorer = Scorer(build_rewards(cfg.rewards, device), policy=cfg.on_reward_error, use_async=True)
    scorer.submit(rollout.images, rollout.prompts, rollout.metadata, offset=0)   # per rollout chunk
    local = scorer.collect()                                                     # Scores of this process
    scores, failed, group_ids = gather_scores(accelerator, local, batch.group_ids)

Policy (the Reward contract, flowrl/reward_contract.py): NaN is "not applicable" (the sample takes no part in that
reward). An exception, a wrong length or an infinite score is an error: raised (`raise`), or, with `skip_sample`, only
the samples that fail on their own are dropped (the chunk is re-scored sample by sample to find them); a
dropped sample has NaN in every reward and `failed` set, and the trainer gives it no loss.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from flowrl import work
from flowrl.advantages import group_advantages
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_scores, score_checked
from flowrl.training.clock import timed
from flowrl.types import RewardOutput, Rollout

POLICIES = ("raise", "skip_sample")


def build_rewards(specs, device) -> dict[str, Any]:
    """{name: reward} from RewardConfig entries (name + constructor kwargs): each on its `device` (None: the run's
    `device`; `cuda` alone: this process's GPU), in its `dtype` (None: the reward's default, float32), scored in
    chunks of `batch_size` samples when set."""
    from flowrl.models import parse_dtype

    rewards = {}
    for spec in specs:
        run = torch.device(device)
        where = getattr(spec, "device", None)
        here = run if where is None or (where == run.type and run.index is not None) else torch.device(where)
        options = {"dtype": parse_dtype(spec.dtype)} if getattr(spec, "dtype", None) is not None else {}
        if _STAND_IN:
            reward = StandInReward(REWARDS.get(spec.name), spec.name)
        else:
            reward = REWARDS.get(spec.name)(device=here, **options, **spec.kwargs)
        size = getattr(spec, "batch_size", None)
        rewards[spec.name] = MeteredReward(BatchedReward(reward, size) if size is not None else reward, spec.name)
    return rewards


class _RewardWrapper:
    """A wrapper around a reward (`self.reward`): every attribute it lacks (registry_name, modalities,
    differentiable, the model) is the wrapped reward's."""

    def __getattr__(self, name: str) -> Any:  # only for names the wrapper lacks
        if name == "reward":  # not yet set (copy, unpickling)
            raise AttributeError(name)
        return getattr(self.reward, name)


_STAND_IN = False


@contextlib.contextmanager
def standing_in():
    """Inside the block `build_rewards` builds stand-ins (StandInReward) instead of the configured rewards: how
    `flowrl plan` runs a config's step without loading a reward model."""
    global _STAND_IN
    before, _STAND_IN = _STAND_IN, True
    try:
        yield
    finally:
        _STAND_IN = before


class StandInReward:
    """A configured reward's stand-in for `flowrl plan`: no weights; deterministic scores in [0, 1) that differ
    between samples (so ranking and group statistics run as they would), differentiable where the real reward is;
    the work meter counts its calls as the real reward's."""

    def __init__(self, cls: Any, name: str):
        self.registry_name, self.modalities = name, getattr(cls, "modalities", ("image",))
        self.differentiable = bool(getattr(cls, "differentiable", False))

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        spread = torch.tensor(
            [(zlib.crc32(p.encode()) % 997) / 997.0 for p in prompts], dtype=torch.float32, device=images.device
        )
        spread = (spread + torch.arange(len(prompts), device=images.device) * 0.6180339887) % 1.0
        mean = images.float().mean(dim=tuple(range(1, images.ndim)))  # [N]: the graph a gradient flows through
        return RewardOutput(scores=spread + 0.0 * mean)


class MeteredReward(_RewardWrapper):
    """A reward whose calls the work meter counts (flowrl.work.scored: images, and the backward through the reward
    where a recipe takes its gradient). Every other attribute is the wrapped reward's."""

    def __init__(self, reward: Any, name: str):
        self.reward, self.metered_name = reward, name

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        out = self.reward(images, prompts, metadata)
        work.scored(self.metered_name, images, out)
        return out


class BatchedReward(_RewardWrapper):
    """A reward called on at most `batch_size` samples at a time; scores and parts concatenated in order. Every
    other attribute (registry_name, modalities, differentiable, the model) is the wrapped reward's."""

    def __init__(self, reward: Any, batch_size: int):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} must be a whole number >= 1 (samples per reward call)")
        self.reward, self.batch_size = reward, batch_size

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> RewardOutput:
        b = self.batch_size
        if len(prompts) <= b:
            return self.reward(images, prompts, metadata)
        chunks = [
            self.reward(images[i : i + b], prompts[i : i + b], None if metadata is None else metadata[i : i + b])
            for i in range(0, len(prompts), b)
        ]
        parts = {
            key: torch.cat([c.parts[key] for c in chunks])
            for key in chunks[0].parts
            if all(key in c.parts for c in chunks)
        }
        return RewardOutput(scores=torch.cat([c.scores for c in chunks]), parts=parts)


@dataclass
class Scores:
    """One record of a scoring pass over n samples."""

    scores: dict[str, torch.Tensor]  # {name: [n] float32 on the CPU}; NaN = not applicable or failed
    failed: torch.Tensor  # [n] bool: dropped by the skip_sample policy
    errors: dict[str, int] = field(default_factory=dict)  # failing samples per reward
    seconds: float = 0.0  # wall time of the scoring calls

    @classmethod
    def concat(cls, parts: list[Scores]) -> Scores:
        names = list(parts[0].scores)
        errors = {name: sum(p.errors.get(name, 0) for p in parts) for name in names}
        return cls(
            {name: torch.cat([p.scores[name] for p in parts]) for name in names},
            torch.cat([p.failed for p in parts]),
            {k: v for k, v in errors.items() if v},
            sum(p.seconds for p in parts),
        )


def _score_each(reward, images, prompts, metadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample by sample: (scores [n] with NaN where it failed, failed [n] bool)."""
    name = getattr(reward, "registry_name", type(reward).__name__)
    values, failed = [], []
    for i in range(len(prompts)):
        try:
            out = reward(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1])
            value = check_scores(name, out.scores, 1).detach().float().cpu()[0]
            failed.append(False)
        except Exception:  # noqa: BLE001 - one policy for every reward failure
            value = torch.tensor(float("nan"))
            failed.append(True)
        values.append(value)
    return torch.stack(values), torch.tensor(failed)


def score_batch(
    rewards: dict[str, Any],
    images: torch.Tensor,
    prompts: list[str],
    metadata: list[dict],
    policy: str,
    offset: int = 0,
) -> Scores:
    """Score one chunk with every reward under the error policy; `offset` places the chunk in error messages."""
    if policy not in POLICIES:
        raise ValueError(f"on_reward_error={policy!r} must be 'raise' or 'skip_sample'")
    tic = time.perf_counter()
    n = len(prompts)
    out, errors, failed = {}, {}, torch.zeros(n, dtype=torch.bool)
    for name, reward in rewards.items():
        try:
            out[name] = score_checked(reward, images, prompts, metadata).scores.detach().float().cpu()
        except Exception as err:  # noqa: BLE001 - one policy for every reward failure
            if policy == "raise":
                raise RuntimeError(
                    f"reward {name!r} failed on local samples {offset}..{offset + n - 1}: {err}"
                ) from err
            out[name], bad = _score_each(reward, images, prompts, metadata)
            errors[name] = int(bad.sum())
            failed |= bad
    for name in out:
        out[name] = torch.where(failed, torch.full_like(out[name], float("nan")), out[name])
    return Scores(out, failed, errors, time.perf_counter() - tic)


class Scorer:
    """Scores rollout chunks as they come; with `use_async` in one worker thread, overlapping the next chunk."""

    def __init__(self, rewards: dict[str, Any], policy: str = "raise", use_async: bool = True):
        if policy not in POLICIES:
            raise ValueError(f"on_reward_error={policy!r} must be 'raise' or 'skip_sample'")
        self.rewards, self.policy = rewards, policy
        self._pool = ThreadPoolExecutor(max_workers=1) if use_async else None
        self._pending: list[Future | Scores] = []

    def submit(self, images: torch.Tensor, prompts: list[str], metadata: list[dict], offset: int = 0) -> None:
        args = (self.rewards, images, prompts, metadata, self.policy, offset)
        self._pending.append(self._pool.submit(score_batch, *args) if self._pool is not None else score_batch(*args))

    def collect(self) -> Scores:
        """The Scores of every chunk submitted since the last collect, in submission order."""
        parts = [p.result() if isinstance(p, Future) else p for p in self._pending]
        self._pending = []
        return Scores.concat(parts)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def gather_scores(
    accelerator, local: Scores, group_ids: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor, int]:
    """All processes' scores in global order: ({name: [B*G]}, failed [B*G], group_ids [B*G], error count)."""
    device = accelerator.device
    scores = {name: accelerator.gather(s.to(device)).cpu() for name, s in local.scores.items()}
    failed = accelerator.gather(local.failed.to(device, torch.uint8)).cpu().bool()  # gloo gathers no bool
    groups = accelerator.gather(group_ids.to(device)).cpu()
    errors = int(accelerator.gather(torch.tensor([sum(local.errors.values())], device=device)).sum())
    return scores, failed, groups, errors


def reward_metrics(scores: dict[str, torch.Tensor], failed: torch.Tensor) -> dict[str, float]:
    """`reward/<name>/mean` and `/std` over the finite scores, and the dropped-sample count."""
    metrics = {}
    for name, s in scores.items():
        finite = s[torch.isfinite(s)]
        metrics[f"reward/{name}/mean"] = float(finite.mean()) if finite.numel() else float("nan")
        metrics[f"reward/{name}/std"] = float(finite.std(unbiased=False)) if finite.numel() else float("nan")
    metrics["reward/dropped_samples"] = float(failed.sum())
    return metrics


def ranking_score_fn(scorer: Scorer, weights: dict[str, float]):
    """The score_fn a recipe hands to samplers that rank candidates (candidate pools, tree pruning): the weighted sum
    of the recipe's rewards, scored now under its error policy; a not-applicable (NaN) reward counts 0."""

    def score_fn(images: torch.Tensor, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        out = score_batch(scorer.rewards, images, prompts, metadata, scorer.policy)
        return sum(weights.get(name, 1.0) * torch.nan_to_num(s, nan=0.0) for name, s in out.scores.items())

    return score_fn


def rollout_and_score(sampler, model, batch, scorer: Scorer, num_chunks: int, step: int, weights=None):
    """Stages 2-3 of a recipe: the batch sampled in `num_chunks` chunks, each chunk's rewards scored (in the scorer's
    worker thread while the next chunk samples); samplers get `ranking_score_fn(scorer, weights)` as their score_fn.
    Returns (Rollout of the whole batch, local Scores, rollout seconds)."""
    chunk = len(batch.prompts) // num_chunks
    parts, seconds = [], 0.0
    score_fn = ranking_score_fn(scorer, weights or {})
    model.transformer.eval()
    for c in range(num_chunks):
        tic = timed(model.device)  # synchronised on CUDA (flowrl.training.clock.Clock)
        part = sampler(model, batch.select(slice(c * chunk, (c + 1) * chunk)), score_fn=score_fn, step=step)
        seconds += tic.seconds()
        parts.append(part)
        scorer.submit(part.images, part.prompts, part.metadata, offset=c * chunk)
    return Rollout.concat(parts), scorer.collect(), seconds


def balance(accelerator, local: Scores, batch, balancer, weights: dict[str, float]):
    """Stages 4-5 of a recipe: every process's scores gathered, advantages by the balancer (0 for failed samples).

    Returns (this process's advantages [N], keep [N] = not failed and kept by the balancer's mask, metrics,
    reward error count)."""
    advantages, _, keep, metrics, errors = balance_per_reward(accelerator, local, batch, balancer, weights)
    return advantages, keep, metrics, errors


def balance_per_reward(accelerator, local: Scores, batch, balancer, weights: dict[str, float]):
    """`balance`, with this process's per-reward advantages [K, N] beside the advantages (rows in reward order; 0 for
    failed samples): the balancer's own rows where it has them (gdpo, gd2po, sa_mrpo, marble), else each reward's
    group z-score (population std, eps 1e-4). Returns (advantages, per_reward, keep, metrics, reward error count)."""
    scores, failed, group_ids, errors = gather_scores(accelerator, local, batch.group_ids)
    out = balancer(scores, group_ids, weights)  # Balance over [B*G]
    advantages = torch.where(failed, torch.zeros_like(out.advantages), out.advantages)
    per_reward = out.per_reward
    if per_reward is None:
        per_reward = torch.stack(
            [group_advantages(s, group_ids, std="group", eps=1e-4, clip=None) for s in scores.values()]
        )
    per_reward = torch.where(failed[None], torch.zeros_like(per_reward), per_reward)
    keep = ~failed & out.keep
    metrics = dict(out.metrics)
    metrics.update(reward_metrics(scores, failed))
    index = batch.global_index
    return advantages[index], per_reward[:, index], keep[index], metrics, errors
