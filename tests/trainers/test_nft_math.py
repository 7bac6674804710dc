"""DiffusionNFT's pieces against numbers computed independently: the reward map, the loss and its gradient by
hand (every term, both branches, the detached weight), ALGORITHMS §11 item 8, the soft-update schedules, the
forward noising and the training-time draws."""

import numpy as np
import pytest
import torch

from flowrl import sde
from flowrl.losses import nft_loss, nft_reward
from flowrl.schedules import nft_times
from flowrl.trainers.nft import old_policy_decay

A = torch.tensor([-10.0, -5.0, -2.5, 0.0, 2.5, 5.0, 10.0])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("all", [0, 0, 0.25, 0.5, 0.75, 1, 1]),
        ("positive_only", [0.5, 0.5, 0.5, 0.5, 0.75, 1, 1]),
        ("negative_only", [0, 0, 0.25, 0.5, 0.5, 0.5, 0.5]),
        ("one_only", [0.5, 0.5, 0.5, 0.5, 0.6, 0.6, 0.6]),  # A -> 1[A > 0], then 1/(2·5) + 1/2
        ("binary", [0.4, 0.4, 0.4, 0.5, 0.6, 0.6, 0.6]),
    ],
)
def test_reward_map_by_hand(mode, expected):
    assert nft_reward(A, 5.0, mode).tolist() == pytest.approx(expected, abs=1e-7)


def test_reward_is_one_half_at_zero_advantage_and_bad_mode_is_named():
    for mode in ("all", "positive_only", "negative_only", "one_only", "binary"):
        assert nft_reward(torch.zeros(3), 5.0, mode).tolist() == [0.5, 0.5, 0.5]
    with pytest.raises(ValueError, match="train.adv_mode='best'"):
        nft_reward(A, 5.0, "best")


def tiny_case(seed=0, n=3, d=6):
    """A tiny linear velocity network v_θ = x_t @ W and fixed old / reference velocities."""
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n, d, generator=g)
    eps = torch.randn(n, d, generator=g)
    sigma = torch.tensor([0.9, 0.5, 0.2])[:n]
    x_t = sde.forward_noise(x0, eps, sigma)
    w = (0.3 * torch.randn(d, d, generator=g)).requires_grad_(True)
    v_old = torch.randn(n, d, generator=g)
    v_ref = torch.randn(n, d, generator=g)
    adv = torch.tensor([2.0, -1.0, 7.0])[:n]
    return x0, eps, sigma, x_t, w, v_old, v_ref, adv


def hand_loss(x0, x_t, sigma, v, v_old, v_ref, adv, a_max, beta, kl_coef):
    """The same loss in float64 numpy, written from the formulas (weights treated as constants), and its
    gradient with respect to v_θ."""
    x0, x_t, v, v_old, v_ref = (np.asarray(a, np.float64) for a in (x0, x_t, v, v_old, v_ref))
    s = np.asarray(sigma, np.float64)[:, None]
    a = np.clip(np.asarray(adv, np.float64), -a_max, a_max)
    r = np.clip(a / (2 * a_max) + 0.5, 0, 1)[:, None]
    d = x0.shape[1]
    e_pos = x_t - s * (beta * v + (1 - beta) * v_old) - x0
    e_neg = x_t - s * ((1 + beta) * v_old - beta * v) - x0
    w_pos = np.maximum(np.abs(e_pos).mean(1, keepdims=True), 1e-5)
    w_neg = np.maximum(np.abs(e_neg).mean(1, keepdims=True), 1e-5)
    l_pos = (e_pos**2).mean(1, keepdims=True) / w_pos
    l_neg = (e_neg**2).mean(1, keepdims=True) / w_neg
    kl = ((v - v_ref) ** 2).mean(1, keepdims=True)
    loss = (a_max / beta) * (r * l_pos + (1 - r) * l_neg) + kl_coef * kl
    grad = (a_max / beta) * (r * 2 * e_pos * (-s * beta) / (d * w_pos) + (1 - r) * 2 * e_neg * (s * beta) / (d * w_neg))
    grad += kl_coef * 2 * (v - v_ref) / d
    return loss[:, 0], grad


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_loss_and_gradient_equal_the_hand_computation(beta):
    x0, _, sigma, x_t, w, v_old, v_ref, adv = tiny_case()
    v = x_t @ w
    v.retain_grad()
    loss, stats = nft_loss(v, v_old, v_ref, x0, x_t, sigma, adv, 5.0, beta, 0.3)
    expected, grad = hand_loss(x0, x_t, sigma, v.detach(), v_old, v_ref, adv, 5.0, beta, 0.3)
    assert loss.dtype == torch.float32 and loss.shape == (3,)
    np.testing.assert_allclose(loss.detach().numpy(), expected, rtol=1e-5)
    np.testing.assert_allclose(stats["r"].numpy(), [0.7, 0.4, 1.0], rtol=1e-6)
    loss.sum().backward()
    # the adaptive weights are constants of the gradient (detached); a differentiated weight adds terms
    np.testing.assert_allclose(v.grad.numpy(), grad, rtol=1e-4, atol=1e-7)


