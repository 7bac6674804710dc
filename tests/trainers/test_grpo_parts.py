"""Advantages, the clipped loss and the balancer against numbers worked out by hand."""

import math

import pytest
import torch

from flowrl.advantages import group_advantages, group_mean_std, zero_std_groups
from flowrl.balancers import WeightedSumBalancer
from flowrl.losses import clipped_policy_loss
from flowrl.training.prompts import GroupedPromptSampler

REWARDS = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 10.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])


def test_group_std_population_and_unbiased():
    mean, std = group_mean_std(REWARDS, GROUPS)
    assert mean.tolist() == [2, 2, 2, 10, 10, 10]
    torch.testing.assert_close(std[:3], torch.full((3,), math.sqrt(2 / 3)))
    _, std_unbiased = group_mean_std(REWARDS, GROUPS, unbiased=True)
    torch.testing.assert_close(std_unbiased[:3], torch.ones(3))
    assert std[3:].tolist() == [0, 0, 0]


def test_per_prompt_advantages_by_hand():
    a = group_advantages(REWARDS, GROUPS, std="group", eps=1e-4)
    s = math.sqrt(2 / 3) + 1e-4
    torch.testing.assert_close(a, torch.tensor([-1 / s, 0, 1 / s, 0, 0, 0]))
    dance = group_advantages(REWARDS, GROUPS, std="group", eps=1e-8, unbiased=True)
    torch.testing.assert_close(dance, torch.tensor([-1.0, 0, 1, 0, 0, 0]), atol=1e-6, rtol=0)


def test_global_std_advantages_by_hand():
    # population std of [1, 2, 3, 10, 10, 10]: mean 6, squares 25+16+9+16+16+16 = 98 -> sqrt(98/6)
    a = group_advantages(REWARDS, GROUPS, std="global", eps=1e-4)
    s = math.sqrt(98 / 6) + 1e-4
    torch.testing.assert_close(a, torch.tensor([-1 / s, 0, 1 / s, 0, 0, 0]))


def test_advantages_are_clipped_at_five():
    rewards = torch.zeros(50)
    rewards[0] = 100.0  # mean 2, population std sqrt((98² + 49·2²)/50) = 14 -> A = 98/14 = 7 -> clipped 5
    a = group_advantages(rewards, torch.zeros(50, dtype=torch.long), eps=0.0)
    assert a[0].item() == 5.0
    torch.testing.assert_close(a[1], torch.tensor(-2 / 14))


def test_nan_rewards_are_left_out_of_the_group():
    rewards = torch.tensor([1.0, float("nan"), 3.0])
    a = group_advantages(rewards, torch.zeros(3, dtype=torch.long), std="group", eps=0.0)
    torch.testing.assert_close(a, torch.tensor([-1.0, 0.0, 1.0]))  # mean 2, std 1 over the two finite rewards


def test_zero_std_groups():
    assert zero_std_groups(REWARDS, GROUPS).tolist() == [False] * 3 + [True] * 3


def test_clipped_loss_by_hand():
    old = torch.zeros(4)
    new = torch.tensor([0.2, -0.2, 0.05, -0.2])
    adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
    loss, stats = clipped_policy_loss(new, old, adv, clip_range=0.1)
    r = [math.exp(0.2), math.exp(-0.2), math.exp(0.05), math.exp(-0.2)]
    expected = [
        max(-r[0], -1.1),  # A>0, ratio above the band: the clipped term -1.1 wins
        max(r[1], 0.9),  # A<0, ratio below the band: 0.9 wins
        -r[2],  # inside the band
        -r[3],  # A>0, ratio below the band: the unclipped term is the larger one
    ]
    torch.testing.assert_close(loss, torch.tensor(expected))
    assert stats["clipped"].tolist() == [True, True, False, True]
    torch.testing.assert_close(stats["approx_kl"], 0.5 * new**2)


def test_clipped_loss_gradient_is_zero_when_clipped():
    new = torch.tensor([0.2], requires_grad=True)
    loss, _ = clipped_policy_loss(new, torch.zeros(1), torch.ones(1), 0.1)
    loss.sum().backward()
    assert new.grad.item() == 0.0


def test_weighted_sum_balancer_sums_then_normalises():
    scores = {"a": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([0.0, 0.0, float("nan"), 2.0])}
    out = WeightedSumBalancer(std="group", eps=0.0)(scores, torch.tensor([0, 0, 1, 1]), {"a": 1.0, "b": 0.5})
    # totals: [1, 2, 3, 5]; groups {1,2} and {3,5}: A = [-1, 1, -1, 1]
    torch.testing.assert_close(out.advantages, torch.tensor([-1.0, 1.0, -1.0, 1.0]))
    assert out.keep.all() and out.per_reward is None
    assert out.metrics["reward/total/mean"] == pytest.approx(2.75)


def test_prompt_sampler_groups_span_processes_and_agree():
    sampler = GroupedPromptSampler(["p0", "p1", "p2"], num_prompts_per_step=2, group_size=3, seed=7)
    full = sampler.global_batch(5)
    parts = [sampler.local_batch(5, r, 2) for r in range(2)]
    assert parts[0].prompts + parts[1].prompts == full.prompts
    assert torch.equal(torch.cat([p.seeds for p in parts]), full.seeds)
    assert full.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert full.prompts[0] == full.prompts[2] and len(set(full.seeds.tolist())) == 6
    # every prompt once per epoch, in a seeded order
    seen = [sampler._prompt_index(i) for i in range(3)]
    assert sorted(seen) == [0, 1, 2]
