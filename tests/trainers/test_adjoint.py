"""Adjoint matching: the memoryless schedule is the flow_grpo step with a = √2 (against the closed-form
Euler–Maruyama step of docs/math.md#adjoint-matching); the lean adjoint of a linear velocity field with a quadratic
reward against its matrix-exponential closed form; the AM regression's residual has zero conditional mean exactly
when the model is the tilted optimum of a Gaussian problem (and not at the base); the recipe's one-line errors and a
toy learning test graded by the exact checker."""

import pytest
import torch
from dotted import set_dotted

from flowrl import schedules, sde
from flowrl.losses import adjoint_matching_loss
from flowrl.schedules import adjoint_loss_times
from flowrl.sde_memoryless import MEMORYLESS_NOISE_LEVEL, adjoint_residual, lean_adjoint, memoryless_diffusion
from flowrl.trainers import build_config, build_trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

MEMORYLESS = {
    "name": "sde",
    "kind": "flow_grpo",
    "noise_level": MEMORYLESS_NOISE_LEVEL,
    "sigma_schedule": "dance",
    "sigma_shift": 1.0,
    "sigma_max": 0.95,
    "num_steps": 4,
    "guidance_scale": 1.0,
}


def test_memoryless_schedule_is_the_flow_grpo_step_with_a_sqrt2():
    g = torch.Generator().manual_seed(0)
    x, v, xi = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    for sigma, sigma_next in [(0.9, 0.8), (0.5, 0.45), (0.1, 0.0)]:
        h = sigma - sigma_next
        # the memoryless SDE dX = (2u − X/τ) dτ + σ_d dB in data time τ = 1 − σ, u = −v, one Euler–Maruyama step
        tau = 1 - sigma
        mean = x + h * (2 * -v - x / tau)
        std = (2 * (1 - tau) / tau) ** 0.5 * h**0.5
        out, _, step_mean, step_std = sde.sde_step(
            v, x, sigma, sigma_next, "flow_grpo", MEMORYLESS_NOISE_LEVEL, noise=xi
        )
        assert torch.allclose(step_mean, mean, atol=1e-5)
        assert float(step_std.flatten()[0]) == pytest.approx(std, rel=1e-5)
        assert torch.allclose(out, mean + std * xi, atol=1e-5)
        assert float(memoryless_diffusion(sigma)) == pytest.approx((2 * sigma / (1 - sigma)) ** 0.5, rel=1e-6)
    with pytest.raises(ValueError, match="singular at σ = 1"):
        memoryless_diffusion(1.0)


# The grids the shipped configs use: AM's 40 uniform steps from σ = 0.975
# (configs/sd3/adjoint_matching_imagereward.yaml) and the toy recipe's 10 (configs/toy/adjoint_matching.yaml). Fine
# grids hid a coarse-grid bug here once.
SHIPPED_GRIDS = [(40, 0.975), (10, 0.975)]


@pytest.mark.parametrize("num_steps,sigma_max", SHIPPED_GRIDS)
def test_lean_adjoint_of_a_linear_field_matches_its_closed_form(num_steps, sigma_max):
    """v(x) = W x (σ-independent), r(x) = −‖x − y‖²/2. The last transition is the rollout's plain Euler step, whose
    adjoint is exact: ã_{T−1} = (I − h·Wᵀ)·ã_T. Before it the continuous lean adjoint dã/dτ = (2Wᵀ + 1/τ)·ã gives
    ã(τ) = (τ/τ_{T−1})·exp(−2(τ_{T−1} − τ)Wᵀ)·ã_{T−1}, whatever the trajectory (the field is linear)."""
    torch.manual_seed(0)
    w = torch.tensor([[0.3, -0.5], [0.2, 0.1]])
    lam = 2.0
    sigmas = schedules.dance_sigmas(num_steps, 1.0, sigma_max)
    latents = torch.randn(3, num_steps + 1, 2)  # any states: a linear field's Jacobian does not depend on them
    y = torch.tensor([0.5, -1.0])
    terminal = lam * (latents[:, -1] - y)  # −λ·∇r
    keep = list(range(num_steps))
    adjoints, velocities = lean_adjoint(lambda x, s: x @ w.T, latents, sigmas, terminal, keep)
    h_last = float(sigmas[-2])
    last = terminal @ (torch.eye(2) - h_last * w.T).T
    tau_last = 1 - h_last
    for k in keep:
        tau = 1 - float(sigmas[k])
        closed = (tau / tau_last) * last @ torch.linalg.matrix_exp(-2 * (tau_last - tau) * w.T).T
        assert torch.allclose(adjoints[k], closed, rtol=2e-3, atol=2e-5), k
        assert torch.allclose(velocities[k], latents[:, k] @ w.T)


