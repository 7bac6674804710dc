"""Run configuration: dataclass schema, YAML loading, `key=value` overrides and validation.

A YAML file maps onto `RunConfig`. Sections with a registered component (`sampler`, `balancer`, each entry
of `rewards`) hold `name` plus that component's constructor arguments, flat:

    sampler: {name: sde, num_steps: 10, noise_level: 0.7}
    rewards:
      - {name: pickscore, weight: 1.0}

Unknown keys are errors that suggest the closest valid key; numbers written as YAML strings ("1e-4") are
converted to the declared type. Configs never mention hardware: sizes are global or per prompt, and the
trainer derives per-process sizes from the number of processes at run time.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ModelConfig:
    path: str = "toy"
    """'toy', a local diffusers pipeline folder, or a hub id (downloads only because you named one)."""
    dtype: str = "float32"
    """Weights dtype of the frozen components (float32, bfloat16, float16)."""
    mixed_precision: str = "fp32"
    """Autocast of the trained forward passes: fp32 (none), bf16 or fp16 (handed to accelerate)."""
    use_lora: bool = True
    """Train a LoRA adapter (the reference model is the adapter switched off); False = full fine-tuning."""
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_target_modules: list[str] | None = None
    """None = the family's default targets (attention projections)."""
    use_gradient_checkpointing: bool = False
    init_lora: str | None = None
    """Start from this LoRA (diffusers format folder) instead of a fresh adapter."""
    max_sequence_length: int | None = None
    """Text tokens per prompt; None = the pipeline's default (SD3 256, FLUX 512, SANA 300, Wan 512, Qwen-Image 512
    (at most 1024), FLUX.2 512, Z-Image 512; Flow-GRPO trains SD3 with 128). The toy model has a fixed length."""
    train_expert: str | None = None
    """Wan 2.2 A14B only: the expert that trains (and carries the LoRA), 'high' (`transformer`, the default) or
    'low' (`transformer_2`); the other expert stays frozen."""
    family_kwargs: dict[str, Any] | None = None
    """Settings of the family's adapter, handed to its constructor (docs/models.md). LTX-2: frame_rate (24),
    guidance_rescale (0), stg_scale (0) with stg_blocks, modality_scale (1), and their audio_* twins (None: the video
    values); the sampler's guidance_scale is its video CFG scale."""
    prompt_cache_max_bytes: int = 2 * 1024**3
    """Bound of the encoded-prompt cache in bytes (an SD3 prompt is about 5 MiB); least recently used prompts go
    first."""
    prompt_cache_device: str = "model"
    """Where cached prompt embeddings live: 'model' (its device) or 'cpu' (copied to the model's device per batch)."""
    offload_text_encoders: bool = False
    """Keep the text encoders on the CPU; they visit the model's device only to encode prompts the cache lacks."""
    vae_slicing: bool = False
    """Decode a chunk of latents one sample at a time (diffusers' `vae.enable_slicing()`; the same images, less
    memory)."""
    vae_tiling: bool = False
    """Decode large latents in overlapping tiles (diffusers' `vae.enable_tiling()`; close, not equal, images)."""
    attention_backend: str = "sdpa"
    """'sdpa' (PyTorch's scaled-dot-product attention, diffusers' default) or 'xformers' (CUDA, the `cuda` extra)."""
    allow_tf32: bool = True
    """On CUDA, float32 matmuls and convolutions in TF32 (`torch.backends.{cuda.matmul,cudnn}.allow_tf32`)."""
    compile: bool = False
    """`torch.compile` the transformer's forward (compiled on the first call: minutes at real size)."""


@dataclass
class DataConfig:
    prompts_file: str | None = None
    """A text file with one prompt per line (blank lines and lines starting with # are skipped)."""
    prompts: list[str] | None = None
    """Prompts written in the config."""
    toy_split: str | None = None
    """'train' or 'heldout': the prompts of the Shapes world's split (the toy configs use this)."""
    prompt_set: str | None = None
    """A named prompt set (flowrl/prompt_sets.py; `flowrl prompts` writes it to a file): geneval:train, geneval:test,
    ocr:train, ocr:test, pickscore:train, pickscore:test, drawbench; a name without a split is its test split.
    GenEval's records give each prompt its metadata (tag, include, exclude) for the `geneval` reward."""
    toy_sources: bool = False
    """With toy_split: give each prompt its toy source image (`metadata["image"]`, flowrl/toy/sources.py), for the toy
    image-to-video model (model.family_kwargs.source_weight > 0)."""
    num_prompts_per_step: int = 8
    """B: prompt groups per training step, over all processes."""
    group_size: int = 8
    """G: rollouts per prompt. B * G must divide by the number of processes."""
    noise_pool: int = 0
    """> 0: a prompt's e-th group takes the group seed (its shared initial noise with sampler.same_latent) number
    e mod noise_pool of a fixed pool per prompt, so starts recur (TAGRPO's memory bank); 0 = a fresh seed per group."""


