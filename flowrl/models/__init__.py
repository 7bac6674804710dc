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
    "WanImageToVideoPipeline": ("flowrl.models.wan_i2v", "WanI2VFlowModel"),
    "QwenImagePipeline": ("flowrl.models.qwen_image", "QwenImageFlowModel"),
    "QwenImageEditPipeline": ("flowrl.models.qwen_image_edit", "QwenImageEditFlowModel"),
    "QwenImageEditPlusPipeline": ("flowrl.models.qwen_image_edit", "QwenImageEditFlowModel"),
    "Flux2Pipeline": ("flowrl.models.flux2", "Flux2FlowModel"),
    "Flux2KleinPipeline": ("flowrl.models.flux2", "Flux2FlowModel"),
    "ZImagePipeline": ("flowrl.models.z_image", "ZImageFlowModel"),
    "LTX2Pipeline": ("flowrl.models.ltx2", "LTX2FlowModel"),
}

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def pretrained_dtype(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The dtype argument of diffusers' `from_pretrained` in the form the installed version honours: `dtype` from
    0.40 on, `torch_dtype` before (0.35-0.39 ignore `dtype` with a warning and load float32; 0.40+ deprecate
    `torch_dtype`)."""
    import diffusers
    from packaging.version import Version

    return {"dtype": dtype} if Version(diffusers.__version__).release >= (0, 40) else {"torch_dtype": dtype}


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def load_flow_model(
    path_or_hub_id: str,
    dtype: str | torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_sequence_length: int | None = None,
    mixed_precision: str = "fp32",
    sharded: bool = False,
    **kwargs,
):
    """Load a FlowModel: 'toy' (the shipped Shapes model), a local diffusers folder, or a hub id.

    A local folder never touches the network; a hub id downloads only because the user named one.
    `max_sequence_length` (None: the pipeline's default) sets the text tokens per prompt; `mixed_precision`
    (fp32, bf16, fp16) the autocast every `velocity` call runs under. `sharded` (FSDP2 will shard the transformer):
    the transformer and the text encoders stay on the CPU, the rest goes to `device` (flowrl.models.placement).
    """
    model = _load(path_or_hub_id, parse_dtype(dtype), device, sharded, **kwargs)
    if max_sequence_length is not None:
        if not hasattr(model, "set_max_sequence_length"):
            raise ValueError(
                f"model.max_sequence_length={max_sequence_length}: the {model.family} model has a fixed prompt "
                "length; leave it unset"
            )
        model.set_max_sequence_length(max_sequence_length)
    model.set_mixed_precision(mixed_precision)
    return model


def build_policy(model_cfg, device: str | torch.device, sharded: bool = False):
    """The model a recipe trains, from its `model:` config section: loaded, autocast set, the adapter added (or
    loaded from `init_lora`), gradient checkpointing on request, trained weights in float32 (frozen parts keep
    `model.dtype`). Call after seeding: a fresh adapter's initial weights come from the global RNG. `sharded` (the
    run shards the transformer with FSDP2): loaded for sharding, the transformer left on the CPU until
    `fully_shard` moves it shard by shard (flowrl.models.placement)."""
    m = model_cfg
    extra = {"train_expert": m.train_expert} if m.train_expert is not None else {}
    extra.update(m.family_kwargs or {})
    model = load_flow_model(
        m.path,
        dtype=m.dtype,
        device=device,
        max_sequence_length=m.max_sequence_length,
        mixed_precision=m.mixed_precision,
        sharded=sharded,
        **extra,
    )
    if m.use_lora:
        if m.init_lora:
            model.load_lora(m.init_lora)
            for name, p in model.transformer.named_parameters():
                p.requires_grad_("lora_" in name)
        else:
            targets = tuple(m.lora_target_modules) if m.lora_target_modules else None
            model.add_lora(rank=m.lora_rank, alpha=m.lora_alpha, target_modules=targets)
    else:
        model.transformer.requires_grad_(True)
    if m.use_gradient_checkpointing:
        model.enable_gradient_checkpointing()
    for p in model.transformer.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    from flowrl.models.switches import apply_switches

    apply_switches(model, m)  # prompt cache, offload, VAE, attention, TF32, compile (docs/models.md#memory-and-speed)
    return model


def _load(path_or_hub_id: str, dtype: torch.dtype, device, sharded: bool = False, **kwargs):
    import contextlib
    import importlib
    import inspect

    from diffusers import DiffusionPipeline

    from flowrl.hub import hub_errors

    if path_or_hub_id == "toy":
        from flowrl.models.toy import load_toy_model

        for key in kwargs:
            if key not in ("source_weight", "grammar"):
                raise ValueError(
                    f"model.{key}={kwargs[key]!r} does not apply to the toy model; its settings are source_weight and "
                    "grammar (geneval: the second toy model, docs/toy.md#geneval-families)"
                )
        return load_toy_model(device=device, dtype=dtype, **kwargs)
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
            f"model={path_or_hub_id!r} is neither an existing folder nor a hub id (org/name); pass one of those "
            "or 'toy'"
        )
    if class_name is not None and class_name not in ADAPTERS:
        raise ValueError(f"pipeline class {class_name!r} is not supported; supported: {', '.join(ADAPTERS)}")
    # a hub id's download failures (offline, gated, missing, no network) become one line naming the fix
    with hub_errors(source, "model") if class_name is None else contextlib.nullcontext():
        pipe = DiffusionPipeline.from_pretrained(source, **pretrained_dtype(dtype))
    class_name = type(pipe).__name__
    if class_name not in ADAPTERS:
        raise ValueError(f"pipeline class {class_name!r} is not supported; supported: {', '.join(ADAPTERS)}")
    pipe.set_progress_bar_config(disable=True)
    if not sharded:  # under FSDP2 nothing moves whole: placement below
        pipe.to(device)
    module, cls = ADAPTERS[class_name]
    adapter = getattr(importlib.import_module(module), cls)
    accepted = inspect.signature(adapter.__init__).parameters
    for key in kwargs:
        if key not in accepted:
            raise ValueError(f"model.{key}={kwargs[key]!r} does not apply to {class_name} checkpoints; leave it unset")
    model = adapter(pipe, device=device, dtype=dtype, **kwargs)
    if sharded:
        from flowrl.models.placement import place_for_sharding

        place_for_sharding(model, device)
    return model
