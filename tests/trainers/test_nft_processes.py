"""DiffusionNFT as real processes: 2 gloo processes equal 1 (accelerate launch), and the FSDP2 and DeepSpeed ZeRO-2
presets give the plain run's weights — the trained adapter, its EMA and the sampling policy's adapter — with
checkpoints that resume in one plain process to the same weights."""

import json
import shutil

import pytest
from launching import launch, one_and_two_processes
from safetensors.torch import load_file
from test_grpo_processes import write_config

import flowrl.trainers.kit as kit
from flowrl.trainers import build_trainer, load_config

STEPS = 2
TOLERANCE = 1e-5  # batch-size-dependent float32 numerics only (the GRPO process tests' tolerance)
NFT = {
    "trainer": "nft",
    "sampler": {"name": "ode", "num_steps": 3, "height": 32, "width": 32, "guidance_scale": 1.0},
    "train": {
        "learning_rate": 3e-3,
        "kl_coef": 0.01,
        "timestep_fraction": 0.67,  # 2 of the 3 grid times
        "decay_type": 0,  # θ_old = θ after every step: the old adapter moves as much as the trained one
        "ema_every_n_steps": 1,
        "use_async_rewards": False,
    },
    "num_steps": STEPS,
}
FILES = ("trainable.safetensors", "ema.safetensors", "adapter_old.safetensors")


def tensors(run_dir, file, step=STEPS):
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / file))


def max_difference(a, b):
    assert a.keys() == b.keys() and len(a) > 0
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def grad_norms(run_dir):
    return [json.loads(line)["train/grad_norm"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory, tiny_pipeline):
    tmp = tmp_path_factory.mktemp("nft_plain")
    extra = {**NFT, "checkpoint": {"every_n_steps": 1, "keep_last": 2}}
    config = write_config(tmp, tiny_pipeline("sd3"), "one", **extra)
    kit.train(build_trainer(load_config(config)))
    return tmp / "runs" / "one", tiny_pipeline("sd3"), extra


@pytest.mark.slow
def test_two_gloo_processes_match_one_process(tmp_path, tiny_pipeline):
    """One prompt group of 4 spans both processes; a sample's training times and noises come from its own seed, so
    the runs agree only if nothing depends on which process holds a sample."""
    extra = {
        **NFT,
        "checkpoint": {"every_n_steps": 0, "keep_last": 1},
        "data": {"prompts": ["a red cat", "a blue dog", "a green tree"], "num_prompts_per_step": 1, "group_size": 4},
    }
    one = write_config(tmp_path, tiny_pipeline("sd3"), "one", **extra)
    runs, _ = one_and_two_processes(tmp_path, one)
    norms = grad_norms(runs / "one"), grad_norms(runs / "two")
    assert len(norms[0]) == STEPS and min(norms[0]) > 0 and norms[0] == pytest.approx(norms[1], rel=1e-4), norms
    for file in FILES:
        assert max_difference(tensors(runs / "one", file), tensors(runs / "two", file)) < TOLERANCE, file
    assert any(float(v.abs().max()) > 0 for k, v in tensors(runs / "two", FILES[2]).items() if "lora_B" in k)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "deepspeed_zero2"])
def test_sharded_preset_matches_one_process_and_resumes_plain(tmp_path, plain_run, preset):
    one, pipeline, extra = plain_run
    config = write_config(tmp_path, pipeline, "sharded", **extra)
    launch(preset, config)
    run = tmp_path / "runs" / "sharded"
    assert json.loads((run / "launch.json").read_text())["sharding"] == preset.split("_")[0]
    assert grad_norms(one) == pytest.approx(grad_norms(run), rel=1e-4)
    for file in FILES:
        assert max_difference(tensors(one, file), tensors(run, file)) < TOLERANCE, file
    # resume the sharded run's step-1 checkpoint in one plain process: step 2 matches again
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:06d}")
    kit.train(build_trainer(load_config(config, ["checkpoint.resume=latest"])))
    for file in FILES:
        assert max_difference(tensors(one, file), tensors(run, file)) < TOLERANCE, file
