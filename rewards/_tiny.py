"""Tiny random checkpoints of the rewards, in their official file formats, built in code and saved to a folder;
the reward tests and `flowrl bench rewards` load them through each plugin's own loading code (no download).

`TINY_REWARDS[name](folder) -> kwargs` writes reward `name`'s tiny weights under `folder` and returns the config
(`REWARDS.build(name, **kwargs)`) that loads them. `remote` is absent: it needs a running server.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

OPENAI_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_STD = [0.26862954, 0.26130258, 0.27577711]
TINY_CLIP_CFG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def tiny_open_clip(
    folder: Path, seed: int = 0, with_weights: bool = True, model_cfg: dict | None = None
) -> tuple[str, dict[str, torch.Tensor]]:
    """An open_clip model folder in the hub layout (open_clip_config.json + open_clip_model.safetensors).

    model_cfg: an open_clip architecture config (default: a 1.6M-parameter CLIP); with_weights=False writes the
    config alone, which open_clip initializes randomly (how the benchmark builds real-size models cheaply)."""
    import open_clip
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "model_cfg": model_cfg or TINY_CLIP_CFG,
        "preprocess_cfg": {
            "mean": OPENAI_MEAN,
            "std": OPENAI_STD,
            "interpolation": "bicubic",
            "resize_mode": "shortest",
        },
    }
    (folder / "open_clip_config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    model = open_clip.create_model(f"local-dir:{folder}")
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if with_weights:
        save_file(state, str(folder / "open_clip_model.safetensors"))
    return str(folder), state


def tiny_clip_tokenizer():
    from transformers import CLIPTokenizer

    chars = list(string.ascii_lowercase + string.digits + ".,!?'\"-")
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    return CLIPTokenizer(vocab=vocab, merges=[])


def tiny_pickscore(folder: Path) -> dict[str, Any]:
    """transformers CLIPModel + CLIPProcessor saved with save_pretrained, as PickScore_v1 is on the hub."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer = tiny_clip_tokenizer()
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_mean=OPENAI_MEAN, image_std=OPENAI_STD
    )
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=77,
            **ids,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    return {"model_name": str(folder), "processor_name": str(folder)}


def tiny_aesthetic_head(path: Path, dims: tuple[int, ...] = (16, 32, 16, 8, 4, 1)) -> dict[str, torch.Tensor]:
    """The improved aesthetic predictor's layout: Linears at layers.0/2/4/6/7 (dropouts between), torch.save'd."""
    torch.manual_seed(1)
    indices = [0, 2, 4, 6, 7][: len(dims) - 1]
    state = {}
    for i, (d_in, d_out) in zip(indices, zip(dims[:-1], dims[1:])):
        state[f"layers.{i}.weight"] = torch.randn(d_out, d_in) / d_in**0.5
        state[f"layers.{i}.bias"] = torch.randn(d_out) * 0.1
    torch.save(state, path)
    return state


def _clipscore(folder: Path) -> dict[str, Any]:
    return {"model_name": tiny_open_clip(folder / "clip")[0], "pretrained": None}


def _hpsv2(folder: Path) -> dict[str, Any]:
    model_dir, state = tiny_open_clip(folder / "clip", seed=3, with_weights=False)
    torch.save({"epoch": 1, "state_dict": state}, folder / "HPS_v2.1_compressed.pt")  # as the HPS release stores it
    return {"model_name": model_dir, "checkpoint": str(folder / "HPS_v2.1_compressed.pt")}


def _aesthetic(folder: Path) -> dict[str, Any]:
    model_dir, _ = tiny_open_clip(folder / "clip")
    tiny_aesthetic_head(folder / "sac+logos+ava1-l14-linearMSE.pth")
    return {"model_name": model_dir, "pretrained": None, "checkpoint": str(folder / "sac+logos+ava1-l14-linearMSE.pth")}


def _temporal(folder: Path) -> dict[str, Any]:
    return {"model_name": tiny_open_clip(folder / "clip")[0], "pretrained": None}


def _ocr(folder: Path) -> dict[str, Any]:
    return {}  # the default backend (rapidocr) ships its models in its wheel: nothing to build


def _per_frame(folder: Path) -> dict[str, Any]:
    return {"reward": "clipscore", "reward_config": _clipscore(folder), "reduce": "min", "every_k_frames": 2}


