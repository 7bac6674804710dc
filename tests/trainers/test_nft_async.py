"""Asynchronous NFT rollouts (train.async_rollout, Miles-Diffusion's one-step overlap) on the shipped toy model: forced
to staleness 0 the run is the synchronous one (weights torch.equal, the same work per step); one step stale, the batch
a step trains on is the rollout of θ_old as it stood a step earlier (torch.equal to a synchronous rollout with that
adapter), `train/staleness` is logged, a step bills the work of its own batch, an interrupted run resumes bitwise, and
bad settings are one-line errors."""

import pytest
import torch
from dotted import set_dotted

import flowrl.trainers.kit as kit
import flowrl.trainers.nft as nft
from flowrl.trainers import build_config, build_trainer
from flowrl.trainers.nft import OLD
from flowrl.training.loop import metered_step
from flowrl.types import RewardOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two green circles", "one blue square", "three yellow triangles", "two red squares"]


class BrightReward:
    """Test reward: the mean brightness of an image."""

    modalities = ("image",)
    differentiable = False

    def __init__(self, device="cpu", dtype=torch.float32):
        pass

    def __call__(self, images, prompts, metadata):
        return RewardOutput(images.float().mean((1, 2, 3)))


def config(tmp_path, **overrides):
    data = {
        "name": "nft_async",
        "trainer": "nft",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "seed": 3,
        "num_steps": 3,
        "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": PROMPTS[:2], "num_prompts_per_step": 2, "group_size": 4},
        "sampler": {"name": "ode", "num_steps": 4, "guidance_scale": 1.0},
        "rewards": [{"name": "test_nft_async.BrightReward"}],
        "balancer": {"name": "weighted_sum", "std": "group"},
        "train": {
            "learning_rate": 1e-2,
            "timestep_fraction": 0.5,
            "decay_type": 0,  # θ_old copies θ after every step: each step's sampling policy differs
            "use_async_rewards": False,
            "use_ema": False,
            "async_rollout": True,
        },
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
        "checkpoint": {"every_n_steps": 0},
        "logging": {"trackers": [], "progress_bar": False},
    }
    set_dotted(data, overrides)
    return build_config(data)


def work_of(metrics):
    return {k: v for k, v in metrics.items() if k.startswith("work/")}


def test_staleness_zero_is_the_synchronous_run(tmp_path):
    forced = build_trainer(config(tmp_path / "a", **{"train.async_staleness": 0}))
    sync = build_trainer(config(tmp_path / "b", **{"train.async_rollout": False}))
    for step in range(3):
        m_forced, m_sync = metered_step(forced), metered_step(sync)
        assert work_of(m_forced) == work_of(m_sync)
        assert m_forced["train/staleness"] == 0.0 and m_forced["train/loss"] == m_sync["train/loss"], step
    for a, b in zip(forced.parts.opt.params, sync.parts.opt.params):
        assert torch.equal(a, b)
    for name, p in forced.parts.model.adapter_parameters(OLD).items():
        assert torch.equal(p, sync.parts.model.adapter_parameters(OLD)[name])


def test_one_step_stale_trains_on_the_rollout_of_the_previous_sampling_policy(tmp_path, monkeypatch):
    stale = build_trainer(config(tmp_path / "a"))
    seen = []
    original = nft.nft_optimise

    def optimise(parts, x0, *rest, **kwargs):
        if parts is stale.parts:
            seen.append(x0.clone())
        return original(parts, x0, *rest, **kwargs)

    monkeypatch.setattr(nft, "nft_optimise", optimise)
    sync = build_trainer(config(tmp_path / "b", **{"train.async_rollout": False}))
    old_at_start = []  # θ_old at the start of each step
    staleness, waits = [], []
    for _ in range(3):
        old_at_start.append({k: v.detach().clone() for k, v in stale.parts.model.adapter_parameters(OLD).items()})
        metrics = metered_step(stale)
        sync_work = metered_step(sync)  # the synchronous run's work for the same step
        staleness.append(metrics["train/staleness"])
        waits.append(metrics["perf/rollout_wait_s"])
        assert metrics["perf/offline_cpu_s"] >= 0  # the worker's CPU between steps, billed to the race's CPU clock
        rollout = {k: v for k, v in work_of(metrics).items() if "/rollout/" in k or "/score/" in k}
        assert rollout == {k: v for k, v in work_of(sync_work).items() if "/rollout/" in k or "/score/" in k}
    assert staleness == [0.0, 1.0, 1.0] and all(w >= 0 for w in waits)
    assert any(not torch.equal(old_at_start[0][k], old_at_start[1][k]) for k in old_at_start[0])  # θ_old moved
    # step 2's batch is the rollout of θ_old as it stood at the start of step 1 (the synchronous rollout with it)
    probe = build_trainer(config(tmp_path / "c", **{"train.async_rollout": False}))
    with torch.no_grad():
        for name, p in probe.parts.model.adapter_parameters(OLD).items():
            p.copy_(old_at_start[1][name])
    probe.parts.step = 2
    expected = kit.collect(probe.parts, adapter=OLD).rollout.final_latents()
    assert torch.equal(seen[2], expected)
    probe.parts.step = 1  # and step 1's was sampled by the start's θ_old (the reference): not step 2's policy
    with torch.no_grad():
        for name, p in probe.parts.model.adapter_parameters(OLD).items():
            p.copy_(old_at_start[0][name])
    assert torch.equal(seen[1], kit.collect(probe.parts, adapter=OLD).rollout.final_latents())


def test_async_resumes_bitwise(tmp_path):
    every = {"checkpoint.every_n_steps": 1}
    straight = build_trainer(config(tmp_path / "a", **every))
    kit.train(straight)
    kit.train(build_trainer(config(tmp_path / "b", num_steps=1, **every)))
    resumed = build_trainer(config(tmp_path / "b", **every, **{"checkpoint.resume": "latest"}))
    kit.train(resumed)
    for a, b in zip(straight.parts.opt.params, resumed.parts.opt.params):
        assert torch.equal(a, b)
    straight.ahead.close()
    resumed.ahead.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train.async_staleness": 2}, r"^train.async_staleness=2 must be 0 \(synchronous\) or 1 \(one step stale\)$"),
        ({"train.replay.enabled": True}, r"^train.async_rollout and train.replay.enabled: enable one of them$"),
    ],
)
def test_bad_async_settings_are_one_line_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_trainer(config(tmp_path, **overrides))
