"""TAGRPO's trajectory alignment (flowrl/experimental/tagrpo.py, the recipe `trainer: tagrpo`): the targets, the loss
and its clip by hand, the memory bank's eviction and weights, coef 0 equal to plain GRPO, the alignment loss lowering
the distance to better members on the toy model, and resume with a bank bit for bit."""

import math

import pytest
import torch
from test_trainer_contract import assert_same, toy_config, trainable

import flowrl.trainers.kit as kit
from flowrl.experimental.tagrpo import Alignment, AlignmentConfig, MemoryBank, alignment_loss, start_key
from flowrl.sde import StepRule
from flowrl.trainers import build_trainer
from flowrl.types import Rollout

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def hand_rollout(rewards_groups, transitions=None):
    """A real Rollout of len(groups) samples, T = 2, latents [N, 3, 1, 2, 2] of distinct values; every transition
    stochastic unless `transitions` [M, 2] names the stochastic (sample, step) pairs."""
    n = len(rewards_groups)
    if transitions is None:
        transitions = torch.tensor([(i, k) for i in range(n) for k in range(2)])
    latents = torch.arange(n * 3 * 4, dtype=torch.float32).view(n, 3, 1, 2, 2) / 7.0
    return Rollout(
        latents=latents,
        log_probs=torch.zeros(n, 2),
        sigmas=torch.tensor([1.0, 0.5, 0.0]),
        images=torch.zeros(n, 3, 2, 2),
        group_ids=torch.tensor([g for _, g in rewards_groups]),
        prompts=["two red circles"] * n,
        cond={},
        noise_levels=torch.ones(n, 2),
        rule=StepRule(),
        transitions=transitions,
    )


def test_targets_are_the_hand_computed_weighted_means_of_better_and_worse_members():
    # group 0: rewards 1, 2, 4 (pair weights ∝ reward differences); group 1: one sample, no partner
    rollout = hand_rollout([(1.0, 0), (2.0, 0), (4.0, 0), (5.0, 1)])
    rewards = torch.tensor([1.0, 2.0, 4.0, 5.0])
    align = Alignment(AlignmentConfig(), MemoryBank(AlignmentConfig()))
    align.prepare(rollout, rewards, torch.ones(4, dtype=torch.bool), ["a", "a", "a", "b"], step=0)
    z_pos, has_pos, z_neg, has_neg, bank = align.targets(torch.arange(4), torch.ones(4, dtype=torch.int64))
    z = rollout.latents[:, 2]  # the next latents of step k = 1
    assert has_pos.tolist() == [True, True, False, False] and has_neg.tolist() == [False, True, True, False]
    torch.testing.assert_close(z_pos[0], (1 * z[1] + 3 * z[2]) / 4)
    torch.testing.assert_close(z_pos[1], z[2])
    torch.testing.assert_close(z_neg[1], z[0])
    torch.testing.assert_close(z_neg[2], (3 * z[0] + 2 * z[1]) / 5)
    assert bank.tolist() == [0, 0, 0, 0]


def test_a_member_whose_step_was_deterministic_is_no_partner_there():
    # member 1 took an ODE step at k = 1 (its window was elsewhere): only member 2 is a better partner of row 0 there
    table = torch.tensor([(0, 0), (0, 1), (1, 0), (2, 0), (2, 1)])
    rollout = hand_rollout([(1.0, 0), (2.0, 0), (4.0, 0)], table)
    align = Alignment(AlignmentConfig(), MemoryBank(AlignmentConfig()))
    align.prepare(rollout, torch.tensor([1.0, 2.0, 4.0]), torch.ones(3, dtype=torch.bool), ["a"] * 3, step=0)
    z_pos, _, _, _, _ = align.targets(torch.tensor([0, 0]), torch.tensor([1, 0]))
    torch.testing.assert_close(z_pos[0], rollout.latents[2, 2])
    torch.testing.assert_close(z_pos[1], (1 * rollout.latents[1, 1] + 3 * rollout.latents[2, 1]) / 4)


