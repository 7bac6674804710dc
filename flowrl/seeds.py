"""Every seed formula of flowrl, in one place (one owner: a change here changes every run's randomness).

A run draws nothing from global RNG state that decides *what* it trains on: prompts, sample seeds, SDE
windows, step noise and minibatch order are pure functions of (run seed, training step, position), so every
process agrees on them and a resumed run repeats them exactly.

A sample's three random streams hang off its own seed `s`:
    initial noise      torch.Generator().manual_seed(s)           (the diffusers pipeline's latents for seed s)
    step noise         manual_seed(s + NOISE_STREAM)
    SDE window start   manual_seed(s + WINDOW_STREAM)
    training noise     manual_seed(s + TRAIN_STREAM)              (NFT, RAM, AWM: its training times and their ε)
A group's seed g is its first sample's seed, or with data.noise_pool = P the prompt's pooled seed number e mod P
(e: how often the prompt was drawn before). A prompt group's candidate pool (the candidates sampler) hangs off g:
    pool seeds, then random selection draws    manual_seed(g + POOL_STREAM)

A recipe's own draws that belong to a group or a step (DGPO's shared ε, GDRO's times, Adv-GRPO's references and
reward-model draws) have their named functions below.

The fixed measurements outside training (held-out accuracy, benches) and the scripts that made the shipped toy
weights take their seeds from the named functions at the end.
"""

from __future__ import annotations

import torch

MAX_SEED = 2**31 - 1
NOISE_STREAM = 1 << 32  # offset between a sample's latent seed and its step-noise seed
WINDOW_STREAM = 2 * NOISE_STREAM  # offset of the seed that places a sample's SDE window
TRAIN_STREAM = 3 * NOISE_STREAM  # offset of the seed of a sample's training-time draws (forward-process recipes)
POOL_STREAM = 4 * NOISE_STREAM  # offset of the seed of a prompt group's candidate pool
RM_STREAM = 0x5AD  # keeps Adv-GRPO's reward-model head and patch draws apart from every other stream
POOL_OFFSET = 987_654_321  # keeps pooled group seeds (data.noise_pool) apart from the sample seeds of early steps
OFFLINE_OFFSET = 123_456_789  # keeps offline pool seeds (GDRO) apart from the sample seeds of early steps


def prompt_order(seed: int, epoch: int, num_prompts: int) -> torch.Tensor:
    """[P] the order in which epoch `epoch` visits the prompt list."""
    return torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed * 7919 + epoch))


def sample_seed(seed: int, step: int, position: int) -> int:
    """Seed of the sample at `position` of training step `step`'s global batch."""
    return (seed * 1_000_003 + step * 100_003 + position) % MAX_SEED


def pooled_group_seed(seed: int, prompt_index: int, slot: int) -> int:
    """Group seed number `slot` of prompt `prompt_index`'s fixed pool (data.noise_pool)."""
    return (seed * 1_000_003 + POOL_OFFSET + prompt_index * 1_009 + slot) % MAX_SEED


def step_generator(seed: int, step: int) -> torch.Generator:
    """CPU generator of a training step's own choices (minibatch order, shuffled timesteps)."""
    return torch.Generator().manual_seed(seed * 31 + step)


def adjoint_order_generator(seed: int, step: int) -> torch.Generator:
    """CPU generator of adjoint matching's minibatch order at a step, apart from the step's loss-time draws."""
    return step_generator(seed + 1, step)


def sample_generators(seeds: torch.Tensor, device: torch.device | str, offset: int = 0) -> list[torch.Generator]:
    """One generator per sample, seeded with seed + offset (diffusers' convention for per-image seeds)."""
    return [torch.Generator(device).manual_seed(int(s) + offset) for s in seeds.tolist()]


def window_start(seed: int, low: int, high: int) -> int:
    """A sample's random SDE window start, uniform in [low, high]."""
    return int(torch.randint(low, high + 1, (1,), generator=torch.Generator().manual_seed(int(seed) + WINDOW_STREAM)))


def pool_generator(group_seed: int) -> torch.Generator:
    """The generator of a prompt group's candidate pool: its seeds first, then any random selection."""
    return torch.Generator().manual_seed(int(group_seed) + POOL_STREAM)


