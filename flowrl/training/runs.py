"""The run folder: the one owner of `<output_dir>/<name>/...` paths, and the run's metric log.

runs/<name>/
  config.yaml              the resolved config
  launch.json              processes, distributed type, sharding, precision, device
  metrics.jsonl            one JSON line per training step ({"step": s, "time": t, metric: value, ...})
  checkpoints/step_XXXXXX/ full training state (flowrl.training.checkpoint)
  eval/base, eval/step_XXXXXX/   scores.json + images (flowrl.training.evaluation)
  report/                  index.html and grids (flowrl.report)
  summary.json             `flowrl demo`'s before/after numbers
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

CHECKPOINTS = "checkpoints"  # <run>/checkpoints/step_XXXXXX
STEP_NAME = re.compile(r"step_(\d+)")


def step_dir_name(step: int | None) -> str:
    """Folder name of one evaluation or checkpoint: 'step_000120'; None is the base model ('base')."""
    return "base" if step is None else f"step_{int(step):06d}"


def step_of(name: str) -> int | None:
    """The step a 'step_000120' folder name stands for (step_dir_name's inverse); None for any other name ('base')."""
    match = STEP_NAME.fullmatch(name)
    return int(match.group(1)) if match else None


class RunFolder:
    def __init__(self, output_dir: str | Path, name: str):
        self.root = Path(output_dir) / name

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def launch(self) -> Path:
        return self.root / "launch.json"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    def eval_dir(self, step: int | None) -> Path:
        return self.root / "eval" / step_dir_name(step)

    @property
    def report(self) -> Path:
        return self.root / "report"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    def start(self, accelerator, config_yaml: str, sharding: str | None, mixed_precision: str) -> None:
        """Create the folder and write config.yaml and launch.json (main process only)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if accelerator.is_main_process:
            self.config.write_text(config_yaml)
            self.launch.write_text(
                json.dumps(
                    {
                        "num_processes": accelerator.num_processes,
                        "distributed_type": accelerator.distributed_type.name,
                        "sharding": sharding or "none",
                        "mixed_precision": mixed_precision,
                        "device": str(accelerator.device),
                    },
                    indent=2,
                )
            )

    def log(self, accelerator, step: int, metrics: dict) -> None:
        """Append one step's finite scalar metrics to metrics.jsonl and hand them to the trackers."""
        finite = finite_metrics(metrics)
        if accelerator.is_main_process:
            with open(self.metrics, "a") as f:
                f.write(json.dumps({"step": step, "time": time.time(), **finite}) + "\n")
        accelerator.log(finite, step=step)

    def forget_after(self, step: int) -> None:
        """Drop metric lines logged after `step` (a resumed run repeats those steps)."""
        if self.metrics.exists():
            kept = [line for line in self.metrics.read_text().splitlines() if _logged_step(line) <= step]
            self.metrics.write_text("".join(line + "\n" for line in kept))


def finite_metrics(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}


def _logged_step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a line cut by a crash: drop it
