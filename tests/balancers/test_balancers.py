"""Multi-reward balancers against numbers worked out by hand (ALGORITHMS §11 item 6), TailRL against the gradient
it claims to follow, and one contract test over every registered balancer."""

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from flowrl.advantages import group_advantages, tail_advantages
from flowrl.balancers import Balance, GD2POBalancer, GDPOBalancer, SAMRPOBalancer, TailBalancer, WeightedSumBalancer
from flowrl.registry import BALANCERS
from flowrl.training.scoring import Scores, balance
from flowrl.types import Balancer, GradientBalancer

NAN = float("nan")


# ------------------------------------------------------------------------------------------------ GDPO


def test_gdpo_worked_example_by_hand():
    # ALGORITHMS §7.1: group A rewards {(0,0), (0,1)}, group B {(0,0), (1,1)}, unbiased std, eps 1e-4
    scores = {"r1": torch.tensor([0.0, 0.0, 0.0, 1.0]), "r2": torch.tensor([0.0, 1.0, 0.0, 1.0])}
    groups = torch.tensor([0, 0, 1, 1])
    out = GDPOBalancer()(scores, groups, {})
    a = 0.5 / (math.sqrt(0.5) + 1e-4)  # z-score of (0, 1): ±0.5 / (unbiased std sqrt(1/2) + eps)
    # r1 has no spread in group A -> 0 there; sums (−a, a, −2a, 2a); batch mean 0, unbiased std a·sqrt(10/3)
    torch.testing.assert_close(out.per_reward, torch.tensor([[0, 0, -a, a], [-a, a, -a, a]]))
    scale = a * math.sqrt(10 / 3) + 1e-4
    torch.testing.assert_close(out.advantages, torch.tensor([-a, a, -2 * a, 2 * a]) / scale)
    assert out.advantages[3] / out.advantages[1] == pytest.approx(2.0)  # group B keeps twice group A's advantage
    # sum-then-normalise collapses both groups to (−0.707, 0.707)
    grpo = WeightedSumBalancer(std="group", eps=1e-4, use_unbiased_std=True)(scores, groups, {})
    b = 1.0 / (math.sqrt(2.0) + 1e-4)  # totals (0, 2): ±1 / (unbiased std sqrt(2) + eps)
    torch.testing.assert_close(grpo.advantages, torch.tensor([-a, a, -b, b]))


def test_gdpo_weights_act_on_normalised_advantages():
    scores = {"r1": torch.tensor([0.0, 2.0, 5.0, 1.0]), "r2": torch.tensor([3.0, 1.0, 0.0, 4.0])}
    groups = torch.tensor([0, 0, 1, 1])
    out = GDPOBalancer(whiten_eps=0.0)(scores, groups, {"r1": 2.0, "r2": 0.5})
    z = out.per_reward  # every pair of distinct values has z = ±1/sqrt(2) (up to eps)
    combined = 2.0 * z[0] + 0.5 * z[1]
    torch.testing.assert_close(out.advantages, (combined - combined.mean()) / combined.std())


# ------------------------------------------------------------------------------------------------ SA-MRPO


def _mixed_batch():
    gen = torch.Generator().manual_seed(3)
    a = torch.rand(12, generator=gen)
    b = torch.rand(12, generator=gen) * 3 - 1
    a[1], b[5], a[6], b[6] = NAN, NAN, NAN, NAN
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3])
    return {"a": a, "b": b}, groups


BOUNDS = {"a": [0.0, 1.0], "b": [-1.0, 2.0]}


@pytest.mark.parametrize("estimator", ["zscore", "tail"])
def test_sa_mrpo_with_gamma_zero_is_gdpo(estimator):
    scores, groups = _mixed_batch()
    weights = {"a": 1.0, "b": 0.5}
    sa = SAMRPOBalancer(gamma=0.0, bounds=BOUNDS, per_reward_estimator=estimator)(scores, groups, weights)
    gdpo = GDPOBalancer(per_reward_estimator=estimator)(scores, groups, weights)
    assert torch.equal(sa.advantages, gdpo.advantages) and torch.equal(sa.per_reward, gdpo.per_reward)


