"""Reading one eval/<name>/scores.json and checking it against the format `flowrl.training.evaluation` writes.

Every key the report reads is checked here, so that a malformed file stops the report with one line naming
the file, the key and the value it holds, instead of a traceback from deep inside the page builder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_scores(path: Path, checkpoint: str) -> dict[str, Any]:
    """Parse and check a scores.json; ValueError names the file, the problem and the fix.

    `checkpoint` is what `flowrl eval --checkpoint` takes to rewrite this file ("base" or a checkpoint folder).
    """
    fix = (
        f"it must be a scores.json written by flowrl.training.evaluation (format flowrl.eval/1): rewrite it with "
        f"`flowrl eval --config CONFIG --checkpoint {checkpoint}` or remove the folder {path.parent}"
    )
    try:
        scores = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}); {fix}") from None
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno} column {err.colno}); {fix}"
        ) from None
    problem = scores_problem(scores)
    if problem:
        raise ValueError(f"{path} {problem}; {fix}")
    return scores


def scores_problem(scores: Any) -> str | None:
    """Why a scores.json cannot be shown (None when it follows the flowrl.training.evaluation schema well enough)."""
    if not isinstance(scores, dict):
        return f"holds a JSON {_kind(scores)}, not an object"
    for key, kind in (("prompts", list), ("seeds", list), ("samples", list), ("rewards", dict)):
        if key not in scores:
            return f"has no {key!r} {kind.__name__}"
        if not isinstance(scores[key], kind):
            return f"{key!r} is a JSON {_kind(scores[key])} ({_short(scores[key])}), not a {kind.__name__}"
    problem = (
        _items(scores["prompts"], "'prompts'", "a string", lambda v: isinstance(v, str))
        or _items(scores["seeds"], "'seeds'", "an integer", _is_int)
        or _rewards_problem(scores["rewards"])
    )
    if problem:
        return problem
    num_prompts = len(scores["prompts"])
    for i, sample in enumerate(scores["samples"]):
        problem = _sample_problem(sample, num_prompts)
        if problem:
            return f"sample {i} {problem}"
    per_prompt = scores.get("per_prompt", {})
    if not isinstance(per_prompt, dict):
        return f"'per_prompt' is a JSON {_kind(per_prompt)}, not an object of reward -> one value per prompt"
    for name, values in per_prompt.items():
        problem = _per_prompt_problem(values, f"per_prompt[{name!r}]", num_prompts)
        if problem:
            return problem
    means = scores.get("means", {})
    if not isinstance(means, dict):
        return f"'means' is a JSON {_kind(means)}, not an object of reward -> number"
    problem = _items(list(means.values()), "'means'", "a number or null", _is_number, keys=list(means))
    if problem:
        return problem
    diversity = scores.get("diversity", {})
    if not isinstance(diversity, dict):
        return f"'diversity' is a JSON {_kind(diversity)}, not an object with 'per_prompt' and 'mean'"
    if diversity.get("per_prompt") is not None:
        problem = _per_prompt_problem(diversity["per_prompt"], "diversity.per_prompt", num_prompts)
        if problem:
            return problem
    if not _is_number(diversity.get("mean")):
        return f"diversity.mean is {_short(diversity['mean'])}, not a number or null"
    return None


def _rewards_problem(rewards: dict[str, Any]) -> str | None:
    for key in ("train", "gold"):
        names = rewards.get(key, [])
        if not isinstance(names, list):
            return f"rewards.{key} is a JSON {_kind(names)} ({_short(names)}), not a list of reward names"
        problem = _items(names, f"rewards.{key}", "a reward name (string)", lambda v: isinstance(v, str))
        if problem:
            return problem
    return None


def _sample_problem(sample: Any, num_prompts: int) -> str | None:
    if not isinstance(sample, dict):
        return f"is a JSON {_kind(sample)}, not an object"
    index = sample.get("prompt_index")
    if not (_is_int(index) and 0 <= index < num_prompts):
        return f"has prompt_index {_short(index)}, not an integer in 0..{num_prompts - 1} ({num_prompts} prompts)"
    if not _is_int(sample.get("seed")):
        return f"has seed {_short(sample.get('seed'))}, not an integer"
    for key in ("image", "animation"):
        if (key == "image" or key in sample) and not (isinstance(sample.get(key), str) and sample[key]):
            return f"has {key} {_short(sample.get(key))}, not a file name relative to its eval folder"
    scores = sample.get("scores", {})
    if not isinstance(scores, dict):
        return f"has scores {_short(scores)}, not an object of reward -> number"
    for name, value in scores.items():
        if not _is_number(value):
            return f"has score {name!r} = {_short(value)}, not a number or null"
    return None


def _per_prompt_problem(values: Any, where: str, num_prompts: int) -> str | None:
    if not isinstance(values, list) or len(values) != num_prompts:
        held = f"{len(values)} values" if isinstance(values, list) else f"a JSON {_kind(values)}"
        return f"{where} holds {held}, not one value per prompt ({num_prompts})"
    return _items(values, where, "a number or null", _is_number)


def _items(values: list[Any], where: str, wanted: str, ok, keys: list[str] | None = None) -> str | None:
    for i, value in enumerate(values):
        if not ok(value):
            at = f"[{keys[i]!r}]" if keys is not None else f"[{i}]"
            return f"{where}{at} is {_short(value)}, not {wanted}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A score: a number, or null (not applicable)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _kind(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, bool, type(None))) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
