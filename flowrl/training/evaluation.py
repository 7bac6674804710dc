"""Fixed prompts x fixed seeds through a deterministic sampler, scored by every reward (training and gold).

`evaluate` runs during training (every `eval_every_n_steps`, and once on the base model as step 0) and on
demand (`flowrl eval`), split over the run's processes (each samples and scores its share of the batches; the main
process gathers them). It writes `out_dir/scores.json` and the images beside it; `flowrl report` reads them back.

scores.json (format "flowrl.eval/1"); P prompts, S seeds, samples in prompt-major order (i = p * S + s):

    {
      "format": "flowrl.eval/1",
      "step": 0, "label": "base",              # optimizer step of the weights; free-form label
      "is_video": false,
      "prompts": [str] * P, "seeds": [int] * S,
      "metadata": [dict] * P,                   # per prompt (e.g. GenEval tags), {} when none
      "sources": [str | null] * P,              # only with source images: "p000_source.png" (edit / image-to-video)
      "rewards": {"train": [name, ...],         # rewards the run optimises
                  "gold": [name, ...]},         # eval-only rewards (the reward-hacking witnesses)
      "samples": [{"prompt_index": p, "seed_index": s, "seed": int,
                   "image": "p000_s000.png",      # path relative to out_dir; for video the frame strip PNG
                   "animation": "p000_s000.gif",  # video only: animated GIF (plus "video": MP4 with imageio-ffmpeg)
                   "scores": {name: float | null}}] * (P * S),   # null = not applicable (NaN)
      "per_prompt": {name: [float | null] * P},  # mean over the prompt's seeds, NaN ignored
      "means": {name: float | null},             # mean of the per-sample scores over all samples, NaN ignored
      "diversity": {"space": "pixel" | <feature name>,
                    "per_prompt": [float | null] * P,   # mean pairwise distance of the prompt's S samples
                    "mean": float | null},              # null when S = 1
      "sampler": {"name": str, "num_steps": int, "guidance_scale": float | null, "scheduler": str, ...},
      "weights": "base" | "raw" | "ema" | null,  # which weights were sampled (null: not stated by the caller)
      "environment": {"family": str, "device": str, "device_name": str, "dtype": str, "python": str,
                      "torch": str, "diffusers": str, "transformers": str, "flowrl": str},
      "time_s": float                            # wall time of sampling + scoring
    }

Diversity is the mean Euclidean distance over the S(S-1)/2 pairs of a prompt's samples in a feature space:
`diversity_features(images) -> [M, D]` when given (L2-normalise inside it for a cosine-like distance), else
pixel space with features = flatten(images) / sqrt(numel), so that the distance is the root-mean-square pixel
difference (0 for identical samples, at most 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from flowrl import media
from flowrl.reward_contract import nan_to_none, score_checked
from flowrl.samplers.ode import ODESampler
from flowrl.training.prompts import load_prompt_records
from flowrl.training.scoring import build_rewards
from flowrl.types import FlowModel, PromptBatch, Reward

SCORES_FORMAT = "flowrl.eval/1"
DiversityFeatures = Callable[[torch.Tensor], torch.Tensor]  # images [M, 3, H, W] (video [M, F, 3, H, W]) -> [M, D]


def pixel_features(images: torch.Tensor) -> torch.Tensor:
    """[M, ...] -> [M, D] flattened pixels scaled by 1/sqrt(D): Euclidean distance = RMS pixel difference."""
    flat = images.detach().float().reshape(images.shape[0], -1)  # [M, D]
    return flat / math.sqrt(flat.shape[1])


def mean_pairwise_distance(features: torch.Tensor) -> float | None:
    """Mean Euclidean distance over all unordered pairs of rows of [M, D]; None when M < 2."""
    m = features.shape[0]
    if m < 2:
        return None
    features = features.double()
    distances = torch.cdist(features, features)  # [M, M]
    upper = torch.triu_indices(m, m, offset=1)  # [2, M(M-1)/2]
    return float(distances[upper[0], upper[1]].mean())


def nanmean(values: list[float]) -> float | None:
    """Mean of the finite values; None when there are none (JSON null = not applicable)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def corrected_score(rewards: list, judges: list, low: float = 1.0, high: float = 5.0) -> list[float | None]:
    """GDRO's corrected score per sample, r·(û − 3) + 0.2 with û = 1 + 4·(judge − low)/(high − low) the judge on a 1-5
    scale (docs/recipes/gdro.md#the-corrected-score); None where either score is missing."""
    out: list[float | None] = []
    for r, j in zip(rewards, judges):
        ok = r is not None and j is not None and math.isfinite(r) and math.isfinite(j)
        out.append(r * (1.0 + 4.0 * (j - low) / (high - low) - 3.0) + 0.2 if ok else None)
    return out


