"""The Reward contract, in core: input checks every reward runs, and the checked call used by
`flowrl score`, `flowrl serve-reward` and the benchmarks; the check of a reward's settings before it is built.

Every error is one line naming the field, the value and the fix.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flowrl.types import RewardOutput


def check_inputs(
    name: str, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]], modality: str = "image"
) -> None:
    """Validate one reward call: images [N, 3, H, W] (video [N, F, 3, H, W]) float in [0, 1], N prompts/metadata."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"{name}: images is a {type(images).__name__}; pass a torch.Tensor")
    want = 4 if modality == "image" else 5
    layout = "[N, 3, H, W]" if modality == "image" else "[N, F, 3, H, W]"
    if images.dim() != want or images.shape[-3] != 3:
        raise ValueError(
            f"{name}: images shape {tuple(images.shape)} is not {layout}; pass RGB {modality}s channels-first"
        )
    if not images.is_floating_point():
        raise ValueError(f"{name}: images dtype {images.dtype} is not floating; convert with images.float() / 255")
    if images.shape[0] == 0:
        raise ValueError(f"{name}: images is an empty batch; pass at least one {modality}")
    if images.numel() > 0:
        lo, hi = float(images.detach().min()), float(images.detach().max())
        if not (lo >= 0.0 and hi <= 1.0):  # also catches NaN
            raise ValueError(
                f"{name}: images range [{lo:.4g}, {hi:.4g}] is outside [0, 1]; map [-1, 1] images with (x + 1) / 2 "
                "and clamp"
            )
    if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)):
        raise ValueError(f"{name}: prompts is a {type(prompts).__name__}; pass a list of strings, one per {modality}")
    if len(prompts) == 0:
        raise ValueError(f"{name}: prompts is empty; pass one prompt per {modality}")
    if len(prompts) != images.shape[0]:
        raise ValueError(
            f"{name}: {len(prompts)} prompts for {images.shape[0]} {modality}s; pass one prompt per {modality}"
        )
    if metadata is not None and len(metadata) != images.shape[0]:
        raise ValueError(
            f"{name}: {len(metadata)} metadata entries for {images.shape[0]} {modality}s; pass one dict per "
            f"{modality} (or [{{}}] * N)"
        )


def check_scores(name: str, scores: torch.Tensor, num: int) -> torch.Tensor:
    """A reward's output must be [N] floats; returns it as float32. +-inf is an error (NaN = not applicable)."""
    if not isinstance(scores, torch.Tensor):
        raise ValueError(
            f"{name}: returned scores of type {type(scores).__name__}; a reward must return "
            "RewardOutput(scores=[N] tensor)"
        )
    if scores.dim() != 1 or scores.shape[0] != num:
        raise ValueError(
            f"{name}: returned scores of shape {tuple(scores.shape)} for {num} samples; a reward must return [N] scores"
        )
    scores = scores.float()
    bad = torch.isinf(scores.detach()).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"{name}: non-finite score {float(scores[bad[0]])} at sample index {bad[0]}; fix the reward or drop that "
            "sample"
        )
    return scores


def score_checked(
    reward: Any, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
) -> RewardOutput:
    """Call a reward and check its output; a failure is reported with the reward's name and the sample index."""
    name = getattr(reward, "registry_name", type(reward).__name__)
    metadata = metadata if metadata is not None else [{} for _ in prompts]
    try:
        out = reward(images, prompts, metadata)
    except (ValueError, OSError):  # bad input, missing files, unreachable servers: not a per-sample failure
        raise
    except Exception as err:  # find the first sample that fails on its own, to name it
        index = _first_failing_index(reward, images, prompts, metadata)
        where = f"at sample index {index}" if index is not None else "on the batch"
        raise RuntimeError(f"reward {name} raised {type(err).__name__} {where}: {err}") from err
    if not isinstance(out, RewardOutput):
        raise ValueError(f"{name}: returned {type(out).__name__}; a reward must return flowrl.types.RewardOutput")
    out.scores = check_scores(name, out.scores, len(prompts))
    return out


def _first_failing_index(
    reward: Any, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]
) -> int | None:
    for i in range(len(prompts)):
        try:
            reward(images[i : i + 1], prompts[i : i + 1], metadata[i : i + 1])
        except Exception:
            return i
    return None


def nan_to_none(values: list[float]) -> list[float | None]:
    """JSON has no NaN: "not applicable" travels as null."""
    return [None if (v is None or math.isnan(v)) else v for v in values]


def check_settings(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` (`--set` pairs) checked against reward `name`'s constructor: a setting it lacks (or misses) is a
    one-line error; returned as given."""
    import difflib
    import inspect

    from flowrl.registry import REWARDS

    cls = REWARDS.get(name)
    for key in ("device", "dtype"):
        if key in kwargs:
            raise ValueError(f"--set {key}=... is not a reward setting; pass --{key} {kwargs[key]} instead")
    params = inspect.signature(cls).parameters
    settings = [
        k for k, p in params.items() if k not in ("device", "dtype") and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        for key in kwargs:
            if key not in params:
                close = difflib.get_close_matches(key, settings, n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ValueError(
                    f"--set {key}=...: reward {name!r} has no setting {key!r}{hint}; "
                    f"its settings are {', '.join(settings) or 'none'}"
                )
    for key in settings:
        if params[key].default is inspect.Parameter.empty and key not in kwargs:
            raise ValueError(f"reward {name!r} needs the setting {key!r}; pass --set {key}=VALUE")
    return kwargs
