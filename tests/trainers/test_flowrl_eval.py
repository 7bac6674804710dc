"""`flowrl eval` of a checkpoint is the run's own evaluation of it: the model built as the trainer builds it (every
`model:` setting, among them train_expert and family_kwargs) on the accelerator's device, the same numbers and images
as the in-training evaluation of the same weights."""

import json
import types

import pytest
import torch
import yaml

import flowrl.models
import flowrl.trainers.kit as kit
import flowrl.training.distributed
from flowrl.cli import main
from flowrl.trainers import build_trainer, load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

TRAIN = {"learning_rate": 1e-2, "adam_weight_decay": 0.0, "clip_range": 1e-2, "use_async_rewards": False}


def toy_i2v(tmp_path, tiny_pipeline):
    """The toy image-to-video model: family_kwargs.source_weight conditions it on each prompt's source image."""
    return {
        "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4, "family_kwargs": {"source_weight": 0.5}},
        "data": {"toy_split": "train", "toy_sources": True, "num_prompts_per_step": 1, "group_size": 2},
        "sampler": {
            "name": "sde",
            "num_steps": 2,
            "height": 32,
            "width": 32,
            "guidance_scale": 1.0,
            "same_latent": True,
        },
        "rewards": [{"name": "toy_attributes"}],
        "eval": {"toy_split": "heldout", "toy_sources": True, "num_prompts": 2, "seeds": [0, 1], "num_steps": 2},
    }


def wan22_low(tmp_path, tiny_pipeline):
    """The tiny Wan 2.2 A14B with its low-noise expert trained; the eval grid has steps on both experts."""
    rollout = {"num_steps": 6, "height": 16, "width": 16, "num_frames": 5, "guidance_scale": 1.0}
    return {
        "model": {"path": tiny_pipeline("wan22_a14b"), "train_expert": "low", "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": ["a red cat", "a blue dog"], "num_prompts_per_step": 1, "group_size": 2},
        "sampler": {"name": "sde", "noise_level": 0.7, **rollout},
        "rewards": [{"name": "per_frame", "reward": "redness.RednessReward"}],  # tests/trainers is on sys.path
        "eval": {"prompts": ["a red cat"], "seeds": [0], "num_steps": 6},
    }


@pytest.mark.parametrize("run", [toy_i2v, wan22_low], ids=lambda f: f.__name__)
def test_flowrl_eval_of_a_checkpoint_gives_the_runs_own_numbers(tmp_path, tiny_pipeline, run):
    data = {
        "name": "run",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 1,
        "seed": 2,
        "train": TRAIN,
        "logging": {"trackers": [], "progress_bar": False},
        **run(tmp_path, tiny_pipeline),
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    kit.train(build_trainer(load_config(config)))  # its final checkpoint and evaluation: step 1
    folder = tmp_path / "runs" / "run"
    checkpoint, in_training = folder / "checkpoints" / "step_000001", folder / "eval" / "step_000001"
    assert (
        main(["eval", "--config", str(config), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "again")]) == 0
    )
    a = json.loads((in_training / "scores.json").read_text())
    b = json.loads((tmp_path / "again" / "scores.json").read_text())
    assert a.pop("time_s") >= 0 and b.pop("time_s") >= 0
    assert a == b
    for sample in a["samples"]:
        assert (in_training / sample["image"]).read_bytes() == (tmp_path / "again" / sample["image"]).read_bytes()


class Loaded(Exception):
    """Raised by the stand-in loader once it has recorded its arguments."""


def test_flowrl_eval_hands_every_model_setting_and_the_accelerators_device_to_the_loader(tmp_path, monkeypatch):
    seen = {}

    def loader(path, **kwargs):
        seen.update(path=path, **kwargs)
        raise Loaded

    accelerator = types.SimpleNamespace(device=torch.device("cuda", 3), num_processes=1, process_index=0)
    monkeypatch.setattr(flowrl.models, "load_flow_model", loader)
    monkeypatch.setattr(flowrl.training.distributed, "make_accelerator", lambda cfg: accelerator)
    data = {
        "name": "run",
        "output_dir": str(tmp_path / "runs"),
        "model": {
            "path": "org/wan22-a14b",
            "train_expert": "low",
            "family_kwargs": {"frame_rate": 16},
            "max_sequence_length": 64,
        },
        "data": {"prompts": ["a red cat"], "num_prompts_per_step": 1, "group_size": 2},
        "rewards": [{"name": "jpeg_compressibility"}],
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(Loaded):
        main(["eval", "--config", str(config), "--checkpoint", "base", "--out", str(tmp_path / "eval")])
    assert seen["path"] == "org/wan22-a14b" and seen["device"] == torch.device("cuda", 3)
    assert seen["train_expert"] == "low" and seen["frame_rate"] == 16 and seen["max_sequence_length"] == 64
