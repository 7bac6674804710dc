"""The `flowrl` command: sample, train, eval, report, demo, bench, rewards list, score, serve-reward.

Each subcommand has a `_add_<name>(subparsers)` that declares its arguments and a `_run_<name>(args)` that
does the work; heavy imports happen inside `_run_*` so that `flowrl --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def _add_sample(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate images or videos from a model folder, hub id or 'toy'")
    p.add_argument("--model", required=True, help="local diffusers folder, hub id, or 'toy'")
    p.add_argument("--lora", default=None, help="folder or .safetensors of a LoRA in the diffusers format")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-steps", type=int, default=20)
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the family's usual value")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None)
    p.add_argument("--sampler", choices=["ode", "sde"], default="ode")
    p.add_argument("--noise-level", type=float, default=0.7, help="SDE sampler noise level")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", required=True, help="output folder")


def _run_sample(args: argparse.Namespace) -> int:
    from flowrl.sample import sample_to_files

    paths = sample_to_files(
        model=args.model, lora=args.lora, prompts=args.prompt, seed=args.seed, num_steps=args.num_steps,
        guidance_scale=args.guidance_scale, height=args.height, width=args.width, num_frames=args.num_frames,
        sampler=args.sampler, noise_level=args.noise_level, dtype=args.dtype, device=args.device, out=args.out,
    )
    for path in paths:
        print(path)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure speed; writes JSON with side-by-side ratios")
    p.add_argument("what", choices=["rollout"], help="which benchmark")
    p.add_argument("--json", required=True, help="output JSON path")
    p.add_argument("--repeats", type=int, default=5)


def _run_bench(args: argparse.Namespace) -> int:
    import json

    from flowrl import bench

    result = getattr(bench, f"bench_{args.what}")(repeats=args.repeats)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


def _add_demo(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("demo", help="align the embedded toy model with GRPO on the CPU and write runs/demo/")


def _run_demo(args: argparse.Namespace) -> int:
    print("flowrl demo: the GRPO trainer has not landed yet (issue [grpo]); nothing to run.")
    return 0


COMMANDS = {
    "sample": (_add_sample, _run_sample),
    "bench": (_add_bench, _run_bench),
    "demo": (_add_demo, _run_demo),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add, _ in COMMANDS.values():
        add(sub)
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command][1](args)
    except (ValueError, FileNotFoundError, KeyError) as err:
        # User-facing errors are one line: the field, the value and the fix.
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"flowrl {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
