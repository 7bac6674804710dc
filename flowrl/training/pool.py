"""An offline pool: `pool_size` samples of every training prompt from the reference model (the adapters off) with the
run's sampler, scored once by the run's rewards and kept on disk for offline recipes (GDRO, docs/recipes/gdro.md).

    flowrl pool configs/toy/gdro.yaml [--out DIR]      # or: the recipe builds it at its start when it is missing

A pool folder holds `manifest.json` and one `shard_XXXXX.safetensors` per chunk of `pool_shard_prompts` prompts:
`x0` [S, N, *latent_shape] (the clean endpoints, float32) and `reward.<name>` [S, N] (each reward's raw score). The
manifest records the config fields that decide the pool (`pool_fields`): a folder made with other values is refused
with a one-line error naming the field. Each shard is written whole (a temporary file renamed), so an interrupted
generation resumes at the first missing shard. Each shard records the work it took (flowrl.work counts, summed over
its forwards, decodes and reward calls) and its seconds; the manifest sums them, so the pool's cost is known whether
this run made it or found it. Over W processes the missing shards are dealt out in turn (the i-th to rank i mod W).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flowrl import work
from flowrl.seeds import offline_sample_seed
from flowrl.training.clock import timed
from flowrl.training.scoring import Scorer, ranking_score_fn
from flowrl.types import PromptBatch

MANIFEST, FORMAT = "manifest.json", "flowrl.pool/1"


def pool_folder(cfg) -> Path:
    """train.pool_dir, else <output_dir>/pools/<name> (runs of one config under any seed share it)."""
    return Path(cfg.train.pool_dir) if cfg.train.pool_dir else Path(cfg.output_dir) / "pools" / cfg.name


def pool_fields(cfg, prompts: list[str], metadata: list[dict]) -> dict:
    """The config fields that decide a pool's contents: a pool made with any other value is another pool."""
    t, m = cfg.train, cfg.model
    listed = json.dumps([prompts, metadata], sort_keys=True, default=str).encode()
    return {
        "model.path": str(m.path),
        "model.dtype": str(m.dtype),
        "model.mixed_precision": str(m.mixed_precision),
        "sampler": json.loads(
            json.dumps({"name": cfg.sampler.name, **cfg.sampler.kwargs}, sort_keys=True, default=str)
        ),
        "rewards": [
            json.loads(json.dumps({"name": r.name, **r.kwargs}, sort_keys=True, default=str)) for r in cfg.rewards
        ],
        "data prompts": hashlib.sha256(listed).hexdigest()[:16],
        "train.pool_size": t.pool_size,
        "train.pool_seed": t.pool_seed,
        "train.pool_shard_prompts": t.pool_shard_prompts,
    }


