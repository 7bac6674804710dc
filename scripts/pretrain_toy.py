"""Pretrain the toy flow model on fresh Shapes renders of the training split (rectified flow, velocity loss).

    python scripts/pretrain_toy.py                 # the shipped model: writes flowrl/toy/weights/toy_model.safetensors
    python scripts/pretrain_toy.py --quick         # a test-sized run (tiny batch, few steps) into a temporary folder
    python scripts/pretrain_toy.py --grammar geneval   # the second model: toy_geneval_model.safetensors

`--grammar geneval` makes the second toy model, which reads both grammars (docs/toy.md#geneval-families): the same
UNet, a text encoder over the larger vocabulary (`flowrl.models.toy.GENEVAL_VOCAB`, prompts up to 10 tokens), trained
on the `geneval_train` split's two-object and position prompts and, for a share --single-fraction of each batch, on
the first grammar's `train` split (with --count-noise and --colour-noise as below). Its imperfections: with
probability --swap-noise a pair scene is drawn with the two objects' colours swapped, with probability
--relation-noise a position scene with its relation redrawn uniformly from the four (the prompt keeps its words).

The model is deliberately imperfect at counting and colour binding: with probability --count-noise a scene is
drawn with a count redrawn uniformly from {1, 2, 3} (the prompt keeps its count), with probability
--colour-noise with a colour redrawn uniformly from the four (the prompt keeps its colour). Shapes are never
corrupted, so the model draws clean shapes but follows the prompt's count and colour only part of the time,
which leaves room for alignment (sampling without CFG shows the learned conditional most directly).

Each step draws a batch of new scenes (infinite data), a logit-normal sigma per image and a Gaussian noise,
and regresses the UNet's output on `eps - x0` at `x = (1 - sigma) x0 + sigma eps`; the prompt is dropped to ""
with probability --cond-dropout so that CFG works. The text encoder trains jointly. Learning rate: linear
warm-up then constant, so stopping a run at step k gives the same weights as `--steps k`. The exponential
moving average (EMA) of the weights is what gets saved, in float16. Everything is seeded by --seed.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from flowrl.models.toy import (
    DEFAULT_NUM_STEPS,
    GENEVAL_MODEL_FILE,
    GRAMMARS,
    MODEL_FILE,
    build_text_encoder,
    build_unet,
    pack,
    tokenize,
    unpack,
)
from flowrl.seeds import pretrain_eval_generator
from flowrl.toy.manifest import WEIGHTS_DIR, file_entry, write_manifest_entry
from flowrl.toy.world import COLOURS, RELATIONS, PairSpec, ShapeSpec, random_batch, render_batch, sample_specs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 3000; --quick: 30)")
    p.add_argument("--batch-size", type=int, default=None, help="images per step (default 32; --quick: 16)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=100)
    p.add_argument("--ema-decay", type=float, default=None, help="default 0.998 (--quick: 0)")
    p.add_argument("--cond-dropout", type=float, default=0.1, help="probability of training on the empty prompt")
    p.add_argument("--count-noise", type=float, default=0.5, help="probability that a scene's count is redrawn")
    p.add_argument("--colour-noise", type=float, default=0.25, help="probability that a scene's colour is redrawn")
    p.add_argument("--grammar", default="shapes", choices=GRAMMARS, help="geneval: the second model (docstring)")
    p.add_argument("--swap-noise", type=float, default=0.3, help="geneval: probability a pair's colours are swapped")
    p.add_argument("--relation-noise", type=float, default=0.4, help="geneval: probability a relation is redrawn")
    p.add_argument("--single-fraction", type=float, default=0.25, help="geneval: share of first-grammar scenes")
    p.add_argument(
        "--num-measure-seeds", type=int, default=None, help="geneval: seeds per held-out prompt (default 8; --quick: 1)"
    )
    p.add_argument(
        "--num-measure-steps", type=int, default=None, help="geneval: sampling steps for it (default 10; --quick: 2)"
    )
    p.add_argument(
        "--measure-only",
        default=None,
        metavar="FILE",
        help="geneval: only measure the model file FILE (held-out accuracies, printed as JSON); no training",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared machine (no spin-waiting)")
    p.add_argument("--save-every-n-steps", type=int, default=0, help="also write checkpoints/step_XXXXXX.safetensors")
    p.add_argument("--out", default=None, help=f"output folder (default {WEIGHTS_DIR}; --quick: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="test-sized run: 30 steps of batch 16, no EMA")
    args = p.parse_args(argv)
    defaults = (
        dict(steps=30, batch_size=16, ema_decay=0.0, num_measure_seeds=1, num_measure_steps=2)
        if args.quick
        else dict(steps=3000, batch_size=32, ema_decay=0.998, num_measure_seeds=8, num_measure_steps=DEFAULT_NUM_STEPS)
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 1 or args.batch_size < 1:
        raise ValueError(f"--steps={args.steps} and --batch-size={args.batch_size} must be >= 1")
    for name in ("cond_dropout", "count_noise", "colour_noise", "swap_noise", "relation_noise", "single_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be a probability in [0, 1]")
    if not 0.0 <= args.ema_decay < 1.0:
        raise ValueError(f"--ema-decay={args.ema_decay} must be in [0, 1)")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="toy_pretrain_") if args.quick else str(WEIGHTS_DIR)
    return args


class ToyDenoiser(torch.nn.Module):
    """UNet + text encoder as one module, so one optimizer and one EMA cover both."""

    def __init__(self, grammar: str = "shapes"):
        super().__init__()
        self.transformer = build_unet()
        self.text_encoder = build_text_encoder(grammar)

    def forward(self, latents: torch.Tensor, sigma: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.text_encoder(input_ids=input_ids).last_hidden_state  # [N, L, D]
        velocity = self.transformer(pack(latents), sigma * 1000.0, encoder_hidden_states=embeds).sample
        return unpack(velocity)  # [N, 3, H, W]


def noisy_scenes(
    specs: list[ShapeSpec], count_noise: float, colour_noise: float, generator: torch.Generator
) -> list[ShapeSpec]:
    """The scenes actually drawn for prompted `specs`: count / colour redrawn uniformly with the given probabilities."""
    n = len(specs)
    redraw_count = (torch.rand(n, generator=generator) < count_noise).tolist()  # [N]
    redraw_colour = (torch.rand(n, generator=generator) < colour_noise).tolist()
    counts = (torch.randint(1, 4, (n,), generator=generator)).tolist()  # [N]
    colours = torch.randint(len(COLOURS), (n,), generator=generator).tolist()
    return [
        ShapeSpec(
            counts[i] if redraw_count[i] else s.count, COLOURS[colours[i]] if redraw_colour[i] else s.colour, s.shape
        )
        for i, s in enumerate(specs)
    ]


def training_batch(
    num: int, cond_dropout: float, generator: torch.Generator, count_noise: float = 0.0, colour_noise: float = 0.0
):
    specs = sample_specs(num, "train", generator)  # the prompts
    scenes = noisy_scenes(specs, count_noise, colour_noise, generator)
    seeds = torch.randint(2**31 - 1, (num,), generator=generator).tolist()  # [N]
    x0 = render_batch(scenes, seeds) * 2 - 1  # [N, 3, 32, 32] in [-1, 1]
    prompts = [spec.prompt for spec in specs]
    drop = torch.rand(num, generator=generator) < cond_dropout  # [N]
    prompts = ["" if d else p for p, d in zip(prompts, drop.tolist())]
    sigma = torch.sigmoid(torch.randn(num, generator=generator))  # [N] logit-normal(0, 1)
    noise = torch.randn(x0.shape, generator=generator)  # [N, 3, 32, 32]
    s = sigma[:, None, None, None]
    return (1 - s) * x0 + s * noise, sigma, tokenize(prompts), noise - x0


def noisy_pairs(specs: list[PairSpec], swap_noise: float, relation_noise: float, generator) -> list[PairSpec]:
    """The scenes actually drawn for prompted pair `specs`: the two colours swapped with probability `swap_noise`, a
    position scene's relation redrawn uniformly with probability `relation_noise`."""
    n = len(specs)
    swap = (torch.rand(n, generator=generator) < swap_noise).tolist()  # [N]
    redraw = (torch.rand(n, generator=generator) < relation_noise).tolist()
    relations = torch.randint(len(RELATIONS), (n,), generator=generator).tolist()  # [N]
    scenes = []
    for i, s in enumerate(specs):
        first, second = ((s.second[0], s.first[1]), (s.first[0], s.second[1])) if swap[i] else (s.first, s.second)
        relation = RELATIONS[relations[i]] if redraw[i] and s.relation is not None else s.relation
        scenes.append(PairSpec(first, second, relation))
    return scenes


