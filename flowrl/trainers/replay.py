"""Replay of past rollouts (`train.replay.*`, OP-GRPO): a bounded buffer of earlier samples that scored above their
group, trained again beside each step's fresh samples with a truncated sequence-level importance weight. The math is in
docs/math.md#replay-op-grpo, the settings in docs/recipes/grpo.md and docs/recipes/nft.md.

    fresh rollout (N rows) ──► optimise ◄── R replayed rows, each weighted w_i = min(exp(log w_i), c̄)
            │                                     ▲
            └─ rows with advantage > min_advantage ─► buffer (capacity, max_age; oldest out first)

GRPO keeps a sample's trajectory with its behaviour log-probs (those of the policy that rolled it out) over the first
`step_fraction` of its stochastic transitions (late steps, whose small std makes the ratio ill-conditioned, are cut);
at replay the current policy re-scores them (the proximal log-probs ℓ_prox: the clipped ratio's reference, so the
clip acts on this step's update as for fresh samples) and log w_i = Σ_k (ℓ_prox − ℓ_behaviour). DiffusionNFT keeps the
clean endpoint and, as its behaviour score, the sampling policy's flow-matching score of it at draws fixed by the
sample's seed (flowrl.trainers.replay_nft; no likelihood: the reconstruction docs/math.md states). A replayed sample
costs no rollout work: its re-scoring forwards count as training work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.trainers.transitions import transition_inputs
from flowrl.types import Rollout, concat_cond

GROUP = "replay"  # the checkpoint's tensor group and JSON key of the buffer


@dataclass
class ReplayConfig:
    """Keys train.replay.* (off by default)."""

    enabled: bool = False
    capacity: int = 64
    """Samples the buffer keeps (per process); the oldest leave first."""
    num_samples: int = 8
    """Samples replayed per step beside the fresh ones (fewer while the buffer holds fewer; a multiple of
    train.num_minibatches)."""
    max_age: int = 4
    """A sample older than this many steps leaves the buffer."""
    min_advantage: float = 0.0
    """Only samples whose advantage exceeds this enter the buffer (the trajectories that beat their group)."""
    max_weight: float = 1.0
    """c̄: the importance weight is truncated at this value."""
    step_fraction: float = 0.6
    """GRPO: a replayed sample trains on, and is weighted over, the first fraction of its stochastic transitions."""
    num_weight_times: int = 2
    """NFT: the training times of its behaviour score (fixed per sample)."""

    def __post_init__(self) -> None:
        for key in ("capacity", "num_samples", "max_age", "num_weight_times"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.replay.{key}={getattr(self, key)} must be >= 1")
        if self.num_samples > self.capacity:
            raise ValueError(
                f"train.replay.num_samples={self.num_samples} exceeds train.replay.capacity={self.capacity}: "
                "raise the capacity or replay fewer"
            )
        if not self.max_weight > 0:
            raise ValueError(f"train.replay.max_weight={self.max_weight} must be > 0 (the truncation c̄)")
        if not 0 < self.step_fraction <= 1:
            raise ValueError(f"train.replay.step_fraction={self.step_fraction} must be in (0, 1]")


def check_replay(parts, recipe: type) -> None:
    """One-line errors for the runs a replay buffer cannot serve; a no-op with replay off."""
    cfg = parts.cfg.train.replay
    if not cfg.enabled:
        return
    minibatches = parts.cfg.train.num_minibatches
    if cfg.num_samples % minibatches:
        raise ValueError(
            f"train.replay.num_samples={cfg.num_samples} must be a multiple of train.num_minibatches={minibatches}"
        )
    if parts.accelerator.num_processes > 1:
        raise ValueError(
            "train.replay keeps each process's own samples and checkpoints save the main process's groups: run one "
            "process, or set train.replay.enabled=false"
        )
    if getattr(parts.cfg.train, "ais", None) is not None and parts.cfg.train.ais.enabled:
        raise ValueError("train.replay and train.ais.enabled both reweight samples: enable one of them")


def truncated_weights(prox: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, max_weight: float):
    """(w [R], log w [R]): log w_i = Σ_k mask_ik (prox_ik − behaviour_ik) in float64, w_i = min(exp(log w_i), c̄)."""
    log_w = ((prox.double() - behaviour.double()) * mask.double()).sum(-1)
    return torch.exp(log_w).clamp(max=max_weight).float(), log_w


class ReplayBuffer:
    """Past samples, each a dict of tensors (no batch dimension) and a JSON-able record; `state()` / `load()` round-trip
    it bitwise (RecipeParts.kept)."""

    def __init__(self, cfg: ReplayConfig) -> None:
        self.cfg = cfg
        self.entries: list[tuple[dict[str, torch.Tensor], dict]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, tensors: dict[str, torch.Tensor], record: dict) -> None:
        self.entries.append(({k: v.detach().cpu().clone() for k, v in tensors.items()}, record))
        del self.entries[: max(0, len(self.entries) - self.cfg.capacity)]  # the oldest leave first

    def draw(self, step: int, seed: int, multiple: int) -> list[tuple[dict[str, torch.Tensor], dict]]:
        """This step's replayed entries: the aged ones dropped, then up to num_samples (a multiple of `multiple`)
        drawn without replacement by the step's replay generator."""
        self.entries = [e for e in self.entries if step - e[1]["step"] <= self.cfg.max_age]
        count = min(len(self.entries), self.cfg.num_samples) // multiple * multiple
        generator = seed_formulas.step_generator(seed + 2, step)  # apart from the step's own and adjoint's draws
        picks = torch.randperm(len(self.entries), generator=generator)[:count].sort().values.tolist()
        return [self.entries[i] for i in picks]

    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        keys = sorted(self.entries[0][0]) if self.entries else []
        tensors = {key: torch.stack([e[0][key] for e in self.entries]) for key in keys}
        return tensors, {"records": [e[1] for e in self.entries], "keys": keys}

    def load(self, tensors: dict[str, torch.Tensor], state: dict) -> None:
        self.entries = [
            ({key: tensors[key][i].clone() for key in state["keys"]}, dict(record))
            for i, record in enumerate(state["records"])
        ]


