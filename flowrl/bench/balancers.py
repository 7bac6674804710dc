"""`flowrl bench balancers`: every multi-reward balancer on three conflicting toy rewards, from one base model.

    flowrl bench balancers --json runs/bench/balancers.json                    # 3 seeds, the configs' 20 steps
    flowrl bench balancers --json runs/b.json --balancers weighted_sum,marble --seeds 0 num_steps=10

Each balancer is a `configs/toy/multireward_*.yaml` (DiffusionNFT on toy_attributes + toy_artifact +
jpeg_compressibility; `tail` and `marble_full` are the weighted-sum and MARBLE configs with the balancer changed),
trained `num_steps` steps per seed with the same loop. Per run:

* the change of each reward from the base model on the held-out split (every held-out prompt x fixed seeds, ODE
  sampler): the attribute reward graded by the exact rule-based `toy_exact` checker (accuracy, as the race does),
  the artifact judge's and the JPEG reward's means;
* the fraction of optimizer steps where some reward's own gradient (its per-prompt z-score advantages, through the
  NFT loss) has a negative cosine with the update that was applied (`train.log_reward_gradients`);
* the step time, less the time those probe gradients took (they are not part of any balancer but full MARBLE).

`single_reward_delta` is configs/toy/nft.yaml (the attribute reward alone) on the same seeds, the single-reward
demo to beat. `marble_step_ratio` is amortized MARBLE's median step time over single-reward NFT's, their steps
interleaved in one process (no probe), and `marble_weighted_sum_step_ratio` the same against the weighted sum.
`jpeg_by_count` is the JPEG reward of the world's own renders by shape count: the conflict the three rewards build in.
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
REWARDS = ("toy_attributes", "toy_artifact", "jpeg_compressibility")
BALANCER_RUNS = {  # name: (config stem, overrides)
    "weighted_sum": ("multireward_weighted_sum", []),
    "gdpo": ("multireward_gdpo", []),
    "gd2po": ("multireward_gd2po", []),
    "sa_mrpo": ("multireward_sa_mrpo", []),
    "tail": ("multireward_weighted_sum", ["balancer={name: tail}"]),
    "marble": ("multireward_marble", []),
    "marble_full": ("multireward_marble", ["balancer.form=full"]),
}
SINGLE = "nft"  # configs/toy/nft.yaml: the single-reward demo


def heldout_rewards(model, num_seeds: int, num_steps: int, guidance_scale: float) -> dict[str, float]:
    """Every held-out prompt x `num_seeds` fixed seeds: exact attribute accuracy (toy_exact), mean artifact and JPEG
    rewards."""
    from flowrl.bench.accuracy import exact_accuracy, sample_images
    from flowrl.registry import REWARDS as REGISTRY
    from flowrl.seeds import heldout_seeds
    from flowrl.toy.world import split_prompts

    base = split_prompts("heldout")
    prompts = [p for p in base for _ in range(num_seeds)]
    seeds = heldout_seeds(len(base), num_seeds)
    images = sample_images(model, prompts, seeds, num_steps, guidance_scale)
    meta = [{} for _ in prompts]
    return {
        "toy_attributes": exact_accuracy(images, prompts)["accuracy"],
        "toy_artifact": float(REGISTRY.build("toy_artifact")(images, prompts, meta).scores.mean()),
        "jpeg_compressibility": float(REGISTRY.build("jpeg_compressibility")(images, prompts, meta).scores.mean()),
    }


@functools.lru_cache(maxsize=1)
def jpeg_by_count(num_per_spec: int = 30) -> dict[str, dict[str, float]]:
    """The JPEG reward of the world's own renders (every prompt x `num_per_spec` seeds) by shape count: mean and
    within-count std. Each shape adds to the file, so on a "three ..." prompt the JPEG reward prefers a wrong count:
    the conflict between toy_attributes and jpeg_compressibility that no balancer can remove."""
    import torch

    from flowrl.registry import REWARDS as REGISTRY
    from flowrl.toy.world import ALL_SPECS, render_batch

    specs = [spec for spec in ALL_SPECS for _ in range(num_per_spec)]
    images = render_batch(specs, list(range(len(specs))))
    scores = REGISTRY.build("jpeg_compressibility")(images, [s.prompt for s in specs], [{} for _ in specs]).scores
    counts = torch.tensor([s.count for s in specs])
    return {
        str(n): {"mean": round(float(scores[counts == n].mean()), 4), "std": round(float(scores[counts == n].std()), 4)}
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
        return heldout_rewards(trainer.parts.model, num_seeds, eval_steps or cfg.eval.num_steps, cfg.eval.guidance_scale)


def _run(name: str, stem: str, extra: list[str], seed: int, overrides: list[str], num_seeds: int, eval_steps) -> dict:
    """One balancer x seed: base and final held-out rewards, opposed fraction, step seconds (probe time taken out)."""
    with tempfile.TemporaryDirectory() as root:
        probe = ["train.log_reward_gradients=true"] if name != SINGLE else []
        trainer = _trainer(stem, [*extra, *probe], root, name, seed, overrides)
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
    return {
        "delta": {r: round(final[r] - base[r], 5) for r in REWARDS},
        "base": base,
        "final": final,
        "opposed_fraction": statistics.mean(opposed) if opposed else None,
        "step_s": statistics.median(step_s),
        "alpha": {k.split("/")[-1]: v for k, v in metrics.items() if k.startswith("marble/alpha/")},
        "fallbacks": metrics.get("marble/fallbacks"),
    }


def side_by_side(overrides: list[str], num_steps: int) -> dict[str, float]:
    """Median step seconds of single-reward NFT, the weighted sum and amortized MARBLE, their steps interleaved."""
    with tempfile.TemporaryDirectory() as root:
        trainers = {
            SINGLE: _trainer(SINGLE, [], root, "time_nft", 0, overrides),
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


def balancer_order(balancers: list[str] | None) -> list[str]:
    if balancers is None:
        return list(BALANCER_RUNS)
    if not balancers:
        raise ValueError(f"--balancers is empty; name some of {', '.join(BALANCER_RUNS)} (default: all)")
    for name in balancers:
        if name not in BALANCER_RUNS:
            raise ValueError(f"--balancers {name!r} is not one of {', '.join(BALANCER_RUNS)}")
        if balancers.count(name) > 1:
            raise ValueError(f"--balancers names {name!r} twice; name each balancer once")
    return list(balancers)


def bench_balancers(
    balancers: list[str] | None = None,
    seeds: list[int] | tuple[int, ...] = (0, 1, 2),
    overrides: list[str] | None = None,
    out_json: str | Path | None = None,
    num_seeds: int = 4,
    eval_num_steps: int | None = None,
    timing_steps: int = 6,
) -> dict:
    """Run every balancer (and single-reward NFT) on every seed; returns (and writes after each run) the JSON.
    `timing_steps=0` skips the side-by-side timing, and no seeds runs only the timing (parts to `merge_balancers`)."""
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
    for name in [SINGLE, *names]:
        stem, extra = (SINGLE, []) if name == SINGLE else BALANCER_RUNS[name]
        for seed in seeds:
            runs.setdefault(name, {})[seed] = _run(name, stem, extra, seed, overrides, num_seeds, eval_num_steps)
            result = balancers_result(runs, None, overrides, settings, host)
            if out_json is not None:
                _write_json(result, Path(out_json))
    timing = side_by_side(overrides, timing_steps) if timing_steps > 0 else None
    result = balancers_result(runs, timing, overrides, settings, host)
    if out_json is not None:
        _write_json(result, Path(out_json))
    return result


def balancers_result(runs: dict, timing: dict | None, overrides: list[str], settings: dict, host: dict) -> dict:
    """The JSON: per balancer and reward the change per seed, opposed fractions, step seconds, the timing ratios."""
    balancers = {name: by_seed for name, by_seed in runs.items() if name != SINGLE}
    single = runs.get(SINGLE, {})
    per_reward_delta = {
        name: {r: [run["delta"][r] for run in by_seed.values()] for r in REWARDS} for name, by_seed in balancers.items()
    }
    return {
        "marble_step_ratio": round(timing["marble"] / timing[SINGLE], 4) if timing else None,
        "marble_weighted_sum_step_ratio": round(timing["marble"] / timing["weighted_sum"], 4) if timing else None,
        "side_by_side_step_s": timing,
        "per_reward_delta": per_reward_delta,
        "single_reward_delta": {"toy_attributes": [run["delta"]["toy_attributes"] for run in single.values()]},
        "improves_every_reward_every_seed": {
            name: all(v > 0 for values in deltas.values() for v in values) for name, deltas in per_reward_delta.items()
        },
        "opposed_fraction": {
            name: statistics.mean(v)
            if (v := [r["opposed_fraction"] for r in s.values() if r["opposed_fraction"] is not None])
            else None
            for name, s in balancers.items()
        },
        "step_s": {name: statistics.median(r["step_s"] for r in by_seed.values()) for name, by_seed in runs.items()},
        "alpha": {name: [r["alpha"] for r in s.values()] for name, s in balancers.items() if name.startswith("marble")},
        "fallbacks": {name: [r["fallbacks"] for r in s.values()] for name, s in balancers.items() if name.startswith("marble")},
        "base": next(iter(next(iter(runs.values())).values()))["base"] if runs else None,
        "jpeg_by_count": jpeg_by_count(),
        "runs": {name: {str(seed): run for seed, run in by_seed.items()} for name, by_seed in runs.items()},
        "overrides": list(overrides),
        "settings": settings,
        "host": host,
    }


def merge_balancers(paths: list[str | Path], out_json: str | Path | None = None) -> dict:
    """One bench from parts run apart (e.g. a process per seed): their runs pooled. The parts must agree on the
    overrides and the held-out evaluation (a timing-only part on the overrides), repeat no (balancer, seed) run,
    and at most one may carry the side-by-side timing (run the others with --timing-steps 0)."""
    import json

    if len(paths) < 2:
        raise ValueError(f"--merge names {len(paths)} file(s); name at least two balancer JSONs, e.g. --merge s0.json s1.json")
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
                    f"{path} and {timed_by} both carry a side-by-side timing; run all parts but one with --timing-steps 0"
                )
            timing, timed_by = part["side_by_side_step_s"], path
        for name, by_seed in part["runs"].items():
            for seed, run in by_seed.items():
                if int(seed) in runs.get(name, {}):
                    raise ValueError(f"{path}: {name} seed {seed} is in two of the files; merge each run once")
                runs.setdefault(name, {})[int(seed)] = run
    if first is None:
        raise ValueError(f"none of {', '.join(map(str, paths))} has runs; merge seed parts (and at most one timing part)")
    for path, other in overrides:
        if other != first[1]:
            raise ValueError(f"{path}: its overrides {other} differ from {first_path}'s {first[1]}; merge like benches only")
    order = [n for n in [SINGLE, *BALANCER_RUNS] if n in runs]
    runs = {name: dict(sorted(runs[name].items())) for name in order}
    seeds = sorted({seed for by_seed in runs.values() for seed in by_seed})
    result = balancers_result(runs, timing, first[1], {**first[0], "seeds": seeds}, host)
    if out_json is not None:
        _write_json(result, Path(out_json))
    return result