def test_old_and_reference_velocities_get_no_gradient():
    x0, _, sigma, x_t, w, v_old, v_ref, adv = tiny_case()
    v_old, v_ref = v_old.clone().requires_grad_(True), v_ref.clone().requires_grad_(True)
    loss, _ = nft_loss(x_t @ w, v_old, v_ref, x0, x_t, sigma, adv, 5.0, 1.0, 1.0)
    loss.sum().backward()
    assert v_old.grad is None and v_ref.grad is None and w.grad is not None


def test_kl_term_is_the_mean_squared_velocity_gap_only_through_v_theta():
    x0, _, sigma, x_t, w, v_old, v_ref, adv = tiny_case()
    v = x_t @ w
    with_kl, _ = nft_loss(v, v_old, v_ref, x0, x_t, sigma, adv, 5.0, 1.0, 0.25)
    without, stats = nft_loss(v, v_old, None, x0, x_t, sigma, adv, 5.0, 1.0, 0.25)
    gap = ((v - v_ref) ** 2).mean(1)
    torch.testing.assert_close(with_kl - without, 0.25 * gap)
    assert stats["kl"].tolist() == [0.0, 0.0, 0.0]


def test_beta_one_and_old_equal_theta_is_plain_self_normalised_x0_regression():
    """ALGORITHMS §11 item 8: with β = 1 and v_old = v_θ the positive branch is the x0 regression
    t·mean(d²)/mean|d| with d = (ε − x0) − v_θ (x̂0 − x0 = t·d), and both branches are equal."""
    x0, eps, sigma, x_t, w, _, _, _ = tiny_case()
    v = x_t @ w
    for adv, branch in ((torch.full((3,), 5.0), "positive"), (torch.full((3,), -5.0), "negative")):
        loss, stats = nft_loss(v, v.detach(), None, x0, x_t, sigma, adv, 5.0, 1.0, 0.0)
        d = (eps - x0) - v.detach()
        plain = sigma * (d**2).mean(1) / d.abs().mean(1)
        torch.testing.assert_close(stats[f"{branch}_loss"], plain, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(stats["positive_loss"], stats["negative_loss"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(loss.detach(), 5.0 * plain, rtol=1e-5, atol=1e-7)


def test_weight_is_floored_and_computed_in_float64():
    # an exact prediction: |x̂0 − x0| = 0 everywhere, so the weight is the floor 1e-5 and the loss 0 (not 0/0)
    x0 = torch.randn(2, 4)
    eps = torch.randn(2, 4)
    sigma = torch.tensor([0.5, 0.7])
    x_t = sde.forward_noise(x0, eps, sigma)
    v = (eps - x0).requires_grad_(True)
    loss, _ = nft_loss(v, v.detach(), None, x0, x_t, sigma, torch.zeros(2), 5.0, 1.0, 0.0)
    assert torch.isfinite(loss).all() and float(loss.detach().abs().max()) < 1e-6
    loss.sum().backward()
    assert torch.isfinite(v.grad).all()


def test_forward_noise_by_hand():
    x0 = torch.tensor([[1.0, -2.0], [0.5, 4.0]])
    eps = torch.tensor([[3.0, 1.0], [-1.0, 0.0]])
    out = sde.forward_noise(x0, eps, torch.tensor([0.25, 1.0]))
    assert out.tolist() == [[0.75 + 0.75, -1.5 + 0.25], [-1.0, 0.0]]
    assert sde.forward_noise(x0, eps, 0.0).tolist() == x0.tolist()


@pytest.mark.parametrize(
    "decay_type,steps,expected",
    [
        (0, [0, 1, 500], [0.0, 0.0, 0.0]),
        (1, [0, 1, 100, 499, 500, 2000], [0.0, 0.001, 0.1, 0.499, 0.5, 0.5]),
        (2, [0, 74, 75, 76, 100, 208, 300], [0.0, 0.0, 0.0, 0.0075, 0.1875, 0.9975, 0.999]),
    ],
)
def test_soft_update_schedules_by_hand(decay_type, steps, expected):
    assert [old_policy_decay(decay_type, s) for s in steps] == pytest.approx(expected, abs=1e-12)


def test_soft_update_cap_and_bad_type():
    assert old_policy_decay(1, 2000, cap=0.95) == 0.95 and old_policy_decay(2, 300, cap=0.95) == 0.95
    with pytest.raises(ValueError, match="train.decay_type=3"):
        old_policy_decay(3, 10)


def generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_training_times_are_distinct_grid_indices_drawn_per_sample():
    grid = torch.linspace(1, 0, 11)  # T = 10
    times = nft_times(generators([1, 2, 3]), grid, 0.99)
    assert times.shape == (3, 9)  # int(10 x 0.99) = 9 of the 10 grid times
    for row in times.tolist():
        assert len(set(row)) == 9 and all(0 <= k < 10 for k in row)
    # a sample's draws depend on its own generator only, not on its batch-mates
    alone = nft_times(generators([2]), grid, 0.99)
    assert torch.equal(alone[0], times[1])
    with pytest.raises(ValueError, match="train.timestep_fraction=0.05"):
        nft_times(generators([1]), grid, 0.05)