def test_sa_mrpo_is_gdpo_with_saturation_scaled_weights():
    scores, groups = _mixed_batch()
    out = SAMRPOBalancer(gamma=0.5, bounds=BOUNDS)(scores, groups, {"a": 1.0, "b": 2.0})
    sat_a = statistics.fmean(v for v in scores["a"].tolist() if v == v)  # bounds [0, 1]
    sat_b = (statistics.fmean(v for v in scores["b"].tolist() if v == v) + 1.0) / 3.0  # bounds [-1, 2]
    weights = {"a": (1 - sat_a) ** 0.5, "b": 2.0 * (1 - sat_b) ** 0.5}
    assert out.metrics["balancer/a/saturation"] == pytest.approx(sat_a)
    assert out.metrics["balancer/b/weight"] == pytest.approx(weights["b"])
    torch.testing.assert_close(out.advantages, GDPOBalancer()(scores, groups, weights).advantages)


def test_sa_mrpo_all_saturated_gives_zero_and_missing_bounds_fail():
    scores = {"a": torch.tensor([1.0, 1.0, 0.0, 1.0])}  # batch mean 0.75 with bounds [0, 0.75]: saturated
    out = SAMRPOBalancer(gamma=0.5, bounds={"a": [0, 0.75]})(scores, torch.tensor([0, 0, 1, 1]), {})
    assert torch.equal(out.advantages, torch.zeros(4))
    with pytest.raises(ValueError, match="bounds.*'b'"):
        SAMRPOBalancer(bounds={"a": [0, 1]})({"a": torch.zeros(2), "b": torch.zeros(2)}, torch.zeros(2), {})


# ------------------------------------------------------------------------------------------------ GD²PO

