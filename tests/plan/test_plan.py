"""`flowrl plan`: the work of a config's step comes from its own code on the stand-in (equal to a hand count from the
config, and, for a toy config, to the real run's meter), priced and sized from the real architecture."""

from __future__ import annotations

import json

import pytest

from flowrl.cli import main
from flowrl.plan import cost, plan
from flowrl.trainers import build_trainer, load_config
from flowrl.training.loop import metered_step


def test_a_real_config_steps_on_its_stand_in_with_the_counts_its_config_implies():
    work, cfg = plan.step_work("configs/sd3/grpo_pickscore.yaml")
    kw = cfg.sampler.kwargs
    n = cfg.data.num_prompts_per_step * cfg.data.group_size  # 48 x 24, the whole global batch
    cfg_rows = 2 if kw["guidance_scale"] > 1 else 1  # SD3 runs true CFG: both branches in rollout and training
    trained = kw["num_steps"] - 1  # the flow_grpo SDE: every step stochastic but the last
    assert work["work/rollout/forward/policy"] == n * kw["num_steps"] * cfg_rows
    assert work["work/train/forward_grad/policy"] == n * trained * cfg_rows
    assert work["work/train/forward/policy"] == 2 * n * trained * cfg_rows  # + the KL reference (kl_coef > 0)
    assert work["work/train/backward/lora"] == n * trained * cfg_rows
    assert work["work/train/recompute/policy"] == n * trained * cfg_rows  # gradient checkpointing is on
    assert work["work/rollout/decode/images"] == n and work["work/score/reward/pickscore"] == n
    assert work["work/rollout/encode/prompts"] == 2 * cfg.data.num_prompts_per_step  # each prompt and its negative


def test_a_toy_config_plans_with_the_work_its_real_run_counts(tmp_path):
    out = tmp_path / "plan.json"
    fixed = ["data.num_prompts_per_step=2", "data.group_size=4"]
    result = plan.plan("configs/toy/grpo.yaml", gpu="h100", num_gpus=2, overrides=fixed, json_out=out)
    assert json.loads(out.read_text()) == result
    real = load_config("configs/toy/grpo.yaml", [*fixed, f"output_dir={tmp_path}", "logging.trackers=[]"])
    counted = {k: v for k, v in metered_step(build_trainer(real)).items() if k.startswith("work/")}
    assert result["step"]["work"] == counted
    assert result["priced_as_toy"] and result["family"] == "sd3.5-medium"
    for key in (
        "transformer_forward_tflops",
        "params_b",
        "step",
        "step_gpu_seconds",
        "run_gpu_hours",
        "peak_memory_gib",
        "fits",
    ):
        assert key in result
    size = cost.real_size("sd3.5-medium", 512, 512, None, result["size"]["text_tokens"], ("toy_attributes",))
    whole = cost.price(counted, size, "h100", cost.ETA["research"])["seconds"]
    assert result["step_gpu_seconds"]["h100"]["research"] == pytest.approx(whole / 2)  # data parallel over 2 GPUs
    assert result["run_gpu_hours"]["h100"]["research"] == pytest.approx(whole * real.num_steps / 3600)
    assert result["fits"] == {"h100": True} and result["peak_memory_gib"]["total"] < 80


def test_a_plan_that_does_not_fit_says_so_and_what_would(capsys):
    config = "configs/toy/grpo.yaml"
    tight = ["data.num_prompts_per_step=2", "data.group_size=4", "model.use_lora=false", "train.num_minibatches=1"]
    mem = plan.memory_plan(load_config(config, tight), plan.Geometry("sd3.5-large", 512, 512, None, 333), 1, "none")
    assert not mem.use_lora and mem.rows == 8
    from flowrl.plan import memory

    assert not memory.fits(memory.estimate_peak(mem)["total"], 80)
    assert "does not fit 80 GiB" in memory.suggestion(mem, 80)


def test_bad_input_is_one_line(capsys):
    assert main(["plan", "configs/toy/grpo.yaml", "--gpu", "a100"]) == 2
    assert "--gpu 'a100' is not one of h100, h200, b200" in capsys.readouterr().err


def test_every_real_config_states_its_plan_in_its_header():
    import importlib.util
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("plan_headers", root / "scripts" / "plan_headers.py")
    headers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(headers)
    configs = headers.real_configs()
    assert len(configs) >= 20
    line = re.compile(
        r"^# Plan: (\d+)x (H100|H200|B200) \((DDP|FSDP2|ZeRO-2)\): \d+ s/step at eta 0\.11 \(\d+ s at 0\.4\), "
        r"\d+ GPU-hours for \d+ steps; peak \d+ GiB per GPU, (fits|does NOT fit; see flowrl plan for what would) "
        r"\(flowrl plan (\S+) --gpu (h100|h200|b200) --num-gpus (\d+)( --sharding (fsdp|zero2))?\)$"
    )
    for path in configs:
        found = [m for m in map(line.match, path.read_text().splitlines()) if m]
        rel = str(path.relative_to(root))
        assert len(found) == 1, f"{rel}: no `# Plan:` header; run python scripts/plan_headers.py {rel}"
        m = found[0]
        assert m.group(5) == rel and m.group(6) == m.group(2).lower() and m.group(7) == m.group(1), rel
        assert (m.group(9) or "none") == headers.SHARDING[m.group(3)], rel
