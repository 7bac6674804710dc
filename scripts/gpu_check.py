"""The prepared GPU check: one run on one lent GPU (an H100 or H200, 8 minutes, no network) that exercises every
GPU-only branch at the real architectures' sizes with random weights, and records the numbers the cost model needs
(docs/gpu.md: what each section measures, how to run it offline with scripts/gpu_run.sh, where results go).

    python scripts/gpu_check.py --out gpu_check/                            # one GPU, real sizes
    python scripts/gpu_check.py --tiny --device cpu --out /tmp/gpu_check    # every section at tiny size (CI)
    python scripts/gpu_check.py --out gpu_check/ --sections sd3_grpo,sd3_resume

Sections run in SECTIONS' order (the most value per second first: the FP8/BF16 preview ratio and the η of one
SD3.5-M forward/backward) with their time budgets, which add up to less than --total-budget; a failure is recorded
as one line and the next section runs. Writes <out>/sections.json (every section's measurements) and
<out>/summary.json (the machine, per section ok, seconds and headline numbers) after every section, and prints the
summary lines. The run works without the project installed, and without diffusers: the missing package is named.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.util
import json
import multiprocessing
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights only: nothing may download
# transformers' hub kernels (on by default in recent 5.x) download, and need the `kernels` package the image lacks
os.environ.setdefault("USE_HUB_KERNELS", "NO")
# cuBLAS's deterministic mode (the resume pair) is chosen when CUDA starts
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

SCRIPTS, ROOT = Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]
sys.path.insert(0, str(SCRIPTS))
sys.path.insert(0, str(ROOT))

TOTAL_BUDGET = 480.0  # seconds: scripts/gpu_run.sh gives the whole run 520
# name -> time budget in seconds on one H100 / H200 (--tiny: x3, its sizes take seconds on a CPU); the order is the
# run's: value per second first (tests/test_gpu_check.py: the budgets add up to less than TOTAL_BUDGET)
SECTIONS = {
    "preview_speed": 30,  # FP8 / BF16 forward ratio (real FP8 through torchao), the bf16 forward's η
    "sd3_eta": 20,  # η of one SD3.5-M LoRA forward and forward+backward at the training micro-batch
    "sd3_loader": 25,  # the real pipeline through build_policy: dtypes, devices, float32 LoRA, checkpointing
    "sd3_grpo": 70,  # two GRPO steps (deterministic): ratio exactly 1, η and peak memory per phase vs the plan
    "sd3_resume": 40,  # the resume pair's second half: bitwise equal to the straight run
    "prompt_cache": 20,  # bytes and encode seconds per cached prompt
    "wan22_step": 10,  # the tiny Wan2.2 A14B: both experts on the device
    "sd3_nft": 30,  # one DiffusionNFT step at SD3.5-M size
    "nft_async": 12,  # NFT's rollout in a worker thread on its own CUDA stream: staleness 0 = synchronous, bitwise
    "sd3_awm": 30,  # one AWM step at SD3.5-M size
    "sd3_fsdp": 50,  # one-process FSDP2: step, save, resume, bitwise
    "sd3_eval": 20,  # one evaluation pass: seconds per image
    "reward_models": 45,  # PickScore, HPSv2, ImageReward, HPSv3 at real size: seconds per image
    "flux_step": 35,  # one FLUX.1-dev step at 720 px
    "wan_step": 40,  # one Wan2.1-1.3B step at 480x832x33
}
# the numbers the summary shows per section (dotted paths into its JSON)
HEADLINES = {
    "preview_speed": ("fp8_real", "formats.fp8.ratio", "formats.fake_fp8.ratio", "eta_bf16_forward"),
    "sd3_eta": ("eta_forward", "eta_train", "train_over_forward_flops", "activation_peak_GiB",
                "plan.activations_over_plan"),
    "sd3_loader": ("load_s", "lora_all_float32", "gradient_checkpointing", "real_size_on_meta.params_B.transformer"),
    "sd3_grpo": ("steps.1.perf/step_s", "eta.eta", "peak_GiB", "plan.train_over_plan",
                 "steps.1.first_pass_ratio_exactly_1"),
    "sd3_resume": ("bitwise_equal", "tensors", "max_abs_difference", "nondeterministic_ops"),
    "prompt_cache": ("MiB_per_prompt", "encode_s_per_prompt"),
    "wan22_step": ("experts_on_device", "step.first_pass_ratio_exactly_1"),
    "sd3_nft": ("step.perf/step_s", "eta.eta", "peak_GiB", "plan.train_over_plan"),
    "nft_async": ("bitwise_equal", "staleness", "cuda_stream"),
    "sd3_awm": ("step.perf/step_s", "eta.eta", "peak_GiB", "plan.train_over_plan"),
    "sd3_fsdp": ("sharding", "bitwise_equal", "peak_GiB", "plan.train_over_plan"),
    "sd3_eval": ("seconds_per_image", "peak_GiB"),
    "reward_models": tuple(f"{r}.seconds_per_image" for r in ("pickscore", "hpsv2", "imagereward", "hpsv3")),
    "flux_step": ("step.perf/step_s", "eta.eta", "peak_GiB", "plan.train_over_plan", "step.first_pass_ratio_exactly_1"),
    "wan_step": ("step.perf/step_s", "eta.eta", "peak_GiB", "plan.train_over_plan", "step.first_pass_ratio_exactly_1"),
}  # fmt: skip
PACKAGES = ("diffusers", "transformers", "accelerate", "peft", "open_clip", "torchao", "timm", "ftfy")


class SectionTimeout(BaseException):
    """A section's budget ran out (a BaseException: a section's own `except Exception` around one part, e.g. one
    reward model, does not swallow it)."""


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


def error_line(err: BaseException) -> str:
    message = str(err).strip().splitlines()
    return f"{type(err).__name__}: {message[0] if message else ''}"[:400]


def run_section(name: str, function, ctx, budget: float) -> dict:
    free_memory()
    ctx.shared["budget_s"] = budget
    ctx.shared["partial"] = {}  # what a section measured before it failed (it fills this dict as it goes)
    tic = time.perf_counter()
    try:
        with time_limit(budget):
            result = function(ctx)
        result = {"ok": bool(result.pop("ok")), **result}
    except (Exception, SectionTimeout) as err:  # noqa: BLE001 - recorded as one line, the next section runs
        tail = traceback.format_exc().strip().splitlines()[-6:]
        result = {**ctx.shared["partial"], "ok": False, "error": error_line(err), "traceback_tail": tail}
    result["seconds"] = time.perf_counter() - tic
    result["budget_s"] = budget
    if torch.cuda.is_available():
        result["section_peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    free_memory()
    return result


def machine(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "host_cpus": os.cpu_count()}
    info["date"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    for package in PACKAGES:
        try:
            info[package] = __import__(package).__version__ if importlib.util.find_spec(package) else "missing"
        except Exception as err:  # noqa: BLE001 - a package that fails to import is named with its error
            info[package] = f"fails to import: {error_line(err)}"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = "sm_{}{}".format(*torch.cuda.get_device_capability(device))
        info["gpu_memory_GiB"] = torch.cuda.get_device_properties(device).total_memory / 2**30
    with contextlib.suppress(Exception):
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        info["commit"] = git.stdout.strip() or None
    # a copy of the tree without .git (the device machine's): the commit its sender named
    info["commit"] = info.get("commit") or os.environ.get("GPU_CHECK_COMMIT")
    return info


def start_plans(sections, names: list[str], tiny: bool, workers: int):
    """`flowrl plan`'s estimates for the sections' batches, computed in worker processes while the sections run (CPU
    work on the meta device): {name: Future}."""
    jobs = {name: sections.plan_job(name, tiny) for name in names}
    jobs = {name: job for name, job in jobs.items() if job is not None}
    if not jobs:
        return None, {}
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"))
    futures, by_job = {}, {}
    for name, job in jobs.items():
        key = json.dumps(job)
        by_job.setdefault(key, pool.submit(sections.plan_estimate, *job))
        futures[name] = by_job[key]
    return pool, futures


def write(out: Path, summary: dict, results: dict) -> None:
    (out / "sections.json").write_text(json.dumps(jsonable(results), indent=2) + "\n")
    (out / "summary.json").write_text(json.dumps(jsonable(summary), indent=2) + "\n")


def summary_line(name: str, result: dict) -> dict:
    line = {"ok": result["ok"], "seconds": round(result.get("seconds", 0.0), 2)}
    if "error" in result:
        line["error"] = result["error"]
    line.update({key: lookup(result, key) for key in HEADLINES[name]})
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for sections.json and summary.json")
    parser.add_argument("--device", default=None, help="cuda (default when a GPU is present) or cpu")
    parser.add_argument("--tiny", action="store_true", help="every section at tiny size (CPU, CI)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, in order")
    parser.add_argument(
        "--total-budget", type=float, default=TOTAL_BUDGET, help="seconds; sections not started by then are skipped"
    )
    fp8 = "preview_speed fails unless real FP8 ran (on sm_89+ always)"
    parser.add_argument("--require-fp8", action="store_true", help=fp8)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU here; pass --tiny --device cpu")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("real sizes need a GPU (tens of GB of weights); on a CPU pass --tiny --device cpu")
    names = [n for n in args.sections.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"--sections: {', '.join(unknown)} unknown; choose from {', '.join(SECTIONS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])
    summary = {"command": command, "tiny": args.tiny, "device": str(device), "machine": machine(device), "sections": {}}
    results: dict = {}
    try:
        import _gpu_archs as archs
        import _gpu_sections as sections
    except Exception as err:  # noqa: BLE001 - no section can run: said in the JSON, not as a bare traceback
        summary.update(all_ok=False, error=f"the sections do not import: {error_line(err)}")
        summary["wall_s"] = time.perf_counter() - started
        write(out, summary, results)
        print(json.dumps({"all_ok": False, "error": summary["error"]}))
        return 2
    if device.type == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    child = os.environ.get(sections.FSDP_CHILD) == "1"
    workers = 1 if args.tiny or child else max(1, min(4, (os.cpu_count() or 4) // 4))
    pool, plans = (None, {}) if child else start_plans(sections, names, args.tiny, workers)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        ctx = sections.Context(args.tiny, device, Path(tmp), require_fp8=args.require_fp8)
        if not args.tiny:
            try:
                archs.install_factories(device, Path(tmp) / "built")
            except Exception as err:  # noqa: BLE001 - the real-size sections then fail with their own errors
                summary["factories_error"] = error_line(err)
        for name in names:
            left = args.total_budget - (time.perf_counter() - started)
            budget = SECTIONS[name] * (3 if args.tiny else 1)
            if left < 5:
                result = {"ok": False, "error": f"skipped: the total budget of {args.total_budget:.0f} s was spent"}
            else:
                result = run_section(name, sections.FUNCTIONS[name][0], ctx, min(budget, left))
            results[name] = jsonable(result)
            summary["sections"][name] = summary_line(name, results[name])
            print(f"[{name}] {json.dumps(summary['sections'][name])}", flush=True)
            write(out, summary, results)
    if pool is not None:  # the plan's estimates beside the measured peaks
        wait = max(10.0, args.total_budget + 20 - (time.perf_counter() - started))
        for name, future in plans.items():
            if name not in results:
                continue
            try:
                estimate = future.result(timeout=wait)
                results[name]["plan"] = jsonable(sections.compare_with_plan(results[name], estimate))
            except Exception as err:  # noqa: BLE001 - the measurement stands without its estimate
                results[name]["plan"] = {"error": error_line(err)}
            summary["sections"][name] = summary_line(name, results[name])
        pool.shutdown(wait=False, cancel_futures=True)
    summary["wall_s"] = time.perf_counter() - started
    summary["all_ok"] = all(s["ok"] for s in summary["sections"].values())
    write(out, summary, results)
    print(json.dumps({"all_ok": summary["all_ok"], "wall_s": round(summary["wall_s"], 1), "out": str(out)}))
    return 0 if summary["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