def replay_metrics(buffer: ReplayBuffer, drawn: list, step: int, weights: torch.Tensor, log_w: torch.Tensor) -> dict:
    out = {"replay/samples": float(len(drawn)), "replay/buffer_size": float(len(buffer))}
    if drawn:
        out |= {
            "replay/weight_mean": float(weights.mean()),
            "replay/truncated_fraction": float((log_w > torch.log(torch.tensor(buffer.cfg.max_weight))).float().mean()),
            "replay/log_weight_mean": float(log_w.mean()),
            "replay/age_mean": sum(step - r["step"] for _, r in drawn) / len(drawn),
        }
    return out


# ------------------------------------------------------------------------------------------ GRPO


@torch.no_grad()
def _rescore(parts, rollout: Rollout, mask: torch.Tensor) -> torch.Tensor:
    """[R, T] the current policy's log-prob of every masked transition of `rollout` (0 elsewhere), step by step."""
    device, model = parts.accelerator.device, parts.model
    sigmas, out = rollout.sigmas.to(device), torch.zeros_like(rollout.log_probs)
    for k in range(mask.shape[1]):
        rows = mask[:, k].nonzero().flatten()
        if len(rows) == 0:
            continue
        index = rows.to(device)
        steps = torch.full_like(index, k)
        cond, x, x_next, sigma, sigma_next, level, scale = transition_inputs(rollout, sigmas, index, steps)
        v = model.velocity(x, sigma, cond, rollout.guidance_scale)
        log_prob, _ = sde.rescore_transition(rollout.rule, v, x, x_next, sigma, sigma_next, level, std_scale=scale)
        out[rows, k] = log_prob.to(out.dtype).to(out.device)
    return out


def _replayed_rollout(fresh: Rollout, drawn: list) -> Rollout:
    tensors = [e[0] for e in drawn]
    stack = {key: torch.stack([t[key] for t in tensors]).to(fresh.log_probs.device) for key in tensors[0]}
    mask = stack["mask"]
    return Rollout(
        latents=stack["latents"].to(fresh.latents.device),
        log_probs=stack["log_probs"],
        sigmas=fresh.sigmas,
        images=stack["images"].to(fresh.images.device),
        group_ids=torch.tensor([r["group_id"] for _, r in drawn], dtype=torch.int64),
        prompts=[r["prompt"] for _, r in drawn],
        cond={key[5:]: value for key, value in stack.items() if key.startswith("cond.")},
        noise_levels=stack["noise_levels"],
        rule=fresh.rule,
        transitions=mask.nonzero().to(torch.int64).cpu(),
        guidance_scale=fresh.guidance_scale,
    )