@dataclass
class ComponentConfig:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Constructor arguments of the registered component (written flat beside `name` in YAML)."""


@dataclass
class RewardConfig:
    name: str
    weight: float = 1.0
    kwargs: dict[str, Any] = field(default_factory=dict)
    dtype: str | None = None
    """The reward's weights: float32, bfloat16 or float16 (fp32, bf16, fp16); None: float32."""
    device: str | None = None
    """Where the reward runs: cpu, cuda (this process's GPU) or cuda:N; None: the run's device."""
    batch_size: int | None = None
    """Score at most this many samples per reward call (chunks of the rollout); None: all at once."""


@dataclass
class CorrectedScoreConfig:
    """GDRO's hacking-aware evaluation score r·(û − 3) + 0.2 (docs/recipes/gdro.md#the-corrected-score), never a
    reward."""

    reward: str = ""
    """r: a training or gold reward's name."""
    judge: str = ""
    """The quality judge û is read from: another training or gold reward's name."""
    judge_range: list[float] = field(default_factory=lambda: [1.0, 5.0])
    """The judge's [low, high]: û = 1 + 4·(judge − low)/(high − low) on the 1-5 scale ([0, 1] for toy_artifact)."""


@dataclass
class EvalConfig:
    every_n_steps: int = 0
    """Evaluate every this many training steps (0: only the base model before and the final model after)."""
    prompts: list[str] | None = None
    prompts_file: str | None = None
    toy_split: str | None = None
    prompt_set: str | None = None
    """A named prompt set, as data.prompt_set (e.g. geneval:test, the benchmark's 553 prompts)."""
    toy_sources: bool = False
    """With toy_split: give each prompt its toy source image, as data.toy_sources."""
    num_prompts: int | None = None
    """Use only the first this many prompts."""
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2, 3])
    num_steps: int = 20
    guidance_scale: float | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    scheduler: str = "euler"
    """'euler' or 'pipeline' (the checkpoint's own scheduler, as users sample it)."""
    gold_rewards: list[RewardConfig] = field(default_factory=list)
    """Rewards scored at evaluation only (to catch reward hacking)."""
    batch_size: int = 16
    use_ema: bool = True
    """Evaluate the EMA weights when the trainer keeps them."""
    corrected_score: CorrectedScoreConfig | None = None
    """Also report GDRO's corrected score of a reward and a quality judge (scores.json `corrected_score`)."""


@dataclass
class CheckpointConfig:
    every_n_steps: int = 0
    """Write the full training state every this many steps (0: only at the end)."""
    keep_last: int = 2
    resume: str | None = None
    """'latest' (the newest checkpoint of this run, if any) or a checkpoint folder."""


@dataclass
class LoggingConfig:
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    """accelerate trackers: tensorboard, wandb (when installed), or [] for metrics.jsonl only."""
    progress_bar: bool = True


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    seed: int = 0
    trainer: str = "grpo"
    num_steps: int = 100
    """Training steps (one rollout batch and its optimisation each)."""
    device: str | None = None
    """None: accelerate's choice (GPU when present); 'cpu' forces the CPU."""
    distributed_timeout_s: int = 1800
    """Seconds a collective waits for the other processes before the run fails (torch.distributed's process-group
    timeout; NCCL's default is 600). Raise it where one rank may work alone longer (a long checkpoint write)."""
    on_reward_error: str = "raise"
    """'raise', or 'skip_sample': a reward that raises or returns NaN/inf drops those samples (counted)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampler: ComponentConfig = field(default_factory=lambda: ComponentConfig("sde"))
    rewards: list[RewardConfig] = field(default_factory=list)
    balancer: ComponentConfig = field(default_factory=lambda: ComponentConfig("weighted_sum"))
    train: Any = None
    """The trainer's own config dataclass (e.g. GRPOConfig), filled from the `train:` section; `trainer`
    names the recipe (flowrl.trainers.TRAINERS), which hands its config class to `build_config`."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    @property
    def run_dir(self) -> Path:
        """<output_dir>/<name>: the run folder (flowrl.training.runs.RunFolder lays out what it holds)."""
        return Path(self.output_dir) / self.name


_COMPONENT_SECTIONS = {"sampler": "SAMPLERS", "balancer": "BALANCERS"}


class ConfigError(ValueError):
    """A config problem, stated in one line with the key, the value and the fix."""