VISION = {"width": 128, "depth": 2, "patch": 8, "image": 16, "heads": 2, "mlp": 256}
MED = {
    "architectures": ["BertModel"],
    "attention_probs_dropout_prob": 0.1,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 40,
    "model_type": "bert",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
    "type_vocab_size": 2,
    "vocab_size": None,
    "encoder_width": 768,
    "add_cross_attention": True,
}
BLIP_LARGE = {"width": 1024, "depth": 24, "patch": 16, "image": 224, "heads": 16, "mlp": 4096}  # ImageReward's ViT-L
BERT_BASE = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "max_position_embeddings": 512,
}
WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
] + "a an the red blue green circle square triangle photo of two three cat dog sign".split()


def _linear(state, name, d_out, d_in, generator):
    state[f"{name}.weight"] = torch.randn(d_out, d_in, generator=generator) / d_in**0.5
    state[f"{name}.bias"] = torch.randn(d_out, generator=generator) * 0.05


def _norm(state, name, d, generator):
    state[f"{name}.weight"] = 1 + 0.1 * torch.randn(d, generator=generator)
    state[f"{name}.bias"] = 0.1 * torch.randn(d, generator=generator)


def make_imagereward_files(
    folder: Path,
    vision: dict | None = None,
    med_overrides: dict | None = None,
    words: list[str] | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """ImageReward.pt (a plain state dict with the official key names), med_config.json and a BERT tokenizer.

    Defaults are tiny; `vision=BLIP_LARGE, med_overrides=BERT_BASE, words=None -> 30522 filler words` gives the
    release's sizes (random weights), which the benchmark stores in bfloat16 to halve the file.
    """
    from transformers import BertTokenizer

    vision = vision or VISION
    words = words or WORDS
    folder.mkdir(parents=True, exist_ok=True)
    BertTokenizer(vocab={w: i for i, w in enumerate(words)}).save_pretrained(folder / "tokenizer")
    med = dict(MED, **(med_overrides or {}), vocab_size=len(words) + 2)  # + [DEC], [ENC]
    (folder / "med_config.json").write_text(json.dumps(med))
    g = torch.Generator().manual_seed(0)
    s: dict[str, torch.Tensor] = {}
    w, p, grid = vision["width"], vision["patch"], vision["image"] // vision["patch"]
    v = "blip.visual_encoder"
    s[f"{v}.cls_token"] = 0.1 * torch.randn(1, 1, w, generator=g)
    s[f"{v}.pos_embed"] = 0.1 * torch.randn(1, 1 + grid * grid, w, generator=g)
    s[f"{v}.patch_embed.proj.weight"] = torch.randn(w, 3, p, p, generator=g) / (3 * p * p) ** 0.5
    s[f"{v}.patch_embed.proj.bias"] = 0.05 * torch.randn(w, generator=g)
    for i in range(vision["depth"]):
        _norm(s, f"{v}.blocks.{i}.norm1", w, g)
        _linear(s, f"{v}.blocks.{i}.attn.qkv", 3 * w, w, g)
        _linear(s, f"{v}.blocks.{i}.attn.proj", w, w, g)
        _norm(s, f"{v}.blocks.{i}.norm2", w, g)
        _linear(s, f"{v}.blocks.{i}.mlp.fc1", vision["mlp"], w, g)
        _linear(s, f"{v}.blocks.{i}.mlp.fc2", w, vision["mlp"], g)
    _norm(s, f"{v}.norm", w, g)
    t, d = "blip.text_encoder", med["hidden_size"]
    s[f"{t}.embeddings.word_embeddings.weight"] = torch.randn(med["vocab_size"], d, generator=g)
    s[f"{t}.embeddings.position_embeddings.weight"] = 0.5 * torch.randn(med["max_position_embeddings"], d, generator=g)
    # saved by older transformers
    s[f"{t}.embeddings.position_ids"] = torch.arange(med["max_position_embeddings"]).unsqueeze(0)
    _norm(s, f"{t}.embeddings.LayerNorm", d, g)
    for i in range(med["num_hidden_layers"]):
        for attn, kv_width in (("attention", d), ("crossattention", w)):
            _linear(s, f"{t}.encoder.layer.{i}.{attn}.self.query", d, d, g)
            _linear(s, f"{t}.encoder.layer.{i}.{attn}.self.key", d, kv_width, g)
            _linear(s, f"{t}.encoder.layer.{i}.{attn}.self.value", d, kv_width, g)
            _linear(s, f"{t}.encoder.layer.{i}.{attn}.output.dense", d, d, g)
            _norm(s, f"{t}.encoder.layer.{i}.{attn}.output.LayerNorm", d, g)
        _linear(s, f"{t}.encoder.layer.{i}.intermediate.dense", med["intermediate_size"], d, g)
        _linear(s, f"{t}.encoder.layer.{i}.output.dense", d, med["intermediate_size"], g)
        _norm(s, f"{t}.encoder.layer.{i}.output.LayerNorm", d, g)
    _linear(s, "blip.vision_proj", 16, w, g)  # present in the release, unused by the score
    _linear(s, "blip.text_proj", 16, d, g)
    for i, (d_out, d_in) in zip((0, 2, 4, 6, 7), ((1024, d), (128, 1024), (64, 128), (16, 64), (1, 16))):
        _linear(s, f"mlp.layers.{i}", d_out, d_in, g)
    torch.save({k: (x.to(dtype) if x.is_floating_point() else x) for k, x in s.items()}, folder / "ImageReward.pt")
    return {
        "checkpoint": str(folder / "ImageReward.pt"),
        "med_config": str(folder / "med_config.json"),
        "tokenizer": str(folder / "tokenizer"),
    }


def _artifact(folder: Path) -> dict[str, Any]:
    from flowrl.rewards.artifact import ArtifactCNN, save_artifact_classifier

    torch.manual_seed(0)
    save_artifact_classifier(ArtifactCNN(image_size=32, channels=(8, 16)), str(folder / "artifact.safetensors"))
    return {"checkpoint": str(folder / "artifact.safetensors")}


def _dino(folder: Path) -> dict[str, Any]:
    """A tiny random Dinov2Model saved as transformers saves facebook/dinov2-base, and one reference image."""
    from transformers import Dinov2Config, Dinov2Model

    from flowrl import media

    torch.manual_seed(0)
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8
    )
    Dinov2Model(config).save_pretrained(folder / "dinov2")
    reference = media.save_image(torch.linspace(0, 1, 3 * 30 * 26).view(3, 30, 26), str(folder / "reference.png"))
    return {"model": str(folder / "dinov2"), "references": [reference], "image_size": 32}


