"""The race priced at real size: each toy run's counted work (flowrl.work) at SD3.5-Medium's price.

The race (flowrl.bench.trainers) records, at every measured point of a run, the work its steps did so far: transformer
rows forward and backward, previews, decodes, text encodes, reward calls. Here that work is priced as if the same
recipe ran on SD3.5-Medium at 512 px (flowrl.plan.cost: FLOPs counted on the real architecture, the GPU's peak, an
efficiency η): on an H100, whose previews run in FP8, and on a B200, whose previews run in NVFP4. A toy reward is
priced as a CLIP ViT-H-14 reward (PickScore's backbone).

What the projection assumes (docs/results/trainers.md says it again beside the numbers): the steps a recipe needs to
reach a target transfer from the toy world to the real model, and a step's work keeps the toy recipe's structure
(samples, steps, trained transitions, guidance) at the real model's price per unit. Speed-ups do not depend on η (every
term is divided by it); seconds are given at η = 0.11 (research code, docs/cost.md).
"""

from __future__ import annotations

import functools
import statistics

PRICED_AS = ("sd3.5-medium", 512, 512, None)
PREVIEW_FORMAT = {"h100": "fp8", "b200": "nvfp4"}  # the GPUs the race is priced on, and the format their previews run
BASELINES = ("grpo_flowgrpo", "dancegrpo")  # Flow-GRPO's and DanceGRPO's structures (configs/toy/*.yaml)
ETA = "research"


def median_if_most(values: list) -> float | None:
    """Median of the non-null values; null when fewer than half of all the values are non-null (or none are)."""
    reached = [v for v in values if v is not None]
    if not reached or len(reached) < len(values) / 2:
        return None
    return statistics.median(reached)


@functools.cache
def _size():
    from flowrl.plan import cost

    family, height, width, frames = PRICED_AS
    return cost.real_size(family, height, width, frames)


def race_work(work: dict[str, float], gpu: str) -> dict[str, float]:
    """`work` with the toy's preview pass (`preview`: the policy at a few steps, on the CPU) priced at the format the
    GPU's previews run (`PREVIEW_FORMAT`)."""
    out: dict[str, float] = {}
    for key, value in work.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[2] in ("forward", "forward_grad", "recompute") and parts[3] == "preview":
            key = "/".join([*parts[:3], PREVIEW_FORMAT[gpu]])
        out[key] = out.get(key, 0.0) + value
    return out


def projected_seconds(work: dict[str, float], gpu: str) -> float:
    """GPU-seconds of `work` at SD3.5-Medium 512 px on `gpu` (η research)."""
    from flowrl.plan import cost

    return cost.price(race_work(work, gpu), _size(), gpu, cost.ETA[ETA])["seconds"]


def projected_curve(run: dict, gpu: str) -> list[float] | None:
    """Projected seconds at each measured point of a run (None for a run recorded without its work)."""
    if not run.get("work_curve"):
        return None
    return [round(projected_seconds(w, gpu), 3) for w in run["work_curve"]]


def projection(runs: dict[str, dict[int, dict]], seeds: list[int], main_baseline: str) -> dict | None:
    """Projected seconds to each baseline's median final accuracy, per recipe and seed, and the speed-ups
    {gpu: {baseline: {recipe: x}}} (the baseline's median projected seconds over the recipe's). Baselines: the race's
    own and `BASELINES`, each once every seed of it ran. None when no run recorded its work."""
    if not any(run.get("work_curve") for by_seed in runs.values() for run in by_seed.values()):
        return None
    baselines = [b for b in dict.fromkeys([main_baseline, *BASELINES]) if b in runs and len(runs[b]) == len(seeds)]
    targets = {b: statistics.median(run["curve"][-1][2] for run in runs[b].values()) for b in baselines}
    per_recipe: dict[str, dict] = {}
    speedup: dict[str, dict] = {gpu: {b: {} for b in baselines} for gpu in PREVIEW_FORMAT}
    for name, by_seed in runs.items():
        entry = per_recipe[name] = {"seconds_to_target": {gpu: {} for gpu in PREVIEW_FORMAT}, "work_per_step": None}
        last = next(iter(by_seed.values()))
        if last.get("work_curve"):
            steps = last["curve"][-1][0]
            entry["work_per_step"] = (
                {k: round(v / steps, 3) for k, v in last["work_curve"][-1].items()} if steps else None
            )
        for gpu in PREVIEW_FORMAT:
            curves = {seed: projected_curve(run, gpu) for seed, run in by_seed.items()}
            entry.setdefault("curves", {})[gpu] = list(curves.values())
            for b, target in targets.items():
                seconds = []
                for seed, run in by_seed.items():
                    index = next((i for i, p in enumerate(run["curve"]) if p[2] >= target), None)
                    seconds.append(None if index is None or curves[seed] is None else curves[seed][index])
                entry["seconds_to_target"][gpu][b] = seconds
    for gpu in PREVIEW_FORMAT:
        for b in baselines:
            reference = median_if_most(per_recipe[b]["seconds_to_target"][gpu][b])
            for name in runs:
                mine = median_if_most(per_recipe[name]["seconds_to_target"][gpu][b])
                speedup[gpu][b][name] = round(reference / mine, 3) if reference and mine else None
    return {
        "priced_as": {"family": PRICED_AS[0], "height": PRICED_AS[1], "width": PRICED_AS[2]},
        "preview_format": dict(PREVIEW_FORMAT),
        "eta": ETA,
        "assumes": (
            "steps to a target transfer from the toy world; a step's work keeps the toy recipe's structure at "
            "SD3.5-Medium 512 px's price per unit (flowrl.plan.projection)"
        ),
        "targets": targets,
        "recipes": per_recipe,
        "projected_speedup": speedup,
    }
