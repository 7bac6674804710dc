"""The prepared GPU check: one run on one lent GPU (an H200, about 8 minutes, no network) that exercises every
GPU-only branch at the real architectures' sizes with random weights, and records the numbers the cost model
needs (docs/gpu.md: what each section measures, where the numbers of a run are recorded).

    python scripts/gpu_check.py --out gpu_check/                            # one GPU, real sizes
    python scripts/gpu_check.py --tiny --device cpu --out /tmp/gpu_check    # every section at tiny size (CI)
    python scripts/gpu_check.py --out gpu_check/ --sections sd3_grpo,sd3_resume

Sections (scripts/_gpu_sections.py): sd3_loader, sd3_grpo, sd3_resume, prompt_cache, flux_step, wan_step,
wan22_step, preview_speed. Each runs on its own with a time budget; a failure is recorded in its JSON as one line
and the next section runs. Writes <out>/<section>.json and <out>/summary.json, and prints the summary.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights only: nothing may download

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _gpu_archs as archs  # noqa: E402
import _gpu_sections as sections  # noqa: E402

# the numbers the summary shows per section (dotted paths into its JSON)
HEADLINES = {
    "sd3_loader": ("load_s", "lora_all_float32", "gradient_checkpointing", "real_size_on_meta.params_B.transformer"),
    "sd3_grpo": ("local_samples", "peak_memory_GB", "steps.0.perf/step_s", "steps.0.perf/rollout_s", "steps.0.perf/optimise_s",
                 "steps.0.first_pass_ratio_exactly_1", "steps.1.first_pass_ratio_exactly_1"),
    "sd3_resume": ("bitwise_equal", "tensors", "max_abs_difference"),
    "prompt_cache": ("MB_per_prompt", "encode_s_per_prompt"),
    "flux_step": ("step.perf/step_s", "step.peak_memory_GB", "step.first_pass_ratio_exactly_1", "real_size_on_meta.params_B.transformer"),
    "wan_step": ("step.perf/step_s", "step.peak_memory_GB", "step.first_pass_ratio_exactly_1", "real_size_on_meta.params_B.transformer"),
    "wan22_step": ("experts_on_device", "step.first_pass_ratio_exactly_1"),
    "preview_speed": ("ran", "formats.fp8.ratio", "formats.fake_fp8.ratio"),
}  # fmt: skip


class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise SectionTimeout in the main thread after `seconds` (checked between Python bytecodes: a CUDA kernel in
    flight finishes first)."""

    def expire(signum, frame):
        raise SectionTimeout(f"over its time budget of {seconds:.0f} s")

    if not hasattr(signal, "SIGALRM"):
        yield
        return
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def jsonable(value):
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, float | int | str | bool) or value is None:
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def lookup(data, dotted: str):
    for key in dotted.split("."):
        if isinstance(data, list) and key.isdigit() and int(key) < len(data):
            data = data[int(key)]
        elif isinstance(data, dict) and key in data:
            data = data[key]
        else:
            return None
    return data


def run_section(name: str, ctx, budget: float) -> dict:
    function = sections.SECTIONS[name][0]
    free_memory()
    tic = time.perf_counter()
    try:
        with time_limit(budget):
            result = function(ctx)
        result = {"ok": bool(result.pop("ok")), **result}
    except Exception as err:  # noqa: BLE001 - recorded as one line, the next section runs
        message = str(err).strip().splitlines()
        result = {"ok": False, "error": f"{type(err).__name__}: {message[0] if message else ''}"}
        result["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
    result["seconds"] = time.perf_counter() - tic
    result["budget_s"] = budget
    if torch.cuda.is_available():
        result["section_peak_memory_GB"] = torch.cuda.max_memory_allocated() / 1e9
    free_memory()
    return result


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "host_cpus": os.cpu_count()}
    for package in ("diffusers", "transformers", "accelerate", "torchao", "peft"):
        with contextlib.suppress(Exception):
            info[package] = __import__(package).__version__
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(device))
        info["gpu_memory_GB"] = torch.cuda.get_device_properties(device).total_memory / 1e9
    with contextlib.suppress(Exception):
        root = Path(__file__).resolve().parents[1]
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for <section>.json and summary.json")
    parser.add_argument("--device", default=None, help="cuda (default when a GPU is present) or cpu")
    parser.add_argument("--tiny", action="store_true", help="every section at tiny size (CPU, CI)")
    parser.add_argument("--sections", default=",".join(sections.SECTIONS), help="comma-separated subset, in order")
    parser.add_argument("--total-budget", type=float, default=480.0, help="seconds; sections not started by then are skipped")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; pass --tiny --device cpu")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("real sizes need a GPU (tens of GB of weights); on a CPU pass --tiny --device cpu")
    names = [n for n in args.sections.split(",") if n]
    unknown = [n for n in names if n not in sections.SECTIONS]
    if unknown:
        raise SystemExit(f"--sections: {', '.join(unknown)} unknown; choose from {', '.join(sections.SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx = sections.Context(args.tiny, device, Path(tmp))
        if not args.tiny:
            archs.install_factories(device, Path(tmp) / "built")
        summary = {"command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}
        summary.update(tiny=args.tiny, device=str(device), machine=machine(device), sections={})
        for name in names:
            left = args.total_budget - (time.perf_counter() - started)
            budget = sections.SECTIONS[name][1] * (3 if args.tiny else 1)
            if left < 5:
                result = {"ok": False, "error": f"skipped: the total budget of {args.total_budget:.0f} s was spent"}
            else:
                result = run_section(name, ctx, min(budget, left))
            result = jsonable(result)
            (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
            line = {"ok": result["ok"], "seconds": round(result.get("seconds", 0.0), 2)}
            if "error" in result:
                line["error"] = result["error"]
            line.update({key: lookup(result, key) for key in HEADLINES[name]})
            summary["sections"][name] = line
            print(f"[{name}] {json.dumps(line)}", flush=True)
    summary["wall_s"] = time.perf_counter() - started
    summary["all_ok"] = all(s["ok"] for s in summary["sections"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"all_ok": summary["all_ok"], "wall_s": round(summary["wall_s"], 1), "out": str(out)}))
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