QWEN2_VL_SPECIALS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN2_VL_CHAT_TEMPLATE = (  # Qwen/Qwen2-VL-7B-Instruct's chat_template.json
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_hpsv3(folder: Path, pixels: int = 768) -> dict[str, Any]:
    """HPSv3's release layout at toy size: a Qwen2-VL base folder (a flat config.json as on the hub, a byte-level
    Qwen2 tokenizer without merges, Qwen2VLProcessor files with the real chat template; patch 4, merge 2, hidden 32)
    and HPSv3.safetensors, the reward model's state dict in transformers 4.45 names (`visual.*`, `model.*`,
    `lm_head.weight`, `rm_head.{0,3,5}.*`; backbone in bfloat16, head in float32, the embedding resized to the
    tokenizer plus <|Reward|>). Weights are Gaussian with 1/sqrt(fan-in) scale so the image moves the score."""
    from safetensors.torch import save_file
    from transformers import (
        AutoConfig,
        Qwen2Tokenizer,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    base = folder / "Qwen2-VL"
    characters = bytes_to_unicode()
    tokenizer = Qwen2Tokenizer(vocab={characters[b]: b for b in range(256)}, merges=[])  # <|endoftext|> = 256
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN2_VL_SPECIALS)})
    sizes = dict(patch_size=4, merge_size=2, temporal_patch_size=2)
    image_processor = Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels, **sizes)
    video_processor = Qwen2VLVideoProcessor(**sizes)
    processor = Qwen2VLProcessor(image_processor, tokenizer, video_processor, chat_template=QWEN2_VL_CHAT_TEMPLATE)
    processor.save_pretrained(base)
    token = dict(zip(QWEN2_VL_SPECIALS, tokenizer.convert_tokens_to_ids(list(QWEN2_VL_SPECIALS))))
    config = {  # the flat layout of Qwen/Qwen2-VL-7B-Instruct's config.json (transformers 4.45)
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "vocab_size": len(tokenizer) + 8,  # padded beyond the tokenizer, as the release's 152064
        "bos_token_id": tokenizer.pad_token_id,
        "eos_token_id": token["<|im_end|>"],
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "sliding_window": 4096,
        "max_window_layers": 2,
        "vision_start_token_id": token["<|vision_start|>"],
        "vision_end_token_id": token["<|vision_end|>"],
        "vision_token_id": token["<|vision_pad|>"],
        "image_token_id": token["<|image_pad|>"],
        "video_token_id": token["<|video_pad|>"],
        "vision_config": {
            "depth": 2,
            "embed_dim": 32,
            "mlp_ratio": 2,
            "num_heads": 2,
            "in_chans": 3,
            "hidden_size": 32,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "spatial_patch_size": 4,
            "temporal_patch_size": 2,
        },
        "transformers_version": "4.41.2",
    }
    (base / "config.json").write_text(json.dumps(config, indent=2))
    model_config = AutoConfig.from_pretrained(base)
    model_config.text_config.vocab_size = len(tokenizer) + 1  # resized to the tokenizer with <|Reward|> added
    with torch.device("meta"):
        names = Qwen2VLForConditionalGeneration(model_config).state_dict()
    g = torch.Generator().manual_seed(0)
    state = {}
    for key, meta in names.items():
        shape = tuple(meta.shape)
        if len(shape) == 1:  # norm weights near 1, biases near 0
            value = float(key.endswith(".weight")) + 0.1 * torch.randn(shape, generator=g)
        else:  # embeddings unit Gaussian, the rest 1/sqrt(fan-in)
            value = torch.randn(shape, generator=g) / (1 if "embed_tokens" in key else math.prod(shape[1:])) ** 0.5
        old = key.replace("model.visual.", "visual.", 1).replace("model.language_model.", "model.", 1)  # 4.45 names
        state[old] = value.to(torch.bfloat16)
    widths = (config["hidden_size"], 1024, 16, 2)  # the release head's widths on the toy hidden size
    for index, d_in, d_out in zip((0, 3, 5), widths[:-1], widths[1:]):
        state[f"rm_head.{index}.weight"] = torch.randn(d_out, d_in, generator=g) / d_in**0.5
        state[f"rm_head.{index}.bias"] = 0.1 * torch.randn(d_out, generator=g)
    save_file(state, str(folder / "HPSv3.safetensors"))
    return {
        "model_name": str(base),
        "checkpoint": str(folder / "HPSv3.safetensors"),
        "min_pixels": pixels,
        "max_pixels": pixels,
    }


