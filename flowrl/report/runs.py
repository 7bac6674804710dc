"""Reading a run folder: config.yaml, metrics.jsonl, checkpoints/, eval/<name>/scores.json, summary.json.

Two kinds of trouble, told apart by what can cause them:

- pieces that an unfinished or crashed run leaves missing (no checkpoints/, an eval folder without its
  scores.json, a missing image, a last metrics.jsonl line cut mid-write) are recorded in `RunRecord.gaps`
  and shown in the report's "Gaps" list;
- input that no run of the trainer writes (a run folder without eval/, a scores.json that is not JSON or
  breaks the `flowrl.training.evaluation` format, a broken metrics.jsonl line before the last) raises ValueError or
  FileNotFoundError with one line naming the file, what is wrong and the fix (`flowrl report` prints it).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flowrl.report.scores import read_scores
from flowrl.training.runs import step_of

DIVERSITY = "diversity"  # the pseudo-reward name of per-prompt diversity in tables and the hacking panel


@dataclass
class EvalRecord:
    """One eval/<name>/ folder."""

    name: str  # "base" or "step_000120"
    step: int  # 0 for base
    path: Path
    scores: dict[str, Any]  # scores.json (flowrl.training.evaluation schema)
    by_key: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict, repr=False)  # (prompt, seed) -> sample

    def __post_init__(self) -> None:
        prompts = self.scores.get("prompts", [])
        for sample in self.scores.get("samples", []):
            self.by_key[prompts[sample["prompt_index"]], sample["seed"]] = sample

    @property
    def title(self) -> str:
        return "base" if self.name == "base" else f"step {self.step}"

    def sample(self, prompt: str, seed: int) -> dict[str, Any] | None:
        return self.by_key.get((prompt, seed))

    def prompt_value(self, reward: str, prompt: str) -> float | None:
        prompts = self.scores.get("prompts", [])
        if prompt not in prompts:
            return None
        p = prompts.index(prompt)
        if reward == DIVERSITY:
            return self.scores.get("diversity", {}).get("per_prompt", [None] * len(prompts))[p]
        return self.scores.get("per_prompt", {}).get(reward, [None] * len(prompts))[p]

    def overall(self, reward: str) -> float | None:
        if reward == DIVERSITY:
            return self.scores.get("diversity", {}).get("mean")
        return self.scores.get("means", {}).get(reward)


@dataclass
class RunRecord:
    name: str
    path: Path
    config_text: str | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[EvalRecord] = field(default_factory=list)  # base first, then by step
    checkpoints: list[int] = field(default_factory=list)
    summary: dict[str, Any] | None = None
    gaps: list[str] = field(default_factory=list)

    @property
    def base(self) -> EvalRecord | None:
        return self.evals[0] if self.evals and self.evals[0].name == "base" else None

    @property
    def reference(self) -> EvalRecord | None:
        """What changes are measured from: eval/base, else the earliest eval."""
        return self.evals[0] if self.evals else None

    def reward_names(self) -> tuple[list[str], list[str]]:
        """(training rewards, gold rewards) over all evals, in first-seen order."""
        train: list[str] = []
        gold: list[str] = []
        for record in self.evals:
            for name in record.scores.get("rewards", {}).get("train", []):
                if name not in train:
                    train.append(name)
            for name in record.scores.get("rewards", {}).get("gold", []):
                if name not in gold and name not in train:
                    gold.append(name)
        return train, gold


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """metrics.jsonl -> (rows with an int "step", gaps).

    A last line that is not valid JSON is what a crash mid-write leaves: it is skipped and named in the gaps.
    Any other line that is not a JSON object with an integer "step" raises ValueError naming the line.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[dict[str, Any]] = []
    gaps: list[str] = []
    for i, line in enumerate(lines):
        number = i + 1
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            if i == last:
                gaps.append(f"metrics.jsonl line {number} is not valid JSON (truncated by a crash?): skipped")
                continue
            raise ValueError(
                f"{path} line {number} is not valid JSON ({err.msg} at column {err.colno}): "
                f"only a last line cut by a crash is skipped; repair or delete line {number}"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row.get("step"), bool):
            got = repr(row.get("step")) if isinstance(row, dict) else f"a JSON {type(row).__name__}"
            raise ValueError(
                f"{path} line {number} has no integer 'step' (got {_short(got)}): every line must be a "
                f'JSON object such as {{"step": 1, "train/loss": 0.5}}; repair or delete line {number}'
            )
        rows.append(row)
    return rows, gaps


