"""Tests of flowrl/sde.py against numbers computed independently: diffusers' scheduler, hand-written
formulas of docs/math.md#sde-steps in float64, torch.distributions.Normal, and closed-form Gaussian marginals."""

from __future__ import annotations

import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift as diffusers_calculate_shift

from flowrl import schedules, sde

STEP_COUNTS = (1, 4, 10, 28)
STOCHASTIC_KINDS = ("flow_grpo", "dance", "cps")

# Scheduler configs shaped like the published checkpoints' scheduler_config.json files.
SD35_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0}
FLUX_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler",
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
SANA_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0}
WAN_CONFIG = {"num_train_timesteps": 1000, "shift": 5.0, "use_dynamic_shifting": False}


def diffusers_sigmas(config, num_steps, sigmas=None, mu=None):
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(num_steps, sigmas=sigmas, mu=mu)
    return scheduler


def sd3_grid(num_steps=10):
    return schedules.scheduler_sigmas(SD35_CONFIG, num_steps)  # [T+1]


# ------------------------------------------------------------------------------------------ schedules


@pytest.mark.parametrize("num_steps", STEP_COUNTS)
@pytest.mark.parametrize("config", [SD35_CONFIG, SANA_CONFIG, WAN_CONFIG], ids=["sd35", "sana", "wan"])
def test_static_shift_schedule_matches_diffusers_bitwise(config, num_steps):
    reference = diffusers_sigmas(config, num_steps)
    sigmas = schedules.scheduler_sigmas(config, num_steps)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
    assert torch.equal(sigmas, reference.sigmas)
    assert torch.equal(sde.timesteps_from_sigmas(sigmas[:-1]), reference.timesteps)
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0


@pytest.mark.parametrize("num_steps", STEP_COUNTS)
@pytest.mark.parametrize("image_seq_len", [256, 1024, 4096])
def test_flux_dynamic_schedule_matches_diffusers_bitwise(num_steps, image_seq_len):
    custom = np.linspace(1.0, 1 / num_steps, num_steps)  # what FluxPipeline passes
    mu = schedules.calculate_shift(image_seq_len)
    reference = diffusers_sigmas(FLUX_CONFIG, num_steps, sigmas=custom, mu=mu)
    sigmas = schedules.scheduler_sigmas(FLUX_CONFIG, num_steps, sigmas=custom, mu=mu)
    assert torch.equal(sigmas, reference.sigmas)
    assert torch.equal(sde.timesteps_from_sigmas(sigmas[:-1]), reference.timesteps)


@pytest.mark.parametrize("num_steps", (2, 4, 10, 28))
@pytest.mark.parametrize(
    "config, custom, mu",
    [
        ({"use_dynamic_shifting": True}, False, 0.8),  # dynamic shift over the default grid (1 -> 1/N)
        ({"use_dynamic_shifting": True, "time_shift_type": "linear"}, False, 1.3),
        ({"use_dynamic_shifting": True, "time_shift_type": "linear"}, True, 1.3),
        ({"use_dynamic_shifting": True, "shift_terminal": 0.1}, True, 0.95),  # LTX-Video style
        ({"shift": 3.0, "shift_terminal": 0.02}, False, None),
        ({"shift": 5.0}, True, None),  # custom sigmas with a static shift stay float32 in diffusers
        ({"shift": 2.0, "num_train_timesteps": 500}, False, None),
        (WAN_CONFIG | {"use_dynamic_shifting": True}, False, 0.7),
    ],
)
def test_other_scheduler_options_match_diffusers_bitwise(config, custom, mu, num_steps):
    custom_sigmas = list(np.linspace(1.0, 1 / num_steps, num_steps)) if custom else None
    reference = diffusers_sigmas(config, num_steps, sigmas=custom_sigmas, mu=mu)
    assert torch.equal(schedules.scheduler_sigmas(config, num_steps, sigmas=custom_sigmas, mu=mu), reference.sigmas)


