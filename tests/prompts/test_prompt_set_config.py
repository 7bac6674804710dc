"""A config reads a named prompt set (data.prompt_set, eval.prompt_set): the prompts and GenEval's records as each
prompt's metadata reach the step's prompt batches and the evaluator; two prompt sources in one section are refused."""

import pytest
import yaml

from flowrl.config import ConfigError
from flowrl.prompt_sets import prompt_set_records
from flowrl.trainers import load_config
from flowrl.training.prompts import load_prompt_records


def toy_config(tmp_path, data: dict, eval_section: dict | None = None):
    config = {
        "name": "prompt_set",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 1,
        "model": {"path": "toy", "lora_rank": 4},
        "data": {"num_prompts_per_step": 1, "group_size": 2, **data},
        "sampler": {"name": "sde", "num_steps": 2},
        "rewards": [{"name": "toy_attributes"}],
        "eval": eval_section or {},
        "logging": {"trackers": [], "progress_bar": False},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_config(path)


def test_geneval_test_set_by_name_gives_prompts_and_records(tmp_path):
    cfg = toy_config(tmp_path, {"prompt_set": "geneval:test"}, {"prompt_set": "geneval:test"})
    d, e = cfg.data, cfg.eval
    prompts, metadata = load_prompt_records(d.prompts, d.prompts_file, d.toy_split, "data", False, d.prompt_set)
    records = prompt_set_records("geneval:test")
    assert len(prompts) == 553 and prompts == [r["prompt"] for r in records]
    assert metadata[0] == {k: v for k, v in records[0].items() if k != "prompt"}
    assert {"tag", "include"} <= metadata[0].keys()
    assert load_prompt_records(None, None, None, "eval", False, e.prompt_set) == (prompts, metadata)


def test_two_sources_are_refused_and_an_unknown_set_is_named(tmp_path):
    with pytest.raises(ConfigError, match="exactly one of prompts_file, prompts, toy_split, prompt_set"):
        toy_config(tmp_path, {"prompt_set": "geneval:test", "toy_split": "train"})
    with pytest.raises(ValueError, match=r"^data\.prompt_set: "):
        load_prompt_records(None, None, None, "data", False, "no_such_set:test")


def test_flowrl_prompts_is_a_command_of_flowrl(tmp_path, capsys):
    from flowrl.cli import main

    out = tmp_path / "geneval_test.jsonl"
    assert main(["prompts", "geneval", "--out", str(out)]) == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 553
    assert "single_object 80" in capsys.readouterr().out