def load_run(run_dir: str | os.PathLike) -> RunRecord:
    """Read a run folder; what an unfinished run can lack is recorded in `RunRecord.gaps`, malformed input raises."""
    path = Path(run_dir)
    if not path.is_dir():
        what = "is a file, not a folder" if path.exists() else "does not exist"
        raise FileNotFoundError(f"run folder {str(path)!r} {what}; pass runs/<name> written by `flowrl train`")
    if not (path / "eval").is_dir():
        raise FileNotFoundError(
            f"run folder {str(path)!r} has no eval/ folder, so there is nothing to report; pass "
            "runs/<name> written by `flowrl train`, or write eval/base/ with `flowrl eval --checkpoint base`"
        )
    run = RunRecord(name=path.resolve().name, path=path)
    config = path / "config.yaml"
    if config.is_file():
        run.config_text = config.read_text(encoding="utf-8", errors="replace")
    else:
        run.gaps.append("config.yaml is missing: the run's configuration cannot be shown")
    metrics = path / "metrics.jsonl"
    if metrics.is_file():
        run.metrics, gaps = read_metrics(metrics)
        run.gaps += gaps
    else:
        run.gaps.append("metrics.jsonl is missing: no reward or KL curves")
    checkpoints = path / "checkpoints"
    if checkpoints.is_dir():
        run.checkpoints = sorted(
            step for d in checkpoints.iterdir() if d.is_dir() and (step := step_of(d.name)) is not None
        )
    else:
        run.gaps.append("checkpoints/ is missing: no checkpoint of this run can be reloaded")
    _load_evals(run)
    summary = path / "summary.json"
    if summary.is_file():
        try:
            run.summary = json.loads(summary.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            run.gaps.append("summary.json is not valid JSON: not shown")
    return run


def _load_evals(run: RunRecord) -> None:
    for folder in sorted((run.path / "eval").iterdir()):
        step = 0 if folder.name == "base" else step_of(folder.name)
        if not folder.is_dir() or step is None:
            continue
        scores_path = folder / "scores.json"
        if not scores_path.is_file():  # the evaluator writes scores.json last: a crash during an eval
            run.gaps.append(f"eval/{folder.name}/scores.json is missing: that evaluation is left out")
            continue
        checkpoint = "base" if folder.name == "base" else str(run.path / "checkpoints" / folder.name)
        scores = read_scores(scores_path, checkpoint)
        record = EvalRecord(folder.name, step, folder, scores)
        for sample in scores["samples"]:
            for key in ("image", "animation"):
                if key in sample and not (folder / sample[key]).is_file():
                    run.gaps.append(
                        f"eval/{folder.name}/{sample[key]} is missing "
                        f"(prompt {sample['prompt_index']}, seed {sample['seed']})"
                    )
        if folder.name != "base" and step not in run.checkpoints and (run.path / "checkpoints").is_dir():
            run.gaps.append(
                f"checkpoints/{folder.name}/ is missing: eval {folder.name} is shown but its weights cannot be reloaded"
            )
        run.evals.append(record)
    run.evals.sort(key=lambda r: (r.name != "base", r.step))
    if not run.evals:
        run.gaps.append("eval/ holds no scores.json: no sample grid, tables or reward-hacking panel")
    elif run.base is None:
        run.gaps.append(f"eval/base/ is missing: changes are measured from the earliest eval, {run.evals[0].name}")


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
