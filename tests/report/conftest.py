"""Fixtures for evaluation and report tests: a small real run folder (tiny SD3) and a headless Chromium."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def chromium(tmp_path_factory, require_program):
    """A real headless Chromium (Debian's `chromium`, installed by .ci/run); one browser for all the tests."""
    binary = require_program(("chromium", "chromium-browser"), "apt-get install -y chromium")
    pytest.importorskip("websocket", reason="websocket-client is in the test extra")
    from chromium_page import ChromiumPage

    page = ChromiumPage(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield page
    page.close()


@pytest.fixture(scope="session")
def evaluated_run(tiny_model, tmp_path_factory):
    """A small real run folder: tiny SD3, base eval, weights perturbed (stands in for training), eval at step 2.

    jpeg_incompressibility is the training reward and jpeg_compressibility (its exact negative) the gold one,
    so any rise of the first is an equal fall of the second: reward hacking by construction.
    """
    import torch

    from flowrl.registry import REWARDS, SAMPLERS
    from flowrl.training.evaluation import evaluate

    run = tmp_path_factory.mktemp("runs") / "tiny_sd3"
    model = tiny_model("sd3")
    sampler = SAMPLERS.get("ode")(num_steps=2, height=32, width=32, guidance_scale=1.0)
    rewards = {
        name: REWARDS.build(name, device="cpu", dtype=torch.float32)
        for name in ("jpeg_compressibility", "jpeg_incompressibility")
    }
    common = dict(
        prompts=["a red circle", "two blue squares"],
        seeds=[3, 5, 8],
        sampler=sampler,
        train_reward_names=["jpeg_incompressibility"],
        batch_size=4,
    )
    base = evaluate(model, rewards, run / "eval" / "base", step=0, label="base", **common)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.transformer.parameters():
            parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    later = evaluate(model, rewards, run / "eval" / "step_000002", step=2, label="step_000002", **common)
    (run / "checkpoints" / "step_000002").mkdir(parents=True)
    (run / "config.yaml").write_text("model:\n  path: tiny-sd3\nrewards:\n  - name: jpeg_incompressibility\n")
    with open(run / "metrics.jsonl", "w") as f:
        for step in (1, 2):
            f.write(
                json.dumps(
                    {
                        "step": step,
                        "time": float(step),
                        "train/loss": 0.5 / step,
                        "train/kl": 0.001 * step,
                        "reward/jpeg_incompressibility/mean": 1.4 + 0.02 * step,
                        "reward/jpeg_incompressibility/std": 0.1,
                    }
                )
                + "\n"
            )
    return {"run": run, "base": base, "later": later, "model": model, "sampler": sampler, "rewards": rewards, **common}
