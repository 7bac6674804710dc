"""`flowrl prompts` through its own parser (flowrl/cli_prompts.py), and the files it writes read back the way a
config's `data.prompts_file` reads them."""

import argparse
import json

import pytest

from flowrl import cli_prompts
from flowrl import prompt_sets as ps
from flowrl.training.prompts import load_prompt_records

datasets = pytest.importorskip("datasets")


def flowrl_prompts(*argv):
    parser = argparse.ArgumentParser(prog="flowrl")
    cli_prompts.add_parser(parser.add_subparsers(dest="command", required=True))
    return cli_prompts.run(parser.parse_args(["prompts", *map(str, argv)]))


def test_geneval_test_and_train_files(tmp_path, capsys):
    assert flowrl_prompts("geneval", "--out", tmp_path / "test.jsonl") == 0
    out = capsys.readouterr().out
    assert "wrote 553 prompts (geneval:test, seed 43)" in out and "two_object 99" in out and "color_attr 100" in out
    prompts, metadata = load_prompt_records(None, str(tmp_path / "test.jsonl"), None, "data")
    assert len(prompts) == 553 and metadata[80] == {
        "tag": "two_object",
        "include": [{"class": "bench", "count": 1}, {"class": "sports ball", "count": 1}],
    }
    argv = ["geneval", "--split", "train", "--seed", 1, "--num-prompts", 300, "--out", tmp_path / "tr.jsonl"]
    assert flowrl_prompts(*argv) == 0
    assert "wrote 300 prompts (geneval:train, seed 1)" in capsys.readouterr().out
    train = [json.loads(line) for line in (tmp_path / "tr.jsonl").read_text().splitlines()]
    assert train == ps.geneval_train(1, 300)


def test_a_hub_set_from_a_local_copy_as_text_and_jsonl(tmp_path, capsys):
    table = datasets.Dataset.from_dict({"Prompts": ["A storefront with 'Hello' written on it.", "Matutinal."]})
    table = table.add_column("Category", ["Text", "Rare Words"])
    table.save_to_disk(str(tmp_path / "db"))
    assert flowrl_prompts("drawbench", "--source", tmp_path / "db", "--out", tmp_path / "db.txt") == 0
    assert "wrote 2 prompts (drawbench:test) to" in capsys.readouterr().out
    text = (tmp_path / "db.txt").read_text()
    assert text.startswith("# drawbench:test: DrawBench's 200 prompts")
    assert load_prompt_records(None, str(tmp_path / "db.txt"), None, "data")[0] == [
        "A storefront with 'Hello' written on it.",
        "Matutinal.",
    ]
    assert flowrl_prompts("drawbench", "--source", tmp_path / "db", "--out", tmp_path / "db.jsonl") == 0
    _, metadata = load_prompt_records(None, str(tmp_path / "db.jsonl"), None, "data")
    assert metadata == [{"category": "Text"}, {"category": "Rare Words"}]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["geneval", "--out", "{tmp}/g.txt"], "GenEval records need their metadata; write a .jsonl file"),
        (["geneval", "--out", "{tmp}/g.csv"], "must end in .jsonl (records) or .txt (one prompt a line)"),
        (["drawbench", "--split", "train", "--out", "{tmp}/d.txt"], "drawbench has no split 'train'"),
        (["ocr", "--seed", "3", "--out", "{tmp}/o.txt"], "seed and num_prompts apply to geneval only"),
        (["pickscore", "--source", "{tmp}/none", "--out", "{tmp}/p.txt"], "is not a save_to_disk folder"),
        (["laion", "--out", "{tmp}/l.txt"], "unknown set 'laion'; use one of geneval, ocr, pickscore, drawbench"),
    ],
)
def test_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    assert flowrl_prompts(*[a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flowrl prompts: error: ") and message in err and "\n" not in err
    assert not list(tmp_path.iterdir())  # nothing written


def test_offline_hub_set_exits_2_naming_the_dataset(tmp_path, capsys, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert flowrl_prompts("drawbench", "--out", tmp_path / "d.jsonl") == 2
    err = capsys.readouterr().err
    assert "sayakpaul/drawbench" in err and "HF_HUB_OFFLINE" in err and err.count("\n") == 1
