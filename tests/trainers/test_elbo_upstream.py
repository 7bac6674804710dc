"""flowrl's ELBO loss (flowrl/trainers/elbo.py) against the authors' own functions on identical tensors.

tests/fixtures/elbo_upstream/rethinking_elbo_loss.py holds `compute_elbo`, `return_decay` and BaseTrainingUtils'
`compute_policy_loss` / `compute_kl_loss` of jaemoo-choi/rethinking-diffusion-rl, extracted unchanged by
scripts/extract_elbo_loss.py (its README names the commit and lines). Every case runs in float64: the ELBO of each
weighting and its gradient in v, every objective with and without the ratio and its gradient in the ELBO, the
velocity KL ("girsanov") and the old policy's soft-update schedule. The authors average over the batch; flowrl
returns per-sample terms, so their mean is compared.
"""

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowrl.losses import velocity_kl
from flowrl.trainers.elbo import ELBO_WEIGHTINGS, OBJECTIVES, elbo_log_likelihood, elbo_policy_loss
from flowrl.trainers.nft import old_policy_decay

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "elbo_upstream"
sys.path.insert(0, str(FIXTURE))
import rethinking_elbo_loss as upstream  # noqa: E402

TOL = {"rtol": 1e-12, "atol": 1e-12}


def case(seed: int = 0, n: int = 5):
    """x0, ε, v [n, 3, 4, 4] and t [n] in (0.05, 0.95), float64; x_t = (1 − t)·x0 + t·ε."""
    gen = torch.Generator().manual_seed(seed)
    x0, noise, v = (torch.randn(n, 3, 4, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    t = 0.05 + 0.9 * torch.rand(n, generator=gen, dtype=torch.float64)
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    return x0, noise, v, t, x_t


@pytest.mark.parametrize("weighting", ELBO_WEIGHTINGS)
def test_elbo_and_its_gradient_equal_the_authors(weighting):
    x0, noise, v, t, x_t = case()
    v_ours, v_theirs = v.clone().requires_grad_(), v.clone().requires_grad_()
    ours = elbo_log_likelihood(v_ours, x_t, x0, noise, t, weighting)
    theirs = upstream.compute_elbo(t.view(-1, 1, 1, 1), v_theirs, x_t, x0, noise, weighting)
    torch.testing.assert_close(ours, theirs, **TOL)
    weights = torch.linspace(-1.0, 2.0, len(t), dtype=torch.float64)  # a weighted sum: every sample's own gradient
    (ours * weights).sum().backward()
    (theirs * weights).sum().backward()
    torch.testing.assert_close(v_ours.grad, v_theirs.grad, **TOL)
    assert float(v_ours.grad.abs().max()) > 1e-3


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("use_ratio", [True, False])
def test_objectives_and_their_gradient_equal_the_authors(objective, use_ratio):
    gen = torch.Generator().manual_seed(1)
    log_p = -torch.rand(6, generator=gen, dtype=torch.float64)  # ELBOs are negative
    old = log_p + 0.3 * torch.randn(6, generator=gen, dtype=torch.float64)  # ratios well off 1
    advantages = torch.randn(6, generator=gen, dtype=torch.float64)
    method = objective if use_ratio else f"{objective}_noratio"
    config = SimpleNamespace(train=SimpleNamespace(method=method, adv="standard"))
    ours_in, theirs_in = log_p.clone().requires_grad_(), log_p.clone().requires_grad_()
    ours, terms = elbo_policy_loss(ours_in, old, advantages, objective, use_ratio)
    theirs = upstream.Upstream(config).compute_policy_loss(theirs_in, old, advantages)
    torch.testing.assert_close(ours.mean(), theirs, **TOL)
    ours.mean().backward()
    theirs.backward()
    torch.testing.assert_close(ours_in.grad, theirs_in.grad, **TOL)
    torch.testing.assert_close(terms["ratio"], (log_p - old).exp(), **TOL)


def test_velocity_kl_equals_the_authors_girsanov_term():
    x0, noise, v, t, x_t = case(2)
    v_ref = v + 0.1 * torch.randn(v.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    config = SimpleNamespace(train=SimpleNamespace(kl_method="girsanov", elbo="adaptive", ref_guidance_scale=1.0))
    theirs = upstream.Upstream(config).compute_kl_loss(v, v_ref, None, None, t.view(-1, 1, 1, 1), x_t, x0, noise)
    torch.testing.assert_close(velocity_kl(v, v_ref).double(), theirs, rtol=1e-6, atol=0)  # flowrl's in float32


@pytest.mark.parametrize("decay_type", [0, 1, 2])
def test_old_policy_decay_equals_the_authors_schedule(decay_type):
    for step in (0, 1, 7, 74, 75, 80, 499, 500, 501, 5000):
        assert old_policy_decay(decay_type, step) == pytest.approx(upstream.return_decay(step, decay_type), abs=1e-15)
