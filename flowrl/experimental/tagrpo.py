"""TAGRPO's trajectory alignment for image-to-video GRPO: intermediate latents pulled toward better group members'
and pushed from worse ones', with a memory bank of past rollouts of the same start (docs/recipes/tagrpo.md).

Experimental: on the toy image-to-video world it collapses on every seed (the race's `--baseline grpo_i2v` rows,
docs/recipes/tagrpo.md), so it is kept runnable and tested, not recommended.

The paper (arXiv 2601.05729) is known here from its abstract only: the loss below is a reconstruction, the recipe
`trainer: tagrpo` (GRPO's stage 6, `flowrl.trainers.grpo.grpo_optimise`, with this alignment as its regulariser).
For a trained transition k of sample i (latent z_k^i, the policy's Gaussian step mean μ_θ(z_k^i) and std s_k),
against the next latents z_{k+1}^j of the other members j of its group (same prompt, source image and initial noise)
whose transition k was stochastic too, and of the bank's entries for that start:

    u_j      = (r_j − mean_g r) / (std_g r + 1e-4)                   the combined reward, z-scored in the group
    a⁺_ij    = w_j · max(u_j − u_i, 0),   a⁻_ij = w_j · max(u_i − u_j, 0)      (w_j = decay^age, 1 for the group)
    z⁺_i     = Σ_j a⁺_ij z_{k+1}^j / Σ_j a⁺_ij,   z⁻_i likewise
    d(z)     = mean over elements of (μ_θ(z_k^i) − z)² / (2 s_k²)
    L_i,k    = d(z⁺_i) − λ · min(d(z⁻_i), τ)              (distance 'gaussian', the default)
             = log d(z⁺_i) − λ · log min(d(z⁻_i), τ)      (distance 'log': scale-free)

a term absent where sample i has no better (worse) partner. The recipe adds `coef · L` to each trained
transition's clipped ratio loss with the same per-sample weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

import flowrl.trainers.kit as kit
from flowrl.advantages import group_mean_std
from flowrl.balancers import weighted_total
from flowrl.config import RunConfig
from flowrl.trainers.grpo import GRPOConfig, grpo_composition_error, grpo_optimise, grpo_parts
from flowrl.trainers.transitions import TransitionInputs
from flowrl.training.clock import timed

EVICTIONS = ("oldest", "smallest_advantage")
DISTANCES = ("log", "gaussian")


@dataclass
class AlignmentConfig:
    """Keys train.tagrpo.* of the TAGRPO recipe."""

    coef: float = 0.1
    """Weight of the alignment loss beside the clipped ratio loss. The term is not clipped (it acts like an extra,
    unclipped policy gradient on the step mean): on the toy, 1.0 and 0.3 collapsed the policy within 30 steps."""
    repel: float = 0.5
    """λ: weight of the push away from worse members' latents."""
    repel_clip: float = 1.0
    """τ: the push counts up to this normalised squared distance d(z⁻) (the loss is bounded below)."""
    distance: str = "gaussian"
    """'gaussian': L = d(z⁺) − λ min(d(z⁻), τ); 'log': L = log d(z⁺) − λ log min(d(z⁻), τ), scale-free (a far
    partner pulls no harder than a near one), but 1/d larger near the noise floor (it collapsed the toy sooner)."""
    bank_size: int = 0
    """Past rollouts kept per start (prompt, source image, initial noise); 0 = no memory bank. Starts recur only
    with data.noise_pool > 0 (a fixed pool of initial noises per prompt)."""
    bank_capacity: int = 2048
    """Most entries (rollout x trained step) in the bank over all starts; the eviction rule drops the rest."""
    bank_decay: float = 0.9
    """An entry's weight per training step of age (entries from older policies count less)."""
    eviction: str = "oldest"
    """Which entry of a full start (or a full bank) goes: 'oldest' or 'smallest_advantage' (least |u| when stored)."""

    def __post_init__(self) -> None:
        if self.distance not in DISTANCES:
            raise ValueError(f"train.tagrpo.distance={self.distance!r} must be one of {', '.join(DISTANCES)}")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"train.tagrpo.eviction={self.eviction!r} must be one of {', '.join(EVICTIONS)}")
        for name in ("coef", "repel", "repel_clip", "bank_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.tagrpo.{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.bank_decay <= 1:
            raise ValueError(f"train.tagrpo.bank_decay={self.bank_decay} must be in [0, 1]")
        if self.bank_size > 0 and self.bank_capacity < 1:
            raise ValueError(f"train.tagrpo.bank_capacity={self.bank_capacity} must be >= 1 with a memory bank")


def pair_weights(u_i: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a⁺ [b, M], a⁻ [b, M]) from the rows' scores u_i [b], the partners' scores u [b, M] and weights w [b, M]
    (0 = not a partner: itself, another group, a failed sample)."""
    diff = u - u_i[:, None]
    return w * diff.clamp(min=0), w * (-diff).clamp(min=0)


def weighted_target(a: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ_j a_j z_j / Σ_j a_j [b, ...], has [b] bool) for weights a [b, M] over partner latents z [b, M, ...]."""
    total = a.sum(1)  # [b]
    has = total > 0
    shape = (*a.shape, *([1] * (z.dim() - 2)))
    target = (a.view(shape) * z).sum(1) / total.clamp(min=1e-12).view(-1, *([1] * (z.dim() - 2)))
    return target, has


def alignment_loss(
    mean: torch.Tensor,
    std: torch.Tensor,
    z_pos: torch.Tensor,
    has_pos: torch.Tensor,
    z_neg: torch.Tensor,
    has_neg: torch.Tensor,
    repel: float,
    repel_clip: float,
    distance: str = "gaussian",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(L [b], d⁺ [b], d⁻ [b]) of the module docstring ('gaussian'), or with `distance='log'` the same terms through
    log; mean [b, ...] carries the gradient, std broadcasts to it."""
    dims = tuple(range(1, mean.dim()))
    std = std.float()
    if std.dim() == 1:  # one std per row ([b], as sde_step returns it)
        std = std.view(-1, *([1] * (mean.dim() - 1)))
    var2 = 2 * std**2
    d_pos = ((mean - z_pos) ** 2 / var2).mean(dims)
    d_neg = ((mean - z_neg) ** 2 / var2).mean(dims)
    zero = torch.zeros_like(d_pos)
    attract, push = d_pos, d_neg.clamp(max=repel_clip)
    if distance == "log":
        tiny = torch.finfo(d_pos.dtype).tiny
        attract, push = attract.clamp(min=tiny).log(), push.clamp(min=tiny).log()
    loss = torch.where(has_pos, attract, zero) - repel * torch.where(has_neg, push, zero)
    return loss, d_pos.detach(), d_neg.detach()


class MemoryBank:
    """Next latents z_{k+1} of past rollouts by (start key, step k), with the combined reward and the training step
    they were drawn at; `bank_size` entries per start and step, `bank_capacity` in all."""

    def __init__(self, cfg: AlignmentConfig):
        self.cfg = cfg
        self.entries: dict[tuple[str, int], list[dict]] = {}  # (key, k) -> [{"z", "reward", "u", "step"}]

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    def _evict_one(self, items: list[dict]) -> None:
        if self.cfg.eviction == "oldest":
            victim = min(range(len(items)), key=lambda i: (items[i]["step"], i))
        else:
            victim = min(range(len(items)), key=lambda i: (abs(items[i]["u"]), items[i]["step"], i))
        items.pop(victim)

    def add(self, key: str, k: int, z: torch.Tensor, reward: float, u: float, step: int) -> None:
        if self.cfg.bank_size == 0:
            return
        items = self.entries.setdefault((key, k), [])
        items.append({"z": z.detach().float().cpu().clone(), "reward": float(reward), "u": float(u), "step": int(step)})
        while len(items) > self.cfg.bank_size:
            self._evict_one(items)
        while len(self) > self.cfg.bank_capacity:  # the whole bank: evict from the slot that holds the victim
            slots = [s for s in self.entries.values() if s]
            if self.cfg.eviction == "oldest":
                slot = min(slots, key=lambda s: min(e["step"] for e in s))
            else:
                slot = min(slots, key=lambda s: min(abs(e["u"]) for e in s))
            self._evict_one(slot)
        self.entries = {key: v for key, v in self.entries.items() if v}

    def lookup(self, key: str, k: int, step: int) -> tuple[list[torch.Tensor], list[float], list[float]]:
        """(latents, rewards, weights decay^age) of the entries for this start and step."""
        items = self.entries.get((key, k), [])
        return (
            [e["z"] for e in items],
            [e["reward"] for e in items],
            [self.cfg.bank_decay ** (step - e["step"]) for e in items],
        )

    # -- checkpoint --------------------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors for a safetensors file, json-able index) of the whole bank."""
        flat = [(key, k, e) for (key, k), items in self.entries.items() for e in items]
        keys = sorted({key for key, _, _ in flat})
        tensors = {
            "latents": torch.stack([e["z"] for _, _, e in flat]) if flat else torch.zeros(0),
            "rewards": torch.tensor([e["reward"] for _, _, e in flat], dtype=torch.float64),
            "u": torch.tensor([e["u"] for _, _, e in flat], dtype=torch.float64),
            "steps": torch.tensor([e["step"] for _, _, e in flat], dtype=torch.int64),
            "k": torch.tensor([k for _, k, _ in flat], dtype=torch.int64),
            "key": torch.tensor([keys.index(key) for key, _, _ in flat], dtype=torch.int64),
        }
        return tensors, {"keys": keys}

    def load(self, tensors: dict[str, torch.Tensor], index: dict) -> None:
        self.entries = {}
        for e in range(len(tensors["steps"])):
            slot = self.entries.setdefault((index["keys"][int(tensors["key"][e])], int(tensors["k"][e])), [])
            slot.append(
                {
                    "z": tensors["latents"][e].clone(),
                    "reward": float(tensors["rewards"][e]),
                    "u": float(tensors["u"][e]),
                    "step": int(tensors["steps"][e]),
                }
            )


def start_key(prompt: str, metadata: dict, latent_seed: int) -> str:
    """The start a bank entry belongs to: prompt, source image and the seed of the initial noise."""
    return f"{prompt}\x1f{metadata.get('image', '')}\x1f{int(latent_seed)}"


class Alignment:
    """The recipe's side of TAGRPO for one training step: targets of each trained (sample, step) from its group and
    the bank, and the bank's update after the step."""

    def __init__(self, cfg: AlignmentConfig, bank: MemoryBank):
        self.cfg, self.bank = cfg, bank
        self.log: dict[str, list[torch.Tensor]] = {k: [] for k in ("loss", "attract", "repel", "bank_partners")}

    def prepare(self, rollout, rewards: torch.Tensor, usable: torch.Tensor, keys: list[str], step: int) -> None:
        """rewards [N] (the combined training reward, NaN where failed), usable [N] bool; keys [N] start keys."""
        self.rollout, self.keys, self.step = rollout, keys, step
        group_ids = rollout.group_ids.cpu()
        rewards = torch.where(usable.cpu(), rewards.cpu().float(), torch.full_like(rewards.cpu().float(), float("nan")))
        self.rewards = rewards  # [N], NaN where not usable
        self.mean, std = group_mean_std(rewards, group_ids)  # population std over each group's usable samples
        self.std = std + 1e-4
        self.u = ((rewards - self.mean) / self.std).nan_to_num(0.0)  # [N]
        self.usable = usable.cpu() & ~torch.isnan(rewards)
        self.members = [
            ((group_ids == group_ids[i]) & self.usable).nonzero().flatten().tolist() for i in range(len(keys))
        ]
        # a partner's next latent counts only where its own transition k was stochastic, as the trained one is: an
        # ODE step's next latent lacks the SDE mean's correction, and pulling toward it bends the velocity
        self.stochastic = {(int(j), int(k)) for j, k in rollout.transitions.tolist()}

    def targets(self, index: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(z⁺ [b, ...], has⁺ [b], z⁻ [b, ...], has⁻ [b], bank partners used [b]) for rows `index` at steps `k`."""
        pos, neg, has_pos, has_neg, from_bank = [], [], [], [], []
        device = self.rollout.latents.device
        for i, step_k in zip(index.tolist(), k.tolist()):
            others = [j for j in self.members[i] if j != i and (j, step_k) in self.stochastic]
            z = list(self.rollout.states(torch.tensor(others, device=device), step_k + 1)) if others else []
            u = [float(self.u[j]) for j in others]
            w = [1.0] * len(others)
            bank_z, bank_r, bank_w = self.bank.lookup(self.keys[i], step_k, self.step)
            z += [b.to(device) for b in bank_z]
            u += [float((r - self.mean[i]) / self.std[i]) for r in bank_r]
            w += bank_w
            from_bank.append(len(bank_z))
            if not z or not self.usable[i]:
                blank = self.rollout.states(torch.tensor([i], device=device), step_k + 1)[0]
                pos.append(blank), neg.append(blank)
                has_pos.append(False), has_neg.append(False)
                continue
            a_pos, a_neg = pair_weights(
                self.u[i : i + 1].float(),
                torch.tensor([u], dtype=torch.float32),
                torch.tensor([w], dtype=torch.float32),
            )
            stack = torch.stack(z)[None].float()  # [1, M, ...]
            zp, hp = weighted_target(a_pos.to(device), stack)
            zn, hn = weighted_target(a_neg.to(device), stack)
            pos.append(zp[0]), neg.append(zn[0])
            has_pos.append(bool(hp[0])), has_neg.append(bool(hn[0]))
        return (
            torch.stack(pos),
            torch.tensor(has_pos, device=device),
            torch.stack(neg),
            torch.tensor(has_neg, device=device),
            torch.tensor(from_bank, dtype=torch.float32),
        )

    def remember(self, trained: list[list[int]]) -> None:
        """Put this step's usable samples' next latents at their trained steps into the bank."""
        if self.cfg.bank_size == 0:
            return
        device = self.rollout.latents.device
        for i, steps in enumerate(trained):
            if not self.usable[i]:
                continue
            for step_k in steps:
                z = self.rollout.states(torch.tensor([i], device=device), step_k + 1)[0]
                self.bank.add(self.keys[i], step_k, z, float(self.rewards[i]), float(self.u[i]), self.step)

    def term(self, rule, v, inputs: TransitionInputs, index, k) -> torch.Tensor:
        """coef · L [b] of the transitions k of rows `index` (the policy's step mean from velocity v), logged: GRPO's
        regulariser (flowrl.trainers.grpo.Regulariser)."""
        cfg = self.cfg
        _, x, x_next, sigma, sigma_next, level, scale = inputs
        _, _, mean, std = rule.step(v, x, sigma, sigma_next, level, prev_sample=x_next, std_scale=scale)
        z_pos, has_pos, z_neg, has_neg, partners = self.targets(index, k)
        loss, d_pos, d_neg = alignment_loss(
            mean, std, z_pos, has_pos, z_neg, has_neg, cfg.repel, cfg.repel_clip, cfg.distance
        )
        self.log["loss"].append(loss.detach().mean())
        self.log["attract"].append(d_pos[has_pos].mean() if has_pos.any() else d_pos.new_zeros(()))
        self.log["repel"].append(d_neg[has_neg].mean() if has_neg.any() else d_neg.new_zeros(()))
        self.log["bank_partners"].append(partners.mean())
        return cfg.coef * loss

    def metrics(self) -> dict[str, float]:
        out = {f"train/tagrpo_{k}": float(torch.stack(v).mean()) for k, v in self.log.items() if v}
        return out | {"train/tagrpo_bank_entries": float(len(self.bank))}

    def finish(self, trained: list[list[int]]) -> dict[str, float]:
        """After the step: its latents into the bank (a start's bank partners are always from earlier steps), then
        the step's metrics."""
        self.remember(trained)
        return self.metrics()


BANK_GROUP = "tagrpo_bank"  # the checkpoint file of the memory bank (<group>.safetensors)


def step_alignment(cfg: AlignmentConfig, bank: MemoryBank, rollout, batch, combined: torch.Tensor, usable, step: int):
    """TAGRPO's targets for one step: the combined training reward of every local sample (whole groups, NaN where no
    reward applies), its start key (prompt, source image, shared initial-noise seed) and the bank."""
    latent_seeds = batch.group_seeds if batch.group_seeds is not None else batch.seeds
    keys = [start_key(p, m, s) for p, m, s in zip(batch.prompts, batch.metadata, latent_seeds.tolist())]
    alignment = Alignment(cfg, bank)
    alignment.prepare(rollout, combined, usable, keys, step)
    return alignment


# ------------------------------------------------------------------------------------------ the recipe


@dataclass
class TAGRPOConfig(GRPOConfig):
    tagrpo: AlignmentConfig = field(default_factory=AlignmentConfig)
    """The trajectory alignment and its memory bank (keys train.tagrpo.*)."""


class TAGRPOTrainer:
    """GRPO on image-to-video groups that share their initial noise, with the alignment above beside the clipped
    ratio loss (outside the advantage and MARBLE's balancing). Every group on one process: members align with each
    other."""

    config_class = TAGRPOConfig
    name = "tagrpo"
    adapter_copies = 0  # the reference is the adapter switched off
    full_reference_copy = False
    cfg_doubles_train_rows = True  # GRPO's transitions at the rollout's guidance: true CFG, both branches
    trains_on = "stochastic_steps"  # GRPO's transitions
    uses_behaviour_log_probs = True  # GRPO's ratio to the rollout's log-probs (kit.lossy_rollout_error)
    shapes_world: ClassVar[str] = "collapses on every seed of the toy image-to-video world: docs/recipes/tagrpo.md"

    @classmethod
    def composition_error(cls, sampler, balancer, train=None, rewards=()) -> str | None:
        """None where sampler `sampler` feeds this recipe through balancer `balancer` (ComponentConfig each), else
        the one-line reason and fix; the constructor raises the same (docs/recipes/compose.md)."""
        why = grpo_composition_error(cls, sampler, balancer, train)
        if why is None and (sampler.name != "sde" or not sampler.kwargs.get("same_latent", False)):
            why = (
                f"trainer: tagrpo aligns group members that share their initial noise, which sampler {sampler.name} "
                f"(same_latent={sampler.kwargs.get('same_latent', False)}) does not give: use sampler sde with "
                "same_latent: true"
            )
        return why

    def __init__(self, cfg: RunConfig, accelerator=None):
        a = cfg.train.tagrpo
        self.parts = parts = grpo_parts(cfg, accelerator, type(self), whole_groups=True)
        self.bank = MemoryBank(a)  # past rollouts (empty unless train.tagrpo.bank_size > 0)
        if a.bank_size > 0 and parts.accelerator.num_processes > 1:
            raise ValueError(
                f"train.tagrpo.bank_size={a.bank_size} keeps each process's own rollouts, which one checkpoint "
                f"cannot hold for {parts.accelerator.num_processes} processes yet; set train.tagrpo.bank_size=0 or "
                "run one process"
            )
        if a.bank_size > 0:
            parts.kept[BANK_GROUP] = self.bank  # its latents a tensor group beside the weights

    def train_step(self) -> dict[str, float]:
        t, parts = self.parts.cfg.train, self.parts
        exp = kit.collect(parts)  # 1-5. prompts, rollout, score, gather, balance
        if t.filter_zero_std:
            exp.keep &= exp.advantages != 0

        # 6. Optimise: the alignment's targets from the group and the bank, GRPO's loss with it beside
        tic = timed(parts.accelerator.device)
        usable = exp.keep.cpu() & ~exp.scores.failed
        combined = weighted_total(exp.scores.scores, parts.weights)  # [N] Σ_k w_k r_k, NaN where none applies
        alignment = step_alignment(t.tagrpo, self.bank, exp.rollout, exp.batch, combined, usable, parts.step)
        metrics = exp.metrics | grpo_optimise(
            parts, exp.rollout, exp.advantages, exp.keep, exp.per_reward, regulariser=alignment
        )
        return kit.finish_step(parts, exp, metrics, tic.seconds())  # 7. Log
