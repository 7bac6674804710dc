"""`flowrl bench rewards`: images/s of every reward, and the remote reward over the same reward in process, measured
side by side in one process and written as JSON with ratios.

Timings are best-of-`repeats` wall times after one warm-up call (the remote comparison: medians of interleaved
rounds); nothing here is asserted by tests. The Ray Serve part (`--parts serve`) is flowrl/bench/serving.py, which
starts its servers with `_served_reward` and times the in-process side with `_in_fresh_thread` from here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["bench_rewards", "best_times"]


def best_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each function over `repeats` rounds, after one warm-up call each.

    The functions are interleaved within each round, so that load from other processes hits them alike.
    """
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _round_times(
    fns: dict[str, Callable[[], object]], rounds: int, cpu_clocks: dict[str, Callable[[], float]]
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of each function in each of `rounds` rounds (a, b, a, b, ...), after one warm-up call each.

    CPU seconds (`cpu_clocks[name]` may add up several processes) depend less on other processes' load than wall
    times."""
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), cpu_clocks[name]()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(cpu_clocks[name]() - start_cpu)
    return wall, cpu


def _in_fresh_thread(fn: Callable[[], object]) -> Callable[[], None]:
    """`fn` run under no_grad on a new thread per call, as the serve-reward server runs each request: on a CPU a model
    call on the main thread measured about 25% slower than the same call on another thread, so this is the fair side."""
    import threading

    import torch

    def call() -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                with torch.no_grad():
                    fn()
            except BaseException as err:  # re-raised on the caller's thread
                errors.append(err)

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        if errors:
            raise errors[0]

    return call


def _process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of another process so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, in clock ticks


@contextlib.contextmanager
def _served_reward(name: str, sets: list[str], threads: int, engine: tuple[str, ...] = ("--engine", "local")):
    """A `flowrl serve-reward NAME --port 0` subprocess on the CPU with `threads` torch threads and the `engine`
    arguments (default: one process; Ray Serve's replica options otherwise); yields (URL, pid). Stopped by SIGTERM."""
    command = [sys.executable, "-m", "flowrl.cli", "serve-reward", name, *engine, "--port", "0", "--device", "cpu"]
    command += [arg for pair in sets for arg in ("--set", pair)]
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
        )
        try:
            line = process.stdout.readline()  # "flowrl serve-reward: serving NAME on http://HOST:PORT"
            if " on http://" not in line:
                stderr.seek(0)
                raise RuntimeError(f"bench: `{' '.join(command)}` did not start: {line!r} {stderr.read()[-800:]}")
            yield line.strip().rsplit(" ", 1)[-1], process.pid
        finally:
            process.terminate()  # SIGTERM: the server closes (on Ray Serve: Serve and Ray shut down)
            try:
                process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def bench_rewards(repeats: int = 3, batch_size: int = 8, remote_batch_size: int = 16, real_sizes: bool = True) -> dict:
    """Images/s of every reward at batch 8 on its tiny checkpoint (flowrl.rewards._tiny); the CLIP and BLIP families
    at their real default sizes with random weights (best of min(repeats, 2): a ViT-H call takes seconds on a CPU);
    and the `remote` reward over in-process at batch 16: a `flowrl serve-reward` subprocess (safetensors uint8 over
    loopback HTTP) against the same call in this process on a fresh thread (as the server runs it), interleaved for
    max(repeats, 5) rounds: median wall and CPU seconds, the median of the per-round ratios remote/local (with min and
    max), the payload size, the client's encoding and the server's decoding time."""
    import statistics

    import open_clip
    import torch

    from flowrl.registry import REWARDS
    from flowrl.rewards._tiny import (
        BERT_BASE,
        BLIP_LARGE,
        TINY_REWARDS,
        make_imagereward_files,
        tiny_aesthetic_head,
        tiny_open_clip,
    )
    from flowrl.rewards.remote import encode_batch
    from flowrl.serving.server import decode_request

    def inputs(reward, n: int, size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        shape = (n, 3, size, size) if "image" in reward.modalities else (n, 4, 3, size, size)  # video: 4 frames
        return torch.randint(0, 256, shape, generator=generator).float() / 255

    def images_per_s(reward, n: int, size: int, rounds: int) -> float:
        images, prompts = inputs(reward, n, size), [f'a sign that says "reward {i}"' for i in range(n)]
        seconds = best_times({"score": lambda: reward(images, prompts, [{} for _ in prompts])}, rounds)["score"]
        return round(n / seconds, 3)

    result: dict = {
        "settings": {
            "batch_size": batch_size,
            "remote_batch_size": remote_batch_size,
            "repeats": repeats,
            "threads": torch.get_num_threads(),
            "device": "cpu",
            "unit": "images/s (video rewards: videos of 4 frames/s)",
        },
        "tiny": {},
        "real": {},
    }
    with tempfile.TemporaryDirectory() as root, torch.no_grad():
        for name, build in TINY_REWARDS.items():
            folder = Path(root) / "tiny" / name
            folder.mkdir(parents=True)
            try:
                reward = REWARDS.build(name, **build(folder))
            except (FileNotFoundError, ImportError) as err:
                result["tiny"][name] = {"skipped": str(err)}
                continue
            result["tiny"][name] = {
                "images_per_s": images_per_s(reward, batch_size, 64, max(repeats, 10))
            }  # ms calls: more
        if not real_sizes:
            return result
        rounds = min(repeats, 2)

        def open_clip_folder(arch: str) -> str:  # config only: open_clip initializes the real architecture randomly
            return tiny_open_clip(Path(root) / arch, with_weights=False, model_cfg=open_clip.get_model_config(arch))[0]

        vit_l = open_clip_folder("ViT-L-14")
        tiny_aesthetic_head(Path(root) / "aesthetic.pth", dims=(768, 1024, 128, 64, 16, 1))
        real = {
            "clipscore[ViT-L-14]": lambda: REWARDS.build("clipscore", model_name=vit_l, pretrained=None),
            "aesthetic[ViT-L-14 + MLP]": lambda: REWARDS.build(
                "aesthetic", model_name=vit_l, pretrained=None, checkpoint=str(Path(root) / "aesthetic.pth")
            ),
            # hpsv2 and pickscore run this same computation (CLIP ViT-H-14 image + text towers, cosine)
            "hpsv2/pickscore[ViT-H-14]": lambda: REWARDS.build(
                "clipscore", model_name=open_clip_folder("ViT-H-14"), pretrained=None
            ),
            "imagereward[BLIP ViT-L + BERT-base]": lambda: REWARDS.build(
                "imagereward",
                **make_imagereward_files(
                    Path(root) / "imagereward",
                    vision=BLIP_LARGE,
                    med_overrides=BERT_BASE,
                    words=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(30517)],
                    dtype=torch.bfloat16,
                ),
            ),
        }
        for label, build_reward in real.items():
            start = time.perf_counter()
            reward = build_reward()
            load_s = round(time.perf_counter() - start, 2)
            result["real"][label] = {"load_s": load_s, "images_per_s": images_per_s(reward, batch_size, 512, rounds)}
            if label.startswith("clipscore"):
                local = reward
            else:
                del reward

        # remote vs in-process: the same ViT-L-14 clipscore (the server's own random weights), 512x512 images, batch 16
        images = inputs(local, remote_batch_size, 512)
        prompts, metadata = [f"prompt {i}" for i in range(remote_batch_size)], [{} for _ in range(remote_batch_size)]
        remote_rounds = max(repeats, 5)
        with _served_reward("clipscore", [f"model_name={vit_l}", "pretrained=null"], torch.get_num_threads()) as (
            url,
            pid,
        ):
            remote = REWARDS.build("remote", url=url, timeout_s=600)
            clocks = {"local": time.process_time, "remote": lambda: time.process_time() + _process_cpu_s(pid)}
            times, cpu = _round_times(
                {
                    "local": _in_fresh_thread(lambda: local(images, prompts, metadata)),
                    "remote": lambda: remote(images, prompts, metadata),
                },
                remote_rounds,
                clocks,
            )
        body, headers = encode_batch(images, prompts, metadata)
        encode_s = min(best_times({"encode": lambda: encode_batch(images, prompts, metadata)}, 3).values())
        decode_s = min(best_times({"decode": lambda: decode_request(body, headers["Content-Type"])}, 3).values())
        ratios = [r / lo for lo, r in zip(times["local"], times["remote"])]
        cpu_ratios = [r / lo for lo, r in zip(cpu["local"], cpu["remote"])]
        median = lambda values: round(statistics.median(values), 3)  # noqa: E731
        result["remote"] = {
            "reward": "clipscore[ViT-L-14]",
            "image_size": 512,
            "batch_size": remote_batch_size,
            "rounds": remote_rounds,
            "server": "flowrl serve-reward subprocess, loopback",
            "wire": "safetensors uint8, no compression",
            "local_call": "in process, one fresh thread per call (as the server runs each request)",
            "local_s": median(times["local"]),
            "remote_s": median(times["remote"]),
            "remote_minus_local_s": median([r - lo for lo, r in zip(times["local"], times["remote"])]),
            "remote_over_local": median(ratios),
            "remote_over_local_min": round(min(ratios), 3),
            "remote_over_local_max": round(max(ratios), 3),
            # CPU seconds (client + server process for remote): the transport's cost with other processes' load left out
            "local_cpu_s": median(cpu["local"]),
            "remote_cpu_s": median(cpu["remote"]),
            "remote_over_local_cpu": median(cpu_ratios),
            "remote_over_local_cpu_min": round(min(cpu_ratios), 3),
            "remote_over_local_cpu_max": round(max(cpu_ratios), 3),
            "local_rounds_s": [round(t, 3) for t in times["local"]],
            "remote_rounds_s": [round(t, 3) for t in times["remote"]],
            "payload_mb": round(len(body) / 1e6, 2),
            "encode_s": round(encode_s, 4),
            "decode_s": round(decode_s, 4),
        }
    return result
