"""Tiny random pipelines of every family, built offline from configs (the fixture of tests and benchmarks).

Each builder creates the real diffusers/transformers classes with a few hundred kilobytes of random
weights and tokenizers made in code (no download), and `save_pretrained`s the whole pipeline, so that
`load_flow_model(folder)` reads it exactly like a hub checkpoint. Components are put in eval mode.

    python -m flowrl.models.tiny sd3 /tmp/tiny-sd3
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from flowrl.models.tiny_ltx2 import build_ltx2
from flowrl.models.tiny_qwen import build_qwen_image, build_qwen_image_edit
from flowrl.models.tiny_tokenizers import (
    QWEN3_CHAT_TEMPLATE,
    clip_tokenizer,
    gemma_tokenizer,
    qwen2_tokenizer,
    t5_tokenizer,
)

# the families the shared model tests run on; those conditioned on a source image per sample (qwen_image_edit,
# qwen_image_edit_plus, wan_i2v) and the joint video + audio one (ltx2) have tests of their own
FAMILIES = (
    "sd3",
    "flux",
    "sana",
    "wan",
    "wan22_a14b",
    "wan22_ti2v",
    "qwen_image",
    "flux2_klein",
    "flux2_dev",
    "z_image",
)


def _clip_text_config():
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=514,
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=77,
        projection_dim=32,
        bos_token_id=512,
        eos_token_id=513,
        pad_token_id=513,
        hidden_act="gelu",
    )


def _t5_config(d_model: int, umt5: bool = False):
    from transformers import T5Config, UMT5Config

    cls = UMT5Config if umt5 else T5Config
    return cls(
        vocab_size=len(t5_tokenizer()),
        d_model=d_model,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )


def _tiny_autoencoder_kl():
    """The 4-channel, 2x-downsampling AutoencoderKL of the tiny SD3 and FLUX pipelines."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(4, 8),
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=1,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )


def build_sd3(folder: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,
        caption_projection_dim=32,
        pooled_projection_dim=64,
        pos_embed_max_size=32,
    )
    text_encoder = CLIPTextModelWithProjection(_clip_text_config())
    text_encoder_2 = CLIPTextModelWithProjection(_clip_text_config())
    text_encoder_3 = T5EncoderModel(_t5_config(64))
    vae = _tiny_autoencoder_kl()
    tmp = Path(tempfile.mkdtemp())
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer(tmp / "t1"),
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer(tmp / "t2"),
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer(),
    )
    pipe.save_pretrained(folder)
    return folder


def build_flux(folder: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=True,
        axes_dims_rope=[4, 4, 8],
    )
    vae = _tiny_autoencoder_kl()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    tmp = Path(tempfile.mkdtemp())
    pipe = FluxPipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=CLIPTextModel(_clip_text_config()),
        tokenizer=clip_tokenizer(tmp / "t1"),
        text_encoder_2=T5EncoderModel(_t5_config(32)),
        tokenizer_2=t5_tokenizer(),
    )
    pipe.save_pretrained(folder)
    return folder


def build_sana(folder: Path) -> Path:
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(0)
    transformer = SanaTransformer2DModel(
        patch_size=1,
        in_channels=4,
        out_channels=4,
        num_layers=1,
        num_attention_heads=2,
        attention_head_dim=4,
        num_cross_attention_heads=2,
        cross_attention_head_dim=4,
        cross_attention_dim=8,
        caption_channels=8,
        sample_size=32,
    )
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=[1, 1],
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
        scaling_factor=0.41407,
    )
    tokenizer = gemma_tokenizer()
    text_encoder = Gemma2Model(
        Gemma2Config(
            head_dim=16,
            hidden_size=8,
            initializer_range=0.02,
            intermediate_size=64,
            max_position_embeddings=8192,
            model_type="gemma2",
            num_attention_heads=2,
            num_hidden_layers=1,
            num_key_value_heads=2,
            vocab_size=len(tokenizer),
            attention_bias=False,
            rms_norm_eps=1e-6,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=1,
        )
    )
    # SANA ships a multistep solver; flowrl's samplers (and the parity tests) step with the flow-matching Euler
    # scheduler at the same flow shift, which is what we save here.
    pipe = SanaPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )
    pipe.save_pretrained(folder)
    return folder


