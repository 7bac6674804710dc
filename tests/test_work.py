"""The work meter (flowrl.work) counts, through the real code path of a training step, what a hand count from the
config says: transformer rows forward (classifier-free guidance doubling them, previews apart), backward rows (LoRA or
full), the forward that checkpointing recomputes, decodes, text encodes and reward calls; for a GRPO step, an NFT
step, a tree rollout and a candidate pool."""

from __future__ import annotations

import pytest
import torch

from flowrl import work
from flowrl.trainers import build_trainer, load_config
from flowrl.trainers.drift import DRIFT_ROWS
from flowrl.training.loop import metered_step

FIXED = ["logging.trackers=[]", "logging.progress_bar=false", "eval.every_n_steps=0", "checkpoint.every_n_steps=0"]


def step_work(tmp_path, recipe: str, *overrides: str) -> tuple[dict, object]:
    cfg = load_config(f"configs/toy/{recipe}.yaml", [f"output_dir={tmp_path}", *FIXED, *overrides])
    trainer = build_trainer(cfg)
    metrics = metered_step(trainer)
    return {k[len("work/") :]: v for k, v in metrics.items() if k.startswith("work/")}, cfg


SMALL = ["data.num_prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4"]


def test_a_grpo_step_counts_what_its_config_says(tmp_path):
    got, cfg = step_work(tmp_path, "grpo", *SMALL, "sampler.sde_window_size=2", "sampler.sde_window_range=[0,3]")
    n, steps, window = 2 * 4, 4, 2
    assert got == {
        "rollout/forward/policy": n * steps,  # every sample through every step, no CFG
        "rollout/decode/images": n,
        "rollout/decode/pixels": n * 32 * 32,
        "rollout/encode/prompts": 2,  # each prompt once (then cached)
        "rollout/encode/tokens": 2 * 5,  # the toy tokenizer's 5 tokens
        "score/reward/toy_attributes": n,
        "train/forward/policy": 2 * n * window,  # the trained transitions with grad + the KL reference without
        "train/forward_grad/policy": n * window,
        "train/backward/lora": n * window,
    }
    assert cfg.train.kl_coef > 0


def test_classifier_free_guidance_doubles_the_rows_in_rollout_and_training(tmp_path):
    got, _ = step_work(
        tmp_path,
        "grpo",
        *SMALL,
        "sampler.sde_window_size=2",
        "sampler.sde_window_range=[0,3]",
        "sampler.guidance_scale=2.0",
    )
    n, steps, window = 8, 4, 2
    assert got["rollout/forward/policy"] == 2 * n * steps
    assert got["train/forward_grad/policy"] == 2 * n * window and got["train/backward/lora"] == 2 * n * window
    assert got["train/forward/policy"] == 4 * n * window  # policy and reference, each doubled
    assert got["rollout/encode/prompts"] == 2 + 1  # the negative prompt "" is encoded once too


def test_full_fine_tuning_with_checkpointing_counts_full_backward_and_the_recomputed_forward(tmp_path):
    got, _ = step_work(
        tmp_path,
        "grpo",
        *SMALL,
        "sampler.sde_window_size=2",
        "sampler.sde_window_range=[0,3]",
        "model.use_lora=false",
        "model.use_gradient_checkpointing=true",
        "train.kl_coef=0.0",
    )
    n, window = 8, 2
    assert got["train/backward/full"] == n * window and "train/backward/lora" not in got
    assert got["train/recompute/policy"] == n * window
    assert got["train/forward/policy"] == n * window  # no KL: no reference forward


def test_an_nft_step_counts_policy_old_and_reference_forwards_per_training_time(tmp_path):
    got, cfg = step_work(tmp_path, "nft", *SMALL, "train.timestep_fraction=0.5", "train.kl_coef=0.1")
    n, steps = 8, 4
    times = round(0.5 * steps)  # training times per sample
    epochs = cfg.train.num_inner_epochs
    assert got["rollout/forward/policy"] == n * steps  # the ODE with the old policy
    assert got["train/forward_grad/policy"] == n * times * epochs
    # θ, θ_old and the reference at each time; the rollout drift's rows again at one step (flowrl.trainers.kit)
    assert got["train/forward/policy"] == 3 * n * times * epochs + DRIFT_ROWS
    assert got["train/backward/lora"] == n * times * epochs


