"""The memory and speed switches of the `model:` config section, applied to a built adapter
(docs/models.md#memory-and-speed).

- `prompt_cache_max_bytes`, `prompt_cache_device`: the encoded-prompt cache's bound and home
  (flowrl.models.prompt_cache);
- `offload_text_encoders`: text encoders on the CPU between encode calls (flowrl.models.placement);
- `vae_slicing`, `vae_tiling`: diffusers' VAE switches (decode a chunk one sample at a time / in overlapping tiles);
- `attention_backend`: sdpa (PyTorch's, diffusers' default) or xformers;
- `allow_tf32`: TF32 for float32 matmuls and convolutions on CUDA (process-wide; nothing on other devices);
- `compile`: `torch.compile` of the transformer's forward (the module itself stays: names, LoRA, sharding unchanged).
"""

from __future__ import annotations

import torch

ATTENTION_BACKENDS = ("sdpa", "xformers")
DEFAULTS = {
    "prompt_cache_max_bytes": 2 * 1024**3,
    "prompt_cache_device": "model",
    "offload_text_encoders": False,
    "vae_slicing": False,
    "vae_tiling": False,
    "attention_backend": "sdpa",
    "allow_tf32": True,
    "compile": False,
}
GLOBAL = ("allow_tf32", "compile")  # apply to every model, the toy one too


def apply_switches(model, model_cfg) -> None:
    """Apply the memory and speed keys of `model_cfg` to `model`; a key set away from its default on a model it does not
    apply to (the toy model has no pipeline) raises a one-line error."""
    settings = {key: getattr(model_cfg, key, default) for key, default in DEFAULTS.items()}
    if settings["attention_backend"] not in ATTENTION_BACKENDS:
        raise ValueError(
            f"model.attention_backend={settings['attention_backend']!r} must be one of {', '.join(ATTENTION_BACKENDS)}"
        )
    device = torch.device(model.device)
    if device.type == "cuda":  # process-wide, so only where it means something
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(settings["allow_tf32"])
    if not hasattr(model, "pipe"):
        changed = [key for key, value in settings.items() if value != DEFAULTS[key] and key not in GLOBAL]
        if changed:
            raise ValueError(
                f"model.{changed[0]}={settings[changed[0]]!r} does not apply to the {model.family} model; "
                "leave it unset"
            )
    else:
        _apply_pipeline_switches(model, settings, device)
    if settings["compile"]:
        model.transformer.compile()  # nn.Module.compile: the forward compiled on first call, the module kept


def _apply_pipeline_switches(model, settings: dict, device: torch.device) -> None:
    model.set_prompt_cache(settings["prompt_cache_max_bytes"], settings["prompt_cache_device"])
    if settings["offload_text_encoders"]:
        from flowrl.models.placement import offload_text_encoders

        offload_text_encoders(model)
    for key, attribute, method in (
        ("vae_slicing", "use_slicing", "enable_slicing"),
        ("vae_tiling", "use_tiling", "enable_tiling"),
    ):
        if settings[key]:
            vae = getattr(model.pipe, "vae", None)
            if not hasattr(vae, attribute) or not hasattr(vae, method):
                raise ValueError(
                    f"model.{key}=true: the {model.family} VAE ({type(vae).__name__}) has no {method}(); leave it false"
                )
            getattr(vae, method)()
    if settings["attention_backend"] == "xformers":
        problem = xformers_problem(device)
        if problem:
            raise ValueError(f"model.attention_backend=xformers: {problem}; use attention_backend: sdpa (the default)")
        model.pipe.enable_xformers_memory_efficient_attention()


def xformers_problem(device: torch.device) -> str | None:
    """Why xformers attention cannot run here (not installed; its kernels built for another torch; no CUDA), or None."""
    try:
        import xformers
        import xformers._cpp_lib as cpp_lib
    except ImportError:
        return "xformers is not installed (pip install 'flowrl[cuda]')"
    failure = getattr(cpp_lib, "_cpp_library_load_exception", None)
    if failure is not None:
        info = getattr(failure, "build_info", None)
        built = f"torch {info.torch_version}" if info is not None else "another torch"
        return (
            f"xformers {xformers.__version__} was built for {built} and its kernels do not load beside "
            f"torch {torch.__version__}"
        )
    if device.type != "cuda":
        return f"xformers attention runs on CUDA only, and the model is on {device.type}"
    return None
