"""The recipe contract, checked for every registered trainer (flowrl.trainers.TRAINERS) on the shipped toy model.

Parametrized over `TRAINERS`, so a recipe added later is covered without editing this file: one step trains and
logs `train/loss`, and a run resumed from its checkpoint ends bit for bit where the uninterrupted run ends
(trainable weights, EMA, optimizer state, scheduler and counters).

The reward is tests/trainers/redness.py's: differentiable (adjoint matching needs its gradient) and different for any
two different images, so a group of two always has reward spread, whatever the toy judges score its samples (the
learned judge can give both one saturated score: advantages exactly 0, weights that do not move).
"""

import dataclasses
import json

import pytest
import torch
from dotted import set_dotted
from safetensors.torch import load_file

import flowrl.trainers.kit as kit
from flowrl.registry import BALANCERS
from flowrl.schedules import TRAINS_ON
from flowrl.trainers import TRAINERS, build_config, build_trainer
from flowrl.training.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two red circles", "one blue square", "three green triangles"]
REWARD = "redness.RednessReward"  # the registries' dotted-path fallback: tests/trainers is on sys.path
SAMPLER = {"name": "sde", "num_steps": 2, "guidance_scale": 1.0, "noise_level": 0.8}
RECIPE_SAMPLERS = {  # recipes that need a particular rollout (each refuses any other at config time)
    "adjoint_matching": {
        **SAMPLER,
        "noise_level": 2**0.5,
        "sigma_schedule": "dance",
        "sigma_shift": 1.0,
        "sigma_max": 0.9,
    },
    "tagrpo": {**SAMPLER, "same_latent": True},  # a group shares its initial noise
}


def toy_config(tmp_path, trainer, **overrides):
    """A run config for recipe `trainer` on the toy model; `train` keys the recipe's config class lacks are dropped."""
    train = {
        "learning_rate": 1e-2,
        "adam_weight_decay": 0.0,
        "clip_range": 1e-2,
        "use_async_rewards": False,
        "use_ema": True,
        "ema_every_n_steps": 1,
        "teacher_steps": 1,  # SMOPD's teachers
    }
    fields = {f.name for f in dataclasses.fields(TRAINERS[trainer].config_class)}
    data = {
        "name": "toy",
        "trainer": trainer,
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 1,
        "seed": 5,
        "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": PROMPTS[:2], "num_prompts_per_step": 1, "group_size": 2},
        "sampler": dict(RECIPE_SAMPLERS.get(trainer, SAMPLER)),
        "rewards": [{"name": REWARD}],
        "balancer": {"name": "weighted_sum", "std": "group"},
        "train": {k: v for k, v in train.items() if k in fields},
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1, "prompts": PROMPTS[:1]},
        "checkpoint": {"every_n_steps": 0, "keep_last": 3},
        "logging": {"trackers": [], "progress_bar": False},
    }
    set_dotted(data, overrides)
    return build_config(data)


def trainable(trainer):
    return {n: p.detach().clone() for n, p in trainer.parts.model.transformer.named_parameters() if p.requires_grad}


def assert_same(a, b, where="state"):
    """Nested dicts / lists of tensors and numbers equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def has_reward_signal(metrics: dict) -> bool:
    """A step's rewards told its samples apart: every group has spread (the recipes that build advantages), or the
    reward's gradient is non-zero (adjoint matching, which regresses on it)."""
    if "train/zero_std_fraction" in metrics:
        return metrics["train/zero_std_fraction"] == 0.0
    return metrics["train/grad_reward_norm"] > 0.0


@pytest.fixture(scope="module")
def straight_runs(tmp_path_factory):
    """trainer name -> (config, trainer, trainable weights before training) of an uninterrupted 2-step run with a
    checkpoint after every step (run once per recipe, shared by the tests below)."""
    cache = {}

    def get(name):
        if name not in cache:
            cfg = toy_config(
                tmp_path_factory.mktemp(f"straight_{name}"), name, num_steps=2, **{"checkpoint.every_n_steps": 1}
            )
            trainer = build_trainer(cfg)
            before = trainable(trainer)
            kit.train(trainer)
            lines = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
            assert all(map(has_reward_signal, lines)), lines  # else a step has nothing to learn from
            cache[name] = cfg, trainer, before
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_a_toy_step_moves_the_trainable_weights_and_logs_the_loss(straight_runs, name):
    cfg, trainer, before = straight_runs(name)
    assert before
    first = load_checkpoint(cfg.run_dir / "checkpoints" / "step_000001")["trainable"]
    # weight decay is 0, so a moved tensor means a non-zero gradient reached the optimizer in step 1
    assert first.keys() == before.keys()
    assert any(not torch.equal(before[n], first[n]) for n in before)
    lines = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert "train/loss" in line and torch.isfinite(torch.tensor(line["train/loss"]))


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_resume_from_a_checkpoint_ends_bit_for_bit_where_the_run_ends(tmp_path, straight_runs, name):
    straight_cfg, straight, _ = straight_runs(name)
    # interrupted: 1 step, then a new trainer resumes from the latest checkpoint and runs step 2
    kit.train(build_trainer(toy_config(tmp_path, name, num_steps=1, **{"checkpoint.every_n_steps": 1})))
    resumed_cfg = toy_config(
        tmp_path, name, num_steps=2, **{"checkpoint.every_n_steps": 1, "checkpoint.resume": "latest"}
    )
    resumed = build_trainer(resumed_cfg)
    kit.train(resumed)
    lines = [json.loads(line) for line in (resumed_cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]

    assert_same(trainable(straight), trainable(resumed), "trainable")
    a = load_checkpoint(straight_cfg.run_dir / "checkpoints" / "step_000002")
    b = load_checkpoint(resumed_cfg.run_dir / "checkpoints" / "step_000002")
    assert a["ema"] is not None and a["trainer_state"]["ema_updates"] == 2  # EMA on, updated after each step
    assert any(not torch.equal(a["ema"][n], a["trainable"][n]) for n in a["trainable"])
    for key in ("trainable", "ema", "optimizer", "lr_scheduler", "trainer_state"):
        assert_same(a[key], b[key], key)
    assert_same(a["trainable"], trainable(straight), "saved trainable")
    # every tensor file, the recipe's own groups too (NFT: adapter_old.safetensors)
    folders = [cfg.run_dir / "checkpoints" / "step_000002" for cfg in (straight_cfg, resumed_cfg)]
    files = sorted(f.name for f in folders[0].glob("*.safetensors"))
    assert files == sorted(f.name for f in folders[1].glob("*.safetensors"))
    for name in files:
        assert_same(load_file(str(folders[0] / name)), load_file(str(folders[1] / name)), name)


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_every_recipe_declares_what_other_modules_read(name):
    """What `flowrl plan`, the σ-range check and the composition checks read instead of testing trainer names."""
    cls = TRAINERS[name]
    assert cls.name == name
    assert isinstance(cls.adapter_copies, int) and cls.adapter_copies >= 0
    assert isinstance(cls.full_reference_copy, bool) and isinstance(cls.cfg_doubles_train_rows, bool)
    assert cls.trains_on in TRAINS_ON


@pytest.mark.parametrize("name", BALANCERS.names())
def test_every_balancer_declares_whether_it_combines_rewards_linearly(name):
    assert isinstance(BALANCERS.get(name).combines_rewards_linearly, bool)
    assert BALANCERS.get(name).combines_rewards_linearly == (name == "weighted_sum")  # the one linear combination
