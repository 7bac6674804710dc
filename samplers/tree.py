"""Tree rollouts (BranchGRPO, arXiv 2509.06040): one tree per prompt group, shared prefixes, branching at split steps.

    sampler = TreeSampler(num_steps=20, split_steps=(0, 3, 6, 9), branching=2, kind="dance", noise_level=0.3,
                          sigma_schedule="dance", split_noise_scale=4.0)
    rollout = sampler(model, batch)  # batch: whole groups of 16 samples, one per leaf of their group's tree

A tree (docs/recipes/grpo.md#tree-rollouts). The root is the group's initial noise (its group seed, as the SDE
sampler's `same_latent`). A node at depth k takes one model forward at σ_k; at a split step it gets b children
drawn independently around that step's mean with the std scaled by λ (`split_noise_scale`), elsewhere one child
(the SDE step, or the Euler step where the step is deterministic). Every step runs the alive nodes of all trees
of the batch as one batched forward (in chunks of `max_forward_batch`), so a tree costs Σ_k nodes(k) forwards,
counted in `extras["num_forwards"]`. Node ids in a tree are depth-major with siblings contiguous in parent
order, so leaves come in depth-first order and leaf l passes through node l // (leaves / nodes(d)) of depth d.

The Rollout has one row per leaf, in batch order (the trainer scores the decoded leaves, images [N]):
  latents [V, ...]       the state table: every node once, V = num_trees · Σ_d nodes(d), depth-major, tree-major
                         within a depth (shared prefixes are not copied per leaf)
  latent_index [N, T+1]  each leaf's path as rows of the table (Rollout.states / paths read through it)
  transitions            every stochastic edge exactly once, in the row of the first leaf below the edge's child;
                         the other rows pass through the same states with noise level 0 and log-prob 0 there
  std_scales [N, T]      the std multiplier each edge's log-prob uses: λ on split edges ('scaled', the density
                         the child was drawn from) or 1 (BranchGRPO's 'unscaled' quirk,
                         docs/recipes/grpo.md#tree-rollouts)
  extras                 tree_nodes [N, T+1] (the row's node id at each depth: its leaf-to-root path; the tree is
                         the row's group id), split_steps, branching, num_trees, num_forwards, nodes_per_step,
                         forward_calls, seeds
Randomness: tree t draws its step noise from its own generator (group seed + NOISE_STREAM), one draw of
[nodes(k+1), ...] per stochastic step, so a tree never depends on its batch-mates or on the chunking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from flowrl import schedules, sde
from flowrl.models.conditioning import encode_prompts
from flowrl.registry import SAMPLERS
from flowrl.samplers._rollout import batch_seeds, latent_seeds, resolve_size
from flowrl.schedules import trainable_steps
from flowrl.seeds import NOISE_STREAM, sample_generators
from flowrl.types import FlowModel, Lossy, PromptBatch, Rollout, ScoreFn, select_cond

SPLIT_LOG_PROBS = ("scaled", "unscaled")


@SAMPLERS.register("tree")
@dataclass
class TreeSampler:
    """Branching SDE rollouts with shared prefixes; one tree per prompt group, its leaves are the group's samples."""

    whole_groups: ClassVar[bool] = True  # a tree needs its whole group on one process (GroupedPromptSampler)
    recipe_variants: ClassVar[dict[str, dict]] = {"": {}}

    num_steps: int = 20
    """Denoising steps T (BranchGRPO: 20)."""
    height: int | None = None
    """None = the model's native size (its pipeline's default)."""
    width: int | None = None
    num_frames: int | None = None
    """Video models only: frames per clip (None = the model's default)."""
    guidance_scale: float | None = None
    """CFG scale (FLUX: the guidance embedding); None = the family's default."""
    negative_prompt: str = ""
    kind: str = "dance"
    """sde_step kind of the stochastic steps: dance (g = η, BranchGRPO), flow_grpo or cps."""
    noise_level: float = 0.3
    """η for dance, a for flow_grpo/cps."""
    log_prob_mode: str = "gaussian"
    """'gaussian' (exact density) or 'cps_sq' (flow_grpo's CPS quirk)."""
    sigma_schedule: str = "model"
    """'model' (the pipeline's scheduler grid) or 'dance' (shift(linspace(1, 0, T+1)), BranchGRPO)."""
    sigma_shift: float = 3.0
    """Shift of the 'dance' grid."""
    split_steps: tuple[int, ...] = ()
    """Steps whose nodes branch (BranchGRPO: 0, 3, 6, 9 of 20); each in [0, T-2]. () = a single chain (groups of 1).
    One split step is Flow-GRPO-Fast's shared prefix with one branching point."""
    branching: int | list[int] = 2
    """Children per node at each split step: one int, or one per split step. Leaves = their product = group size."""
    split_noise_scale: float = 4.0
    """λ: split children are drawn with λ·s_k around the step's mean (BranchGRPO: 4.0 with dance η = 0.3)."""
    split_log_prob: str = "scaled"
    """'scaled': a split edge's log-prob is the density it was drawn from (std λ·s_k); 'unscaled': BranchGRPO's
    quirk, scored with s_k (offered for reproduction only)."""
    use_mix: bool = False
    """BranchGRPO-Mix: only the steps k with (k mod mix_window_stride) < mix_window_size and the split steps are
    stochastic, the others Euler (not trained). Off: every step but the last is stochastic."""
    mix_window_size: int = 4
    """W of Mix (BranchGRPO: 4); 0 = only the split steps are stochastic (Flow-GRPO-Fast's Euler prefix)."""
    mix_window_stride: int = 0
    """The Mix window repeats every this many steps (BranchGRPO: its depth-slide interval, 30); 0 = never
    repeats (the window is the first W steps)."""
    max_forward_batch: int = 0
    """At most this many nodes per model forward (and per decode); 0 = all alive nodes at once. The result does
    not depend on it."""
    decode: bool = True

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1")
        if self.noise_level < 0:
            raise ValueError(f"noise_level={self.noise_level} must be >= 0")
        if self.kind not in sde.KINDS:
            raise ValueError(f"kind={self.kind!r} is not one of {', '.join(sde.KINDS)}")
        self.rule = sde.StepRule(self.kind, self.log_prob_mode)
        if self.sigma_schedule not in ("model", "dance"):
            raise ValueError(f"sigma_schedule={self.sigma_schedule!r} must be 'model' or 'dance'")
        steps = [int(s) for s in self.split_steps]
        if sorted(set(steps)) != steps or any(not 0 <= s <= self.num_steps - 2 for s in steps):
            raise ValueError(
                f"split_steps={list(self.split_steps)} must be increasing steps in "
                f"[0, num_steps - 2 = {self.num_steps - 2}]"
            )
        self.split_steps = tuple(steps)
        factors = [self.branching] * len(steps) if isinstance(self.branching, int) else list(self.branching)
        if len(factors) != len(steps) or any(int(b) != b or b < 2 for b in factors):
            raise ValueError(
                f"branching={self.branching!r} must be an integer >= 2 or one such integer per split step "
                f"({len(steps)})"
            )
        self.factors = tuple(int(b) for b in factors)
        if not self.split_noise_scale > 0:
            raise ValueError(f"split_noise_scale={self.split_noise_scale} must be > 0 (1 = the step's own std)")
        if self.split_log_prob not in SPLIT_LOG_PROBS:
            raise ValueError(
                f"split_log_prob={self.split_log_prob!r} must be 'scaled' (exact) or 'unscaled' (BranchGRPO)"
            )
        for name in ("mix_window_size", "mix_window_stride", "max_forward_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")

    def carries(self) -> frozenset[str]:
        """What its rollouts hold for a trainer (docs/recipes/compose.md): the leaves' clean endpoints, behaviour
        log-probs where some step is stochastic, and `per_edge`: a tree's edges are shared by the leaves below them,
        so a policy-gradient trainer credits each edge from its leaves (one advantage per edge, not per sample);
        `gaussian_steps` where every edge is scored by the density it was drawn from (not the 'unscaled' quirk) and
        `flow_grpo_steps` where its steps are Flow-GRPO's."""
        stochastic = any(level > 0 for level in self.step_noise_levels())
        out = {"clean_endpoints", "per_edge"} | ({"log_probs"} if stochastic else set())
        exact = self.split_log_prob == "scaled" or not self.split_steps or self.split_noise_scale == 1.0
        if stochastic and self.kind != "ode" and self.log_prob_mode == "gaussian" and exact:
            out |= {"gaussian_steps"} | ({"flow_grpo_steps"} if self.kind == "flow_grpo" else set())
        return frozenset(out)

    def lossy(self) -> tuple[Lossy, ...]:
        """None of its options is lossy: every transition is the full-precision policy's (docs/recipes/compose.md)."""
        return ()

    def trained_steps(self, model: FlowModel, stochastic_only: bool = False) -> torch.Tensor:
        """[T] bool: the steps of its grid on the σ the model trains; with `stochastic_only`, only its stochastic
        ones."""
        steps = trainable_steps(model, self.grid(model))
        return steps & (torch.tensor(self.step_noise_levels()) > 0) if stochastic_only else steps

    def check_groups(self, group_size: int, chunk_size: int | None = None, num_chunks: int = 1) -> None:
        """A tree's leaves are its group's samples, and a rollout chunk holds whole trees."""
        leaves = self.num_leaves
        if group_size != leaves:
            raise ValueError(
                f"data.group_size={group_size} but the tree of sampler.split_steps={list(self.split_steps)} and "
                f"sampler.branching={self.branching} has {leaves} leaves; set data.group_size={leaves}"
            )
        if chunk_size is not None and chunk_size % leaves:
            raise ValueError(
                f"train.num_rollout_batches={num_chunks} makes rollout chunks of {chunk_size} samples, which splits a "
                f"tree of {leaves} leaves; make it a divisor of the {chunk_size * num_chunks // leaves} trees per "
                "process"
            )

    def rollout_metrics(self, rollout: Rollout) -> dict[str, float]:
        return {}

    # -- the shape of a tree (the same for every tree) --------------------------------------------------------
    @property
    def num_leaves(self) -> int:
        return math.prod(self.factors)

    def children_per_node(self) -> list[int]:
        """[T] children of every node at step k (b at split steps, else 1)."""
        split = dict(zip(self.split_steps, self.factors))
        return [split.get(k, 1) for k in range(self.num_steps)]

    def nodes_per_depth(self) -> list[int]:
        """[T+1] nodes of one tree at each depth (depth k = after k steps; the last entry is the leaf count)."""
        counts = [1]
        for b in self.children_per_node():
            counts.append(counts[-1] * b)
        return counts

    def step_noise_levels(self) -> list[float]:
        """[T] noise level of each step: `noise_level` where the step is stochastic, 0 (Euler) elsewhere."""
        levels = []
        for k in range(self.num_steps):
            inside = k % self.mix_window_stride if self.mix_window_stride else k
            stochastic = k < self.num_steps - 1 and (not self.use_mix or inside < self.mix_window_size)
            levels.append(self.noise_level if stochastic or k in self.split_steps else 0.0)
        return levels

    def grid(self, model: FlowModel) -> torch.Tensor:
        if self.sigma_schedule == "dance":
            return schedules.dance_sigmas(self.num_steps, self.sigma_shift)
        return model.sigmas(self.num_steps, *resolve_size(self, model))

    def trees(self, batch: PromptBatch) -> list[list[int]]:
        """The batch rows of each tree (its group's rows in batch order = its leaves in depth-first order)."""
        groups: dict[int, list[int]] = {}
        for row, gid in enumerate(batch.group_ids.cpu().tolist()):
            groups.setdefault(gid, []).append(row)
        for gid, rows in groups.items():
            if len(rows) != self.num_leaves:
                raise ValueError(
                    f"tree sampler: group {gid} has {len(rows)} samples in this batch but its tree has "
                    f"{self.num_leaves} leaves; set data.group_size={self.num_leaves} and keep each group whole in one "
                    "rollout chunk"
                )
        return list(groups.values())

    # -- sampling -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(
        self,
        model: FlowModel,
        batch: PromptBatch,
        generator: torch.Generator | None = None,
        score_fn: ScoreFn | None = None,
        step: int = 0,
    ) -> Rollout:
        # 1. Prompts, seeds and trees (one per group)
        guidance = self.guidance_scale if self.guidance_scale is not None else model.default_guidance_scale
        height, width, frames = resolve_size(self, model)
        cond = encode_prompts(
            model, batch.prompts, batch.metadata, self.negative_prompt, guidance, (height, width, frames)
        )
        seeds = batch_seeds(batch, generator)
        trees = self.trees(batch)
        first = torch.tensor([rows[0] for rows in trees])  # [B] one row per tree
        tree_seeds = latent_seeds(batch, seeds, same_latent=True)[first]  # [B]
        tree_cond = select_cond(cond, first.to(cond[next(iter(cond))].device))
        # 2. Roots: each tree's initial noise from its group seed (the SDE sampler's shared noise)
        x = model.prepare_latents(
            len(trees), height, width, sample_generators(tree_seeds, model.device), frames
        ).float()
        # 3. Time grid, per-step noise levels, the tree's shape
        sigmas = self.grid(model).to(model.device)  # [T+1]
        levels, children, nodes = self.step_noise_levels(), self.children_per_node(), self.nodes_per_depth()
        # 4. Denoising loop over the frontier: every alive node of every tree, one batched forward per step; each
        #    depth's frontier [B*nodes(d), ...] (tree-major) is written once into the state table, depth after depth
        generators = sample_generators(tree_seeds, model.device, offset=NOISE_STREAM)
        starts = [len(trees) * sum(nodes[:d]) for d in range(len(nodes) + 1)]  # [T+2] first table row of each depth
        table = x.new_empty((starts[-1], *x.shape[1:]))  # [B * Σ_d nodes(d), ...]
        table[: starts[1]] = x
        edge_log_probs = []  # per step [B*nodes(k+1)]
        forwards, calls = [], 0  # nodes run through the model at each step (all trees), model calls
        for k in range(self.num_steps):
            v, used = self._velocity(model, x, sigmas[k], tree_cond, nodes[k], guidance)
            forwards.append(v.shape[0])
            calls += used
            b = children[k]
            if levels[k] > 0:
                if b > 1:
                    x, v = x.repeat_interleave(b, dim=0), v.repeat_interleave(b, dim=0)  # parent-major children
                noise = torch.cat(
                    [torch.randn((nodes[k + 1], *x.shape[1:]), generator=g, device=x.device) for g in generators]
                )
                scale = self.split_noise_scale if b > 1 else None
                x_next, log_prob, _, _ = self.rule.step(
                    v, x, sigmas[k], sigmas[k + 1], levels[k], noise=noise, std_scale=scale
                )
                if b > 1 and self.split_log_prob == "unscaled":  # BranchGRPO: drawn with λ·s_k, scored with s_k
                    _, log_prob, _, _ = self.rule.step(v, x, sigmas[k], sigmas[k + 1], levels[k], prev_sample=x_next)
            else:
                x_next, _, _, _ = sde.sde_step(v, x, sigmas[k], sigmas[k + 1], "ode", 0.0)
                x_next = x_next.repeat_interleave(b, dim=0) if b > 1 else x_next
                log_prob = torch.zeros(x_next.shape[0], device=x.device)
            table[starts[k + 1] : starts[k + 2]] = x_next
            x = table[starts[k + 1] : starts[k + 2]]
            edge_log_probs.append(log_prob)
        # 5. One row per leaf: its path through the table, and the edges it owns
        rows = torch.tensor([r for tree in trees for r in tree])  # [N] batch row of each (tree, leaf)
        tree_of = torch.arange(len(trees)).repeat_interleave(self.num_leaves)  # [N]
        leaf = torch.arange(self.num_leaves).repeat(len(trees))  # [N]
        below = [self.num_leaves // n for n in nodes]  # [T+1] leaves below one node of depth d
        offsets = [sum(nodes[:d]) for d in range(len(nodes))]
        order = torch.empty_like(rows)
        order[rows] = torch.arange(len(rows))  # batch row -> position in (tree, leaf) order
        # per depth [N] into depth d's frontier
        index = [(tree_of * n + leaf // m)[order] for n, m in zip(nodes, below)]
        latent_index = torch.stack([start + i for start, i in zip(starts, index)], dim=1).to(table.device)  # [N, T+1]
        owner = torch.stack([(leaf % m == 0)[order] for m in below[1:]], dim=1)  # [N, T] row owns its step-k edge
        log_probs = torch.stack([lp[i.to(lp.device)] for lp, i in zip(edge_log_probs, index[1:])], dim=1).cpu()
        log_probs = torch.where(owner, log_probs, torch.zeros_like(log_probs))  # [N, T]
        noise_levels = torch.where(owner, torch.tensor(levels)[None], torch.zeros(()))  # [N, T]
        split = torch.tensor([b > 1 for b in children])[None] & owner
        std_scales = None
        if self.split_log_prob == "scaled" and self.split_steps:
            std_scales = torch.where(split, torch.tensor(self.split_noise_scale), torch.ones(()))  # [N, T]
        tree_nodes = torch.stack([(offset + leaf // m)[order] for offset, m in zip(offsets, below)], dim=1)  # [N, T+1]
        # 6. Decode the leaves
        images = self._decode(model, table[latent_index[:, -1]]) if self.decode else torch.empty(0)
        return Rollout(
            latents=table,
            latent_index=latent_index,
            log_probs=log_probs.to(table.device),
            sigmas=sigmas.float(),
            images=images,
            group_ids=batch.group_ids,
            prompts=list(batch.prompts),
            cond=cond,
            noise_levels=noise_levels.to(table.device),
            rule=self.rule,
            std_scales=None if std_scales is None else std_scales.to(table.device),
            guidance_scale=guidance,
            metadata=list(batch.metadata),
            extras={
                "seeds": seeds,
                "tree_nodes": tree_nodes,
                "split_steps": self.split_steps,
                "branching": self.factors,
                "num_trees": len(trees),
                "num_forwards": sum(forwards),  # of this call, all trees: num_trees * Σ_k nodes(k)
                "nodes_per_step": tuple(forwards),
                "forward_calls": calls,
            },
        )

    def _velocity(self, model, x, sigma, tree_cond, nodes_per_tree: int, guidance: float) -> tuple[torch.Tensor, int]:
        """Velocity of every frontier node [B*n, ...] (tree-major), in chunks of max_forward_batch; (v, calls)."""
        size = self.max_forward_batch or x.shape[0]
        device = next(iter(tree_cond.values())).device
        tree_of = torch.arange(x.shape[0], device=device) // nodes_per_tree  # [B*n]
        parts = [
            model.velocity(x[i : i + size], sigma, select_cond(tree_cond, tree_of[i : i + size]), guidance)
            for i in range(0, x.shape[0], size)
        ]
        return torch.cat(parts), len(parts)

    def _decode(self, model, latents: torch.Tensor) -> torch.Tensor:
        size = self.max_forward_batch or latents.shape[0]
        return torch.cat([model.decode(latents[i : i + size]) for i in range(0, latents.shape[0], size)])