@pytest.mark.parametrize("solver", ["UniPCMultistepScheduler", "DPMSolverMultistepScheduler"])
def test_flow_sigma_solver_configs_read_as_euler_with_their_flow_shift(solver):
    import diffusers

    # A config as SANA / Wan checkpoints ship it (here built in code, so without _class_name) and as saved.
    scheduler = getattr(diffusers, solver)(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    config = dict(scheduler.config)
    reference = diffusers_sigmas({"shift": 5.0}, 10).sigmas
    assert torch.equal(schedules.scheduler_sigmas(config, 10), reference)
    assert torch.equal(schedules.scheduler_sigmas(config | {"_class_name": solver}, 10), reference)


def test_inverted_sigmas_only_on_request():
    config = {"shift": 3.0, "invert_sigmas": True}
    with pytest.raises(ValueError, match="invert_sigmas"):
        schedules.scheduler_sigmas(config, 8)
    reference = diffusers_sigmas(config, 8)
    assert torch.equal(schedules.scheduler_sigmas(config, 8, allow_inverted=True), reference.sigmas)


def test_sd3_shift3_test_vector_of_algorithms_0_1():
    expected = [1000, 960.13, 913.35, 857.69, 790.37, 707.28, 602.15, 464.88, 278.05, 8.93]  # rounded to 0.01
    timesteps = sde.timesteps_from_sigmas(sd3_grid(10))
    assert timesteps[-1] == 0.0
    assert torch.allclose(timesteps[:-1], torch.tensor(expected), atol=0.0051, rtol=0)


def test_sd3_grid_by_hand():
    # Linear from 1 to shift(1/1000) = 3/1002, shifted again: σ_k = shift(1 − k·(1 − 3/1002)/(T − 1)).
    num_steps = 10
    lowest = 3 * 0.001 / (1 + 2 * 0.001)
    hand = []
    for k in range(num_steps):
        u = 1 - k * (1 - lowest) / (num_steps - 1)
        hand.append(3 * u / (1 + 2 * u))
    assert torch.allclose(sd3_grid(num_steps)[:-1].double(), torch.tensor(hand, dtype=torch.float64), atol=1e-7, rtol=0)


def test_dance_grid_t16_by_hand():
    sigmas = schedules.dance_sigmas(16, 3.0)
    # shift(1 − k/16; 3) = 3(16 − k) / (48 − 2k) exactly.
    exact = torch.tensor([3 * (16 - k) / (48 - 2 * k) for k in range(17)], dtype=torch.float64)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (17,)
    assert torch.allclose(sigmas.double(), exact, atol=1e-7, rtol=0)
    listed = [
        1,
        0.9783,
        0.9545,
        0.9286,
        0.9,
        0.8684,
        0.8333,
        0.7941,
        0.75,
        0.7,
        0.6429,
        0.5769,
        0.5,
        0.4091,
        0.3,
        0.1667,
        0,
    ]
    assert torch.allclose(sigmas, torch.tensor(listed), atol=5.1e-5, rtol=0)


def test_shift_sigmas_by_hand():
    shifted = schedules.shift_sigmas(torch.tensor([0.0, 0.25, 0.5, 1.0]), 3.0)
    assert torch.allclose(shifted, torch.tensor([0.0, 0.5, 0.75, 1.0]), atol=1e-7, rtol=0)  # 0.75/1.5, 1.5/2
    assert torch.equal(schedules.shift_sigmas([0.3, 0.6], 1.0), torch.tensor([0.3, 0.6]))


def test_calculate_shift_matches_flux_pipeline_and_hand_values():
    assert schedules.calculate_shift(256) == pytest.approx(0.5, abs=1e-12)
    assert schedules.calculate_shift(4096) == pytest.approx(1.15, abs=1e-12)
    assert schedules.calculate_shift(1024) == pytest.approx(0.5 + 0.65 * 768 / 3840, abs=1e-12)
    for seq_len in (64, 256, 1024, 3600, 4096, 8192):
        assert schedules.calculate_shift(seq_len) == diffusers_calculate_shift(seq_len)
    assert schedules.calculate_shift(1024, 128, 2048, 0.3, 1.0) == diffusers_calculate_shift(1024, 128, 2048, 0.3, 1.0)


def test_timesteps_from_sigmas():
    assert torch.equal(sde.timesteps_from_sigmas(torch.tensor([1.0, 0.5, 0.0])), torch.tensor([1000.0, 500.0, 0.0]))
    assert torch.equal(sde.timesteps_from_sigmas([0.25], num_train_timesteps=500), torch.tensor([125.0]))


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: schedules.scheduler_sigmas({"use_karras_sigmas": True}, 4), "use_karras_sigmas"),
        (lambda: schedules.scheduler_sigmas({"use_beta_sigmas": True}, 4), "use_beta_sigmas"),
        (lambda: schedules.scheduler_sigmas({"_class_name": "DPMSolverMultistepScheduler"}, 4), "_class_name"),
        (
            lambda: schedules.scheduler_sigmas({"_class_name": "UniPCScheduler", "flow_shift": 3.0}, 4),
            "use_flow_sigmas",
        ),
        (lambda: schedules.scheduler_sigmas({"_class_name": "DDIMScheduler"}, 4), "_class_name"),
        (lambda: schedules.scheduler_sigmas(FLUX_CONFIG, 4), "mu"),
        (lambda: schedules.scheduler_sigmas({"time_shift_type": "cosine"}, 4), "time_shift_type"),
        (lambda: schedules.scheduler_sigmas(SD35_CONFIG, 4, sigmas=[1.0, 0.5]), "sigmas"),
        (lambda: schedules.scheduler_sigmas(SD35_CONFIG, 0), "num_steps"),
        (lambda: schedules.scheduler_sigmas({"shift_terminal": 0.1}, 1), "shift_terminal"),
        (lambda: schedules.dance_sigmas(0, 3.0), "num_steps"),
        (lambda: schedules.shift_sigmas([0.5], 0.0), "shift"),
    ],
)
def test_schedule_bad_input_raises_one_line(call, field):
    with pytest.raises(ValueError, match=field) as error:
        call()
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------ estimates