def tiny_geneval(folder: Path, detect: bool = False, num_labels: int = 80) -> dict:
    """A tiny Mask2Former COCO-instance checkpoint (`model.*` and `class_predictor.*`, as the hub's
    Mask2FormerForUniversalSegmentation files hold them) and a tiny CLIP folder. detect=True biases the class head
    so that each of its 8 queries is nearly sure of a dog, a cat, a cup or no object; otherwise nothing passes
    GenEval's thresholds."""
    from safetensors.torch import save_file
    from transformers import Mask2FormerConfig, Mask2FormerModel, SwinConfig

    from . import _geneval_rules

    layers = dict(depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1])
    backbone = SwinConfig(image_size=64, patch_size=4, embed_dim=16, window_size=4, **layers)
    backbone.out_features = ["stage1", "stage2", "stage3", "stage4"]
    sizes = dict(hidden_dim=32, mask_feature_size=32, feature_size=32, encoder_feedforward_dim=32, dim_feedforward=32)
    config = Mask2FormerConfig(
        backbone_config=backbone,
        num_queries=8,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        id2label=dict(enumerate(_geneval_rules.OBJECT_NAMES[:num_labels])),
        label2id={name: i for i, name in enumerate(_geneval_rules.OBJECT_NAMES[:num_labels])},
        architectures=["Mask2FormerForUniversalSegmentation"],
        **sizes,
    )
    torch.manual_seed(0)
    state = {f"model.{k}": v.contiguous() for k, v in Mask2FormerModel(config).state_dict().items()}
    generator = torch.Generator().manual_seed(1)
    weight, bias = 0.02 * torch.randn(num_labels + 1, 32, generator=generator), torch.zeros(num_labels + 1)
    if detect:
        weight, bias = torch.zeros(81, 32), torch.full((81,), -10.0)
        for label in [_geneval_rules.OBJECT_NAMES.index(name) for name in ("dog", "cat", "cup")] + [80]:
            weight[label], bias[label] = 3 * torch.randn(32, generator=generator), 0.0
    state["class_predictor.weight"], state["class_predictor.bias"] = weight, bias
    (folder / "detector").mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder / "detector")
    save_file(state, str(folder / "detector" / "model.safetensors"))
    tiny_pickscore(folder / "clip")
    return {"detector_model": str(folder / "detector"), "clip_model": str(folder / "clip"), "short_side": 36}


TINY_REWARDS: dict[str, Callable[[Path], dict[str, Any]]] = {
    "jpeg_compressibility": lambda folder: {},
    "jpeg_incompressibility": lambda folder: {},
    "clipscore": _clipscore,
    "hpsv2": _hpsv2,
    "aesthetic": _aesthetic,
    "pickscore": tiny_pickscore,
    "ocr": _ocr,
    "per_frame": _per_frame,
    "temporal_consistency": _temporal,
    "image_consistency": _temporal,  # the same tiny open_clip folder
    "artifact": _artifact,
    "imagereward": make_imagereward_files,
    "dino_similarity": _dino,
    "hpsv3": tiny_hpsv3,
    "geneval": tiny_geneval,
}