def test_a_failed_member_is_no_partner():
    rollout = hand_rollout([(1.0, 0), (2.0, 0), (4.0, 0)])
    align = Alignment(AlignmentConfig(), MemoryBank(AlignmentConfig()))
    usable = torch.tensor([True, True, False])
    align.prepare(rollout, torch.tensor([1.0, 2.0, float("nan")]), usable, ["a"] * 3, step=0)
    z_pos, has_pos, _, has_neg, _ = align.targets(torch.tensor([0, 2]), torch.tensor([0, 0]))
    torch.testing.assert_close(z_pos[0], rollout.latents[1, 1])  # only member 1 is better (member 2 failed)
    assert has_pos.tolist() == [True, False] and has_neg.tolist() == [False, False]


def test_loss_and_its_clip_by_hand():
    mean = torch.tensor([[1.0, 2.0]], requires_grad=True)
    std = torch.tensor([[0.5]])
    z_pos, z_neg, yes = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]]), torch.tensor([True])
    # d⁺ = mean((1, 4) / (2 · 0.25)) = 5; d⁻ = mean((0, 1) / 0.5) = 1
    loss, d_pos, d_neg = alignment_loss(mean, std, z_pos, yes, z_neg, yes, repel=0.5, repel_clip=2.0)
    assert float(d_pos) == 5.0 and float(d_neg) == 1.0 and float(loss.detach()) == 4.5
    (grad,) = torch.autograd.grad(loss.sum(), mean)
    # ∂d/∂μ = (μ − z) / (s² · numel) = (μ − z) / 0.5
    torch.testing.assert_close(grad, torch.tensor([[2.0, 4.0]]) - 0.5 * torch.tensor([[0.0, 2.0]]))
    clipped, _, _ = alignment_loss(mean, std, z_pos, yes, z_neg, yes, repel=0.5, repel_clip=0.8)
    assert math.isclose(float(clipped.detach()), 5.0 - 0.5 * 0.8, rel_tol=1e-6)
    (grad,) = torch.autograd.grad(clipped.sum(), mean)
    torch.testing.assert_close(grad, torch.tensor([[2.0, 4.0]]))  # past τ the push has no gradient
    none, _, _ = alignment_loss(mean, std, z_pos, ~yes, z_neg, ~yes, repel=0.5, repel_clip=2.0)
    assert float(none.detach()) == 0.0


def test_log_distance_by_hand():
    mean = torch.tensor([[1.0, 2.0]], requires_grad=True)
    std, yes = torch.tensor([0.5]), torch.tensor([True])
    z_pos, z_neg = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, 1.0]])
    # d⁺ = 5, d⁻ = 1 as above: L = log 5 − 0.5 · log 1; ∂ log d / ∂μ = (∂d / ∂μ) / d
    loss, _, _ = alignment_loss(mean, std, z_pos, yes, z_neg, yes, repel=0.5, repel_clip=2.0, distance="log")
    assert math.isclose(float(loss.detach()), math.log(5.0), rel_tol=1e-6)
    (grad,) = torch.autograd.grad(loss.sum(), mean)
    torch.testing.assert_close(grad, torch.tensor([[2.0, 4.0]]) / 5 - 0.5 * torch.tensor([[0.0, 2.0]]) / 1)
    clipped, _, _ = alignment_loss(mean, std, z_pos, yes, z_neg, yes, repel=0.5, repel_clip=0.8, distance="log")
    assert math.isclose(float(clipped.detach()), math.log(5.0) - 0.5 * math.log(0.8), rel_tol=1e-6)
    (grad,) = torch.autograd.grad(clipped.sum(), mean)
    torch.testing.assert_close(grad, torch.tensor([[2.0, 4.0]]) / 5)
    with pytest.raises(ValueError, match="train.tagrpo.distance"):
        AlignmentConfig(distance="l1")


