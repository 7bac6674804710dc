"""GRPO's ratio options (flowrl/trainers/guard.py, docs/recipes/grpo.md#grpo-options-guard-and-ratio_control).

GRPO-Guard (`train.guard`): the identities of ALGORITHMS §20.1 items 1-2 (RatioNorm is the noise projection of the mean
shift and exactly 0 on policy; Flow-GRPO's log-ratio has mean −b; the reweighted gradient is A·c_k·ξ/D at every noise
level, where Flow-GRPO's carries h_k/s_k). Flow-DPPO (`train.ratio_control: dppo`): item 6 (the mask's truth table, its
KL = the Gaussians' KL / D). Both losses and their gradients against float64 computations written here without
flowrl.sde, on a tiny case and through a toy GRPO step; with the options off the surrogate is PPO's clip, bit for bit;
short toy runs with each option log their metrics."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

import flowrl.trainers.grpo as grpo
import flowrl.trainers.kit as kit
from flowrl import schedules, sde
from flowrl.losses import clipped_policy_loss
from flowrl.trainers import GRPOConfig, build_trainer, compose, load_config
from flowrl.trainers.guard import RatioControl, dppo_policy_loss, guard_log_ratio, guard_policy_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

A_NOISE = 0.7
RULE = sde.StepRule("flow_grpo")
FLOW_GRPO_H_OVER_S = [0.057, 0.063, 0.104, 0.151, 0.212, 0.298, 0.430, 0.663, 1.194]  # ALGORITHMS §18.1, SD3 T = 10


def sd3_grid() -> torch.Tensor:
    return schedules.scheduler_sigmas({"shift": 3.0}, 10)  # SD3.5's shift-3 grid, T = 10


def one_step(k, n, d, shift, seed=0):
    """A Flow-GRPO transition k of the SD3 grid drawn under v_old: (ξ, ℓ_θ, ℓ_old, μ_θ, μ_old, s, h) of v = v_old +
    shift·r, all [n] or [n, d] float32."""
    gen = torch.Generator().manual_seed(seed)
    sigmas = sd3_grid()
    x, v_old, r, xi = (torch.randn(n, d, generator=gen) for _ in range(4))
    x_next, old_lp, old_mean, std = RULE.step(v_old, x, sigmas[k], sigmas[k + 1], A_NOISE, noise=xi)
    _, lp, mean, _ = RULE.step(v_old + shift * r, x, sigmas[k], sigmas[k + 1], A_NOISE, prev_sample=x_next)
    return xi, lp, old_lp, mean, old_mean, std, float(sigmas[k] - sigmas[k + 1])


# ------------------------------------------------------------------------------------------ §20.1 item 1: RatioNorm


@pytest.mark.parametrize("k", range(9))
def test_rationorm_is_the_noise_projection_of_the_mean_shift(k):
    """(ℓ_θ − ℓ_old + b)·s == mean(ξ ⊙ (μ_θ − μ_old)) at every trained step of the SD3 grid (k = 0: the first-step
    rule)."""
    xi, lp, old_lp, mean, old_mean, std, _ = one_step(k, n=6, d=256, shift=0.3, seed=k)
    log_ratio, bias = guard_log_ratio(lp, old_lp, mean, old_mean, std)
    projection = (xi.double() * (mean.double() - old_mean.double())).mean(1)  # [n]
    assert projection.abs().min() > 1e-5  # far above float32 rounding of ℓ (~1e-7)
    torch.testing.assert_close(log_ratio.double(), projection, rtol=0, atol=3e-7)
    b = ((mean.double() - old_mean.double()) ** 2).mean(1) / (2 * std.double() ** 2)
    torch.testing.assert_close(bias.double(), b, rtol=1e-5, atol=0)


def test_on_policy_both_options_give_ratio_one_exactly():
    """θ = old (the same velocity): ρ_guard == 1 and Flow-DPPO's ρ == 1 and KL == 0, bit for bit."""
    xi, lp, old_lp, mean, old_mean, std, h = one_step(4, n=5, d=64, shift=0.0)
    assert torch.equal(lp, old_lp) and torch.equal(mean, old_mean)
    advantages = torch.tensor([1.0, -2.0, 0.5, 0.0, -0.1])
    dt = torch.full((5,), h)
    loss, stats = guard_policy_loss(lp, old_lp, mean, old_mean, std, dt, advantages, clip_range=2e-6)
    assert torch.equal(stats["guard_log_ratio"], torch.zeros(5)) and torch.equal(stats["ratio"], torch.ones(5))
    assert torch.equal(loss, -advantages / dt)
    loss, stats = dppo_policy_loss(lp, old_lp, mean, old_mean, std, advantages, kl_threshold=0.0)
    assert torch.equal(stats["ratio"], torch.ones(5)) and torch.equal(stats["kl"], torch.zeros(5))
    assert not stats["clipped"].any() and torch.equal(loss, -advantages)


