"""trainer: elbo (flowrl/trainers/elbo.py): its loss and gradient by hand in float64, one step's gradient against
docs/recipes/elbo.md written out here, resume bit for bit, the toy config and its one-line errors. The comparison
with the authors' own code on identical tensors is tests/trainers/test_elbo_upstream.py."""

import json
import math

import pytest
import torch
from launching import ROOT, assert_same_checkpoints, one_and_two_processes
from safetensors.torch import load_file
from test_grpo_processes import write_config
from test_term_gradients import (
    PROMPTS,
    OptimizerSteps,
    assert_terms,
    f64,
    flat_mean,
    noised,
    set_adapter_apart,
    term_gradients,
    trained,
    wrap,
)
from test_trainer_contract import assert_same, toy_config, trainable

import flowrl.trainers.kit as kit
from flowrl.plan import plan
from flowrl.trainers import build_trainer, load_config
from flowrl.trainers.elbo import elbo_log_likelihood, elbo_policy_loss
from flowrl.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def test_adaptive_elbo_value_and_gradient_by_hand():
    """log p = −S / w, S = mean((x̂0 − x0)²), x̂0 = x_t − t·v, w = sg(mean|x̂0 − x0|): ∂log p/∂v = 2·t·(x̂0 − x0) / (D·w),
    the weight held fixed; one sample worked on numbers small enough to read."""
    x0 = torch.tensor([[0.5, -1.0, 2.0, 0.0]], dtype=torch.float64)
    noise = torch.tensor([[1.0, 0.0, -1.0, 0.5]], dtype=torch.float64)
    t = torch.tensor([0.5], dtype=torch.float64)
    x_t = 0.5 * x0 + 0.5 * noise  # [0.75, -0.5, 0.5, 0.25]
    v = torch.tensor([[0.5, 1.0, -2.0, 0.5]], dtype=torch.float64, requires_grad=True)
    log_p = elbo_log_likelihood(v, x_t, x0, noise, t, "adaptive")
    # x̂0 = x_t − 0.5·v = [0.5, −1.0, 1.5, 0.0]; x̂0 − x0 = [0, 0, −0.5, 0]; S = 0.0625, w = 0.125
    assert float(log_p.detach()) == pytest.approx(-0.5, abs=1e-15)
    log_p.sum().backward()
    assert v.grad[0].tolist() == pytest.approx([0.0, 0.0, 2 * 0.5 * -0.5 / (4 * 0.125), 0.0], abs=1e-15)  # −1


