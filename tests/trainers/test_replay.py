"""Replay of past rollouts (train.replay, OP-GRPO) in GRPO and NFT on the shipped toy model: the truncated
sequence-level importance weight against a hand computation in float64, the buffer's admission, age and capacity
rules, replayed samples costing no rollout work (the work meter), the buffer resumed bitwise (interrupted after step
1, resumed, weights compared with torch.equal), and bad keys as one-line errors. Replay off is today's recipe: the
GRPO and NFT trainer tests run unchanged."""

import math

import pytest
import torch
from dotted import set_dotted

import flowrl.trainers.kit as kit
from flowrl.trainers import build_config, build_trainer
from flowrl.trainers.replay import GROUP, ReplayBuffer, ReplayConfig, grpo_replay, truncated_weights
from flowrl.training.loop import metered_step
from flowrl.types import RewardOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two green circles", "one blue square", "three yellow triangles", "two red squares"]


class BrightReward:
    """Test reward: the mean brightness of an image (spread within every group, so advantages are non-zero)."""

    modalities = ("image",)
    differentiable = False

    def __init__(self, device="cpu", dtype=torch.float32):
        pass

    def __call__(self, images, prompts, metadata):
        return RewardOutput(images.float().mean((1, 2, 3)))


def config(tmp_path, trainer, **overrides):
    sampler = {"name": "ode", "num_steps": 4, "guidance_scale": 1.0}
    if trainer == "grpo":
        sampler = {"name": "sde", "num_steps": 4, "guidance_scale": 1.0, "kind": "flow_grpo", "noise_level": 1.0}
    data = {
        "name": trainer,
        "trainer": trainer,
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "seed": 3,
        "num_steps": 3,
        "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": PROMPTS[:2], "num_prompts_per_step": 2, "group_size": 4},
        "sampler": sampler,
        "rewards": [{"name": "test_replay.BrightReward"}],
        "balancer": {"name": "weighted_sum", "std": "group"},
        "train": {
            "learning_rate": 1e-2,
            "use_async_rewards": False,
            "use_ema": False,
            "replay": {"enabled": True, "capacity": 6, "num_samples": 4, "max_age": 2, "max_weight": 1.5},
        },
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
        "checkpoint": {"every_n_steps": 0},
        "logging": {"trackers": [], "progress_bar": False},
    }
    if trainer == "grpo":
        data["train"] |= {"clip_range": 1e-2, "kl_coef": 0.0}
    else:
        data["train"] |= {"timestep_fraction": 0.5}
    set_dotted(data, overrides)
    return build_config(data)


