"""The `flowrl` command: sample, train, eval, report, demo, bench, plan, pool, rewards list, score, serve-reward,
recipes, prompts.

Each subcommand has a `_add_<name>(subparsers)` that declares its arguments and a `_run_<name>(args)` that
does the work; heavy imports happen inside `_run_*` so that `flowrl --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

from flowrl import cli_prompts
from flowrl.bench.cli import _add_bench, _run_bench  # the bench subcommands
from flowrl.cli_rewards import _add_rewards, _add_score, _add_serve_reward, _run_rewards, _run_score, _run_serve_reward


def _add_sample(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sample", help="generate images or videos from a model folder, hub id or 'toy'")
    p.add_argument("--model", required=True, help="local diffusers folder, hub id, or 'toy'")
    p.add_argument("--lora", default=None, help="folder or .safetensors of a LoRA in the diffusers format")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several prompts")
    p.add_argument(
        "--image",
        action="append",
        default=None,
        help="source image of edit / image-to-video models: one for every prompt, or one per --prompt in order",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-images-per-prompt",
        type=int,
        default=1,
        help="N images per prompt with seeds SEED, SEED+1, ..., SEED+N-1 (the seed is in each file name)",
    )
    p.add_argument("--num-steps", type=int, default=20)
    p.add_argument("--guidance-scale", type=float, default=None, help="default: the family's usual value")
    p.add_argument("--height", type=int, default=None)
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--num-frames", type=int, default=None)
    p.add_argument("--sampler", choices=["ode", "sde"], default="ode")
    p.add_argument("--noise-level", type=float, default=0.7, help="SDE sampler noise level")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="text tokens per prompt (default: the pipeline's own; the toy model has a fixed length)",
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--out", required=True, help="output folder")


def _run_sample(args: argparse.Namespace) -> int:
    """One sampler call per seed over all prompts, so each file equals `flowrl sample --seed <its seed>` bit for bit."""
    import os
    import re

    import torch
    from safetensors import SafetensorError, safe_open

    from flowrl import media
    from flowrl.models import load_flow_model
    from flowrl.models.lora import WEIGHT_NAME
    from flowrl.registry import SAMPLERS
    from flowrl.types import PromptBatch

    # 0. Arguments that need no model: fail before loading one
    num_images = args.num_images_per_prompt
    if num_images < 1:
        raise ValueError(
            f"--num-images-per-prompt={num_images} must be >= 1 (images per prompt, seeds --seed, --seed+1, ...)"
        )
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} is a file, not a folder; pass a folder (created when missing)")
    images = [os.path.abspath(p) for p in args.image or []]
    if images and len(images) not in (1, len(args.prompt)):
        raise ValueError(f"{len(images)} --image for {len(args.prompt)} --prompt; give one image, or one per prompt")
    for path in images:
        media.load_image(path)  # a missing or unreadable file: its one-line error now
    lora_file = None
    if args.lora:
        lora_file = os.path.join(args.lora, WEIGHT_NAME) if os.path.isdir(args.lora) else args.lora
        if not os.path.isfile(lora_file):
            is_dir = os.path.isdir(args.lora)
            where = f"folder {args.lora!r} holds no {WEIGHT_NAME}" if is_dir else f"{args.lora!r} does not exist"
            raise FileNotFoundError(
                f"--lora {where}; pass a folder written by save_lora (a checkpoint's lora/) or its .safetensors file"
            )
        try:
            with safe_open(lora_file, framework="pt"):
                pass
        except (SafetensorError, OSError) as err:
            raise ValueError(
                f"--lora file {lora_file!r} is not a readable .safetensors file ({err}); "
                f"pass the {WEIGHT_NAME} written by save_lora"
            ) from None
    # 1. Model and sampler
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_flow_model(args.model, dtype=args.dtype, device=device, max_sequence_length=args.max_sequence_length)
    if args.lora:
        try:
            model.load_lora(args.lora)
        except (KeyError, RuntimeError) as err:  # peft / diffusers on an adapter made for another model
            detail = " ".join(str(err).split())[:120]
            raise ValueError(
                f"--lora {lora_file!r} does not fit the {model.family} model {args.model!r} "
                f"({type(err).__name__}: {detail}); pass a LoRA trained on this model"
            ) from None
    conditioned = getattr(model, "conditioning", None) is not None
    if images and not conditioned:
        raise ValueError(
            f"--image given to the text-only {model.family} model {args.model!r}; "
            "drop --image or use an edit / image-to-video model"
        )
    if conditioned and not images:
        raise ValueError(f"the {model.family} model {args.model!r} edits or animates a source image; pass --image PATH")
    default_h, default_w, default_f = model.native_size
    height, width, num_frames = args.height or default_h, args.width or default_w, args.num_frames or default_f
    options = dict(
        num_steps=args.num_steps, height=height, width=width, num_frames=num_frames, guidance_scale=args.guidance_scale
    )
    if args.sampler == "sde":
        options["noise_level"] = args.noise_level
    sampler = SAMPLERS.get(args.sampler)(**options)
    # 2. Sample: seeds S, S+1, ..., S+N-1 for every prompt (diffusers' num_images_per_prompt with one
    #    Generator().manual_seed(S+i) per image); one call per seed keeps each image's batch what `--seed S+i` gives
    prompts = list(args.prompt)
    os.makedirs(args.out, exist_ok=True)
    for seed in range(args.seed, args.seed + num_images):
        metadata = [{"image": images[min(i, len(images) - 1)]} if images else {} for i in range(len(prompts))]
        batch = PromptBatch(prompts, torch.arange(len(prompts)), metadata, seeds=torch.full((len(prompts),), seed))
        rollout = sampler(model, batch)
        for i, (prompt, media_tensor) in enumerate(zip(prompts, rollout.images)):
            slug = re.sub(r"[^a-zA-Z0-9]+", "_", prompt)[:48].strip("_")
            stem = os.path.join(args.out, f"{i:03d}_seed{seed}_{slug}")
            if model.is_video:
                print(media.save_video(media_tensor, stem))
                print(media.save_strip(media_tensor, stem + "_strip.png"))
            else:
                print(media.save_image(media_tensor, stem + ".png"))
    return 0


def run_training(config: str, overrides: list[str]) -> int:
    """Load a config and run its trainer in this process (under `accelerate launch`, in each process)."""
    from flowrl.trainers import build_trainer, kit, load_config

    kit.train(build_trainer(load_config(config, overrides)))
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train with a YAML config (one process; use accelerate launch scripts/train.py for more)"
    )
    p.add_argument("config", help="YAML run config, e.g. configs/toy/grpo.yaml")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.learning_rate=1e-4")


def _run_train(args: argparse.Namespace) -> int:
    return run_training(args.config, args.overrides)


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="align the embedded toy model with GRPO on the CPU and write runs/demo/")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides of configs/toy/grpo.yaml (e.g. seed=1)")
    p.add_argument("--out", default="runs", help="folder that receives demo/ (default: runs)")


def _run_demo(args: argparse.Namespace) -> int:
    from flowrl.demo import run_demo, summary_text

    summary = run_demo(args.overrides, output_dir=args.out)
    print(summary_text(summary))  # the whole record is summary.json, whose path it ends with
    return 0


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="sample the config's fixed eval prompts x seeds from a checkpoint (or base) and score them; or run a "
        "published benchmark (--benchmark) on a model or a checkpoint",
    )
    p.add_argument("--config", default=None, help="the run's config YAML (optional with --benchmark and --model)")
    p.add_argument(
        "--checkpoint", default=None, help="checkpoints/step_XXXXXX folder, or 'base' for the untrained model"
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: <run>/eval/step_XXXXXX or <run>/eval/base; a benchmark: "
        "<run>/benchmarks/NAME/<checkpoint>, or runs/benchmarks/NAME/<model>)",
    )
    p.add_argument(
        "--set", action="append", dest="overrides", metavar="KEY=VALUE", help="config override (dotlist), repeatable"
    )
    p.add_argument("--batch-size", type=int, default=None, help="default: eval.batch_size of the config (16)")
    b = p.add_argument_group("benchmarks (flowrl.benchmarks)")
    b.add_argument("--benchmark", default=None, help="geneval, ocr, pickscore or drawbench: its prompts, seeds, scorer")
    b.add_argument("--model", default=None, help="a diffusers folder or hub id (benchmark settings)")
    b.add_argument("--num-prompts", type=int, default=None, help="a quick subset over every task (marked partial)")
    b.add_argument(
        "--reward", action="append", default=None, help="drawbench: a scoring reward, repeatable (default: its three)"
    )
    b.add_argument(
        "--reward-kwargs",
        default=None,
        metavar="JSON",
        help='the scorer\'s keyword arguments, e.g. \'{"detector_model": "DIR", "clip_model": "DIR"}\' (several '
        'scorers: {"NAME": {...}})',
    )
    b.add_argument("--source", default=None, help="ocr, pickscore, drawbench: a local copy of the prompts")
    b.add_argument("--num-steps", type=int, default=None, help="default: the benchmark's 40 (a run: eval.num_steps)")
    b.add_argument("--guidance-scale", type=float, default=None, help="default: the benchmark's 4.5 (a run: its eval)")
    b.add_argument("--height", type=int, default=None, help="default: the benchmark's 512 (a run: its eval)")
    b.add_argument("--width", type=int, default=None, help="default: the benchmark's 512 (a run: its eval)")
    b.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="--model's weights")
    b.add_argument("--device", default=None, help="--model: cpu, or default the accelerator's device")


_BENCHMARK_ONLY = (
    "model", "num_prompts", "reward", "reward_kwargs", "source", "num_steps", "guidance_scale", "height", "width",
    "dtype", "device",
)  # fmt: skip


def _eval_out_dir(config, checkpoint: str, out: str | None) -> tuple[str, int, str]:
    """(output folder, step, label) of `flowrl eval`.

    The step comes from a `step_XXXXXX` checkpoint folder name (0 for 'base'); the folder defaults to
    <run>/eval/<label>, where <run> holds the checkpoint (runs/<name>/checkpoints/step_X) or, for 'base', is the
    config's `run_dir` (output_dir/name).
    """
    import os

    from flowrl.training.runs import step_of

    run_dir = None
    if checkpoint == "base":
        step, label = 0, "base"
        run_dir = getattr(config, "run_dir", None)  # output_dir / name
    else:
        if not os.path.isdir(checkpoint):
            raise FileNotFoundError(
                f"--checkpoint {checkpoint!r} does not exist; pass a checkpoints/step_XXXXXX folder or 'base'"
            )
        label = os.path.basename(os.path.normpath(checkpoint))
        numbered = step_of(label)
        step = numbered if numbered is not None else 0
        parent = os.path.dirname(os.path.normpath(checkpoint))
        if numbered is not None and os.path.basename(parent) == "checkpoints":
            run_dir = os.path.dirname(parent)
    if out:
        return out, step, label
    if not run_dir:
        raise ValueError(
            f"--out is not set and --checkpoint {checkpoint!r} is not inside runs/<name>/checkpoints/; pass --out DIR"
        )
    return os.path.join(str(run_dir), "eval", label), step, label


def _run_benchmark(args: argparse.Namespace) -> int:
    """`flowrl eval --benchmark NAME` (flowrl.benchmarks): the per-task table, benchmark.json, scores.json, grid.png."""
    import json

    from flowrl.benchmarks import run_benchmark

    kwargs = None
    if args.reward_kwargs is not None:
        try:
            kwargs = json.loads(args.reward_kwargs)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"--reward-kwargs {args.reward_kwargs!r} is not JSON ({err.msg}); give an object"
            ) from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--reward-kwargs {args.reward_kwargs!r} must be a JSON object, e.g. '{{\"score\": 1}}'")
    sampling = dict(num_steps=args.num_steps, guidance_scale=args.guidance_scale, height=args.height, width=args.width)
    record, out = run_benchmark(
        args.benchmark,
        out=args.out,
        model=args.model,
        config=args.config,
        checkpoint=args.checkpoint,
        overrides=args.overrides,
        num_prompts=args.num_prompts,
        rewards=args.reward,
        reward_kwargs=kwargs,
        source=args.source,
        sampling=sampling,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.batch_size,
    )
    if record is None:  # not the main process
        return 0
    from flowrl.benchmarks import table

    print(table(record))
    print(f"wrote {out}/benchmark.json")
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    """The trainer's evaluation (flowrl.training.evaluation.Evaluator) on demand, for one checkpoint or the base
    model: the run's model settings on the accelerator's device; under `accelerate launch` (scripts/evaluate.py) split
    over the processes, the main one writing and printing. With --benchmark: a published benchmark."""
    import contextlib

    if args.benchmark is not None:
        return _run_benchmark(args)
    only = [f"--{k.replace('_', '-')}" for k in _BENCHMARK_ONLY if getattr(args, k) not in (None, "float32")]
    if only:
        raise ValueError(f"{', '.join(only)} go with --benchmark NAME; add it or drop them")
    if args.config is None or args.checkpoint is None:
        raise ValueError("flowrl eval needs --config CONFIG and --checkpoint CKPT (or --benchmark NAME with --model)")

    from flowrl.trainers import load_config
    from flowrl.training.checkpoint import load_model_for_eval
    from flowrl.training.distributed import make_accelerator
    from flowrl.training.evaluation import Evaluator

    cfg = load_config(args.config, args.overrides or [])
    out, step, label = _eval_out_dir(cfg, args.checkpoint, args.out)
    acc = make_accelerator(cfg)
    model, weights = load_model_for_eval(cfg, args.checkpoint, acc.device)
    evaluator = Evaluator.from_config(cfg, model)
    train_names = evaluator.train_reward_names
    base = weights == "base" and model.has_lora  # the run's base eval: the adapter switched off
    with model.adapter_disabled() if base else contextlib.nullcontext():
        result = evaluator.run(out, step, label, weights=weights, batch_size=args.batch_size, accelerator=acc)
    if result is None:  # not the main process
        return 0
    for name, value in result["means"].items():
        kind = "train" if name in train_names else "gold"
        print(f"{name:<28} {kind:<5} {'n/a' if value is None else f'{value:.6g}'}")
    diversity = result["diversity"]["mean"]
    print(f"{'diversity':<28} {'':<5} {'n/a' if diversity is None else f'{diversity:.6g}'}")
    print(f"wrote {out}/scores.json")
    return 0


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write index.html (self-contained) and grid PNGs for a run folder")
    p.add_argument("run_dir", help="runs/<name> folder written by `flowrl train`")
    p.add_argument("--compare", nargs="+", default=[], metavar="RUN_DIR", help="other run folders to show beside it")
    p.add_argument("--out", default=None, help="output folder (default: RUN_DIR/report)")
    p.add_argument("--steps", nargs="+", type=int, default=None, help="eval steps shown beside base (default: all)")
    p.add_argument(
        "--hacking-margin",
        type=float,
        default=0.02,
        help="flag a gold reward or diversity when the 95%% one-sided bootstrap lower bound of its fall (paired over "
        "the eval samples) is above this (absolute) while a training reward rises",
    )
    p.add_argument(
        "--hacking-pair",
        action="append",
        default=[],
        metavar="GOLD=TRAIN",
        help="pair a gold reward with the training reward it also measures (repeatable), e.g. "
        "toy_exact=toy_attributes: flag GOLD when the 95%% bootstrap lower bound of TRAIN's gain over it, on the "
        "same samples, is above the margin",
    )
    p.add_argument("--thumb", type=int, default=128, help="largest image height in the page and grids, in pixels")


def _run_report(args: argparse.Namespace) -> int:
    from flowrl.report import build_report

    pairs: dict[str, str] = {}  # --hacking-pair GOLD=TRAIN -> {gold: training reward}
    for value in args.hacking_pair:
        gold, _, train = (part.strip() for part in value.partition("="))
        if not gold or not train:
            raise ValueError(
                f"--hacking-pair {value!r} must be GOLD=TRAIN (two reward names), e.g. toy_exact=toy_attributes"
            )
        if gold in pairs:
            raise ValueError(
                f"--hacking-pair pairs {gold!r} twice ({gold}={pairs[gold]} and {value}); give each gold reward once"
            )
        pairs[gold] = train
    result = build_report(
        args.run_dir,
        args.compare,
        args.out,
        steps=args.steps,
        hacking_margin=args.hacking_margin,
        hacking_pairs=pairs,
        thumb=args.thumb,
    )
    for run, gap in result["gaps"]:
        print(f"gap: {run}: {gap}", file=sys.stderr)
    for run, flagged in result["flag_reasons"].items():
        for (
            step,
            name,
            reason,
        ) in flagged:  # reason: "fell by 0.05" or "gained 0.2 less than <training> on the same N samples"
            print(f"reward hacking? {run}: {name} {reason} at {step} while a training reward rose", file=sys.stderr)
    print(result["index"])
    return 0


def _add_recipes(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("recipes", help="which sampler x trainer x balancer combination runs, and why not where not")
    p.add_argument(
        "--json", action="store_true", help='print [{"sampler", "trainer", "balancer", "works", "why"}] instead'
    )


def _add_plan(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="what one step of a config does, how long it takes on a GPU, whether it fits")
    p.add_argument("config", help="YAML run config, e.g. configs/sd3/grpo_pickscore.yaml")
    p.add_argument("--gpu", default=None, help="h100, h200 or b200 (default: all three)")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs the run is launched on (default: 1)")
    p.add_argument("--sharding", default="none", help="none (data parallel), fsdp (FSDP2) or zero2 (DeepSpeed ZeRO-2)")
    p.add_argument("--json", default=None, help="also write the plan as JSON here")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides of the config, e.g. sampler.num_steps=16")


def _add_pool(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pool", help="make (or finish) the offline pool of an offline recipe's config (gdro)")
    p.add_argument("config", help="YAML run config of an offline recipe, e.g. configs/toy/gdro.yaml")
    p.add_argument(
        "--out", default=None, help="the pool's folder (default: train.pool_dir, else <output_dir>/pools/<name>)"
    )
    p.add_argument("overrides", nargs="*", help="key.path=value overrides of the config, e.g. train.pool_size=8")


def _run_pool(args: argparse.Namespace) -> int:
    from flowrl.trainers import build_trainer, load_config

    cfg = load_config(args.config, [*args.overrides, *([f"train.pool_dir={args.out}"] if args.out else [])])
    if not hasattr(cfg.train, "pool_size"):
        raise ValueError(f"trainer={cfg.trainer!r} of {args.config} trains on rollouts, not a pool; use a gdro config")
    print(build_trainer(cfg).pool.summary())  # the pool made where missing, checked against the config where present
    return 0


def _run_plan(args: argparse.Namespace) -> int:
    from flowrl.plan.plan import plan, render

    print(render(plan(args.config, args.gpu, args.num_gpus, args.sharding, args.overrides, args.json)))
    return 0


def _run_recipes(args: argparse.Namespace) -> int:
    from flowrl.trainers.compose import print_matrix

    return print_matrix(args.json)


COMMANDS = {
    "sample": (_add_sample, _run_sample),
    "bench": (_add_bench, _run_bench),
    "demo": (_add_demo, _run_demo),
    "train": (_add_train, _run_train),
    "rewards": (_add_rewards, _run_rewards),
    "score": (_add_score, _run_score),
    "serve-reward": (_add_serve_reward, _run_serve_reward),
    "eval": (_add_eval, _run_eval),
    "report": (_add_report, _run_report),
    "recipes": (_add_recipes, _run_recipes),
    "plan": (_add_plan, _run_plan),
    "pool": (_add_pool, _run_pool),
    "prompts": (cli_prompts.add_parser, cli_prompts.run),
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
        # User-facing errors are one line: the field, the value and the fix (a library's multi-line text is joined).
        msg = err.args[0] if isinstance(err, KeyError) and err.args else err
        one_line = " ".join(line.strip() for line in str(msg).splitlines() if line.strip())
        print(f"flowrl {args.command}: error: {one_line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