@pytest.mark.parametrize("objective", ["epg", "pepg", "par"])
def test_objective_gradients_by_hand(objective):
    """∂loss/∂log p per sample: EPG −ρ·A, PEPG −ρ·(A − δ), PAR −ρ·(A − (log p − log p_old)), ρ = exp(δ) held fixed."""
    log_p = torch.tensor([-0.2, -0.5, -1.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([-0.3, -0.4, -1.0], dtype=torch.float64)
    a = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    loss, terms = elbo_policy_loss(log_p, old, a, objective, True)
    loss.sum().backward()
    delta = log_p.detach() - old  # [0.1, −0.1, 0]
    rho = delta.exp()
    hand = {"epg": -rho * a, "pepg": -rho * (a - delta), "par": -rho * (a - delta)}[objective]
    torch.testing.assert_close(log_p.grad, hand, rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(terms["log_ratio"], delta, rtol=0, atol=0)
    values = {"epg": -rho * a * log_p, "pepg": -rho * (a - delta) * log_p, "par": 0.5 * rho * (a - delta) ** 2}
    torch.testing.assert_close(loss, values[objective].detach(), rtol=1e-14, atol=1e-15)


def test_step_gradient_is_the_pepg_term_plus_the_kl_term_by_hand(tmp_path):
    """docs/recipes/elbo.md#the-loss by hand, off policy (θ_old set apart from θ, so ρ ≠ 1 and δ ≠ 0): the mean over
    the kept (sample, time) items of −ρ·(s·A − δ)·log p + β·mean((v_θ − v_ref)²), log p the adaptive ELBO of θ,
    δ = sg(log p) − log p_old with θ_old's ELBO at the same x_t, s the advantage scale."""
    settings = {"data.prompts": PROMPTS, "data.num_prompts_per_step": 2, "sampler.num_steps": 3, "train.use_ema": False}
    settings |= {"train.timestep_fraction": 1.0, "train.max_grad_norm": 1e9, "train.kl_coef": 3.0}
    settings |= {"train.advantage_scale": 0.7, "train.objective": "pepg"}
    trainer = build_trainer(toy_config(tmp_path, "elbo", **settings))
    model, t = trainer.parts.model, trainer.parts.cfg.train
    for seed, adapter in enumerate(("default", "old")):
        set_adapter_apart(model, adapter, seed=seed, scale=0.05)
    steps, seen, drawn = OptimizerSteps(trainer), {}, []
    wrap(trainer, "_optimise", seen)
    original_draw = trainer._draw
    trainer._draw = lambda *args: drawn.append(original_draw(*args)) or drawn[-1]
    trainer.train_step()
    assert len(steps.grads) == 1 and len(drawn) == 1
    steps.restore(0)  # θ_old moves after the step
    x0, sigmas, cond, advantages, _, keep, _ = seen["_optimise"]
    times, noises = drawn[0]
    n, k = times.shape
    assert k == 3 and all(len(set(row.tolist())) == 3 for row in times)  # every grid time once per sample
    kept, g = float(keep.sum()), trainer.guidance
    terms = {"policy": 0.0, "kl": 0.0}
    log_ratios = []
    for j in range(k):
        sigma = sigmas[times[:, j]]
        s = f64(sigma).view(-1, 1, 1, 1)
        x_t = noised(x0, noises[:, j], sigma)
        v = model.velocity(x_t, sigma, cond, g).double()
        with torch.no_grad():
            with model.adapter_disabled():
                v_ref = f64(model.velocity(x_t, sigma, cond, g))
            with model.using_adapter("old"):
                v_old = f64(model.velocity(x_t, sigma, cond, g))

        def elbo(velocity, x_t=x_t, s=s):
            error = f64(x_t) - s * velocity - f64(x0)
            return -flat_mean(error**2) / flat_mean(error.detach().abs())

        log_p, log_p_old = elbo(v), elbo(v_old)
        delta = log_p.detach() - log_p_old
        log_ratios.append(delta)
        policy = -delta.exp() * (t.advantage_scale * f64(advantages) - delta) * log_p
        per_item = {"policy": policy, "kl": t.kl_coef * flat_mean((v - v_ref) ** 2)}
        for name, value in per_item.items():
            terms[name] = terms[name] + (f64(keep) * value).sum() / (kept * k)
    assert float(torch.stack(log_ratios).abs().max()) > 1e-3  # off policy: the ratio and δ are in play
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, terms))


def elbo_config(tmp_path, **overrides):
    """The contract test's toy config for trainer elbo: 1 prompt x group 2, redness reward, a small KL."""
    return toy_config(tmp_path, "elbo", **{"train.kl_coef": 0.01, "train.timestep_fraction": 0.5, **overrides})


def test_a_step_rolls_out_with_the_old_policy_and_soft_updates_it_by_hand(tmp_path):
    trainer = build_trainer(elbo_config(tmp_path, **{"train.decay_type": 1}))
    old = {k: p.detach().clone() for k, p in trainer.parts.adapters["old"].items()}
    metrics = trainer.train_step()
    assert metrics["train/ratio"] == 1.0 and metrics["train/log_ratio"] == 0.0  # θ_old = θ during the one step
    assert metrics["train/old_decay"] == pytest.approx(0.001)  # min(0.001 · 1 optimizer step, 0.5)
    theta = trainer.parts.model.adapter_parameters("default")
    for name, p in trainer.parts.adapters["old"].items():  # θ_old ← η·θ_old + (1 − η)·θ
        hand = 0.001 * old[name] + 0.999 * theta[name.replace(".old.", ".default.")].detach()
        assert torch.allclose(p, hand, rtol=0, atol=1e-7), name


def test_off_policy_path_resumes_bit_for_bit(tmp_path):
    """Two optimizer steps a training step (2 minibatches): the second trains on ratios to θ_old's ELBO."""
    extra = {"train.num_minibatches": 2, "data.group_size": 4}
    straight = elbo_config(tmp_path / "a", num_steps=2, **{"checkpoint.every_n_steps": 1}, **extra)
    kit.train(build_trainer(straight))
    lines = [json.loads(line) for line in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(line["train/optimizer_steps"] == 2 * line["step"] for line in lines)
    assert all(line["train/ratio"] != 1.0 for line in lines)
    kit.train(build_trainer(elbo_config(tmp_path / "b", num_steps=1, **{"checkpoint.every_n_steps": 1}, **extra)))
    resumed_cfg = elbo_config(
        tmp_path / "b", num_steps=2, **{"checkpoint.every_n_steps": 1, "checkpoint.resume": "latest"}, **extra
    )
    resumed = build_trainer(resumed_cfg)
    kit.train(resumed)
    a = load_checkpoint(straight.run_dir / "checkpoints" / "step_000002")
    b = load_checkpoint(resumed_cfg.run_dir / "checkpoints" / "step_000002")
    for key in ("trainable", "ema", "optimizer", "lr_scheduler", "trainer_state"):
        assert_same(a[key], b[key], key)
    assert_same(a["trainable"], trainable(resumed), "live weights")
    olds = [
        load_file(str(c.run_dir / "checkpoints" / "step_000002" / "adapter_old.safetensors"))
        for c in (straight, resumed_cfg)
    ]
    assert_same(*olds, "adapter_old")


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path, tiny_pipeline):
    """One prompt group of 4 spans both processes; two inner epochs, each one optimizer step over every sample (the
    second on ratios off 1, whichever process holds a sample); the KL on; the tiny SD3 pipeline."""
    extra = {
        "trainer": "elbo",
        "num_steps": 2,
        "sampler": {"name": "ode", "num_steps": 3, "height": 32, "width": 32, "guidance_scale": 1.0},
        "data": {"prompts": ["a red cat", "a blue dog", "a green tree"], "num_prompts_per_step": 1, "group_size": 4},
        "train": {"learning_rate": 3e-3, "kl_coef": 0.01, "timestep_fraction": 0.7, "num_inner_epochs": 2},
        "checkpoint": {"every_n_steps": 0, "keep_last": 1},
    }
    extra["train"] |= {"ema_every_n_steps": 1, "use_async_rewards": False}
    runs, lines = one_and_two_processes(tmp_path, write_config(tmp_path, tiny_pipeline("sd3"), "one", **extra))
    norms = [[x["train/grad_norm"] for x in run] for run in lines]  # a global quantity (the losses logged are local)
    assert min(norms[0]) > 0 and norms[0] == pytest.approx(norms[1], rel=1e-4), norms
    assert all(x["train/ratio"] != 1.0 for x in lines[0])  # the second epoch trained on ratios off 1
    assert_same_checkpoints(runs, ("trainable.safetensors", "ema.safetensors", "adapter_old.safetensors"))


def test_the_toy_config_runs(tmp_path):
    """configs/toy/elbo.yaml shrunk to 2 steps of 2 prompts x 4 (4 sampler steps, 2 training times each)."""
    small = ["data.num_prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "train.timestep_fraction=0.5"]
    cfg = load_config(
        ROOT / "configs" / "toy" / "elbo.yaml",
        [f"output_dir={tmp_path}", "num_steps=2", "logging.trackers=[]", "logging.progress_bar=false", *small]
        + ["eval.every_n_steps=0", "eval.seeds=[0]", "eval.num_steps=2", "checkpoint.every_n_steps=0"],
    )
    kit.train(build_trainer(cfg))
    lines = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert all(math.isfinite(line["train/loss"]) and line["train/log_likelihood"] < 0 for line in lines)


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="train.objective='grpo' must be in"):
        build_trainer(elbo_config(tmp_path, **{"train.objective": "grpo"}))
    with pytest.raises(ValueError, match="elbo_weighting='l2' in"):
        build_trainer(elbo_config(tmp_path, **{"train.elbo_weighting": "l2"}))
    with pytest.raises(ValueError, match=r"timestep_fraction=1.5 must be in \(0, 1\]"):
        build_trainer(elbo_config(tmp_path, **{"train.timestep_fraction": 1.5}))
    with pytest.raises(ValueError, match="train.decay_type=7 must be one of"):
        build_trainer(elbo_config(tmp_path, **{"train.decay_type": 7}))
    with pytest.raises(ValueError, match="needs model.use_lora=true"):
        build_trainer(elbo_config(tmp_path, **{"model.use_lora": False}))
    with pytest.raises(ValueError, match="sampler.guidance_scale=4.5 is classifier-free guidance"):
        build_trainer(elbo_config(tmp_path, **{"sampler.guidance_scale": 4.5}))
    amortized = {"balancer": {"name": "marble", "form": "amortized"}, "train.objective": "par"}
    with pytest.raises(ValueError, match="needs a loss affine in the advantage, which train.objective='par' is not"):
        build_trainer(elbo_config(tmp_path, **amortized))


@pytest.mark.slow
def test_flowrl_plan_prices_the_recipes_own_forwards(tmp_path):
    """`flowrl plan` meters one step of configs/toy/elbo.yaml: per trained (sample, time) item one forward with
    gradient and one backward of θ, a forward of θ_old, and a reference forward only where kl_coef > 0."""
    small = ["data.num_prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "train.timestep_fraction=0.5"]
    work = {}
    for kl in (0.0, 1e-4):
        out = tmp_path / f"plan_{kl}.json"
        plan.plan(ROOT / "configs/toy/elbo.yaml", "h100", 1, overrides=[*small, f"train.kl_coef={kl}"], json_out=out)
        work[kl] = json.loads(out.read_text())["step"]["work"]
    items = 8 * 2  # 2 prompts x 4 samples, 2 of the 4 grid times each
    for kl in work:
        assert work[kl]["work/rollout/forward/policy"] == 8 * 4
        assert work[kl]["work/train/forward_grad/policy"] == work[kl]["work/train/backward/lora"] == items
        assert work[kl]["work/train/forward/policy"] >= 2 * items  # θ's and θ_old's
    assert work[1e-4]["work/train/forward/policy"] - work[0.0]["work/train/forward/policy"] == items  # v_ref
