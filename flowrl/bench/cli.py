"""`flowrl bench ...`: the arguments and dispatch of the bench subcommands (flowrl/cli.py registers them).

Every bench writes JSON with ratios measured side by side in one run, one module each in flowrl/bench/: rewards.py
(with serving.py for Ray Serve), report.py, train.py, rollout.py, trainers.py (the race), tree.py, candidates.py,
balancers.py.
"""

from __future__ import annotations

import argparse

BENCHES = {
    "rewards": (
        "images/s of every reward; the remote reward over in-process; the Ray Serve service with 1 and 2 replicas"
    ),
    "report": "time to build the report of a fabricated run",
    "train": "throughput and time shares of the toy GRPO config",
}


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure speed; writes JSON with side-by-side ratios")
    which = p.add_subparsers(
        dest="what",
        required=True,
        metavar="{" + ",".join(["rollout", *BENCHES, "tree", "trainers", "balancers", "candidates"]) + "}",
    )
    q = which.add_parser("rollout", help="diffusers pipeline vs flowrl's ODE and SDE samplers on every tiny family")
    q.add_argument("--json", required=True, help="output JSON path")
    q.add_argument("--repeats", type=int, default=5)
    q.add_argument("--families", default=None, help="comma-separated tiny families, e.g. sd3,wan22_a14b (default: all)")
    q.add_argument("--num-steps", default="10", help="denoising steps of all three (default: 10)")
    q.add_argument("--batch-size", default="4", help="samples per call (default: 4; Edit Plus' pipeline makes 1)")
    for name, text in BENCHES.items():
        q = which.add_parser(name, help=text)
        q.add_argument("--json", required=True, help="output JSON path")
        q.add_argument("--repeats", type=int, default=5)
        if name == "rewards":
            q.add_argument(
                "--parts",
                default="tiny,real,remote,serve",
                help=(
                    "comma-separated: tiny, real (real-size CLIP/BLIP), remote (local engine), "
                    "serve (Ray Serve replicas)"
                ),
            )
    q = which.add_parser(
        "tree", help="tree vs independent SDE rollouts at equal leaves and steps: forwards and wall per leaf"
    )
    q.add_argument("--json", required=True, help="output JSON path")
    q.add_argument("--repeats", type=int, default=5)
    q.add_argument("--num-steps", default="20", help="denoising steps of both (default: 20)")
    q.add_argument(
        "--split-steps", default="0,3,6,9", help="the tree's split steps (default: 0,3,6,9; b = 2: 16 leaves)"
    )
    q.add_argument("--families", default="toy,sd3", help="comma-separated models (default: toy,sd3)")
    q = which.add_parser(
        "trainers", help="race the configs/toy/*.yaml recipes over seeds to GRPO's final held-out exact accuracy"
    )
    q.add_argument(
        "--json", required=True, help="output JSON path (rewritten after every run); the plot goes beside it, .png"
    )
    q.add_argument(
        "--recipes", default=None, help="comma-separated configs/toy/<name>.yaml stems, e.g. grpo,nft (default: all)"
    )
    q.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default: 0,1,2)")
    q.add_argument("--eval-every", default=None, help="measure every N training steps (default: num_steps // 10)")
    q.add_argument("--heldout-seeds", default=None, help="seeds per held-out prompt (default: the demo's 16)")
    q.add_argument("--clock", default="wall", help="wall, or cpu: process CPU time, not inflated by a shared machine")
    q.add_argument(
        "--merge", nargs="+", default=None, help="race JSONs run apart (e.g. a seed each) -> one race at --json"
    )
    q.add_argument(
        "--part", action="store_true", help="--recipes may leave grpo out: a part to --merge with one that has it"
    )
    q.add_argument(
        "--baseline",
        default=None,
        help=(
            "the recipe whose median final accuracy is the target "
            "(default grpo; grpo_i2v: the toy I2V world; with --merge: the parts' own)"
        ),
    )
    q.add_argument("overrides", nargs="*", help="key.path=value overrides for every recipe, e.g. num_steps=30")
    q = which.add_parser(
        "candidates", help="preview vs full-precision ranking fidelity and cost of every preview backend"
    )
    q.add_argument("--json", required=True, help="output JSON path")
    q.add_argument("--num-prompts", default="8", help="prompts per world, one seed pool each (default: 8)")
    q.add_argument("--worlds", default="toy,sd3", help="comma-separated: toy, sd3 (default: toy,sd3)")
    q = which.add_parser(
        "balancers", help="every multi-reward balancer and SMOPD on the toy multi-reward bed, over seeds"
    )
    q.add_argument("--json", required=True, help="output JSON path (rewritten after every run)")
    q.add_argument(
        "--balancers", default=None, help="comma-separated, e.g. single_toy_size,weighted_sum,marble (default: all)"
    )
    q.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds (default: 0,1,2)")
    q.add_argument("--heldout-seeds", default="8", help="seeds per held-out prompt (default: 8)")
    q.add_argument(
        "--timing-steps", default="6", help="interleaved steps of the side-by-side timing (default: 6; 0: none)"
    )
    q.add_argument(
        "--merge", nargs="+", default=None, help="balancer JSONs run apart (e.g. a seed each) -> one at --json"
    )
    q.add_argument("--timing-only", action="store_true", help="only the side-by-side timing: a part to --merge")
    q.add_argument("overrides", nargs="*", help="key.path=value overrides for every run, e.g. num_steps=10")