def _sampler_record(sampler: Any) -> dict[str, Any]:
    record: dict[str, Any] = {"name": getattr(sampler, "registry_name", type(sampler).__name__)}
    if dataclasses.is_dataclass(sampler):
        for f in dataclasses.fields(sampler):
            value = getattr(sampler, f.name)
            if value is None or isinstance(value, (bool, int, float, str)):
                record[f.name] = value
    return record


def _environment(model: FlowModel) -> dict[str, str]:
    """Where the evaluation ran: model family, device (and its name), dtype, Python and package versions."""
    import platform
    import sys

    from flowrl.environment import package_versions

    device = torch.device(model.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    env = {
        "family": str(model.family),
        "device": str(device),
        "device_name": name,
        "dtype": str(model.dtype).replace("torch.", ""),
        "python": sys.version.split()[0],
    }
    return {**env, **package_versions(("torch", "diffusers", "transformers", "flowrl"))}


def _check_inputs(
    model: FlowModel,
    rewards: dict[str, Reward],
    prompts: list[str],
    seeds: list[int],
    train_reward_names: list[str],
    batch_size: int,
    metadata: list[dict] | None,
) -> None:
    if not prompts or isinstance(prompts, str):
        raise ValueError(
            f"evaluate: prompts={prompts!r} must be a non-empty list of strings; set eval.prompts in the config"
        )
    if not seeds or isinstance(seeds, int):
        raise ValueError(
            f"evaluate: seeds={seeds!r} must be a non-empty list of ints; set eval.seeds, e.g. [0, 1, 2, 3]"
        )
    if len(set(seeds)) != len(seeds):
        raise ValueError(
            f"evaluate: seeds={seeds} repeat a value; give distinct seeds (a repeat would fake zero diversity)"
        )
    if batch_size < 1:
        raise ValueError(f"evaluate: batch_size={batch_size} must be >= 1")
    if metadata is not None and len(metadata) != len(prompts):
        raise ValueError(
            f"evaluate: {len(metadata)} metadata entries for {len(prompts)} prompts; give one dict per prompt or None"
        )
    unknown = [n for n in train_reward_names if n not in rewards]
    if unknown:
        raise ValueError(
            f"evaluate: train_reward_names {unknown} are not in rewards {sorted(rewards)}; pass every training reward "
            "in `rewards`"
        )
    modality = "video" if model.is_video else "image"
    for name, reward in rewards.items():
        if modality not in getattr(reward, "modalities", ("image",)):  # a plain callable scores images
            raise ValueError(
                f"evaluate: reward {name!r} scores {tuple(reward.modalities)} but the model makes {modality}s; "
                f"use a {modality} reward (e.g. wrap it with per_frame)"
            )


def eval_chunks(num_samples: int, batch_size: int, num_processes: int) -> list[range]:
    """The sample batches of an evaluation, in order (process `rank` of W takes batches rank, rank + W, ...):
    `batch_size` samples each, fewer where that spreads them over more processes. Wherever W·batch_size <= the sample
    count the batches are the one-process run's, so every sample is computed in the same batch (same numerics)."""
    size = max(1, min(batch_size, math.ceil(num_samples / num_processes)))
    return [range(i, min(i + size, num_samples)) for i in range(0, num_samples, size)]


def _gather_to_main(accelerator, part: Any) -> list[Any]:
    """Every process's `part`, by rank, on the main process (one gather; an empty list elsewhere)."""
    if accelerator is None or accelerator.num_processes == 1:
        return [part]
    import torch.distributed as dist

    parts: list[Any] | None = [None] * accelerator.num_processes if accelerator.is_main_process else None
    dist.gather_object(part, parts, dst=0)
    return parts or []


@torch.no_grad()
def evaluate(
    model: FlowModel,
    rewards: dict[str, Reward],
    out_dir: str | os.PathLike,
    *,
    prompts: list[str],
    seeds: list[int],
    sampler: Any,
    train_reward_names: list[str],
    step: int,
    label: str,
    batch_size: int = 16,
    metadata: list[dict] | None = None,
    diversity_features: DiversityFeatures | None = None,
    weights: str | None = None,
    accelerator=None,
    lockstep: bool = False,
    corrected=None,
) -> dict | None:
    """Sample every prompt x seed with `sampler`, score with every reward, write out_dir/scores.json + images; with
    `corrected` (eval.corrected_score) also `corrected_score`: {reward, judge, mean, per_prompt}.

    `rewards` holds training and gold rewards by name; those named in `train_reward_names` are the training
    ones, the rest are gold. Returns the scores.json dict (schema in the module docstring).

    With an `accelerator` of W processes every process calls this: the batches (`eval_chunks`) are split over the
    processes, each samples and scores its own, and the main process gathers images, scores and features round by
    round, writes every file and returns the dict (the others return None). A sample is its (prompt, seed)'s whatever
    the process. `lockstep` (FSDP2, whose forwards gather weights from every process): a process without a batch in
    the last round samples its first batch again and drops it, so that every process runs the same forwards.
    """
    _check_inputs(model, rewards, prompts, seeds, train_reward_names, batch_size, metadata)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    main = rank == 0
    out = Path(out_dir)
    metadata = [dict(m) for m in metadata] if metadata is not None else [{} for _ in prompts]
    num_prompts, num_seeds = len(prompts), len(seeds)
    pairs = [(p, s) for p in range(num_prompts) for s in range(num_seeds)]  # prompt-major, [P*S]
    featurize = diversity_features or pixel_features
    space = (
        "pixel"
        if diversity_features is None
        else getattr(diversity_features, "__name__", type(diversity_features).__name__)
    )
    start = time.perf_counter()

    def sample_and_score(rows: range) -> dict[str, Any]:
        chunk = [pairs[i] for i in rows]
        batch = PromptBatch(
            prompts=[prompts[p] for p, _ in chunk],
            group_ids=torch.tensor([p for p, _ in chunk], dtype=torch.int64),  # [b]
            metadata=[metadata[p] for p, _ in chunk],
            seeds=torch.tensor([seeds[s] for _, s in chunk], dtype=torch.int64),  # [b]
        )
        images = (
            sampler(model, batch).images.detach().float().clamp(0, 1)
        )  # [b, 3, H, W] or [b, F, 3, H, W], model device
        scores = {
            name: nan_to_none(score_checked(reward, images, batch.prompts, batch.metadata).scores.cpu().tolist())
            for name, reward in rewards.items()
        }
        feats = featurize(images)
        if not isinstance(feats, torch.Tensor) or feats.dim() != 2 or feats.shape[0] != len(chunk):
            raise ValueError(
                f"evaluate: diversity_features returned {getattr(feats, 'shape', type(feats))}; it must map "
                f"[M, ...] images to [M, D] features"
            )
        return {"rows": rows, "images": images.cpu(), "scores": scores, "features": feats.detach().float().cpu()}

    if main:
        out.mkdir(parents=True, exist_ok=True)
    sources = _copy_sources(metadata, out) if main else []  # [P] the source image beside its samples
    samples: list[dict[str, Any]] = []
    features: list[torch.Tensor] = []  # [b, D] per batch
    chunks = eval_chunks(len(pairs), batch_size, world)
    for first in range(0, len(chunks), world):  # one round: a batch per process
        own = first + rank
        part = sample_and_score(chunks[own]) if own < len(chunks) else None
        if part is None and lockstep:
            sample_and_score(chunks[rank % len(chunks)])  # the same forwards as the others; dropped
        for got in _gather_to_main(accelerator, part):
            if got is None:
                continue
            features.append(got["features"])
            for k, i in enumerate(got["rows"]):
                samples.append(_write_sample(model, out, got["images"][k], pairs[i], seeds, got["scores"], k))
    if not main:
        return None

    all_features = torch.cat(features)  # [P*S, D]
    per_prompt = {
        name: [
            nanmean([samples[p * num_seeds + s]["scores"][name] for s in range(num_seeds)]) for p in range(num_prompts)
        ]
        for name in rewards
    }
    means = {name: nanmean([sample["scores"][name] for sample in samples]) for name in rewards}
    diversity = [mean_pairwise_distance(all_features[p * num_seeds : (p + 1) * num_seeds]) for p in range(num_prompts)]
    result = {
        "format": SCORES_FORMAT,
        "step": int(step),
        "label": str(label),
        "is_video": bool(model.is_video),
        "prompts": list(prompts),
        "seeds": [int(s) for s in seeds],
        "metadata": metadata,
        **({"sources": sources} if any(sources) else {}),
        "rewards": {
            "train": [n for n in rewards if n in train_reward_names],
            "gold": [n for n in rewards if n not in train_reward_names],
        },
        "samples": samples,
        "per_prompt": per_prompt,
        "means": means,
        "diversity": {"space": space, "per_prompt": diversity, "mean": nanmean(diversity)},
        "sampler": _sampler_record(sampler),
        "weights": weights,
        "environment": _environment(model),
        "time_s": round(time.perf_counter() - start, 4),
    }
    if corrected is not None:
        got = [[x["scores"][corrected.reward], x["scores"][corrected.judge]] for x in samples]
        per = corrected_score([r for r, _ in got], [j for _, j in got], *corrected.judge_range)
        mean = {
            "mean": nanmean(per),
            "per_prompt": [nanmean(per[p * num_seeds : (p + 1) * num_seeds]) for p in range(num_prompts)],
        }
        result["corrected_score"] = {"reward": corrected.reward, "judge": corrected.judge, **mean}
    tmp = out / "scores.json.tmp"
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, out / "scores.json")  # atomic: a crash never leaves half a scores.json
    return result