def test_the_weight_is_the_truncated_exponential_of_the_summed_log_ratio():
    prox = torch.tensor([[-1.0, -2.0, -3.0], [0.5, 0.25, 4.0], [-0.1, -0.2, -0.3]])
    behaviour = torch.tensor([[-1.5, -2.0, -2.75], [0.0, 0.5, -9.0], [-0.1, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    weights, log_w = truncated_weights(prox, behaviour, mask, max_weight=1.2)
    # by hand: row 0: 0.5 + 0 - 0.25 = 0.25; row 1: 0.5 - 0.25 = 0.25 (the masked late step left out); row 2: 0
    assert log_w.dtype == torch.float64 and log_w.tolist() == [0.25, 0.25, 0.0]
    expected = [min(math.exp(0.25), 1.2), min(math.exp(0.25), 1.2), 1.0]
    assert weights.tolist() == pytest.approx(expected, abs=0, rel=1e-7)
    assert float(weights[0]) == pytest.approx(1.2, rel=1e-7)  # exp(0.25) = 1.284 truncated at c̄ = 1.2
    weights, _ = truncated_weights(prox, behaviour, mask, max_weight=2.0)
    assert float(weights[0]) == pytest.approx(math.exp(0.25), rel=1e-7)


def test_the_buffer_keeps_the_newest_drops_the_aged_and_draws_a_multiple():
    buffer = ReplayBuffer(ReplayConfig(enabled=True, capacity=3, num_samples=3, max_age=1))
    for step in range(4):
        buffer.add({"x": torch.tensor([float(step)])}, {"step": step})
    assert [r["step"] for _, r in buffer.entries] == [1, 2, 3]  # capacity 3: the oldest left first
    drawn = buffer.draw(step=3, seed=0, multiple=2)
    assert [r["step"] for _, r in buffer.entries] == [2, 3]  # age 2 > max_age 1
    assert len(drawn) == 2  # min(2 held, 3 asked), a multiple of 2
    tensors, state = buffer.state()
    again = ReplayBuffer(buffer.cfg)
    again.load(tensors, state)
    assert [r for _, r in again.entries] == [r for _, r in buffer.entries]
    assert all(torch.equal(a[0]["x"], b[0]["x"]) for a, b in zip(again.entries, buffer.entries))


@pytest.mark.parametrize("trainer", ["grpo", "nft"])
def test_replayed_samples_train_and_cost_no_rollout_work(tmp_path, trainer):
    on = build_trainer(config(tmp_path / "on", trainer))
    off = build_trainer(config(tmp_path / "off", trainer, **{"train.replay.enabled": False}))
    for _ in range(2):
        m_on, m_off = metered_step(on), metered_step(off)
        rollout = {k: v for k, v in m_on.items() if k.startswith("work/rollout/")}
        assert rollout == {k: v for k, v in m_off.items() if k.startswith("work/rollout/")}
    assert m_on["replay/samples"] in (2, 4) and "replay/samples" not in m_off  # step 0's above-group samples
    assert 0 < m_on["replay/weight_mean"] <= 1.5
    assert m_on["replay/age_mean"] == 1.0
    train_forwards = "work/train/forward/policy"
    assert m_on[train_forwards] > m_off[train_forwards]  # the replayed rows' re-scoring and training: training work
    buffer = on.parts.kept[GROUP]
    assert 0 < len(buffer) <= 6 and all(r["step"] >= 0 for _, r in buffer.entries)


def test_grpo_keeps_the_behaviour_log_probs_of_the_first_fraction_of_transitions(tmp_path):
    trainer = build_trainer(config(tmp_path, "grpo", **{"train.replay.step_fraction": 0.5}))
    exp = kit.collect(trainer.parts)
    grpo_replay(trainer.parts, exp, trainer.parts.kept[GROUP])
    entries = trainer.parts.kept[GROUP].entries
    stored = [i for i in range(len(exp.advantages)) if exp.advantages[i] > 0]
    assert len(entries) == min(len(stored), 6) > 0
    for (tensors, record), i in zip(entries, stored):
        steps = sorted(k for s, k in exp.rollout.transitions.tolist() if s == i)
        assert tensors["mask"].nonzero().flatten().tolist() == steps[: max(1, len(steps) // 2)]  # late ones cut
        assert torch.equal(tensors["log_probs"], exp.rollout.log_probs[i].cpu())
        assert torch.equal(tensors["latents"], exp.rollout.latents[i].cpu()) and record["step"] == 0


def test_first_replay_with_unchanged_weights_has_weight_one(tmp_path):
    trainer = build_trainer(config(tmp_path, "grpo", **{"train.learning_rate": 0.0}))
    trainer.train_step()
    metrics = trainer.train_step()
    assert metrics["replay/samples"] in (2, 4)
    assert abs(metrics["replay/log_weight_mean"]) < 1e-5  # the same policy: prox = behaviour up to batch rounding


@pytest.mark.parametrize("trainer", ["grpo", "nft"])
def test_replay_resumes_bitwise(tmp_path, trainer):
    every = {"checkpoint.every_n_steps": 1}
    straight = build_trainer(config(tmp_path / "a", trainer, **every))
    kit.train(straight)
    kit.train(build_trainer(config(tmp_path / "b", trainer, num_steps=1, **every)))
    resumed = build_trainer(config(tmp_path / "b", trainer, **every, **{"checkpoint.resume": "latest"}))
    kit.train(resumed)
    assert len(straight.parts.kept[GROUP]) > 0
    for a, b in zip(straight.parts.opt.params, resumed.parts.opt.params):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train.replay.capacity": 0}, r"^train.replay.capacity=0 must be >= 1$"),
        ({"train.replay.num_samples": 8}, r"^train.replay.num_samples=8 exceeds train.replay.capacity=6: "),
        ({"train.replay.max_weight": 0.0}, r"^train.replay.max_weight=0.0 must be > 0"),
        ({"train.replay.step_fraction": 1.5}, r"^train.replay.step_fraction=1.5 must be in \(0, 1\]$"),
        (
            {"train.num_minibatches": 8, "train.num_rollout_batches": 8},
            r"^train.replay.num_samples=4 must be a multiple of train.num_minibatches=8$",
        ),
    ],
)
def test_bad_replay_settings_are_one_line_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        build_trainer(config(tmp_path, "grpo", **overrides))
    assert "\n" not in str(error.value)


def test_an_unknown_replay_key_is_refused(tmp_path):
    with pytest.raises(Exception, match="capacity"):
        config(tmp_path, "grpo", **{"train.replay.capacty": 3})