def test_clean_and_noise_estimates_invert_the_interpolant():
    generator = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, 2, 4, generator=generator)  # [N, C, L]
    noise = torch.randn(3, 2, 4, generator=generator)
    sigma = torch.tensor([0.9, 0.5, 0.1])  # [N]
    x = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
    v = noise - x0  # the exact velocity of a single data point
    assert torch.allclose(sde.x0_from_velocity(x, v, sigma), x0, atol=1e-6)
    assert torch.allclose(sde.noise_from_velocity(x, v, sigma), noise, atol=1e-6)


# ------------------------------------------------------------------------------------------ steps


def reference_step(x, v, sigma, sigma_next, kind, a, first_step_threshold=1.0):
    """Mean and std of one transition in float64, written as docs/math.md#sde-steps writes them (not as sde.py does)."""
    x, v = x.double(), v.double()
    sigma = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1, *[1] * (x.ndim - 1))
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float64).reshape(-1, *[1] * (x.ndim - 1))
    a = torch.as_tensor(a, dtype=torch.float64).reshape(-1, *[1] * (x.ndim - 1))
    dt = sigma_next - sigma
    if kind == "flow_grpo":  # docs/math.md#sde-steps
        sigma_tilde = torch.where(sigma >= first_step_threshold, sigma_next, sigma)
        g = a * torch.sqrt(sigma / (1 - sigma_tilde))
        mean = x * (1 + g**2 * dt / (2 * sigma)) + v * dt * (1 + g**2 * (1 - sigma) / (2 * sigma))
        std = g * torch.sqrt(-dt)
    elif kind == "dance":  # DanceGRPO's score form (docs/math.md#sde-steps)
        x0_hat = x - sigma * v
        score = -(x - (1 - sigma) * x0_hat) / sigma**2
        mean = x + dt * v - 0.5 * a**2 * score * dt
        std = a * torch.sqrt(-dt)
    else:  # cps (docs/math.md#sde-steps)
        std = sigma_next * torch.sin(a * math.pi / 2)
        x0_hat, noise_hat = x - sigma * v, x + (1 - sigma) * v
        mean = (1 - sigma_next) * x0_hat + torch.sqrt(sigma_next**2 - std**2) * noise_hat
    return mean, std.flatten()


@pytest.mark.parametrize("kind", sde.KINDS)
def test_zero_noise_level_is_the_diffusers_euler_step_exactly(kind):
    generator = torch.Generator().manual_seed(1)
    scheduler = diffusers_sigmas(SD35_CONFIG, 6)
    latents = torch.randn(3, 4, 2, 2, generator=generator)  # [N, C, H, W]
    ours = latents.clone()
    for k, timestep in enumerate(scheduler.timesteps):
        v = torch.randn(latents.shape, generator=generator)
        latents = scheduler.step(v, timestep, latents).prev_sample
        for noise_level in (0.0, torch.zeros(3)):
            prev, log_prob, mean, std = sde.sde_step(
                v,
                ours,
                float(scheduler.sigmas[k]),
                float(scheduler.sigmas[k + 1]),
                kind,
                noise_level,
                generator=torch.Generator().manual_seed(k),
            )
            assert torch.equal(prev, latents) and torch.equal(mean, latents)
            assert torch.equal(std, torch.zeros(3)) and torch.equal(log_prob, torch.zeros(3))
        ours = prev


@pytest.mark.parametrize("noise_level", [0.3, 0.7, 0.9, 1.2])
@pytest.mark.parametrize(
    "grid",
    [
        sd3_grid(10),
        sd3_grid(28),
        schedules.dance_sigmas(16, 3.0),
        torch.linspace(1, 0, 6),
        schedules.scheduler_sigmas(FLUX_CONFIG, 6, sigmas=np.linspace(1, 1 / 6, 6), mu=1.15),
    ],
    ids=["sd3_10", "sd3_28", "dance_16", "uniform_5", "flux_6"],
)
def test_flow_grpo_first_step_std_equals_noise_level_exactly(grid, noise_level):
    x = torch.zeros(2, 3)
    _, _, _, std = sde.sde_step(x, x, float(grid[0]), float(grid[1]), "flow_grpo", noise_level)
    assert torch.equal(std, torch.full((2,), noise_level, dtype=torch.float32))
    assert sde.sde_std(grid[0], grid[1], "flow_grpo", noise_level) == torch.tensor(noise_level, dtype=torch.float32)


