"""The real architectures of scripts/gpu_check.py (the published configs of flowrl.plan.archs), and the pipelines
they build with random weights: on a GPU in the run's dtype, or on the meta device to count parameters without
memory.

No weights ship and nothing downloads: the tokenizers are the tiny character-level ones of
flowrl.models.tiny_tokenizers (token ids stay below every real vocabulary), which give the real sequence lengths.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

# the published configs, defined once in flowrl.plan.arch_configs (re-exported here for gpu_check and its sections)
from flowrl.plan.arch_configs import (  # noqa: F401
    CLIP_G,
    CLIP_L,
    CLIP_VIT_H14,
    FLUX1_DEV,
    FLUX_VAE,
    OPEN_CLIP_VIT_B32,
    SD3_VAE,
    SD35_MEDIUM,
    T5_XXL,
    UMT5_XXL,
    WAN21_1_3B,
    WAN_VAE,
)

# parameter counts of the transformers (counted on meta): the check compares against these
EXPECTED_PARAMS_B = {"sd3": 2.243, "flux": 11.901, "wan": 1.419}
PIPELINE_CLASSES = {"sd3": "StableDiffusion3Pipeline", "flux": "FluxPipeline", "wan": "WanPipeline"}


@contextlib.contextmanager
def building(device, dtype: torch.dtype):
    """Modules constructed inside are created on `device` in `dtype` (no float32 copy first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


@contextlib.contextmanager
def seeded(device, seed: int = 0):
    """The same random weights on every build (a resumed run's frozen weights equal the first run's), the caller's
    RNG streams untouched."""
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _clip(cls, cfg: dict, tokenizer):
    from transformers import CLIPTextConfig

    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return cls(CLIPTextConfig(**cfg, **ids))


def _t5(cls_name: str, cfg: dict):
    import transformers

    config = getattr(transformers, cls_name.replace("EncoderModel", "Config"))(
        **cfg, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1
    )
    return getattr(transformers, cls_name)(config)


def as_loaded(pipe, dtype: torch.dtype):
    """Every component in `dtype`, buffers included, except what its class keeps in float32 (`_keep_in_fp32_modules`:
    T5's `wo`, Wan's norms and time embedder): what from_pretrained(..., dtype) gives."""
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            torch.nn.Module.to(component, dtype)
            keep = getattr(component, "_keep_in_fp32_modules", None) or []
            for name, tensor in [*component.named_parameters(), *component.named_buffers()]:
                if tensor.is_floating_point() and any(k in name.split(".") for k in keep):
                    tensor.data = tensor.data.float()
    return pipe


def _scheduler(**kwargs):
    """Built on the CPU in float32 whatever `building` says (its tables are not weights)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    with building("cpu", torch.float32):
        return FlowMatchEulerDiscreteScheduler(**kwargs)


def transformer(family: str):
    """The real-size transformer of `family` (construct inside `building`)."""
    from diffusers import FluxTransformer2DModel, SD3Transformer2DModel, WanTransformer3DModel

    cls, cfg = {
        "sd3": (SD3Transformer2DModel, SD35_MEDIUM),
        "flux": (FluxTransformer2DModel, FLUX1_DEV),
        "wan": (WanTransformer3DModel, WAN21_1_3B),
    }[family]
    return cls(**cfg)


def pipeline(family: str, tmp: Path):
    """The real-size diffusers pipeline of `family` with random weights (construct inside `building`)."""
    import diffusers
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from flowrl.models.tiny_tokenizers import clip_tokenizer, t5_tokenizer

    parts = {"transformer": transformer(family)}
    if family == "sd3":
        tok1, tok2 = clip_tokenizer(tmp / "tok1"), clip_tokenizer(tmp / "tok2")
        parts.update(
            scheduler=_scheduler(shift=3.0),
            vae=diffusers.AutoencoderKL(**SD3_VAE),
            tokenizer=tok1,
            tokenizer_2=tok2,
            tokenizer_3=t5_tokenizer(512),
            text_encoder=_clip(CLIPTextModelWithProjection, CLIP_L, tok1),
            text_encoder_2=_clip(CLIPTextModelWithProjection, CLIP_G, tok2),
            text_encoder_3=_t5("T5EncoderModel", T5_XXL),
        )
        return diffusers.StableDiffusion3Pipeline(**parts)
    if family == "flux":
        tok1 = clip_tokenizer(tmp / "tok1")
        parts.update(
            scheduler=_scheduler(
                shift=3.0,
                use_dynamic_shifting=True,
                base_shift=0.5,
                max_shift=1.15,
                base_image_seq_len=256,
                max_image_seq_len=4096,
            ),
            vae=diffusers.AutoencoderKL(**FLUX_VAE),
            tokenizer=tok1,
            tokenizer_2=t5_tokenizer(512),
            text_encoder=_clip(CLIPTextModel, {k: v for k, v in CLIP_L.items() if k != "projection_dim"}, tok1),
            text_encoder_2=_t5("T5EncoderModel", T5_XXL),
        )
        return diffusers.FluxPipeline(**parts)
    parts.update(
        scheduler=_scheduler(shift=3.0),
        vae=diffusers.AutoencoderKLWan(**WAN_VAE),
        tokenizer=t5_tokenizer(512),
        text_encoder=_t5("UMT5EncoderModel", UMT5_XXL),
    )
    return diffusers.WanPipeline(**parts)


def count_params(family: str, tmp: Path) -> dict:
    """Parameters per component of the real pipeline, built on the meta device (no memory, seconds)."""
    with building("meta", torch.float32):
        pipe = pipeline(family, tmp)
    counts = {
        name: sum(p.numel() for p in module.parameters()) / 1e9
        for name, module in pipe.components.items()
        if isinstance(module, torch.nn.Module)
    }
    expected = EXPECTED_PARAMS_B[family]
    return {
        "params_B": {k: round(v, 4) for k, v in counts.items()},
        "transformer_params_B_expected": expected,
        "transformer_matches_costs_md": abs(counts["transformer"] - expected) < 0.0015,
    }


def real_pipeline_folder(family: str, folder: Path) -> Path:
    """A folder the loader accepts (model_index.json naming the class); install_factories makes its from_pretrained
    build the random real-size pipeline instead of reading weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": PIPELINE_CLASSES[family]}))
    FACTORIES[str(folder)] = ("pipeline", family)
    return folder


def real_clip_folder(folder: Path) -> Path:
    """A PickScore folder: the tiny processor at 224 px and the ViT-H-14 config; CLIPModel.from_pretrained of it
    builds random weights (install_factories)."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPProcessor

    from rewards._tiny import OPENAI_MEAN, OPENAI_STD, tiny_clip_tokenizer

    tokenizer = tiny_clip_tokenizer()
    images = CLIPImageProcessor(
        size={"shortest_edge": 224},
        crop_size={"height": 224, "width": 224},
        image_mean=OPENAI_MEAN,
        image_std=OPENAI_STD,
    )
    CLIPProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(folder)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    CLIPConfig(**dict(CLIP_VIT_H14, text_config={**CLIP_VIT_H14["text_config"], **ids})).save_pretrained(folder)
    FACTORIES[str(folder)] = ("clip", None)
    return folder


FACTORIES: dict[str, tuple[str, str | None]] = {}


def install_factories(device, tmp: Path):
    """Make DiffusionPipeline / CLIPModel .from_pretrained of the folders registered above build random real-size
    models on `device` (the loader's own code runs on everything else: validation, adapter, placement, LoRA). Returns
    the function that undoes it."""
    from diffusers import DiffusionPipeline
    from transformers import CLIPConfig, CLIPModel

    pipe_from, clip_from = DiffusionPipeline.from_pretrained.__func__, CLIPModel.from_pretrained.__func__

    def pipeline_from_pretrained(cls, source, *args, **kwargs):
        kind, family = FACTORIES.get(str(source), (None, None))
        if kind != "pipeline":
            return pipe_from(cls, source, *args, **kwargs)
        dtype = kwargs.get("dtype") or kwargs.get("torch_dtype") or torch.float32
        with seeded(device), building(device, dtype):
            return as_loaded(pipeline(family, tmp / family), dtype)

    def clip_from_pretrained(cls, source, *args, **kwargs):
        if FACTORIES.get(str(source), (None,))[0] != "clip":
            return clip_from(cls, source, *args, **kwargs)
        with seeded(device), building(device, kwargs.get("dtype") or torch.float32):
            return CLIPModel(CLIPConfig.from_pretrained(source))

    originals = DiffusionPipeline.__dict__["from_pretrained"], CLIPModel.__dict__.get("from_pretrained")
    DiffusionPipeline.from_pretrained = classmethod(pipeline_from_pretrained)
    CLIPModel.from_pretrained = classmethod(clip_from_pretrained)

    def restore() -> None:
        DiffusionPipeline.from_pretrained = originals[0]
        if originals[1] is None:
            del CLIPModel.from_pretrained
        else:
            CLIPModel.from_pretrained = originals[1]

    return restore


# ------------------------------------------------------------------------------------------------ reward models
# Qwen/Qwen2-VL-7B-Instruct's config.json (HPSv3's base), the published sizes in its flat layout
QWEN2_VL_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
    "max_window_layers": 28,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
                      "temporal_patch_size": 2},
}  # fmt: skip
OPEN_CLIP_ARCH = "ViT-H-14"  # HPSv2's backbone (open_clip's own config ships with the package)


def _hpsv2_checkpoint(path: Path, device) -> None:
    """HPSv2's release layout ({"state_dict": ...}) with random ViT-H-14 weights, built on `device` in float16."""
    import open_clip

    with seeded(device), building(device, torch.float16):
        model = open_clip.create_model(OPEN_CLIP_ARCH, pretrained=None, device=device)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": {k: v.half().cpu() for k, v in model.state_dict().items()}}, path)


def _hpsv3_folder(folder: Path) -> dict:
    """rewards/_tiny.py's HPSv3 folder (a byte-level tokenizer: a prompt's text takes more tokens than the release's
    BPE) with the config rewritten to Qwen2-VL-7B's sizes."""
    from rewards._tiny import tiny_hpsv3

    kwargs = tiny_hpsv3(folder, pixels=256 * 28 * 28)
    config_file = Path(kwargs["model_name"]) / "config.json"
    config = json.loads(config_file.read_text())
    config.update({k: v for k, v in QWEN2_VL_7B.items() if k != "vision_config"})
    config["vision_config"] = {**config["vision_config"], **QWEN2_VL_7B["vision_config"]}
    config_file.write_text(json.dumps(config, indent=2))
    return kwargs


def _hpsv3_state(model_name: str, device) -> dict[str, torch.Tensor]:
    """HPSv3.safetensors' keys (transformers 4.45 names, the ranknet head) at the config's size, random on `device`:
    norm weights 1, the rest Gaussian at 1/sqrt(fan-in), bfloat16 (the head float32, on the CPU)."""
    import math

    from transformers import AutoConfig, Qwen2VLForConditionalGeneration

    config = AutoConfig.from_pretrained(model_name)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen2VLForConditionalGeneration(config).state_dict().items()}
    state = {}
    with seeded(device):
        for key, shape in shapes.items():
            old = key.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1)
            if len(shape) == 1:
                value = torch.ones(shape, device=device, dtype=torch.bfloat16) * float(key.endswith(".weight"))
            else:
                scale = 1 if "embed_tokens" in key else math.prod(shape[1:]) ** -0.5
                value = torch.randn(shape, device=device, dtype=torch.bfloat16) * scale
            state[old] = value
        widths = (config.text_config.hidden_size, 1024, 16, 2)  # the head is copied into its module: on the CPU
        for index, d_in, d_out in zip((0, 3, 5), widths[:-1], widths[1:]):
            state[f"rm_head.{index}.weight"] = torch.randn(d_out, d_in) * d_in**-0.5
            state[f"rm_head.{index}.bias"] = torch.zeros(d_out)
    return state


