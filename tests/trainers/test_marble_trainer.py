"""MARBLE in the recipes (flowrl.training.reward_gradients.RewardGradients, balancer `marble`): the combined .grad
against the per-reward gradients taken one by one, the amortized schedule and its clamp fallback, the config errors, a
toy learning test, and α of 2 gloo processes equal to 1 process (accelerate launch)."""

import json

import pytest
import torch
import yaml
from launching import launch
from test_nft_trainer import PROMPTS, RedPixelsReward, measured_red, nft_config

import flowrl.trainers.kit as kit
from flowrl.balancers import MarbleBalancer
from flowrl.balancers.marble import harmonize
from flowrl.trainers import build_config, build_trainer
from flowrl.training.loop import resume_recipe
from flowrl.training.optim import OptimizerConfig, OptimizerStep
from flowrl.types import RewardOutput

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


class PaintedReward(RedPixelsReward):
    """Test reward: the fraction of an image's pixels that belong to a shape (any colour)."""

    def __call__(self, images, prompts, metadata):
        from flowrl.toy.exact import pixel_colours

        index, coverage = pixel_colours(images)
        return RewardOutput((coverage.gather(1, index[:, None]).squeeze(1) > 0.5).float().mean((1, 2)))


# ------------------------------------------------------------------------------------------ the component


def tiny_setup(form="full", refresh_every=10):
    from accelerate import Accelerator

    from flowrl.training.reward_gradients import RewardGradients

    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = OptimizerStep(Accelerator(cpu=True), net, OptimizerConfig(max_grad_norm=1e9), micro_batch=4)
    marble = MarbleBalancer(form=form, refresh_every=refresh_every)
    grads = RewardGradients(marble, opt, opt.acc, ["a", "b"], True, 5.0, False)
    return net, opt, marble, grads


def losses(net, x):
    """Two rewards' losses as functions of an advantage vector, sharing one forward; and a KL-like term."""
    y = net(x)  # [4, 2]

    def loss_of(a):
        return (a * y[:, 0] + 0.5 * y[:, 1] ** 2).mean()

    return y, loss_of, 0.1 * (y**2).mean()


def test_full_window_writes_the_harmonized_gradients_plus_the_kl():
    net, opt, marble, grads = tiny_setup()
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(1))
    per_reward = torch.tensor([[1.0, -1.0, 0.5, 0.0], [-0.2, 2.0, 1.0, -1.0]])
    # by hand: each reward's gradient summed over the two backward calls, one by one
    expected_g, kl_grad = [], None
    for row in per_reward:
        total = None
        for b in range(2):
            _, loss_of, _ = losses(net, x[b])
            g = torch.autograd.grad(loss_of(row), list(net.parameters()))
            flat = torch.cat([t.flatten() for t in g])
            total = flat if total is None else total + flat
        expected_g.append(total)
    kl_grad = sum(
        torch.cat([t.flatten() for t in torch.autograd.grad(losses(net, x[b])[2], list(net.parameters()))])
        for b in range(2)
    )
    expected = harmonize(torch.stack(expected_g)).direction.float() + kl_grad

    assert grads.plan(per_reward) == "full"
    for b in range(2):
        _, loss_of, kl = losses(net, x[b])
        grads.backward(loss_of, per_reward, kl, boundary=b == 1)
    grads.finish()
    got = torch.cat([p.grad.flatten() for p in opt.params])
    assert torch.allclose(got, expected, atol=1e-6)
    metrics = grads.metrics()
    alpha = [metrics["marble/alpha/a"], metrics["marble/alpha/b"]]
    assert sum(alpha) == pytest.approx(1.0) and marble.alpha.tolist() == pytest.approx(alpha)


def test_amortized_schedule_ema_and_clamp_fallback():
    net, opt, marble, grads = tiny_setup("amortized", refresh_every=3)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2))
    small = torch.tensor([[1.0, -1.0, 0.5, 0.0], [-0.2, 2.0, 1.0, -1.0]])
    clamped = small.clone()
    clamped[0, 0] = 6.0
    modes = []
    for window, per_reward in enumerate([small, small, clamped, small, small]):
        modes.append(grads.plan(per_reward))
        if not grads.single:
            _, loss_of, kl = losses(net, x)
            grads.backward(loss_of, per_reward, kl, boundary=True)
        grads.finish()
        if window == 0:
            fresh = grads.alpha.clone()
            assert torch.allclose(
                fresh, 0.7 * torch.full((2,), 0.5, dtype=torch.float64) + 0.3 * harmonize_alpha(net, x, small)
            )
        opt.optimizer.zero_grad(set_to_none=True)
    assert modes == ["full", "single", "exact", "full", "single"]  # refresh every 3 windows; the clamp falls back
    assert grads.metrics()["marble/fallbacks"] == 1 and grads.counters["refreshes"] == 2
    # between refreshes a single backward trains on Σ ᾱ_k A_k
    assert torch.allclose(grads.advantages(torch.zeros(4), small), (grads.alpha.float()[:, None] * small).sum(0))


def harmonize_alpha(net, x, per_reward):
    _, loss_of, _ = losses(net, x)
    params = list(net.parameters())
    rows = [
        torch.cat([t.flatten() for t in torch.autograd.grad(loss_of(r), params, retain_graph=True)]) for r in per_reward
    ]
    return harmonize(torch.stack(rows)).alpha


# ------------------------------------------------------------------------------------------ the recipes


