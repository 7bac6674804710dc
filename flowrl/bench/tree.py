"""`flowrl bench tree`: tree rollouts (samplers/tree.py) against independent SDE rollouts, at equal leaves and steps.

    flowrl bench tree --json runs/bench/tree.json

On the toy model and on the tiny SD3 pipeline, in one process: one tree of `branching ** len(split_steps)` leaves
(BranchGRPO: 2^4 = 16, splits 0, 3, 6, 9 of 20 steps) against the same number of independent DanceGRPO SDE rollouts
of the same steps (the same step rule, noise level and sigma grid). The forwards are counted by a wrapper around the
model (rows passed to `velocity`, CFG's doubled batch counted once), untimed; the wall times are the denoising loops
(no decode: both decode the same leaves), interleaved round by round in alternating order, medians over the rounds.

Per family: forwards_per_leaf and wall_per_leaf_s of both, nfe_ratio = independent / tree forwards,
wall_ratio = the median over rounds of independent / tree seconds, and wall_over_nfe = wall_ratio / nfe_ratio
(the issue's target: at least 0.85, i.e. batching the frontier keeps what the shared prefixes save). The same ratios
of this process's CPU seconds (cpu_ratio, cpu_over_nfe) leave out time lost to other processes on a shared machine.

Where the tree falls short of its forward count, the cause is the model, not the sampler: both samplers make one
call per step (T calls), and a call costs a fixed part plus a part per row; the tree's early calls are small
(1, 2, 4, 8 nodes), so the fixed part weighs more per node. On the toy UNet (one CPU thread) a call of 1 row costs
24 ms, of 16 rows 113 ms (fixed ≈ 18 ms, 6 ms a row), which bounds its wall_over_nfe near 0.91 for one 16-leaf
tree; the sampler's own arithmetic outside the forwards is about 2% of a rollout.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

FAMILIES = ("toy", "sd3")
TARGET = 0.85  # wall_ratio >= TARGET * nfe_ratio


class CountingModel:
    """A FlowModel that counts the rows (nodes) and calls of its velocity; everything else is the model's."""

    def __init__(self, model):
        self.model, self.rows, self.calls = model, 0, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def velocity(self, latents, sigma, cond, guidance_scale=1.0):
        self.rows += latents.shape[0]
        self.calls += 1
        return self.model.velocity(latents, sigma, cond, guidance_scale)


def interleaved_times(
    fns: dict[str, Callable[[], object]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(wall, CPU) seconds of each function in each of `repeats` rounds (after one warm-up call each); the order within
    a round alternates, so that a load drift over a round hits both sides alike. CPU seconds are this process's."""
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            fns[name]()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return wall, cpu


def _load(family: str, root: Path):
    from flowrl.models import load_flow_model

    if family == "toy":
        return load_flow_model("toy")
    from flowrl.models.tiny import build_tiny_pipeline

    return load_flow_model(str(build_tiny_pipeline(family, root / family)))


def compare(model, tree, independent, batch, repeats: int) -> dict:
    """One family's record: forwards and wall time per leaf of `tree` and `independent` on `batch`."""
    import torch

    leaves = len(batch.prompts)
    forwards = {}
    with torch.no_grad():
        for name, sampler in (("tree", tree), ("independent", independent)):
            counting = CountingModel(model)
            rollout = sampler(counting, batch)
            forwards[name] = (counting.rows, counting.calls)
            if name == "tree" and rollout.extras["num_forwards"] != counting.rows:
                raise RuntimeError(
                    f"tree sampler counted {rollout.extras['num_forwards']} forwards, the model saw {counting.rows}"
                )
        times, cpu = interleaved_times(
            {"tree": lambda: tree(model, batch), "independent": lambda: independent(model, batch)}, repeats
        )
    nfe_ratio = forwards["independent"][0] / forwards["tree"][0]
    wall_ratio = statistics.median(i / t for t, i in zip(times["tree"], times["independent"]))
    cpu_ratio = statistics.median(i / t for t, i in zip(cpu["tree"], cpu["independent"]))
    return {
        "forwards_per_leaf": {name: round(rows / leaves, 4) for name, (rows, _) in forwards.items()},
        "forward_calls": {name: calls for name, (_, calls) in forwards.items()},
        "wall_per_leaf_s": {name: round(statistics.median(ts) / leaves, 6) for name, ts in times.items()},
        "nfe_ratio": round(nfe_ratio, 4),
        "wall_ratio": round(wall_ratio, 4),
        "wall_over_nfe": round(wall_ratio / nfe_ratio, 4),
        "target_met": wall_ratio >= TARGET * nfe_ratio,
        "cpu_ratio": round(cpu_ratio, 4),
        "cpu_over_nfe": round(cpu_ratio / nfe_ratio, 4),
        "rounds_s": {name: [round(t, 4) for t in ts] for name, ts in times.items()},
        "rounds_cpu_s": {name: [round(t, 4) for t in ts] for name, ts in cpu.items()},
    }


def bench_tree(
    repeats: int = 5,
    num_steps: int = 20,
    split_steps: tuple[int, ...] = (0, 3, 6, 9),
    branching: int = 2,
    families: tuple[str, ...] = FAMILIES,
    noise_level: float = 0.3,
    split_noise_scale: float = 4.0,
    max_forward_batch: int = 0,
) -> dict:
    """Tree vs independent SDE rollouts per family: {"settings": ..., "toy": {...}, "sd3": {...}} (see the module)."""
    import torch

    from flowrl.registry import SAMPLERS
    from flowrl.types import PromptBatch

    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"families={list(families)}: {unknown} not benchmarked; choose from {', '.join(FAMILIES)}")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    common = dict(num_steps=num_steps, kind="dance", noise_level=noise_level, sigma_schedule="dance", decode=False)
    tree = SAMPLERS.get("tree")(
        **common,
        split_steps=tuple(split_steps),
        branching=branching,
        split_noise_scale=split_noise_scale,
        max_forward_batch=max_forward_batch,
    )
    independent = SAMPLERS.get("sde")(**common)
    leaves = tree.num_leaves
    batch = PromptBatch(
        ["two red circles"] * leaves, torch.zeros(leaves, dtype=torch.int64), seeds=torch.arange(leaves)
    )
    result: dict = {
        "settings": {
            "leaves": leaves,
            "num_steps": num_steps,
            "split_steps": list(tree.split_steps),
            "branching": branching,
            "kind": "dance",
            "noise_level": noise_level,
            "split_noise_scale": split_noise_scale,
            "max_forward_batch": max_forward_batch,
            "size": "native",
            "decode": False,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "target": f"wall_ratio >= {TARGET} x nfe_ratio",
        }
    }
    with tempfile.TemporaryDirectory() as root:
        for family in families:
            result[family] = compare(_load(family, Path(root)), tree, independent, batch, repeats)
    return result
