"""`flowrl bench rollout` (flowrl/bench/rollout.py) at tiny settings: its JSON shape, ratios computed from the recorded
times, every tiny family covered by a call spec, and its one-line errors. Speed is measured, never asserted."""

import json
import re
import statistics

import pytest
import torch

from flowrl import cli
from flowrl.bench.rollout import SPECS, bench_rollout
from flowrl.models.tiny import BUILDERS

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

SIDES = ("pipeline", "ode", "sde", "sde_cold")
ENTRY_KEYS = {"settings", "target_met", "rounds_s", "rounds_cpu_s"} | {f"{side}_s" for side in SIDES}
ENTRY_KEYS |= {f"{cpu}{side}_over_pipeline" for side in SIDES[1:] for cpu in ("", "cpu_")}


def check_ratios(entry: dict, repeats: int) -> None:
    """Medians and ratios follow from the recorded rounds (rounded to 5 decimals in the JSON): a ratio is the median
    over rounds of that round's side / pipeline seconds."""
    for rounds in (entry["rounds_s"], entry["rounds_cpu_s"]):
        assert set(rounds) == set(SIDES) and all(len(ts) == repeats and min(ts) > 0 for ts in rounds.values())
    for side in SIDES:
        assert entry[f"{side}_s"] == pytest.approx(statistics.median(entry["rounds_s"][side]), abs=2e-5)
    for prefix, rounds in (("", entry["rounds_s"]), ("cpu_", entry["rounds_cpu_s"])):
        for side in SIDES[1:]:
            expected = statistics.median(a / b for a, b in zip(rounds[side], rounds["pipeline"]))
            assert entry[f"{prefix}{side}_over_pipeline"] == pytest.approx(expected, rel=2e-3, abs=2e-3)
    ratio = statistics.median(a / b for a, b in zip(entry["rounds_s"]["sde"], entry["rounds_s"]["pipeline"]))
    assert entry["target_met"] == (ratio <= 1.10) or abs(ratio - 1.10) < 1e-3  # (rounding at the boundary)


def test_cli_writes_one_entry_per_family_with_its_settings(tmp_path, capsys):
    out = tmp_path / "rollout.json"
    argv = ["bench", "rollout", "--json", str(out), "--repeats", "2", "--families", "sd3, wan", "--num-steps", "2"]
    assert cli.main([*argv, "--batch-size", "2"]) == 0
    result = json.loads(out.read_text())
    assert capsys.readouterr().out.endswith(json.dumps(result, indent=2) + "\n")
    assert set(result) == {"settings", "sd3", "wan"}
    assert result["settings"]["families"] == ["sd3", "wan"] and result["settings"]["repeats"] == 2
    for family, pipeline, size in (
        ("sd3", "StableDiffusion3Pipeline", (64, 64, None)),
        ("wan", "WanPipeline", (32, 32, 5)),
    ):
        entry = result[family]
        assert set(entry) == ENTRY_KEYS
        settings = entry["settings"]
        assert (
            settings["pipeline"] == pipeline and (settings["height"], settings["width"], settings["num_frames"]) == size
        )
        assert settings["num_steps"] == 2 and settings["batch_size"] == 2 and settings["source_image"] is None
        assert settings["cfg_branches"] == 2 and settings["guidance_arg"] == "guidance_scale"
        check_ratios(entry, repeats=2)
    assert result["sd3"]["settings"]["guidance_scale"] == 4.5 and result["wan"]["settings"]["guidance_scale"] == 5.0


def test_a_source_image_family_runs_at_its_pipelines_batch_and_restores_the_edit_area():
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    before = (edit.calculate_dimensions, plus.VAE_IMAGE_SIZE)
    result = bench_rollout(repeats=1, num_steps=2, batch_size=2, families=("qwen_image_edit_plus",))
    assert (edit.calculate_dimensions, plus.VAE_IMAGE_SIZE) == before
    entry = result["qwen_image_edit_plus"]
    settings = entry["settings"]
    assert settings["batch_size"] == 1  # QwenImageEditPlusPipeline makes one sample per call; every side runs at 1
    assert settings["source_image"] == "shared" and settings["guidance_arg"] == "true_cfg_scale"
    assert {"image", "negative_prompt", "true_cfg_scale"} <= set(settings["pipeline_kwargs"])
    assert settings["cfg_branches"] == 2 and settings["num_steps"] == 2
    check_ratios(entry, repeats=1)


def test_every_tiny_family_has_a_call_spec():
    assert set(SPECS) == set(BUILDERS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--families", "sd3,sd4"], r"--families 'sd3,sd4': unknown \['sd4'\]; choose from sd3, flux, sana, wan"),
        (["--repeats", "0"], r"--repeats '0' must be a whole number >= 1"),
        (["--batch-size", "two"], r"--batch-size 'two' must be a whole number >= 1"),
    ],
)
def test_bad_arguments_are_one_line_errors(tmp_path, capsys, argv, message):
    assert cli.main(["bench", "rollout", "--json", str(tmp_path / "x.json"), *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowrl bench: error: ")
    assert re.search(message, lines[0]), lines[0]


def test_clear_prompt_cache_makes_the_next_encode_run_the_text_encoders(tiny_model):
    """What the sde_cold side relies on: a cleared cache encodes again, to the same numbers."""
    model = tiny_model("sd3")
    calls = []
    original = model.pipe.encode_prompt
    model.pipe.encode_prompt = lambda *a, **k: calls.append(k["prompt"]) or original(*a, **k)
    first = model.encode(["a red cat"])
    model.encode(["a red cat"])
    assert len(calls) == 1
    model.clear_prompt_cache()
    again = model.encode(["a red cat"])
    assert len(calls) == 2
    for key, value in first.items():
        assert torch.equal(value, again[key]), key
