"""The sets read through `datasets` (OCR, PickScore, DrawBench): the offline error, local copies built here with
`datasets`, the shipped samples, and sets by name as a config reads them. No test touches the network."""

import json
from pathlib import Path

import pytest

from flowrl import prompt_sets as ps
from flowrl.training.prompts import load_prompt_records

datasets = pytest.importorskip("datasets")

PROMPTS = Path(__file__).parents[2] / "configs" / "prompts"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No network and an empty `datasets` cache, whatever the machine has cached."""
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")


@pytest.mark.parametrize(
    ("spec", "source"),
    [
        ("drawbench", "sayakpaul/drawbench"),
        ("ocr:test", "yifan123/flow_grpo/ac4c86e8cae021841f1fde853d340e0db67690dd/dataset/ocr/test.txt"),
        ("pickscore:train", "dataset/pickscore/train.txt"),
    ],
)
def test_offline_and_uncached_is_one_line_naming_the_dataset_and_the_fix(offline, spec, source):
    with pytest.raises(ps.PromptSetUnavailable) as err:
        ps.prompt_set_records(spec)
    message = str(err.value)
    assert "\n" not in message and source in message and spec.split(":")[0] in message
    assert "HF_HUB_OFFLINE" in message and "local copy" in message and "--source" in message


def test_a_local_save_to_disk_copy_gives_prompts_and_categories(tmp_path):
    table = datasets.Dataset.from_dict(
        {
            "Prompts": ["A red colored car.", "  Two  cats\non a mat. ", "", "A sign that says 'Diffusion'."],
            "Category": ["Colors", "Counting", "Counting", "Text"],
        }
    )
    table.save_to_disk(str(tmp_path / "drawbench"))
    records = ps.prompt_set_records("drawbench:test", source=tmp_path / "drawbench")
    assert records == [
        {"prompt": "A red colored car.", "category": "Colors"},
        {"prompt": "Two cats on a mat.", "category": "Counting"},  # whitespace collapsed, the blank row dropped
        {"prompt": "A sign that says 'Diffusion'.", "category": "Text"},
    ]


def test_a_local_dataset_dict_picks_the_split(tmp_path):
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"text": ['a sign that reads "OPEN"', 'a mug with "BEST DAD"']}),
            "test": datasets.Dataset.from_dict({"text": ['a poster titled "MIDNIGHT TRAIN"']}),
        }
    )
    splits.save_to_disk(str(tmp_path / "ocr"))
    assert [r["prompt"] for r in ps.prompt_set_records("ocr:train", source=tmp_path / "ocr")] == [
        'a sign that reads "OPEN"',
        'a mug with "BEST DAD"',
    ]
    test = ps.prompt_set_records("ocr:test", source=tmp_path / "ocr")
    assert test == [{"prompt": 'a poster titled "MIDNIGHT TRAIN"'}]
    datasets.DatasetDict({"validation": splits["test"]}).save_to_disk(str(tmp_path / "other"))
    with pytest.raises(ValueError, match=r"holds splits \['validation'\], not 'test'; save that split"):
        ps.prompt_set_records("ocr:test", source=tmp_path / "other")


def test_local_csv_parquet_and_jsonl_copies(tmp_path):
    table = datasets.Dataset.from_dict({"Prompts": ["An elephant under the sea.", "A pink colored giraffe."]})
    table.to_csv(str(tmp_path / "drawbench.csv"), index=False)
    table.to_parquet(str(tmp_path / "drawbench.parquet"))
    expected = [{"prompt": "An elephant under the sea."}, {"prompt": "A pink colored giraffe."}]
    assert ps.prompt_set_records("drawbench", source=tmp_path / "drawbench.csv") == expected
    assert ps.prompt_set_records("drawbench", source=tmp_path / "drawbench.parquet") == expected
    ps.write_records([{"prompt": "A storefront.", "category": "Text"}], tmp_path / "copy.jsonl")
    copy = ps.prompt_set_records("drawbench", source=tmp_path / "copy.jsonl")
    assert copy == [{"prompt": "A storefront.", "category": "Text"}]
    with pytest.raises(FileNotFoundError, match=r"is not a save_to_disk folder or a .txt/.jsonl/.csv/.parquet file"):
        ps.prompt_set_records("drawbench", source=tmp_path / "missing.txt")
    datasets.Dataset.from_dict({"caption": ["x"]}).save_to_disk(str(tmp_path / "wrong"))
    with pytest.raises(ValueError, match=r"no prompt column 'Prompts' among \['caption'\]; rename the column"):
        ps.prompt_set_records("drawbench", source=tmp_path / "wrong")


@pytest.mark.parametrize(
    ("name", "size"),
    [("ocr_flowgrpo_sample.txt", 30), ("pickscore_flowgrpo_sample.txt", 30), ("drawbench_sample.txt", 30)],
)
def test_shipped_samples_name_their_source_and_load_as_local_copies(name, size):
    path = PROMPTS / name
    text = path.read_text(encoding="utf-8")
    assert text.startswith("# 30 of ") and ("yifan123/flow_grpo" in text or "sayakpaul/drawbench" in text)
    set_name = name.split("_")[0]
    records = ps.prompt_set_records(f"{set_name}:test", source=path)
    prompts, _ = load_prompt_records(None, str(path), None, "data")  # the reader a config's prompts_file goes through
    assert len(records) == size == len(prompts) == len(set(prompts))
    assert [r["prompt"] for r in records] == [" ".join(p.split()) for p in prompts]
    if set_name == "ocr":
        assert all('"' in p for p in prompts)  # every OCR prompt quotes the text to render


def test_geneval_sample_is_the_first_six_of_each_task_and_reads_as_a_prompts_file():
    path = PROMPTS / "geneval_sample.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    test = ps.geneval_test()
    assert lines == [r for tag in ps.GENEVAL_TEST_MIX for r in [x for x in test if x["tag"] == tag][:6]]
    prompts, metadata = load_prompt_records(None, str(path), None, "data")
    assert prompts == [r["prompt"] for r in lines]
    assert metadata == [{k: v for k, v in r.items() if k != "prompt"} for r in lines]  # tag, include, exclude


def test_sets_by_name():
    prompts, metadata = ps.load_prompt_set("geneval:test")
    assert len(prompts) == 553 and metadata[0] == {"tag": "single_object", "include": [{"class": "bench", "count": 1}]}
    assert ps.parse_prompt_set("geneval") == ("geneval", "test") and ps.parse_prompt_set("ocr:train") == (
        "ocr",
        "train",
    )
    train, _ = ps.load_prompt_set("geneval:train", seed=1)
    assert len(train) == 50_000 and not set(train) & set(ps.load_prompt_set("geneval:test", seed=1)[0])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda: ps.load_prompt_set("geneval:val", where="eval"),
            r"eval.prompt_set: .*geneval has no split 'val'; use",
        ),
        (lambda: ps.load_prompt_set("coco"), r"data.prompt_set: .*unknown set 'coco'; use one of geneval, ocr"),
        (lambda: ps.prompt_set_records("drawbench:train"), r"drawbench has no split 'train'; use drawbench:test"),
        (
            lambda: ps.prompt_set_records("ocr:test", seed=1),
            r"fixed prompt files; seed and num_prompts apply to geneval",
        ),
        (lambda: ps.prompt_set_records("geneval:test", num_prompts=9), r"num_prompts applies to geneval:train"),
        (lambda: ps.prompt_set_records("geneval", seed=-1), r"seed=-1 must be a non-negative integer"),
        (lambda: ps.prompt_set_records("geneval", source="x"), r"geneval is generated by flowrl; it takes no source"),
    ],
)
def test_bad_names_and_options_are_one_line_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
