"""SDE/ODE samplers on a tiny SD3 pipeline: determinism, windows, shared noise, on-policy log-probs."""

import pytest
import torch

from flowrl import sde
from flowrl.registry import SAMPLERS
from flowrl.types import PromptBatch

SIZE = dict(height=32, width=32)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("sd3")


def make_batch(prompts=("a red cat", "a red cat", "two dogs", "two dogs"), groups=(0, 0, 1, 1), seeds=(1, 2, 3, 4)):
    return PromptBatch(list(prompts), torch.tensor(groups), seeds=torch.tensor(seeds))


def sampler(name="sde", **kw):
    return SAMPLERS.get(name)(
        num_steps=kw.pop("num_steps", 4), guidance_scale=kw.pop("guidance_scale", 3.0), **SIZE, **kw
    )


def train_mask(rollout) -> torch.Tensor:
    """[N, T] bool: the rollout's trainable transitions (its `transitions` table) as a mask."""
    mask = torch.zeros(rollout.noise_levels.shape, dtype=torch.bool)
    mask[rollout.transitions[:, 0], rollout.transitions[:, 1]] = True
    return mask


@pytest.mark.parametrize("kind", ["flow_grpo", "dance", "cps"])
def test_zero_noise_equals_ode_sampler(model, kind):
    batch = make_batch()
    ode = sampler("ode")(model, batch)
    zero = sampler(kind=kind, noise_level=0.0)(model, batch)
    torch.testing.assert_close(zero.latents, ode.latents, rtol=0, atol=0)
    assert zero.log_probs.abs().max() == 0 and not train_mask(zero).any()


def test_seed_determinism_and_batch_independence(model):
    s = sampler(noise_level=0.7)
    a, b = s(model, make_batch()), s(model, make_batch())
    torch.testing.assert_close(a.latents, b.latents, rtol=0, atol=0)
    torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=0)
    # sample 2 alone gets the same trajectory as inside the batch (its randomness is its own)
    alone = s(model, make_batch(prompts=["two dogs"], groups=[1], seeds=[3]))
    torch.testing.assert_close(alone.latents[0], a.latents[2], rtol=0, atol=1e-5)
    # different seeds, different samples
    assert (a.latents[0, -1] - a.latents[1, -1]).abs().max() > 1e-3


def test_same_latent_shares_initial_noise_within_groups(model):
    r = sampler(noise_level=0.7, same_latent=True)(model, make_batch())
    x0 = r.latents[:, 0]
    torch.testing.assert_close(x0[0], x0[1], rtol=0, atol=0)
    torch.testing.assert_close(x0[2], x0[3], rtol=0, atol=0)
    assert (x0[0] - x0[2]).abs().max() > 0.1
    assert (r.latents[0, -1] - r.latents[1, -1]).abs().max() > 1e-3  # the SDE noise still differs


def test_rescoring_with_same_weights_gives_ratio_exactly_one(model):
    """docs/math.md#clipped-surrogate: with the same weights and batch the recomputed log-prob equals the stored one."""
    r = sampler(noise_level=0.7, num_steps=5)(model, make_batch())
    for k in range(r.num_steps):
        with torch.no_grad():
            v = model.velocity(r.latents[:, k], r.sigmas[k], r.cond, r.guidance_scale)
        _, log_prob, _, _ = sde.sde_step(
            v,
            r.latents[:, k],
            float(r.sigmas[k]),
            float(r.sigmas[k + 1]),
            r.kind,
            r.noise_levels[:, k],
            prev_sample=r.latents[:, k + 1],
        )
        ratio = torch.exp(log_prob - r.log_probs[:, k])
        assert torch.equal(ratio, torch.ones_like(ratio)), k