def _merge(fresh: Rollout, old: Rollout, prox: torch.Tensor) -> Rollout:
    """The fresh rows then the replayed ones; the replayed rows' log-probs are the proximal ones (the ratio's
    reference)."""
    n = len(fresh.prompts)
    return Rollout(
        latents=torch.cat([fresh.latents, old.latents]),
        log_probs=torch.cat([fresh.log_probs, prox.to(fresh.log_probs.device)]),
        sigmas=fresh.sigmas,
        images=torch.cat([fresh.images, old.images]),
        group_ids=torch.cat([fresh.group_ids.cpu(), old.group_ids]),
        prompts=fresh.prompts + old.prompts,
        cond=concat_cond([fresh.cond, {k: v.to(fresh.cond[k].device) for k, v in old.cond.items()}]),
        noise_levels=torch.cat([fresh.noise_levels, old.noise_levels.to(fresh.noise_levels.device)]),
        rule=fresh.rule,
        transitions=torch.cat([fresh.transitions, old.transitions + torch.tensor([n, 0])]),
        guidance_scale=fresh.guidance_scale,
        metadata=fresh.metadata + [{} for _ in old.prompts],
    )


def _grpo_store(parts, buffer: ReplayBuffer, exp) -> None:
    cfg, rollout = buffer.cfg, exp.rollout
    kept_steps = [[] for _ in rollout.prompts]
    for i, k in rollout.transitions.tolist():
        kept_steps[i].append(k)
    for i in (exp.keep & (exp.advantages > cfg.min_advantage)).nonzero().flatten().tolist():
        steps = kept_steps[i][: max(1, int(len(kept_steps[i]) * cfg.step_fraction + 1e-6))]
        mask = torch.zeros(rollout.num_steps, dtype=torch.bool)
        mask[steps] = True  # late transitions cut
        tensors = {
            "latents": rollout.latents[i],
            "log_probs": rollout.log_probs[i],
            "noise_levels": rollout.noise_levels[i],
            "images": rollout.images[i],
            "mask": mask,
            "advantage": exp.advantages[i],
            "per_reward": exp.per_reward[:, i],
        } | {f"cond.{key}": value[i] for key, value in rollout.cond.items()}
        buffer.add(tensors, {"step": parts.step, "prompt": rollout.prompts[i], "group_id": int(rollout.group_ids[i])})


def grpo_replay(parts, exp, buffer: ReplayBuffer | None):
    """GRPO with replay: `exp` (kit.Experience) gains this step's replayed rows after its fresh ones (rollout,
    advantages, keep, per_reward); the fresh rows that beat their group enter the buffer. Returns (exp, sample_weights
    [N + R] or None, metrics); with no buffer (replay off) `exp` is returned as it is."""
    if buffer is None:
        return exp, None, {}
    if exp.rollout.latent_index is not None:
        raise ValueError("train.replay keeps per-sample trajectories; tree rollouts share states: use sampler sde")
    drawn = buffer.draw(parts.step, parts.cfg.seed, parts.cfg.train.num_minibatches)
    _grpo_store(parts, buffer, exp)  # after the draw: a sample is not replayed at the step that rolled it out
    fresh, device = exp.rollout, parts.accelerator.device
    weights, log_w = torch.ones(0), torch.zeros(0, dtype=torch.float64)
    if drawn:
        old = _replayed_rollout(fresh, drawn)
        mask = torch.stack([e[0]["mask"] for e in drawn]).to(old.log_probs.device)
        prox = _rescore(parts, old, mask)  # [R, T] this step's policy, before any update
        weights, log_w = truncated_weights(prox, old.log_probs, mask, buffer.cfg.max_weight)
        exp.rollout = _merge(fresh, old, prox)
        exp.advantages = torch.cat([exp.advantages, torch.stack([e[0]["advantage"] for e in drawn]).to(device)])
        exp.per_reward = torch.cat([exp.per_reward, torch.stack([e[0]["per_reward"] for e in drawn], 1).to(device)], 1)
        exp.keep = torch.cat([exp.keep, torch.ones(len(drawn), dtype=torch.bool, device=device)])
    sample_weights = torch.cat([torch.ones(len(fresh.prompts)), weights]).to(device)
    return exp, sample_weights, replay_metrics(buffer, drawn, parts.step, weights, log_w)
