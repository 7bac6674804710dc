"""RAM and adjoint matching as real processes: 2 gloo processes (accelerate launch) give the weights of 1 plain
process. Toy model, one prompt group of 4 spanning both processes: a sample's rollout, training times and noises
come from its own seed, the adjoint's loss times from the step's own generator, so the runs agree only if nothing
depends on which process holds a sample."""

import json

import pytest
import yaml
from launching import launch
from test_nft_processes import grad_norms, max_difference, tensors

import flowrl.trainers.kit as kit
from flowrl.trainers import build_trainer, load_config

STEPS = 2
TOLERANCE = 2e-5  # batch-size-dependent float32 numerics only: RAM measured 1.02e-5 with one OpenMP thread per
# process (make test's setting; 2 threads gave < 1e-5), against LoRA weights of 1e-3..0.5 and updates of 3e-3
ADAM_EPSILON = 1e-6  # Adam divides by sqrt(v) + ε: near-zero gradients (LoRA A behind a small B) must not turn
# float32 reduction-order noise into lr-sized updates, which with ε = 1e-8 they do (measured: 1.2e-4 on RAM's weights)
BASE = {
    "device": "cpu",
    "num_steps": STEPS,
    "seed": 11,
    "model": {"path": "toy", "lora_rank": 4},
    "data": {
        "prompts": ["two red circles", "one blue square", "three green triangles"],
        "num_prompts_per_step": 1,
        "group_size": 4,
    },
    "rewards": [{"name": "toy_attributes"}],
    "checkpoint": {"every_n_steps": 0, "keep_last": 1},
    "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
    "logging": {"trackers": [], "progress_bar": False},
}
RECIPES = {
    "ram": {
        "trainer": "ram",
        "sampler": {"name": "ode", "num_steps": 3, "guidance_scale": 1.0},
        "balancer": {"name": "weighted_sum", "std": "none"},
        "train": {
            "learning_rate": 3e-3,
            "adam_epsilon": ADAM_EPSILON,
            "reward_multiplier": 10.0,
            "num_loss_targets_per_sample": 2,
            "use_async_rewards": False,
        },
    },
    "adjoint_matching": {
        "trainer": "adjoint_matching",
        "sampler": {
            "name": "sde",
            "kind": "flow_grpo",
            "noise_level": 2**0.5,
            "sigma_schedule": "dance",
            "sigma_shift": 1.0,
            "sigma_max": 0.9,
            "num_steps": 3,
            "guidance_scale": 1.0,
        },
        "train": {
            "learning_rate": 3e-3,
            "adam_epsilon": ADAM_EPSILON,
            "reward_multiplier": 30.0,
            "num_random_loss_times": 1,
        },
    },
}
FILES = {
    "ram": ("trainable.safetensors", "ema.safetensors", "adapter_old.safetensors"),
    "adjoint_matching": ("trainable.safetensors", "ema.safetensors"),
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["ram", "adjoint_matching"])
def test_two_gloo_processes_match_one_process(tmp_path, recipe):
    data = {
        **BASE,
        **RECIPES[recipe],
        "output_dir": str(tmp_path / "runs"),
        "checkpoint": {"every_n_steps": 0, "keep_last": 1},
    }
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump({**data, "name": "one"}))
    kit.train(build_trainer(load_config(one)))
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({**data, "name": "two"}))
    launch("cpu_2proc", two)
    runs = tmp_path / "runs"
    assert json.loads((runs / "two" / "launch.json").read_text())["num_processes"] == 2
    norms = grad_norms(runs / "one"), grad_norms(runs / "two")
    assert len(norms[0]) == STEPS and min(norms[0]) > 0 and norms[0] == pytest.approx(norms[1], rel=1e-4), norms
    for file in FILES[recipe]:
        assert max_difference(tensors(runs / "one", file), tensors(runs / "two", file)) < TOLERANCE, file
