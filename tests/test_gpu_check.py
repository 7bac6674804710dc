"""scripts/gpu_check.py: every section passes at tiny size on the CPU, and the real-size parts it builds on a GPU
(architectures, the loader stand-in, PickScore's ViT-H-14) build on the meta device with the published sizes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("sd3_loader", "sd3_grpo", "sd3_resume", "prompt_cache", "flux_step", "wan_step", "wan22_step", "preview_speed")


@pytest.fixture
def scripts_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))


@pytest.mark.slow
def test_tiny_run_passes_every_section(tmp_path):
    out = tmp_path / "gpu_check"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = {name: json.loads((out / f"{name}.json").read_text()) for name in SECTIONS}
    for name, result in results.items():
        assert result["ok"], (name, result.get("error"), result.get("traceback_tail"))
    steps = results["sd3_grpo"]["steps"]
    assert len(steps) == 2
    for step in steps:
        assert step["first_pass_transitions"] > 0
        assert step["first_pass_ratio_min"] == 1.0 and step["first_pass_ratio_max"] == 1.0
    assert results["sd3_resume"]["bitwise_equal"] and results["sd3_resume"]["max_abs_difference"] == 0.0
    assert results["sd3_resume"]["step_after_resume"] == 2
    for name in ("flux_step", "wan_step", "wan22_step"):
        assert results[name]["step"]["first_pass_ratio_exactly_1"], name
    for name in ("sd3_loader", "flux_step", "wan_step"):  # the real architectures, counted on meta
        assert results[name]["real_size_on_meta"]["transformer_matches_costs_md"], name
    assert results["sd3_loader"]["lora_all_float32"] and results["sd3_loader"]["gradient_checkpointing"]
    assert results["prompt_cache"]["bytes_per_prompt"] > 0
    assert "fake_fp8" in results["preview_speed"]["ran"]
    assert "error" in results["preview_speed"]["formats"]["fp8"]  # real FP8 needs an sm_89+ GPU: said, not hidden
    summary = json.loads((out / "summary.json").read_text())
    assert summary["all_ok"] and list(summary["sections"]) == list(SECTIONS)


def test_a_failing_section_is_recorded_and_the_rest_run(tmp_path):
    """sd3_resume without sd3_grpo's checkpoint fails with one line; the run goes on and exits 1."""
    out = tmp_path / "gpu_check"
    command = [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--tiny", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(
        [*command, "--sections", "sd3_resume,wan22_step"],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    resume = json.loads((out / "sd3_resume.json").read_text())
    assert not resume["ok"] and resume["error"].startswith("RuntimeError: needs section sd3_grpo")
    assert json.loads((out / "wan22_step.json").read_text())["ok"]
    assert not json.loads((out / "summary.json").read_text())["all_ok"]


def test_real_size_sd3_goes_through_the_loader_on_meta(tmp_path, scripts_on_path):
    """Section 1's real-size path without memory: the random SD3.5-M pipeline (full text encoders) through
    build_policy on the meta device: fp16 frozen weights, float32 LoRA, gradient checkpointing."""
    import _gpu_archs as archs
    import _gpu_sections as sections

    from flowrl.registry import REWARDS

    meta = torch.device("meta")
    restore = archs.install_factories(meta, tmp_path / "built")
    try:
        result = sections.sd3_loader(sections.Context(False, meta, tmp_path))
        reward = REWARDS.get("pickscore")(device="meta", **sections.pickscore(sections.Context(False, meta, tmp_path)))
    finally:
        restore()
    assert result["ok"], result
    assert result["frozen_transformer_dtypes"] == ["torch.float16"]
    params = result["real_size_on_meta"]["params_B"]
    assert params["text_encoder_3"] == pytest.approx(4.76, abs=0.01)  # T5-XXL encoder
    assert params["text_encoder_2"] == pytest.approx(0.69, abs=0.01)  # CLIP-G
    assert sum(p.numel() for p in reward.model.parameters()) / 1e9 == pytest.approx(0.99, abs=0.01)  # ViT-H-14


@pytest.mark.parametrize("family", ["sd3", "flux", "wan"])
def test_real_architectures_match_the_cost_tables(tmp_path, scripts_on_path, family):
    import _gpu_archs as archs

    counts = archs.count_params(family, tmp_path)
    assert counts["transformer_matches_costs_md"], counts
