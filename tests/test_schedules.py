"""flowrl.schedules' training-time draws: one error shape where no time is left to train, GDRO's shifted times by hand,
DGPO's shared times among the trained grid times; and the recipe-local seed formulas of flowrl.seeds by hand."""

import re

import pytest
import torch

from flowrl import schedules, seeds

NO_TIME = re.escape("leaves no training time on the model's trained σ range (model.train_expert)")


def generators(count: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(i) for i in range(count)]


def test_every_draw_that_finds_no_time_raises_the_one_error():
    grid = torch.linspace(1, 0, 9)  # T = 8
    none = torch.zeros(8, dtype=torch.bool)
    with pytest.raises(ValueError, match=f"sampler.num_steps=8 {NO_TIME}; add steps"):
        schedules.nft_times(generators(2), grid, 0.5, none)
    with pytest.raises(ValueError, match=f"train.timestep_fraction=0.05 of 8 trainable grid times {NO_TIME}; raise it"):
        schedules.nft_times(generators(2), grid, 0.05)
    with pytest.raises(ValueError, match=f"\\(discrete_wo_init: from index 1\\) {NO_TIME}"):
        schedules.awm_times(generators(2), grid, (1,), 2, 0.2, "discrete_wo_init")
    with pytest.raises(ValueError, match=f"train.max_timestep_index=3 {NO_TIME}"):
        schedules.dgpo_times(torch.Generator().manual_seed(0), grid, 3, 2, 1, none)
    with pytest.raises(ValueError, match=f"train.num_random_loss_times=0 {NO_TIME}"):
        schedules.adjoint_loss_times(grid, 0.1, 0, torch.Generator().manual_seed(0), torch.arange(8) < 2)


def test_gdro_times_are_the_shifted_draw_mapped_onto_the_range_by_hand():
    lo, hi, shift = 0.2, 0.9, 3.0
    times, noises = schedules.gdro_times(torch.Generator().manual_seed(4), 5, (2,), "uniform", shift, (lo, hi))
    gen = torch.Generator().manual_seed(4)
    u = torch.rand(5, generator=gen).double()
    expected = lo + (hi - lo) * (shift * u / (1 + (shift - 1) * u))
    torch.testing.assert_close(times.double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(noises, torch.randn((5, 2), generator=gen))  # the noises follow the times on one generator
    logit, _ = schedules.gdro_times(torch.Generator().manual_seed(4), 5, (2,), "logit_normal", 1.0, (0.0, 1.0))
    assert torch.equal(logit, torch.sigmoid(torch.randn(5, generator=torch.Generator().manual_seed(4))))


def test_dgpo_times_are_distinct_trained_indices_up_to_the_last_allowed():
    grid = torch.linspace(1, 0, 11)  # T = 10
    trained = torch.arange(10) >= 3
    epochs = schedules.dgpo_times(torch.Generator().manual_seed(1), grid, 6, 3, 4, trained)
    assert len(epochs) == 4
    for times in epochs:
        assert len(set(times.tolist())) == 3 and all(3 <= k <= 6 for k in times.tolist())
    assert [len(t) for t in schedules.dgpo_times(torch.Generator(), grid, 4, 5, 1, trained)] == [2]  # fewer exist


def test_recipe_seed_formulas_by_hand():
    assert seeds.reference_key(3, 2, 7) == (3 * 1_000_003 + 2 * 10_007 + 7) % 2**31
    key = (3 * 1_000_003 + 2 * 100_003 + 1 * 1_009 + 4 * 101 + 5 * 7_919_993) % 2**62
    expected = torch.randn(4, generator=torch.Generator().manual_seed(key + seeds.TRAIN_STREAM))
    assert torch.equal(torch.randn(4, generator=seeds.dgpo_noise_generator(3, 2, 1, 4, 5)), expected)
    key = (3 * 1_000_003 + 2 * 100_003 + 4 * 1_009 + 5 * 7_919_993) % 2**62
    expected = torch.rand(4, generator=torch.Generator().manual_seed(key + seeds.TRAIN_STREAM))
    assert torch.equal(torch.rand(4, generator=seeds.gdro_draw_generator(3, 2, 4, 5)), expected)
    key = (3 * 1_000_003 + 2 * 10_007 + 1 * 101 + 0x5AD) % 2**62
    expected = torch.rand(4, generator=torch.Generator().manual_seed(key))
    assert torch.equal(torch.rand(4, generator=seeds.rm_patch_generator(3, 2, 1)), expected)
    assert seeds.rm_head_seed(3) == 3 + 0x5AD
