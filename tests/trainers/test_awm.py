"""AWM (docs/recipes/awm.md) against numbers computed independently: the weighting W(ℓ, t) at hand-picked points, the
policy loss and its gradient by hand in float64 (on policy ρ ≡ 1, off policy with the clip binding), the stratified
training times of docs/recipes/awm.md#the-loss, the EMA-KL term and its anchor's update by hand; then the recipe: a toy
step whose every ratio is exactly 1, a resume of the off-policy (two optimizer steps a step) path bit for bit, 2 gloo
processes = 1, a short run of configs/toy/awm.yaml, and one-line errors. The contract over every recipe
(tests/trainers/test_trainer_contract.py) covers AWM's default step and resume as well."""

import json
import math

import pytest
import torch
from launching import assert_same_checkpoints, one_and_two_processes, toy_config_run
from safetensors.torch import load_file
from test_grpo_processes import write_config
from test_trainer_contract import assert_same, toy_config, trainable

import flowrl.trainers.kit as kit
from flowrl.losses import awm_log_prob, awm_policy_loss, awm_weighting
from flowrl.schedules import awm_times
from flowrl.trainers import build_trainer
from flowrl.trainers.awm import KL_EMA
from flowrl.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

EPS = 1e-10


def ghuber(ell, t, p=0.25):
    return t / p * ((ell + EPS) ** p - EPS**p)


@pytest.mark.parametrize(
    "weighting,ell,t,expected",
    [
        ("ghuber", 0.0, 0.7, 0.0),  # the 1e-10 floor cancels: no loss at a perfect fit
        ("ghuber", 1.0, 1.0, 4 * ((1 + EPS) ** 0.25 - 10**-2.5)),  # 3.98735...
        ("ghuber", 16.0, 0.5, 2 * ((16 + EPS) ** 0.25 - 10**-2.5)),  # 3.99367...
        ("huber", 0.25, 0.5, 0.5 * (math.sqrt(0.25 + EPS) - 1e-5)),
        ("uniform", 0.3, 0.2, 0.3),
        ("t", 0.3, 0.2, 0.06),
        ("t2", 0.3, 0.2, 0.012),
    ],
)
def test_weighting_at_hand_picked_points(weighting, ell, t, expected):
    value = awm_weighting(torch.tensor([ell], dtype=torch.float64), torch.tensor([t], dtype=torch.float64), weighting)
    assert value.dtype == torch.float64 and float(value) == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_ghuber_slope_is_t_times_ell_to_the_minus_three_quarters():
    ell = torch.tensor([0.0625, 1.0, 81.0], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.8, 0.5, 0.3], dtype=torch.float64)
    awm_weighting(ell, t).sum().backward()
    # 0.0625^-0.75 = 8, 1^-0.75 = 1, 81^-0.75 = 1/27 (up to the 1e-10 floor)
    assert ell.grad.tolist() == pytest.approx([6.4, 0.5, 0.3 / 27], rel=1e-8)
    assert float(awm_weighting(torch.tensor([2.0]), torch.tensor([0.5]), "ghuber", power=1.0)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="train.weighting='l1' must be one of uniform, t, t2, huber, ghuber"):
        awm_weighting(torch.tensor([1.0]), torch.tensor([1.0]), "l1")


def tiny_case():
    g = torch.Generator().manual_seed(0)
    v, x0, eps = (torch.randn(3, 2, 2, generator=g) for _ in range(3))
    return v, x0, eps, torch.tensor([0.9, 0.5, 0.1]), torch.tensor([7.0, -2.5, 1.0])


def hand_terms(v, x0, eps, t, a, p=0.25):
    """Per sample, in Python floats: ℓ, W, Â and dW/dv (a list of D partials), written out element by element."""
    out = []
    for i in range(len(t)):
        vi = v[i].flatten().tolist()
        target = [e - x for e, x in zip(eps[i].flatten().tolist(), x0[i].flatten().tolist())]  # ε − x0 in Python floats
        d = len(vi)
        ell = sum((x - y) ** 2 for x, y in zip(vi, target)) / d
        a_hat = max(-5.0, min(5.0, float(a[i]))) / 5.0
        slope = float(t[i]) * (ell + EPS) ** (p - 1)
        out.append((ell, ghuber(ell, float(t[i]), p), a_hat, [slope * 2 * (x - y) / d for x, y in zip(vi, target)]))
    return out


