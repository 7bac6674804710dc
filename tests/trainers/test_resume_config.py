"""Resuming refuses a checkpoint written with another config, but not one written before a key existed while the
current run keeps that key's default (an upgrade of flowrl between the save and the resume)."""

import pytest
from test_trainer_contract import toy_config

import flowrl.trainers.kit as kit
from flowrl.config import flatten, to_dict
from flowrl.trainers import build_trainer
from flowrl.trainers.ais import AISConfig
from flowrl.training.checkpoint import config_differences, field_default


def older(saved: dict, *dotted: str) -> dict:
    """The config dict as a flowrl without the keys `dotted` would have written it."""
    out = to_dict(saved)
    for key in dotted:
        *path, last = key.split(".")
        node = out
        for part in path:
            node = node[part]
        del node[last]
    return out


def test_a_key_new_since_the_checkpoint_at_its_default_is_no_difference(tmp_path):
    cfg = toy_config(tmp_path, "grpo")
    current = to_dict(cfg)
    saved = older(cfg, "data.noise_pool", "train.ais.max_weight")
    assert field_default(cfg, "train.ais.max_weight") == AISConfig().max_weight
    assert field_default(cfg, "data.noise_pool") == 0
    assert config_differences(saved, current, cfg) == []
    assert config_differences(saved, current) == ["data.noise_pool", "train.ais.max_weight"]  # without the schema
    changed = toy_config(tmp_path, "grpo", **{"data.noise_pool": 2})
    assert config_differences(saved, to_dict(changed), changed) == ["data.noise_pool"]
    other = toy_config(tmp_path, "grpo", **{"train.learning_rate": 0.5})
    assert config_differences(to_dict(cfg), to_dict(other), other) == ["train.learning_rate"]
    assert "train.ais.max_weight" in flatten(current)


def test_a_retired_section_switched_off_in_the_checkpoint_is_no_difference(tmp_path):
    """A GRPO checkpoint written while the recipe held TAGRPO's train.tagrpo section (trainer: tagrpo now) resumes
    where that section was off, and is refused where it was on."""
    cfg = toy_config(tmp_path, "grpo")
    current = to_dict(cfg)
    saved = to_dict(cfg)
    saved["train"]["tagrpo"] = {"enabled": False, "coef": 0.1, "bank_size": 0}
    assert config_differences(saved, current, cfg) == []
    saved["train"]["tagrpo"]["enabled"] = True
    assert config_differences(saved, current, cfg) == [
        "train.tagrpo.bank_size",
        "train.tagrpo.coef",
        "train.tagrpo.enabled",
    ]


def test_resume_refuses_a_changed_key_with_a_one_line_error(tmp_path):
    kit.train(build_trainer(toy_config(tmp_path, "grpo", num_steps=1, **{"checkpoint.every_n_steps": 1})))
    cfg = toy_config(tmp_path, "grpo", num_steps=2, **{"checkpoint.resume": "latest", "train.clip_range": 0.5})
    with pytest.raises(ValueError, match="comes from another config: keys train.clip_range differ"):
        kit.train(build_trainer(cfg))