def geneval_training_batch(num: int, args: argparse.Namespace, generator: torch.Generator):
    """`training_batch` for the geneval grammar: pair prompts of `geneval_train` and, a share `single_fraction`, the
    first grammar's `train` prompts, each kind with its own noise."""
    single = (torch.rand(num, generator=generator) < args.single_fraction).tolist()  # [N]
    num_single = sum(single)
    singles = iter(sample_specs(num_single, "train", generator))
    pairs = iter(sample_specs(num - num_single, "geneval_train", generator))
    specs = [next(singles) if s else next(pairs) for s in single]
    single_scenes = iter(noisy_scenes([s for s in specs if isinstance(s, ShapeSpec)], *args.single_noise, generator))
    pair_scenes = iter(noisy_pairs([s for s in specs if isinstance(s, PairSpec)], *args.pair_noise, generator))
    scenes = [next(single_scenes) if isinstance(s, ShapeSpec) else next(pair_scenes) for s in specs]
    seeds = torch.randint(2**31 - 1, (num,), generator=generator).tolist()  # [N]
    x0 = render_batch(scenes, seeds) * 2 - 1  # [N, 3, 32, 32] in [-1, 1]
    drop = torch.rand(num, generator=generator) < args.cond_dropout  # [N]
    prompts = ["" if d else spec.prompt for spec, d in zip(specs, drop.tolist())]
    sigma = torch.sigmoid(torch.randn(num, generator=generator))  # [N] logit-normal(0, 1)
    noise = torch.randn(x0.shape, generator=generator)  # [N, 3, 32, 32]
    s = sigma[:, None, None, None]
    return (1 - s) * x0 + s * noise, sigma, tokenize(prompts, "geneval"), noise - x0


