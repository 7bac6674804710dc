r"""Evaluation entry point for `accelerate launch`: `flowrl eval` with the eval prompts x seeds split over the
processes.

accelerate launch scripts/evaluate.py --config configs/sd3/grpo_pickscore.yaml \
    --checkpoint runs/NAME/checkpoints/step_XXXXXX
accelerate launch --multi_gpu --num_processes 2 scripts/evaluate.py --config configs/toy/grpo.yaml \
    --checkpoint base --set device=cpu
accelerate launch scripts/evaluate.py --benchmark geneval --model stabilityai/stable-diffusion-3.5-medium

A benchmark (--benchmark, docs/evaluation.md#benchmarks) is split over the processes alike.
"""

from __future__ import annotations

import sys

from flowrl.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
