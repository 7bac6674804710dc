"""RAM: the target's sanity lines of docs/math.md#reinforce-adjoint-matching by hand, the training-time law against
its closed-form moments, one RAM step on the toy model raising the likelihood of high-advantage endpoints relative to
low-advantage ones, a red-pixel reward making the policy paint more red (graded by the exact checker's palette), and
one-line errors."""

import pytest
import torch
from dotted import set_dotted
from test_nft_trainer import PROMPTS, measured_red

import flowrl.trainers.kit as kit
from flowrl import sde
from flowrl.heldout import sample_images
from flowrl.losses import ram_loss, ram_target
from flowrl.schedules import ram_times
from flowrl.trainers import build_config, build_trainer
from flowrl.trainers.ram import OLD, old_policy_decay

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def ram_config(tmp_path, **overrides):
    data = {
        "name": "ram",
        "trainer": "ram",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "seed": 3,
        "num_steps": 6,
        "model": {"path": "toy", "lora_rank": 8, "lora_alpha": 8},
        "data": {"prompts": PROMPTS, "num_prompts_per_step": 4, "group_size": 4},
        "sampler": {"name": "ode", "num_steps": 6, "guidance_scale": 1.0},
        "rewards": [{"name": "test_nft_trainer.RedPixelsReward"}],
        "balancer": {"name": "weighted_sum", "std": "none"},
        "train": {
            "learning_rate": 1e-2,
            "reward_multiplier": 10.0,
            "num_loss_targets_per_sample": 2,
            "use_async_rewards": False,
            "use_ema": False,
        },
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
        "checkpoint": {"every_n_steps": 0},
        "logging": {"trackers": [], "progress_bar": False},
    }
    set_dotted(data, overrides)
    return build_config(data)


def test_target_sanity_lines_by_hand():
    g = torch.Generator().manual_seed(0)
    x0, eps, v_ref, v_old = (torch.randn(3, 2, 2, generator=g) for _ in range(4))
    # m·A = 1 and v_old = v_ref: the plain flow-matching target ε − x0
    fm = ram_target(v_ref, v_ref, x0, eps, torch.full((3,), 0.25), 4.0)
    assert torch.allclose(fm, eps - x0, atol=1e-6)
    # A = 0: the reference velocity
    assert torch.equal(ram_target(v_ref, v_old, x0, eps, torch.zeros(3), 100.0), v_ref)
    # one element by hand: v_ref + m·A·((ε − x0) − v_old)
    a = torch.tensor([0.5, -1.0, 2.0])
    target = ram_target(v_ref, v_old, x0, eps, a, 3.0)
    i, j, k = 1, 0, 1
    hand = float(v_ref[i, j, k]) + 3.0 * -1.0 * (float(eps[i, j, k]) - float(x0[i, j, k]) - float(v_old[i, j, k]))
    assert float(target[i, j, k]) == pytest.approx(hand, abs=1e-5)
    # the loss: mean squared residual per sample, gradient only through v_θ
    v = torch.randn(3, 2, 2, generator=g, requires_grad=True)
    loss = ram_loss(v, target)
    assert torch.allclose(loss, ((v - target) ** 2).mean((1, 2)))
    loss.sum().backward()
    assert torch.allclose(v.grad, 2 * (v - target).detach() / 4)


def test_training_times_follow_p_t_proportional_to_t_alpha():
    generators = [torch.Generator().manual_seed(s) for s in range(400)]
    for alpha in (0.0, 1.0, 3.0):
        times, noises = ram_times(generators, (2,), 50, alpha)
        assert times.shape == (400, 50) and noises.shape == (400, 50, 2)
        assert 0 < float(times.min()) and float(times.max()) <= 1
        # E[t] = (α + 1) / (α + 2), E[t²] = (α + 1) / (α + 3) for the density (α + 1)·t^α on (0, 1]
        assert float(times.mean()) == pytest.approx((alpha + 1) / (alpha + 2), abs=0.01)
        assert float((times**2).mean()) == pytest.approx((alpha + 1) / (alpha + 3), abs=0.01)
    assert float(noises.std()) == pytest.approx(1.0, abs=0.02)


def test_old_policy_decay_ramps_linearly_to_its_cap():
    assert [old_policy_decay(i, 0.01, 0.9) for i in (0, 1, 50, 90, 200)] == pytest.approx([0, 0.01, 0.5, 0.9, 0.9])
    assert old_policy_decay(7, 0.0, 0.9) == 0.0  # no ramp: θ_old = θ after every step


