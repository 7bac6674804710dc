"""Full training state, written atomically and read back without unpickling arbitrary objects.

A checkpoint is a folder `runs/<name>/checkpoints/step_XXXXXX/`:

    trainable.safetensors   every parameter that requires grad (LoRA or full weights), by name
    ema.safetensors         EMA copies of those parameters (when the trainer keeps EMA)
    <group>.safetensors     a recipe's own tensor groups (NFT: adapter_old.safetensors, its sampling policy)
    optimizer.pt            optimizer state keyed by parameter name, whole tensors whatever the sharding
                            (tensors and numbers; read with weights_only=True)
    lr_scheduler.json       LR scheduler state_dict
    trainer_state.json      step, prompt-sampler position, counters
    rng_<rank>.json         torch / numpy / python RNG states of every process, and its CUDA device's
    config.yaml             the run's resolved config
    lora/                   the adapter in the diffusers LoRA format (pipe.load_lora_weights reads it)

It is first written to `.tmp_step_XXXXXX/` and renamed into place when complete, so a crash mid-write leaves
the previous checkpoints intact and no half-written `step_*` folder.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from flowrl.training.runs import CHECKPOINTS, step_dir_name, step_of

# Tests set this to a step number to SIGKILL the process in the middle of writing that step's checkpoint.
FAULT_ENV = "FLOWRL_FAULT_KILL_DURING_CHECKPOINT"
# keys that may differ between a checkpoint's config and the config that resumes it
RESUMABLE_DIFFERENCES = (
    "num_steps",
    "checkpoint.",
    "logging.",
    "eval.",
    "device",
    "output_dir",
    "distributed_timeout_s",
)
# config sections a recipe no longer holds, with the switch that had them off: a checkpoint written with the section
# switched off resumes without it (TAGRPO left the GRPO recipe's train.tagrpo for a recipe of its own, trainer: tagrpo)
RETIRED_SECTIONS = {"train.tagrpo.": ("train.tagrpo.enabled", False)}


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    folder = Path(run_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [
        p
        for p in folder.iterdir()
        if p.is_dir() and step_of(p.name) is not None and (p / "trainer_state.json").exists()
    ]
    return sorted(found, key=lambda p: step_of(p.name))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def _fsync_dir(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())


def rng_state() -> dict[str, Any]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [kind, keys.tolist(), pos, has_gauss, cached],
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available():  # this process's device only: a resume may see fewer devices
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if cuda and isinstance(cuda[0], list):  # older checkpoints: every visible device's state, by index
            index = torch.cuda.current_device()
            if index >= len(cuda):
                warnings.warn(
                    f"the checkpoint's CUDA RNG states cover devices 0-{len(cuda) - 1}, not this process's device "
                    f"{index}: its CUDA RNG keeps the run's seeding (flowrl's sampling draws from per-sample "
                    "generators)",
                    stacklevel=2,
                )
                return
            cuda = cuda[index]  # the state of the device this process's rank ran on
        torch.cuda.set_rng_state(torch.tensor(cuda, dtype=torch.uint8))


def save_checkpoint(
    accelerator,
    run_dir: str | Path,
    step: int,
    *,
    trainable: dict[str, torch.Tensor],
    optimizer_state: dict,
    lr_scheduler,
    trainer_state: dict,
    config_yaml: str,
    ema: dict[str, torch.Tensor] | None = None,
    model=None,
    keep_last: int = 2,
    lora_tensors: dict[str, torch.Tensor] | None = None,
    groups: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Write the full state of every process for `step`; all processes must call it. Returns the folder.

    `trainable`, `optimizer_state` and `ema` are whole (gathered) CPU tensors keyed by parameter name, whatever
    the sharding (flowrl.training.distributed); only the main process reads them. The LoRA export is written from
    `trainable`.
    """
    folder = Path(run_dir) / CHECKPOINTS
    final = folder / step_dir_name(step)
    tmp = folder / f".tmp_{step_dir_name(step)}"
    if accelerator.is_main_process:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    accelerator.wait_for_everyone()
    (tmp / f"rng_{accelerator.process_index}.json").write_text(json.dumps(rng_state()))
    if accelerator.is_main_process:
        save_file(trainable, str(tmp / "trainable.safetensors"))
        if os.environ.get(FAULT_ENV) == str(step):  # fault injection for the resume tests: die mid-write
            os.kill(os.getpid(), signal.SIGKILL)
        if ema is not None:
            save_file(ema, str(tmp / "ema.safetensors"))
        for group, tensors in (groups or {}).items():
            save_file(tensors, str(tmp / f"{group}.safetensors"))
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "lr_scheduler.json").write_text(json.dumps(lr_scheduler.state_dict()))
        (tmp / "config.yaml").write_text(config_yaml)
        if model is not None and getattr(model, "has_lora", False):
            model.save_lora(tmp / "lora", lora_tensors if lora_tensors is not None else trainable)
        (tmp / "trainer_state.json").write_text(json.dumps({**trainer_state, "step": step}))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        _fsync_dir(tmp)
        if final.exists():
            old = folder / f".old_{final.name}"
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            shutil.rmtree(old)
        tmp.rename(final)
        for stale in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


