"""Train the Shapes world's judges on fresh renders and measure them on held-out renders.

    # -> flowrl/toy/weights/toy_attributes.safetensors
    python scripts/train_toy_judges.py --judge attributes --seed 2 --faint-fraction 0.25
    # -> flowrl/toy/weights/toy_artifact.safetensors
    python scripts/train_toy_judges.py --judge artifact
    # the shipped judge, as in manifest.json
    python scripts/train_toy_judges.py --judge attributes --evaluate-only --seed 2

Training data are endless new scenes of all 36 combinations (the judges must know every combination),
softened like model samples (slight blur, faint noise). The attribute judge also sees scenes the world never
draws (`--impossible-fraction` of each batch: no shape, four or five, two colours or two shapes in one scene),
labelled with each head's "other" class, so a count or colour outside the world cannot pass for a prompt's.
`--faint-fraction` of the scenes of both kinds have one shape faint (faded and shrunk, `faint_items`) where the exact
checker still reads the same shapes, so a dim or small extra shape counts for the judge as it does for the gold (the
shipped judge has 0.25; a judge trained with 0 scores four shapes for "three ..." near 1 when one is dim;
docs/toy.md#judges).
The artifact judge sees half clean scenes and half scenes with one corruption each (noise, blocking, stripes,
saturation). Held-out accuracy is measured on scenes drawn from a generator seeded apart from training
(seed + 1,000,000), raw and softened; for the attribute judge also the mean score the best of the 36 prompts
gets on impossible scenes (seed + 2,000,000), which should be near 0; and both on faint scenes ("faint",
"impossible_faint").

    python scripts/train_toy_judges.py --judge attributes --evaluate-only \
        --checkpoint tests/toy/fixtures/toy_attributes_countblind.safetensors   # the first, count-blind judge
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from flowrl.seeds import judge_heldout_generator, judge_impossible_generator
from flowrl.toy.exact import faint_items
from flowrl.toy.judges import ARTIFACT_FILE, ATTRIBUTE_FILE, ArtifactJudge, AttributeJudge, load_judge, scene_labels
from flowrl.toy.manifest import WEIGHTS_DIR, file_entry, write_manifest_entry
from flowrl.toy.world import (
    COLOURS,
    CORRUPTIONS,
    COUNTS,
    IMPOSSIBLE_KINDS,
    SHAPES,
    corrupt,
    impossible_batch,
    random_batch,
    soften,
)

HEADS = ("count", "colour", "shape")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--judge", required=True, choices=["attributes", "artifact"])
    p.add_argument("--steps", type=int, default=None, help="default 2000 (attributes) / 800 (artifact); --quick: 20")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--num-eval", type=int, default=2000, help="held-out scenes for the accuracy report")
    p.add_argument("--out", default=None, help=f"output folder (default {WEIGHTS_DIR}; --quick: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="test-sized run: 20 steps, 256 eval scenes")
    p.add_argument(
        "--impossible-fraction", type=float, default=0.25, help="attributes: share of each batch outside the world"
    )
    p.add_argument("--faint-fraction", type=float, default=0.0, help="attributes: share of scenes with one faint shape")
    p.add_argument(
        "--evaluate-only", action="store_true", help="measure --checkpoint, else --out's judge (or the shipped)"
    )
    p.add_argument("--checkpoint", default=None, help="--evaluate-only: the judge file to measure")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 20 if args.quick else {"attributes": 2000, "artifact": 800}[args.judge]
    if not 0.0 <= args.impossible_fraction < 1.0:
        raise ValueError(
            f"--impossible-fraction={args.impossible_fraction} must be in [0, 1); 0.25 is the shipped judge's"
        )
    if not 0.0 <= args.faint_fraction <= 1.0:
        raise ValueError(
            f"--faint-fraction={args.faint_fraction} must be in [0, 1]; 0.25 is the shipped judge's, "
            "0 leaves faint shapes out"
        )
    if args.quick:
        args.num_eval = min(args.num_eval, 256)
    if args.steps < 1 or args.batch_size < 2:
        raise ValueError(f"--steps={args.steps} must be >= 1 and --batch-size={args.batch_size} >= 2")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="toy_judge_") if args.quick else str(WEIGHTS_DIR)
    return args


def make_faint(
    images: torch.Tensor,
    items: list[list[tuple[str, str]]],
    fraction: float,
    generator: torch.Generator,
    same_shapes: bool,
):
    """`images` [N, 3, 32, 32] with the first round(N * fraction) scenes redrawn with one faint shape (in place),
    where the exact checker still reads the scene's shapes in their colours, and with `same_shapes` their shapes
    (world scenes keep their labels; an impossible scene's count is what makes it impossible); `faint_items`. A
    scene the checker would read otherwise stays as it was."""
    for i in range(round(len(items) * fraction)):
        seed = int(torch.randint(2**31 - 1, (), generator=generator))
        image = faint_items(items[i], seed, generator, same_shapes)
        if image is not None:
            images[i] = image
    return images


def attribute_batch(
    num: int,
    generator: torch.Generator,
    augment: bool = True,
    impossible_fraction: float = 0.0,
    faint_fraction: float = 0.0,
):
    """Scenes [N, 3, 32, 32] and labels [N, 3] (count, colour, shape): round(N * fraction) impossible ones first;
    `faint_fraction` of each kind with one faint shape."""
    num_impossible = round(num * impossible_fraction)
    images, specs = random_batch(num - num_impossible, "all", generator)  # [N - k, 3, 32, 32]
    labels = [spec.labels for spec in specs]
    if faint_fraction:
        images = make_faint(images, [[(s.colour, s.shape)] * s.count for s in specs], faint_fraction, generator, True)
    if num_impossible:
        odd, items = impossible_batch(num_impossible, generator)  # [k, 3, 32, 32]
        if faint_fraction:
            odd = make_faint(odd, items, faint_fraction, generator, False)
        images, labels = torch.cat([odd, images]), [scene_labels(scene) for scene in items] + labels
    if augment:
        images = soften(images, generator)
    return images, torch.tensor(labels)  # [N, 3]


def best_prompt_score(logits: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N] the toy_attributes score of the best of the 36 prompts: the heads are independent, so the product of each
    head's largest probability among the world's classes (never the "other" class)."""
    probs = [logits[h].softmax(1)[:, :num].amax(1) for h, num in zip(HEADS, (len(COUNTS), len(COLOURS), len(SHAPES)))]
    return probs[0] * probs[1] * probs[2]


def artifact_batch(num: int, generator: torch.Generator, kinds: tuple[str, ...] = CORRUPTIONS):
    """Half clean (softened) scenes, half corrupted, the corruption kinds cycling; labels [N] 1 = artifact."""
    images, _ = random_batch(num, "all", generator)
    num_bad = num // 2
    clean = soften(images[num_bad:], generator)
    bad = [corrupt(images[i : i + 1], kinds[i % len(kinds)], generator) for i in range(num_bad)]
    labels = torch.cat([torch.ones(num_bad), torch.zeros(num - num_bad)])  # [N]
    return torch.cat(bad + [clean]), labels


def attribute_loss(judge: AttributeJudge, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = judge(images)
    return sum(torch.nn.functional.cross_entropy(logits[h], labels[:, i]) for i, h in enumerate(HEADS))


@torch.no_grad()
def evaluate_attributes(judge: AttributeJudge, num: int, seed: int) -> dict:
    generator = judge_heldout_generator(seed)
    result = {}
    for name, augment, faint in (("raw", False, 0.0), ("softened", True, 0.0), ("faint", True, 1.0)):
        correct, total = torch.zeros(3), 0
        joint = 0
        for start in range(0, num, 250):
            images, labels = attribute_batch(min(250, num - start), generator, augment, 0.0, faint)
            logits = judge(images)
            hits = torch.stack([logits[h].argmax(1) == labels[:, i] for i, h in enumerate(HEADS)], 1)  # [N, 3]
            correct += hits.float().sum(0)
            joint += hits.all(1).sum().item()
            total += len(labels)
        result[name] = {h: round(correct[i].item() / total, 4) for i, h in enumerate(HEADS)}
        result[name]["all_three"] = round(joint / total, 4)
    generator = judge_impossible_generator(seed)
    fadable = tuple(kind for kind in IMPOSSIBLE_KINDS if kind != "empty")  # an empty scene has no shape to fade
    for name, augment, kinds in (
        ("impossible_raw", False, IMPOSSIBLE_KINDS),
        ("impossible_softened", True, IMPOSSIBLE_KINDS),
        ("impossible_faint", True, fadable),
    ):
        scores = {kind: [] for kind in kinds}
        for start in range(0, num, 250):
            for kind in kinds:  # an equal share of each kind
                images, items = impossible_batch(max(1, min(250, num - start) // len(kinds)), generator, (kind,))
                if kinds is fadable:
                    images = make_faint(images, items, 1.0, generator, False)
                scores[kind].append(best_prompt_score(judge(soften(images, generator) if augment else images)))
        result[name] = {f"{kind}_best_prompt_score": round(torch.cat(s).mean().item(), 4) for kind, s in scores.items()}
        result[name]["mean_best_prompt_score"] = round(
            torch.cat([torch.cat(s) for s in scores.values()]).mean().item(), 4
        )
    return result


@torch.no_grad()
def evaluate_artifact(judge: ArtifactJudge, num: int, seed: int) -> dict:
    """Accuracy on clean scenes (raw and softened) and on each corruption separately."""
    generator = judge_heldout_generator(seed)
    images, _ = random_batch(num, "all", generator)
    sets = {"clean_raw": (images, 0.0), "clean_softened": (soften(images, generator), 0.0)}
    per_kind = max(1, num // len(CORRUPTIONS))
    for kind in CORRUPTIONS:
        sets[kind] = (corrupt(images[:per_kind], kind, generator), 1.0)
    result = {}
    for name, (batch, label) in sets.items():
        predicted = (judge(batch) > 0).float()
        result[name] = round((predicted == label).float().mean().item(), 4)
    result["balanced"] = round(
        0.5 * (result["clean_softened"] + sum(result[k] for k in CORRUPTIONS) / len(CORRUPTIONS)), 4
    )
    return result


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command = "python scripts/train_toy_judges.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    name = ATTRIBUTE_FILE if args.judge == "attributes" else ARTIFACT_FILE
    evaluate = evaluate_attributes if args.judge == "attributes" else evaluate_artifact
    if args.evaluate_only:
        checkpoint = args.checkpoint or (None if out == WEIGHTS_DIR else out / name)
        result = evaluate(load_judge(args.judge, checkpoint), args.num_eval, args.seed)
        print(json.dumps({"judge": args.judge, "heldout_accuracy": result}, indent=2))
        return result

    print(f"command: {command}\nseed: {args.seed}  steps: {args.steps}  out: {out}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    judge = AttributeJudge() if args.judge == "attributes" else ArtifactJudge()
    optimizer = torch.optim.AdamW(judge.parameters(), lr=args.lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
    )
    start, running = time.time(), []
    for step in range(1, args.steps + 1):
        if args.judge == "attributes":
            batch = attribute_batch(args.batch_size, generator, True, args.impossible_fraction, args.faint_fraction)
            loss = attribute_loss(judge, *batch)
        else:
            images, labels = artifact_batch(args.batch_size, generator)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(judge(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        running.append(loss.item())
        if step % 100 == 0 or step == args.steps:
            print(
                f"step {step} loss {sum(running) / len(running):.4f} {(time.time() - start) / step:.3f}s/step",
                flush=True,
            )
            running = []
    path = out / name
    save_file(
        {k: v.detach().half().contiguous() for k, v in judge.state_dict().items()},
        str(path),
        metadata={"command": command, "seed": str(args.seed)},
    )
    # accuracy of the weights as stored (float16), which is what the rewards load
    stored = evaluate(load_judge(args.judge, path), args.num_eval, args.seed)
    entry = {
        **file_entry(path, command, args.seed, args.steps),
        "heldout_accuracy": stored,
        "train_minutes": round((time.time() - start) / 60, 1),
        "threads": args.threads,
    }
    if args.judge == "attributes":
        entry["impossible_fraction"] = args.impossible_fraction
        entry["faint_fraction"] = args.faint_fraction
    write_manifest_entry(out, name, entry)
    print(json.dumps(entry, indent=2), flush=True)
    return entry


if __name__ == "__main__":
    main()
