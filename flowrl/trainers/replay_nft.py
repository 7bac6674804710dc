"""DiffusionNFT's replay (`train.replay.*` with `trainer: nft`; the buffer, its settings and the truncated weight are
flowrl.trainers.replay's): a replayed sample is its clean endpoint, and its behaviour score the sampling policy's
flow-matching score of it at draws fixed by the sample's seed (no likelihood: the reconstruction
docs/math.md#replay-op-grpo states)."""

from __future__ import annotations

import torch

from flowrl import sde
from flowrl import seeds as seed_formulas
from flowrl.schedules import trainable_steps
from flowrl.trainers.replay import ReplayBuffer, replay_metrics, truncated_weights
from flowrl.types import concat_cond, select_cond

WEIGHT_STREAM = 5 << 32  # offset of a replayed NFT sample's fixed scoring draws (apart from seeds.py's streams)


@torch.no_grad()
def nft_score(parts, x0: torch.Tensor, cond, seeds: list[int], sigmas: torch.Tensor, guidance: float, adapter: str):
    """[b] the flow-matching score −½·mean_j mean((v(x_t_j, σ_j) − (ε_j − x0))²) of adapter `adapter` at the
    sample's num_weight_times draws, fixed by its seed (σ_j among the grid's trainable times, ε_j)."""
    model, device = parts.model, parts.accelerator.device
    grid = trainable_steps(model, sigmas).nonzero().flatten().tolist()  # trainable grid indices
    generators = [torch.Generator().manual_seed(int(s) + WEIGHT_STREAM) for s in seeds]
    score = torch.zeros(len(seeds), dtype=torch.float64)
    times = parts.cfg.train.replay.num_weight_times
    for _ in range(times):
        picks = [grid[int(torch.randint(len(grid), (1,), generator=g))] for g in generators]
        sigma = sigmas[torch.tensor(picks, device=sigmas.device)].to(device)  # [b]
        noise = torch.stack([torch.randn(x0.shape[1:], generator=g) for g in generators]).to(device)
        x_t = sde.forward_noise(x0, noise, sigma)
        with model.using_adapter(adapter):
            v = model.velocity(x_t, sigma, cond, guidance)
        err = (v.double() - (noise - x0).double()).pow(2).flatten(1).mean(1)
        score -= 0.5 * err.cpu() / times
    return score


def nft_replay(parts, data: dict, seeds: torch.Tensor, buffer: ReplayBuffer | None, guidance: float, adapter: str):
    """NFT with replay: `data` (x0 [N, ...], cond, advantages, per_reward, keep, draws, weights) gains this step's
    replayed rows, weighted by min(exp(score_now − score_then), c̄) of the sampling policy `adapter`; then the fresh rows
    that beat their group enter the buffer with their behaviour score (the same adapter: it sampled them)."""
    if buffer is None:
        return data, {}
    cfg, device, n = buffer.cfg, parts.accelerator.device, len(data["x0"])
    sigmas = data["sigmas"]
    drawn = buffer.draw(parts.step, parts.cfg.seed, parts.cfg.train.num_minibatches)
    weights, log_w = torch.ones(0), torch.zeros(0, dtype=torch.float64)
    if drawn:
        stack = {key: torch.stack([e[0][key] for e in drawn]) for key in drawn[0][0]}
        x0 = stack["x0"].to(device)
        cond = {key[5:]: value.to(device) for key, value in stack.items() if key.startswith("cond.")}
        old_seeds = [r["seed"] for _, r in drawn]
        now = nft_score(parts, x0, cond, old_seeds, sigmas, guidance, adapter)
        weights, log_w = truncated_weights(
            now[:, None], stack["score"][:, None], torch.ones(len(drawn), 1), cfg.max_weight
        )
        train_seeds = torch.tensor([r["seed"] + 7919 * parts.step for _, r in drawn], dtype=torch.int64)
        data = data | {
            "x0": torch.cat([data["x0"], x0]),
            "cond": concat_cond([data["cond"], cond]),
            "advantages": torch.cat([data["advantages"], stack["advantage"].to(device)]),
            "per_reward": torch.cat([data["per_reward"], stack["per_reward"].T.to(device)], 1),
            "keep": torch.cat([data["keep"], torch.ones(len(drawn), dtype=torch.bool, device=device)]),
            "draws": data["draws"] + seed_formulas.sample_generators(train_seeds, "cpu", seed_formulas.TRAIN_STREAM),
            "weights": torch.cat([torch.ones(n), weights]).to(device),
        }
    rows = (data["keep"][:n] & (data["advantages"][:n] > cfg.min_advantage)).nonzero().flatten()
    if len(rows):
        index = rows.to(device)
        fresh_seeds = seeds[rows.cpu()].tolist()
        fresh_cond = select_cond(data["cond"], index)
        scores = nft_score(parts, data["x0"][index], fresh_cond, fresh_seeds, sigmas, guidance, adapter)
        for j, i in enumerate(rows.tolist()):
            tensors = {
                "x0": data["x0"][i],
                "advantage": data["advantages"][i],
                "per_reward": data["per_reward"][:, i],
                "score": scores[j],
            } | {f"cond.{key}": value[i] for key, value in data["cond"].items()}
            buffer.add(tensors, {"step": parts.step, "seed": int(seeds[i])})
    return data, replay_metrics(buffer, drawn, parts.step, weights, log_w)
