"""The NFT recipe on the shipped toy model: a reward that prefers red pixels makes the policy paint more red after a
few steps (a measured quantity with a margin, graded by the exact checker's palette, not by the reward), both adapters
start at the reference, the sampling policy follows θ by its soft update, and bad settings are one-line errors."""

import pytest
import torch
from dotted import set_dotted

from flowrl.toy.exact import pixel_colours
from flowrl.toy.world import COLOURS
from flowrl.trainers import build_config, build_trainer
from flowrl.trainers.nft import OLD
from flowrl.types import RewardOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two green circles", "one blue square", "three yellow triangles", "two red squares"]
RED = COLOURS.index("red")


class RedPixelsReward:
    """Test reward: the fraction of an image's pixels the exact checker's palette reads as red."""

    modalities = ("image",)
    differentiable = False

    def __init__(self, device="cpu", dtype=torch.float32):
        pass

    def __call__(self, images, prompts, metadata):
        return RewardOutput(red_fraction(images))


def red_fraction(images):
    index, coverage = pixel_colours(images)  # [N, H, W], [N, K, H, W]
    painted = coverage.gather(1, index[:, None]).squeeze(1) > 0.5  # [N, H, W] shape pixels
    return ((index == RED) & painted).float().mean((1, 2))  # [N]


def nft_config(tmp_path, **overrides):
    data = {
        "name": "nft",
        "trainer": "nft",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "seed": 3,
        "num_steps": 6,
        "model": {"path": "toy", "lora_rank": 8, "lora_alpha": 8},
        "data": {"prompts": PROMPTS, "num_prompts_per_step": 4, "group_size": 4},
        "sampler": {"name": "ode", "num_steps": 6, "guidance_scale": 1.0},
        "rewards": [{"name": "test_nft_trainer.RedPixelsReward"}],
        "balancer": {"name": "weighted_sum", "std": "group"},
        "train": {"learning_rate": 1e-2, "timestep_fraction": 0.5, "use_async_rewards": False, "use_ema": False},
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
        "checkpoint": {"every_n_steps": 0},
        "logging": {"trackers": [], "progress_bar": False},
    }
    set_dotted(data, overrides)
    return build_config(data)


@torch.no_grad()
def measured_red(trainer):
    from flowrl.heldout import sample_images

    prompts = [p for p in PROMPTS for _ in range(8)]
    images = sample_images(trainer.parts.model, prompts, list(range(500, 500 + len(prompts))), 8, 1.0)
    return float(red_fraction(images).mean())


def test_a_reward_for_red_pixels_makes_the_policy_paint_more_red(tmp_path):
    trainer = build_trainer(nft_config(tmp_path))
    before = measured_red(trainer)
    rewards = [trainer.train_step()["reward/test_nft_trainer.RedPixelsReward/mean"] for _ in range(6)]
    after = measured_red(trainer)
    assert after > before + 0.04, (before, after, rewards)  # measured on held-out seeds, by the checker's palette


def test_adapters_start_at_the_reference_and_old_follows_theta(tmp_path):
    trainer = build_trainer(nft_config(tmp_path, **{"train.decay_type": 0}))
    model = trainer.parts.model
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond, sigma = model.encode(PROMPTS[:2]), torch.tensor([0.7, 0.3])

    def velocities():
        with torch.no_grad():
            v = model.velocity(x, sigma, cond, 1.0)
            with model.using_adapter(OLD):
                v_old = model.velocity(x, sigma, cond, 1.0)
            with model.adapter_disabled():
                v_ref = model.velocity(x, sigma, cond, 1.0)
        return v, v_old, v_ref

    v, v_old, v_ref = velocities()
    assert torch.equal(v, v_old) and torch.equal(v, v_ref)  # LoRA B = 0 in both adapters
    assert not any(p.requires_grad for p in model.adapter_parameters(OLD).values())
    metrics = trainer.train_step()
    assert metrics["train/old_decay"] == 0.0
    v, v_old, v_ref = velocities()
    assert (v - v_ref).abs().max() > 0 and torch.equal(v, v_old)  # decay type 0: θ_old = θ after the step


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(
        ValueError, match=r"sampler.guidance_scale=4.5 is classifier-free guidance for toy; set it to 1.0"
    ):
        build_trainer(nft_config(tmp_path, **{"sampler.guidance_scale": 4.5}))
    with pytest.raises(ValueError, match="train.decay_type=7"):
        build_trainer(nft_config(tmp_path, **{"train.decay_type": 7}))
    with pytest.raises(ValueError, match="train.adv_mode='top'"):
        build_trainer(nft_config(tmp_path, **{"train.adv_mode": "top"}))
    with pytest.raises(ValueError, match="needs model.use_lora=true"):
        build_trainer(nft_config(tmp_path, **{"model.use_lora": False}))