# Three groups of three with two rewards. Group z-scores (unbiased std; eps 1e-6 is ignored in the comments):
#   group 0  a (1, 0, 2) -> (0, −1, 1)        b (0, .55, 1) -> (−1.032, .067, .965)
#   group 1  a (0, 1, 2) -> (−1, 0, 1)        b (1, 0, 0)   -> (1.155, −.577, −.577)
#   group 2  a (0, 0, 1) -> (−.577, −.577, 1.155), b the same: no conflict
# Conflicts (signs differ): sample 1 (s = −.933/1.067 = −.875), 3 (s = .155/2.155 = .072), 5 (s = .423/1.577 = .268).
CONFLICT_A = [1.0, 0.0, 2.0, 0.0, 1.0, 2.0, 0.0, 0.0, 1.0]
CONFLICT_B = [0.0, 0.55, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
CONFLICT_GROUPS = [0, 0, 0, 1, 1, 1, 2, 2, 2]
MASKS = {  # kept samples by variant
    ("hard", 0.8): [1, 0, 1, 0, 1, 0, 1, 1, 1],
    ("snr", 0.8): [1, 1, 1, 0, 1, 0, 1, 1, 1],
    ("snr", 0.2): [1, 1, 1, 0, 1, 1, 1, 1, 1],
}


def _gd2po_by_hand(keep, eps=1e-6, whiten_eps=1e-4):
    """κ_g · Σ_k z_k over kept rollouts, whitened over kept rollouts (python statistics, unbiased std)."""
    z = {}
    for values in (CONFLICT_A, CONFLICT_B):
        for g in set(CONFLICT_GROUPS):
            idx = [i for i, gi in enumerate(CONFLICT_GROUPS) if gi == g]
            mean, std = statistics.fmean(values[i] for i in idx), statistics.stdev([values[i] for i in idx])
            for i in idx:
                z[i] = z.get(i, 0.0) + (values[i] - mean) / (std + eps)
    kappa = {g: sum(keep[i] for i, gi in enumerate(CONFLICT_GROUPS) if gi == g) / 3 for g in set(CONFLICT_GROUPS)}
    combined = [kappa[CONFLICT_GROUPS[i]] * z[i] for i in range(9)]
    kept = [combined[i] for i in range(9) if keep[i]]
    mean, std = statistics.fmean(kept), statistics.stdev(kept)
    return [(combined[i] - mean) / (std + whiten_eps) if keep[i] else 0.0 for i in range(9)]


@pytest.mark.parametrize(("mask", "threshold"), list(MASKS))
def test_gd2po_masks_on_a_hand_made_conflict_set(mask, threshold):
    scores = {"a": torch.tensor(CONFLICT_A), "b": torch.tensor(CONFLICT_B)}
    out = GD2POBalancer(mask=mask, snr_threshold=threshold)(scores, torch.tensor(CONFLICT_GROUPS), {})
    expected_keep = MASKS[(mask, threshold)]
    assert out.keep.tolist() == [bool(k) for k in expected_keep]
    torch.testing.assert_close(out.advantages, torch.tensor(_gd2po_by_hand(expected_keep)), atol=1e-5, rtol=1e-5)
    assert out.metrics["balancer/conflict_fraction"] == pytest.approx(3 / 9)
    assert out.metrics["balancer/masked_fraction"] == pytest.approx(expected_keep.count(0) / 9)


def test_gd2po_hard_mask_is_the_snr_mask_at_threshold_one():
    scores, groups = _mixed_batch()
    hard = GD2POBalancer(mask="hard")(scores, groups, {})
    snr = GD2POBalancer(mask="snr", snr_threshold=1.0)(scores, groups, {})
    assert torch.equal(hard.keep, snr.keep) and torch.equal(hard.advantages, snr.advantages)


def test_gd2po_nothing_kept_gives_zeros():
    scores = {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([1.0, 0.0])}  # both rollouts conflict, s = 0
    out = GD2POBalancer(mask="hard")(scores, torch.tensor([0, 0]), {})
    assert out.keep.tolist() == [False, False] and torch.equal(out.advantages, torch.zeros(2))


# ------------------------------------------------------------------------------------------------ TailRL


def test_tail_advantages_by_hand():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 5.0, 4.0, NAN])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    # group 0: above 1 -> 3 rewards, above 2 -> 1, above 3 -> none (no threshold)
    #   w(1) = 0, w(2) = 1/3, w(3) = 1/3 + 1 + 1 = 7/3; mean (0 + 7/3 + 1/3 + 1/3) / 4 = 3/4
    # group 1 (the NaN sample takes no part): w(4) = 0, w(5) = 1/1; mean 1/2
    expected = [-3 / 4, 7 / 3 - 3 / 4, 1 / 3 - 3 / 4, 1 / 3 - 3 / 4, 0.5, -0.5, 0.0]
    torch.testing.assert_close(tail_advantages(rewards, groups), torch.tensor(expected))


def test_tail_advantages_of_distinct_rewards_are_harmonic_numbers():
    n = 6
    rewards = torch.tensor([0.3, -1.0, 2.5, 0.7, 9.0, 0.0])
    rank = rewards.argsort().argsort() + 1  # ascending rank ρ in 1..n
    harmonic = [sum(1 / m for m in range(1, k + 1)) for k in range(n)]
    expected = [harmonic[n - 1] - harmonic[n - int(r)] - (n - 1) / n for r in rank]
    torch.testing.assert_close(tail_advantages(rewards, torch.zeros(n, dtype=torch.long)), torch.tensor(expected))
    # rank-based: an increasing transform changes nothing
    torch.testing.assert_close(tail_advantages(rewards.exp() * 7, torch.zeros(n)), torch.tensor(expected))


def test_tail_advantage_follows_the_gradient_of_the_expected_log_tail_probability():
    """E_x[A(x) ∇log π(x)] over groups drawn from a categorical policy = ∇_θ E_τ[log P_θ(R > τ)], τ ~ R (detached)."""
    values = torch.tensor([0.0, 1.0, 1.0, 3.0])  # rewards of 4 actions: a tie, and a rare best action
    logits = torch.tensor([0.8, 0.0, 0.3, -1.2], requires_grad=True)
    probs = logits.softmax(0)
    p_bar = probs.detach()
    objective = sum(p_bar[b] * torch.log(probs[values > values[b]].sum()) for b in range(3))  # b = 3: no one clears it
    (exact,) = torch.autograd.grad(objective, logits)

    gen = torch.Generator().manual_seed(0)
    num_groups, group_size = 2000, 128
    actions = torch.multinomial(p_bar, num_groups * group_size, replacement=True, generator=gen)
    advantages = tail_advantages(values[actions], torch.arange(num_groups).repeat_interleave(group_size))
    score = torch.nn.functional.one_hot(actions, 4).float() - p_bar  # ∇_θ log softmax(θ)[a]
    estimate = (advantages[:, None] * score).mean(0)
    torch.testing.assert_close(estimate, exact, atol=4e-3, rtol=0)  # seeds 0-9 land within 2e-3
    zscore = group_advantages(values[actions], torch.arange(num_groups).repeat_interleave(group_size), std="group")
    assert (zscore[:, None] * score).mean(0).sub(exact).abs().max() > 0.1  # the check tells objectives apart