def gaussian_velocity(mu, s):
    """The flow-matching velocity of data N(mu, s²) in 1-D: E[ε − x0 | x_σ = x], linear in x."""

    def v(x, sigma):
        var = (1 - sigma) ** 2 * s**2 + sigma**2
        return -mu + (sigma - (1 - sigma) * s**2) / var * (x - (1 - sigma) * mu)

    return v


def gaussian_adjoint_factor(tau: float, s: float, n: int = 20000) -> float:
    """F(τ) = ã(τ)/ã(1) of the continuous lean adjoint for 1-D Gaussian data N(μ, s²): ln F = −∫_τ^1 (2·J(1 − t) + 1/t)
    dt with J(σ) = (σ − (1 − σ)s²) / ((1 − σ)²s² + σ²) (the base velocity's slope), the 1/t part exact (ln τ), the rest
    by Simpson's rule in float64."""
    import math

    t = torch.linspace(tau, 1, 2 * n + 1, dtype=torch.float64)
    sigma = 1 - t
    slope = (sigma - (1 - sigma) * s**2) / ((1 - sigma) ** 2 * s**2 + sigma**2)
    weights = torch.ones_like(t)
    weights[1:-1:2], weights[2:-1:2] = 4, 2
    integral = float((weights * 2 * slope).sum()) * float(t[1] - t[0]) / 3
    return math.exp(-integral + math.log(tau))


@pytest.mark.parametrize("num_steps,sigma_max,tolerance", [(40, 0.975, 0.02), (10, 0.975, 0.08)])
@pytest.mark.parametrize("s", [0.3, 0.8, 1.0])
def test_lean_adjoint_of_a_gaussian_base_follows_the_continuous_adjoint_on_the_shipped_grids(
    num_steps, sigma_max, tolerance, s
):
    """The base model of 1-D Gaussian data (its velocity linear in x, its slope J(σ) rising from −1 at the data to ≈ 1
    at the noise end) has the closed-form lean adjoint F(τ)·ã(1). At every grid index, including k = 0 where τ_0 =
    0.025 (the first-order Euler recursion's factor 1 − h/τ_0 is ≈ 0 there: −102% at k = 0, −59% at k = 1 on the
    40-step grid), the recursion stays within `tolerance` of it (measured: ≤ 0.1% on the 40-step grid)."""
    sigmas = schedules.dance_sigmas(num_steps, 1.0, sigma_max)
    latents = torch.randn(2, num_steps + 1, 1, generator=torch.Generator().manual_seed(0))
    terminal = torch.ones(2, 1)
    adjoints, _ = lean_adjoint(
        lambda z, sg: gaussian_velocity(0.3, s)(z, sg[:, None]), latents, sigmas, terminal, list(range(num_steps))
    )
    for k in range(num_steps):
        closed = gaussian_adjoint_factor(1 - float(sigmas[k]), s)
        assert float(adjoints[k][0, 0]) == pytest.approx(closed, rel=tolerance), (k, float(adjoints[k][0, 0]), closed)