def flow_matching_loss(model, x0, cond, seed=123, k=16):
    """Monte-Carlo flow-matching loss of each endpoint (an ELBO proxy for −log-likelihood), fixed draws. [n]"""
    g = torch.Generator().manual_seed(seed)
    total = torch.zeros(x0.shape[0])
    with torch.no_grad():
        for _ in range(k):
            t = torch.rand(x0.shape[0], generator=g).clamp(0.05, 0.95)
            eps = torch.randn(x0.shape, generator=g)
            x_t = sde.forward_noise(x0, eps, t)
            total += ((model.velocity(x_t, t, cond, 1.0) - (eps - x0)) ** 2).mean((1, 2, 3))
    return total / k


def test_one_step_raises_the_likelihood_of_high_advantage_endpoints(tmp_path):
    trainer = build_trainer(
        ram_config(tmp_path, **{"train.learning_rate": 3e-3, "train.num_loss_targets_per_sample": 8})
    )
    model = trainer.parts.model
    prompts = PROMPTS * 2
    cond = model.encode(prompts)
    with torch.no_grad():  # 8 of the model's own endpoints (the toy decodes x0 ↦ (x0 + 1) / 2), half favoured
        x0 = sample_images(model, prompts, list(range(8)), 6, 1.0) * 2 - 1
    advantages = torch.tensor([0.5, 0.5, 0.5, 0.5, -0.5, -0.5, -0.5, -0.5])
    before = flow_matching_loss(model, x0, cond)
    draws = [torch.Generator().manual_seed(10 + i) for i in range(8)]
    times, noises = ram_times(draws, tuple(x0.shape[1:]), 8, 1.0)
    trainer.parts.local_n = 8
    trainer._optimise(x0, cond, advantages, torch.ones(8, dtype=torch.bool), times, noises)
    after = flow_matching_loss(model, x0, cond)
    change = after - before  # lower loss = higher likelihood
    high, low = float(change[:4].mean()), float(change[4:].mean())
    assert high < 0 < low, (high, low)  # the favoured endpoints got likelier, the others less likely


def test_a_reward_for_red_pixels_makes_the_policy_paint_more_red(tmp_path):
    trainer = build_trainer(
        ram_config(tmp_path, **{"train.reward_multiplier": 300.0, "train.num_loss_targets_per_sample": 4})
    )
    before = measured_red(trainer)
    rewards = [trainer.train_step()["reward/test_nft_trainer.RedPixelsReward/mean"] for _ in range(6)]
    after = measured_red(trainer)
    assert after > before + 0.04, (before, after, rewards)  # held-out seeds, graded by the checker's palette


def test_old_policy_and_loss_guidance(tmp_path):
    trainer = build_trainer(ram_config(tmp_path, **{"sampler.guidance_scale": 4.5, "train.old_decay_ramp": 0.0}))
    assert (
        trainer.guidance == 1.0 and kit.sampler_guidance(trainer.parts) == 4.5
    )  # CFG in the rollout, none in the loss
    model = trainer.parts.model
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond, sigma = model.encode(PROMPTS[:2]), torch.tensor([0.7, 0.3])
    trainer.train_step()
    with torch.no_grad():
        v = model.velocity(x, sigma, cond, 1.0)
        with model.using_adapter(OLD):
            v_old = model.velocity(x, sigma, cond, 1.0)
        with model.adapter_disabled():
            v_ref = model.velocity(x, sigma, cond, 1.0)
    assert (v - v_ref).abs().max() > 0 and torch.equal(v, v_old)  # decay 0 at step 0: θ_old = θ


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="num_loss_targets_per_sample=0"):
        build_trainer(ram_config(tmp_path, **{"train.num_loss_targets_per_sample": 0}))
    with pytest.raises(ValueError, match="time_alpha=-1"):
        build_trainer(ram_config(tmp_path, **{"train.time_alpha": -1.0}))
    with pytest.raises(ValueError, match="16 samples per process do not split into train.num_minibatches=3"):
        build_trainer(ram_config(tmp_path, **{"train.num_minibatches": 3}))
    with pytest.raises(ValueError, match="needs model.use_lora=true"):
        build_trainer(ram_config(tmp_path, **{"model.use_lora": False}))
