"""Full training state, written atomically and read back without unpickling arbitrary objects.

A checkpoint is a folder `runs/<name>/checkpoints/step_XXXXXX/`:

    trainable.safetensors   every parameter that requires grad (LoRA or full weights), by name
    ema.safetensors         EMA copies of those parameters (when the trainer keeps EMA)
    optimizer.pt            optimizer state keyed by parameter name, whole tensors whatever the sharding
                            (tensors and numbers; read with weights_only=True)
    lr_scheduler.json       LR scheduler state_dict
    trainer_state.json      step, prompt-sampler position, counters
    rng_<rank>.json         torch / CUDA / numpy / python RNG states of every process
    config.yaml             the run's resolved config
    lora/                   the adapter in the diffusers LoRA format (pipe.load_lora_weights reads it)

It is first written to `.tmp_step_XXXXXX/` and renamed into place when complete, so a crash mid-write leaves
the previous checkpoints intact and no half-written `step_*` folder.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors.torch import load_file, save_file

STEP_PREFIX = "step_"
# Tests set this to a step number to SIGKILL the process in the middle of writing that step's checkpoint.
FAULT_ENV = "FLOWRL_FAULT_KILL_DURING_CHECKPOINT"
# keys that may differ between a checkpoint's config and the config that resumes it
RESUMABLE_DIFFERENCES = ("num_steps", "checkpoint.", "logging.", "eval.", "device", "output_dir")


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:06d}"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / "trainer_state.json").exists()]
    return sorted(found, key=lambda p: int(p.name[len(STEP_PREFIX):]))


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
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def save_checkpoint(
    accelerator, run_dir: str | Path, step: int, *, trainable: dict[str, torch.Tensor], optimizer_state: dict, lr_scheduler,
    trainer_state: dict, config_yaml: str, ema: dict[str, torch.Tensor] | None = None, model=None, keep_last: int = 2,
) -> Path:
    """Write the full state of every process for `step`; all processes must call it. Returns the folder.

    `trainable`, `optimizer_state` and `ema` are whole (gathered) CPU tensors keyed by parameter name, whatever
    the sharding (flowrl.distributed); only the main process reads them. The LoRA export is written from `trainable`.
    """
    folder = Path(run_dir) / "checkpoints"
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
        torch.save(optimizer_state, tmp / "optimizer.pt")
        (tmp / "lr_scheduler.json").write_text(json.dumps(lr_scheduler.state_dict()))
        (tmp / "config.yaml").write_text(config_yaml)
        if model is not None and getattr(model, "has_lora", False):
            model.save_lora(tmp / "lora", trainable)
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


def load_checkpoint(path: str | Path, process_index: int = 0) -> dict[str, Any]:
    """Read a checkpoint folder: tensors through safetensors, the optimizer with weights_only=True."""
    path = Path(path)
    if not (path / "trainer_state.json").is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} has no trainer_state.json; pass a checkpoints/step_XXXXXX folder")
    out: dict[str, Any] = {
        "trainable": load_file(str(path / "trainable.safetensors")),
        "optimizer": torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu"),
        "lr_scheduler": json.loads((path / "lr_scheduler.json").read_text()),
        "trainer_state": json.loads((path / "trainer_state.json").read_text()),
        "config": yaml.safe_load((path / "config.yaml").read_text()),
        "ema": load_file(str(path / "ema.safetensors")) if (path / "ema.safetensors").exists() else None,
    }
    rng = path / f"rng_{process_index}.json"
    out["rng"] = json.loads(rng.read_text()) if rng.exists() else None
    return out


def config_differences(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ between a checkpoint's config and the current one (resumable keys excluded)."""
    from flowrl.config import flatten

    a, b = flatten(saved), flatten(current)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if a.get(k) != b.get(k) and not k.startswith(RESUMABLE_DIFFERENCES)]


def resolve_resume(resume: str | None, run_dir: Path) -> Path | None:
    if resume is None:
        return None
    if resume == "latest":
        return latest_checkpoint(run_dir)
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint.resume={resume!r} is not a folder; pass 'latest' or a checkpoints/step_XXXXXX folder")
    return path


def load_model_for_eval(cfg, checkpoint: str | Path):
    """The run's model with a checkpoint's weights ('base': none), EMA weights when present and cfg.eval.use_ema."""
    from flowrl.models import load_flow_model

    model = load_flow_model(cfg.model.path, dtype=cfg.model.dtype, device=cfg.device or "cpu")
    if str(checkpoint) == "base":
        return model
    state = load_checkpoint(checkpoint)
    if cfg.model.use_lora:
        model.add_lora(rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                       target_modules=tuple(cfg.model.lora_target_modules) if cfg.model.lora_target_modules else None)
    weights = state["ema"] if (cfg.eval.use_ema and state["ema"] is not None) else state["trainable"]
    params = dict(model.transformer.named_parameters())
    missing = [k for k in weights if k not in params]
    if missing:
        raise ValueError(f"checkpoint {str(checkpoint)!r} has weights the model lacks ({missing[0]}, ...): was it made with another model config?")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
    return model