@dataclass
class Pool:
    """A finished pool: its folder, manifest and every reward's raw scores {name: [P, N]} (the latents stay on disk)."""

    folder: Path
    manifest: dict
    rewards: dict[str, torch.Tensor]

    def summary(self) -> str:
        """One line: the folder, prompts x samples, and the transformer forwards and seconds the pool cost."""
        m = self.manifest
        forwards = sum(v for k, v in m["work"].items() if k.startswith("work/rollout/forward/"))
        size = f"{m['num_prompts']} prompts x {m['fields']['train.pool_size']} samples"
        return f"{self.folder}: {size}, {forwards:.0f} forwards, {m['seconds']:.1f} s"

    def x0(self, prompt_index: int, slots: torch.Tensor) -> torch.Tensor:
        """[len(slots), *latent_shape] float32: the clean endpoints `slots` of prompt `prompt_index`."""
        per = self.manifest["fields"]["train.pool_shard_prompts"]
        with safe_open(str(self.folder / shard_name(prompt_index // per)), framework="pt", device="cpu") as f:
            return f.get_slice("x0")[prompt_index % per : prompt_index % per + 1][0][slots]


def shard_name(s: int) -> str:
    return f"shard_{s:05d}.safetensors"


def refuse_mismatch(folder: Path, saved: dict, fields: dict) -> None:
    for key, value in fields.items():
        if saved.get(key) != value:
            raise ValueError(
                f"train.pool_dir={str(folder)!r} holds a pool made with {key}={saved.get(key)!r}, this run has "
                f"{value!r}: delete that folder or set train.pool_dir to another one"
            )


def build_pool(cfg, accelerator, model, sampler, rewards: dict, prompts: list[str], metadata: list[dict]) -> Pool:
    """The run's pool, made where missing (every process calls it): the manifest checked (or written by the main
    process), each process's missing shards generated, the manifest's totals written, every reward's scores read."""
    folder, fields, acc = pool_folder(cfg), pool_fields(cfg, prompts, metadata), accelerator
    per = cfg.train.pool_shard_prompts
    num_shards = -(-len(prompts) // per)
    if acc.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / MANIFEST).exists():
            _write_json(
                folder / MANIFEST, {"format": FORMAT, "fields": fields, "num_prompts": len(prompts), "complete": False}
            )
    acc.wait_for_everyone()
    manifest = json.loads((folder / MANIFEST).read_text())
    refuse_mismatch(folder, manifest["fields"], fields)
    missing = [s for s in range(num_shards) if not (folder / shard_name(s)).exists()]
    acc.wait_for_everyone()  # every process has listed the folder before any writes to it
    if missing or not manifest.get("complete"):  # the same on every process: they all see the folder
        scorer = Scorer(rewards, cfg.on_reward_error, use_async=False)
        weights = {r.name: r.weight for r in cfg.rewards}
        for s in missing[acc.process_index :: acc.num_processes]:
            rows = range(s * per, min((s + 1) * per, len(prompts)))
            _make_shard(folder / shard_name(s), cfg.train, model, sampler, scorer, weights, prompts, metadata, rows)
        scorer.close()
        acc.wait_for_everyone()
        if acc.is_main_process:
            manifest = _totals(folder, manifest, num_shards)
            _write_json(folder / MANIFEST, manifest)
        acc.wait_for_everyone()
        manifest = json.loads((folder / MANIFEST).read_text())
    scores: dict[str, list[torch.Tensor]] = {r.name: [] for r in cfg.rewards}
    for s in range(num_shards):
        with safe_open(str(folder / shard_name(s)), framework="pt", device="cpu") as f:
            for name in scores:
                scores[name].append(f.get_tensor(f"reward.{name}"))
    return Pool(folder, manifest, {name: torch.cat(parts) for name, parts in scores.items()})


def _make_shard(path: Path, t, model, sampler, scorer, weights, prompts, metadata, rows: range) -> None:
    """Shard `path`: pool_size samples of each prompt in `rows` by the reference model, scored; its work and seconds."""
    work.METER.reset()
    wall, cpu = timed(model.device), time.process_time()
    n, x0 = t.pool_size, []
    scores: dict[str, list[torch.Tensor]] = {name: [] for name in scorer.rewards}
    model.transformer.eval()
    for p in rows:
        seeds = torch.tensor([offline_sample_seed(t.pool_seed, p, j) for j in range(n)])  # [N]
        ids = torch.arange(n)  # each sample its own group: independent samples (a candidates sampler picks per sample)
        batch = PromptBatch([prompts[p]] * n, ids, [dict(metadata[p]) for _ in range(n)], seeds)
        off = model.adapter_disabled() if getattr(model, "has_lora", False) else contextlib.nullcontext()
        with off, work.phase("rollout"):
            rollout = sampler(model, batch, score_fn=ranking_score_fn(scorer, weights), step=0)
        scorer.submit(rollout.images, rollout.prompts, rollout.metadata)
        got = scorer.collect()
        for name, values in got.scores.items():
            if got.failed.any() or not torch.isfinite(values).all():
                raise ValueError(
                    f"reward {name} gave no finite score to some pool images of prompt {prompts[p]!r}: an offline pool "
                    "ranks every image; fix the reward or drop the prompt"
                )
            scores[name].append(values.float())
        x0.append(rollout.final_latents().detach().float().cpu())
    counts = work.METER.metrics()
    work.METER.reset()
    tensors = {"x0": torch.stack(x0).contiguous()} | {f"reward.{k}": torch.stack(v) for k, v in scores.items()}
    extra = {
        "work": json.dumps(counts),
        "seconds": repr(wall.seconds()),
        "cpu_seconds": repr(time.process_time() - cpu),
    }
    save_file(tensors, str(path) + ".tmp", metadata=extra)
    os.replace(str(path) + ".tmp", path)  # whole or absent: an interrupted generation redoes only this shard


def _totals(folder: Path, manifest: dict, num_shards: int) -> dict:
    """The manifest completed with the summed work and seconds of every shard."""
    total: dict[str, float] = {}
    seconds = cpu_seconds = 0.0
    for s in range(num_shards):
        with safe_open(str(folder / shard_name(s)), framework="pt", device="cpu") as f:
            meta = f.metadata()
        for key, value in json.loads(meta["work"]).items():
            total[key] = total.get(key, 0.0) + value
        seconds, cpu_seconds = seconds + float(meta["seconds"]), cpu_seconds + float(meta["cpu_seconds"])
    return manifest | {
        "complete": True,
        "work": dict(sorted(total.items())),
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }


def _write_json(path: Path, data: dict) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(data, indent=1))
    os.replace(path.with_suffix(".tmp"), path)
