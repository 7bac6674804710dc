"""Write each shipped real-model config's `# Plan:` header line from `flowrl plan` (flowrl/plan/plan.py).

    python scripts/plan_headers.py                       # every configs/<family>/*.yaml but toy/, accelerate/, prompts/
    python scripts/plan_headers.py configs/sd3/grpo_pickscore.yaml

A config's header names the launch it was planned for: `# Plan: NxGPU (DDP|FSDP2) ...`; the line is replaced whole
(or added after the header's first comment lines), nothing else in the file changes.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAUNCH = re.compile(r"^# (?:Plan|Planned for): (\d+)x (H100|H200|B200)[^(]*\((DDP|FSDP2|ZeRO-2)\)")
SHARDING = {"DDP": "none", "FSDP2": "fsdp", "ZeRO-2": "zero2"}
FLAG = {"none": "", "fsdp": " --sharding fsdp", "zero2": " --sharding zero2"}
NAME = {"none": "DDP", "fsdp": "FSDP2", "zero2": "ZeRO-2"}


def real_configs() -> list[Path]:
    """Every real-model config (a symbolic link is the config it links to, planned there)."""
    return sorted(
        p
        for p in (ROOT / "configs").rglob("*.yaml")
        if p.relative_to(ROOT / "configs").parts[0] not in ("toy", "accelerate", "prompts") and not p.is_symlink()
    )


def launch_of(lines: list[str]) -> tuple[int, str, str]:
    """(GPUs, gpu key, sharding) the header plans for: its Plan line, else 8 H100s with data parallelism."""
    for line in lines:
        m = LAUNCH.match(line)
        if m:
            return int(m.group(1)), m.group(2).lower(), SHARDING[m.group(3)]
    return 8, "h100", "none"


def header_line(config: Path, result: dict, gpu: str, sharding: str) -> str:
    n, rel = result["num_gpus"], config.relative_to(ROOT)
    step, hours = result["step_gpu_seconds"][gpu], result["run_gpu_hours"][gpu]
    peak = result["peak_memory_gib"]["total"]
    fit = "fits" if result["fits"][gpu] else "does NOT fit; see flowrl plan for what would"
    return (
        f"# Plan: {n}x {gpu.upper()} ({NAME[sharding]}): {step['research']:.0f} s/step at eta 0.11 "
        f"({step['tuned']:.0f} s at 0.4), {hours['research']:.0f} GPU-hours for {result['num_steps']} steps; "
        f"peak {peak:.0f} GiB per GPU, {fit} "
        f"(flowrl plan {rel} --gpu {gpu} --num-gpus {n}{FLAG[sharding]})"
    )


def write_header(config: Path) -> str:
    from flowrl.plan.plan import plan

    lines = config.read_text().splitlines()
    n, gpu, sharding = launch_of(lines)
    line = header_line(config, plan(config, gpu, n, sharding), gpu, sharding)
    at = next((i for i, x in enumerate(lines) if LAUNCH.match(x)), None)
    if at is None:
        at = next(i for i, x in enumerate(lines) if not x.startswith("#"))
        lines.insert(at, line)
    else:
        lines[at] = line
    config.write_text("\n".join(lines) + "\n")
    return line


if __name__ == "__main__":
    failed = []
    for path in [Path(a).resolve() for a in sys.argv[1:]] or real_configs():
        try:
            print(path.relative_to(ROOT), write_header(path), sep="\n  ", flush=True)
        except Exception as err:  # noqa: BLE001 - report every config that cannot be planned, then fail
            failed.append(path)
            print(f"{path.relative_to(ROOT)}: cannot plan: {type(err).__name__}: {err}", flush=True)
    sys.exit(1 if failed else 0)
