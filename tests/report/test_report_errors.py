"""Malformed input to `flowrl report` stops it with one line on stderr (exit 2) naming the file, the problem and the
fix; what a crash leaves (a last metrics.jsonl line cut mid-write) is skipped without an error."""

from __future__ import annotations

import json

import pytest
from fabricated_runs import TRAIN, fabricate_run

from flowrl.cli import main

PROMPTS = ["one red circle", "two blue squares"]
SEEDS = [0, 7]


def _run(tmp_path, name="r"):
    return fabricate_run(tmp_path, name, prompts=PROMPTS, seeds=SEEDS, steps=[0, 5])


def _error(capsys, argv) -> str:
    """Runs `flowrl report ARGV`; asserts exit 2 and a one-line error, returns the message after the prefix."""
    assert main(["report", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.rstrip("\n")
    assert captured.out == "" and "\n" not in err and "Traceback" not in err, err
    assert err.startswith("flowrl report: error: "), err
    return err[len("flowrl report: error: ") :]


def _edit_scores(run_dir, folder, edit):
    path = run_dir / "eval" / folder / "scores.json"
    scores = json.loads(path.read_text())
    edit(scores)
    path.write_text(json.dumps(scores))
    return path


def test_scores_json_that_is_not_json(tmp_path, capsys):
    run_dir = _run(tmp_path)
    path = run_dir / "eval" / "step_000005" / "scores.json"
    path.write_text('{"prompts": ["a"], "see')
    message = _error(capsys, [str(run_dir)])
    assert message.startswith(f"{path} is not valid JSON (") and "at line 1 column 20);" in message
    assert f"`flowrl eval --config CONFIG --checkpoint {run_dir / 'checkpoints' / 'step_000005'}`" in message
    assert f"or remove the folder {path.parent}" in message


def test_scores_json_that_is_not_utf8(tmp_path, capsys):
    run_dir = _run(tmp_path)
    path = run_dir / "eval" / "base" / "scores.json"
    path.write_bytes(b'{"prompts": ["\xff"]}')
    message = _error(capsys, [str(run_dir)])
    assert message.startswith(f"{path} is not UTF-8 text (byte 14);") and "--checkpoint base`" in message


@pytest.mark.parametrize(
    "edit, problem",
    [
        (lambda s: s.pop("samples"), "has no 'samples' list"),
        (lambda s: s.pop("rewards"), "has no 'rewards' dict"),
        (lambda s: s.update(prompts="one red circle"), "'prompts' is a JSON string (\"one red circle\"), not a list"),
        (lambda s: s.update(seeds=[0, "7"]), "'seeds'[1] is \"7\", not an integer"),
        (
            lambda s: s["rewards"].update(gold="toy_artifact"),
            'rewards.gold is a JSON string ("toy_artifact"), not a list of reward names',
        ),
        (
            lambda s: s["samples"][3].update(prompt_index=2),
            "sample 3 has prompt_index 2, not an integer in 0..1 (2 prompts)",
        ),
        (lambda s: s["samples"][0].pop("seed"), "sample 0 has seed null, not an integer"),
        (
            lambda s: s["samples"][1].pop("image"),
            "sample 1 has image null, not a file name relative to its eval folder",
        ),
        (
            lambda s: s["samples"][2]["scores"].update({TRAIN: "high"}),
            f"sample 2 has score '{TRAIN}' = \"high\", not a number or null",
        ),
        (
            lambda s: s["per_prompt"].update({TRAIN: [0.5]}),
            f"per_prompt['{TRAIN}'] holds 1 values, not one value per prompt (2)",
        ),
        (lambda s: s["means"].update({TRAIN: [0.5]}), f"'means'['{TRAIN}'] is [0.5], not a number or null"),
        (
            lambda s: s["diversity"].update(per_prompt=None, mean="wide"),
            'diversity.mean is "wide", not a number or null',
        ),
    ],
    ids=[
        "no-samples",
        "no-rewards",
        "prompts-str",
        "seed-str",
        "gold-str",
        "prompt-index",
        "no-seed",
        "no-image",
        "score-str",
        "per-prompt-length",
        "mean-list",
        "diversity-mean",
    ],
)
def test_scores_json_that_breaks_the_format(tmp_path, capsys, edit, problem):
    run_dir = _run(tmp_path)
    path = _edit_scores(run_dir, "base", edit)
    message = _error(capsys, [str(run_dir)])
    assert message == (
        f"{path} {problem}; it must be a scores.json written by flowrl.training.evaluation (format flowrl.eval/1): "
        f"rewrite it with `flowrl eval --config CONFIG --checkpoint base` or remove the folder {path.parent}"
    )


def test_scores_json_that_is_a_list(tmp_path, capsys):
    run_dir = _run(tmp_path)
    path = run_dir / "eval" / "step_000005" / "scores.json"
    path.write_text("[1, 2]")
    assert _error(capsys, [str(run_dir)]).startswith(
        f"{path} holds a JSON list, not an object; it must be a scores.json"
    )


def test_metrics_with_a_broken_middle_line(tmp_path, capsys):
    run_dir = _run(tmp_path)
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:20]  # line 3 of 5 cut short
    path.write_text("\n".join(lines) + "\n")
    message = _error(capsys, [str(run_dir)])
    assert message.startswith(f"{path} line 3 is not valid JSON (")
    assert message.endswith(": only a last line cut by a crash is skipped; repair or delete line 3")


def test_metrics_with_a_line_without_step(tmp_path, capsys):
    run_dir = _run(tmp_path)
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = json.dumps({"time": 2.0, "train/loss": 0.5})
    lines[3] = "[4]"
    path.write_text("\n".join(lines) + "\n")
    message = _error(capsys, [str(run_dir)])
    assert message == (
        f"{path} line 2 has no integer 'step' (got None): every line must be a JSON object such as "
        '{"step": 1, "train/loss": 0.5}; repair or delete line 2'
    )
    lines[1] = json.dumps({"step": "2"})
    path.write_text("\n".join(lines))
    assert _error(capsys, [str(run_dir)]).startswith(f"{path} line 2 has no integer 'step' (got '2'):")
    lines[1] = json.dumps({"step": 2})
    path.write_text("\n".join(lines))
    assert _error(capsys, [str(run_dir)]).startswith(f"{path} line 4 has no integer 'step' (got a JSON list):")


def test_metrics_with_a_truncated_last_line_is_no_error(tmp_path, capsys):
    run_dir = _run(tmp_path)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "train/lo\n\n')  # a crash mid-line (blank lines after it do not count)
    assert main(["report", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(run_dir / "report" / "index.html") and "error" not in captured.err
    assert "gap: r: metrics.jsonl line 6 is not valid JSON (truncated by a crash?): skipped" in captured.err


def test_run_folder_that_does_not_exist_or_is_a_file(tmp_path, capsys):
    missing = tmp_path / "runs" / "nope"
    assert _error(capsys, [str(missing)]) == (
        f"run folder {str(missing)!r} does not exist; pass runs/<name> written by `flowrl train`"
    )
    (tmp_path / "file.txt").write_text("x")
    assert _error(capsys, [str(tmp_path / "file.txt")]).startswith(
        f"run folder {str(tmp_path / 'file.txt')!r} is a file, not a folder;"
    )


def test_run_folder_without_eval(tmp_path, capsys):
    run_dir = tmp_path / "fresh"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: fresh\n")
    expected = (
        f"run folder {str(run_dir)!r} has no eval/ folder, so there is nothing to report; pass runs/<name> written "
        "by `flowrl train`, or write eval/base/ with `flowrl eval --checkpoint base`"
    )
    assert _error(capsys, [str(run_dir)]) == expected
    good = _run(tmp_path)
    assert _error(capsys, [str(good), "--compare", str(run_dir), "--out", str(tmp_path / "cmp")]) == expected
    assert not (tmp_path / "cmp" / "index.html").exists()