def test_std_test_vectors_on_the_sd3_grid():
    sigmas = sd3_grid(10)
    flow_grpo = [
        0.700,
        0.743,
        0.536,
        0.446,
        0.392,
        0.353,
        0.319,
        0.282,
        0.225,
        0.0063,
    ]  # docs/math.md#test-vectors, a = 0.7
    cps = [0.913, 0.869, 0.816, 0.752, 0.673, 0.573, 0.442, 0.264, 0.0085, 0.0]  # docs/math.md#test-vectors, a = 0.8
    ours = sde.sde_std(sigmas[:-1], sigmas[1:], "flow_grpo", 0.7)
    assert torch.allclose(ours, torch.tensor(flow_grpo), atol=6e-4, rtol=0)
    assert torch.allclose(sde.sde_std(sigmas[:-1], sigmas[1:], "cps", 0.8), torch.tensor(cps), atol=6e-4, rtol=0)
    dance = 0.3 * torch.sqrt(sigmas[:-1] - sigmas[1:])  # s = η·√h
    assert torch.allclose(sde.sde_std(sigmas[:-1], sigmas[1:], "dance", 0.3), dance, atol=1e-7, rtol=0)


@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("kind", STOCHASTIC_KINDS)
def test_log_prob_mean_and_std_equal_independent_gaussian(kind, reduce):
    generator = torch.Generator().manual_seed(2)
    sigmas = sd3_grid(10)
    steps = torch.tensor([0, 1, 4, 8, 9 if kind != "cps" else 7])  # per-sample steps, incl. the first and last
    sigma, sigma_next = sigmas[steps], sigmas[steps + 1]  # [N]
    noise_level = torch.tensor([0.7, 0.5, 0.9, 0.3, 0.8])  # [N]
    x = torch.randn(5, 2, 3, 3, generator=generator)  # [N, C, H, W]
    v = torch.randn(5, 2, 3, 3, generator=generator)
    prev, log_prob, mean, std = sde.sde_step(
        v, x, sigma, sigma_next, kind, noise_level, generator=generator, reduce=reduce
    )
    ref_mean, ref_std = reference_step(x, v, sigma, sigma_next, kind, noise_level)
    assert torch.allclose(mean.double(), ref_mean, atol=2e-6, rtol=1e-5)
    assert torch.allclose(std.double(), ref_std, atol=1e-7, rtol=1e-5)
    density = torch.distributions.Normal(ref_mean, ref_std.reshape(-1, 1, 1, 1)).log_prob(prev.double())
    expected = density.flatten(1).mean(1) if reduce == "mean" else density.flatten(1).sum(1)
    assert torch.allclose(log_prob.double(), expected, atol=1e-3 if reduce == "sum" else 1e-4, rtol=1e-5)
    # Scoring a given sample: same log-prob, and the sample comes back unchanged.
    given = prev.clone()
    scored, rescored, _, _ = sde.sde_step(v, x, sigma, sigma_next, kind, noise_level, given, reduce=reduce)
    assert scored is given and torch.equal(rescored, log_prob)


def test_log_prob_by_hand_for_one_element():
    # One element: x = 1, v = 0.5, σ = 0.6, σ' = 0.4, dance η = 0.5, x' = 0.9.
    # ε̂ = 1 + 0.4·0.5 = 1.2; μ = 1 − 0.2·0.5 − (0.25·0.2/1.2)·1.2 = 0.85; s = 0.5·√0.2.
    x, v, prev = torch.tensor([[1.0]]), torch.tensor([[0.5]]), torch.tensor([[0.9]])
    _, log_prob, mean, std = sde.sde_step(v, x, 0.6, 0.4, "dance", 0.5, prev)
    s = 0.5 * math.sqrt(0.2)
    hand = -((0.9 - 0.85) ** 2) / (2 * s * s) - math.log(s) - 0.5 * math.log(2 * math.pi)
    assert mean.item() == pytest.approx(0.85, abs=1e-6)
    assert std.item() == pytest.approx(s, rel=1e-6)
    assert log_prob.item() == pytest.approx(hand, abs=1e-5)


