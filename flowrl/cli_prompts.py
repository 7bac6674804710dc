"""`flowrl prompts`: write a real prompt set to the file a config's `data.prompts_file` reads.

flowrl prompts geneval --out geneval_test.jsonl                  # GenEval's 553 evaluation prompts and metadata
flowrl prompts geneval --split train --out geneval_train.jsonl   # 50,000 that share none with them
flowrl prompts ocr --split train --out ocr_train.txt             # Flow-GRPO's OCR prompts, through `datasets`
flowrl prompts drawbench --out drawbench.jsonl --source DIR      # from a local copy instead of the network

flowrl/prompt_sets.py makes (GenEval) or loads (OCR, PickScore, DrawBench) the records; flowrl/cli.py registers the
command with `add_parser` and `run`. Heavy imports happen inside `run`, so `flowrl --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys

SETS = "geneval, ocr, pickscore or drawbench"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "prompts",
        help="write a real prompt set (geneval made here; ocr, pickscore, drawbench read through datasets) to a file",
    )
    p.add_argument("set", metavar="SET", help=SETS)
    p.add_argument("--out", required=True, help=".jsonl (one record a line, with metadata) or .txt (one prompt a line)")
    p.add_argument("--split", choices=["train", "test"], default="test", help="default: test (the benchmark)")
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="geneval only: the generator's seed for both splits (default 43: GenEval's published prompts)",
    )
    p.add_argument("--num-prompts", type=int, default=None, help="geneval train only: how many (default 50,000)")
    p.add_argument(
        "--source",
        default=None,
        help="ocr, pickscore, drawbench: a local copy instead of the network, a `datasets` save_to_disk folder or a "
        ".txt/.jsonl/.csv/.parquet file",
    )


def run(args: argparse.Namespace) -> int:
    from flowrl.prompt_sets import (
        GENEVAL_SEED,
        HUB_SETS,
        PromptSetUnavailable,
        prompt_set_records,
        task_counts,
        write_records,
    )

    spec = f"{args.set}:{args.split}"
    try:
        records = prompt_set_records(spec, seed=args.seed, num_prompts=args.num_prompts, source=args.source)
        header = f"{spec}: {HUB_SETS[args.set].about}" if args.set in HUB_SETS else None
        path = write_records(records, args.out, header=header)
    except (ValueError, FileNotFoundError, PromptSetUnavailable) as err:
        print(f"flowrl prompts: error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    tasks = ", ".join(f"{tag} {n}" for tag, n in task_counts(records).items())
    seed = f", seed {GENEVAL_SEED if args.seed is None else args.seed}" if args.set == "geneval" else ""
    print(f"wrote {len(records)} prompts ({spec}{seed}) to {path}" + (f": {tasks}" if tasks else ""))
    return 0