def pool_seeds(generator: torch.Generator, pool_size: int) -> torch.Tensor:
    """[P] int64 seeds of a candidate pool, UniformInt[0, 2^31 − 1) (Sol-RL); a larger pool extends a smaller one."""
    return torch.randint(0, MAX_SEED, (pool_size,), generator=generator, dtype=torch.int64)


def offline_sample_seed(pool_seed: int, prompt_index: int, slot: int) -> int:
    """Seed of image `slot` of prompt `prompt_index` in an offline pool (GDRO's, flowrl.training.pool): a function of
    the pool's own seed, not the run's, so runs of any seed share one pool."""
    return (pool_seed * 1_000_003 + OFFLINE_OFFSET + prompt_index * 10_007 + slot) % MAX_SEED


# ---- a recipe's own draws that hang off (run seed, step, ...) rather than a sample's seed ----------------------------
def dgpo_noise_generator(seed: int, step: int, epoch: int, j: int, group_id: int) -> torch.Generator:
    """DGPO: the generator of the ε every sample of group `group_id` shares at time j of inner epoch `epoch` of step
    `step` (the same on any process)."""
    key = (seed * 1_000_003 + step * 100_003 + epoch * 1_009 + j * 101 + group_id * 7_919_993) % (2**62)
    return torch.Generator().manual_seed(key + TRAIN_STREAM)


def gdro_draw_generator(seed: int, step: int, j: int, group_id: int) -> torch.Generator:
    """GDRO: the generator of group `group_id`'s training times and noises at draw j of step `step` (any process)."""
    key = (seed * 1_000_003 + step * 100_003 + j * 1_009 + group_id * 7_919_993) % (2**62)
    return torch.Generator().manual_seed(key + TRAIN_STREAM)


def reference_key(seed: int, step: int, position: int) -> int:
    """Adv-GRPO: the key that picks the reference image of the sample at `position` of step `step`'s global batch."""
    return (seed * 1_000_003 + step * 10_007 + position) % (2**31)


def rm_head_seed(seed: int) -> int:
    """Adv-GRPO: the torch seed of its reward model's head initialisation (the same on every process)."""
    return seed + RM_STREAM


def rm_patch_generator(seed: int, version: int, purpose: int) -> torch.Generator:
    """Adv-GRPO: the generator of the reward model's patch draws at head version `version` for `purpose` (0 scoring,
    1 references, 2 generated samples of the RM step): the same on every process and on resume."""
    return torch.Generator().manual_seed((seed * 1_000_003 + version * 10_007 + purpose * 101 + RM_STREAM) % (2**62))


# ---- fixed measurements and the shipped weights' scripts -------------------------------------------------------------
def heldout_seeds(num_prompts: int, num_seeds: int) -> list[int]:
    """[P * S] the fixed seeds of the held-out measurements (`flowrl demo`'s before/after, `flowrl bench trainers` and
    `balancers`), prompt-major: seed k of prompt i is 10,000 + 100 i + k."""
    return [10_000 + i * 100 + k for i in range(num_prompts) for k in range(num_seeds)]


def split_seeds(seed: int, num_prompts: int, num_per_prompt: int) -> list[int]:
    """[P * S] the seeds of `python -m flowrl.heldout`'s measurement of a split under run seed `seed`,
    prompt-major: sample k of prompt i is 1,000,000 seed + 1000 i + k."""
    return [seed * 1_000_000 + i * 1000 + k for i in range(num_prompts) for k in range(num_per_prompt)]


def bench_group_seed(index: int) -> int:
    """The group seed of prompt `index` in `flowrl bench candidates` (its candidate pool hangs off it)."""
    return 1000 + index


def judge_heldout_generator(seed: int) -> torch.Generator:
    """scripts/train_toy_judges.py: the held-out scenes a judge trained with `seed` is measured on."""
    return torch.Generator().manual_seed(seed + 1_000_000)


def judge_impossible_generator(seed: int) -> torch.Generator:
    """scripts/train_toy_judges.py: the impossible scenes (counts or colours the world never draws) it is measured
    on."""
    return torch.Generator().manual_seed(seed + 2_000_000)


def pretrain_eval_generator(seed: int) -> torch.Generator:
    """scripts/pretrain_toy.py: the fixed evaluation batch of a pretraining run with `seed`."""
    return torch.Generator().manual_seed(seed + 12345)