def fixed_eval_batch(seed: int, grammar: str = "shapes"):
    """64 training-split scenes (the geneval grammar: of `geneval_train`) with sigmas spread over (0, 1): the loss
    every run reports, before and after."""
    generator = pretrain_eval_generator(seed)
    images, specs = random_batch(64, "train" if grammar == "shapes" else "geneval_train", generator)
    x0 = images * 2 - 1
    sigma = torch.linspace(0.05, 0.95, 64)  # [64]
    noise = torch.randn(x0.shape, generator=generator)
    s = sigma[:, None, None, None]
    return (1 - s) * x0 + s * noise, sigma, tokenize([spec.prompt for spec in specs], grammar), noise - x0


@torch.no_grad()
def measure_geneval(path: Path, num_seeds: int, num_steps: int = DEFAULT_NUM_STEPS) -> dict:
    """Held-out accuracy of the geneval-grammar model file `path`, ODE sampler over `num_steps` at the model's default
    guidance, `num_seeds` fixed seeds per prompt (`flowrl.seeds.split_seeds`, run seed 0): GenEval's verdict over the
    exact checker's shapes (`toy_geneval_exact`) on `geneval_heldout`, per family, and the first grammar's `toy_exact`
    accuracy on its `heldout` split."""
    from flowrl.heldout import exact_accuracy, sample_images
    from flowrl.models.toy import DEFAULT_GUIDANCE_SCALE, load_toy_model
    from flowrl.registry import REWARDS
    from flowrl.seeds import split_seeds
    from flowrl.toy.world import split_prompts

    model = load_toy_model(checkpoint=path, grammar="geneval")
    result = {"num_measure_seeds": num_seeds, "num_measure_steps": num_steps}
    for split in ("geneval_heldout", "heldout"):
        base = split_prompts(split)
        prompts = [p for p in base for _ in range(num_seeds)]
        seeds = split_seeds(0, len(base), num_seeds)
        images = sample_images(model, prompts, seeds, num_steps, DEFAULT_GUIDANCE_SCALE)
        if split == "heldout":
            result["heldout_exact_accuracy"] = exact_accuracy(images, prompts)["accuracy"]
            continue
        out = REWARDS.build("toy_geneval_exact")(images, prompts, None)
        result["geneval_heldout_exact_accuracy"] = round(out.scores.mean().item(), 4)
        for family in ("two_object", "position"):
            values = out.parts[family]
            result[f"{family}_heldout_exact_accuracy"] = round(values[~values.isnan()].mean().item(), 4)
    return result