def test_bank_evicts_by_rule_and_weights_entries_by_age():
    z = torch.zeros(3, 1, 2, 2)
    bank = MemoryBank(AlignmentConfig(bank_size=2, bank_decay=0.5))
    for step, (reward, u) in enumerate([(1.0, 0.1), (2.0, -2.0), (3.0, 0.5)]):
        bank.add("a", 0, z + step, reward, u, step)
    latents, rewards, weights = bank.lookup("a", 0, step=4)
    assert rewards == [2.0, 3.0] and weights == [0.5**3, 0.5**2]  # the oldest went
    assert torch.equal(latents[0], z + 1)
    bank = MemoryBank(AlignmentConfig(bank_size=2, eviction="smallest_advantage"))
    for step, (reward, u) in enumerate([(1.0, 0.1), (2.0, -2.0), (3.0, 0.5)]):
        bank.add("a", 0, z, reward, u, step)
    assert bank.lookup("a", 0, step=3)[1] == [2.0, 3.0]  # |u| = 0.1 went
    bank = MemoryBank(AlignmentConfig(bank_size=4, bank_capacity=3))
    for step in range(5):
        bank.add(f"k{step % 2}", step % 3, z, float(step), 0.0, step)
    assert len(bank) == 3 and sorted(e["step"] for s in bank.entries.values() for e in s) == [2, 3, 4]
    tensors, index = bank.state()
    again = MemoryBank(bank.cfg)
    again.load(tensors, index)
    assert again.entries.keys() == bank.entries.keys()
    for key in bank.entries:
        assert_same([dict(e) for e in bank.entries[key]], [dict(e) for e in again.entries[key]], str(key))


def test_bank_entries_join_the_targets_with_their_age_weight():
    rollout = hand_rollout([(1.0, 0), (2.0, 0), (4.0, 0)])
    cfg = AlignmentConfig(bank_size=4, bank_decay=0.5)
    bank = MemoryBank(cfg)
    old = torch.full((1, 2, 2), 9.0)
    bank.add("a", 1, old, reward=3.0, u=0.0, step=2)  # one step old at step 3: weight 0.5
    align = Alignment(cfg, bank)
    align.prepare(rollout, torch.tensor([1.0, 2.0, 4.0]), torch.ones(3, dtype=torch.bool), ["a"] * 3, step=3)
    z_pos, _, z_neg, has_neg, partners = align.targets(torch.tensor([0, 2]), torch.tensor([1, 1]))
    z = rollout.latents[:, 2]
    # row 0 (reward 1): members 2 − 1 = 1 and 4 − 1 = 3, the bank entry 0.5 · (3 − 1) = 1
    torch.testing.assert_close(z_pos[0], (1 * z[1] + 3 * z[2] + 1 * old) / 5)
    # row 2 (reward 4): worse are 1 (3), 2 (2) and the bank entry 0.5 · (4 − 3)
    torch.testing.assert_close(z_neg[1], (3 * z[0] + 2 * z[1] + 0.5 * old) / 5.5)
    assert bool(has_neg[1]) and partners.tolist() == [1, 1]


def test_start_key_names_prompt_source_and_noise():
    assert start_key("a", {"image": "/x.png"}, 7) != start_key("a", {"image": "/y.png"}, 7)
    assert start_key("a", {}, 7) != start_key("a", {}, 8) and start_key("a", {}, 7) == start_key("a", {"other": 1}, 7)


TAGRPO = {"sampler.same_latent": True, "data.group_size": 3}


def test_coef_zero_trains_exactly_as_plain_grpo(tmp_path):
    plain = build_trainer(toy_config(tmp_path / "a", "grpo", **{"sampler.same_latent": True, "data.group_size": 3}))
    plain.train_step()
    aligned = build_trainer(toy_config(tmp_path / "b", "tagrpo", **TAGRPO, **{"train.tagrpo.coef": 0.0}))
    metrics = aligned.train_step()
    assert_same(trainable(plain), trainable(aligned))
    assert metrics["train/tagrpo_attract"] > 0 and "train/tagrpo_bank_entries" in metrics


