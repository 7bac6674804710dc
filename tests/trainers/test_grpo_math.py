"""The GRPO step's gradient against an objective built by hand from torch.distributions.Normal, the clipped
surrogate and the code-form KL, written here without flowrl.sde; and the accumulation scale (2 minibatches x 2
accumulation steps = 1 x 1)."""

import math

import pytest
import torch

import flowrl.trainers.grpo as grpo
from flowrl.trainers import build_config
from flowrl.trainers.grpo import GRPOTrainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

A_NOISE, BETA, CLIP = 0.7, 0.3, 1e-3


def config(tmp_path, pipeline, minibatches, accumulation):
    return build_config(
        {
            "name": f"m{minibatches}a{accumulation}",
            "output_dir": str(tmp_path / "runs"),
            "device": "cpu",
            "num_steps": 1,
            "seed": 5,
            "model": {"path": pipeline, "lora_rank": 4, "lora_alpha": 8},
            "data": {"prompts": ["a red cat", "a blue dog"], "num_prompts_per_step": 2, "group_size": 2},
            "sampler": {
                "name": "sde",
                "num_steps": 3,
                "height": 32,
                "width": 32,
                "guidance_scale": 2.0,
                "noise_level": A_NOISE,
            },
            "rewards": [{"name": "jpeg_compressibility"}],
            "balancer": {"name": "weighted_sum", "std": "group"},
            "train": {
                "learning_rate": 0.0,
                "clip_range": CLIP,
                "kl_coef": BETA,
                "use_async_rewards": False,
                "use_ema": False,
                "max_grad_norm": 1e9,
                "num_minibatches": minibatches,
                "gradient_accumulation_steps": accumulation,
                "num_rollout_batches": minibatches,
            },
            "logging": {"trackers": [], "progress_bar": False},
        }
    )


def run_one_step(cfg):
    """One train_step; returns (trainer, rollout, advantages, summed gradient at the optimizer step)."""
    trainer = GRPOTrainer(cfg)
    with torch.no_grad():  # a trained-looking adapter, so that policy and reference differ
        gen = torch.Generator().manual_seed(0)
        for name, p in trainer.parts.model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    captured, seen = {}, {}
    original_optimise, original_step = grpo.grpo_optimise, trainer.parts.opt.step

    def optimise(parts, rollout, advantages, keep, *rest, **options):  # rest: MARBLE's per-reward advantages
        # shift some stored log-probs so that ratios leave the clip band on both sides
        rollout.log_probs[0] += 2 * CLIP
        rollout.log_probs[1] -= 2 * CLIP
        seen.update(rollout=rollout, advantages=advantages.clone())
        return original_optimise(parts, rollout, advantages, keep, *rest, **options)

    def step(losses):
        for name, p in zip(trainer.parts.opt.names, trainer.parts.opt.params):
            captured[name] = captured.get(name, 0) + p.grad.detach().clone()
        return original_step(losses)

    grpo.grpo_optimise, trainer.parts.opt.step = optimise, step
    try:
        trainer.train_step()
    finally:
        grpo.grpo_optimise = original_optimise
    return trainer, seen["rollout"], seen["advantages"], captured


def hand_objective(trainer, rollout, advantages):
    """mean over samples and their stochastic transitions of max(−Aρ, −A clip(ρ)) + β KL_code, by hand."""
    model, sigmas = trainer.parts.model, rollout.sigmas.tolist()
    total, terms = 0.0, 0
    for i in range(len(rollout.prompts)):
        cond = {k: v[i : i + 1] for k, v in rollout.cond.items()}
        steps = [k for k in range(rollout.num_steps) if rollout.noise_levels[i, k] > 0 and k < rollout.num_steps - 1]
        for k in steps:
            s, s_next = sigmas[k], sigmas[k + 1]
            s_tilde = sigmas[1] if s >= 1 else s  # flow_grpo's first-step rule: sigma_1 in g's denominator at sigma = 1
            g2 = A_NOISE**2 * s / (1 - s_tilde)
            h = s - s_next
            x, x_next = rollout.latents[i : i + 1, k], rollout.latents[i : i + 1, k + 1]

            def mean_of(v):
                eps_hat = x + (1 - s) * v
                return x - h * (v + g2 * eps_hat / (2 * s))

            mean = mean_of(model.velocity(x, s, cond, rollout.guidance_scale))
            with torch.no_grad(), model.adapter_disabled():
                ref_mean = mean_of(model.velocity(x, s, cond, rollout.guidance_scale))
            log_prob = torch.distributions.Normal(mean, math.sqrt(g2 * h)).log_prob(x_next).mean()
            ratio = torch.exp(log_prob - rollout.log_probs[i, k])
            a = advantages[i]
            surrogate = torch.maximum(-a * ratio, -a * ratio.clamp(1 - CLIP, 1 + CLIP))
            kl = ((mean - ref_mean) ** 2).mean() / (2 * g2)
            total = total + (surrogate + BETA * kl) / len(steps)
            terms += 1
    assert terms > 0
    return total / len(rollout.prompts)


@pytest.fixture(scope="module")
def sd3(tiny_pipeline):
    return tiny_pipeline("sd3")


def test_step_gradient_equals_the_hand_built_objective(tmp_path, sd3):
    trainer, rollout, advantages, grads = run_one_step(config(tmp_path, sd3, 1, 1))
    assert advantages.abs().max() > 0.5  # the surrogate carries signal
    trainer.parts.model.transformer.zero_grad(set_to_none=True)
    hand_objective(trainer, rollout, advantages).backward()
    largest = max(float(g.abs().max()) for g in grads.values())
    assert largest > 0
    for name, p in zip(trainer.parts.opt.names, trainer.parts.opt.params):
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6 * largest, msg=name)


def test_two_minibatches_times_two_accumulation_steps_equal_one_by_one(tmp_path, sd3):
    _, _, _, one = run_one_step(config(tmp_path, sd3, 1, 1))
    _, _, _, four = run_one_step(config(tmp_path, sd3, 2, 2))
    largest = max(float(g.abs().max()) for g in one.values())
    for name in one:
        torch.testing.assert_close(four[name], one[name], rtol=1e-4, atol=1e-6 * largest, msg=name)
