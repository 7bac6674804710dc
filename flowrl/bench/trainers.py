"""`flowrl bench trainers`: the race between training recipes on the toy Shapes world.

    flowrl bench trainers --json runs/race.json                       # configs/toy/*.yaml but multireward_*
    flowrl bench trainers --json runs/race.json --recipes grpo,nft --seeds 0,1 num_steps=30

Each recipe is a config file, `configs/toy/<name>.yaml`, run once per seed with the same loop (no code per recipe):
its trainer's `train_step()` `num_steps` times, with no checkpoint and no in-training evaluation. Only the
`train_step()` calls are timed, so the seconds axis leaves evaluation out; an offline recipe's precomputed data (GDRO's
pool, made before its first step) is billed at its first step from the seconds it recorded (`perf/offline_s`, or
`perf/offline_cpu_s` with the cpu clock), whether this run made the pool or found it. The held-out accuracy is the
demo's measurement (`flowrl.heldout.heldout_scores`: every held-out prompt x fixed seeds through the ODE sampler),
graded by the exact rule-based `toy_exact` checker (the headline) with the trained judge's reading beside it, taken at
step 0 (the base model), every `eval_every_n_steps` steps and at the final step, on the weights the recipe evaluates
with (its EMA once one was updated and `eval.use_ema` holds, else the raw weights).

The target is GRPO's median final exact accuracy over the seeds; a run reaches it at its first measured point at or
above it (steps and that point's training seconds; nothing interpolated). Medians over seeds are taken over the
seeds that reached the target, and are null when fewer than half of the seeds did. The JSON is rewritten after
every finished run, so a crash keeps what finished; the plot (exact accuracy vs training seconds) goes beside it.

Two clocks: `wall` (the default) times `train_step()` by the wall clock; `cpu` by the process's CPU time (all its
threads), which other work on a shared machine does not inflate: with one torch thread (`OMP_NUM_THREADS=1`) it reads
what the wall clock reads on a quiet machine. Seeds can run in separate processes, one JSON each
(`--seeds 0 --json s0.json`, ...), and be merged (`merge_results`, `flowrl bench trainers --merge s0.json s1.json
s2.json --json race.json`): the target and medians are then taken over all of them.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from flowrl.plan.projection import median_if_most

REPO = Path(__file__).parents[2]  # = Path(flowrl.__file__).parents[1]
TOY_CONFIGS = REPO / "configs" / "toy"
BASELINE = "grpo"  # the recipe whose median final accuracy is the target
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # what "training seconds" are read from
MULTI_REWARD_PREFIX = "multireward_"  # configs/toy/multireward_*.yaml belong to `flowrl bench balancers`
I2V_SUFFIX = "_i2v"  # configs/toy/*_i2v.yaml: the toy image-to-video world, raced on its own (--baseline grpo_i2v)
GENEVAL_PREFIX = "geneval_"  # configs/toy/geneval_*.yaml: the GenEval families' world, another base model


def world(name: str) -> str:
    """Which toy world a recipe trains in: 'i2v' (a source image per prompt), 'geneval' (configs/toy/geneval_*.yaml:
    the GenEval toy model on the GenEval families, docs/toy.md#training-on-the-families; not raced) or 't2i'."""
    if name.startswith(GENEVAL_PREFIX):
        return "geneval"
    return "i2v" if name.endswith(I2V_SUFFIX) else "t2i"


def toy_recipes(baseline: str = BASELINE) -> list[str]:
    """Every `configs/toy/*.yaml` stem of the baseline's world but the multi-reward ones (`multireward_*`, raced by
    `flowrl bench balancers`: three rewards, not the race's one), sorted, the baseline first."""
    if not TOY_CONFIGS.is_dir():
        raise FileNotFoundError(
            f"no {TOY_CONFIGS} folder: `flowrl bench trainers` runs from a source checkout of flowrl"
        )
    stems = sorted(p.stem for p in TOY_CONFIGS.glob("*.yaml") if not p.stem.startswith(MULTI_REWARD_PREFIX))
    return sorted((s for s in stems if world(s) == world(baseline)), key=lambda name: name != baseline)


def recipe_order(recipes: list[str] | None, part: bool = False, baseline: str = BASELINE) -> list[str]:
    """The recipes to race, the baseline (grpo) first; an unknown name, a repeat, a recipe of another toy world or a
    list without the baseline (unless `part`: a race to be merged with one that has it) is a one-line error."""
    available = toy_recipes(baseline)
    every = sorted(p.stem for p in TOY_CONFIGS.glob("*.yaml") if not p.stem.startswith(MULTI_REWARD_PREFIX))
    if baseline not in every:
        raise ValueError(f"--baseline {baseline!r} has no configs/toy/{baseline}.yaml; use one of {', '.join(every)}")
    if recipes is None:
        recipes = available
    recipes = list(recipes)
    for name in recipes:
        if name in every and world(name) != world(baseline):
            raise ValueError(
                f"--recipes {name!r} trains in the toy {world(name)} world but --baseline {baseline!r} in the "
                f"{world(baseline)} one; race each world apart (--baseline grpo_i2v for configs/toy/*{I2V_SUFFIX}.yaml)"
            )
    if not recipes:
        raise ValueError(f"--recipes is empty; name some of {', '.join(available)} (default: all)")
    for name in recipes:
        if name not in available:
            raise ValueError(
                f"--recipes {name!r} has no configs/toy/{name}.yaml; the recipes are {', '.join(available)} "
                "(the configs/toy/*.yaml files)"
            )
        if recipes.count(name) > 1:
            raise ValueError(f"--recipes names {name!r} twice; name each recipe once")
    if baseline not in recipes and not part:
        raise ValueError(
            f"--recipes {','.join(recipes)} lacks {baseline}: the target is its median final accuracy; "
            f"add it, e.g. --recipes {baseline},{recipes[0]} (or --part, to --merge with a race that has it)"
        )
    return [baseline] * (baseline in recipes) + [name for name in recipes if name != baseline]


def first_reaching(curve: list[list[float]], target: float | None) -> tuple[int | None, float | None]:
    """(step, training seconds) of the first curve point [step, seconds, exact, judge, artifact] with
    exact >= target."""
    if target is None:
        return None, None
    for step, seconds, exact, *_ in curve:
        if exact >= target:
            return int(step), seconds
    return None, None


def _run_recipe(
    recipe: str,
    seed: int,
    overrides: list[str],
    every: int | None,
    num_seeds: int,
    eval_steps,
    progress: bool,
    clock: str,
):
    """One recipe x seed: its config's num_steps train steps, measured at 0, every `every` steps and at the end."""
    import torch

    from flowrl.heldout import heldout_scores, judge_checkpoint
    from flowrl.trainers import build_trainer, load_config
    from flowrl.training.loop import metered_step, progress_bar, show_progress

    with tempfile.TemporaryDirectory() as root:
        fixed = [f"seed={seed}", f"output_dir={root}", f"name=bench_{recipe}_{seed}", "logging.trackers=[]"]
        fixed += ["logging.progress_bar=false", "checkpoint.every_n_steps=0", "eval.every_n_steps=0"]
        cfg = load_config(TOY_CONFIGS / f"{recipe}.yaml", [*fixed, *overrides])
        trainer = build_trainer(cfg)
        model, judge = trainer.parts.model, judge_checkpoint(cfg)
        every = every or max(1, cfg.num_steps // 10)
        steps = eval_steps or cfg.eval.num_steps

        def measure(step: int, seconds: float) -> dict:
            weights, _ = trainer.parts.evaluation.weights(step or None)  # the base at 0, else what the recipe evaluates
            with torch.random.fork_rng(), weights:  # training never depends on how often it is measured
                model.transformer.eval()
                scores = heldout_scores(model, num_seeds, steps, cfg.eval.guidance_scale, judge)
            curve.append(
                [step, round(seconds, 3), scores["exact_accuracy"], scores["judge_accuracy"], scores["artifact"]]
                + [scores["impossible_count_rate"], scores["diversity"]]
            )
            work_curve.append(dict(sorted(work.items())))  # the work meter's counts summed to this point
            return scores

        curve: list[list[float]] = []
        work: dict[str, float] = {}
        work_curve: list[dict[str, float]] = []
        base = measure(0, 0.0)
        seconds, final = 0.0, base
        perf = dict.fromkeys(("step", "rollout", "reward", "optimise"), 0.0)  # the trainer's own wall timings
        bar = progress_bar(progress, cfg.num_steps, 0, f"{recipe} seed {seed}")
        try:
            for step in range(1, cfg.num_steps + 1):
                tic = CLOCKS[clock]()
                metrics = metered_step(trainer)
                seconds += CLOCKS[clock]() - tic
                seconds += metrics.get(
                    "perf/offline_cpu_s" if clock == "cpu" else "perf/offline_s", 0.0
                )  # a pool's cost
                for key, value in metrics.items():
                    if key.startswith("work/"):
                        work[key] = work.get(key, 0.0) + value
                for key in perf:
                    perf[key] += metrics.get(f"perf/{key}_s", 0.0)
                show_progress(bar, metrics)
                if step % every == 0 or step == cfg.num_steps:
                    final = measure(step, seconds)
        finally:
            if bar is not None:
                bar.close()
            if getattr(trainer, "scorer", None) is not None:  # adjoint matching scores inside its step
                trainer.parts.scorer.close()
    return {
        "curve": curve,
        "final_judge_accuracy": final["judge_accuracy"],
        "final_artifact": final["artifact"],
        "base_artifact": base["artifact"],
        "train_seconds": round(seconds, 3),
        "time_shares": time_shares(perf),
        "work_curve": work_curve,
    }


def time_shares(perf: dict[str, float]) -> dict[str, float] | None:
    """Rollout, reward and optimisation shares of the summed `perf/step_s` (the trainer's own wall timings; "other"
    is the rest: prompt sampling, balancing, bookkeeping), or None when the trainer logged no step time."""
    if not perf.get("step"):
        return None
    shares = {k: round(perf[k] / perf["step"], 3) for k in ("rollout", "reward", "optimise")}
    return {**shares, "other": round(1 - sum(shares.values()), 3)}


def value_at(curve: list[list], step: int | None, index: int):
    """Value `index` of the curve's point at `step`; None for no step (never reached) or a point older races recorded
    without that value."""
    return next((p[index] for p in curve if p[0] == step and len(p) > index), None) if step is not None else None


def race_result(runs: dict[str, dict[int, dict]], overrides: list[str], settings: dict, host: dict) -> dict:
    """The race's JSON from the finished runs ({recipe: {seed: run}}); the target is null until every seed of the
    baseline (settings["baseline"], default grpo) ran."""
    baseline = settings.get("baseline", BASELINE)
    grpo = runs.get(baseline, {})
    target = None
    if grpo and len(grpo) == len(settings["seeds"]):
        target = statistics.median(run["curve"][-1][2] for run in grpo.values())
    recipes, to_steps, to_seconds = {}, {}, {}
    for name, by_seed in runs.items():
        reached = [first_reaching(run["curve"], target) for run in by_seed.values()]
        entry = recipes[name] = {
            "config": f"configs/toy/{name}.yaml",
            "seeds": list(by_seed),
            "final_accuracy": [run["curve"][-1][2] for run in by_seed.values()],
            "final_judge_accuracy": [run["final_judge_accuracy"] for run in by_seed.values()],
            "final_artifact": [run["final_artifact"] for run in by_seed.values()],
            "base_artifact": next(iter(by_seed.values()))["base_artifact"],  # the base model: alike for every seed
            "steps_to_target": [steps for steps, _ in reached],
            "seconds_to_target": [seconds for _, seconds in reached],
            **{
                f"{key}_at_target": [
                    value_at(run["curve"], steps, index) for run, (steps, _) in zip(by_seed.values(), reached)
                ]
                for key, index in (("artifact", 4), ("impossible", 5), ("diversity", 6))
            },
            "final_diversity": [value_at(run["curve"], run["curve"][-1][0], 6) for run in by_seed.values()],
            "train_seconds": [run["train_seconds"] for run in by_seed.values()],
            "time_shares": [run.get("time_shares") for run in by_seed.values()],
            "curves": [run["curve"] for run in by_seed.values()],
            "work_curves": [run.get("work_curve") for run in by_seed.values()],  # flowrl.work counts to each point
        }
        to_steps[name] = median_if_most(entry["steps_to_target"])
        to_seconds[name] = median_if_most(entry["seconds_to_target"])
    grpo_seconds = to_seconds.get(baseline)
    from flowrl.plan.projection import projection

    projected = projection(runs, settings["seeds"], baseline)
    return {
        "baseline": baseline,  # the "grpo" of the keys below: the recipe whose median final accuracy is the target
        "target_accuracy": target,
        "recipes": recipes,
        "steps_to_grpo_final": to_steps,
        "seconds_to_grpo_final": to_seconds,
        "seconds_ratio_to_grpo": {
            name: round(s / grpo_seconds, 3) if s is not None and grpo_seconds else None
            for name, s in to_seconds.items()
        },
        **(
            {
                "projected_seconds_to_target": {n: e["seconds_to_target"] for n, e in projected["recipes"].items()},
                "projected_speedup": projected["projected_speedup"],
                "projection": projected,
            }
            if projected
            else {}
        ),
        "overrides": list(overrides),
        "settings": settings,
        "host": host,
    }


def _write_json(result: dict, path: Path) -> None:
    """Replace `path` whole (a crash mid-write leaves the previous version)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(result, indent=2))
    os.replace(partial, path)


def _cell(value, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def bench_trainers(
    recipes: list[str] | None = None,
    seeds: list[int] | tuple[int, ...] = (0, 1, 2),
    eval_every_n_steps: int | None = None,
    overrides: list[str] | None = None,
    out_json: str | Path | None = None,
    num_seeds: int | None = None,
    eval_num_steps: int | None = None,
    progress: bool = True,
    clock: str = "wall",
    part: bool = False,
    baseline: str = BASELINE,
) -> dict:
    """Race `recipes` (configs/toy/<name>.yaml stems; default all, grpo first) over `seeds` to GRPO's median final
    exact held-out accuracy. Measured at step 0, every `eval_every_n_steps` (default num_steps // 10, at least 1) and
    at the final step, over every held-out prompt x `num_seeds` seeds (default flowrl.heldout.SUMMARY_SEEDS) with
    `eval_num_steps` ODE steps (default the config's eval.num_steps). `overrides` (dotlist) apply to every recipe.

    Per recipe: per seed the final accuracies and artifact score, the first measured step and training seconds at
    or above the target (null if never), the artifact score, impossible-count rate and diversity there, the final
    diversity, the trainer's time shares (`time_shares`), and the curves [[step, seconds, exact, judge, artifact,
    impossible, diversity], ...] (diversity: `flowrl.heldout.heldout_scores`). The medians
    (`steps_to_grpo_final`, `seconds_to_grpo_final`, `seconds_ratio_to_grpo` = a recipe's median seconds over
    GRPO's) are over the seeds that reached the target, and null when fewer than half of the seeds reached it (the
    ratio also when GRPO's median seconds is 0: the base model already at the target). With `out_json`, the JSON is
    written there after every finished run and the plot beside it (`.png`) at the end. `clock`: `wall` or `cpu`
    (module docstring). `part`: the recipes may leave GRPO out, to be merged (`merge_results`) with a race that has it.
    """
    import torch

    from flowrl.heldout import SUMMARY_SEEDS
    from flowrl.trainers import load_config

    order = recipe_order(recipes, part, baseline)
    seeds, overrides = list(seeds), list(overrides or [])
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(
            f"--seeds {','.join(map(str, seeds)) or '(none)'} must name at least one seed, each once, e.g. 0,1,2"
        )
    num_seeds = SUMMARY_SEEDS if num_seeds is None else num_seeds
    if clock not in CLOCKS:
        raise ValueError(
            f"--clock {clock!r} must be one of {', '.join(CLOCKS)} (cpu: process CPU time, for a shared machine)"
        )
    for flag, value in (
        ("--eval-every", eval_every_n_steps),
        ("--heldout-seeds", num_seeds),
        ("eval_num_steps", eval_num_steps),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag}={value} must be >= 1")
    for name in order:  # every config and override loads before the first run starts
        load_config(TOY_CONFIGS / f"{name}.yaml", [f"seed={seeds[0]}", *overrides])
    out_json = Path(out_json) if out_json is not None else None
    settings = {
        "seeds": seeds,
        "heldout_seeds": num_seeds,
        "eval_num_steps": eval_num_steps,
        "eval_every_n_steps": eval_every_n_steps,
        "clock": clock,
        "baseline": baseline,
    }
    host = {
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    print(
        f"{'recipe':<12} {'seed':>4} {'exact':>6} {'judge':>6} {'artifact':>8} {'train_s':>8} "
        f"{'steps->t':>8} {'s->t':>8}",
        flush=True,
    )
    runs: dict[str, dict[int, dict]] = {}
    for name in order:
        for seed in seeds:
            run = _run_recipe(name, seed, overrides, eval_every_n_steps, num_seeds, eval_num_steps, progress, clock)
            runs.setdefault(name, {})[seed] = run
            result = race_result(runs, overrides, settings, host)
            if out_json is not None:
                _write_json(result, out_json)
            steps, seconds = first_reaching(run["curve"], result["target_accuracy"])
            pending = name == baseline and result["target_accuracy"] is None
            print(
                f"{name:<12} {seed:>4} {run['curve'][-1][2]:>6.3f} {run['final_judge_accuracy']:>6.3f} "
                f"{run['final_artifact']:>8.3f} {run['train_seconds']:>8.1f} "
                f"{'?' if pending else _cell(steps):>8} {'?' if pending else _cell(seconds, '{:.1f}'):>8}",
                flush=True,
            )
            if name == baseline and seed == seeds[-1]:
                entry = result["recipes"][baseline]
                print(
                    f"target: exact accuracy {result['target_accuracy']:.4f} ({baseline}'s median final); "
                    f"it reaches it at steps {entry['steps_to_target']}, seconds {entry['seconds_to_target']}",
                    flush=True,
                )
    _print_medians(result)
    if out_json is not None:
        plot_trainers(result, out_json.with_suffix(".png"))
    return result


def _print_medians(result: dict) -> None:
    for name in result["recipes"]:
        steps, seconds = result["steps_to_grpo_final"][name], result["seconds_to_grpo_final"][name]
        ratio = result["seconds_ratio_to_grpo"][name]
        print(
            f"{name}: median steps {_cell(steps)}, seconds {_cell(seconds, '{:.1f}')}, x grpo {_cell(ratio)}",
            flush=True,
        )


def merge_results(paths: list[str | Path], out_json: str | Path | None = None, baseline: str | None = None) -> dict:
    """One race from the JSONs of races run apart (e.g. one process per seed): their runs pooled, the target and the
    medians recomputed over all of them. They must agree on everything but the seeds and the baseline (overrides,
    held-out seeds, evaluation steps and interval, clock) and not repeat a (recipe, seed) run. The target is
    `baseline`'s median final accuracy (default: the parts' own baseline, GRPO unless they were run with another)."""
    if len(paths) < 2:
        raise ValueError(
            f"--merge names {len(paths)} file(s); name at least two race JSONs, e.g. --merge s0.json s1.json"
        )
    runs: dict[str, dict[int, dict]] = {}
    first = None
    for path in paths:
        part = json.loads(Path(path).read_text())
        same = {k: v for k, v in part["settings"].items() if k not in ("seeds", "baseline")}, part["overrides"]
        if first is None:
            first, host, own = same, part["host"], part["settings"].get("baseline", BASELINE)
        elif same != first:
            raise ValueError(
                f"{path}: its settings or overrides {same} differ from {paths[0]}'s {first}; merge like races only"
            )
        for name, entry in part["recipes"].items():
            for k, seed in enumerate(entry["seeds"]):
                if seed in runs.get(name, {}):
                    raise ValueError(f"{path}: {name} seed {seed} is in two of the files; merge each run once")
                runs.setdefault(name, {})[seed] = {
                    "curve": entry["curves"][k],
                    "final_judge_accuracy": entry["final_judge_accuracy"][k],
                    "final_artifact": entry["final_artifact"][k],
                    "base_artifact": entry["base_artifact"],
                    "train_seconds": entry["train_seconds"][k],
                    "time_shares": entry.get("time_shares", [None] * len(entry["seeds"]))[k],
                    "work_curve": entry.get("work_curves", [None] * len(entry["seeds"]))[k],
                }
    baseline = baseline or own
    if baseline not in runs:
        raise ValueError(
            f"none of {', '.join(map(str, paths))} has {baseline} runs: the target is its median final accuracy"
        )
    runs = {name: dict(sorted(runs[name].items())) for name in [baseline] + [n for n in runs if n != baseline]}
    settings = {**first[0], **({"baseline": baseline} if baseline != own else {}), "seeds": sorted(runs[baseline])}
    result = race_result(runs, first[1], settings, host)
    _print_medians(result)
    if out_json is not None:
        out_json = Path(out_json)
        _write_json(result, out_json)
        plot_trainers(result, out_json.with_suffix(".png"))
    return result


def plot_trainers(result: dict, path: str | Path) -> Path:
    """Exact held-out accuracy vs training seconds: one colour per recipe, one thin line per seed, the target dashed."""
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    projected = result.get("projection")
    panels = 2 if projected else 1
    fig = Figure(figsize=(7 * panels, 4.5))
    FigureCanvasAgg(fig)  # the Agg backend, without touching pyplot's global backend
    colours = colormaps["tab10"]
    clock = "CPU seconds, one process" if result.get("settings", {}).get("clock") == "cpu" else "training seconds"
    for panel in range(panels):
        ax = fig.add_subplot(1, panels, panel + 1)
        for i, (name, entry) in enumerate(result["recipes"].items()):
            count = len(entry["seeds"])
            xs = [[p[1] for p in c] for c in entry["curves"]]
            if panel == 1:
                xs = projected["recipes"][name]["curves"]["h100"]
            for k, (curve, x) in enumerate(zip(entry["curves"], xs)):
                if x is None:
                    continue
                label = f"{name} ({count} seed{'s' * (count > 1)})" if k == 0 else None
                exact = [p[2] for p in curve]
                ax.plot(
                    x, exact, color=colours(i % 10), linewidth=1.0, alpha=0.85, marker=".", markersize=3, label=label
                )
        if result["target_accuracy"] is not None:
            ax.axhline(
                result["target_accuracy"],
                color="black",
                linestyle="--",
                linewidth=1.0,
                label=f"target {result['target_accuracy']:.3f}: {result.get('baseline', BASELINE)} median final",
            )
        if panel == 0:
            ax.set_xlabel(f"{clock} (train_step only, evaluation excluded)")
            ax.set_title("flowrl bench trainers: the toy Shapes world")
        else:
            ax.set_xlabel("projected H100 seconds at SD3.5-Medium 512 px (FP8 previews, eta 0.11)")
            ax.set_title("the same runs, their counted work priced at real size")
        ax.set_ylabel("held-out exact accuracy (toy_exact)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