def _tiny_wan_transformer():
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=16,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )


def build_wan(folder: Path, two_experts: bool = False, expand_timesteps: bool = False) -> Path:
    """Wan 2.1 T2V; `two_experts`: Wan 2.2 A14B's layout (a low-noise `transformer_2` below boundary_ratio 0.7, so
    that a few steps use both); `expand_timesteps`: Wan 2.2 TI2V-5B's per-token timesteps."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5EncoderModel

    torch.manual_seed(0)
    transformer = _tiny_wan_transformer()
    experts = {"transformer_2": _tiny_wan_transformer(), "boundary_ratio": 0.7} if two_experts else {}
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    pipe = WanPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        vae=vae,
        text_encoder=UMT5EncoderModel(_t5_config(32, umt5=True)),
        tokenizer=t5_tokenizer(),
        expand_timesteps=expand_timesteps,
        **experts,
    )
    pipe.save_pretrained(folder)
    return folder


def build_wan_i2v(folder: Path) -> Path:
    """Wan 2.1 image-to-video (WanImageToVideoPipeline): the Wan 2.1 parts, a transformer over 16 noise + 4 mask + 16
    condition channels with an image embedding, and a 1-layer CLIP vision encoder (65 tokens of a 32x32 crop)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanImageToVideoPipeline,
        WanTransformer3DModel,
    )
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, UMT5EncoderModel

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=36,
        out_channels=16,
        text_dim=32,
        freq_dim=256,
        ffn_dim=32,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
        image_dim=8,
        added_kv_proj_dim=24,
    )
    vae = AutoencoderKLWan(
        base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True]
    )
    image_encoder = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=4
        )
    )
    pipe = WanImageToVideoPipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        vae=vae,
        text_encoder=UMT5EncoderModel(_t5_config(32, umt5=True)),
        tokenizer=t5_tokenizer(),
        image_encoder=image_encoder,
        image_processor=CLIPImageProcessor(crop_size=32, size=32),
    )
    pipe.save_pretrained(folder)
    return folder


def _tiny_flux2_parts(guidance_embeds: bool):
    """The tiny FLUX.2 VAE (batch-norm statistics away from (0, 1), so decoding exercises them) and transformer."""
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel

    vae = AutoencoderKLFlux2(
        block_out_channels=(4, 8),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=1,
        sample_size=32,
        mid_block_add_attention=False,
    )
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.linspace(-0.3, 0.3, vae.bn.num_features))
        vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, vae.bn.num_features))
    transformer = Flux2Transformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=48,  # three stacked text-encoder layers of 16
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=guidance_embeds,
    )
    return vae, transformer