def test_tail_balancer_uses_the_weighted_sum():
    scores = {"a": torch.tensor([1.0, 0.0, 2.0]), "b": torch.tensor([0.0, 3.0, NAN])}
    out = TailBalancer()(scores, torch.zeros(3, dtype=torch.long), {"a": 2.0, "b": 1.0})
    # totals (2, 3, 4): distinct, ranks 1, 2, 3 -> w = (0, 1/2, 1/2 + 1), mean 2/3
    torch.testing.assert_close(out.advantages, torch.tensor([-2 / 3, 0.5 - 2 / 3, 1.5 - 2 / 3]))
    assert out.per_reward is None


def test_tail_per_reward_inside_gdpo():
    scores, groups = _mixed_batch()
    out = GDPOBalancer(per_reward_estimator="tail")(scores, groups, {})
    torch.testing.assert_close(out.per_reward, torch.stack([tail_advantages(scores[k], groups) for k in scores]))


# ------------------------------------------------------------------------------------------------ contract

NAMES = BALANCERS.names()
KWARGS = {"sa_mrpo": {"bounds": BOUNDS}}


def _build(name):
    return BALANCERS.get(name)(**KWARGS.get(name, {}))


def _without(scores, groups, i):
    rows = [j for j in range(groups.numel()) if j != i]
    return {k: v[rows] for k, v in scores.items()}, groups[rows], rows


@pytest.mark.parametrize("name", NAMES)
def test_contract_protocol_members_are_declared(name):
    balancer = _build(name)
    gradients = "reward_gradients" in balancer.needs()
    protocol = GradientBalancer if gradients else Balancer
    members = {m for cls in protocol.__mro__ for m in vars(cls).get("__annotations__", {})}
    members |= {"needs", "__call__"}
    missing = sorted(m for m in members if not hasattr(balancer, m))
    assert not missing, f"balancer {name} lacks {missing} of flowrl.types.{protocol.__name__}"
    assert isinstance(balancer.needs(), frozenset) and isinstance(type(balancer).recipe_variants, dict)


@pytest.mark.parametrize("name", NAMES)
def test_contract_record(name):
    scores, groups = _mixed_batch()
    out = _build(name)(scores, groups, {"a": 1.0, "b": 0.5})
    assert isinstance(out, Balance)
    assert out.advantages.shape == (12,) and out.advantages.dtype == torch.float32
    assert out.keep.shape == (12,) and out.keep.dtype == torch.bool
    if out.per_reward is not None:
        assert out.per_reward.shape == (2, 12) and out.per_reward.dtype == torch.float32
    assert torch.isfinite(out.advantages).all() and out.advantages.abs().max() > 0
    assert all(isinstance(k, str) and isinstance(v, float) for k, v in out.metrics.items())