def _write_sample(
    model: FlowModel, out: Path, image: torch.Tensor, pair: tuple[int, int], seeds, scores, k: int
) -> dict:
    """Write one sample's files (p<P>_s<S>.png; video: frame strip, GIF and MP4 when ffmpeg is there); its record."""
    p, s = pair
    stem = f"p{p:03d}_s{s:03d}"
    sample: dict[str, Any] = {"prompt_index": p, "seed_index": s, "seed": int(seeds[s])}
    if model.is_video:
        sample["image"] = os.path.basename(media.save_strip(image, str(out / f"{stem}_strip.png")))
        sample["animation"] = os.path.basename(media.save_gif(image, str(out / f"{stem}.gif")))
        if media._has_ffmpeg():
            sample["video"] = os.path.basename(media.save_video(image, str(out / stem)))
    else:
        sample["image"] = os.path.basename(media.save_image(image, str(out / f"{stem}.png")))
    sample["scores"] = {name: values[k] for name, values in scores.items()}
    return sample


def _copy_sources(metadata: list[dict], out: Path) -> list[str | None]:
    """Each prompt's source image (metadata "image") copied into `out` as p<P>_source.png; None where it has none."""
    sources: list[str | None] = []
    for p, meta in enumerate(metadata):
        if meta.get("image") is None:
            sources.append(None)
            continue
        sources.append(
            os.path.basename(media.save_image(media.load_image(meta["image"]), str(out / f"p{p:03d}_source.png")))
        )
    return sources


