"""Tiny random Qwen-Image pipelines (text-to-image and the two edit pipelines), built offline for flowrl.models.tiny.

Qwen2.5-VL from a config, the byte-level Qwen2 tokenizer of tiny_tokenizers.py (with the vision tokens for the edit
pipelines, whose prompts hold the source image), and the Qwen-Image VAE, transformer and scheduler at tiny sizes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flowrl.models.tiny_tokenizers import qwen2_tokenizer


def _tiny_qwen_vl(tokenizer, vision_tokens: bool = False):
    """A 2-layer Qwen2.5-VL (1-block vision tower); `vision_tokens`: its image / video / vision-start ids are the
    tokenizer's (the edit pipelines put images in the prompt)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    pad, eos = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    names = ("image_token_id", "video_token_id", "vision_start_token_id")
    ids = dict(zip(names, tokenizer.convert_tokens_to_ids(list(VL_TOKENS)))) if vision_tokens else {}
    text = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2}
    return Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config={
                **text,
                "num_key_value_heads": 2,
                "vocab_size": len(tokenizer),
                "max_position_embeddings": 2048,
                "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2], "rope_type": "default"},
                "bos_token_id": pad,
                "eos_token_id": eos,
                "pad_token_id": pad,
            },
            vision_config={
                "depth": 1,
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_heads": 2,
                "out_hidden_size": 16,
            },
            vocab_size=len(tokenizer),
            bos_token_id=pad,
            eos_token_id=eos,
            pad_token_id=pad,
            **ids,
        )
    )


# Qwen2.5-VL's image tokens, in the order of its config's image / video / vision-start ids
VL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>")


def _tiny_qwen_image_parts():
    """The tiny Qwen-Image VAE, transformer and scheduler (shared by Qwen-Image and its edit pipelines)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel

    # 4-channel video VAE, 4x down (two stages); the transformer packs 2x2 of its latents per token
    vae = AutoencoderKLQwenImage(
        base_dim=4,
        z_dim=4,
        dim_mult=[1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0],
        latents_std=[1.5, 0.8, 1.2, 2.0],
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's scheduler settings
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    return vae, transformer, scheduler


def build_qwen_image(folder: Path) -> Path:
    from diffusers import QwenImagePipeline

    torch.manual_seed(0)
    tokenizer = qwen2_tokenizer()
    text_encoder = _tiny_qwen_vl(tokenizer)
    vae, transformer, scheduler = _tiny_qwen_image_parts()
    pipe = QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(folder)
    return folder


def build_qwen_image_edit(folder: Path, plus: bool = False) -> Path:
    """Qwen-Image-Edit (`plus`: Edit Plus, 2509): the Qwen-Image parts, and a Qwen2-VL processor whose image
    processor sizes every image to 56x56 (2x2 merged patches of 14: 4 image tokens in the prompt)."""
    from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    torch.manual_seed(0)
    tokenizer = qwen2_tokenizer()
    tokenizer.add_tokens([*VL_TOKENS, "<|vision_end|>"], special_tokens=True)
    text_encoder = _tiny_qwen_vl(tokenizer, vision_tokens=True)
    image_processor = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=56 * 56)
    processor = Qwen2VLProcessor(
        image_processor=image_processor, tokenizer=tokenizer, video_processor=Qwen2VLVideoProcessor()
    )
    vae, transformer, scheduler = _tiny_qwen_image_parts()
    cls = QwenImageEditPlusPipeline if plus else QwenImageEditPipeline
    pipe = cls(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        processor=processor,
        transformer=transformer,
    )
    pipe.save_pretrained(folder)
    return folder
