"""Prompts are data: loading prompt lists, and the grouped sampler that turns them into each step's batch.

prompts = load_prompts(cfg.data.prompts, cfg.data.prompts_file, cfg.data.toy_split, "data")
sampler = GroupedPromptSampler(prompts, num_prompts_per_step=8, group_size=8, seed=0)
batch = sampler.local_batch(step, accelerator.process_index, accelerator.num_processes)

A prompts file is plain text (one prompt a line, `#` comments) or, named `*.jsonl`, one JSON object a line:
`{"prompt": "make the sky red", "image": "sources/beach.png", ...}`. `image` (a path relative to the file) is the
source image of edit and image-to-video models; it and every other key reach the adapter and every reward as the
sample's `metadata` (`load_prompt_records` returns them; docs/models.md#conditioning-images).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from flowrl import seeds as seed_formulas
from flowrl.types import PromptBatch


def load_prompts(prompts: list[str] | None, prompts_file: str | None, toy_split: str | None, where: str) -> list[str]:
    """The prompt list of a data or eval section, checked non-empty; `where` names the section in errors."""
    return load_prompt_records(prompts, prompts_file, toy_split, where)[0]


def load_prompt_records(
    prompts: list[str] | None,
    prompts_file: str | None,
    toy_split: str | None,
    where: str,
    toy_sources: bool = False,
    prompt_set: str | None = None,
) -> tuple[list[str], list[dict[str, Any]]]:
    """(prompts [P], metadata [P]) of a data or eval section: a JSONL file's extra keys per prompt (its `image`
    resolved against the file's folder and checked to exist), {} for every other source; with `toy_sources` (a
    toy_split only) each toy prompt's source image, {"image": path} (flowrl/toy/sources.py)."""
    if toy_sources and toy_split is None:
        raise ValueError(f"{where}.toy_sources=true needs {where}.toy_split; set it or drop {where}.toy_sources")
    if prompts is not None:
        out = [p for p in prompts if p.strip()]
    elif prompts_file is not None:
        path = Path(prompts_file)
        if not path.is_file():
            raise FileNotFoundError(
                f"{where}.prompts_file={prompts_file!r} does not exist; give a text file with one prompt per line"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{where}.prompts_file={prompts_file!r} is not UTF-8 text (byte {err.start}); "
                "give a text file with one prompt per line"
            ) from None
        if path.suffix == ".jsonl":
            return _jsonl_records(path, text, where)
        out = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    elif toy_split is not None:
        from flowrl.toy.world import split_prompts

        out = split_prompts(toy_split)
    elif prompt_set is not None:
        from flowrl.prompt_sets import load_prompt_set

        return load_prompt_set(prompt_set, where)
    else:
        raise ValueError(f"{where} needs one of prompts, prompts_file, toy_split, prompt_set")
    if not out:
        raise ValueError(f"{where}: the prompt list is empty; add at least one prompt")
    if toy_sources:
        from flowrl.toy.sources import source_records

        return out, source_records(out)
    return out, [{} for _ in out]


def _jsonl_records(path: Path, text: str, where: str) -> tuple[list[str], list[dict[str, Any]]]:
    prompts, metadata = [], []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        at = f"{where}.prompts_file={str(path)!r} line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f'{at} is not JSON ({err.msg}); write one object a line, e.g. {{"prompt": "a cat"}}'
            ) from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"].strip():
            raise ValueError(f'{at} has no "prompt" string; write one object a line, e.g. {{"prompt": "a cat"}}')
        extra = {k: v for k, v in record.items() if k != "prompt"}
        if "image" in extra:
            image = extra["image"]
            if not isinstance(image, str) or not image:
                raise ValueError(f'{at}: "image"={image!r} must be a path to a PNG or JPEG (relative to the file)')
            resolved = (path.parent / image).resolve()
            if not resolved.is_file():
                raise FileNotFoundError(
                    f'{at}: "image"={image!r} does not exist (looked at {str(resolved)!r}); fix the path'
                )
            extra["image"] = str(resolved)
        prompts.append(record["prompt"].strip())
        metadata.append(extra)
    if not prompts:
        raise ValueError(f"{where}: the prompt list is empty; add at least one prompt")
    return prompts, metadata


