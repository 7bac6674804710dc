"""MARBLE's math (flowrl/balancers/marble.py): the min-norm solver against brute force on the simplex and the KKT
certificate, degenerate gradients, the rescaling to the mean norm, the EMA, and Proposition 1 (the amortization
identity) by autograd on a tiny network with the NFT loss, including where a clamp breaks it."""

import itertools

import pytest
import torch

from flowrl.balancers.marble import clamp_active, combine, cosines, ema_alpha, harmonize, min_norm_weights
from flowrl.losses import nft_loss


def simplex_grid(k: int, n: int) -> torch.Tensor:
    """Every point of the simplex with coordinates in multiples of 1/n. [P, k] float64"""
    points = [c for c in itertools.product(range(n + 1), repeat=k - 1) if sum(c) <= n]
    return torch.tensor([[*c, n - sum(c)] for c in points], dtype=torch.float64) / n


def brute_force(gram: torch.Tensor, n: int) -> tuple[float, torch.Tensor]:
    grid = simplex_grid(gram.shape[0], n)
    values = ((grid @ gram) * grid).sum(1)
    best = int(values.argmin())
    return float(values[best]), grid[best]


def random_gram(k: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.randn(k, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = g / g.norm(dim=1, keepdim=True)
    return g @ g.T


@pytest.mark.parametrize("k,n", [(2, 2000), (3, 200), (4, 60), (5, 28)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_solver_matches_brute_force_on_the_simplex(k, n, seed):
    # dim < k for some seeds makes M singular (the hull contains 0 or a flat face): the solver must still be exact
    gram = random_gram(k, dim=[k + 3, 2, k][seed], seed=seed * 10 + k)
    alpha = min_norm_weights(gram)
    assert alpha.min() >= 0 and float(alpha.sum()) == pytest.approx(1.0, abs=1e-12)
    value = float(alpha @ gram @ alpha)
    grid_value, _ = brute_force(gram, n)
    assert value <= grid_value + 1e-12  # nothing on the grid is lower
    # the grid's best is within its resolution: |Δα| <= k/n moves the objective by at most 2·||M||·k/n + ||M||·(k/n)^2
    assert grid_value - value <= 2 * float(gram.abs().max()) * k * (k / n) + 1e-9
    # KKT certificate, independent of the search: (Mα)_k >= αᵀMα everywhere, with equality on the support
    g = gram @ alpha
    assert torch.all(g >= value - 1e-9)
    assert torch.allclose(g[alpha > 1e-9], torch.full_like(g[alpha > 1e-9], value), atol=1e-9)


def test_two_rewards_closed_form():
    for seed in range(5):
        m = random_gram(2, 4, seed)
        closed = min(max(float((m[1, 1] - m[0, 1]) / (m[0, 0] + m[1, 1] - 2 * m[0, 1])), 0.0), 1.0)
        assert float(min_norm_weights(m)[0]) == pytest.approx(closed, abs=1e-10)


@pytest.mark.parametrize("k", [2, 3, 4, 5])
def test_orthogonal_unit_gradients_give_uniform_alpha(k):
    grads = torch.eye(k, 7, dtype=torch.float64) * torch.arange(1, k + 1, dtype=torch.float64)[:, None]  # any norms
    out = harmonize(grads)
    assert torch.allclose(out.alpha, torch.full((k,), 1 / k, dtype=torch.float64), atol=1e-12)
    # d* = (1/k) Σ e_k, rescaled by the mean norm (k + 1) / 2; every cosine is 1/sqrt(k)
    expected = torch.zeros(7, dtype=torch.float64)
    expected[:k] = (k + 1) / 2 / k
    assert torch.allclose(out.direction, expected, atol=1e-12)
    assert torch.allclose(out.cosines, torch.full((k,), k**-0.5, dtype=torch.float64), atol=1e-12)


def test_degenerate_gradients():
    g = torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64)
    # parallel (same direction, other norms): any α is optimal; the tie goes to the whole face, d = n̄ · ĝ
    out = harmonize(torch.stack([g, 3 * g]))
    assert torch.allclose(out.alpha, torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert torch.allclose(out.direction, 2 * g)  # n̄ = (1 + 3)/2 · ||g||, ĝ = g / ||g||
    # opposite: the hull holds 0, the batch is Pareto-stationary, no update
    out = harmonize(torch.stack([g, -2 * g]))
    assert torch.allclose(out.alpha, torch.tensor([0.5, 0.5], dtype=torch.float64))  # of the normalized pair
    assert out.direction.abs().max() == 0 and torch.all(out.cosines == 0)
    # a zero gradient takes no part; the rest is balanced, and n̄ still averages over all K
    h = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    out = harmonize(torch.stack([g, torch.zeros(3, dtype=torch.float64), h]))
    assert out.alpha[1] == 0 and float(out.alpha.sum()) == pytest.approx(1.0)
    assert out.cosines[1] == 0
    # all zero: uniform α and a zero update
    out = harmonize(torch.zeros(3, 4))
    assert torch.allclose(out.alpha, torch.full((3,), 1 / 3, dtype=torch.float64)) and out.direction.abs().max() == 0
    # three collinear unit vectors, two of them opposite: d = 0
    out = harmonize(torch.stack([g, -g, g]))
    assert out.direction.abs().max() == 0


def test_min_norm_point_never_opposes_a_reward():
    for seed in range(4):
        grads = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        out = harmonize(grads)
        assert torch.all(out.cosines >= -1e-12)  # MGDA: ĝ_kᵀ d* >= ||d*||² >= 0 for every k


def test_bad_gram_is_a_one_line_error():
    with pytest.raises(ValueError, match="square"):
        min_norm_weights(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="K=13"):
        min_norm_weights(torch.eye(13))


def test_ema_stays_on_the_simplex():
    prev, fresh = torch.tensor([0.25, 0.25, 0.5]), torch.tensor([1.0, 0.0, 0.0])
    assert torch.allclose(ema_alpha(prev, fresh), torch.tensor([0.475, 0.175, 0.35]))  # 0.7·prev + 0.3·fresh
    assert float(ema_alpha(prev, fresh, 0.1).sum()) == pytest.approx(1.0)


def test_cosines_by_hand():
    got = cosines(torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]]), torch.tensor([2.0, 0.0]))
    assert torch.allclose(got, torch.tensor([1.0, 2**-0.5, 0.0], dtype=torch.float64))


# --------------------------------------------------------------------------------------------- Proposition 1


def tiny_nft_losses(advantages: list[torch.Tensor], a_max: float = 5.0):
    """∇θ of the NFT loss (kl 0) of a tiny velocity network, once per advantage vector. Returns [len, P]."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    old = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    x0, noise = torch.randn(6, 4), torch.randn(6, 4)
    sigma = torch.rand(6) * 0.8 + 0.1
    x_t = (1 - sigma[:, None]) * x0 + sigma[:, None] * noise
    inputs = torch.cat([x_t, sigma[:, None]], 1)
    out = []
    for a in advantages:
        net.zero_grad()
        v_theta, v_old = net(inputs), old(inputs).detach()
        loss, _ = nft_loss(v_theta, v_old, None, x0, x_t, sigma, a, a_max, 0.1, 0.0)
        loss.mean().backward()
        out.append(torch.cat([p.grad.flatten() for p in net.parameters()]).clone())
    return torch.stack(out)


def test_amortization_identity_holds_without_clamps():
    gen = torch.Generator().manual_seed(3)
    per_reward = torch.randn(3, 6, generator=gen) * 1.5  # |A_k| < 5
    alpha = torch.distributions.Dirichlet(torch.ones(3)).sample()
    assert not clamp_active(per_reward, alpha, 5.0)
    grads = tiny_nft_losses([*per_reward, (alpha[:, None] * per_reward).sum(0)])
    separate, single = combine(grads[:3], alpha), grads[3]
    assert single.abs().max() > 1e-3
    assert torch.allclose(separate, single, atol=1e-6, rtol=1e-5)


def test_amortization_identity_breaks_where_a_clamp_is_active():
    per_reward = torch.tensor([[7.0, -1.0, 0.5, 2.0, -0.3, 1.0], [-2.0, 1.0, -0.5, 0.0, 0.3, -1.0]])
    alpha = torch.tensor([0.5, 0.5])
    assert clamp_active(per_reward, alpha, 5.0)  # the first reward's 7 saturates r at 1
    grads = tiny_nft_losses([*per_reward, (alpha[:, None] * per_reward).sum(0)])
    separate, single = combine(grads[:2], alpha), grads[2]
    assert (separate - single).abs().max() > 1e-4  # so the fallback takes the exact combination
    # where the combined advantage itself reaches A_max the check fires too
    assert clamp_active(torch.tensor([[4.9], [4.9]]), torch.tensor([0.5, 0.5]), 4.9)
    # a loss without an advantage clamp (the ELBO policy gradient's) is affine at any advantage
    assert not clamp_active(per_reward * 1e3, alpha, None)