def test_flow_grpo_log_ratio_has_mean_minus_b_and_rationorm_mean_zero():
    """Monte-Carlo over 2000 draws of ξ (D = 4096) at one fixed (x, v_old, v): E[ℓ_θ − ℓ_old] = −b (Flow-GRPO's ratio is
    biased below 1), E[log ρ_guard] = 0, each within 4 standard errors; −b is 8+ standard errors away from 0."""
    gen = torch.Generator().manual_seed(7)
    sigmas, k, d, draws = sd3_grid(), 5, 4096, 2000
    x, v_old = torch.randn(1, d, generator=gen), torch.randn(1, d, generator=gen)
    v = v_old + 0.1 * torch.randn(1, d, generator=gen)
    raw, normed, biases = [], [], []
    for _ in range(draws // 500):
        xi = torch.randn(500, d, generator=gen)
        xs, vs, vos = x.expand(500, d), v.expand(500, d), v_old.expand(500, d)
        x_next, old_lp, old_mean, std = RULE.step(vos, xs, sigmas[k], sigmas[k + 1], A_NOISE, noise=xi)
        _, lp, mean, _ = RULE.step(vs, xs, sigmas[k], sigmas[k + 1], A_NOISE, prev_sample=x_next)
        log_ratio, bias = guard_log_ratio(lp, old_lp, mean, old_mean, std)
        raw.append((lp - old_lp).double())
        normed.append(log_ratio.double())
        biases.append(bias.double())
    raw, normed, b = torch.cat(raw), torch.cat(normed), float(torch.cat(biases).mean())
    se_raw, se_norm = float(raw.std()) / math.sqrt(draws), float(normed.std()) / math.sqrt(draws)
    assert b > 8 * se_raw
    assert abs(float(raw.mean()) + b) < 4 * se_raw
    assert abs(float(normed.mean())) < 4 * se_norm


# ------------------------------------------------------------------------------------------ §20.1 item 2: reweighting


def test_guard_gradient_is_a_c_xi_over_d_at_every_noise_level_and_flow_grpo_carries_h_over_s():
    """At ρ = 1 the gradient of the guard loss w.r.t. v is A·c_k·ξ/D, c_k = 1 + a²/2 (k ≥ 1), 1 at σ = 1 (k = 0); the
    plain clipped loss's is A·c_k·(h_k/s_k)·ξ/D, h_k/s_k the listed factors of the SD3 T = 10 grid (growing ~21x)."""
    sigmas, n, d = sd3_grid(), 4, 64
    stds = sde.sde_std(sigmas[:-1], sigmas[1:], "flow_grpo", A_NOISE)
    h_over_s = (sigmas[:-1] - sigmas[1:]) / stds
    torch.testing.assert_close(h_over_s[:9], torch.tensor(FLOW_GRPO_H_OVER_S), rtol=0, atol=6e-4)
    advantages = torch.tensor([0.8, -1.3, 0.2, 2.0])
    for k in range(9):
        gen = torch.Generator().manual_seed(100 + k)
        x, v_old, xi = (torch.randn(n, d, generator=gen) for _ in range(3))
        x_next, old_lp, old_mean, std = RULE.step(v_old, x, sigmas[k], sigmas[k + 1], A_NOISE, noise=xi)
        c_k = 1.0 if k == 0 else 1 + A_NOISE**2 / 2
        h = sigmas[k] - sigmas[k + 1]
        for loss_of in ("guard", "clip"):
            v = v_old.clone().requires_grad_(True)
            _, lp, mean, _ = RULE.step(v, x, sigmas[k], sigmas[k + 1], A_NOISE, prev_sample=x_next)
            if loss_of == "guard":
                loss, stats = guard_policy_loss(lp, old_lp, mean, old_mean, std, h.expand(n), advantages, 1e-3)
                factor = 1.0
            else:
                loss, stats = clipped_policy_loss(lp, old_lp, advantages, 1e-3)
                factor = float(h_over_s[k])
            assert torch.equal(stats["ratio"], torch.ones(n))
            (grad,) = torch.autograd.grad(loss.sum(), v)
            expected = advantages[:, None] * c_k * factor * xi / d
            torch.testing.assert_close(grad, expected, rtol=2e-4, atol=1e-9, msg=f"{loss_of} k={k}")


# ------------------------------------------------------------------------------------------ §20.1 item 6: Flow-DPPO


def test_dppo_mask_truth_table():
    """Dropped exactly where KL ≥ τ and the ratio moved the way A pushes it: 4 sign cases x KL below / above τ (and ρ =
    1, which is never dropped); dropped rows have loss 0 and no gradient, kept rows −A·ρ."""
    rows = [(kl_high, up, a) for kl_high in (False, True) for up in (False, True, None) for a in (1.0, -1.0)]
    n, d, tau = len(rows), 8, 1e-3
    std = torch.ones(n)
    shift = torch.tensor([0.1 if high else 0.01 for high, _, _ in rows])  # KL = shift²/2: 5e-3 above τ, 5e-5 below
    old_mean = torch.zeros(n, d)
    mean = old_mean + shift[:, None]
    old_lp = torch.zeros(n)
    lp = torch.tensor([0.0 if up is None else (0.01 if up else -0.01) for _, up, _ in rows], requires_grad=True)
    advantages = torch.tensor([a for _, _, a in rows])
    loss, stats = dppo_policy_loss(lp, old_lp, mean, old_mean, std, advantages, kl_threshold=tau)
    expected = torch.tensor([high and up is not None and (up == (a > 0)) for high, up, a in rows])
    assert torch.equal(stats["clipped"], expected)
    assert torch.equal(stats["over_threshold"], torch.tensor([high for high, _, _ in rows]))
    ratio = torch.exp(lp.detach())
    torch.testing.assert_close(loss.detach(), torch.where(expected, 0.0, -advantages * ratio))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    torch.testing.assert_close(grad, torch.where(expected, 0.0, -advantages * ratio))


def test_dppo_kl_is_the_gaussian_kl_over_the_element_count():
    _, lp, old_lp, mean, old_mean, std, _ = one_step(3, n=4, d=128, shift=0.5)
    _, stats = dppo_policy_loss(lp, old_lp, mean, old_mean, std, torch.ones(4), kl_threshold=1e-5)
    s = std.double()[:, None]
    exact = torch.distributions.kl_divergence(
        torch.distributions.Normal(old_mean.double(), s), torch.distributions.Normal(mean.double(), s)
    )
    torch.testing.assert_close(stats["kl"].double(), exact.sum(1) / 128, rtol=1e-5, atol=0)


# ------------------------------------------------------------------------------------------ losses against float64


def hand_step(v, x, x_next, sigma, sigma_next):
    """Flow-GRPO's transition in float64, written from ALGORITHMS §1.2: (mean, std, per-element-mean log-density)."""
    sigma_tilde = SIGMAS_TINY[1] if sigma >= 1 else sigma
    g2 = A_NOISE**2 * sigma / (1 - sigma_tilde)
    h = sigma - sigma_next
    mean = x * (1 - g2 * h / (2 * sigma)) - v * h * (1 + g2 * (1 - sigma) / (2 * sigma))
    std = math.sqrt(g2 * h)
    log_density = (-((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - 0.5 * math.log(2 * math.pi)).mean()
    return mean, std, log_density


SIGMAS_TINY = schedules.scheduler_sigmas({"shift": 3.0}, 4).tolist()  # T = 4: steps 0, 1, 2 stochastic and trained


def velocity(params, x, sigma):
    """A tiny velocity field with parameters: v = w ⊙ x + b·σ (elementwise over the latent [2, 3])."""
    w, b = params
    return w * x + b * sigma


def tiny_rollout(seed=11):
    """3 samples x 3 trained transitions of the T = 4 grid drawn by the old parameters; the current ones differ."""
    gen = torch.Generator().manual_seed(seed)
    old = [torch.randn(2, 3, generator=gen) * 0.5, torch.randn(2, 3, generator=gen)]
    new = [(p + 0.15 * torch.randn(p.shape, generator=gen)).requires_grad_(True) for p in old]
    x = torch.randn(3, 2, 3, generator=gen)
    states, old_lps = [x], []
    for k in range(3):
        xi = torch.randn(3, 2, 3, generator=gen)
        x, lp, _, _ = RULE.step(
            velocity(old, x, SIGMAS_TINY[k]), x, SIGMAS_TINY[k], SIGMAS_TINY[k + 1], A_NOISE, noise=xi
        )
        states.append(x)
        old_lps.append(lp)
    return old, new, states, torch.stack(old_lps, 1)  # old_lps [3, 3]


ADVANTAGES = torch.tensor([1.0, -0.7, 0.4])


def flowrl_loss(option, old, new, states, old_lps, clip_range, kl_threshold):
    """The mean over samples and their transitions of the option's per-sample loss, through flowrl.sde and the
    losses."""
    total = 0.0
    for k in range(3):
        sigma, sigma_next, x, x_next = SIGMAS_TINY[k], SIGMAS_TINY[k + 1], states[k], states[k + 1]
        _, lp, mean, std = RULE.step(velocity(new, x, sigma), x, sigma, sigma_next, A_NOISE, prev_sample=x_next)
        with torch.no_grad():
            _, _, old_mean, _ = RULE.step(velocity(old, x, sigma), x, sigma, sigma_next, A_NOISE, prev_sample=x_next)
        if option == "guard":
            dt = torch.full((3,), sigma - sigma_next)
            loss, _ = guard_policy_loss(lp, old_lps[:, k], mean, old_mean, std, dt, ADVANTAGES, clip_range)
        elif option == "dppo":
            loss, _ = dppo_policy_loss(lp, old_lps[:, k], mean, old_mean, std, ADVANTAGES, kl_threshold)
        else:  # the options off: what RatioControl hands the GRPO loop
            t = GRPOConfig(clip_range=clip_range)
            control = RatioControl(SimpleNamespace(cfg=SimpleNamespace(train=t)), None, [], torch.arange(3), 3)
            surrogate = control.surrogate(None, None, lp, old_lps[:, k], None, None)
            loss, _ = surrogate(ADVANTAGES)
            assert torch.equal(loss, clipped_policy_loss(lp, old_lps[:, k], ADVANTAGES, clip_range)[0])  # bit for bit
        total = total + loss.sum() / 9
    return total


def hand_loss(option, old, new, states, old_lps, clip_range, kl_threshold):
    """The same objective in float64 without flowrl: ALGORITHMS §0.5 (clip), §18.2-18.3 (guard), §19 (dppo). Also
    returns the quantities the clip and the mask compare (to check that float32 sits on the same side)."""
    total, compared = 0.0, []
    old64 = [p.detach().double() for p in old]
    new64 = [p.double() for p in new]
    for i in range(3):
        for k in range(3):
            sigma, sigma_next = SIGMAS_TINY[k], SIGMAS_TINY[k + 1]
            x, x_next = states[k][i].double(), states[k + 1][i].double()
            mean, std, log_density = hand_step(velocity(new64, x, sigma), x, x_next, sigma, sigma_next)
            old_mean, _, _ = hand_step(velocity(old64, x, sigma), x, x_next, sigma, sigma_next)
            a, old_lp = float(ADVANTAGES[i]), old_lps[i, k].double()
            mean_shift = ((mean - old_mean) ** 2).mean() / (2 * std**2)  # b of RatioNorm = Flow-DPPO's KL
            if option == "guard":
                ratio = torch.exp((log_density - old_lp + mean_shift) * std)
            else:
                ratio = torch.exp(log_density - old_lp)
            r, kl = float(ratio.detach()), float(mean_shift.detach())
            if option == "dppo":
                moved = (r > 1 and a > 0) or (r < 1 and a < 0)
                loss = 0.0 * ratio if (kl >= kl_threshold and moved) else -a * ratio
                compared.append(abs(kl - kl_threshold) / kl_threshold)
            else:
                loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_range, 1 + clip_range))
                compared.append(abs(abs(r - 1) - clip_range) / clip_range)
                if option == "guard":
                    loss = loss / (sigma - sigma_next)
            total = total + loss / 9
    return total, min(compared)


@pytest.mark.parametrize(
    "option, clip_range, kl_threshold", [("clip", 0.05, 0.0), ("guard", 0.01, 0.0), ("dppo", 0.0, 0.002)]
)
def test_loss_and_gradient_equal_a_float64_hand_computation(option, clip_range, kl_threshold):
    """3 samples x 3 transitions of a tiny parametrised velocity, current ≠ old weights, clip range and KL threshold set
    inside the spread of the ratios and KLs (some clipped or masked, some not): the value and the gradient of both
    parameters match the float64 objective; the options off are PPO's clip bit for bit."""
    old, new, states, old_lps = tiny_rollout()
    ours = flowrl_loss(option, old, new, states, old_lps, clip_range, kl_threshold)
    ours_grads = torch.autograd.grad(ours, new)
    hand, margin = hand_loss(option, old, new, states, old_lps, clip_range, kl_threshold)
    hand_grads = torch.autograd.grad(hand, new)
    assert margin > 0.02  # no ratio or KL within 2% of the boundary: float32 and float64 decide alike
    torch.testing.assert_close(ours.double(), hand.detach(), rtol=1e-4, atol=1e-7)
    for g, h in zip(ours_grads, hand_grads):
        assert h.abs().max() > 1e-3
        torch.testing.assert_close(g, h, rtol=1e-3, atol=1e-6)


def test_the_hand_case_exercises_the_clip_and_the_mask():
    """The tiny case above is not trivial: its ratios straddle the clip ranges and its KLs the threshold."""
    old, new, states, old_lps = tiny_rollout()
    guard, dppo = [], []
    for k in range(3):
        sigma, sigma_next, x, x_next = SIGMAS_TINY[k], SIGMAS_TINY[k + 1], states[k], states[k + 1]
        with torch.no_grad():
            _, lp, mean, std = RULE.step(velocity(new, x, sigma), x, sigma, sigma_next, A_NOISE, prev_sample=x_next)
            _, _, old_mean, _ = RULE.step(velocity(old, x, sigma), x, sigma, sigma_next, A_NOISE, prev_sample=x_next)
            dt = torch.full((3,), sigma - sigma_next)
            guard.append(guard_policy_loss(lp, old_lps[:, k], mean, old_mean, std, dt, ADVANTAGES, 0.01)[1]["clipped"])
            dppo.append(dppo_policy_loss(lp, old_lps[:, k], mean, old_mean, std, ADVANTAGES, 0.002)[1]["clipped"])
    guard, dppo = torch.cat(guard), torch.cat(dppo)
    assert 0 < int(guard.sum()) < 9 and 0 < int(dppo.sum()) < 9


# ------------------------------------------------------------------------------------------ the GRPO recipe


def toy_config(tmp_path, name, *overrides):
    base = [
        f"output_dir={tmp_path}",
        f"name={name}",
        "num_steps=1",
        "data.num_prompts_per_step=2",
        "data.group_size=4",
        "train.use_async_rewards=false",
        "logging.trackers=[]",
        "logging.progress_bar=false",
        "eval.num_prompts=1",
        "eval.seeds=[0]",
        "eval.num_steps=2",
        "eval.gold_rewards=[]",
        "checkpoint.every_n_steps=0",
    ]
    return load_config("configs/toy/grpo.yaml", base + list(overrides))


OPTIONS = {"guard": ["train.guard=true", "train.clip_range=2e-6"], "dppo": ["train.ratio_control=dppo"]}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_a_toy_run_with_each_option_trains_and_logs_its_metrics(tmp_path, option):
    """2 steps of the toy GRPO config, 2 minibatches and 2 optimizer steps a step (the second minibatch's old means come
    from the pass before the first optimizer step)."""
    cfg = toy_config(
        tmp_path, option, "num_steps=2", "train.num_minibatches=2", "train.num_rollout_batches=2", *OPTIONS[option]
    )
    trainer = build_trainer(cfg)
    before = [p.detach().clone() for p in trainer.parts.opt.params]
    kit.train(trainer)
    assert any((a - b).abs().max() > 0 for a, b in zip(before, trainer.parts.opt.params))
    lines = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    keys = {"log_ratio_mean", "log_ratio_std", "prepass_transitions"}
    keys |= {"norm_log_ratio_mean", "norm_log_ratio_std", "mean_bias"} if option == "guard" else set()
    keys |= {"mask_fraction", "kl_mean", "kl_max", "over_threshold_fraction"} if option == "dppo" else set()
    for line in lines:
        assert {f"{option}/{key}" for key in keys} <= line.keys()
        assert all(math.isfinite(line[k]) for k in line if k.startswith((option, "train/")))
        assert line[f"{option}/prepass_transitions"] == 4 * 2  # the second minibatch's 4 samples x 2 window steps
    other = "dppo" if option == "guard" else "guard"
    assert not any(k.startswith(f"{other}/") for k in lines[0])


def counted_step(cfg) -> tuple[dict, int]:
    """(metrics, model forwards) of one training step."""
    trainer = build_trainer(cfg)
    model, calls = trainer.parts.model, [0]
    velocity = model.velocity

    def counting(*args, **kwargs):
        calls[0] += 1
        return velocity(*args, **kwargs)

    model.velocity = counting
    return trainer.train_step(), calls[0]


def test_on_policy_every_ratio_is_one_and_the_options_add_only_their_pass(tmp_path):
    """θ = old (learning rate 0), 2 minibatches x 1 accumulation x 2 inner epochs. Off: the plain step, with no guard/
    or dppo/ metric. On: every ratio of every pass is exactly 1, whether its old means came from its own forward, the
    pass before the first optimizer step or the table the second epoch reads; that pass is one forward for each of the
    second minibatch's 2 window steps, and the first minibatch's old means cost nothing."""
    on_policy = [
        "train.learning_rate=0.0",
        "train.num_minibatches=2",
        "train.num_rollout_batches=2",
        "train.num_inner_epochs=2",
    ]
    plain, forwards = counted_step(toy_config(tmp_path, "plain", *on_policy))
    assert not any(k.startswith(("guard/", "dppo/")) for k in plain)
    for option, overrides in OPTIONS.items():
        metrics, count = counted_step(toy_config(tmp_path, option, *on_policy, *overrides))
        assert count == forwards + 2, option
        assert metrics["train/ratio_min"] == 1.0 and metrics["train/ratio_max"] == 1.0, option
        assert metrics["train/clip_fraction"] == 0.0 and metrics[f"{option}/log_ratio_std"] == 0.0, option
        assert metrics[f"{option}/log_ratio_mean"] == 0.0 and metrics[f"{option}/prepass_transitions"] == 8, option


def toy_gradient_run(tmp_path, option, shift):
    """One toy GRPO step at learning rate 0 with a trained-looking adapter, samples 0 and 1's stored log-probs shifted
    by ±shift (their ratios leave the clip band): (trainer, rollout, advantages, gradient at the optimizer step)."""
    cfg = toy_config(
        tmp_path, option, "train.learning_rate=0.0", "train.kl_coef=0.0", "train.max_grad_norm=1e9", *OPTIONS[option]
    )
    cfg.train.clip_range = 1e-3
    trainer = build_trainer(cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in trainer.parts.model.transformer.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    seen, grads = {}, {}
    optimise, step = grpo.grpo_optimise, trainer.parts.opt.step

    def shifted(parts, rollout, advantages, keep, *rest, **options):
        rollout.log_probs[0] += shift
        rollout.log_probs[1] -= shift
        seen.update(rollout=rollout, advantages=advantages.clone())
        return optimise(parts, rollout, advantages, keep, *rest, **options)

    def capture(losses):
        grads.update({n: p.grad.detach().clone() for n, p in zip(trainer.parts.opt.names, trainer.parts.opt.params)})
        return step(losses)

    grpo.grpo_optimise, trainer.parts.opt.step = shifted, capture
    try:
        trainer.train_step()
    finally:
        grpo.grpo_optimise = optimise
    return trainer, seen["rollout"], seen["advantages"], grads


def toy_hand_objective(trainer, rollout, advantages, option):
    """(1/N) Σ_i (1/|K_i|) Σ_k loss_ik in float64 from the model's velocity: guard's clipped RatioNorm ratio over Δσ
    (θ = old, so μ_old = sg(μ_θ)), or dppo's −A·ρ (KL 0 < τ: nothing masked)."""
    model, sigmas, eps = trainer.parts.model, rollout.sigmas.tolist(), trainer.parts.cfg.train.clip_range
    total, n = 0.0, len(rollout.prompts)
    for i in range(n):
        cond = {key: value[i : i + 1] for key, value in rollout.cond.items()}
        steps = [k for row, k in rollout.transitions.tolist() if row == i]
        for k in steps:
            sigma, sigma_next = sigmas[k], sigmas[k + 1]
            level = float(rollout.noise_levels[i, k])
            x, x_next = rollout.latents[i : i + 1, k], rollout.latents[i : i + 1, k + 1]
            sigma_tilde = sigmas[1] if sigma >= 1 else sigma
            g2, h = level**2 * sigma / (1 - sigma_tilde), sigma - sigma_next
            v = model.velocity(x, sigma, cond, rollout.guidance_scale).double()
            x64, x_next64 = x.double(), x_next.double()
            mean = x64 - h * (v + g2 * (x64 + (1 - sigma) * v) / (2 * sigma))
            std = math.sqrt(g2 * h)
            log_density = torch.distributions.Normal(mean, std).log_prob(x_next64).mean()
            a, old = float(advantages[i]), rollout.log_probs[i, k].double()
            if option == "guard":
                b = ((mean - mean.detach()) ** 2).mean() / (2 * std**2)
                ratio = torch.exp((log_density - old + b) * std)
                loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - eps, 1 + eps)) / h
            else:
                loss = -a * torch.exp(log_density - old)
            total = total + loss / len(steps)
    return total / n


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_a_toy_step_gradient_equals_the_float64_hand_objective(tmp_path, option):
    trainer, rollout, advantages, grads = toy_gradient_run(tmp_path, option, shift=0.01)
    assert advantages.abs().max() > 0.5
    trainer.parts.model.transformer.zero_grad(set_to_none=True)
    toy_hand_objective(trainer, rollout, advantages, option).backward()
    largest = max(float(g.abs().max()) for g in grads.values())
    assert largest > 0
    for name, p in zip(trainer.parts.opt.names, trainer.parts.opt.params):
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5 * largest, msg=name)


