"""ImageReward (Xu et al. 2023) on maintained transformers classes: BLIP's ViT as BlipVisionModel, BLIP's
cross-attention BERT ("med") as BlipTextModel, the official MLP head; the official `ImageReward.pt` keys are
mapped onto them. Score = (MLP(text_encoder(prompt | image)[CLS]) - 0.16717) / 1.03334, as the package does.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from typing import Any

import torch

from flowrl.hub import download_file, hub_errors, is_hub_id
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._clip_backbone import ImagePreprocess
from .aesthetic import build_aesthetic_head

REPO = "THUDM/ImageReward"
REWARD_MEAN, REWARD_STD = 0.16717362830052426, 1.0333394966054072
VISION_KEYS = [  # BLIP/timm ViT name -> transformers BlipVisionModel name
    (r"cls_token", "embeddings.class_embedding"),
    (r"pos_embed", "embeddings.position_embedding"),
    (r"patch_embed\.proj\.", "embeddings.patch_embedding."),
    (r"blocks\.(\d+)\.norm1\.", r"encoder.layers.\1.layer_norm1."),
    (r"blocks\.(\d+)\.norm2\.", r"encoder.layers.\1.layer_norm2."),
    (r"blocks\.(\d+)\.attn\.qkv\.", r"encoder.layers.\1.self_attn.qkv."),
    (r"blocks\.(\d+)\.attn\.proj\.", r"encoder.layers.\1.self_attn.projection."),
    (r"blocks\.(\d+)\.mlp\.", r"encoder.layers.\1.mlp."),
    (r"norm\.", "post_layernorm."),
]


def map_vision_key(key: str) -> str:
    for pattern, replacement in VISION_KEYS:
        new, count = re.subn(f"^{pattern}", replacement, key)
        if count:
            return new
    raise ValueError(f"imagereward: unexpected vision key {key!r} in the checkpoint; pass the official ImageReward.pt")


def _find(path: str | None, filename: str, field: str) -> str:
    """The given path; else the image-reward package's copy in ~/.cache/ImageReward, or THUDM/ImageReward's file
    through the HF cache (downloaded unless HF_HUB_OFFLINE)."""
    if path is None:
        package_copy = os.path.expanduser(f"~/.cache/ImageReward/{filename}")
        if os.path.isfile(package_copy):
            return package_copy
        return download_file(REPO, filename, f"imagereward: {field}")
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"imagereward: {field}={path!r} does not exist; pass the path of {filename}, or leave {field} unset "
            f"to use {REPO}'s"
        )
    return path


def load_imagereward(checkpoint: str, med_config: str, vision_num_heads: int | None = None):
    """-> (BlipVisionModel, BlipTextModel, MLP head, image size) in eval mode, from the official files."""
    from transformers import BlipTextConfig, BlipVisionConfig
    from transformers.models.blip.modeling_blip import BlipVisionModel
    from transformers.models.blip.modeling_blip_text import BlipTextModel

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    with open(med_config) as f:
        med = json.load(f)
    vision = {
        map_vision_key(k[len("blip.visual_encoder.") :]): v
        for k, v in state.items()
        if k.startswith("blip.visual_encoder.")
    }
    text = {
        k[len("blip.text_encoder.") :]: v
        for k, v in state.items()
        if k.startswith("blip.text_encoder.") and not k.endswith("position_ids")
    }
    head = {k[len("mlp.") :]: v for k, v in state.items() if k.startswith("mlp.")}
    if not vision or not text or not head:
        raise ValueError(
            f"imagereward: {checkpoint!r} lacks blip.visual_encoder/blip.text_encoder/mlp weights; "
            "pass the official ImageReward.pt"
        )
    width = vision["embeddings.class_embedding"].shape[-1]
    patch = vision["embeddings.patch_embedding.weight"].shape[-1]
    grid = round((vision["embeddings.position_embedding"].shape[1] - 1) ** 0.5)
    heads = vision_num_heads or width // 64  # BLIP ViT-B/L use 64-wide heads (12 / 16 heads)
    vision_config = BlipVisionConfig(
        hidden_size=width,
        intermediate_size=vision["encoder.layers.0.mlp.fc1.weight"].shape[0],
        num_attention_heads=heads,
        num_hidden_layers=1 + max(int(k.split(".")[2]) for k in vision if k.startswith("encoder.layers.")),
        image_size=grid * patch,
        patch_size=patch,
        layer_norm_eps=1e-6,
        hidden_act="gelu",
    )
    text_config = BlipTextConfig(
        vocab_size=med["vocab_size"],
        hidden_size=med["hidden_size"],
        encoder_hidden_size=width,
        intermediate_size=med["intermediate_size"],
        num_hidden_layers=med["num_hidden_layers"],
        num_attention_heads=med["num_attention_heads"],
        max_position_embeddings=med["max_position_embeddings"],
        hidden_act=med.get("hidden_act", "gelu"),
        layer_norm_eps=med.get("layer_norm_eps", 1e-12),
        pad_token_id=med.get("pad_token_id", 0),
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        is_decoder=True,
    )  # is_decoder builds the cross-attention layers; forward runs with is_decoder=False
    vision_model, text_model = BlipVisionModel(vision_config), BlipTextModel(text_config, add_pooling_layer=False)
    vision_model.load_state_dict(vision)
    text_model.load_state_dict(text)
    return vision_model.eval(), text_model.eval(), build_aesthetic_head(head).eval(), grid * patch


@REWARDS.register("imagereward")
class ImageRewardReward:
    modalities = ("image",)
    differentiable = True
    extra_requires = ("transformers",)

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        checkpoint: str | None = None,
        med_config: str | None = None,
        tokenizer: str = "bert-base-uncased",
        vision_num_heads: int | None = None,
    ):
        from transformers import BertTokenizer

        self.device, self.dtype = torch.device(device), dtype
        vision, text, head, size = load_imagereward(
            _find(checkpoint, "ImageReward.pt", "checkpoint"),
            _find(med_config, "med_config.json", "med_config"),
            vision_num_heads,
        )
        self.vision, self.text, self.head = (
            m.to(self.device, dtype).requires_grad_(False) for m in (vision, text, head)
        )
        self.preprocess = ImagePreprocess(size)  # CLIP mean/std, bicubic resize + center crop, as the package
        if not os.path.isdir(tokenizer):  # a hub id such as bert-base-uncased
            if "/" in tokenizer and not is_hub_id(tokenizer):
                raise FileNotFoundError(
                    f"imagereward: tokenizer folder {tokenizer!r} does not exist; pass a folder or a hub id"
                )
            # the vocabulary first: offline, transformers 5 returns an almost empty tokenizer instead of raising
            download_file(tokenizer, "vocab.txt", "imagereward: tokenizer")
        with (
            hub_errors(tokenizer, "imagereward: tokenizer")
            if not os.path.isdir(tokenizer)
            else contextlib.nullcontext()
        ):
            self.tokenizer = BertTokenizer.from_pretrained(tokenizer)
        # BLIP's init_tokenizer
        self.tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
        if len(self.tokenizer) != text.config.vocab_size:
            raise ValueError(
                f"imagereward: tokenizer {tokenizer!r} has {len(self.tokenizer)} tokens, med_config expects "
                f"{text.config.vocab_size}; use bert-base-uncased"
            )

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        image_embeds = self.vision(
            pixel_values=self.preprocess(images.to(self.device, self.dtype))
        ).last_hidden_state  # [N, 1+P, Dv]
        tokens = self.tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt").to(
            self.device
        )
        image_mask = torch.ones(image_embeds.shape[:2], dtype=torch.long, device=self.device)  # [N, 1+P]
        hidden = self.text(
            input_ids=tokens.input_ids,
            attention_mask=tokens.attention_mask,
            encoder_hidden_states=image_embeds,
            encoder_attention_mask=image_mask,
            is_decoder=False,
        ).last_hidden_state  # [N, 35, D]
        rewards = self.head(hidden[:, 0].float().to(self.dtype)).squeeze(-1)  # [N]
        return RewardOutput(scores=((rewards - REWARD_MEAN) / REWARD_STD).float())
