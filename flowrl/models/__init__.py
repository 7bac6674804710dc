"""Model adapters: one file per family over diffusers classes, all behind `load_flow_model`."""

from __future__ import annotations

import json
from pathlib import Path

import torch

# model_index.json "_class_name" -> (module, adapter class)
ADAPTERS = {
    "StableDiffusion3Pipeline": ("flowrl.models.sd3", "SD3FlowModel"),
    "FluxPipeline": ("flowrl.models.flux", "FluxFlowModel"),
    "SanaPipeline": ("flowrl.models.sana", "SanaFlowModel"),
    "WanPipeline": ("flowrl.models.wan", "WanFlowModel"),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def load_flow_model(path_or_hub_id: str, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu", **kwargs):
    """Load a FlowModel: 'toy' (the shipped Shapes model), a local diffusers folder, or a hub id.

    A local folder never touches the network; a hub id downloads only because the user named one.
    """
    import importlib

    from diffusers import DiffusionPipeline

    dtype = parse_dtype(dtype)
    if path_or_hub_id == "toy":
        from flowrl.models.toy import load_toy_model

        return load_toy_model(device=device, dtype=dtype)
    path = Path(path_or_hub_id).expanduser()
    if path.exists():
        from flowrl.models.pipeline import validate_pipeline_folder

        validate_pipeline_folder(path)
        class_name = json.loads((path / "model_index.json").read_text()).get("_class_name", "?")
        source = str(path)
    elif _looks_like_hub_id(path_or_hub_id):
        class_name = None
        source = path_or_hub_id
    else:
        raise FileNotFoundError(
            f"model={path_or_hub_id!r} is neither an existing folder nor a hub id (org/name); pass one of those or 'toy'"
        )
    if class_name is not None and class_name not in ADAPTERS:
        raise ValueError(f"pipeline class {class_name!r} is not supported; supported: {', '.join(ADAPTERS)}")
    pipe = DiffusionPipeline.from_pretrained(source, dtype=dtype)
    class_name = type(pipe).__name__
    if class_name not in ADAPTERS:
        raise ValueError(f"pipeline class {class_name!r} is not supported; supported: {', '.join(ADAPTERS)}")
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    module, cls = ADAPTERS[class_name]
    return getattr(importlib.import_module(module), cls)(pipe, device=device, dtype=dtype, **kwargs)