def test_on_policy_loss_and_gradient_by_hand():
    v, x0, eps, t, a = tiny_case()
    v = v.double().requires_grad_(True)
    log_p = awm_log_prob(v, x0, eps, t)
    loss, stats = awm_policy_loss(log_p, None, a, 5.0, 1.0, 1.0)
    assert torch.equal(stats["ratio"], torch.ones(3, dtype=torch.float64))  # exactly 1: log p_old = sg(log p)
    assert not stats["clipped"].any()
    loss.mean().backward()
    terms = hand_terms(v.detach(), x0, eps, t, a)
    assert (-log_p.detach()).tolist() == pytest.approx([w for _, w, _, _ in terms], rel=1e-12)
    assert loss.tolist() == pytest.approx([-a_hat for _, _, a_hat, _ in terms], rel=1e-12)  # −Â·ρ, ρ = 1
    # ∇ mean_i(−Â_i·ρ_i) = ∇ mean_i(Â_i·W_i): Â_i/n · t_i (ℓ_i + 1e-10)^(−3/4) · 2(v − (ε − x0))/D
    hand = [[a_hat / 3 * g for g in grad] for _, _, a_hat, grad in terms]
    assert v.grad.flatten(1).tolist() == [pytest.approx(row, rel=1e-10) for row in hand]
    assert [a_hat for _, _, a_hat, _ in terms] == [1.0, -0.5, 0.2]  # Â = clip(A, ±5)/5 ∈ [−1, 1]


def test_off_policy_ratio_and_its_clip_by_hand():
    v, x0, eps, t, a = tiny_case()
    v = v.double().requires_grad_(True)
    log_p = awm_log_prob(v, x0, eps, t)
    old = log_p.detach() + torch.tensor([-0.5, 0.05, 0.0], dtype=torch.float64)  # ρ = e^0.5, e^-0.05, 1
    loss, stats = awm_policy_loss(log_p, old, a, 5.0, 1.0, 0.1)
    rho = [math.exp(0.5), math.exp(-0.05), 1.0]
    assert stats["ratio"].tolist() == pytest.approx(rho, rel=1e-12)
    assert stats["clipped"].tolist() == [True, False, False]
    # sample 0: Â = 1 > 0 and ρ > 1 + c: max(−ρ, −(1 + c)) = −1.1, constant in θ (no gradient)
    assert loss.tolist() == pytest.approx([-1.1, 0.5 * rho[1], -0.2], rel=1e-12)
    loss.sum().backward()
    terms = hand_terms(v.detach(), x0, eps, t, a)
    assert v.grad[0].abs().max() == 0
    for i in (1, 2):  # ∇(−Â·ρ) = Â·ρ·∇W
        hand = [terms[i][2] * rho[i] * g for g in terms[i][3]]
        assert v.grad[i].flatten().tolist() == pytest.approx(hand, rel=1e-10)


