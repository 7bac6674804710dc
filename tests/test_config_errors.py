"""A broken config file is one ConfigError of one line that names the file (and, for bad YAML, the line and column);
through `flowrl train` it is exit code 2 and one stderr line. Every case writes the real bad file into tmp_path."""

import pytest
import yaml

from flowrl.cli import main
from flowrl.config import ConfigError
from flowrl.trainers import TRAINERS, load_config


def config_error(path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message, message
    assert str(path) in message, message
    return message


def train_error(argv, capsys) -> str:
    capsys.readouterr()
    assert main(["train", *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("flowrl train: error: "), lines[0]
    return lines[0]


def toy_run(tmp_path, **data):
    """A valid toy run config (as plain data) with `data` overriding the data section."""
    return {
        "name": "bad",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 1,
        "model": {"path": "toy", "lora_rank": 4},
        "data": {"num_prompts_per_step": 1, "group_size": 2, **data},
        "sampler": {"name": "sde", "num_steps": 2},
        "rewards": [{"name": "toy_attributes"}],
        "logging": {"trackers": [], "progress_bar": False},
    }


def test_invalid_yaml_names_the_file_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: [1,2")  # the flow sequence is still open when the stream ends after 11 characters
    message = config_error(path)
    assert "line 1, column 12" in message and "not valid YAML" in message


def test_invalid_yaml_on_a_later_line_names_that_line_and_column(tmp_path):
    lines = ["seed: 1", "model: [1,2", "name: x"]
    path = tmp_path / "later.yaml"
    path.write_text("\n".join(lines) + "\n")
    # the open sequence swallows '2 name' as one plain scalar; the parser stops at the ':' of line 3
    message = config_error(path)
    assert f"line 3, column {lines[2].index(':') + 1}" in message


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    message = config_error(path)
    assert "UTF-8" in message


def test_a_top_level_list_is_one_line(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- name: a\n- name: b\n")
    message = config_error(path)
    assert "mapping" in message


def test_flowrl_train_on_bad_yaml_exits_2_with_one_stderr_line(tmp_path, capsys):
    path = tmp_path / "BAD.yaml"
    path.write_text("model: [1,2")
    line = train_error([str(path)], capsys)
    assert str(path) in line and "line 1, column 12" in line


def test_a_prompts_file_that_is_not_utf8_names_data_prompts_file(tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"two red circles\n\xff\xfe one blue square\n")
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(toy_run(tmp_path, prompts_file=str(prompts))))
    line = train_error([str(path)], capsys)
    assert "data.prompts_file" in line and str(prompts) in line and "UTF-8" in line


def test_an_unknown_trainer_names_the_registered_trainers(tmp_path):
    path = tmp_path / "nope.yaml"
    path.write_text(yaml.safe_dump({**toy_run(tmp_path, prompts=["two red circles"]), "trainer": "nope"}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and "'nope'" in message
    assert TRAINERS and all(name in message for name in TRAINERS), message