class Evaluator:
    """A run's fixed evaluation: eval prompts x eval seeds through the ODE sampler, training + gold rewards.

    One object behind the in-training eval and `flowrl eval`, so both sample at the same sizes: height,
    width, frames and guidance come from the `eval` section, else from the training sampler's config
    (`sampler_defaults`, its YAML kwargs), else the model's native size and default guidance.
    """

    def __init__(
        self,
        model: FlowModel,
        rewards: dict[str, Reward],
        gold_rewards: dict[str, Reward],
        eval_cfg,
        sampler_defaults: dict,
        prompts: list[str],
        metadata: list[dict] | None = None,
    ):
        e, d = eval_cfg, sampler_defaults
        self.model, self.cfg = model, e
        self.train_reward_names = list(rewards)
        overlap = sorted(set(rewards) & set(gold_rewards))
        if overlap:
            raise ValueError(
                f"eval.gold_rewards repeats the training reward(s) {overlap}; a gold reward must be another reward"
            )
        self.rewards = {**rewards, **gold_rewards}
        c = e.corrected_score
        for key in ("reward", "judge") if c is not None else ():
            if getattr(c, key) not in self.rewards:
                raise ValueError(
                    f"eval.corrected_score.{key}={getattr(c, key)!r} is not a training or gold reward; name one of "
                    f"{', '.join(self.rewards)}"
                )
        if c is not None and (len(c.judge_range) != 2 or c.judge_range[0] >= c.judge_range[1]):
            raise ValueError(f"eval.corrected_score.judge_range={c.judge_range} must be [low, high] with low < high")
        self.prompts = prompts[: e.num_prompts] if e.num_prompts else list(prompts)
        self.metadata = list(metadata)[: len(self.prompts)] if metadata is not None else None
        self.sampler = ODESampler(
            num_steps=e.num_steps,
            height=e.height or d.get("height"),
            width=e.width or d.get("width"),
            num_frames=e.num_frames or d.get("num_frames"),
            guidance_scale=e.guidance_scale if e.guidance_scale is not None else d.get("guidance_scale"),
            scheduler=e.scheduler,
        )

    @classmethod
    def from_config(cls, cfg, model: FlowModel, rewards: dict[str, Reward] | None = None) -> Evaluator:
        """From a run config; `rewards` are the already-built training rewards (built here when None)."""
        e = cfg.eval
        if e.prompts or e.prompts_file or e.toy_split or e.prompt_set:
            sources = (e.prompts, e.prompts_file, e.toy_split, "eval", e.toy_sources, e.prompt_set)
            prompts, metadata = load_prompt_records(*sources)
        else:
            d = cfg.data
            sources = (d.prompts, d.prompts_file, d.toy_split, "data", d.toy_sources, d.prompt_set)
            prompts, metadata = load_prompt_records(*sources)
        rewards = rewards if rewards is not None else build_rewards(cfg.rewards, model.device)
        gold = build_rewards(e.gold_rewards, model.device)
        return cls(model, rewards, gold, e, dict(cfg.sampler.kwargs), prompts, metadata)

    def run(
        self,
        out_dir: str | os.PathLike,
        step: int,
        label: str,
        weights: str | None = None,
        batch_size: int | None = None,
        accelerator=None,
        lockstep: bool = False,
    ) -> dict | None:
        """The evaluation into `out_dir`; with an `accelerator` every process calls it and shares the work (`evaluate`),
        and the main process writes the files and returns the result (the others None)."""
        self.model.transformer.eval()
        return evaluate(
            self.model,
            self.rewards,
            out_dir,
            prompts=self.prompts,
            metadata=self.metadata,
            seeds=list(self.cfg.seeds),
            sampler=self.sampler,
            train_reward_names=self.train_reward_names,
            step=step,
            label=label,
            batch_size=batch_size or self.cfg.batch_size,
            weights=weights,
            accelerator=accelerator,
            lockstep=lockstep,
            corrected=getattr(self.cfg, "corrected_score", None),
        )

    def run_in_training(
        self, accelerator, every_process: bool, out_dir: Path, step: int, label: str, weights: str
    ) -> dict | None:
        """The in-training eval, split over the processes; the main process writes `out_dir` and returns the result.
        `every_process` (FSDP2 gathers weights inside every forward): every process runs the same forwards."""
        result = self.run(out_dir, step, label, weights, accelerator=accelerator, lockstep=every_process)
        accelerator.wait_for_everyone()
        return result