def test_training_times_are_one_per_stratum_of_the_rollout_grid():
    grid = torch.linspace(1, 0, 15)  # T = 14, AWM's rollout length

    def generators():
        return [torch.Generator().manual_seed(s) for s in range(200)]

    times, noises = awm_times(generators(), grid, (2, 3), 6, 0.9, "discrete_wo_init")
    assert times.shape == (200, 6) and noises.shape == (200, 6, 2, 3)
    strata = [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]  # docs/recipes/awm.md#the-loss: T = 14, discrete_wo_init
    assert [set(times[:, j].tolist()) for j in range(6)] == strata  # every member drawn, nothing else
    times, _ = awm_times(generators(), grid, (2, 3), 6, 0.9, "discrete")
    assert [set(times[:, j].tolist()) for j in range(6)] == [{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]
    again, _ = awm_times(generators()[50:], grid, (2, 3), 6, 0.9, "discrete")
    assert torch.equal(times[50:], again)  # a sample's draws come from its own generator only
    trained = torch.arange(14) >= 6  # a model that trains σ_6..σ_13 only: strata of {6..11}
    times, _ = awm_times(generators(), grid, (1,), 3, 0.9, "discrete", trained)
    assert [set(times[:, j].tolist()) for j in range(3)] == [{6, 7}, {8, 9}, {10, 11}]
    # more strata than times (AWM's code does the same): a stratum of width 0 takes its lower bound, a time repeats
    times, _ = awm_times(generators(), grid, (1,), 7, 0.9, "discrete", trained)
    assert [set(times[:, j].tolist()) for j in range(7)] == [{6}, {6}, {7}, {8}, {9}, {10}, {11}]
    with pytest.raises(
        ValueError,
        match=r"train.timestep_fraction=0.9 of sampler.num_steps=14 \(discrete: from index 0\) leaves no training time",
    ):
        awm_times(generators(), grid, (1,), 2, 0.9, "discrete", torch.arange(14) >= 12)


def awm_config(tmp_path, **overrides):
    """The contract test's toy config for trainer awm: 1 prompt x group 2, SDE rollouts of 2 steps, redness reward."""
    return toy_config(tmp_path, "awm", **{"train.num_train_timesteps": 1, "train.kl_coef": 0.01, **overrides})


def test_a_toy_step_is_on_policy_and_moves_the_ema_kl_anchor_by_hand(tmp_path):
    trainer = build_trainer(awm_config(tmp_path, **{"train.ema_kl_decay_ramp": 0.25}))
    model = trainer.parts.model
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond, sigma = model.encode(["two red circles", "one blue square"]), torch.tensor([0.7, 0.3])
    with torch.no_grad():
        v_theta = model.velocity(x, sigma, cond, 1.0)
        with model.using_adapter(KL_EMA):
            assert torch.equal(model.velocity(x, sigma, cond, 1.0), v_theta)  # both adapters start at LoRA B = 0
        with model.adapter_disabled():
            assert torch.equal(model.velocity(x, sigma, cond, 1.0), v_theta)
    anchor = {k: p.detach().clone() for k, p in trainer.parts.adapters["kl_ema"].items()}
    metrics = trainer.train_step()
    assert metrics["train/ratio"] == 1.0 and metrics["train/kl_ema_decay"] == 0.25  # min(0.3, 0.25 · 1 step)
    assert metrics["train/kl"] >= 0 and metrics["train/ema_kl"] == 0.0  # the anchor was θ during the step
    theta = model.adapter_parameters("default")
    for name, p in trainer.parts.adapters["kl_ema"].items():  # θ_kl_ema ← d·θ_kl_ema + (1 − d)·θ
        hand = 0.25 * anchor[name] + 0.75 * theta[name.replace(f".{KL_EMA}.", ".default.")].detach()
        assert torch.allclose(p, hand, rtol=0, atol=1e-7), name
    assert any(float(p.abs().max()) > 0 for n, p in trainer.parts.adapters["kl_ema"].items() if "lora_B" in n)
    # the EMA-KL term: mean over elements of (v_θ − v_kl_ema)², its gradient 2(v_θ − v_kl_ema)/D through v_θ only
    v = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(1), requires_grad=True)
    with torch.no_grad(), model.using_adapter(KL_EMA):
        v_ema = model.velocity(x, sigma, cond, 1.0).double()
    term = trainer._kl(v, x, sigma, cond, KL_EMA)
    d = v[0].numel()
    assert term.tolist() == pytest.approx(
        ((v.detach().double() - v_ema) ** 2).flatten(1).sum(1).div(d).tolist(), rel=1e-6
    )
    term.sum().backward()
    assert torch.allclose(v.grad.double(), 2 * (v.detach().double() - v_ema) / d, rtol=1e-5, atol=1e-9)