def test_cps_squared_log_prob_quirk():
    generator = torch.Generator().manual_seed(3)
    x, v = torch.randn(4, 6, generator=generator), torch.randn(4, 6, generator=generator)  # [N, D]
    prev, log_prob, mean, _ = sde.sde_step(v, x, 0.7, 0.5, "cps", 0.8, generator=generator, log_prob_mode="cps_sq")
    assert torch.allclose(log_prob, -((prev - mean) ** 2).mean(1), atol=1e-7, rtol=0)
    _, summed, _, _ = sde.sde_step(v, x, 0.7, 0.5, "cps", 0.8, prev, reduce="sum", log_prob_mode="cps_sq")
    assert torch.allclose(summed, -((prev - mean) ** 2).sum(1), atol=1e-6, rtol=0)


def test_sampling_draws_standard_normal_noise_from_the_generator():
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(4))
    v = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    prev, _, mean, std = sde.sde_step(v, x, 0.8, 0.6, "flow_grpo", 0.7, generator=torch.Generator().manual_seed(6))
    noise = torch.randn(3, 5, generator=torch.Generator().manual_seed(6))
    assert torch.allclose((prev - mean) / std[:, None], noise, atol=1e-5)
    again, _, _, _ = sde.sde_step(v, x, 0.8, 0.6, "flow_grpo", 0.7, generator=torch.Generator().manual_seed(6))
    assert torch.equal(prev, again)


def test_zero_std_samples_in_a_batch_score_zero_and_keep_the_mean():
    x = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(7))  # [N, C, L]
    v = torch.randn(4, 2, 3, generator=torch.Generator().manual_seed(8))
    noise_level = torch.tensor([0.0, 0.7, 0.0, 0.7])  # a window sampler: half the samples deterministic
    prev, log_prob, mean, std = sde.sde_step(v, x, 0.5, 0.3, "flow_grpo", noise_level, generator=torch.Generator())
    euler = x + (torch.tensor(0.3) - torch.tensor(0.5)) * v
    assert torch.equal(prev[[0, 2]], euler[[0, 2]]) and torch.equal(log_prob[[0, 2]], torch.zeros(2))
    assert (std[[1, 3]] > 0).all() and (log_prob[[1, 3]] != 0).all()
    # CPS's last step to σ' = 0 has std 0: the sample is the clean estimate x̂0 = x − σ·v.
    prev, log_prob, _, std = sde.sde_step(v, x, 0.2, 0.0, "cps", 0.8, generator=torch.Generator())
    assert torch.allclose(prev, x - 0.2 * v, atol=1e-7) and torch.equal(std, torch.zeros(4))
    assert torch.equal(log_prob, torch.zeros(4))


def test_per_sample_generators_draw_row_i_from_generator_i():
    x, v = torch.zeros(3, 2, 2), torch.zeros(3, 2, 2)  # [N, H, W]
    generators = [torch.Generator().manual_seed(seed) for seed in (5, 6, 7)]
    prev, _, mean, std = sde.sde_step(v, x, 0.5, 0.3, "dance", 0.4, generator=generators)
    expected = torch.stack([torch.randn(2, 2, generator=torch.Generator().manual_seed(seed)) for seed in (5, 6, 7)])
    assert torch.allclose((prev - mean) / std[:, None, None], expected, atol=1e-5)
    with pytest.raises(ValueError, match="generators") as error:
        sde.sde_step(v, x, 0.5, 0.3, "dance", 0.4, generator=generators[:2])
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("kind", sde.KINDS)
def test_scalar_and_per_sample_inputs_give_identical_steps(kind):
    x = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(15))  # [N, C, L]
    v = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(16))
    level = 0.0 if kind == "ode" else 0.6
    scalar = sde.sde_step(v, x, 0.7, 0.55, kind, level, generator=torch.Generator().manual_seed(17))
    per_sample = sde.sde_step(
        v,
        x,
        torch.full((4,), 0.7),
        torch.tensor(0.55),
        kind,
        torch.full((4,), level),
        generator=torch.Generator().manual_seed(17),
    )
    for ours, theirs in zip(scalar, per_sample):
        assert torch.equal(ours, theirs)


def test_no_host_read_of_device_tensors():
    """On the meta device any read of tensor data (`.item()`, `bool(t.any())`, the syncs a GPU would pay)
    raises, so running the step, the KL and the estimates there shows the per-step path has none."""
    x = torch.randn(3, 2, 4, device="meta")  # [N, C, L]
    v = torch.randn(3, 2, 4, device="meta")
    per_sample = torch.full((3,), 0.6, device="meta")  # [N]
    for kind in STOCHASTIC_KINDS:
        for sigma, sigma_next, level in [(0.8, 0.6, 0.7), (per_sample + 0.2, per_sample, 0.7), (1.0, 0.6, per_sample)]:
            prev, log_prob, mean, std = sde.sde_step(v, x, sigma, sigma_next, kind, level, generator=torch.Generator())
            assert {t.device.type for t in (prev, log_prob, mean, std)} == {"meta"}
            assert log_prob.shape == std.shape == (3,)
            sde.sde_step(v, x, sigma, sigma_next, kind, level, prev)
    assert sde.gaussian_kl(x, v, per_sample, dt=0.1).device.type == "meta"
    assert sde.gaussian_kl(x, v, 0.3, "paper").device.type == "meta"
    assert sde.x0_from_velocity(x, v, per_sample).device.type == "meta"


