"""Bad input to `flowrl sample`, `flowrl score` and `flowrl eval` is one stderr line `flowrl <cmd>: error: ...` and
exit 2.

Every case writes the real bad file (a truncated safetensors, a text file named .png, a broken JSON) into tmp_path.
"""

import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from flowrl.cli import main
from flowrl.models.lora import WEIGHT_NAME
from flowrl.training.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[1]
TOY_CONFIG = str(REPO / "configs" / "toy" / "grpo.yaml")


def one_line_error(argv: list[str], capsys) -> str:
    """Run the CLI, check exit code 2 and a single `flowrl <cmd>: error:` line on stderr; return that line."""
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"flowrl {argv[0]}: error: "), lines[0]
    return lines[0]


def write_truncated_safetensors(path: Path) -> Path:
    save_file({"weight": torch.arange(64, dtype=torch.float32)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


# ---- flowrl sample ------------------------------------------------------------------------------------------


def sample_argv(tmp_path: Path, *extra: str, prompt: str = "two red circles") -> list[str]:
    return ["sample", "--model", "toy", "--prompt", prompt, "--num-steps", "1", "--out", str(tmp_path / "out"), *extra]


@pytest.mark.parametrize("prompt", ["", "   "])
def test_sample_toy_refuses_a_blank_prompt_like_any_prompt_outside_the_grammar(tmp_path, capsys, prompt):
    err = one_line_error(sample_argv(tmp_path, prompt=prompt), capsys)
    assert f"prompt {prompt!r} is outside the Shapes grammar" in err and "e.g. 'two red circles'" in err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_sample_toy_refuses_a_prompt_outside_the_grammar(tmp_path, capsys):
    err = one_line_error(sample_argv(tmp_path, prompt="four red circles"), capsys)
    assert "prompt 'four red circles' is outside the Shapes grammar" in err


def test_sample_without_prompts_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["sample", "--model", "toy", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "--prompt" in capsys.readouterr().err


def test_sample_missing_model_folder(tmp_path, capsys):
    missing = tmp_path / "no_such_model"
    err = one_line_error(sample_argv(tmp_path) + ["--model", str(missing)], capsys)
    assert str(missing) in err and "neither an existing folder nor a hub id" in err


def test_sample_model_folder_that_is_not_a_pipeline(tmp_path, capsys):
    folder = tmp_path / "not_a_pipeline"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    err = one_line_error(sample_argv(tmp_path) + ["--model", str(folder)], capsys)
    assert str(folder) in err and "model_index.json" in err


def test_sample_lora_path_that_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "no_lora"
    err = one_line_error(sample_argv(tmp_path, "--lora", str(missing)), capsys)
    assert f"--lora {str(missing)!r} does not exist" in err and "save_lora" in err


def test_sample_lora_folder_without_weights(tmp_path, capsys):
    folder = tmp_path / "lora"
    folder.mkdir()
    (folder / "README.md").write_text("no weights here\n")
    err = one_line_error(sample_argv(tmp_path, "--lora", str(folder)), capsys)
    assert f"--lora folder {str(folder)!r} holds no {WEIGHT_NAME}" in err


def test_sample_lora_file_truncated(tmp_path, capsys):
    folder = tmp_path / "lora"
    folder.mkdir()
    file = write_truncated_safetensors(folder / WEIGHT_NAME)
    err = one_line_error(sample_argv(tmp_path, "--lora", str(folder)), capsys)
    assert f"--lora file {str(file)!r} is not a readable .safetensors file" in err


def test_sample_lora_file_without_adapter_config(tmp_path, capsys):
    file = tmp_path / "adapter.safetensors"
    save_file({"transformer.x.lora_A.weight": torch.zeros(2, 2)}, str(file))
    err = one_line_error(sample_argv(tmp_path, "--lora", str(file)), capsys)
    assert str(file) in err and "no adapter config in its metadata" in err


@pytest.mark.parametrize("num", ["0", "-2"])
def test_sample_num_images_per_prompt_must_be_positive(tmp_path, capsys, num):
    err = one_line_error(sample_argv(tmp_path, "--num-images-per-prompt", num), capsys)
    assert f"--num-images-per-prompt={num} must be >= 1" in err


@pytest.mark.parametrize("field,value", [("--height", "30"), ("--width", "12"), ("--height", "-8")])
def test_sample_size_not_a_multiple_the_toy_model_needs(tmp_path, capsys, field, value):
    err = one_line_error(sample_argv(tmp_path, field, value), capsys)
    assert f"{field[2:]}={value}" in err and "multiples of 8" in err


def test_sample_out_that_is_a_file(tmp_path, capsys):
    file = tmp_path / "taken.png"
    file.write_bytes(b"x")
    err = one_line_error(sample_argv(tmp_path) + ["--out", str(file)], capsys)
    assert f"--out {str(file)!r} is a file" in err


# ---- flowrl score -------------------------------------------------------------------------------------------


def score_argv(*files: str, reward: str = "toy_artifact", sets: tuple[str, ...] = ()) -> list[str]:
    extra = [x for pair in sets for x in ("--set", pair)]
    return ["score", "--reward", reward, *extra, "--prompt", "two red circles", *files]


@pytest.fixture
def good_png(tmp_path) -> str:
    path = tmp_path / "good.png"
    Image.new("RGB", (32, 32), (200, 30, 30)).save(path)
    return str(path)


def test_score_image_file_that_does_not_exist(tmp_path, capsys):
    missing = str(tmp_path / "missing.png")
    err = one_line_error(score_argv(missing), capsys)
    assert f"image file {missing!r} does not exist" in err


def test_score_file_that_is_not_an_image(tmp_path, good_png, capsys):
    text = tmp_path / "notes.png"
    text.write_text("this is text, not a PNG\n")
    err = one_line_error(score_argv(good_png, str(text)), capsys)
    assert f"image file {str(text)!r} is not a readable image" in err


def test_score_truncated_png(tmp_path, capsys):
    path = tmp_path / "cut.png"
    Image.effect_noise((64, 64), 64).convert("RGB").save(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    err = one_line_error(score_argv(str(path)), capsys)
    assert f"image file {str(path)!r} is not a readable image" in err


def test_score_folder_for_an_image_reward(tmp_path, good_png, capsys):
    folder = tmp_path / "frames"
    folder.mkdir()
    Image.open(good_png).save(folder / "000.png")
    err = one_line_error(score_argv(str(folder)), capsys)
    assert str(folder) in err and "scores image only" in err


def test_score_unknown_setting_suggests_the_close_one(good_png, capsys):
    err = one_line_error(score_argv(good_png, sets=("chekpoint=/x.safetensors",)), capsys)
    assert "reward 'toy_artifact' has no setting 'chekpoint'" in err and "did you mean 'checkpoint'" in err


def test_score_set_without_a_value(good_png, capsys):
    err = one_line_error(score_argv(good_png, sets=("checkpoint",)), capsys)
    assert "--set 'checkpoint' is not key=value" in err


def test_score_set_device_points_to_the_flag(good_png, capsys):
    err = one_line_error(score_argv(good_png, sets=("device=cpu",)), capsys)
    assert "pass --device cpu" in err


def test_score_unknown_reward(good_png, capsys):
    err = one_line_error(score_argv(good_png, reward="toy_artefact"), capsys)
    assert "unknown reward 'toy_artefact'" in err and "toy_artifact" in err


def test_score_more_prompts_than_files(good_png, capsys):
    err = one_line_error(
        ["score", "--reward", "toy_artifact", "--prompt", "a", "--prompt", "b", "--prompt", "c", good_png, good_png],
        capsys,
    )
    assert "--prompt given 3 times for 2 files" in err


def test_score_a_good_image_still_works(good_png, capsys):
    assert main(score_argv(good_png)) == 0
    assert capsys.readouterr().out.strip().endswith(good_png)


# ---- flowrl eval --checkpoint -------------------------------------------------------------------------------


def write_checkpoint(root: Path) -> Path:
    """A checkpoint folder with every file `load_checkpoint` reads, real formats, tiny contents."""
    folder = root / "checkpoints" / "step_000010"
    folder.mkdir(parents=True)
    save_file({"weight": torch.zeros(4)}, str(folder / "trainable.safetensors"))
    torch.save({"state": {}}, folder / "optimizer.pt")
    (folder / "lr_scheduler.json").write_text(json.dumps({"last_epoch": 10}))
    (folder / "trainer_state.json").write_text(json.dumps({"step": 10}))
    (folder / "config.yaml").write_text("name: broken\n")
    return folder


def eval_argv(checkpoint: Path, tmp_path: Path) -> list[str]:
    return ["eval", "--config", TOY_CONFIG, "--checkpoint", str(checkpoint), "--out", str(tmp_path / "eval")]


def test_eval_checkpoint_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    folder = tmp_path / "some_folder"
    folder.mkdir()
    (folder / "model.bin").write_bytes(b"\0" * 16)
    err = one_line_error(eval_argv(folder, tmp_path), capsys)
    assert str(folder) in err and "has no trainer_state.json" in err


def test_eval_checkpoint_with_corrupt_trainer_state(tmp_path, capsys):
    folder = write_checkpoint(tmp_path / "run")
    (folder / "trainer_state.json").write_text('{"step": 10, "prompt_sampler": {"epo')  # cut off mid-write
    err = one_line_error(eval_argv(folder, tmp_path), capsys)
    assert f"checkpoint file {str(folder / 'trainer_state.json')!r} is corrupt or truncated" in err
    assert "pass another checkpoints/step_XXXXXX folder" in err


def test_eval_checkpoint_with_truncated_trainable_weights(tmp_path, capsys):
    folder = write_checkpoint(tmp_path / "run")
    write_truncated_safetensors(folder / "trainable.safetensors")
    err = one_line_error(eval_argv(folder, tmp_path), capsys)
    assert f"checkpoint file {str(folder / 'trainable.safetensors')!r} is corrupt or truncated" in err


def test_load_checkpoint_names_each_damaged_file(tmp_path):
    folder = write_checkpoint(tmp_path / "run")
    assert load_checkpoint(folder)["trainer_state"] == {"step": 10}
    (folder / "optimizer.pt").write_bytes(b"PK\x03\x04 truncated zip")
    with pytest.raises(ValueError, match=r"optimizer\.pt' is corrupt or truncated"):
        load_checkpoint(folder)
    (folder / "optimizer.pt").unlink()
    with pytest.raises(FileNotFoundError, match=r"optimizer\.pt' is missing"):
        load_checkpoint(folder)
    torch.save({"state": {}}, folder / "optimizer.pt")
    (folder / "config.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match=r"config\.yaml' is corrupt or truncated"):
        load_checkpoint(folder)
    (folder / "config.yaml").write_text("name: ok\n")
    (folder / "trainer_state.json").write_text("[10]")
    with pytest.raises(ValueError, match=r"trainer_state\.json' holds a list, not a dict"):
        load_checkpoint(folder)


# ---- flowrl rewards list ------------------------------------------------------------------------------------


def test_rewards_list_works(capsys):
    assert main(["rewards", "list"]) == 0
    out = capsys.readouterr().out
    assert "toy_artifact" in out and "toy_attributes" in out
