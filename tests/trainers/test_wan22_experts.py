"""Wan 2.2 A14B trains one expert: every recipe trains only the transitions and times of that expert's σ range.

The tiny A14B pipeline switches experts at boundary_ratio 0.7. On its 6-step grid (σ = 1, .95, .88, .77, .56, .02, 0)
the high-noise expert runs steps 0-3 and the low-noise one steps 4-5; a rollout uses both, as the pipeline does, but
a gradient only exists where the trained expert runs (docs/models.md#wan-22).
"""

import pytest
import torch

from flowrl.models import load_flow_model
from flowrl.registry import SAMPLERS
from flowrl.schedules import trainable_steps
from flowrl.trainers import build_config, build_trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

REWARD = {"name": "per_frame", "reward": "redness.RednessReward"}  # tests/trainers is on sys.path
ROLLOUT = {"num_steps": 6, "height": 16, "width": 16, "num_frames": 5, "guidance_scale": 1.0}
SAMPLER = {
    "grpo": {"name": "sde", "noise_level": 0.7, **ROLLOUT},
    "nft": {"name": "ode", **ROLLOUT},
    "ram": {"name": "ode", **ROLLOUT},
}
TRAIN = {
    "grpo": {"clip_range": 1e-2, "kl_coef": 0.01},
    "nft": {},
    "ram": {"num_loss_targets_per_sample": 4},
}


def a14b_config(tmp_path, pipeline, trainer, expert, **sampler):
    return build_config(
        {
            "name": f"{trainer}_{expert}",
            "trainer": trainer,
            "output_dir": str(tmp_path / "runs"),
            "device": "cpu",
            "num_steps": 1,
            "seed": 3,
            "model": {"path": pipeline, "train_expert": expert, "lora_rank": 4, "lora_alpha": 4},
            "data": {"prompts": ["a red cat", "a blue dog"], "num_prompts_per_step": 1, "group_size": 2},
            "sampler": {**SAMPLER[trainer], **sampler},
            "rewards": [REWARD],
            "balancer": {"name": "weighted_sum", "std": "group"},
            "train": {"learning_rate": 1e-2, "adam_weight_decay": 0.0, "use_async_rewards": False, **TRAIN[trainer]},
            "eval": {"num_steps": 2, "seeds": [0], "num_prompts": 1},
            "checkpoint": {"every_n_steps": 0},
            "logging": {"trackers": [], "progress_bar": False},
        }
    )


def trained_sigmas(trainer) -> list[float]:
    """Record the σ of every velocity row computed with gradient (the rows a backward reaches)."""
    seen: list[float] = []
    velocity = trainer.parts.model.velocity

    def spy(latents, sigma, cond, guidance_scale):
        if torch.is_grad_enabled():
            sigma = torch.as_tensor(sigma, dtype=torch.float32).reshape(-1).expand(latents.shape[0])
            seen.extend(sigma.tolist())
        return velocity(latents, sigma, cond, guidance_scale)

    trainer.parts.model.velocity = spy
    return seen


@pytest.mark.parametrize("expert", ["high", "low"])
@pytest.mark.parametrize("name", ["grpo", "nft", "ram"])
def test_one_step_trains_only_the_configured_expert(tmp_path, tiny_pipeline, name, expert):
    trainer = build_trainer(a14b_config(tmp_path, tiny_pipeline("wan22_a14b"), name, expert))
    pipe = trainer.parts.model.pipe
    trained, frozen = (
        (pipe.transformer, pipe.transformer_2) if expert == "high" else (pipe.transformer_2, pipe.transformer)
    )
    assert trainer.parts.model.transformer is trained
    lo, hi = trainer.parts.model.trainable_sigma_range()
    assert (lo, hi) == pytest.approx((0.7, 1.0) if expert == "high" else (0.0, 0.7))
    lora = {n: p.detach().clone() for n, p in trained.named_parameters() if "lora_B" in n}
    frozen_before = {n: p.detach().clone() for n, p in frozen.state_dict().items()}
    sigmas = trained_sigmas(trainer)
    metrics = trainer.train_step()
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert sigmas and all(lo <= s <= hi for s in sigmas), sigmas
    assert any(not torch.equal(p, dict(trained.named_parameters())[n]) for n, p in lora.items())  # the LoRA moved
    assert not any("lora" in n for n in frozen.state_dict())
    for n, p in frozen.state_dict().items():
        assert torch.equal(p, frozen_before[n]), n


@pytest.mark.parametrize("expert,stochastic", [("high", [0, 1, 2, 3]), ("low", [4])])
def test_the_sde_window_stays_on_the_trained_experts_steps(tiny_pipeline, expert, stochastic):
    model = load_flow_model(tiny_pipeline("wan22_a14b"), train_expert=expert)
    seeds = torch.arange(3)
    every = SAMPLERS.get("sde")(noise_level=0.7, **ROLLOUT)
    steps = trainable_steps(model, every.grid(model))
    assert steps.nonzero().flatten().tolist() == (stochastic if expert == "high" else [4, 5])
    # without a window every step but the last stays stochastic (the rollout's law); GRPO trains the trainable ones
    assert every.noise_levels(seeds, 0, steps).nonzero()[:, 1].unique().tolist() == [0, 1, 2, 3, 4]
    window = SAMPLERS.get("sde")(noise_level=0.7, sde_window_size=1, sde_window_range=(0, 5), **ROLLOUT)
    for seed in range(20):
        assert window.noise_levels(torch.tensor([seed]), 0, steps).nonzero()[:, 1].tolist()[0] in stochastic
    sliding = SAMPLERS.get("sde")(noise_level=0.7, sde_window_size=1, sde_window_mode="sliding", **ROLLOUT)
    assert [sliding.noise_levels(seeds, s, steps).nonzero()[0, 1].item() for s in range(5)] == [
        stochastic[s % len(stochastic)] for s in range(5)
    ]


@pytest.mark.parametrize(
    "sampler, message",
    [
        (
            {"sde_window_size": 2, "sde_window_range": [0, 4]},
            r"sampler.sde_window_size=2 in sde_window_range=\(0, 4\) of 6 steps: the model trains steps 4-5 of 6 only",
        ),
        (
            {"num_steps": 3},
            r"sampler.num_steps=3: no stochastic step of the rollout is on the trained σ range \[0, 0.7\]",
        ),
    ],
)
def test_a_window_on_the_frozen_side_is_refused_before_training(tmp_path, tiny_pipeline, sampler, message):
    with pytest.raises(ValueError, match=message):
        build_trainer(a14b_config(tmp_path, tiny_pipeline("wan22_a14b"), "grpo", "low", **sampler))


def test_single_expert_models_train_every_sigma(tiny_model):
    assert tiny_model("wan").trainable_sigma_range() == (0.0, 1.0)
    assert load_flow_model("toy").trainable_sigma_range() == (0.0, 1.0)