def test_the_alignment_loss_moves_the_step_mean_toward_better_members(tmp_path):
    """Only the alignment term (advantages 0, no KL): one optimizer step on one rollout lowers the normalised distance
    of each trained transition's step mean to its better members' next latents (4 inner epochs on one rollout)."""
    from flowrl.balancers import weighted_total
    from flowrl.experimental.tagrpo import step_alignment
    from flowrl.trainers.grpo import grpo_optimise
    from flowrl.training.scoring import balance_per_reward, rollout_and_score

    cfg = toy_config(
        tmp_path,
        "tagrpo",
        **{
            **TAGRPO,
            "train.learning_rate": 1e-2,
            "train.num_inner_epochs": 4,
            "train.tagrpo.coef": 1.0,
            "train.tagrpo.repel": 0.0,
            "data.group_size": 4,
        },
    )
    trainer = build_trainer(cfg)
    batch = trainer.parts.prompt_sampler.local_batch(0, 0, 1)
    parts = trainer.parts
    rollout, local, _ = rollout_and_score(parts.sampler, parts.model, batch, parts.scorer, 1, 0, parts.weights)
    _, per_reward, keep, _, _ = balance_per_reward(parts.accelerator, local, batch, parts.balancer, parts.weights)
    combined = weighted_total(local.scores, parts.weights)
    alignment = step_alignment(cfg.train.tagrpo, trainer.bank, rollout, batch, combined, keep.cpu() & ~local.failed, 0)

    def distance() -> float:
        rows, steps = rollout.transitions[:, 0], rollout.transitions[:, 1]
        with torch.no_grad():
            x, x_next = rollout.states(rows, steps), rollout.states(rows, steps + 1)
            sig = rollout.sigmas
            v = trainer.parts.model.velocity(x, sig[steps], {k: c[rows] for k, c in rollout.cond.items()}, 1.0)
            _, _, mean, std = rollout.rule.step(
                v, x, sig[steps], sig[steps + 1], rollout.noise_levels[rows, steps], prev_sample=x_next
            )
            z_pos, has_pos, *_ = alignment.targets(rows, steps)
            d = ((mean - z_pos) ** 2 / (2 * std.view(-1, 1, 1, 1) ** 2)).mean((1, 2, 3))
        return float(d[has_pos].mean())

    before = distance()
    grpo_optimise(parts, rollout, torch.zeros(len(keep)), keep, torch.zeros_like(per_reward), regulariser=alignment)
    after = distance()
    assert after < before - 2e-3, (before, after)  # measured 0.5097 -> 0.5062 (the noise floor is 0.5)


def test_resume_with_a_memory_bank_ends_bit_for_bit(tmp_path):
    bank = {**TAGRPO, "train.tagrpo.bank_size": 2, "checkpoint.every_n_steps": 1}
    straight = build_trainer(toy_config(tmp_path / "s", "tagrpo", num_steps=2, **bank))
    kit.train(straight)
    kit.train(build_trainer(toy_config(tmp_path / "r", "tagrpo", num_steps=1, **bank)))
    resumed = build_trainer(
        toy_config(tmp_path / "r", "tagrpo", num_steps=2, **bank, **{"checkpoint.resume": "latest"})
    )
    kit.train(resumed)
    assert len(straight.bank) > 0
    assert_same(trainable(straight), trainable(resumed))
    assert_same(straight.bank.state(), resumed.bank.state())


def test_tagrpo_needs_a_shared_initial_noise(tmp_path):
    with pytest.raises(ValueError, match="same_latent: true"):
        build_trainer(toy_config(tmp_path, "tagrpo", **{**TAGRPO, "sampler.same_latent": False}))
    with pytest.raises(ValueError, match="train.tagrpo.eviction"):
        AlignmentConfig(eviction="lru")


def test_noise_pool_makes_a_prompts_starts_recur():
    from flowrl.seeds import pooled_group_seed
    from flowrl.training.prompts import GroupedPromptSampler

    prompts = ["one red circle", "two blue squares", "three green triangles"]
    pooled = GroupedPromptSampler(prompts, 3, 2, seed=4, noise_pool=2)
    plain = GroupedPromptSampler(prompts, 3, 2, seed=4)
    seen: dict[str, list[int]] = {}
    for step in range(4):  # 3 prompts a step: step e visits every prompt for the e-th time
        batch, fresh = pooled.global_batch(step), plain.global_batch(step)
        assert torch.equal(batch.seeds, fresh.seeds)  # step noise stays per sample
        for g in range(3):
            rows = slice(2 * g, 2 * g + 2)
            assert len(set(batch.group_seeds[rows].tolist())) == 1
            seen.setdefault(batch.prompts[2 * g], []).append(int(batch.group_seeds[2 * g]))
    for p, seeds in seen.items():
        i = prompts.index(p)
        assert seeds == [pooled_group_seed(4, i, e % 2) for e in range(4)]
    with pytest.raises(ValueError, match="data.noise_pool"):
        GroupedPromptSampler(prompts, 3, 2, seed=4, noise_pool=-1)
