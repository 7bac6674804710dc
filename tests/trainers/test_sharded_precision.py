"""Under the sharded presets with bf16 mixed precision (2 gloo processes, tiny SD3, NFT), the trained LoRA, its EMA and
NFT's old adapter stay float32 after a step, and FSDP2 reduces gradients in float32
(docs/models.md#precision-under-sharding)."""

import json
import subprocess
from pathlib import Path

import pytest
from launching import env, launch_command
from test_grpo_processes import write_config
from test_nft_processes import NFT

SCRIPT = Path(__file__).with_name("precision_probe.py")


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "deepspeed_zero2"])
def test_trained_state_stays_float32_under_bf16(tmp_path, tiny_pipeline, preset):
    extra = {**NFT, "num_steps": 1, "checkpoint": {"every_n_steps": 0, "keep_last": 1}}
    extra["model"] = {"path": tiny_pipeline("sd3"), "lora_rank": 4, "mixed_precision": "bf16"}
    extra["eval"] = {"every_n_steps": 0, "num_steps": 1, "seeds": [0], "num_prompts": 1}
    config = write_config(tmp_path, tiny_pipeline("sd3"), "bf16", **extra)
    done = subprocess.run(
        launch_command(preset, SCRIPT, config, tmp_path), env=env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        out = json.loads((tmp_path / f"precision_{rank}.json").read_text())
        assert out["trainable"] == out["ema"] == out["old"] == ["torch.float32"], out
        if preset == "fsdp":
            assert out["policies"] and all(p == ["torch.bfloat16", "torch.float32"] for p in out["policies"]), out