def test_low_precision_inputs_compute_in_float32():
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    v = torch.randn(2, 8, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    prev, log_prob, mean, std = sde.sde_step(v, x, 0.9, 0.7, "flow_grpo", 0.7, generator=generator)
    assert prev.dtype == log_prob.dtype == mean.dtype == std.dtype == torch.float32
    upcast = sde.sde_step(v.float(), x.float(), 0.9, 0.7, "flow_grpo", 0.7, generator=torch.Generator().manual_seed(0))
    assert torch.equal(prev, upcast[0]) and torch.equal(log_prob, upcast[1])


# ------------------------------------------------------------------------------------------ marginals


def gaussian_toy_velocity(x, sigma, m, s):
    """Exact v(x, σ) = E[ε − x0 | x_σ = x] for x0 ~ N(m, diag s²), by Gaussian conditioning.

    Cov(ε, x_σ) = σ, Cov(x0, x_σ) = (1 − σ)s², Var(x_σ) = (1 − σ)²s² + σ², E[x_σ] = (1 − σ)m, so
    v = (σ − (1 − σ)s²)·(x − (1 − σ)m) / Var(x_σ) − m.
    """
    variance = (1 - sigma) ** 2 * s**2 + sigma**2
    return (sigma - (1 - sigma) * s**2) * (x - (1 - sigma) * m) / variance - m


def run_toy_sde(kind, noise_level, m, s, stop_at, checks, num_samples=8_000, num_steps=100, seed=11):
    """Sample the Gaussian toy with `sde_step` on a uniform grid from σ = 1; return {σ: samples [N, D]}."""
    generator = torch.Generator().manual_seed(seed)
    sigmas = torch.linspace(1, 0, num_steps + 1)  # [T+1]
    x = torch.randn(num_samples, m.shape[0], generator=generator)  # [N, D], x at σ = 1 is pure noise
    seen = {}
    for k in range(stop_at + 1):
        for sigma in checks:
            if abs(float(sigmas[k]) - sigma) < 1e-6:
                seen[sigma] = x
        if k == stop_at:
            break
        v = gaussian_toy_velocity(x, float(sigmas[k]), m, s)
        x, _, _, _ = sde.sde_step(v, x, float(sigmas[k]), float(sigmas[k + 1]), kind, noise_level, generator=generator)
    assert sorted(seen) == sorted(checks)
    return seen


TOY_MEAN = torch.tensor([0.5, -1.0, 2.0, 0.0])  # [D]
TOY_STD = torch.tensor([0.5, 1.5, 0.2, 1.0])  # [D]


@pytest.mark.parametrize("kind, noise_level", [("flow_grpo", 0.7), ("dance", 0.5), ("ode", 0.0)])
def test_sde_preserves_the_marginals_of_a_gaussian_toy(kind, noise_level):
    """The SDE family keeps the interpolant's marginals N((1 − σ)m, (1 − σ)²s² + σ²) up to discretization.

    100 uniform steps from σ = 1, 8,000 samples in 4 dims, checked at σ = 0.75, 0.5, 0.25, 0.1.
    Tolerance 0.05 on means (3 sampling stds; Euler keeps the mean of this linear toy exactly) and 10% on
    variances: the discretization error alone, computed by propagating the moments exactly through the
    discrete steps, is at most 4.8% (flow_grpo, whose g diverges at σ = 1), 2.6% (ode) and 2.3% (dance),
    plus 3 sampling stds of 1.6%. A 10% error in the std or 20% in the drift correction fails it (16-28%).
    """
    checks = (0.75, 0.5, 0.25, 0.1)
    for sigma, x in run_toy_sde(kind, noise_level, TOY_MEAN, TOY_STD, 90, checks).items():
        expected_mean = (1 - sigma) * TOY_MEAN
        expected_var = (1 - sigma) ** 2 * TOY_STD**2 + sigma**2
        assert torch.allclose(x.mean(0), expected_mean, atol=0.05), (sigma, x.mean(0), expected_mean)
        assert torch.allclose(x.var(0), expected_var, rtol=0.10, atol=0), (sigma, x.var(0), expected_var)


def test_cps_preserves_the_marginals_of_a_point_mass_and_the_mean_of_a_gaussian():
    """CPS keeps the noise coefficient: exact for a point-mass data law (x̂0 exact), at any step size.

    For spread-out data it is not a discretization of a marginal-preserving SDE: its fresh noise per step,
    σ'·sin(aπ/2), does not shrink with the step, so on a fine grid it contracts the data variance
    (measured: about 0.6 of s² at σ = 0 with a = 0.8 and 40 to 200 steps). Means stay exact (the maps are
    linear). Same sizes and sampling tolerances as the test above; no discretization error for the point mass.
    """
    checks = (0.75, 0.5, 0.25, 0.1, 0.0)
    point_mass = run_toy_sde("cps", 0.8, TOY_MEAN, torch.zeros(4), 100, checks)
    for sigma, x in point_mass.items():
        assert torch.allclose(x.mean(0), (1 - sigma) * TOY_MEAN, atol=0.05), (sigma, x.mean(0))
        assert torch.allclose(x.var(0), torch.full((4,), sigma**2), rtol=0.06, atol=1e-6), (sigma, x.var(0))
    gaussian = run_toy_sde("cps", 0.8, TOY_MEAN, TOY_STD, 100, checks)
    for sigma, x in gaussian.items():
        assert torch.allclose(x.mean(0), (1 - sigma) * TOY_MEAN, atol=0.05), (sigma, x.mean(0))
    final_var = gaussian[0.0].var(0)
    assert (final_var < 0.8 * TOY_STD**2).all() and (final_var > 0.4 * TOY_STD**2).all(), final_var


# ------------------------------------------------------------------------------------------ on-policy ratio


class TinyVelocity(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(dim + 1, 16), torch.nn.SiLU(), torch.nn.Linear(16, dim))

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        return self.net(torch.cat([x, sigma[:, None]], dim=1))


@pytest.mark.parametrize("kind", STOCHASTIC_KINDS)
def test_on_policy_ratio_is_exactly_one(kind):
    torch_generator = torch.Generator().manual_seed(12)
    model = TinyVelocity(6)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=torch_generator) * 0.3)
    sigmas = sd3_grid(4)
    latents = [torch.randn(5, 6, generator=torch_generator)]  # x_0 [N, D]
    old_log_probs = []
    with torch.no_grad():
        for k in range(4):
            sigma = sigmas[k].expand(5)  # [N]
            v = model(latents[-1], sigma)
            prev, log_prob, _, _ = sde.sde_step(
                v, latents[-1], sigma, sigmas[k + 1].expand(5), kind, 0.7, generator=torch_generator
            )
            latents.append(prev)
            old_log_probs.append(log_prob)
    for k in range(3):  # the last cps step is deterministic; train on the others
        sigma = sigmas[k].expand(5)
        v = model(latents[k], sigma)
        _, log_prob, _, _ = sde.sde_step(v, latents[k], sigma, sigmas[k + 1].expand(5), kind, 0.7, latents[k + 1])
        ratio = torch.exp(log_prob - old_log_probs[k])
        approx_kl = 0.5 * ((log_prob - old_log_probs[k]) ** 2).mean()
        assert torch.equal(ratio, torch.ones(5)) and approx_kl.item() == 0.0
        log_prob.sum().backward()  # the log-prob is differentiable through the mean
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
        model.zero_grad()