def conditional_bias(velocity, base, lam, y, mu_star, s_star, n=40000, num_steps=40, sigma_max=0.975, keep=None):
    """{k: (largest regression coefficient of the AM residual on 1 and x_k, the residual's std)} at each trained grid
    index, for trajectories of the memoryless SDE of `velocity` started at the tilted marginal at σ_max."""
    g = torch.Generator().manual_seed(1)
    sigmas = schedules.dance_sigmas(num_steps, 1.0, sigma_max)
    x = (1 - sigma_max) * (mu_star + s_star * torch.randn(n, generator=g)) + sigma_max * torch.randn(n, generator=g)
    states = [x]
    for k in range(num_steps):
        s, s_next = float(sigmas[k]), float(sigmas[k + 1])
        level = MEMORYLESS_NOISE_LEVEL if k < num_steps - 1 else 0.0  # the last step noiseless
        x, _, _, _ = sde.sde_step(velocity(x, s)[:, None], x[:, None], s, s_next, "flow_grpo", level, generator=g)
        x = x[:, 0]
        states.append(x)
    latents = torch.stack(states, 1)[:, :, None]  # [n, T+1, 1]
    terminal = lam * (latents[:, -1] - y)  # −λ∇r for r = −(x − y)²/2
    keep = list(range(num_steps)) if keep is None else keep  # every index the loss may train (σ > 0)
    adjoints, v_base = lean_adjoint(lambda z, s: base(z, s[:, None]), latents, sigmas, terminal, keep)
    worst = {}
    for k in keep:
        s = sigmas[k].expand(n)
        xk = latents[:, k]
        residual = adjoint_residual(velocity(xk, float(sigmas[k])), v_base[k], adjoints[k], s)[:, 0]
        design = torch.stack([torch.ones(n), (xk[:, 0] - xk[:, 0].mean()) / xk[:, 0].std()], 1)
        coef = torch.linalg.lstsq(design, residual[:, None]).solution[:, 0]
        worst[k] = (float(coef.abs().max()), float(residual.std()))
    return worst


def test_am_residual_has_zero_conditional_mean_at_the_tilted_optimum():
    """Base data N(0.3, 0.8²), reward −(x − y)²/2, λ = 1.5: the tilt is N(μ*, s*²) with 1/s*² = 1/s² + λ,
    μ* = s*²(μ/s² + λy). With memoryless noise the optimal velocity is the flow-matching velocity of the tilt, so the
    AM regression target's conditional mean given x_k is what that model predicts: on AM's 40-step grid from
    σ = 0.975 the residual regresses to ≈ 0 at every trained index k = 0 … 39, measured against the base model's
    residual scale at the same index (the last transition is deterministic, so there the optimum's own residual
    spread is ≈ 0 too); the base model's residual is far from it (1.13). A first-order Euler recursion of the adjoint
    measures 0.59 (k = 0), 0.34 (k = 1), 0.25 (k = 2) here; what is left (≤ 0.042) is the Euler–Maruyama rollout's
    own discretization: the tilted velocity is the optimum of the continuous process, not of its 40-step walk."""
    mu, s, lam, y = 0.3, 0.8, 1.5, 1.2
    s_star = (1 / s**2 + lam) ** -0.5
    mu_star = s_star**2 * (mu / s**2 + lam * y)
    base, tilted = gaussian_velocity(mu, s), gaussian_velocity(mu_star, s_star)
    at_optimum = conditional_bias(tilted, base, lam, y, mu_star, s_star)
    at_base = conditional_bias(base, base, lam, y, mu, s)
    for k, (bias, _) in at_optimum.items():
        base_bias, base_scale = at_base[k]
        assert bias / base_scale < 0.06, (k, bias, base_scale)
        assert base_bias / base_scale > 0.3, (k, base_bias, base_scale)