@contextlib.contextmanager
def reward_weights(name: str, folder: Path, device, tiny: bool):
    """The kwargs that build reward `name` with random weights: rewards/_tiny.py's at tiny size; else the real
    architecture: PickScore's CLIP ViT-H-14 (install_factories builds it), HPSv2's open_clip ViT-H-14 checkpoint,
    ImageReward's BLIP ViT-L + BERT-base files (bfloat16), and HPSv3's Qwen2-VL-7B, whose 16 GB checkpoint is not
    written: while the block runs, reading the folder's checkpoint returns random tensors made on `device`."""
    from rewards._tiny import BERT_BASE, BLIP_LARGE, TINY_REWARDS, make_imagereward_files

    folder.mkdir(parents=True, exist_ok=True)
    if tiny:
        yield TINY_REWARDS[name](folder)
        return
    if name == "pickscore":
        real_clip_folder(folder)
        yield {"model_name": str(folder), "processor_name": str(folder)}
    elif name == "hpsv2":
        _hpsv2_checkpoint(folder / "HPS_v2.1_compressed.pt", device)
        yield {"model_name": OPEN_CLIP_ARCH, "checkpoint": str(folder / "HPS_v2.1_compressed.pt")}
    elif name == "imagereward":
        words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(30517)]
        yield make_imagereward_files(folder, BLIP_LARGE, BERT_BASE, words, dtype=torch.bfloat16)
    elif name == "hpsv3":
        import flowrl.rewards._hpsv3_format as fmt  # the module the registered reward reads through

        kwargs = _hpsv3_folder(folder)
        original = fmt.read_checkpoint

        def read_checkpoint(path: str):
            return _hpsv3_state(kwargs["model_name"], device) if path == kwargs["checkpoint"] else original(path)

        fmt.read_checkpoint = read_checkpoint
        try:
            yield {**kwargs, "dtype": torch.bfloat16}  # a 7B reward runs in bfloat16 (float32: 33 GB)
        finally:
            fmt.read_checkpoint = original
    else:
        raise ValueError(f"reward {name!r} has no real-size build here; choose pickscore, hpsv2, imagereward or hpsv3")
