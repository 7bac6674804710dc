"""scripts/train.py that records which process sampled which evaluation samples (test_evaluation_processes.py):
every call of the evaluation's ODE sampler appends its (prompt, seed) pairs to FOLDER/shares_<rank>.jsonl.

    accelerate launch ... tests/trainers/eval_shares.py CONFIG FOLDER
"""

import json
import os
import sys
from pathlib import Path

from flowrl.samplers.ode import ODESampler


def recording_call(folder: Path, rank: int):
    """ODESampler.__call__ that first appends the batch's [[prompt, seed], ...] to FOLDER/shares_<rank>.jsonl."""
    call = ODESampler.__call__

    def recording(self, model, batch, *args, **kwargs):
        with open(folder / f"shares_{rank}.jsonl", "a") as f:
            f.write(json.dumps([[p, int(s)] for p, s in zip(batch.prompts, batch.seeds.tolist())]) + "\n")
        return call(self, model, batch, *args, **kwargs)

    return recording


if __name__ == "__main__":
    from flowrl.cli import run_training

    config, folder = sys.argv[1], Path(sys.argv[2])
    ODESampler.__call__ = recording_call(folder, int(os.environ.get("RANK", "0")))
    sys.exit(run_training(config, []))