# ------------------------------------------------------------------------------------------ composition


def test_the_matrix_lists_both_options_and_refuses_what_they_cannot_use():
    rows = {(r["sampler"], r["trainer"], r["balancer"]): r for r in compose.matrix()}

    def why(sampler, trainer):
        return rows[(sampler, trainer, "weighted_sum")]["why"]

    assert why("sde", "grpo(guard)") == why("sde", "grpo(dppo)") == why("sde(memoryless)", "grpo(guard)") == ""
    assert why("candidates(full=sde)", "grpo(guard)") == "" and why("tree", "grpo(dppo)") == ""  # a tree of dance steps
    assert why("tree", "grpo(guard)").startswith("train.guard (GRPO-Guard) needs Flow-GRPO SDE steps")
    assert why("ode", "grpo(dppo)").startswith("trainer: grpo needs behaviour log-probs")


@pytest.mark.parametrize(
    "sampler, train, start",
    [
        ({"kind": "dance", "noise_level": 0.3}, {"guard": True}, "train.guard (GRPO-Guard) needs Flow-GRPO SDE steps"),
        ({"kind": "cps", "noise_level": 0.8}, {"guard": True}, "train.guard (GRPO-Guard) needs Flow-GRPO SDE steps"),
        (
            {"kind": "cps", "noise_level": 0.8, "log_prob_mode": "cps_sq"},
            {"ratio_control": "dppo"},
            "train.ratio_control=dppo",
        ),
        ({}, {"guard": True, "ratio_control": "dppo"}, "train.guard normalises the ratio that PPO's clip bounds"),
        ({}, {"ratio_control": "ppo"}, "train.ratio_control='ppo' must be one of clip, dppo"),
        ({}, {"ratio_control": "dppo", "dppo_kl_threshold": -1.0}, "train.dppo_kl_threshold=-1.0 must be >= 0"),
    ],
)
def test_impossible_combinations_are_one_line_errors(sampler, train, start):
    cfg = toy_config("unused", "refused", *[f"sampler.{k}={v}" for k, v in sampler.items()])
    for key, value in train.items():
        setattr(cfg.train, key, value)
    with pytest.raises(ValueError) as err:
        build_trainer(cfg)
    assert str(err.value).startswith(start) and "\n" not in str(err.value)