@pytest.mark.parametrize("name", NAMES)
def test_contract_nan_takes_no_part(name):
    balancer = _build(name)
    scores, groups = _mixed_batch()
    out = balancer(scores, groups, {})
    # sample 6 has every reward NaN: advantage 0, and the others as if it were not in the batch
    assert out.advantages[6] == 0
    rest, rest_groups, rows = _without(scores, groups, 6)
    alone = balancer(rest, rest_groups, {})
    torch.testing.assert_close(out.advantages[rows], alone.advantages, atol=1e-6, rtol=1e-6)
    assert torch.equal(out.keep[rows], alone.keep)
    # one reward, NaN at sample 1: the same as leaving sample 1 out
    single = {"a": scores["a"]}
    out = balancer(single, groups, {})
    rest, rest_groups, rows = _without(single, groups, 1)
    assert out.advantages[1] == 0
    torch.testing.assert_close(out.advantages[rows], balancer(rest, rest_groups, {}).advantages, atol=1e-6, rtol=1e-6)
    # per-reward rows: reward a's row ignores the sample where only a is NaN
    out = balancer(scores, groups, {})
    if out.per_reward is not None:
        rest, rest_groups, rows = _without(scores, groups, 1)
        assert out.per_reward[0, 1] == 0
        torch.testing.assert_close(out.per_reward[0, rows], balancer(rest, rest_groups, {}).per_reward[0])


@pytest.mark.parametrize("name", NAMES)
def test_contract_group_of_one_and_equal_rewards_give_zero(name):
    balancer = _build(name)
    scores, groups = _mixed_batch()
    out = balancer(scores, groups, {})
    assert out.advantages[11] == 0  # group 3 holds one sample
    if out.per_reward is not None:
        assert torch.equal(out.per_reward[:, 11], torch.zeros(2))
    # every group's rewards equal (values that float sums do not reproduce exactly)
    flat = {"a": torch.tensor([0.1] * 4 + [0.7] * 4 + [0.3] * 4), "b": torch.full((12,), 0.3)}
    groups = torch.tensor([0] * 4 + [1] * 4 + [2] * 4)
    out = balancer(flat, groups, {"a": 1.0, "b": 0.1})
    assert torch.equal(out.advantages, torch.zeros(12))
    if out.per_reward is not None:
        assert torch.equal(out.per_reward, torch.zeros(2, 12))


@pytest.mark.parametrize("name", NAMES)
def test_contract_permuting_samples_permutes_the_output(name):
    balancer = _build(name)
    scores, groups = _mixed_batch()
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    out = balancer(scores, groups, {"a": 1.0, "b": 2.0})
    shuffled = balancer({k: v[perm] for k, v in scores.items()}, groups[perm], {"a": 1.0, "b": 2.0})
    torch.testing.assert_close(shuffled.advantages, out.advantages[perm], atol=1e-5, rtol=1e-5)
    assert torch.equal(shuffled.keep, out.keep[perm])
    if out.per_reward is not None:
        torch.testing.assert_close(shuffled.per_reward, out.per_reward[:, perm], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("name", "field", "value"),
    [
        ("weighted_sum", "std", "batch"),
        ("gdpo", "eps", -1.0),
        ("gdpo", "per_reward_estimator", "rank"),
        ("gd2po", "mask", "soft"),
        ("gd2po", "snr_threshold", 1.5),
        ("sa_mrpo", "gamma", -0.5),
        ("sa_mrpo", "bounds", {"a": [1.0, 0.0]}),
        ("tail", "clip", 0.0),
    ],
)
def test_bad_config_values_name_the_field(name, field, value):
    with pytest.raises(ValueError) as err:
        BALANCERS.get(name)(**{field: value})
    message = str(err.value)
    assert "\n" not in message and field in message and name in message and "must" in message


def test_balance_keeps_neither_failed_samples_nor_masked_ones():
    scores = {"a": torch.tensor(CONFLICT_A), "b": torch.tensor(CONFLICT_B)}
    failed = torch.zeros(9, dtype=torch.bool)
    failed[7] = True
    scores = {k: torch.where(failed, torch.full_like(v, NAN), v) for k, v in scores.items()}
    accelerator = SimpleNamespace(device="cpu", gather=lambda t: t)
    batch = SimpleNamespace(group_ids=torch.tensor(CONFLICT_GROUPS), global_index=torch.arange(9))
    advantages, keep, metrics, errors = balance(
        accelerator, Scores(scores, failed), batch, GD2POBalancer(mask="hard"), {}
    )
    assert keep.tolist() == [True, False, True, False, True, False, True, False, True]
    assert advantages[7] == 0 and errors == 0 and "balancer/masked_fraction" in metrics