# ------------------------------------------------------------------------------------------ KL


def test_paper_kl_equals_velocity_form_for_flow_grpo():
    generator = torch.Generator().manual_seed(13)
    sigmas = sd3_grid(10)
    a = 0.7
    x = torch.randn(3, 4, 4, generator=generator)  # [N, H, W]
    v_policy = torch.randn(3, 4, 4, generator=generator)
    v_ref = v_policy + 0.1 * torch.randn(3, 4, 4, generator=generator)
    for k in (0, 3, 8):
        sigma, sigma_next = float(sigmas[k]), float(sigmas[k + 1])
        _, _, mean, std = sde.sde_step(v_policy, x, sigma, sigma_next, "flow_grpo", a, generator=generator)
        _, _, ref_mean, _ = sde.sde_step(v_ref, x, sigma, sigma_next, "flow_grpo", a, generator=generator)
        kl = sde.gaussian_kl(mean, ref_mean, std, "paper")
        h = sigma - sigma_next
        sigma_tilde = sigma_next if sigma >= 1 else sigma
        g = a * math.sqrt(sigma / (1 - sigma_tilde))
        factor = (h / 2) * (1 / g + g * (1 - sigma) / (2 * sigma)) ** 2
        expected = factor * ((v_policy.double() - v_ref.double()) ** 2).flatten(1).sum(1)
        assert torch.allclose(kl.double(), expected, rtol=2e-4, atol=0), (k, kl, expected)