def _closest(key: str, options: list[str]) -> str:
    match = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f"; did you mean {match[0]!r}?" if match else f"; valid keys: {', '.join(sorted(options))}"


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Convert a YAML value to the declared type (numbers from strings, nested dataclasses, lists)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], where) if len(args) == 1 else value
    if value is None:
        return None
    if dataclasses.is_dataclass(hint):
        return from_dict(hint, value, where)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}={value!r} must be a list")
        (item,) = typing.get_args(hint) or (Any,)
        return [_coerce(v, item, f"{where}.{i}") for i, v in enumerate(value)]
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}={value!r} must be true or false")
    if hint in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}={value!r} must be a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}={value!r} must be a number") from None
        if hint is int:
            if number != int(number):
                raise ConfigError(f"{where}={value!r} must be a whole number")
            return int(number)
        return number
    if hint is str and not isinstance(value, str):
        raise ConfigError(f"{where}={value!r} must be a string")
    return value


def from_dict(cls: type, data: Any, where: str = "config") -> Any:
    """Build dataclass `cls` from a mapping, rejecting unknown keys with the closest valid one."""
    if cls in (ComponentConfig, RewardConfig):
        return _component_from_dict(cls, data, where)
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping of keys, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown key {where}.{key}{_closest(key, names)}")
    return cls(**{key: _coerce(value, hints[key], f"{where}.{key}") for key, value in data.items()})


def _component_from_dict(cls: type, data: Any, where: str) -> Any:
    if isinstance(data, str):
        data = {"name": data}
    if not isinstance(data, dict) or "name" not in data:
        raise ConfigError(f"{where} must be a mapping with a 'name' key (e.g. {{name: ...}})")
    data = dict(data)
    fixed = {"name": str(data.pop("name"))}
    if cls is RewardConfig and "weight" in data:
        fixed["weight"] = _coerce(data.pop("weight"), float, f"{where}.weight")
    for key in ("dtype", "device", "batch_size") if cls is RewardConfig else ():  # how it runs, not its kwargs
        if key in data:
            fixed[key] = data.pop(key)
    nested = data.pop("kwargs", {}) or {}
    return cls(**fixed, kwargs={**nested, **data})


def _check_component_kwargs(component_cls: type, kwargs: dict, where: str) -> dict:
    """Unknown constructor arguments of a registered component -> a ConfigError naming the closest one."""
    if dataclasses.is_dataclass(component_cls):
        hints = typing.get_type_hints(component_cls)
        names = [f.name for f in dataclasses.fields(component_cls) if f.init]
        out = {}
        for key, value in kwargs.items():
            if key not in names:
                raise ConfigError(f"unknown key {where}.{key}{_closest(key, names)}")
            out[key] = _coerce(value, hints[key], f"{where}.{key}") if hints[key] in (int, float, bool) else value
        return out
    params = inspect.signature(component_cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(kwargs)
    names = [n for n in params if n not in ("self", "device", "dtype")]
    for key in kwargs:
        if key not in names:
            raise ConfigError(f"unknown key {where}.{key}{_closest(key, names)}")
    return dict(kwargs)


def _check_reward_runtime(spec: RewardConfig, where: str) -> None:
    """A reward's dtype, device and batch_size, each a one-line ConfigError naming the field."""
    import torch

    from flowrl.models import DTYPES

    if spec.dtype is not None and spec.dtype not in DTYPES:
        raise ConfigError(f"{where}.dtype={spec.dtype!r} must be one of {', '.join(DTYPES)} (unset: float32)")
    if spec.device is not None:
        try:
            torch.device(spec.device if isinstance(spec.device, str) else "?")
        except RuntimeError:
            raise ConfigError(
                f"{where}.device={spec.device!r} is not a device; use cpu, cuda or cuda:N (unset: the run's)"
            ) from None
    size = spec.batch_size
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError(
            f"{where}.batch_size={size!r} must be a whole number >= 1 (samples per call; unset: all at once)"
        )


def _check_preview_backend(backend: Any, device: str | None) -> None:
    """The candidates sampler's preview precision against this machine's device, before any model loads: a kernel it
    lacks is a ConfigError; what `auto` chose is printed once (by the first process)."""
    import os
    import sys

    from flowrl.quant import check_preview_backend

    try:
        note = check_preview_backend(backend, device)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if note and os.environ.get("RANK", "0") == "0":
        print(f"flowrl: {note}", file=sys.stderr)


def validate(cfg: RunConfig) -> RunConfig:
    """Cross-field checks and component-argument checks, each a one-line ConfigError."""
    from flowrl import registry

    if cfg.on_reward_error not in ("raise", "skip_sample"):
        raise ConfigError(f"on_reward_error={cfg.on_reward_error!r} must be 'raise' or 'skip_sample'")
    if cfg.num_steps < 0:
        raise ConfigError(f"num_steps={cfg.num_steps} must be >= 0")
    if cfg.distributed_timeout_s < 1:
        raise ConfigError(f"distributed_timeout_s={cfg.distributed_timeout_s} must be >= 1 (seconds; e.g. 1800)")
    for name in ("num_prompts_per_step", "group_size"):
        if getattr(cfg.data, name) < 1:
            raise ConfigError(f"data.{name}={getattr(cfg.data, name)} must be >= 1")
    if cfg.model.mixed_precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"model.mixed_precision={cfg.model.mixed_precision!r} must be fp32, bf16 or fp16")
    if not cfg.rewards:
        raise ConfigError("rewards is empty: list at least one reward, e.g. rewards: [{name: toy_attributes}]")
    sources = [cfg.data.prompts_file, cfg.data.prompts, cfg.data.toy_split, cfg.data.prompt_set]
    if sum(s is not None for s in sources) != 1:
        raise ConfigError("data needs exactly one of prompts_file, prompts, toy_split, prompt_set")
    for section in ("data", "eval"):
        part = getattr(cfg, section)
        if part.toy_sources and part.toy_split is None:
            raise ConfigError(
                f"{section}.toy_sources=true needs {section}.toy_split (the source images are renders of the Shapes "
                f"world's prompts); set {section}.toy_split or drop {section}.toy_sources"
            )
    for section, reg_name in _COMPONENT_SECTIONS.items():
        spec = getattr(cfg, section)
        reg = getattr(registry, reg_name)
        try:
            component = reg.get(spec.name)
        except KeyError as err:
            raise ConfigError(f"{section}.name: {err.args[0]}") from None
        spec.kwargs = _check_component_kwargs(component, spec.kwargs, section)
    if isinstance(cfg.sampler.kwargs.get("preview_backend"), (str, list)):  # the candidates sampler's
        _check_preview_backend(cfg.sampler.kwargs["preview_backend"], cfg.device)
    for i, spec in enumerate(list(cfg.rewards) + list(cfg.eval.gold_rewards)):
        where = f"rewards.{i}" if i < len(cfg.rewards) else f"eval.gold_rewards.{i - len(cfg.rewards)}"
        try:
            component = registry.REWARDS.get(spec.name)
        except KeyError as err:
            raise ConfigError(f"{where}.name: {err.args[0]}") from None
        spec.kwargs = _check_component_kwargs(component, spec.kwargs, where)
        _check_reward_runtime(spec, where)
    names = [r.name for r in cfg.rewards]
    if len(set(names)) != len(names):
        raise ConfigError(f"rewards lists a reward twice ({names}); give each reward once with its weight")
    return cfg