def test_stored_log_prob_is_the_gaussian_density_of_the_step(model):
    """An independent density: torch.distributions.Normal around the flow_grpo mean (docs/math.md#sde-steps)
    written out here."""
    r = sampler(noise_level=0.7, num_steps=4)(model, make_batch())
    k = 1
    sigma, sigma_next = float(r.sigmas[k]), float(r.sigmas[k + 1])
    x = r.latents[:, k]
    with torch.no_grad():
        v = model.velocity(x, r.sigmas[k], r.cond, r.guidance_scale)
    g = 0.7 * (sigma / (1 - sigma)) ** 0.5
    dt = sigma_next - sigma
    mean = x * (1 + g**2 * dt / (2 * sigma)) + v * dt * (1 + g**2 * (1 - sigma) / (2 * sigma))
    std = g * (-dt) ** 0.5
    expected = torch.distributions.Normal(mean, std).log_prob(r.latents[:, k + 1]).flatten(1).mean(1)
    torch.testing.assert_close(r.log_probs[:, k], expected, rtol=1e-5, atol=1e-5)
    assert r.log_probs[:, -1].abs().max() == 0 and not train_mask(r)[:, -1].any()  # last step is Euler


def test_random_window_is_w_consecutive_stochastic_steps(model):
    s = sampler(noise_level=0.8, kind="cps", num_steps=6, sde_window_size=2, sde_window_range=(0, 4))
    r = s(model, make_batch(seeds=(10, 11, 12, 13)))
    ode = sampler("ode", num_steps=6)(model, make_batch(seeds=(10, 11, 12, 13)))
    mask = train_mask(r)
    assert mask.sum(1).tolist() == [2, 2, 2, 2]
    starts = mask.float().argmax(1)
    assert ((starts >= 0) & (starts <= 2)).all()
    assert (r.log_probs[~mask] == 0).all() and (r.log_probs[mask] != 0).all()
    for i, start in enumerate(starts.tolist()):  # before the window the trajectory is the ODE's
        torch.testing.assert_close(r.latents[i, : start + 1], ode.latents[i, : start + 1], rtol=0, atol=0)
    # the window start depends only on the sample's seed
    again = s(model, make_batch(seeds=(10, 11, 12, 13)))
    assert torch.equal(train_mask(again), mask)


def test_sliding_window_moves_with_the_training_step(model):
    s = sampler(
        noise_level=0.7,
        num_steps=6,
        sde_window_size=2,
        sde_window_range=(0, 5),
        sde_window_mode="sliding",
        sde_window_shift_every_n_steps=2,
        decode=False,
    )
    starts = []
    for step in range(0, 10, 2):
        starts.append(int(s.noise_levels(torch.tensor([1]), step)[0].nonzero()[0]))
    assert starts == [0, 1, 2, 3, 0]


def test_dance_grid(model):
    r = sampler(kind="dance", noise_level=0.3, sigma_schedule="dance", sigma_shift=3.0, num_steps=4, decode=False)(
        model, make_batch()
    )
    expected = [3 * s / (1 + 2 * s) for s in (1.0, 0.75, 0.5, 0.25, 0.0)]
    torch.testing.assert_close(r.sigmas, torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(noise_level=-0.1), "noise_level=-0.1"),
        (dict(kind="euler"), "kind='euler'"),
        (dict(sde_window_size=3, sde_window_range=(0, 2)), "sde_window_size=3"),
        (dict(num_steps=0), "num_steps=0"),
    ],
)
def test_bad_sampler_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SAMPLERS.get("sde")(**{"num_steps": 4, **kwargs})


def test_unknown_sampler_name_lists_registered():
    with pytest.raises(KeyError, match="Did you mean 'sde'.*Registered: .*ode"):
        SAMPLERS.get("sdee")


def test_ode_with_the_pipelines_own_scheduler(tiny_model):
    """scheduler='pipeline' steps with the checkpoint's own multistep solver and matches the pipeline."""
    from diffusers import UniPCMultistepScheduler

    model = tiny_model("sd3")
    model.pipe.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    r = sampler("ode", scheduler="pipeline", num_steps=4)(
        model, make_batch(prompts=["a red cat"], groups=[0], seeds=[5])
    )
    out = model.pipe(
        "a red cat",
        **SIZE,
        num_inference_steps=4,
        guidance_scale=3.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(5),
    ).images
    torch.testing.assert_close(r.latents[:, -1], out, rtol=0, atol=1e-5)
    euler = sampler("ode", num_steps=4)(model, make_batch(prompts=["a red cat"], groups=[0], seeds=[5]))
    assert (euler.latents[:, -1] - out).abs().max() > 1e-4  # a different solver really ran
