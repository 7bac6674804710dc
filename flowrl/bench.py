"""`flowrl bench ...`: speed measured side by side in one process, written as JSON with ratios.

Timings are best-of-`repeats` wall times after one warm-up call; nothing here is asserted by tests.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable


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


def bench_rollout(repeats: int = 5, height: int = 64, width: int = 64, num_steps: int = 10, batch_size: int = 4) -> dict:
    """Diffusers pipeline vs flowrl's ODE and SDE samplers on the tiny SD3 and FLUX pipelines."""
    import torch

    from flowrl.models import load_flow_model
    from flowrl.models.tiny import build_tiny_pipeline
    from flowrl.registry import SAMPLERS
    from flowrl.types import PromptBatch

    prompts = [f"a photo of object number {i}" for i in range(batch_size)]
    seeds = list(range(batch_size))
    batch = PromptBatch(prompts, torch.arange(batch_size), seeds=torch.tensor(seeds))
    result: dict = {"settings": {"height": height, "width": width, "num_steps": num_steps, "batch_size": batch_size,
                                 "repeats": repeats, "threads": torch.get_num_threads(), "prompt_cache": "warm"}}
    with tempfile.TemporaryDirectory() as root:
        for family in ("sd3", "flux"):
            model = load_flow_model(str(build_tiny_pipeline(family, Path(root) / family)))
            guidance = model.default_guidance_scale
            common = dict(num_steps=num_steps, height=height, width=width, guidance_scale=guidance)
            ode = SAMPLERS.get("ode")(**common)
            sde = SAMPLERS.get("sde")(**common, kind="flow_grpo", noise_level=0.7)

            def pipeline():
                gens = [torch.Generator().manual_seed(s) for s in seeds]
                return model.pipe(prompts, height=height, width=width, num_inference_steps=num_steps,
                                  guidance_scale=guidance, generator=gens, output_type="pt")

            with torch.no_grad():
                times = best_times({"pipeline": pipeline, "ode": lambda: ode(model, batch), "sde": lambda: sde(model, batch)},
                                   repeats)
            pipeline_s, ode_s, sde_s = times["pipeline"], times["ode"], times["sde"]
            result[family] = {
                "pipeline_s": round(pipeline_s, 5), "ode_s": round(ode_s, 5), "sde_s": round(sde_s, 5),
                "ode_over_pipeline": round(ode_s / pipeline_s, 3), "sde_over_pipeline": round(sde_s / pipeline_s, 3),
            }
    return result