MULTI = {
    "rewards": [{"name": "test_nft_trainer.RedPixelsReward"}, {"name": "test_marble_trainer.PaintedReward"}],
    "balancer": {"name": "marble", "form": "amortized", "refresh_every": 2},
}


def test_config_errors_name_the_field(tmp_path):
    data = yaml.safe_load(open("configs/toy/grpo.yaml"))
    data.update(MULTI)
    with pytest.raises(ValueError, match="clipped ratio loss is not affine in the advantage.*set balancer.form=full"):
        build_trainer(build_config(data))
    with pytest.raises(ValueError, match="adv_mode='all'"):
        build_trainer(nft_config(tmp_path, **{**MULTI, "train.adv_mode": "binary"}))
    with pytest.raises(ValueError, match="refresh_every"):
        MarbleBalancer(refresh_every=0)


@pytest.mark.slow
def test_amortized_marble_learns_red_without_losing_the_shapes(tmp_path):
    trainer = build_trainer(nft_config(tmp_path, **MULTI))
    before = measured_red(trainer)
    history = [trainer.train_step() for _ in range(6)]
    after = measured_red(trainer)
    assert after > before + 0.04, (before, after)  # measured on held-out seeds by the checker's palette
    last = history[-1]
    alpha = [v for k, v in last.items() if k.startswith("marble/alpha/")]
    # two unit vectors' min-norm point is their midpoint whenever it is interior: α = (1/2, 1/2) for K = 2
    assert alpha == pytest.approx([0.5, 0.5], abs=1e-6)
    assert last["marble/refreshes"] == 3 and last["marble/fallbacks"] == 0  # 6 windows, refresh every 2
    assert any("marble/cos/test_marble_trainer.PaintedReward" in m for m in history)


def test_grpo_full_form_runs_and_logs_alpha(tmp_path):
    data = yaml.safe_load(open("configs/toy/grpo.yaml"))
    data.update(MULTI)
    data["balancer"] = {"name": "marble", "form": "full"}
    data["data"] = {"prompts": PROMPTS, "num_prompts_per_step": 2, "group_size": 4}
    data.update({"output_dir": str(tmp_path), "num_steps": 1, "logging": {"trackers": [], "progress_bar": False}})
    data["sampler"]["num_steps"] = 3
    metrics = build_trainer(build_config(data)).train_step()
    assert metrics["marble/refreshes"] == 0 and 0 <= metrics["marble/negative_cos_fraction"] <= 1
    alpha = [v for k, v in metrics.items() if k.startswith("marble/alpha/")]
    assert sum(alpha) == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------------------------ processes

TOY = {
    "trainer": "nft",
    "seed": 5,
    "device": "cpu",
    "num_steps": 2,
    "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4},
    "data": {"prompts": PROMPTS, "num_prompts_per_step": 1, "group_size": 4},
    "sampler": {"name": "ode", "num_steps": 3, "guidance_scale": 1.0},
    "rewards": [{"name": "toy_attributes"}, {"name": "toy_artifact"}, {"name": "jpeg_compressibility"}],
    "balancer": {"name": "marble", "form": "amortized", "refresh_every": 2},
    "train": {"learning_rate": 1e-2, "timestep_fraction": 0.67, "num_minibatches": 2, "use_async_rewards": False},
    "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
    "checkpoint": {"every_n_steps": 0, "keep_last": 1},
    "logging": {"trackers": [], "progress_bar": False},
}


def alphas(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [[v for k, v in sorted(line.items()) if k.startswith("marble/alpha/")] for line in lines]


@pytest.mark.slow
def test_alpha_of_two_gloo_processes_equals_one_process(tmp_path):
    """One prompt group of 4 spans both processes: the per-reward gradients are all-reduced before the QP, so both
    processes solve the one QP of the whole batch; windows: refresh, single, refresh, single."""
    for name in ("one", "two"):
        (tmp_path / f"{name}.yaml").write_text(
            yaml.safe_dump({**TOY, "name": name, "output_dir": str(tmp_path / "runs")})
        )
    kit.train(build_trainer(build_config(yaml.safe_load((tmp_path / "one.yaml").read_text()))))
    launch("cpu_2proc", tmp_path / "two.yaml")
    runs = tmp_path / "runs"
    assert json.loads((runs / "two" / "launch.json").read_text())["num_processes"] == 2
    one, two = alphas(runs / "one"), alphas(runs / "two")
    assert len(one) == 2 and all(len(a) == 3 for a in one) and one[0] != [1 / 3] * 3
    assert sum(one, []) == pytest.approx(sum(two, []), abs=1e-6), (one, two)


@pytest.mark.slow
def test_resume_restores_alpha_and_the_refresh_clock(tmp_path):
    overrides = {
        **MULTI,
        "num_steps": 1,
        "data.num_prompts_per_step": 2,
        "sampler.num_steps": 3,
        "train.num_minibatches": 2,
        "checkpoint.every_n_steps": 1,
    }
    first = build_trainer(nft_config(tmp_path, **overrides))
    kit.train(first)
    resumed = build_trainer(nft_config(tmp_path, **{**overrides, "num_steps": 2, "checkpoint.resume": "latest"}))
    resume_recipe(resumed, first.parts.run.checkpoints / "step_000001")
    assert resumed.parts.reward_grads.windows == first.parts.reward_grads.windows == 2
    assert torch.equal(resumed.parts.reward_grads.alpha, first.parts.reward_grads.alpha)
    assert torch.equal(resumed.parts.balancer.alpha, first.parts.balancer.alpha)  # the balancer's Σ ᾱ_k A_k uses it