# what reading a damaged checkpoint file raises: json/yaml/UTF-8 errors, safetensors headers, torch's zip and unpickler
_READ_ERRORS = (
    OSError,
    ValueError,
    EOFError,
    RuntimeError,
    KeyError,
    yaml.YAMLError,
    SafetensorError,
    pickle.UnpicklingError,
)


def _read_checkpoint_file(file: Path, read: Callable[[Path], Any], kind: type | None = None) -> Any:
    """One file of a checkpoint through `read`; a missing or damaged file is a one-line error naming it and the fix."""
    fix = "pass another checkpoints/step_XXXXXX folder (e.g. the previous step) or rewrite this one by training again"
    if not file.is_file():
        raise FileNotFoundError(f"checkpoint file {str(file)!r} is missing; {fix}")
    try:
        value = read(file)
    except _READ_ERRORS as err:
        detail = " ".join(str(err).split())[:160] or type(err).__name__
        raise ValueError(f"checkpoint file {str(file)!r} is corrupt or truncated ({detail}); {fix}") from None
    if kind is not None and not isinstance(value, kind):
        raise ValueError(f"checkpoint file {str(file)!r} holds a {type(value).__name__}, not a {kind.__name__}; {fix}")
    return value


def load_checkpoint(path: str | Path, process_index: int = 0, groups: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read a checkpoint folder: tensors through safetensors, the optimizer with weights_only=True; `groups` are the
    recipe's own tensor groups (returned under "groups")."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        what = "has no trainer_state.json" if path.is_dir() else "is not a folder"
        raise FileNotFoundError(f"checkpoint {str(path)!r} {what}; pass a checkpoints/step_XXXXXX folder")

    def read_json(file: Path) -> Any:
        return json.loads(file.read_text())

    def read_optimizer(file: Path) -> Any:
        return torch.load(file, weights_only=True, map_location="cpu")

    def read_tensors(file: Path) -> dict[str, torch.Tensor]:
        return load_file(str(file))

    ema, rng = path / "ema.safetensors", path / f"rng_{process_index}.json"
    return {
        "trainer_state": _read_checkpoint_file(path / "trainer_state.json", read_json, dict),
        "trainable": _read_checkpoint_file(path / "trainable.safetensors", read_tensors),
        "optimizer": _read_checkpoint_file(path / "optimizer.pt", read_optimizer),
        "lr_scheduler": _read_checkpoint_file(path / "lr_scheduler.json", read_json, dict),
        "config": _read_checkpoint_file(path / "config.yaml", lambda f: yaml.safe_load(f.read_text()), dict),
        "ema": _read_checkpoint_file(ema, read_tensors) if ema.exists() else None,
        "rng": _read_checkpoint_file(rng, read_json, dict) if rng.exists() else None,
        "groups": {g: _read_checkpoint_file(path / f"{g}.safetensors", read_tensors) for g in groups},
    }


def read_group(path: str | Path, group: str) -> dict[str, torch.Tensor]:
    """A recipe's tensor group of variable size (e.g. TAGRPO's memory bank) as saved, not copied into live tensors."""
    return _read_checkpoint_file(Path(path) / f"{group}.safetensors", lambda f: load_file(str(f)))


def load_group_into(path: str | Path, group: str, live: dict[str, torch.Tensor]) -> None:
    """A recipe's tensor group of fixed names and shapes (e.g. NFT's old adapter), copied into its live (possibly
    sharded) tensors in place."""
    from flowrl.training.distributed import like

    saved = read_group(path, group)
    if saved.keys() != live.keys():
        raise ValueError(f"checkpoint {str(path)!r}: {group}.safetensors holds other tensors than this run's {group}")
    with torch.no_grad():
        for name, tensor in live.items():
            tensor.copy_(like(saved[name], tensor))


def field_default(cfg: Any, dotted: str) -> Any:
    """The schema default of config key `dotted` ("train.tagrpo.coef") of the config object `cfg`; a sentinel where
    the key is no dataclass field (a list entry, a component's kwargs)."""
    import dataclasses

    missing = object()
    *path, last = dotted.split(".")
    node = cfg
    for part in path:
        node = getattr(node, part, missing) if dataclasses.is_dataclass(node) else missing
    if not dataclasses.is_dataclass(node):
        return missing
    for f in dataclasses.fields(node):
        if f.name == last:
            if f.default is not dataclasses.MISSING:
                return f.default
            return f.default_factory() if f.default_factory is not dataclasses.MISSING else missing
    return missing


def config_differences(saved: dict, current: dict, cfg: Any = None) -> list[str]:
    """Dotted keys whose values differ between a checkpoint's config and the current one (resumable keys excluded).
    With the current config object `cfg`, a key the checkpoint lacks (written by a flowrl before the key existed)
    does not differ while the current value is the key's default, the behaviour the older run had; a section the
    current schema no longer holds (RETIRED_SECTIONS) does not differ where the checkpoint had it switched off."""
    from flowrl.config import flatten, to_dict

    a, b = flatten(saved), flatten(current)
    for prefix, (switch, off) in RETIRED_SECTIONS.items():
        if a.get(switch, off) == off and not any(k.startswith(prefix) for k in b):
            a = {k: v for k, v in a.items() if not k.startswith(prefix)}
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        if a.get(k) == b.get(k) or k.startswith(RESUMABLE_DIFFERENCES):
            continue
        if cfg is not None and k not in a and k in b and to_dict(field_default(cfg, k)) == b[k]:
            continue
        out.append(k)
    return out


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "latest":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(
            f"checkpoint.resume={resume!r} is not a folder; pass 'latest' or a checkpoints/step_XXXXXX folder"
        )
    return path


def load_model_for_eval(cfg, checkpoint: str | Path, device: str | torch.device):
    """(model, weights) for `flowrl eval` on `device` (the accelerator's): the run's model built as its trainer builds
    it (`build_policy`: train_expert, family_kwargs, init_lora, trained weights in float32) with a checkpoint's
    weights, the EMA ones when the run kept EMA, at least one EMA update happened and cfg.eval.use_ema; weights is
    "base" (evaluate it with the adapter switched off, as the run's base eval), "ema" or "raw"."""
    from flowrl.models import build_policy

    state = (
        None if str(checkpoint) == "base" else load_checkpoint(checkpoint)
    )  # a broken one fails before the model loads
    model = build_policy(cfg.model, device)
    if state is None:
        return model, "base"
    use_ema = cfg.eval.use_ema and state["ema"] is not None and state["trainer_state"].get("ema_updates", 1) > 0
    weights = state["ema"] if use_ema else state["trainable"]
    params = dict(model.transformer.named_parameters())
    missing = [k for k in weights if k not in params]
    if missing:
        raise ValueError(
            f"checkpoint {str(checkpoint)!r} has weights the model lacks ({missing[0]}, ...): was it made with another "
            "model config?"
        )
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
    return model, "ema" if use_ema else "raw"


def save_training_state(
    accelerator,
    run_dir: str | Path,
    step: int,
    opt,
    ema,
    model,
    trainer_state: dict,
    config_yaml: str,
    keep_last: int = 2,
    groups: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Any recipe's checkpoint: the OptimizerStep's tensors and counters, the EMA, the recipe's own state and
    tensor groups (`groups`: name -> live tensors by name, e.g. a second adapter; gathered like the rest).

    Whole tensors are gathered for the main process (a collective under FSDP2 / ZeRO-2, skipped by other
    data-parallel processes). The exported `lora/` holds the EMA adapter when the run keeps EMA (the weights
    the evaluation reports); `trainer_state.json` says which (`lora_weights`: "ema" or "raw").
    """
    from flowrl.training.distributed import full

    gather = opt.sharding.kind is not None or accelerator.is_main_process
    trainable, optimizer_state = opt.full_state(gather)
    ema_tensors = {k: full(v) for k, v in ema.shadow.items()} if gather and ema is not None else None
    group_tensors = {g: {k: full(v) for k, v in ts.items()} for g, ts in (groups or {}).items()} if gather else None
    exported = "ema" if ema is not None and ema.num_updates > 0 else "raw"
    state = {
        **trainer_state,
        "optimizer": opt.state_dict(),
        "ema_updates": ema.num_updates if ema is not None else 0,
        "lora_weights": exported,
    }
    return save_checkpoint(
        accelerator,
        run_dir,
        step,
        trainable=trainable,
        optimizer_state=optimizer_state,
        lr_scheduler=opt.lr_scheduler,
        trainer_state=state,
        config_yaml=config_yaml,
        ema=ema_tensors,
        model=model,
        keep_last=keep_last,
        lora_tensors=ema_tensors if exported == "ema" else None,
        groups=group_tensors,
    )


def restore_training_state(path: str | Path, accelerator, opt, ema, cfg: Any) -> dict:
    """Load a checkpoint into an OptimizerStep and EMA; returns the recipe's trainer state (step, counters; a recipe's
    own tensor groups load with `read_group` or `load_group_into`).

    Refuses a checkpoint written with another config (keys other than RESUMABLE_DIFFERENCES differ).
    """
    from flowrl.training.distributed import like

    state = load_checkpoint(path, accelerator.process_index)
    from flowrl.config import to_dict

    diff = config_differences(state["config"], to_dict(cfg), cfg)
    if diff:
        raise ValueError(
            f"checkpoint {str(path)!r} comes from another config: keys {', '.join(diff[:6])} differ; "
            "resume with the config it was written with or start a new run name"
        )
    opt.load_full_state(state["trainable"], state["optimizer"], state["lr_scheduler"])
    ts = state["trainer_state"]
    # a trainer state without an optimizer record keeps the optimizer counters at its top level
    legacy = {"optimizer_steps": ts.get("optimizer_steps", 0), "nan_streak": ts.get("nan_streak", 0), "counters": {}}
    opt.load_state_dict(ts.get("optimizer", legacy))
    if ema is not None and state["ema"] is not None:
        for name, value in state["ema"].items():
            ema.shadow[name] = like(value, ema.shadow[name])
        ema.num_updates = int(ts.get("ema_updates", 0))
    if state["rng"] is not None:
        set_rng_state(state["rng"])
    return ts