def test_loss_clips_each_term_and_divides_by_the_element_count():
    residual = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])  # squared norms 5 and 25, D = 2
    assert adjoint_matching_loss(residual, None).tolist() == [2.5, 12.5]
    assert adjoint_matching_loss(residual, 10.0).tolist() == [2.5, 5.0]


def test_loss_times_keep_every_late_time_and_draw_the_rest():
    sigmas = torch.linspace(0.975, 0, 41)  # AM's 40-step grid, h = 0.024375
    times = adjoint_loss_times(sigmas, 0.25, 10, torch.Generator().manual_seed(0))
    late = [k for k in range(40) if float(sigmas[k]) <= 0.25]
    assert set(late) <= set(times) and len(times) == len(late) + 10
    assert all(float(sigmas[k]) > 0 for k in times) and times == sorted(times)


def am_config(tmp_path, **overrides):
    data = {
        "name": "am",
        "trainer": "adjoint_matching",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "seed": 3,
        "num_steps": 4,
        "model": {"path": "toy", "lora_rank": 8, "lora_alpha": 8},
        "data": {"prompts": ["two green circles", "one blue square"], "num_prompts_per_step": 2, "group_size": 4},
        "sampler": dict(MEMORYLESS),
        "rewards": [{"name": "toy_attributes"}],
        "train": {"learning_rate": 3e-3, "reward_multiplier": 30.0, "num_random_loss_times": 1, "use_ema": False},
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
        "checkpoint": {"every_n_steps": 0},
        "logging": {"trackers": [], "progress_bar": False},
    }
    set_dotted(data, overrides)
    return build_config(data)


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(
        ValueError, match="needs differentiable rewards; jpeg_compressibility is not: use one of .*toy_attributes"
    ):
        build_trainer(am_config(tmp_path, rewards=[{"name": "jpeg_compressibility"}]))
    with pytest.raises(ValueError, match="needs the memoryless SDE"):
        build_trainer(am_config(tmp_path, **{"sampler.noise_level": 0.7}))
    with pytest.raises(ValueError, match="stops short of σ = 1"):
        build_trainer(am_config(tmp_path, **{"sampler.sigma_max": 1.0}))
    with pytest.raises(ValueError, match="classifier-free guidance for toy"):
        build_trainer(am_config(tmp_path, **{"sampler.guidance_scale": 4.5}))


def test_full_fine_tuning_uses_a_frozen_copy_as_the_base(tmp_path):
    trainer = build_trainer(am_config(tmp_path, **{"model.use_lora": False, "train.learning_rate": 1e-4}))
    model = trainer.parts.model
    x = torch.randn(2, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond, sigma = model.encode(["one blue square", "two green circles"]), torch.tensor([0.7, 0.3])
    trainer.train_step()
    with torch.no_grad():
        v = model.velocity(x, sigma, cond, 1.0)
        with trainer.base_model():
            v_base = model.velocity(x, sigma, cond, 1.0)
        assert model.velocity(x, sigma, cond, 1.0).equal(v)  # the trained transformer is back after the block
    assert (v - v_base).abs().max() > 0
    assert not any(p.requires_grad for p in trainer.parts.base_copy.parameters())


def test_a_differentiable_redness_reward_makes_the_policy_paint_more_red(tmp_path):
    """Graded by the exact checker's palette on held-out seeds, not by the reward it trained on."""
    from test_nft_trainer import PROMPTS, measured_red

    overrides = {
        "rewards": [{"name": "redness.RednessReward"}],
        "data.prompts": PROMPTS,
        "data.num_prompts_per_step": 4,
        "train.reward_multiplier": 3000.0,
        "train.learning_rate": 1e-2,
    }
    trainer = build_trainer(am_config(tmp_path, **overrides))
    before = measured_red(trainer)
    rewards = [trainer.train_step()["reward/redness.RednessReward/mean"] for _ in range(6)]
    after = measured_red(trainer)
    assert after > before + 0.04, (before, after, rewards)  # measured 0.030 -> 0.170
