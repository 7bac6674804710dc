"""Loading for FSDP2 (flowrl.models.placement): no process moves the whole transformer or a text encoder to its device
before FSDP2 shards the transformer, and training still matches one plain process (tiny FLUX.2 [dev], 2 gloo
processes)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from launching import env, launch_command
from safetensors.torch import load_file
from test_grpo_processes import write_config

import flowrl.trainers.kit as kit
from flowrl.models import load_flow_model
from flowrl.models.placement import on_device
from flowrl.trainers import load_config
from flowrl.trainers.grpo import GRPOTrainer

SCRIPT = Path(__file__).with_name("sharded_loading.py")
STEPS = 2
TOLERANCE = 1e-5  # the sharded-preset tests' tolerance (test_grpo_sharded.py)
FILE = "trainable.safetensors"


def devices(module) -> set[str]:
    return {p.device.type for p in module.parameters()}


def test_a_sharded_load_keeps_the_transformer_and_text_encoder_on_the_cpu(tiny_pipeline):
    """`meta` stands in for the GPU: the rest of the pipeline goes there, the two large parts stay on the CPU."""
    model = load_flow_model(tiny_pipeline("flux2_dev"), device="meta", sharded=True)
    assert devices(model.transformer) == {"cpu"} and devices(model.pipe.text_encoder) == {"cpu"}
    assert devices(model.pipe.vae) == {"meta"} and model.offloaded == (model.pipe.text_encoder,)


def test_on_device_moves_for_the_block_and_copies_nothing_back():
    linear = torch.nn.Linear(3, 2)
    storage = linear.weight.data_ptr()
    with on_device([linear], "meta"):
        assert devices(linear) == {"meta"}
    assert devices(linear) == {"cpu"} and linear.weight.data_ptr() == storage  # its own storage, not a copy


@pytest.mark.slow
def test_fsdp2_shards_before_anything_large_reaches_the_device_and_trains_as_one_process(tmp_path, tiny_pipeline):
    pipeline = tiny_pipeline("flux2_dev")
    extra = {
        "num_steps": STEPS,
        "rewards": [{"name": "redness.RednessReward"}],  # smooth: jpeg_compressibility turns float rounding into steps
        "checkpoint": {"every_n_steps": 1, "keep_last": 1},
        "eval": {"every_n_steps": 0, "num_steps": 2, "seeds": [0], "num_prompts": 1},
    }
    plain = write_config(tmp_path, pipeline, "one", **extra)
    kit.train(GRPOTrainer(load_config(plain)))
    config = write_config(tmp_path, pipeline, "sharded", **extra)
    cmd = launch_command("fsdp", SCRIPT, config, tmp_path)
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"placement_{rank}.json").read_text())
        target = torch.device(out["device"]).type
        shard = [i for i, e in enumerate(out["events"]) if e["event"] == "shard"]
        assert len(shard) == 1, out["events"]
        # nothing moved the whole transformer to the process's device before FSDP2 sharded it ...
        early = [
            e
            for e in out["events"][: shard[0]]
            if e["module"] == "transformer" and torch.device(e["device"]).type == target
        ]
        assert early == [], early
        # ... and no text encoder ever moved as a whole: it stays on the CPU, copied in only while it encodes
        assert not [e for e in out["events"] if e["module"] == "text_encoder"], out["events"]
        assert out["text_encoder_devices"] == ["cpu"] and out["offloaded"] == ["Mistral3ForConditionalGeneration"]
        # every process holds its shard of the transformer: about half (the tiny tensors' shards are padded)
        assert out["transformer_sharded"] and out["transformer_local"] < 0.75 * out["transformer_whole"], out
    one, run = (
        load_file(str(tmp_path / "runs" / n / "checkpoints" / f"step_{STEPS:06d}" / FILE)) for n in ("one", "sharded")
    )
    assert one.keys() == run.keys() and len(one) > 0
    assert max(float((one[k] - run[k]).abs().max()) for k in one) < TOLERANCE
    assert any(float(v.abs().max()) > 0 for k, v in run.items() if "lora_B" in k)