def _set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node: Any = data
    for i, key in enumerate(keys[:-1]):
        nxt = keys[i + 1]
        if isinstance(node, list):
            node = node[int(key)]
            continue
        if key not in node or node[key] is None:
            node[key] = [] if nxt.isdigit() else {}
        node = node[key]
    last = keys[-1]
    if isinstance(node, list):
        index = int(last)
        if index == len(node):
            node.append(value)
        else:
            node[index] = value
    else:
        node[last] = value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """`a.b=value` overrides (value parsed as YAML; list entries by index: rewards.0.weight=2)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        try:
            _set_path(data, key.strip(), yaml.safe_load(raw))
        except (IndexError, ValueError, TypeError, AttributeError):
            raise ConfigError(f"override {item!r}: {key} is not a valid path in the config") from None
    return data


def build_config(data: dict, train_config: type) -> RunConfig:
    """A validated RunConfig from plain data; `train_config` is the recipe's config dataclass for `train:`."""
    data = dict(data or {})
    train = data.pop("train", None) or {}
    cfg = from_dict(RunConfig, data, "config")
    cfg.train = from_dict(train_config, train, "train")
    return validate(cfg)


def read_config_data(path: str | Path, overrides: list[str] | None = None) -> dict:
    """The YAML mapping of a config file with `key=value` overrides applied; one-line errors for a missing file,
    a file that is not YAML (file, line, column and the parser's complaint) or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"config file {str(path)!r} does not exist; pass a YAML file such as configs/toy/grpo.yaml"
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML:{where}: {problem}; fix the file") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys at the top level")
    return apply_overrides(data, list(overrides or []))


def load_config(path: str | Path, overrides: list[str] | None, train_config: type) -> RunConfig:
    return build_config(read_config_data(path, overrides), train_config)


def to_dict(cfg: Any) -> Any:
    """The config as plain YAML-able data, with component kwargs written flat again."""
    if isinstance(cfg, (ComponentConfig, RewardConfig)):
        out = {"name": cfg.name}
        if isinstance(cfg, RewardConfig):
            out["weight"] = cfg.weight
            out.update({k: getattr(cfg, k) for k in ("dtype", "device", "batch_size") if getattr(cfg, k) is not None})
        out.update(cfg.kwargs)
        return out
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1} (lists by index), for comparing two configs key by key."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    if isinstance(data, list) and data and isinstance(data[0], dict):
        out = {}
        for i, v in enumerate(data):
            out.update(flatten(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: data}
