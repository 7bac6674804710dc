"""`flowrl bench rewards --parts serve`: the reward service on Ray Serve, measured side by side in one run.

- remote over in-process: one client sends batches of `batch_size` images to `flowrl serve-reward` with one replica
  of `cpus` CPUs; the same reward scores the same batch in this process on `cpus` torch threads; interleaved rounds,
  the median of the per-round ratios of wall seconds.
- throughput with 1 and 2 replicas: `clients` concurrent clients each send `rounds` batches; images/s over the
  whole burst. On a CPU machine replicas share its cores (each replica `cpus` CPUs); on a GPU node each replica holds
  its own GPU, so throughput grows with replicas x GPUs.

The reward is clipscore on open_clip's ViT-B-32 architecture with random weights (no download): a real forward of a
real CLIP tower pair, small enough for a 2-core CPU.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from flowrl.bench.rewards import _in_fresh_thread, _served_reward


def _service(name: str, sets: list[str], replicas: int, cpus: float, max_batch_size: int, batch_wait_ms: float):
    """A `flowrl serve-reward NAME` process on Ray Serve (flowrl.bench.rewards' `_served_reward` with its replica
    options)."""
    engine = ("--replicas", str(replicas), "--cpus-per-replica", str(cpus), "--gpus-per-replica", "0")
    engine += ("--max-batch-size", str(max_batch_size), "--batch-wait-ms", str(batch_wait_ms))
    return _served_reward(name, sets, max(1, int(cpus)), engine)


def bench_serve(
    batch_size: int = 16,
    image_size: int = 224,
    rounds: int = 7,
    clients: int = 4,
    burst_rounds: int = 4,
    cpus: float = 1.0,
) -> dict:
    """The ratio remote/in-process at `batch_size` and images/s with 1 and 2 replicas (see the module docstring)."""
    import open_clip
    import torch

    from flowrl.registry import REWARDS
    from flowrl.rewards._tiny import tiny_open_clip

    generator = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch_size, 3, image_size, image_size), generator=generator).float() / 255
    prompts, metadata = [f"a photo of thing {i}" for i in range(batch_size)], [{} for _ in range(batch_size)]
    result: dict = {
        "settings": {
            "reward": "clipscore[ViT-B-32, random weights]",
            "batch_size": batch_size,
            "image_size": image_size,
            "cpus_per_replica": cpus,
            "local_threads": max(1, int(cpus)),
            "machine_cpus": os.cpu_count(),
            "engine": "ray serve (flowrl serve-reward), loopback HTTP, safetensors uint8",
        }
    }
    with tempfile.TemporaryDirectory() as root:
        cfg = open_clip.get_model_config("ViT-B-32")  # config only: random weights, the real architecture's cost
        folder, _ = tiny_open_clip(Path(root) / "vit-b-32", with_weights=False, model_cfg=cfg)
        sets = [f"model_name={folder}", "pretrained=null"]
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, int(cpus)))  # the replica's share of the machine
        try:
            local = REWARDS.build("clipscore", model_name=folder, pretrained=None)
            with _service("clipscore", sets, 1, cpus, batch_size, 10.0) as (url, _):
                remote = REWARDS.build("remote", url=url, timeout_s=600)
                fns = {
                    "local": _in_fresh_thread(lambda: local(images, prompts, metadata)),
                    "remote": lambda: remote(images, prompts, metadata),
                }
                times: dict[str, list[float]] = {name: [] for name in fns}
                for fn in fns.values():
                    fn()  # warm-up
                for _ in range(rounds):
                    for name, fn in fns.items():
                        start = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - start)
        finally:
            torch.set_num_threads(threads)
        ratios = [r / lo for lo, r in zip(times["local"], times["remote"])]
        result["remote_over_local"] = {
            "median": round(statistics.median(ratios), 3),
            "min": round(min(ratios), 3),
            "max": round(max(ratios), 3),
            "local_s": round(statistics.median(times["local"]), 3),
            "remote_s": round(statistics.median(times["remote"]), 3),
            "rounds": rounds,
        }
        result["throughput"] = {}
        for replicas in (1, 2):
            with _service("clipscore", sets, replicas, cpus, batch_size, 10.0) as (url, _):
                result["throughput"][f"{replicas}_replicas"] = _burst(
                    url, images, prompts, metadata, clients, burst_rounds
                )
        one, two = (result["throughput"][f"{n}_replicas"]["images_per_s"] for n in (1, 2))
        result["throughput"]["two_over_one"] = round(two / one, 3)
    return result


def _burst(url: str, images, prompts, metadata, clients: int, rounds: int) -> dict:
    """`clients` threads, each sending `rounds` batches (after one warm-up batch each): images/s over the burst."""
    from flowrl.registry import REWARDS

    remotes = [REWARDS.build("remote", url=url, timeout_s=600) for _ in range(clients)]
    warm = [threading.Thread(target=r, args=(images, prompts, metadata)) for r in remotes]
    for thread in warm:
        thread.start()
    for thread in warm:
        thread.join()
    errors: list[BaseException] = []

    def client(remote) -> None:
        try:
            for _ in range(rounds):
                remote(images, prompts, metadata)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=client, args=(r,)) for r in remotes]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    total = clients * rounds * len(prompts)
    return {
        "clients": clients,
        "batches": clients * rounds,
        "images": total,
        "seconds": round(seconds, 2),
        "images_per_s": round(total / seconds, 2),
    }