def test_off_policy_path_resumes_bit_for_bit(tmp_path):
    """Two optimizer steps a training step (2 minibatches): the second trains on ratios to the old log-probs."""
    extra = {"train.num_minibatches": 2, "data.group_size": 4, "train.clip_range": 1.0}
    straight = awm_config(tmp_path / "a", num_steps=2, **{"checkpoint.every_n_steps": 1}, **extra)
    kit.train(build_trainer(straight))
    lines = [json.loads(line) for line in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(line["train/optimizer_steps"] == 2 * line["step"] for line in lines)
    assert all(line["train/ratio"] != 1.0 for line in lines)  # the second minibatch's ratios moved off 1
    kit.train(build_trainer(awm_config(tmp_path / "b", num_steps=1, **{"checkpoint.every_n_steps": 1}, **extra)))
    resumed_cfg = awm_config(
        tmp_path / "b", num_steps=2, **{"checkpoint.every_n_steps": 1, "checkpoint.resume": "latest"}, **extra
    )
    resumed = build_trainer(resumed_cfg)
    kit.train(resumed)
    a = load_checkpoint(straight.run_dir / "checkpoints" / "step_000002")
    b = load_checkpoint(resumed_cfg.run_dir / "checkpoints" / "step_000002")
    for key in ("trainable", "ema", "optimizer", "lr_scheduler", "trainer_state"):
        assert_same(a[key], b[key], key)
    assert_same(a["trainable"], trainable(resumed), "live weights")
    anchors = [
        load_file(str(c.run_dir / "checkpoints" / "step_000002" / "adapter_kl_ema.safetensors"))
        for c in (straight, resumed_cfg)
    ]
    assert_same(*anchors, "adapter_kl_ema")


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path, tiny_pipeline):
    """One prompt group of 4 spans both processes; two inner epochs, each one optimizer step over every sample (the
    second on ratios off 1, whichever process holds a sample); both KL terms on."""
    extra = {
        "trainer": "awm",
        "num_steps": 2,
        "sampler": {"name": "ode", "num_steps": 3, "height": 32, "width": 32, "guidance_scale": 1.0},
        "data": {"prompts": ["a red cat", "a blue dog", "a green tree"], "num_prompts_per_step": 1, "group_size": 4},
        "train": {"learning_rate": 3e-3, "kl_coef": 0.01, "ema_kl_decay_ramp": 0.1, "num_train_timesteps": 2},
        "checkpoint": {"every_n_steps": 0, "keep_last": 1},
    }
    extra["train"] |= {"num_inner_epochs": 2, "ema_every_n_steps": 1, "use_async_rewards": False}
    runs, lines = one_and_two_processes(tmp_path, write_config(tmp_path, tiny_pipeline("sd3"), "one", **extra))
    norms = [[x["train/grad_norm"] for x in run] for run in lines]  # a global quantity (the losses logged are local)
    assert min(norms[0]) > 0 and norms[0] == pytest.approx(norms[1], rel=1e-4), norms
    assert all(x["train/ratio"] != 1.0 for x in lines[0])  # the second epoch trained on ratios off 1
    assert_same_checkpoints(runs, ("trainable.safetensors", "ema.safetensors", "adapter_kl_ema.safetensors"))


def test_the_toy_config_runs(tmp_path):
    lines = toy_config_run(tmp_path, "awm")
    assert [line["step"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["train/loss"]) and line["train/ratio"] == 1.0 for line in lines)


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="train.weighting='l2' must be in"):
        build_trainer(awm_config(tmp_path, **{"train.weighting": "l2"}))
    with pytest.raises(ValueError, match="time_type='uniform' in"):
        build_trainer(awm_config(tmp_path, **{"train.time_type": "uniform"}))
    with pytest.raises(ValueError, match=r"timestep_fraction=1.5 in \(0, 1\]"):
        build_trainer(awm_config(tmp_path, **{"train.timestep_fraction": 1.5}))
    with pytest.raises(ValueError, match="needs model.use_lora=true"):
        build_trainer(awm_config(tmp_path, **{"model.use_lora": False}))
    amortized = {"balancer": {"name": "marble", "form": "amortized"}, "train.num_minibatches": 2}
    with pytest.raises(ValueError, match="balancer marble form=amortized needs a loss affine in the advantage"):
        build_trainer(awm_config(tmp_path, **amortized))