@torch.no_grad()
def eval_loss(net: torch.nn.Module, batch) -> float:
    latents, sigma, ids, target = batch
    return torch.nn.functional.mse_loss(net(latents, sigma, ids), target).item()


def state_for_file(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.float16).contiguous() for k, v in net.state_dict().items()}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.measure_only is not None:
        result = measure_geneval(Path(args.measure_only), args.num_measure_seeds, args.num_measure_steps)
        print(json.dumps(result), flush=True)
        return result
    arguments = argv if argv is not None else sys.argv[1:]
    command = "python scripts/pretrain_toy.py " + " ".join(shlex.quote(a) for a in arguments)
    print(
        f"command: {command}\nseed: {args.seed}  steps: {args.steps}  batch: {args.batch_size}  out: {args.out}",
        flush=True,
    )
    torch.manual_seed(args.seed)  # parameter initialisation
    generator = torch.Generator().manual_seed(args.seed)  # data, sigmas, noise, dropout
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    args.single_noise, args.pair_noise = (args.count_noise, args.colour_noise), (args.swap_noise, args.relation_noise)
    geneval = args.grammar == "geneval"
    model_file = GENEVAL_MODEL_FILE if geneval else MODEL_FILE
    net = ToyDenoiser(args.grammar).train()
    ema = copy.deepcopy(net).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / args.warmup_steps))
    eval_batch = fixed_eval_batch(args.seed, args.grammar)
    loss_before = eval_loss(net, eval_batch)
    print(f"eval loss before: {loss_before:.4f}", flush=True)

    start, running = time.time(), []
    for step in range(1, args.steps + 1):
        if geneval:
            latents, sigma, ids, target = geneval_training_batch(args.batch_size, args, generator)
        else:
            latents, sigma, ids, target = training_batch(
                args.batch_size, args.cond_dropout, generator, args.count_noise, args.colour_noise
            )
        loss = torch.nn.functional.mse_loss(net(latents, sigma, ids), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        decay = min(args.ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            for p_ema, p in zip(ema.parameters(), net.parameters()):
                p_ema.lerp_(p, 1 - decay)
        running.append(loss.item())
        if step % 50 == 0 or step == args.steps:
            print(
                f"step {step} loss {sum(running) / len(running):.4f} {(time.time() - start) / step:.2f}s/step",
                flush=True,
            )
            running = []
        if args.save_every_n_steps and step % args.save_every_n_steps == 0:
            (out / "checkpoints").mkdir(exist_ok=True)
            save_file(state_for_file(ema), str(out / "checkpoints" / f"step_{step:06d}.safetensors"))

    final = ema if args.ema_decay > 0 else net
    loss_after = eval_loss(final.eval(), eval_batch)
    seconds = time.time() - start
    print(f"eval loss after: {loss_after:.4f}  ({seconds / 60:.1f} min)", flush=True)
    path = out / model_file
    save_file(state_for_file(final), str(path), metadata={"command": command, "seed": str(args.seed)})
    entry = {
        **file_entry(path, command, args.seed, args.steps),
        "eval_loss_before": round(loss_before, 4),
        "eval_loss_after": round(loss_after, 4),
        "train_minutes": round(seconds / 60, 1),
        "threads": args.threads,
        "count_noise": args.count_noise,
        "colour_noise": args.colour_noise,
    }
    if geneval:
        entry.update(
            grammar="geneval",
            swap_noise=args.swap_noise,
            relation_noise=args.relation_noise,
            single_fraction=args.single_fraction,
            **measure_geneval(path, args.num_measure_seeds, args.num_measure_steps),
        )
    write_manifest_entry(out, model_file, entry)
    print(json.dumps(entry), flush=True)
    return entry


if __name__ == "__main__":
    main()
