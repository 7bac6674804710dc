"""`flowrl bench balancers`: every multi-reward balancer (and SMOPD) on the Shapes world's multi-reward bed.

    flowrl bench balancers --json runs/bench/balancers.json                    # 3 seeds, the configs' 20 steps
    flowrl bench balancers --json runs/b.json --balancers weighted_sum,marble --seeds 0 num_steps=10

The bed (docs/results/balancers.md#the-bed): four rewards of different granularity and scale that the world sets
against each other: `toy_attributes` (the attribute judge, 0-1), `toy_artifact` (the artifact judge's log-odds of a
clean image, ~9), `toy_size` (the shapes' mean area, ~50 px, dense) and `toy_midline` (every shape on the middle
row, binary, base rate ~10%). Each balancer is a `configs/toy/multireward_*.yaml` (DiffusionNFT on the four; `tail`,
`marble_full` and `weighted_sum_tuned` change the balancer or the weights of another config), trained `num_steps`
steps per seed with the same loop; `single_<reward>` is the weighted-sum config with that reward alone. Per run:

* the change of each reward from the base model on the held-out split (every held-out prompt x fixed seeds, ODE
  sampler), each graded by an exact gold: the attribute reward by the rule-based `toy_exact` checker (accuracy),
  the layout rewards are their own gold (rules on the pixels), the artifact judge by its own log-odds;
* for the unit-weight weighted sum (and MARBLE, on the steps that take them anyway), the fraction of optimizer steps
  where some reward's own gradient (its per-prompt z-score advantages through the NFT loss) has a negative cosine with
  the update that was applied (`train.log_reward_gradients`);
* the step time, less the time those probe gradients took; SMOPD's teachers are billed apart (`offline_s`).

The bed's validity: `single_reward_gain` (each reward trained alone, per seed) and `single_reward_cross` (what the
other rewards did meanwhile); `conflicts` lists the (trained, lowered) pairs lowered on at least 2 of 3 seeds.
`keeps_half` marks, per balancer and seed, whether every reward kept at least half its single-reward gain (MARBLE's
claim). `marble_step_ratio` is amortized MARBLE's median step time over the weighted sum's, their steps interleaved
in one process (no probe). `world_by_count` is the layout rewards of the world's own renders by shape count.
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from pathlib import Path

from flowrl.bench.trainers import REPO, _write_json

TOY_CONFIGS = REPO / "configs" / "toy"
REWARDS = ("toy_attributes", "toy_artifact", "toy_size", "toy_midline")
REWARD_SPECS = {  # each reward as the bed's configs list it (the artifact judge's log-odds)
    "toy_attributes": "{name: toy_attributes}",
    "toy_artifact": "{name: toy_artifact, output: log_odds}",
    "toy_size": "{name: toy_size}",
    "toy_midline": "{name: toy_midline}",
}
# Weights that give each reward the same spread: 1 / its mean within-prompt std on the base model's samples of the
# train prompts (8 samples each, seeds 1000-1223: 0.473 / 1.42 / 15.9 / 0.207), scaled to 1 on the attribute reward.
TUNED_WEIGHTS = {"toy_attributes": 1.0, "toy_artifact": 0.33, "toy_size": 0.03, "toy_midline": 2.3}
BALANCER_RUNS = {  # name: (config stem, overrides)
    "weighted_sum": ("multireward_weighted_sum", []),
    "weighted_sum_tuned": (
        "multireward_weighted_sum",
        [f"rewards.{i}.weight={TUNED_WEIGHTS[r]}" for i, r in enumerate(REWARDS)],
    ),
    "gdpo": ("multireward_gdpo", []),
    "gd2po": ("multireward_gd2po", []),
    "sa_mrpo": ("multireward_sa_mrpo", []),
    "tail": ("multireward_weighted_sum", ["balancer={name: tail}"]),
    "marble": ("multireward_marble", []),
    "marble_full": ("multireward_marble", ["balancer.form=full"]),
    "smopd": ("multireward_smopd", []),
}
SINGLE_RUNS = {f"single_{r}": ("multireward_weighted_sum", [f"rewards=[{spec}]"]) for r, spec in REWARD_SPECS.items()}
AXES = {  # each reward's measure (its gold), as the figure labels it
    "toy_attributes": "exact accuracy (toy_attributes)",
    "toy_artifact": "artifact log-odds",
    "toy_size": "mean shape area, px",
    "toy_midline": "midline rate",
}
PROBED = ("weighted_sum",)  # per-reward gradient cosines logged (MARBLE has them on its refresh / full steps)


def heldout_rewards(model, num_seeds: int, num_steps: int, guidance_scale: float) -> dict[str, float]:
    """Every held-out prompt x `num_seeds` fixed seeds, each reward by its exact gold: attribute accuracy (toy_exact),
    mean artifact log-odds, mean shape area (px), midline rate."""
    from flowrl.heldout import exact_accuracy, sample_images
    from flowrl.registry import REWARDS as REGISTRY
    from flowrl.seeds import heldout_seeds
    from flowrl.toy.world import split_prompts

    base = split_prompts("heldout")
    prompts = [p for p in base for _ in range(num_seeds)]
    seeds = heldout_seeds(len(base), num_seeds)
    images = sample_images(model, prompts, seeds, num_steps, guidance_scale)
    meta = [{} for _ in prompts]

    def mean(name: str, **kwargs) -> float:
        return float(REGISTRY.build(name, **kwargs)(images, prompts, meta).scores.float().mean())

    return {
        "toy_attributes": exact_accuracy(images, prompts)["accuracy"],
        "toy_artifact": mean("toy_artifact", output="log_odds"),
        "toy_size": mean("toy_size"),
        "toy_midline": mean("toy_midline"),
    }


@functools.lru_cache(maxsize=1)
def world_by_count(num_per_spec: int = 30) -> dict[str, dict[str, float]]:
    """The layout rewards of the world's own renders (every prompt x `num_per_spec` seeds) by shape count: mean
    shape area and midline rate. The world shrinks three shapes to fit them apart, and rarely lines them up."""
    import torch

    from flowrl.registry import REWARDS as REGISTRY
    from flowrl.toy.world import ALL_SPECS, render_batch

    specs = [spec for spec in ALL_SPECS for _ in range(num_per_spec)]
    images = render_batch(specs, list(range(len(specs))))
    prompts, meta = [s.prompt for s in specs], [{} for _ in specs]
    size = REGISTRY.build("toy_size")(images, prompts, meta).scores
    midline = REGISTRY.build("toy_midline")(images, prompts, meta).scores
    counts = torch.tensor([s.count for s in specs])
    return {
        str(n): {
            "toy_size": round(float(size[counts == n].mean()), 3),
            "toy_midline": round(float(midline[counts == n].mean()), 4),
        }
        for n in sorted(set(counts.tolist()))
    }


def _fixed(root: str, name: str, seed: int) -> list[str]:
    return [
        f"seed={seed}",
        f"output_dir={root}",
        f"name=bench_{name}_{seed}",
        "logging.trackers=[]",
        "logging.progress_bar=false",
        "checkpoint.every_n_steps=0",
        "eval.every_n_steps=0",
    ]


def _trainer(stem: str, extra: list[str], root: str, name: str, seed: int, overrides: list[str]):
    from flowrl.trainers import build_trainer, load_config

    return build_trainer(load_config(TOY_CONFIGS / f"{stem}.yaml", [*_fixed(root, name, seed), *extra, *overrides]))


def _measure(trainer, num_seeds: int, eval_steps: int | None, step: int | None) -> dict[str, float]:
    import torch

    weights, _ = trainer.parts.evaluation.weights(step)  # the base at None, else what the recipe evaluates
    with torch.random.fork_rng(), weights:
        trainer.parts.model.transformer.eval()
        cfg = trainer.parts.cfg
        return heldout_rewards(
            trainer.parts.model, num_seeds, eval_steps or cfg.eval.num_steps, cfg.eval.guidance_scale
        )


def _run(name: str, stem: str, extra: list[str], seed: int, overrides: list[str], num_seeds: int, eval_steps) -> dict:
    """One balancer x seed: base and final held-out rewards, opposed fraction, step seconds (probe time taken out)."""
    with tempfile.TemporaryDirectory() as root:
        probe = ["train.log_reward_gradients=true"] if name in PROBED else []
        trainer = _trainer(stem, [*extra, *probe], root, name, seed, overrides)
        manifest = getattr(trainer, "teacher_manifest", None)  # SMOPD's teachers, trained at construction
        offline_s = manifest["seconds"] if manifest else None
        try:
            base = _measure(trainer, num_seeds, eval_steps, None)
            step_s, opposed = [], []
            for _ in range(trainer.parts.cfg.num_steps):
                tic = time.perf_counter()
                metrics = trainer.train_step()
                step_s.append(time.perf_counter() - tic - metrics.get("perf/reward_gradients_probe_s", 0.0))
                if "marble/opposed" in metrics:
                    opposed.append(metrics["marble/opposed"])
            final = _measure(trainer, num_seeds, eval_steps, trainer.parts.step)
        finally:
            trainer.parts.scorer.close()
    trained = [r.name for r in trainer.parts.cfg.rewards]
    return {
        "delta": {r: round(final[r] - base[r], 5) for r in REWARDS},
        "base": base,
        "final": final,
        "rewards": trained,
        "opposed_fraction": statistics.mean(opposed) if opposed else None,
        "step_s": statistics.median(step_s),
        "offline_s": offline_s,
        "alpha": {k.split("/")[-1]: v for k, v in metrics.items() if k.startswith("marble/alpha/")},
        "fallbacks": metrics.get("marble/fallbacks"),
    }


def side_by_side(overrides: list[str], num_steps: int) -> dict[str, float]:
    """Median step seconds of the weighted sum and amortized MARBLE, their steps interleaved."""
    with tempfile.TemporaryDirectory() as root:
        trainers = {
            "weighted_sum": _trainer("multireward_weighted_sum", [], root, "time_ws", 0, overrides),
            "marble": _trainer("multireward_marble", [], root, "time_marble", 0, overrides),
        }
        seconds = {name: [] for name in trainers}
        try:
            for _ in range(num_steps):
                for name, trainer in trainers.items():
                    tic = time.perf_counter()
                    trainer.train_step()
                    seconds[name].append(time.perf_counter() - tic)
        finally:
            for trainer in trainers.values():
                trainer.parts.scorer.close()
    return {name: statistics.median(s) for name, s in seconds.items()}


ALL_RUNS = {**SINGLE_RUNS, **BALANCER_RUNS}


def balancer_order(balancers: list[str] | None) -> list[str]:
    """The runs to make, single-reward ones first (default: every single-reward run and every balancer)."""
    if balancers is None:
        return list(ALL_RUNS)
    if not balancers:
        raise ValueError(f"--balancers is empty; name some of {', '.join(ALL_RUNS)} (default: all)")
    for name in balancers:
        if name not in ALL_RUNS:
            raise ValueError(f"--balancers {name!r} is not one of {', '.join(ALL_RUNS)}")
        if balancers.count(name) > 1:
            raise ValueError(f"--balancers names {name!r} twice; name each balancer once")
    return [name for name in ALL_RUNS if name in balancers]


def bench_balancers(
    balancers: list[str] | None = None,
    seeds: list[int] | tuple[int, ...] = (0, 1, 2),
    overrides: list[str] | None = None,
    out_json: str | Path | None = None,
    num_seeds: int = 8,
    eval_num_steps: int | None = None,
    timing_steps: int = 6,
) -> dict:
    """Run every named run (default: the single-reward runs and every balancer) on every seed; returns (and writes
    after each run) the JSON. `timing_steps=0` skips the side-by-side timing, and no seeds runs only the timing
    (parts to `merge_balancers`)."""
    import platform

    import torch

    names = balancer_order(balancers)
    overrides = list(overrides or [])
    if not seeds and timing_steps == 0:
        raise ValueError("--timing-only with --timing-steps 0 measures nothing; give --timing-steps N >= 1")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {','.join(map(str, seeds))} repeats a seed; name each once")
    from flowrl.trainers import load_config

    with tempfile.TemporaryDirectory() as root:  # a bad override fails before any run
        load_config(TOY_CONFIGS / "multireward_marble.yaml", [*_fixed(root, "check", 0), *overrides])
    runs: dict[str, dict[int, dict]] = {}
    settings = {"seeds": list(seeds), "heldout_seeds": num_seeds, "eval_num_steps": eval_num_steps}
    host = {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform()}
    result: dict = {}
    for name in names:
        stem, extra = ALL_RUNS[name]
        for seed in seeds:
            runs.setdefault(name, {})[seed] = _run(name, stem, extra, seed, overrides, num_seeds, eval_num_steps)
            result = balancers_result(runs, None, overrides, settings, host)
            if out_json is not None:
                _write_json(result, Path(out_json))
    timing = side_by_side(overrides, timing_steps) if timing_steps > 0 else None
    result = balancers_result(runs, timing, overrides, settings, host)
    if out_json is not None:
        _write_json(result, Path(out_json))
        if runs:
            pareto_figure(result, Path(out_json).with_suffix(".png"))
    return result


def _by_seed(by_seed: dict, key) -> list:
    return [key(run) for _, run in sorted(by_seed.items())]


def balancers_result(runs: dict, timing: dict | None, overrides: list[str], settings: dict, host: dict) -> dict:
    """The JSON: the bed's validity (single-reward gains and what they cost the others), per balancer and reward the
    change per seed, whether each kept half of every single-reward gain, opposed fractions, step seconds, timing."""
    balancers = {name: by_seed for name, by_seed in runs.items() if name in BALANCER_RUNS}
    singles = {name.removeprefix("single_"): by_seed for name, by_seed in runs.items() if name in SINGLE_RUNS}
    gain = {r: {seed: run["delta"][r] for seed, run in by_seed.items()} for r, by_seed in singles.items()}
    cross = {
        r: {o: _by_seed(by_seed, lambda run, o=o: run["delta"][o]) for o in REWARDS} for r, by_seed in singles.items()
    }
    conflicts = [
        {"trained": r, "lowered": o, "seeds_lowered": sum(v < 0 for v in deltas), "of": len(deltas)}
        for r, row in cross.items()
        for o, deltas in row.items()
        if o != r and len(deltas) >= 2 and sum(v < 0 for v in deltas) >= 2
    ]
    per_reward_delta = {
        name: {r: _by_seed(by_seed, lambda run, r=r: run["delta"][r]) for r in REWARDS}
        for name, by_seed in balancers.items()
    }
    keeps_half = {  # per seed: every reward's change >= half its single-reward gain there (None: no single-reward run)
        name: [
            all(run["delta"][r] >= 0.5 * gain[r][seed] for r in REWARDS)
            if all(seed in gain.get(r, {}) for r in REWARDS)
            else None
            for seed, run in sorted(by_seed.items())
        ]
        for name, by_seed in balancers.items()
    }
    opposed = {
        name: [r["opposed_fraction"] for r in s.values() if r["opposed_fraction"] is not None]
        for name, s in runs.items()
    }
    return {
        "marble_step_ratio": round(timing["marble"] / timing["weighted_sum"], 4) if timing else None,
        "side_by_side_step_s": timing,
        "single_reward_gain": {r: [v for _, v in sorted(by_seed.items())] for r, by_seed in gain.items()},
        "single_reward_rises_every_seed": {r: all(v > 0 for v in by_seed.values()) for r, by_seed in gain.items()},
        "single_reward_cross": cross,
        "conflicts": conflicts,
        "per_reward_delta": per_reward_delta,
        "keeps_half": keeps_half,
        "keeps_half_seeds": {name: sum(bool(v) for v in flags) for name, flags in keeps_half.items()},
        "opposed_fraction": {
            name: statistics.mean(v) if v else None for name, v in opposed.items() if name in balancers
        },
        "step_s": {name: statistics.median(r["step_s"] for r in by_seed.values()) for name, by_seed in runs.items()},
        "offline_s": {  # the runs with work done before their steps (SMOPD's teachers)
            name: _by_seed(s, lambda run: run["offline_s"])
            for name, s in runs.items()
            if any(run["offline_s"] is not None for run in s.values())
        },
        "alpha": {name: [r["alpha"] for r in s.values()] for name, s in balancers.items() if name.startswith("marble")},
        "fallbacks": {
            name: [r["fallbacks"] for r in s.values()] for name, s in balancers.items() if name.startswith("marble")
        },
        "base": next(iter(next(iter(runs.values())).values()))["base"] if runs else None,
        "world_by_count": world_by_count(),
        "runs": {name: {str(seed): run for seed, run in by_seed.items()} for name, by_seed in runs.items()},
        "overrides": list(overrides),
        "settings": settings,
        "host": host,
    }


def pareto_figure(result: dict, path: str | Path) -> Path:
    """A scatter per reward pair of each run's mean change over its seeds (balancers and single-reward runs), the
    Pareto front joined, the base at the origin: the PNG of a balancers JSON (written beside it)."""
    import itertools
    import math

    from flowrl.report.curves import draw_pareto, figure_png, new_figure

    means = {
        name: {r: statistics.mean(run["delta"][r] for run in by_seed.values()) for r in REWARDS}
        for name, by_seed in result["runs"].items()
    }
    pairs = list(itertools.combinations(REWARDS, 2))
    figure, axes = new_figure(math.ceil(len(pairs) / 3), 3, 13, 3.6 * math.ceil(len(pairs) / 3))
    for ax, (a, b) in zip(axes.flat, pairs):
        draw_pareto(
            ax,
            {n.replace("single_toy_", "only "): (m[a], m[b]) for n, m in means.items()},
            f"Δ {AXES[a]}",
            f"Δ {AXES[b]}",
            (0, 0),
        )
    seeds = ",".join(map(str, result["settings"]["seeds"]))
    figure.suptitle(f"change from the base, mean over seeds {seeds}: the Pareto front (line), the base (x)", fontsize=9)
    figure.tight_layout()
    Path(path).write_bytes(figure_png(figure))
    return Path(path)


def merge_balancers(paths: list[str | Path], out_json: str | Path | None = None) -> dict:
    """One bench from parts run apart (e.g. a process per seed): their runs pooled. The parts must agree on the
    overrides and the held-out evaluation (a timing-only part on the overrides), repeat no (balancer, seed) run,
    and at most one may carry the side-by-side timing (run the others with --timing-steps 0)."""
    import json

    if len(paths) < 2:
        raise ValueError(
            f"--merge names {len(paths)} file(s); name at least two balancer JSONs, e.g. --merge s0.json s1.json"
        )
    runs: dict[str, dict[int, dict]] = {}
    first, timing, timed_by, first_path = None, None, None, None
    overrides: list[tuple] = []  # (path, overrides) of the timing-only parts
    for path in paths:
        part = json.loads(Path(path).read_text())
        same = {k: v for k, v in part["settings"].items() if k != "seeds"}, part["overrides"]
        if not part["runs"]:  # a timing-only part: no held-out evaluation to agree on, only the overrides
            overrides.append((path, part["overrides"]))
        elif first is None:
            first, host, first_path = same, part["host"], path
        elif same != first:
            raise ValueError(
                f"{path}: its settings or overrides {same} differ from {first_path}'s {first}; merge like benches only"
            )
        if part["side_by_side_step_s"] is not None:
            if timing is not None:
                raise ValueError(
                    f"{path} and {timed_by} both carry a side-by-side timing; "
                    "run all parts but one with --timing-steps 0"
                )
            timing, timed_by = part["side_by_side_step_s"], path
        for name, by_seed in part["runs"].items():
            for seed, run in by_seed.items():
                if int(seed) in runs.get(name, {}):
                    raise ValueError(f"{path}: {name} seed {seed} is in two of the files; merge each run once")
                runs.setdefault(name, {})[int(seed)] = run
    if first is None:
        raise ValueError(
            f"none of {', '.join(map(str, paths))} has runs; merge seed parts (and at most one timing part)"
        )
    for path, other in overrides:
        if other != first[1]:
            raise ValueError(
                f"{path}: its overrides {other} differ from {first_path}'s {first[1]}; merge like benches only"
            )
    order = [n for n in ALL_RUNS if n in runs]
    runs = {name: dict(sorted(runs[name].items())) for name in order}
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    result = balancers_result(runs, timing, first[1], {**first[0], "seeds": seeds}, host)
    if out_json is not None:
        _write_json(result, Path(out_json))
        pareto_figure(result, Path(out_json).with_suffix(".png"))
    return result
