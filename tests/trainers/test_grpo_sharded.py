"""Sharded training through the shipped accelerate presets, as real 2-process gloo runs on the CPU.

FSDP2 (configs/accelerate/fsdp.yaml) and DeepSpeed ZeRO-2 (configs/accelerate/deepspeed_zero2.yaml) must give
the weights of the plain 1-process run with the same global batch, and their checkpoints (whole tensors by
parameter name) must resume in a plain process to the same weights.
"""

import json
import shutil

import pytest
from launching import launch
from safetensors.torch import load_file
from test_grpo_processes import write_config

import flowrl.trainers.kit as kit
from flowrl.trainers import load_config
from flowrl.trainers.grpo import GRPOTrainer

STEPS = 2
TOLERANCE = 1e-5  # batch-size-dependent float32 numerics only (the data-parallel test's tolerance)


def weights(run_dir, step=STEPS, file="trainable.safetensors"):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / file))


def max_difference(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, tiny_pipeline):
    tmp = tmp_path_factory.mktemp("plain")
    extra = {"num_steps": STEPS, "checkpoint": {"every_n_steps": 1, "keep_last": 2}}
    config = write_config(tmp, tiny_pipeline("sd3"), "one", **extra)
    kit.train(GRPOTrainer(load_config(config)))
    return tmp / "runs" / "one", tiny_pipeline("sd3"), extra


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "deepspeed_zero2"])
def test_sharded_preset_matches_one_process_and_resumes_plain(tmp_path, plain_run, preset):
    one, pipeline, extra = plain_run
    config = write_config(tmp_path, pipeline, "sharded", **extra)
    launch(preset, config)
    run = tmp_path / "runs" / "sharded"
    launched = json.loads((run / "launch.json").read_text())
    assert launched["num_processes"] == 2 and launched["sharding"] == preset.split("_")[0], launched
    # gradient norms (before clipping) agree too: Adam would hide a wrongly scaled gradient from the weights
    norms = [
        [json.loads(line)["train/grad_norm"] for line in (r / "metrics.jsonl").read_text().splitlines()]
        for r in (one, run)
    ]
    assert len(norms[1]) == STEPS and norms[0] == pytest.approx(norms[1], rel=1e-4), norms

    # the same weights and EMA as the plain run, and the trained LoRA really moved
    plain, sharded = weights(one), weights(run)
    assert max_difference(plain, sharded) < TOLERANCE
    assert max_difference(weights(one, file="ema.safetensors"), weights(run, file="ema.safetensors")) < TOLERANCE
    assert any(float(v.abs().max()) > 0 for k, v in sharded.items() if "lora_B" in k)
    # the evaluation ran once per eval point on the main process only
    assert (run / "eval" / "base").is_dir()

    # resume the sharded run's step-1 checkpoint in one plain process: step 2 matches again
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:06d}")
    kit.train(GRPOTrainer(load_config(config, ["checkpoint.resume=latest"])))
    assert max_difference(plain, weights(run)) < TOLERANCE


TREE = {
    "data": {"prompts": ["a red cat", "a blue dog", "a green tree"], "num_prompts_per_step": 2, "group_size": 4},
    "sampler": {
        "name": "tree",
        "num_steps": 3,
        "height": 32,
        "width": 32,
        "guidance_scale": 2.0,
        "kind": "dance",
        "noise_level": 0.7,
        "split_steps": [0, 1],
        "branching": 2,
        "split_noise_scale": 2.0,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "deepspeed_zero2"])
def test_tree_rollouts_train_sharded_as_in_one_process(tmp_path, tiny_pipeline, preset):
    """A tree's leaves own different numbers of its edges (2, 1, 2, 1 here), yet every process (one tree each) runs
    the same backward calls, so FSDP2 / ZeRO-2 train trees as one plain process with both trees does."""
    extra = {"num_steps": STEPS, "checkpoint": {"every_n_steps": 1, "keep_last": 2}, **TREE}
    plain = write_config(tmp_path, tiny_pipeline("sd3"), "one", **extra)
    kit.train(GRPOTrainer(load_config(plain)))
    config = write_config(tmp_path, tiny_pipeline("sd3"), "sharded", **extra)
    launch(preset, config)
    one, run = tmp_path / "runs" / "one", tmp_path / "runs" / "sharded"
    assert json.loads((run / "launch.json").read_text())["sharding"] == preset.split("_")[0]
    norms = [
        [json.loads(line)["train/grad_norm"] for line in (r / "metrics.jsonl").read_text().splitlines()]
        for r in (one, run)
    ]
    assert len(norms[1]) == STEPS and norms[0] == pytest.approx(norms[1], rel=1e-4), norms
    assert max_difference(weights(one), weights(run)) < TOLERANCE
    assert any(float(v.abs().max()) > 0 for k, v in weights(run).items() if "lora_B" in k)
