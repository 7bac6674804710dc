"""`flowrl eval --benchmark`: GenEval end to end on the tiny SD3 pipeline with the tiny GenEval checkpoint (the table,
benchmark.json, GenEval's results.jsonl, the sample count), GenEval's summary arithmetic against summary_scores.py's
on a hand-made table, a sample-mean benchmark (PickScore on a local copy of its prompts), the quick subset, 2 gloo
processes equal to one, and the one-line errors. Offline, tiny models, fixed seeds."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pandas
import pytest

from flowrl import benchmarks
from flowrl.cli import main
from flowrl.rewards._tiny import tiny_geneval, tiny_pickscore

sys.path.insert(0, str(Path(__file__).parents[1] / "trainers"))  # the launch helpers of the process tests
from launching import env, launch_command  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

TASKS = ["single_object", "two_object", "counting", "colors", "position", "color_attr"]
TINY = ["--num-steps", "2", "--height", "32", "--width", "32", "--device", "cpu"]


def geneval_args(tiny_pipeline, folder: Path, out: Path, num_prompts: int = 6) -> list[str]:
    kwargs = json.dumps(tiny_geneval(folder, detect=True))
    model = tiny_pipeline("sd3")
    argv = ["--benchmark", "geneval", "--model", model, "--num-prompts", str(num_prompts), *TINY, "--out", str(out)]
    return [*argv, "--reward-kwargs", kwargs]


def run(argv: list[str]) -> tuple[int, str]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["eval", *argv])
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def geneval_run(tiny_pipeline, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("geneval")
    code, printed = run(geneval_args(tiny_pipeline, tmp / "tiny", tmp / "out"))
    assert code == 0
    return tmp / "out", printed


def test_geneval_end_to_end_writes_the_table_the_json_and_genevals_results(geneval_run):
    out, printed = geneval_run
    record = json.loads((out / "benchmark.json").read_text())
    scores = json.loads((out / "scores.json").read_text())
    assert record["benchmark"] == "geneval" and record["checkpoint"] is None and record["model"].endswith("sd3")
    assert record["prompts"] == 6 and record["seeds"] == [0, 1, 2, 3] and record["samples"] == 6 * 4
    assert record["partial"] is True and record["benchmark_prompts"] == 553
    assert record["rewards"]["geneval"]["score"] == "correct"  # GenEval's verdict, not flow_grpo's partial score
    assert len(scores["samples"]) == 24 and scores["sampler"]["num_steps"] == 2
    assert len(record["commit"]) == 40 and record["sampler"] == scores["sampler"]
    # the subset takes one prompt of each task; every per-sample verdict is 0 or 1
    assert [m["tag"] for m in scores["metadata"]] == TASKS and list(record["tasks"]) == TASKS
    verdicts = [x["scores"]["geneval"] for x in scores["samples"]]
    assert set(verdicts) <= {0.0, 1.0}
    # by hand from the per-sample verdicts: each task's accuracy, then their mean
    by_task = {t: [] for t in TASKS}
    for x in scores["samples"]:
        by_task[scores["metadata"][x["prompt_index"]]["tag"]].append(x["scores"]["geneval"])
    for task, values in by_task.items():
        assert record["tasks"][task] == {"geneval": pytest.approx(sum(values) / 4), "samples": 4}
    assert record["overall"]["geneval"] == pytest.approx(sum(sum(v) / 4 for v in by_task.values()) / 6)
    assert record["geneval"]["images"] == 24 and record["geneval"]["prompts"] == 6
    # the printed table: a row per task and the overall one
    lines = printed.splitlines()
    assert "6 prompts x 4 seeds = 24 samples (partial: 6 of 553 prompts)" in lines
    for task in [*TASKS, "overall"]:
        row = next(line.split() for line in lines if line.startswith(task + " "))
        value = record["overall" if task == "overall" else "tasks"]
        assert float(row[1]) == pytest.approx((value if task == "overall" else value[task])["geneval"], abs=5e-5)
    assert lines[-1] == f"wrote {out}/benchmark.json"
    # results.jsonl in GenEval's format, read as its summary_scores.py reads it
    df = pandas.read_json(out / "results.jsonl", orient="records", lines=True)
    assert len(df) == 24 and df.groupby("metadata").ngroups == 6
    assert [(out / f).is_file() for f in df["filename"]] == [True] * 24
    assert df.groupby("tag", sort=False)["correct"].mean().mean() == pytest.approx(record["overall"]["geneval"])
    assert (out / "grid.png").is_file()


def test_genevals_summary_arithmetic_on_a_hand_made_table():
    """Tasks of unequal sizes, so that the mean of the task accuracies (GenEval's overall) differs from the share of
    correct images."""
    table = [  # (prompt, tag, correct)
        *[(0, "single_object", c) for c in (1, 1, 1, 0)],  # 3/4
        *[(1, "two_object", c) for c in (1, 0)],  # 1/2
        *[(2, "counting", c) for c in (0, 0, 0, 0)] + [(3, "counting", c) for c in (1, 1, 0, 0)],  # 2/8
        *[(4, "colors", c) for c in (0, 0, 0, 0)],  # 0/4
    ]
    rows = [{"prompt": p, "tag": t, "correct": c} for p, t, c in table]
    summary = benchmarks.geneval_summary(rows)
    assert summary["overall"] == pytest.approx((3 / 4 + 1 / 2 + 2 / 8 + 0) / 4)  # 0.375
    assert summary["images_correct"] == pytest.approx(6 / 18)
    assert summary["prompts_correct"] == pytest.approx(3 / 5)  # prompts 0, 1 and 3 have a correct image
    assert summary["images"] == 18 and summary["prompts"] == 5
    assert summary["tasks"]["counting"] == {"accuracy": 0.25, "correct": 2, "samples": 8}
    # GenEval's summary_scores.py: pandas over the rows, metadata = the prompt, groupby('tag', sort=False)
    df = pandas.DataFrame({"metadata": [p for p, _, _ in table], "tag": [t for _, t, _ in table]})
    df["correct"] = [bool(c) for _, _, c in table]
    task_scores = [task_df["correct"].mean() for _, task_df in df.groupby("tag", sort=False)]
    assert list(summary["tasks"]) == list(df.groupby("tag", sort=False).groups)
    assert summary["overall"] == pytest.approx(sum(task_scores) / len(task_scores))
    assert summary["images_correct"] == pytest.approx(df["correct"].mean())
    assert summary["prompts_correct"] == pytest.approx(df.groupby("metadata")["correct"].any().mean())
    # the same table as a scores.json: benchmark.json's numbers
    metadata = [{"tag": t} for t in ("single_object", "two_object", "counting", "counting", "colors")]
    samples = [{"prompt_index": p, "scores": {"geneval": float(c)}} for p, _, c in table]
    scores = {"rewards": {"train": [], "gold": ["geneval"]}, "metadata": metadata, "samples": samples}
    summed = benchmarks.summarize(benchmarks.BENCHMARKS["geneval"], scores)
    assert summed["overall"] == {"geneval": pytest.approx(0.375)}
    assert summed["tasks"]["two_object"] == {"geneval": 0.5, "samples": 2}
    assert summed["geneval"]["prompts_correct"] == pytest.approx(3 / 5)


def test_the_quick_subset_takes_prompts_in_turn_from_every_task_in_the_sets_order():
    records = [{"tag": t} for t in "aaaabbc"]
    assert benchmarks.subset(records, "tag", 4) == [0, 1, 4, 6]  # a, b, c, then a again
    assert benchmarks.subset(records, "tag", 6) == [0, 1, 2, 4, 5, 6]
    assert benchmarks.subset(records, "tag", None) == list(range(7)) == benchmarks.subset(records, "tag", 99)
    assert benchmarks.subset(records, None, 3) == [0, 1, 2]  # no tasks: the first prompts


def test_pickscore_on_a_local_copy_is_the_mean_over_the_samples(tiny_pipeline, tmp_path):
    (tmp_path / "test.txt").write_text("a red fox\na blue bird\nthree green apples\n")
    kwargs = json.dumps(tiny_pickscore(tmp_path / "pickscore"))
    argv = ["--benchmark", "pickscore", "--model", tiny_pipeline("sd3"), *TINY, "--reward-kwargs", kwargs]
    code, printed = run([*argv, "--source", str(tmp_path / "test.txt"), "--out", str(tmp_path / "out")])
    assert code == 0
    record = json.loads((tmp_path / "out" / "benchmark.json").read_text())
    scores = json.loads((tmp_path / "out" / "scores.json").read_text())
    assert record["prompts"] == record["benchmark_prompts"] == 3 and record["partial"] is False
    assert record["samples"] == 3 and record["tasks"] == {}
    values = [x["scores"]["pickscore"] for x in scores["samples"]]
    assert record["overall"]["pickscore"] == pytest.approx(sum(values) / 3)
    assert "3 prompts x 1 seeds = 3 samples" in printed and "partial" not in printed


def test_a_runs_checkpoint_samples_at_the_runs_eval_settings_with_the_runs_scorer_weights(tiny_pipeline, tmp_path):
    """--config + --checkpoint base: the run's eval sizes and steps, the run's own pickscore weights, and the folder
    beside the run's eval/."""
    import yaml

    (tmp_path / "test.txt").write_text("a red fox\na blue bird\n")
    tiny = tiny_pickscore(tmp_path / "pickscore")
    config = {
        "name": "run",
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "model": {"path": tiny_pipeline("sd3"), "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": ["a cat"], "num_prompts_per_step": 1, "group_size": 2},
        "sampler": {"name": "sde", "num_steps": 2, "height": 32, "width": 32},
        "rewards": [{"name": "pickscore", "kwargs": tiny}],
        "eval": {"num_steps": 3, "guidance_scale": 1.5},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    argv = ["--benchmark", "pickscore", "--config", str(tmp_path / "run.yaml"), "--checkpoint", "base"]
    code, printed = run([*argv, "--source", str(tmp_path / "test.txt")])
    assert code == 0
    out = tmp_path / "runs" / "run" / "benchmarks" / "pickscore" / "base"
    record = json.loads((out / "benchmark.json").read_text())
    assert record["checkpoint"] == "base" and record["weights"] == "base" and record["rewards"] == {"pickscore": tiny}
    assert record["model"] == tiny_pipeline("sd3") and record["samples"] == 2
    sampler = record["sampler"]
    assert (sampler["num_steps"], sampler["guidance_scale"], sampler["height"], sampler["width"]) == (3, 1.5, 32, 32)
    assert printed.splitlines()[-1] == f"wrote {out}/benchmark.json"


@pytest.mark.slow
def test_two_gloo_processes_write_the_one_process_results(tiny_pipeline, tmp_path, geneval_run):
    """The same command (6 prompts x 4 seeds in batches of 4: 6 batches, 3 a process) on 1 and 2 processes."""
    argv = [*geneval_args(tiny_pipeline, tmp_path / "tiny", tmp_path / "one"), "--batch-size", "4"]
    assert run(argv)[0] == 0
    two = [a if a != str(tmp_path / "one") else str(tmp_path / "two") for a in argv]
    script = Path(__file__).parents[2] / "scripts" / "evaluate.py"
    done = subprocess.run(launch_command("cpu_2proc", script, *two), env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1 and "overall" in done.stdout  # the main process prints
    for name in ("scores.json", "benchmark.json"):
        a = json.loads((tmp_path / "one" / name).read_text())
        b = json.loads((tmp_path / "two" / name).read_text())
        a.pop("time_s", None), b.pop("time_s", None)
        assert a.pop("environment").pop("device") == "cpu" and b.pop("environment").pop("device") == "cpu:0"
        assert a == b
    for sample in json.loads((tmp_path / "one" / "scores.json").read_text())["samples"]:
        assert (tmp_path / "one" / sample["image"]).read_bytes() == (tmp_path / "two" / sample["image"]).read_bytes()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--benchmark", "parti", "--model", "m"], "--benchmark 'parti' is not a benchmark; use one of geneval, ocr"),
        (["--benchmark", "geneval"], "--benchmark needs --model PATH_OR_ID, or --config CONFIG with --checkpoint"),
        (["--benchmark", "geneval", "--model", "m", "--reward", "ocr"], "geneval is scored by geneval; drop --reward"),
        (["--benchmark", "ocr", "--model", "m", "--reward-kwargs", "{x"], "--reward-kwargs '{x' is not JSON"),
        (["--benchmark", "geneval", "--model", "m", "--num-prompts", "0"], "--num-prompts=0 must be >= 1"),
        (["--benchmark", "ocr", "--model", "m", "--device", "cuda:1"], "--device 'cuda:1': give cpu, or leave it"),
        (["--benchmark", "ocr", "--config", "c", "--checkpoint", "base", "--dtype", "float16"], "a run's are its"),
        (["--model", "m"], "--model go with --benchmark NAME; add it or drop them"),
        (["--checkpoint", "base"], "flowrl eval needs --config CONFIG and --checkpoint CKPT"),
    ],
)
def test_errors_are_one_line_naming_the_option_and_the_fix(capsys, argv, message):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowrl eval: error: ") and message in err and err.count("\n") == 1


def test_ocr_offline_without_a_local_copy_is_the_prompt_sets_one_line_error(capsys, monkeypatch, tmp_path):
    datasets = pytest.importorskip("datasets")
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    assert main(["eval", "--benchmark", "ocr", "--model", "no/model", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flowrl eval: error: --benchmark ocr: prompt set ocr:test reads ") and err.count("\n") == 1
    assert "HF_HUB_OFFLINE" in err and "local copy" in err and not (tmp_path / "out").exists()