class GroupedPromptSampler:
    """The step's B prompts (epoch-wise shuffled, seeded) expanded to B*G samples with agreed seeds.

    Everything is a function of (seed, step), so every process, and a resumed run, sees the same batch. The
    global batch is prompt-major (sample j belongs to group j // G); each process takes a contiguous slice,
    so a group may span processes unless `whole_groups` is set, which requires B to divide by the process
    count and then keeps every group on one process (tree rollouts need their group together).
    """

    def __init__(
        self,
        prompts: list[str],
        num_prompts_per_step: int,
        group_size: int,
        seed: int,
        whole_groups: bool = False,
        metadata: list[dict[str, Any]] | None = None,
        noise_pool: int = 0,
    ):
        if not prompts:
            raise ValueError("GroupedPromptSampler: the prompt list is empty; add at least one prompt")
        if metadata is not None and len(metadata) != len(prompts):
            raise ValueError(
                f"GroupedPromptSampler: {len(metadata)} metadata entries for {len(prompts)} prompts; give one each"
            )
        self.prompts, self.b, self.g, self.seed = prompts, num_prompts_per_step, group_size, seed
        self.whole_groups = whole_groups
        if noise_pool < 0:
            raise ValueError(f"data.noise_pool={noise_pool} must be >= 0 (0 = a fresh seed per group)")
        self.noise_pool = noise_pool
        self.metadata = metadata if metadata is not None else [{} for _ in prompts]

    def _prompt_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.prompts))
        return int(seed_formulas.prompt_order(self.seed, epoch, len(self.prompts))[offset])

    def global_batch(self, step: int) -> PromptBatch:
        indices = [self._prompt_index(step * self.b + i) for i in range(self.b)]
        prompts = [self.prompts[i] for i in indices for _ in range(self.g)]  # [B*G]
        group_ids = torch.arange(self.b).repeat_interleave(self.g)  # [B*G]
        seeds = torch.tensor([seed_formulas.sample_seed(self.seed, step, j) for j in range(self.b * self.g)])  # [B*G]
        group_seeds = seeds[group_ids * self.g]  # [B*G] the seed of each group's first sample
        if self.noise_pool:  # the prompt's e-th visit takes its pooled seed e mod P (seeds.pooled_group_seed)
            visits = [(step * self.b + i) // len(self.prompts) for i in range(self.b)]
            pooled = [
                seed_formulas.pooled_group_seed(self.seed, p, e % self.noise_pool) for p, e in zip(indices, visits)
            ]
            group_seeds = torch.tensor(pooled).repeat_interleave(self.g)
        return PromptBatch(
            prompts,
            group_ids,
            [dict(self.metadata[i]) for i in indices for _ in range(self.g)],  # [B*G] each sample its prompt's record
            seeds=seeds,
            global_index=torch.arange(self.b * self.g),
            group_seeds=group_seeds,
        )

    def local_size(self, num_processes: int) -> int:
        """Samples per process; a one-line error when the step's batch does not split over the processes."""
        total = self.b * self.g
        if total % num_processes:
            raise ValueError(
                f"data.num_prompts_per_step * data.group_size = {total} does not divide across "
                f"{num_processes} processes; make it a multiple of {num_processes}"
            )
        if self.whole_groups and self.b % num_processes:
            raise ValueError(
                f"data.num_prompts_per_step={self.b} does not divide across {num_processes} processes, "
                f"which keeping whole groups on one process needs; make it a multiple of {num_processes}"
            )
        return total // num_processes

    def local_batch(self, step: int, process_index: int, num_processes: int) -> PromptBatch:
        n = self.local_size(num_processes)
        return self.global_batch(step).select(slice(process_index * n, (process_index + 1) * n))


def step_batches(cfg, sampler, num_processes: int, whole_groups: bool = False) -> tuple[GroupedPromptSampler, int]:
    """A recipe's grouped prompt sampler and its per-process sample count N, checked against the `train:` splits
    every recipe has (num_minibatches, gradient_accumulation_steps, num_rollout_batches); a sampler that sets
    `whole_groups` (tree rollouts) keeps every group on one process."""
    t, d = cfg.train, cfg.data
    if t.num_minibatches % t.gradient_accumulation_steps:
        raise ValueError(
            f"train.gradient_accumulation_steps={t.gradient_accumulation_steps} must divide "
            f"train.num_minibatches={t.num_minibatches}"
        )
    whole = whole_groups or sampler.whole_groups  # the recipe's need (TAGRPO) or the sampler's
    sampler.check_groups(d.group_size)  # a tree: one leaf per sample of its group
    sources = (d.prompts, d.prompts_file, d.toy_split, "data", d.toy_sources, d.prompt_set)
    prompts, metadata = load_prompt_records(*sources)
    prompt_sampler = GroupedPromptSampler(
        prompts, d.num_prompts_per_step, d.group_size, cfg.seed, whole, metadata, d.noise_pool
    )
    local_n = prompt_sampler.local_size(num_processes)
    chunks = t.num_rollout_batches
    if local_n % t.num_minibatches or local_n % chunks:
        raise ValueError(
            f"the {local_n} samples per process do not split into train.num_minibatches="
            f"{t.num_minibatches} and train.num_rollout_batches={chunks}"
        )
    sampler.check_groups(d.group_size, local_n // chunks, chunks)  # a tree: whole trees per chunk
    if whole and (local_n // chunks) % d.group_size:
        raise ValueError(
            f"train.num_rollout_batches={chunks} makes rollout chunks of {local_n // chunks} samples, which splits a "
            f"prompt group of {d.group_size} (sampler {cfg.sampler.name} works on whole groups); make it a divisor of "
            f"the {local_n // d.group_size} groups per process"
        )
    return prompt_sampler, local_n
