"""The scripts that make the shipped weights: quick runs learn, and every shipped file is recorded."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

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


def test_pretrain_quick_geneval_grammar_records_the_second_model_and_its_accuracy(tmp_path):
    argv = ["--quick", "--grammar", "geneval", "--steps", "4", "--batch-size", "8", "--out", str(tmp_path)]
    entry = load_script("pretrain_toy").main(argv)
    assert not (tmp_path / "toy_model.safetensors").exists()  # the shipped model's file is never written
    path = tmp_path / "toy_geneval_model.safetensors"
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest) == {"toy_geneval_model.safetensors"} and manifest[path.name] == entry
    assert entry["size"] == path.stat().st_size and entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert entry["grammar"] == "geneval" and (entry["swap_noise"], entry["relation_noise"]) == (0.3, 0.4)
    assert entry["eval_loss_after"] < entry["eval_loss_before"]
    assert (entry["num_measure_seeds"], entry["num_measure_steps"]) == (1, 2)
    for key in ("geneval_heldout", "two_object_heldout", "position_heldout", "heldout"):
        assert 0.0 <= entry[f"{key}_exact_accuracy"] <= 1.0
    # 24 two-object and 96 position held-out prompts: the overall accuracy is their weighted mean
    mean = (24 * entry["two_object_heldout_exact_accuracy"] + 96 * entry["position_heldout_exact_accuracy"]) / 120
    assert abs(entry["geneval_heldout_exact_accuracy"] - mean) < 1e-3
    model = load_toy_model(checkpoint=path, grammar="geneval")
    cond = model.encode(["a red circle above a blue square"])
    assert model.velocity(model.prepare_latents(1, 32, 32, None), 0.5, cond, 1.0).shape == (1, 3, 32, 32)
    again = load_script("pretrain_toy").main(["--measure-only", str(path), "--quick"])
    assert again == {k: entry[k] for k in again}  # re-measuring a file gives the recorded numbers


def test_pair_noise_swaps_colours_and_redraws_relations_at_the_given_rates():
    from flowrl.toy.world import RELATIONS, sample_specs

    noisy_pairs = load_script("pretrain_toy").noisy_pairs
    generator = torch.Generator().manual_seed(0)
    specs = sample_specs(6000, "position_train", generator)
    assert noisy_pairs(specs, 0.0, 0.0, generator) == specs
    scenes = noisy_pairs(specs, 0.3, 0.4, generator)
    for a, b in zip(specs, scenes):  # shapes stay; colours stay or trade places
        assert (b.first[1], b.second[1]) == (a.first[1], a.second[1])
        assert (b.first[0], b.second[0]) in ((a.first[0], a.second[0]), (a.second[0], a.first[0]))
    # by hand: a swap changes a scene only when its two colours differ
    changed = sum((a.first, a.second) != (b.first, b.second) for a, b in zip(specs, scenes)) / len(specs)
    distinct = sum(a.first[0] != a.second[0] for a in specs) / len(specs)
    assert abs(changed - 0.3 * distinct) < 0.03
    same_relation = sum(a.relation == b.relation for a, b in zip(specs, scenes)) / len(specs)
    assert abs(same_relation - (1 - 0.4 * (len(RELATIONS) - 1) / len(RELATIONS))) < 0.03  # a redraw keeps it 1/4
    two = sample_specs(100, "two_object_train", generator)
    assert all(b.relation is None for b in noisy_pairs(two, 0.3, 1.0, generator))


def test_bad_script_arguments():
    with pytest.raises(ValueError, match="--ema-decay=1.5 must be in"):
        load_script("pretrain_toy").parse_args(["--ema-decay", "1.5"])
    with pytest.raises(ValueError, match="--count-noise=2.0 must be a probability"):
        load_script("pretrain_toy").parse_args(["--count-noise", "2"])
    with pytest.raises(ValueError, match="--swap-noise=-0.1 must be a probability"):
        load_script("pretrain_toy").parse_args(["--grammar", "geneval", "--swap-noise", "-0.1"])


def test_every_shipped_weight_file_is_small_and_recorded():
    manifest = json.loads((WEIGHTS_DIR / "manifest.json").read_text())
    assert set(manifest) == {
        "toy_model.safetensors",
        "toy_geneval_model.safetensors",
        "toy_attributes.safetensors",
        "toy_artifact.safetensors",
    }
    assert {p.name for p in WEIGHTS_DIR.glob("*.safetensors")} == set(manifest)
    total = 0
    for name, entry in manifest.items():
        data = (WEIGHTS_DIR / name).read_bytes()
        assert len(data) == entry["size"] < 8 * 2**20 and hashlib.sha256(data).hexdigest() == entry["sha256"]
        assert entry["command"].startswith("python scripts/") and isinstance(entry["seed"], int)
        total += len(data)
    assert total < 12 * 2**20
    geneval = manifest["toy_geneval_model.safetensors"]
    assert geneval["grammar"] == "geneval" and "--grammar geneval" in geneval["command"]
    assert 0.0 <= geneval["geneval_heldout_exact_accuracy"] <= 1.0