class TrainingEvaluation:
    """The evaluation a recipe runs during training: the base model (adapter switched off) before the first step,
    then the trained weights — their EMA once an EMA update happened and `eval.use_ema` — on the eval grid.

    The evaluator (and the gold rewards) is built at the first call.
    """

    def __init__(self, cfg, accelerator, run, model: FlowModel, rewards: dict[str, Reward], opt, ema):
        self.cfg, self.accelerator, self.run, self.model, self.rewards, self.opt, self.ema = (
            cfg,
            accelerator,
            run,
            model,
            rewards,
            opt,
            ema,
        )
        self._evaluator: Evaluator | None = None

    @property
    def evaluator(self) -> Evaluator:
        if self._evaluator is None:
            self._evaluator = Evaluator.from_config(self.cfg, self.model, self.rewards)
        return self._evaluator

    def weights(self, step: int | None):
        """(context manager, label): the weights evaluated at `step` swapped in; label 'base', 'ema' or 'raw'."""
        import contextlib

        if step is None:
            return (self.model.adapter_disabled() if self.model.has_lora else contextlib.nullcontext()), "base"
        if self.cfg.eval.use_ema and self.ema is not None and self.ema.num_updates > 0:
            return self.ema.swapped(self.opt.params), "ema"
        return contextlib.nullcontext(), "raw"

    def __call__(self, step: int | None) -> dict | None:
        from flowrl.training.runs import step_dir_name

        context, label = self.weights(step)
        with context:
            result = self.evaluator.run_in_training(
                self.accelerator,
                self.opt.sharding.kind == "fsdp",
                self.run.eval_dir(step),
                step or 0,
                step_dir_name(step),
                label,
            )
        if result is not None and "corrected_score" in result and result["corrected_score"]["mean"] is not None:
            self.accelerator.log(
                {"eval/corrected_score": result["corrected_score"]["mean"]}, step=step or 0
            )  # trackers
        return result
