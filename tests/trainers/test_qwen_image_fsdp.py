"""Qwen-Image under FSDP2 (2 gloo processes): prompts of different padded lengths on the two processes still make one
transformer call per branch on each, so FSDP2's weight all-gathers pair up, and the velocities equal one process's."""

import subprocess
from pathlib import Path

import pytest
import torch
from launching import env, launch_command
from qwen_fsdp_velocity import PROMPTS, inputs

from flowrl.models import load_flow_model

SCRIPT = Path(__file__).with_name("qwen_fsdp_velocity.py")


@pytest.mark.slow
def test_sharded_qwen_image_calls_agree_over_processes_and_match_one_process(tmp_path, tiny_pipeline):
    pipeline = tiny_pipeline("qwen_image")
    model = load_flow_model(pipeline)
    widths = [{-(-int(n) // 64) for n in model.encode(p)["prompt_embeds_mask"].sum(1)} for p in PROMPTS]
    assert len(widths[0]) == 1 and len(widths[1]) == 2  # unsharded: one call on rank 0, two on rank 1
    cmd = launch_command("cpu_2proc", SCRIPT, pipeline, tmp_path)
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    results = [torch.load(tmp_path / f"velocity_{rank}.pt") for rank in (0, 1)]
    # guidance 1: one call; guidance 4: the prompt and the negative prompt, one call each
    assert [r["calls"] for r in results] == [3, 3]
    for rank, result in enumerate(results):
        x, sigma = inputs(model, rank)
        cond = model.encode(PROMPTS[rank], guidance_scale=4.0)
        with torch.no_grad():
            plain, guided = model.velocity(x, sigma, cond, 1.0), model.velocity(x, sigma, cond, 4.0)
        # the masked padding up to the longest prompt over both processes changes no prediction beyond float rounding
        torch.testing.assert_close(result["plain"], plain, rtol=0, atol=1e-5)
        torch.testing.assert_close(result["guided"], guided, rtol=0, atol=1e-5)
