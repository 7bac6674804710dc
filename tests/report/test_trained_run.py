"""A run folder written by the GRPO trainer: `flowrl report` reads it, and `flowrl eval` of a checkpoint
reproduces the trainer's own evaluation of that step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from PIL import Image

from flowrl.cli import main


def test_trainer_run_folder_report_and_eval(tiny_pipeline, tmp_path, capsys):
    import flowrl.trainers.kit as kit
    from flowrl.trainers import build_config
    from flowrl.trainers.grpo import GRPOTrainer

    data = {
        "name": "trained",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 2,
        "seed": 3,
        "model": {"path": tiny_pipeline("sd3"), "lora_rank": 4},
        "data": {"prompts": ["a red cat", "a blue dog"], "num_prompts_per_step": 2, "group_size": 2},
        "sampler": {
            "name": "sde",
            "num_steps": 2,
            "height": 32,
            "width": 32,
            "guidance_scale": 2.0,
            "noise_level": 0.7,
        },
        "rewards": [{"name": "jpeg_compressibility"}],
        "train": {"learning_rate": 0.05, "clip_range": 1e-3, "use_async_rewards": False},
        "logging": {"trackers": [], "progress_bar": False},
        "eval": {
            "num_steps": 2,
            "seeds": [0, 1],
            "every_n_steps": 1,
            "use_ema": False,
            "gold_rewards": [{"name": "jpeg_incompressibility"}],
        },
        "checkpoint": {"every_n_steps": 1, "keep_last": 5},
    }
    kit.train(GRPOTrainer(build_config(data)))
    run = tmp_path / "runs" / "trained"
    capsys.readouterr()  # drop what training printed (e.g. DeepSpeed's one-time accelerator notice on first import)
    assert main(["report", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "report" / "index.html")
    page = (run / "report" / "index.html").read_text()
    assert "None: every file the report looks for is present." in page  # the trainer's layout has no gaps
    assert (run / "report" / "grid_000002.png").is_file()
    trained = json.loads((run / "eval" / "step_000002" / "scores.json").read_text())
    for reward, value in trained["means"].items():
        assert (
            f'data-step="step_000002" data-reward="{reward}" data-prompt="all" data-kind="overview">{value:.3g}<'
            in page
        )

    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    out = tmp_path / "re_eval"
    assert (
        main(
            [
                "eval",
                "--config",
                str(tmp_path / "config.yaml"),
                "--checkpoint",
                str(run / "checkpoints" / "step_000002"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    again = json.loads((out / "scores.json").read_text())
    assert again["step"] == 2 and again["rewards"] == trained["rewards"]
    for reward, value in trained["means"].items():
        assert again["means"][reward] == pytest.approx(value, abs=0.02)
    changed = []
    for new, old in zip(again["samples"], trained["samples"], strict=True):
        a = np.asarray(Image.open(out / new["image"]), dtype=np.int16)
        b = np.asarray(Image.open(run / "eval" / "step_000002" / old["image"]), dtype=np.int16)
        assert np.abs(a - b).max() <= 1
        base = np.asarray(Image.open(run / "eval" / "base" / old["image"]), dtype=np.int16)
        changed.append(np.abs(b - base).max())
    assert max(changed) > 1, "training changed nothing: the reproduction check would be vacuous"