def test_code_kl_by_its_definition():
    generator = torch.Generator().manual_seed(14)
    mean = torch.randn(4, 2, 5, generator=generator)  # [N, C, L]
    ref_mean = torch.randn(4, 2, 5, generator=generator)
    sigma, sigma_next, a = 0.6, 0.45, 0.7
    std = sde.sde_std(sigma, sigma_next, "flow_grpo", a)
    g_squared = a**2 * sigma / (1 - sigma)  # docs/math.md#sde-steps, straight from the formula
    expected = ((mean - ref_mean) ** 2).mean(dim=(1, 2)) / (2 * g_squared)
    assert torch.allclose(sde.gaussian_kl(mean, ref_mean, std, "code", dt=sigma - sigma_next), expected, rtol=1e-5)
    # cps: flow_grpo divides by its std directly.
    cps_std = sigma_next * math.sin(0.8 * math.pi / 2)
    expected = ((mean - ref_mean) ** 2).mean(dim=(1, 2)) / (2 * cps_std**2)
    cps_kl = sde.gaussian_kl(mean, ref_mean, sde.sde_std(sigma, sigma_next, "cps", 0.8))
    assert torch.allclose(cps_kl, expected, rtol=1e-5)
    # the two forms differ by h·D for the same Gaussian pair
    paper = sde.gaussian_kl(mean, ref_mean, std, "paper")
    code = sde.gaussian_kl(mean, ref_mean, std, "code", dt=sigma - sigma_next)
    assert torch.allclose(code, paper * (sigma - sigma_next) / 10, rtol=1e-5)
    # reduce overrides the form's own; per-sample stds; zero std gives 0
    per_sample_std = torch.tensor([0.5, 0.0, 0.25, 1.0])
    summed = sde.gaussian_kl(mean, ref_mean, per_sample_std, "code", reduce="sum")
    by_hand = ((mean - ref_mean) ** 2).sum(dim=(1, 2)) / (2 * per_sample_std**2)
    assert summed[1] == 0 and torch.allclose(summed[[0, 2, 3]], by_hand[[0, 2, 3]], rtol=1e-6)
    assert torch.equal(sde.gaussian_kl(mean, mean, 0.3, "paper"), torch.zeros(4))


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "arguments, field",
    [
        (dict(kind="flow_grpo", noise_level=-0.1), "noise_level"),
        (dict(kind="dance", noise_level=torch.tensor([0.3, -0.2])), "noise_level"),
        (dict(kind="cps", noise_level=1.5), "noise_level"),
        (dict(kind="sde", noise_level=0.7), "kind"),
        (dict(kind="flow_grpo", noise_level=0.7, v=torch.zeros(2, 4)), "v has shape"),
        (dict(kind="flow_grpo", noise_level=0.7, prev_sample=torch.zeros(3, 3)), "prev_sample"),
        (dict(kind="flow_grpo", noise_level=0.7, sigma=torch.tensor([0.8, 0.7, 0.6])), "sigma"),
        (dict(kind="flow_grpo", noise_level=torch.tensor([0.7, 0.7, 0.7])), "noise_level"),
        (dict(kind="flow_grpo", noise_level=0.7, reduce="max"), "reduce"),
        (dict(kind="flow_grpo", noise_level=0.7, log_prob_mode="cps_sq"), "log_prob_mode"),
        (dict(kind="flow_grpo", noise_level=0.7, x=torch.zeros(2), v=torch.zeros(2)), "x has shape"),
    ],
)
def test_step_bad_input_raises_one_line(arguments, field):
    call = dict(v=torch.zeros(2, 3), x=torch.zeros(2, 3), sigma=0.8, sigma_next=0.6) | arguments
    with pytest.raises(ValueError, match=field) as error:
        sde.sde_step(**call)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda: sde.gaussian_kl(torch.zeros(2, 3), torch.zeros(2, 4), 0.5), "ref_mean"),
        (lambda: sde.gaussian_kl(torch.zeros(2, 3), torch.zeros(2, 3), 0.5, "exact"), "form"),
        (lambda: sde.gaussian_kl(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(3)), "std"),
        (lambda: sde.sde_std(0.8, 0.6, "euler", 0.5), "kind"),
        (lambda: sde.sde_std(0.8, 0.6, "flow_grpo", -1.0), "noise_level"),
    ],
)
def test_kl_and_std_bad_input_raises_one_line(call, field):
    with pytest.raises(ValueError, match=field) as error:
        call()
    assert "\n" not in str(error.value)