def build_flux2_dev(folder: Path) -> Path:
    """FLUX.2 [dev]: Mistral-3 (31 layers: the pipeline stacks hidden states 10, 20, 30) behind a Pixtral processor
    whose chat template reads the pipeline's multimodal message lists; the transformer has a guidance embedding."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessor, PixtralProcessor

    torch.manual_seed(0)
    tokenizer = qwen2_tokenizer(max_length=512)
    tokenizer.add_special_tokens(
        {"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]}
    )
    template = (
        "{% for m in messages %}[{{ m['role'] }}]{% for c in m['content'] %}"
        "{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
    )
    processor = PixtralProcessor(
        image_processor=PixtralImageProcessor(), tokenizer=tokenizer, chat_template=template, patch_size=16
    )
    pad, eos, image = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "[IMG]"])
    text = {"vocab_size": len(tokenizer), "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 31}
    text_encoder = Mistral3ForConditionalGeneration(
        Mistral3Config(
            text_config={
                **text,
                "model_type": "mistral",
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 8,
                "max_position_embeddings": 1024,
                "pad_token_id": pad,
                "bos_token_id": pad,
                "eos_token_id": eos,
            },
            vision_config={
                "model_type": "pixtral",
                "hidden_size": 16,
                "intermediate_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "head_dim": 8,
                "image_size": 32,
                "patch_size": 16,
            },
            image_token_index=image,
            spatial_merge_size=1,
        )
    )
    vae, transformer = _tiny_flux2_parts(guidance_embeds=True)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
    pipe = Flux2Pipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=processor, transformer=transformer
    )
    pipe.save_pretrained(folder)
    return folder


def _tiny_qwen3_text(model_class, num_hidden_layers: int):
    """(tokenizer, text encoder): the character-level tokenizer with Qwen3's chat template and a 16-wide Qwen3
    `model_class` (Qwen3Model or Qwen3ForCausalLM) of `num_hidden_layers` layers, from the global RNG."""
    from transformers import Qwen3Config

    tokenizer = qwen2_tokenizer(max_length=512)
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    pad, eos = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
    )
    return tokenizer, model_class(config)


def build_flux2_klein(folder: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    tokenizer, text_encoder = _tiny_qwen3_text(Qwen3ForCausalLM, 28)  # the pipeline stacks hidden states 9, 18 and 27
    vae, transformer = _tiny_flux2_parts(guidance_embeds=False)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")
    pipe = Flux2KleinPipeline(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer
    )
    pipe.save_pretrained(folder)
    return folder


def build_z_image(folder: Path) -> Path:
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Model

    torch.manual_seed(0)
    tokenizer, text_encoder = _tiny_qwen3_text(Qwen3Model, 2)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=1,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,
        axes_dims=[4, 6, 6],
        axes_lens=[1024, 64, 64],
    )
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # Z-Image-Turbo's static shift
        vae=_tiny_autoencoder_kl(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    pipe.save_pretrained(folder)
    return folder


BUILDERS = {
    "sd3": build_sd3,
    "flux": build_flux,
    "sana": build_sana,
    "wan": build_wan,
    "wan22_a14b": lambda folder: build_wan(folder, two_experts=True),
    "wan22_ti2v": lambda folder: build_wan(folder, expand_timesteps=True),
    "qwen_image": build_qwen_image,
    "qwen_image_edit": build_qwen_image_edit,
    "qwen_image_edit_plus": lambda folder: build_qwen_image_edit(folder, plus=True),
    "wan_i2v": build_wan_i2v,
    "flux2_klein": build_flux2_klein,
    "flux2_dev": build_flux2_dev,
    "z_image": build_z_image,
    "ltx2": build_ltx2,
}

# A size each tiny family runs at (height, width, num_frames) — divisible by its latent factors.
TINY_SIZES = {
    "sd3": (32, 32, None),
    "flux": (32, 32, None),
    "sana": (32, 32, None),
    "wan": (16, 16, 5),
    "wan22_a14b": (16, 16, 5),
    "wan22_ti2v": (16, 16, 5),
    "qwen_image": (32, 32, None),
    "qwen_image_edit": (32, 32, None),
    "qwen_image_edit_plus": (32, 32, None),
    "wan_i2v": (16, 16, 5),
    "flux2_klein": (32, 32, None),
    "flux2_dev": (32, 32, None),
    "z_image": (32, 32, None),
    "ltx2": (32, 32, 5),  # the pipeline needs multiples of 32; 5 frames: 3 latent frames, 5 audio latent frames
}


def build_tiny_pipeline(family: str, folder: str | Path) -> Path:
    """Build the tiny random pipeline of `family` and save it to `folder` (created). Returns the folder."""
    if family not in BUILDERS:
        raise ValueError(f"family={family!r} has no tiny pipeline; choose one of {', '.join(BUILDERS)}")
    folder = Path(folder)
    if (folder / "model_index.json").exists():
        return folder
    return BUILDERS[family](folder)


if __name__ == "__main__":
    build_tiny_pipeline(sys.argv[1], sys.argv[2])
    print(sys.argv[2])
