"""The scripts that make the shipped weights: quick runs learn, and every shipped file is recorded."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from flowrl.models.toy import load_toy_model
from flowrl.toy.manifest import WEIGHTS_DIR
from flowrl.toy.world import IMPOSSIBLE_KINDS

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pretrain_quick_lowers_the_loss_and_records_the_file(tmp_path):
    entry = load_script("pretrain_toy").main(["--quick", "--steps", "8", "--batch-size", "8", "--out", str(tmp_path)])
    assert entry["eval_loss_after"] < entry["eval_loss_before"] - 0.05, entry
    path = tmp_path / "toy_model.safetensors"
    manifest = json.loads((tmp_path / "manifest.json").read_text())["toy_model.safetensors"]
    assert (
        manifest["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() and manifest["size"] == path.stat().st_size
    )
    assert manifest["seed"] == 0 and "--quick" in manifest["command"]
    model = load_toy_model(checkpoint=path)
    assert model.velocity(model.prepare_latents(1, 32, 32, None), 0.5, model.encode(["one red circle"]), 1.0).shape == (
        1,
        3,
        32,
        32,
    )


def test_judge_quick_run_records_its_accuracy(tmp_path):
    entry = load_script("train_toy_judges").main(
        ["--judge", "artifact", "--quick", "--steps", "3", "--num-eval", "32", "--out", str(tmp_path)]
    )
    assert set(entry["heldout_accuracy"]) == {
        "clean_raw",
        "clean_softened",
        "noise",
        "blocking",
        "stripes",
        "saturation",
        "balanced",
    }
    assert (tmp_path / "toy_artifact.safetensors").is_file()


def test_attribute_judge_quick_run_records_valid_and_impossible_scores(tmp_path):
    entry = load_script("train_toy_judges").main(
        ["--judge", "attributes", "--quick", "--steps", "2", "--num-eval", "20", "--out", str(tmp_path)]
    )
    accuracy = entry["heldout_accuracy"]
    assert set(accuracy) == {"raw", "softened", "faint", "impossible_raw", "impossible_softened", "impossible_faint"}
    kinds = {f"{k}_best_prompt_score" for k in IMPOSSIBLE_KINDS}
    assert set(accuracy["impossible_softened"]) == kinds | {"mean_best_prompt_score"}
    assert set(accuracy["impossible_faint"]) == kinds - {"empty_best_prompt_score"} | {"mean_best_prompt_score"}
    assert entry["impossible_fraction"] == 0.25 and entry["faint_fraction"] == 0.0 and entry["steps"] == 2
    from flowrl.toy.judges import load_judge

    assert load_judge("attributes", tmp_path / "toy_attributes.safetensors").other_class is True
    with pytest.raises(ValueError, match="--impossible-fraction=1.0 must be in"):
        load_script("train_toy_judges").parse_args(["--judge", "attributes", "--impossible-fraction", "1"])
    with pytest.raises(ValueError, match="--faint-fraction=1.5 must be in"):
        load_script("train_toy_judges").parse_args(["--judge", "attributes", "--faint-fraction", "1.5"])


def test_label_noise_redraws_count_and_colour_at_the_given_rates():
    import torch

    from flowrl.toy.world import sample_specs

    noisy_scenes = load_script("pretrain_toy").noisy_scenes
    generator = torch.Generator().manual_seed(0)
    specs = sample_specs(6000, "train", generator)
    assert noisy_scenes(specs, 0.0, 0.0, generator) == specs
    scenes = noisy_scenes(specs, 0.5, 0.25, generator)
    same_count = sum(a.count == b.count for a, b in zip(specs, scenes)) / len(specs)
    same_colour = sum(a.colour == b.colour for a, b in zip(specs, scenes)) / len(specs)
    # by hand: a redraw keeps the value with probability 1/3 (counts) or 1/4 (colours)
    assert abs(same_count - (1 - 0.5 * 2 / 3)) < 0.03 and abs(same_colour - (1 - 0.25 * 3 / 4)) < 0.03
    assert all(a.shape == b.shape for a, b in zip(specs, scenes))


def test_bad_script_arguments():
    with pytest.raises(ValueError, match="--ema-decay=1.5 must be in"):
        load_script("pretrain_toy").parse_args(["--ema-decay", "1.5"])
    with pytest.raises(ValueError, match="--count-noise=2.0 must be a probability"):
        load_script("pretrain_toy").parse_args(["--count-noise", "2"])


def test_every_shipped_weight_file_is_small_and_recorded():
    manifest = json.loads((WEIGHTS_DIR / "manifest.json").read_text())
    assert set(manifest) == {"toy_model.safetensors", "toy_attributes.safetensors", "toy_artifact.safetensors"}
    assert {p.name for p in WEIGHTS_DIR.glob("*.safetensors")} == set(manifest)
    total = 0
    for name, entry in manifest.items():
        data = (WEIGHTS_DIR / name).read_bytes()
        assert len(data) == entry["size"] < 8 * 2**20 and hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert entry["command"].startswith("python scripts/") and isinstance(entry["seed"], int)
        total += len(data)
    assert total < 12 * 2**20