def _int_list(flag: str, value: str) -> list[int]:
    try:
        return [int(part) for part in value.split(",")]
    except ValueError:
        raise ValueError(f"{flag} {value!r} must be comma-separated integers, e.g. {flag} 0,1,2") from None


def _positive_int(flag: str, value: str | None) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{flag} {value!r} must be a whole number >= 1, e.g. {flag} 5")
    return int(value)


def _run_bench(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    if args.what == "trainers" and args.merge:
        from flowrl.bench.trainers import merge_results

        merge_results(args.merge, args.json, baseline=args.baseline)
        print(f"wrote {args.json} and its plot {Path(args.json).with_suffix('.png')}")
        return 0
    if args.what == "trainers":
        from flowrl.bench.trainers import bench_trainers

        bench_trainers(
            recipes=None if args.recipes is None else [name.strip() for name in args.recipes.split(",")],
            seeds=_int_list("--seeds", args.seeds),
            eval_every_n_steps=_positive_int("--eval-every", args.eval_every),
            overrides=args.overrides,
            out_json=args.json,
            num_seeds=_positive_int("--heldout-seeds", args.heldout_seeds),
            clock=args.clock,
            part=args.part,
            baseline=args.baseline or "grpo",
        )
        print(f"wrote {args.json} and its plot {Path(args.json).with_suffix('.png')}")
        return 0
    if args.what == "balancers" and args.merge:
        from flowrl.bench.balancers import merge_balancers

        result = merge_balancers(args.merge, args.json)
        print(f"wrote {args.json}: marble_step_ratio {result['marble_step_ratio']}")
        return 0
    if args.what == "balancers":
        from flowrl.bench.balancers import bench_balancers

        timing_steps = args.timing_steps.strip()
        result = bench_balancers(
            balancers=None if args.balancers is None else [name.strip() for name in args.balancers.split(",")],
            seeds=[] if args.timing_only else _int_list("--seeds", args.seeds),
            overrides=args.overrides,
            out_json=args.json,
            num_seeds=_positive_int("--heldout-seeds", args.heldout_seeds),
            timing_steps=0 if timing_steps == "0" else _positive_int("--timing-steps", timing_steps),
        )
        print(f"wrote {args.json}: marble_step_ratio {result['marble_step_ratio']}")
        return 0
    if args.what == "candidates":
        from flowrl.bench.candidates import bench_candidates

        worlds = tuple(name.strip() for name in args.worlds.split(","))
        result = bench_candidates(num_prompts=_positive_int("--num-prompts", args.num_prompts), worlds=worlds)
    elif args.what == "rollout":
        from flowrl.bench.rollout import bench_rollout

        result = bench_rollout(
            repeats=_positive_int("--repeats", str(args.repeats)),
            num_steps=_positive_int("--num-steps", args.num_steps),
            batch_size=_positive_int("--batch-size", args.batch_size),
            families=None if args.families is None else tuple(name.strip() for name in args.families.split(",")),
        )
    elif args.what == "tree":
        from flowrl.bench.tree import bench_tree

        result = bench_tree(
            repeats=_positive_int("--repeats", str(args.repeats)),
            num_steps=_positive_int("--num-steps", args.num_steps),
            split_steps=tuple(_int_list("--split-steps", args.split_steps)),
            families=tuple(name.strip() for name in args.families.split(",")),
        )
    elif args.what == "rewards":
        parts = {part.strip() for part in args.parts.split(",")}
        unknown = parts - {"tiny", "real", "remote", "serve"}
        if unknown:
            raise ValueError(
                f"--parts {args.parts!r}: unknown {sorted(unknown)}; choose from tiny, real, remote, serve"
            )
        result = {}
        if parts - {"serve"}:
            from flowrl.bench.rewards import bench_rewards

            result = bench_rewards(repeats=args.repeats, real_sizes=bool(parts & {"real", "remote"}))
        if "serve" in parts:
            from flowrl.bench.serving import bench_serve

            result["serve"] = bench_serve(rounds=max(args.repeats, 5))
    elif args.what == "report":
        from flowrl.bench import report

        result = report.bench_report(repeats=args.repeats)
    else:
        from flowrl.bench.train import bench_train

        result = bench_train(repeats=args.repeats)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0