def bench_report(repeats: int = 1, num_prompts: int = 100, num_seeds: int = 8, num_checkpoints: int = 3,
                 size: int = 32) -> dict:
    """Time to build the report of a fabricated run: base + `num_checkpoints` evals of prompts x seeds, and
    the size of its index.html. Images are smooth random `size`x`size` PNGs (the toy world's resolution)."""
    import json

    import numpy as np
    from PIL import Image

    from flowrl.report import build_report

    rng = np.random.default_rng(0)
    rewards = {"train": ["toy_attributes"], "gold": ["toy_artifact", "jpeg_compressibility"]}
    names = rewards["train"] + rewards["gold"]
    prompts = [f"{1 + i % 3} {['red', 'green', 'blue'][i % 3]} shapes number {i}" for i in range(num_prompts)]
    seeds = list(range(num_seeds))
    with tempfile.TemporaryDirectory() as root:
        run = Path(root) / "bench_run"
        steps = [0] + [100 * (k + 1) for k in range(num_checkpoints)]
        (run / "checkpoints").mkdir(parents=True)
        (run / "config.yaml").write_text("model:\n  path: toy\nrewards:\n  - name: toy_attributes\n")
        with open(run / "metrics.jsonl", "w") as f:
            for step in range(1, steps[-1] + 1):
                f.write(json.dumps({"step": step, "time": step * 1.0, "train/loss": float(rng.normal()),
                                    "train/kl": step * 1e-4, "reward/toy_attributes/mean": step / steps[-1],
                                    "reward/toy_attributes/std": 0.1}) + "\n")
        for step in steps:
            folder = run / "eval" / ("base" if step == 0 else f"step_{step:06d}")
            folder.mkdir(parents=True)
            if step:
                (run / "checkpoints" / folder.name).mkdir()
            samples = []
            for p in range(num_prompts):
                for s in seeds:
                    coarse = rng.integers(0, 256, (size // 8, size // 8, 3), dtype=np.uint8)  # [h, w, 3]
                    image = Image.fromarray(coarse).resize((size, size), Image.Resampling.BILINEAR)
                    image.save(folder / f"p{p:03d}_s{s:03d}.png")
                    samples.append({"prompt_index": p, "seed_index": s, "seed": s, "image": f"p{p:03d}_s{s:03d}.png",
                                    "scores": {n: float(rng.random()) for n in names}})
            per_prompt = {n: [float(np.mean([x["scores"][n] for x in samples[p * num_seeds:(p + 1) * num_seeds]]))
                              for p in range(num_prompts)] for n in names}
            diversity = [float(rng.random()) for _ in prompts]
            (folder / "scores.json").write_text(json.dumps({
                "format": "flowrl.eval/1", "step": step, "label": folder.name, "is_video": False, "prompts": prompts,
                "seeds": seeds, "metadata": [{} for _ in prompts], "rewards": rewards, "samples": samples,
                "per_prompt": per_prompt, "means": {n: float(np.mean(v)) for n, v in per_prompt.items()},
                "diversity": {"space": "pixel", "per_prompt": diversity, "mean": float(np.mean(diversity))},
            }))
        times = []
        for _ in range(max(1, repeats)):
            start = time.perf_counter()
            result = build_report(run, out_dir=Path(root) / "report")
            times.append(time.perf_counter() - start)
        grid_bytes = sum(Path(g).stat().st_size for g in result["grids"])
    return {
        "settings": {"num_prompts": num_prompts, "num_seeds": num_seeds, "num_checkpoints": num_checkpoints,
                     "evals_including_base": len(steps), "image_size": size, "repeats": repeats,
                     "metrics_lines": steps[-1]},
        "build_s": round(min(times), 3),
        "index_html_bytes": result["index_bytes"],
        "index_html_mb": round(result["index_bytes"] / 1e6, 2),
        "num_grids": len(result["grids"]),
        "grid_png_bytes": grid_bytes,
    }


def bench_rewards(repeats: int = 3, batch_size: int = 8, remote_batch_size: int = 16, real_sizes: bool = True) -> dict:
    """Images/s of every reward at batch 8 on its tiny checkpoint (flowrl.rewards.tiny); the CLIP and BLIP families
    at their real default sizes with random weights (best of min(repeats, 2): a ViT-H call takes seconds on a CPU);
    and the `remote` reward (a serve-reward server in a thread, PNG over HTTP) over in-process at batch 16."""
    import threading

    import open_clip
    import torch

    from flowrl.registry import REWARDS
    from flowrl.rewards.reward_server import make_server
    from flowrl.rewards.tiny import BERT_BASE, BLIP_LARGE, TINY_REWARDS, make_imagereward_files, tiny_aesthetic_head, tiny_open_clip

    def inputs(reward, n: int, size: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        shape = (n, 3, size, size) if "image" in reward.modalities else (n, 4, 3, size, size)  # video: 4 frames
        return torch.randint(0, 256, shape, generator=generator).float() / 255

    def images_per_s(reward, n: int, size: int, rounds: int) -> float:
        images, prompts = inputs(reward, n, size), [f'a sign that says "reward {i}"' for i in range(n)]
        seconds = best_times({"score": lambda: reward(images, prompts, [{} for _ in prompts])}, rounds)["score"]
        return round(n / seconds, 3)

    result: dict = {"settings": {"batch_size": batch_size, "remote_batch_size": remote_batch_size, "repeats": repeats,
                                 "threads": torch.get_num_threads(), "device": "cpu", "unit": "images/s (video rewards: videos of 4 frames/s)"},
                    "tiny": {}, "real": {}}
    with tempfile.TemporaryDirectory() as root, torch.no_grad():
        for name, build in TINY_REWARDS.items():
            folder = Path(root) / "tiny" / name
            folder.mkdir(parents=True)
            try:
                reward = REWARDS.build(name, **build(folder))
            except (FileNotFoundError, ImportError) as err:
                result["tiny"][name] = {"skipped": str(err)}
                continue
            result["tiny"][name] = {"images_per_s": images_per_s(reward, batch_size, 64, max(repeats, 10))}  # ms calls: more rounds
        if not real_sizes:
            return result
        rounds = min(repeats, 2)

        def open_clip_folder(arch: str) -> str:  # config only: open_clip initializes the real architecture randomly
            return tiny_open_clip(Path(root) / arch, with_weights=False, model_cfg=open_clip.get_model_config(arch))[0]

        vit_l = open_clip_folder("ViT-L-14")
        tiny_aesthetic_head(Path(root) / "aesthetic.pth", dims=(768, 1024, 128, 64, 16, 1))
        real = {
            "clipscore[ViT-L-14]": lambda: REWARDS.build("clipscore", model_name=vit_l, pretrained=None),
            "aesthetic[ViT-L-14 + MLP]": lambda: REWARDS.build("aesthetic", model_name=vit_l, pretrained=None, checkpoint=str(Path(root) / "aesthetic.pth")),
            # hpsv2 and pickscore run this same computation (CLIP ViT-H-14 image + text towers, cosine)
            "hpsv2/pickscore[ViT-H-14]": lambda: REWARDS.build("clipscore", model_name=open_clip_folder("ViT-H-14"), pretrained=None),
            "imagereward[BLIP ViT-L + BERT-base]": lambda: REWARDS.build("imagereward", **make_imagereward_files(
                Path(root) / "imagereward", vision=BLIP_LARGE, med_overrides=BERT_BASE,
                words=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(30517)], dtype=torch.bfloat16)),
        }
        for label, build_reward in real.items():
            start = time.perf_counter()
            reward = build_reward()
            result["real"][label] = {"load_s": round(time.perf_counter() - start, 2), "images_per_s": images_per_s(reward, batch_size, 512, rounds)}
            if label.startswith("clipscore"):
                local = reward
            else:
                del reward

        # remote vs in-process: the same ViT-L-14 clipscore, 512x512 images, batch 16
        server = make_server(local, port=0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            remote = REWARDS.build("remote", url=f"http://127.0.0.1:{server.server_address[1]}", timeout_s=600)
            images = inputs(local, remote_batch_size, 512)
            prompts, metadata = [f"prompt {i}" for i in range(remote_batch_size)], [{} for _ in range(remote_batch_size)]
            times = best_times({"local": lambda: local(images, prompts, metadata), "remote": lambda: remote(images, prompts, metadata)}, rounds)
        finally:
            server.shutdown()
            server.server_close()
        result["remote"] = {"reward": "clipscore[ViT-L-14]", "image_size": 512, "batch_size": remote_batch_size,
                            "local_s": round(times["local"], 3), "remote_s": round(times["remote"], 3),
                            "remote_minus_local_s": round(times["remote"] - times["local"], 3),
                            "remote_over_local": round(times["remote"] / times["local"], 3)}
    return result


def bench_train(repeats: int = 3, overrides: list[str] | None = None) -> dict:
    """The toy GRPO config for `repeats` steps (after one warm-up step): throughput, peak RSS, time shares."""
    import resource
    import shutil

    import torch

    from flowrl.config import load_config
    from flowrl.demo import CONFIG
    from flowrl.trainers.grpo import GRPOTrainer

    with tempfile.TemporaryDirectory() as root:
        cfg = load_config(CONFIG, [f"output_dir={root}", "name=bench", "logging.trackers=[]", "logging.progress_bar=false",
                                   *(overrides or [])])
        shutil.rmtree(cfg.run_dir, ignore_errors=True)
        trainer = GRPOTrainer(cfg)
        trainer.train_step()  # warm-up
        steps = [trainer.train_step() for _ in range(repeats)]
    total = sum(m["perf/step_s"] for m in steps)
    rollout = sum(m["perf/rollout_s"] for m in steps)
    reward = sum(m["perf/reward_s"] for m in steps)
    optimise = sum(m["perf/optimise_s"] for m in steps)
    samples = trainer.local_n * len(steps)
    return {
        "settings": {"config": str(CONFIG), "steps": repeats, "samples_per_step": trainer.local_n,
                     "threads": torch.get_num_threads(), "sampler_steps": cfg.sampler.kwargs.get("num_steps")},
        "rollout_images_per_s": round(samples / rollout, 2),
        "train_samples_per_s": round(samples / optimise, 2),
        "step_samples_per_s": round(samples / total, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "share": {"rollout": round(rollout / total, 3), "reward": round(reward / total, 3),
                  "optimise": round(optimise / total, 3), "other": round(1 - (rollout + reward + optimise) / total, 3)},
        "note": "reward time runs in a worker thread and overlaps the next rollout chunk; its share is its own wall time",
    }
