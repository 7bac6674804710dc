"""Training entry point for `accelerate launch`.

accelerate launch scripts/train.py --config configs/toy/grpo.yaml [key=value ...]
accelerate launch --multi_gpu --num_processes 2 scripts/train.py --config configs/toy/grpo.yaml device=cpu
"""

from __future__ import annotations

import argparse
import sys

from flowrl.cli import run_training


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides, e.g. train.learning_rate=1e-4")
    args = parser.parse_args()
    return run_training(args.config, args.overrides)


if __name__ == "__main__":
    sys.exit(main())