def test_a_tree_rollout_counts_one_forward_per_node_and_trains_its_edges(tmp_path):
    got, cfg = step_work(tmp_path, "branchgrpo_mix", "data.num_prompts_per_step=2")
    prompts, b, steps, splits = 2, cfg.sampler.kwargs["branching"], cfg.sampler.kwargs["num_steps"], [0, 1, 2]
    assert cfg.sampler.kwargs["split_steps"] == splits and b == 2 and steps == 8
    nodes = [b ** sum(s < k for s in splits) for k in range(steps)]  # nodes alive at step k: 1, 2, 4, 8, 8, ...
    assert got["rollout/forward/policy"] == prompts * sum(nodes)  # shared prefixes run once
    edges = sum(b ** (i + 1) for i in range(len(splits)))  # the stochastic edges: the splits (the window lies inside)
    assert got["train/forward_grad/policy"] == prompts * edges and got["train/backward/lora"] == prompts * edges
    assert got["rollout/decode/images"] == prompts * b ** len(splits)


def test_a_candidate_pool_counts_previews_apart_from_the_regenerated_samples(tmp_path):
    got, cfg = step_work(tmp_path, "solrl", *SMALL, "sampler.pool_size=6", "sampler.preview_num_steps=2")
    prompts, group, pool, steps, preview_steps = 2, 4, 6, 4, 2
    assert got["rollout/forward/preview"] == prompts * pool * preview_steps
    assert got["rollout/forward/policy"] == prompts * group * steps  # the selected seeds regenerated in full
    assert got["rollout/decode/images"] == prompts * (pool + group)
    # every preview scored to rank it; the regenerated ones scored by the sampler (score_full) and by the step's scorer
    assert got["score/reward/toy_attributes"] == prompts * (pool + 2 * group)


def test_a_quantized_preview_copy_is_counted_at_its_backend(tmp_path):
    got, _ = step_work(
        tmp_path,
        "solrl",
        *SMALL,
        "sampler.pool_size=6",
        "sampler.preview_num_steps=2",
        "sampler.preview_backend=fake_fp8+few_step",
    )
    assert got["rollout/forward/fake_fp8"] == 2 * 6 * 2 and "rollout/forward/preview" not in got


def test_differentiable_reward_and_decoder_backward_are_counted():
    from flowrl.training.scoring import MeteredReward
    from flowrl.types import RewardOutput

    reward = MeteredReward(lambda images, prompts, metadata: RewardOutput(scores=images.mean((1, 2, 3))), "brightness")
    work.METER.reset()
    latents = torch.zeros(3, 3, 8, 8, requires_grad=True)
    images = work.decoded((latents / 2 + 0.5).clamp(0, 1))  # a decode with a gradient, as adjoint matching takes it
    reward(images, ["a"] * 3, [{}] * 3).scores.sum().backward()
    assert work.METER.metrics() == {
        "work/score/reward/brightness": 3,
        "work/score/reward_backward/brightness": 3,
        "work/train/decode/images": 3,
        "work/train/decode/pixels": 3 * 64,
        "work/train/decode_backward/images": 3,
    }
    with torch.no_grad():
        reward(images.detach(), ["a"] * 3, [{}] * 3)
    assert work.METER.metrics()["work/score/reward_backward/brightness"] == 3  # no gradient, no backward counted


def test_unknown_phase_and_kind_are_one_line_errors():
    with pytest.raises(ValueError, match="work phase 'warmup'"):
        with work.phase("warmup"):
            pass
    with pytest.raises(ValueError, match="work kind 'flops'"):
        work.METER.add("flops", "x", 1)
