"""The real architectures as data: each family's published transformer config, its VAE, its text encoders and its
token geometry, and functions that build them on the meta device (no memory, seconds on a CPU).

A family is found from a run config's `model.path` with `family_of(path)` (each `Arch.matches` reads the hub id or
folder name). `build_transformer(key)`, `build_vae(key)` and `build_reward_backbone(name)` construct the diffusers /
transformers modules under `torch.device("meta")`; `transformer_inputs(key, ...)` gives meta tensors of the real
shapes for one forward (batch 1, no CFG), which is what `flowrl.bench.cost` counts FLOPs on.

Sources: each transformer config is its `transformer/config.json` on the Hugging Face hub (the comment above each
names where the values were read: the diffusers class defaults, diffusers' conversion scripts, or copies of the
hub file); no weights are read and nothing downloads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# ---------------------------------------------------------------------------------------------------------------------
# transformer configs (each model's transformer/config.json)

# stabilityai/stable-diffusion-3.5-medium transformer/config.json
SD35_MEDIUM = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=24,
    attention_head_dim=64,
    num_attention_heads=24,
    joint_attention_dim=4096,
    caption_projection_dim=1536,
    pooled_projection_dim=2048,
    pos_embed_max_size=384,
    dual_attention_layers=tuple(range(13)),
    qk_norm="rms_norm",
)
# stabilityai/stable-diffusion-3.5-large transformer/config.json (38 heads x 64 = 2432; no dual attention layers)
SD35_LARGE = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=38,
    attention_head_dim=64,
    num_attention_heads=38,
    joint_attention_dim=4096,
    caption_projection_dim=2432,
    pooled_projection_dim=2048,
    pos_embed_max_size=192,
    dual_attention_layers=(),
    qk_norm="rms_norm",
)
# black-forest-labs/FLUX.1-dev transformer/config.json
FLUX1_DEV = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# black-forest-labs/FLUX.2-dev transformer/config.json: the Flux2Transformer2DModel defaults of diffusers (8 double +
# 48 single blocks, 48 heads x 128 = 6144, Mistral-Small-3.1 text: 3 layers x 5120 = 15360, guidance embedding)
FLUX2_DEV = dict(
    patch_size=1,
    in_channels=128,
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=True,
)
# black-forest-labs/FLUX.2-klein-base-9B (and -9B) transformer/config.json: BFL's Klein9BParams (flux2 model.py) in
# diffusers names; Qwen3-8B text: 3 layers x 4096 = 12288; no guidance embedding
FLUX2_KLEIN_9B = dict(FLUX2_DEV, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288,
                      guidance_embeds=False)  # fmt: skip
# black-forest-labs/FLUX.2-klein-4B transformer/config.json (BFL's Klein4BParams; Qwen3-4B text: 3 x 2560 = 7680)
FLUX2_KLEIN_4B = dict(FLUX2_DEV, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680,
                      guidance_embeds=False)  # fmt: skip
# Efficient-Large-Model/Sana_1600M_1024px_diffusers transformer/config.json (SanaMS_1600M_P1_D20 in diffusers'
# scripts/convert_sana_to_diffusers.py: 20 layers, 70 linear-attention heads x 32 = 2240, 20 cross heads x 112,
# Gemma-2-2B captions 2304, DC-AE f32c32 latents)
SANA_1600M = dict(
    in_channels=32,
    out_channels=32,
    num_attention_heads=70,
    attention_head_dim=32,
    num_layers=20,
    num_cross_attention_heads=20,
    cross_attention_head_dim=112,
    cross_attention_dim=2240,
    caption_channels=2304,
    mlp_ratio=2.5,
    dropout=0.0,
    attention_bias=False,
    sample_size=32,
    patch_size=1,
    norm_elementwise_affine=False,
    norm_eps=1e-6,
)
# Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer/config.json
WAN21_1_3B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=12,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=8960,
    num_layers=30,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
# Wan-AI/Wan2.1-T2V-14B-Diffusers transformer/config.json (the WanTransformer3DModel defaults of diffusers); each of
# Wan2.2-T2V-A14B's two experts (transformer/, transformer_2/) has the same config (I2V-A14B: in_channels 36)
WAN_14B = dict(WAN21_1_3B, num_attention_heads=40, ffn_dim=13824, num_layers=40)
# Wan-AI/Wan2.2-TI2V-5B-Diffusers transformer/config.json (24 heads x 128 = 3072, 48 latent channels)
WAN22_TI2V_5B = dict(WAN21_1_3B, num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48)
# Qwen/Qwen-Image transformer/config.json (the QwenImageTransformer2DModel defaults of diffusers: 60 double-stream
# layers, 24 heads x 128 = 3072, Qwen2.5-VL-7B captions 3584)
QWEN_IMAGE = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    guidance_embeds=False,
    axes_dims_rope=(16, 56, 56),
)
# Tongyi-MAI/Z-Image-Turbo transformer/config.json (single-stream S3-DiT: 30 layers + 2 noise + 2 context refiners,
# 30 heads x 128 = 3840, Qwen3-4B captions 2560)
Z_IMAGE = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=2560,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[32, 48, 48],
    axes_lens=[1536, 512, 512],
)
# Lightricks/LTX-2 transformer/config.json as diffusers' scripts/convert_ltx2_to_diffusers.py writes it (48 layers;
# video 32 heads x 128 = 4096, audio 32 heads x 64 = 2048; Gemma-3 captions 3840 through the text connectors)
LTX2 = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    num_layers=48,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=3840,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_offset=1,
    timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000,
    rope_type="split",
)
LTX2_AUDIO_LATENTS_PER_SECOND = 16000 / 160 / 4  # sampling rate / mel hop / audio VAE temporal factor (the pipeline's)
LTX2_FPS = 24.0  # the pipeline's default frame rate

# ---------------------------------------------------------------------------------------------------------------------
# text encoders (transformers configs; token ids come from the tokenizer at build time)

CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")  # fmt: skip
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")  # fmt: skip
T5_XXL = dict(vocab_size=32128, d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64,
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32, relative_attention_max_distance=128)  # fmt: skip
UMT5_XXL = dict(T5_XXL, vocab_size=256384)

# ---------------------------------------------------------------------------------------------------------------------
# VAEs (each model's vae/config.json)

SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
               down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2,
               norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False,
               use_post_quant_conv=False)  # fmt: skip
FLUX_VAE = dict(SD3_VAE, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1 and Z-Image
# black-forest-labs/FLUX.2-dev vae/config.json: the AutoencoderKLFlux2 defaults (32 latent channels, 2x2 patchified
# to the transformer's 128)
FLUX2_VAE: dict = {}
WAN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json (the Wan2.2 VAE: 16x spatial, 48 latent channels)
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
                 scale_factor_spatial=16, scale_factor_temporal=4)  # fmt: skip
# Qwen/Qwen-Image vae/config.json (the AutoencoderKLQwenImage defaults)
QWEN_VAE: dict = {}
# Efficient-Large-Model/Sana_1600M_1024px_diffusers vae/config.json (DC-AE f32c32, SANA 1.0)
SANA_DC_AE = dict(
    in_channels=3,
    latent_channels=32,
    attention_head_dim=32,
    encoder_block_types=("ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock", "EfficientViTBlock"),
    decoder_block_types=("ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock", "EfficientViTBlock"),
    encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    encoder_layers_per_block=(2, 2, 2, 3, 3, 3),
    decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
    encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
    decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
    upsample_block_type="interpolate",
    downsample_block_type="Conv",
    decoder_norm_types="rms_norm",
    decoder_act_fns="silu",
    scaling_factor=0.41407,
)
# Lightricks/LTX-2 vae/config.json as diffusers' scripts/convert_ltx2_to_diffusers.py writes it (32x spatial, 8x time)
LTX2_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=128,
    block_out_channels=(256, 512, 1024, 2048),
    decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 6, 6, 2, 2),
    decoder_layers_per_block=(5, 5, 5, 5),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    encoder_causal=True,
    decoder_causal=False,
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)

# ---------------------------------------------------------------------------------------------------------------------
# reward backbones

# PickScore_v1 / HPSv2: CLIP ViT-H-14 (laion/CLIP-ViT-H-14-laion2B-s32B-b79K; transformers CLIPModel)
CLIP_VIT_H14 = dict(
    text_config=dict(vocab_size=49408, hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                     num_attention_heads=16, max_position_embeddings=77, hidden_act="gelu"),
    vision_config=dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                       image_size=224, patch_size=14, hidden_act="gelu"),
    projection_dim=1024,
)  # fmt: skip
# aesthetic / CLIPScore / image_consistency: CLIP ViT-L/14 (openai/clip-vit-large-patch14 config.json)
CLIP_VIT_L14 = dict(
    text_config=dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                     num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu"),
    vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                       image_size=224, patch_size=14, hidden_act="quick_gelu"),
    projection_dim=768,
)  # fmt: skip
# ImageReward: BLIP with vit="large" at 224 px (ViT-L/16) and the BERT-base text encoder of its med_config.json with
# cross-attention to the image (encoder_width 1024), prompts cut at 35 tokens (THUDM/ImageReward ImageReward.py)
BLIP_VIT_L = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16, image_size=224,
                  patch_size=16)  # fmt: skip
BLIP_TEXT = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 encoder_hidden_size=1024, max_position_embeddings=512)  # fmt: skip
IMAGEREWARD_TEXT_TOKENS = 35
# temporal consistency's default CLIP (open_clip ViT-B-32)
OPEN_CLIP_VIT_B32 = {
    "embed_dim": 512,
    "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
}


# ---------------------------------------------------------------------------------------------------------------------
# families


@dataclass(frozen=True)
class TextEncoder:
    """One text encoder of a pipeline: its parameters (billions, all of them: what is resident), the parameters a
    token passes through (`token_params_b`: its layers' weights, not the embedding table, which is a lookup, nor an LM
    head, since the pipelines read hidden states) and its tokens per prompt. `fixed` encoders always run at `tokens`
    (CLIP's 77); the others run at the pipeline's max_sequence_length."""

    name: str
    params_b: float
    token_params_b: float
    tokens: int
    fixed: bool = False
    source: str = ""


CLIP_L_TEXT = TextEncoder("CLIP-L", 0.1237, 0.0856, 77, fixed=True, source="counted on meta (CLIP_L with projection)")
CLIP_G_TEXT = TextEncoder("CLIP-G", 0.6947, 0.6313, 77, fixed=True, source="counted on meta (CLIP_G with projection)")


def _t5(tokens: int) -> TextEncoder:
    return TextEncoder("T5-XXL", 4.7623, 4.6307, tokens, source="counted on meta (T5_XXL encoder)")


def _umt5(tokens: int) -> TextEncoder:
    return TextEncoder("UMT5-XXL", 5.6809, 4.6308, tokens, source="counted on meta (UMT5_XXL encoder)")


@dataclass(frozen=True)
class VAE:
    """A family's VAE: the diffusers class, its config, and its spatial / temporal compression (pixels per latent)."""

    cls: str
    config: dict
    spatial: int
    temporal: int | None = None
    latent_channels: int = 16
    source: str = ""


@dataclass(frozen=True)
class Arch:
    """One model family at its published size.

    `patch` is the latent pixels per token side (a token covers vae.spatial * patch image pixels per side): the
    transformer's patch size, or the 2x2 packing of FLUX.1 / Qwen-Image latents and FLUX.2's VAE; `text_tokens` the default number of text tokens the transformer sees (SD3: 77 CLIP + 256 T5); `true_cfg`
    False for guidance-distilled models (one forward per step); `experts` the transformers resident (Wan2.2-A14B: two,
    one runs per forward); `image_streams` how many images' tokens ride in the sequence (Qwen-Image-Edit: the target
    and its source)."""

    key: str
    transformer_cls: str
    transformer: dict
    vae: VAE
    text_encoders: tuple[TextEncoder, ...]
    patch: int
    text_tokens: int
    true_cfg: bool = True
    video: bool = False
    experts: int = 1
    image_streams: int = 1
    default_size: tuple[int, int, int | None] = (1024, 1024, None)  # height, width, frames
    include: tuple[tuple[str, ...], ...] = ()  # model.path matches when it contains every string of one tuple
    exclude: tuple[str, ...] = ()  # ... and none of these
    source: str = ""
    notes: str = field(default="", compare=False)

    @property
    def px_per_token(self) -> int:
        return self.vae.spatial * self.patch

    @property
    def fixed_text_tokens(self) -> int:
        """Text tokens from encoders whose length never changes (SD3's 77 CLIP tokens)."""
        return 77 if self.transformer_cls == "SD3Transformer2DModel" else 0

    def matches(self, model_path: str) -> bool:
        """Whether a config's `model.path` (a hub id or a local folder named after it) is this family."""
        path = str(model_path).lower().replace("_", "-")
        if any(x in path for x in self.exclude):
            return False
        return any(all(x in path for x in pattern) for pattern in self.include)

    def latent_frames(self, num_frames: int | None) -> int:
        """Latent frames of a clip of `num_frames` (1 for images): (frames - 1) / temporal factor + 1."""
        if not self.video or not num_frames:
            return 1
        return (int(num_frames) - 1) // self.vae.temporal + 1

    def image_tokens(self, height: int, width: int, num_frames: int | None = None) -> int:
        """Image (video) tokens of one sample through the transformer."""
        p = self.px_per_token
        return (int(height) // p) * (int(width) // p) * self.latent_frames(num_frames) * self.image_streams

    def audio_tokens(self, num_frames: int | None) -> int:
        """LTX-2's audio tokens: the clip's seconds x audio latents per second (the pipeline's rounding)."""
        if self.transformer_cls != "LTX2VideoTransformer3DModel":
            return 0
        return round((num_frames or 1) / LTX2_FPS * LTX2_AUDIO_LATENTS_PER_SECOND)


_SD3_TEXT = (CLIP_L_TEXT, CLIP_G_TEXT, _t5(256))
_SD3_VAE = VAE("AutoencoderKL", SD3_VAE, 8, source="stabilityai/stable-diffusion-3.5-medium vae/config.json")
_FLUX_VAE = VAE("AutoencoderKL", FLUX_VAE, 8, source="black-forest-labs/FLUX.1-dev vae/config.json")
_FLUX2_VAE = VAE("AutoencoderKLFlux2", FLUX2_VAE, 8, latent_channels=32, source="FLUX.2-dev vae/config.json")
_WAN_VAE = VAE("AutoencoderKLWan", WAN_VAE, 8, 4, source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json")
_WAN22_VAE = VAE("AutoencoderKLWan", WAN22_VAE, 16, 4, latent_channels=48, source="Wan2.2-TI2V-5B vae/config.json")
_QWEN_VAE = VAE("AutoencoderKLQwenImage", QWEN_VAE, 8, source="Qwen/Qwen-Image vae/config.json")
_SANA_VAE = VAE("AutoencoderDC", SANA_DC_AE, 32, latent_channels=32, source="mit-han-lab dc-ae-f32c32-sana-1.0")
_LTX2_VAE = VAE("AutoencoderKLLTX2Video", LTX2_VAE, 32, 8, latent_channels=128, source="Lightricks/LTX-2 vae")

# LLM text encoders: all parameters and the non-embedding ones, from the model cards (where a card gives no
# non-embedding count: its total less the vision tower and hidden size x vocabulary per embedding / LM head matrix)
MISTRAL_SMALL_31 = TextEncoder("Mistral-Small-3.1-24B", 24.0, 22.2, 512, source="model card 24.0 B; - vision 0.44 - 2 x 131072 x 5120")  # fmt: skip
QWEN3_8B = TextEncoder("Qwen3-8B", 8.19, 6.95, 512, source="Qwen3-8B model card: 8.2 B, 6.95 B non-embedding")
QWEN3_4B = TextEncoder("Qwen3-4B", 4.02, 3.6, 512, source="Qwen3-4B model card: 4.0 B, 3.6 B non-embedding")
GEMMA2_2B = TextEncoder("Gemma-2-2B", 2.61, 2.02, 300, source="model card 2.61 B; - 256000 x 2304 (tied)")
QWEN25_VL_7B = TextEncoder("Qwen2.5-VL-7B", 8.29, 6.53, 512, source="model card 8.29 B; LLM 6.53 B non-embedding (Qwen2.5-7B card)")  # fmt: skip
GEMMA3_12B = TextEncoder("Gemma-3-12B", 12.19, 10.76, 1024, source="model card 12.19 B; - vision 0.42 - 262208 x 3840 (tied)")  # fmt: skip
LTX2_CONNECTORS = TextEncoder("LTX-2 text connectors", 1.431, 1.431, 1024, source="counted on meta (LTX2TextConnectors)")

ARCHS: dict[str, Arch] = {
    a.key: a
    for a in [
        Arch("sd3.5-medium", "SD3Transformer2DModel", SD35_MEDIUM, _SD3_VAE, _SD3_TEXT, patch=2, text_tokens=333,
             include=(("stable-diffusion-3.5-medium",), ("sd3.5-medium",)), source="stabilityai/stable-diffusion-3.5-medium"),
        Arch("sd3.5-large", "SD3Transformer2DModel", SD35_LARGE, _SD3_VAE, _SD3_TEXT, patch=2, text_tokens=333,
             include=(("stable-diffusion-3.5-large",), ("sd3.5-large",)), source="stabilityai/stable-diffusion-3.5-large"),
        Arch("flux.1-dev", "FluxTransformer2DModel", FLUX1_DEV, _FLUX_VAE, (CLIP_L_TEXT, _t5(512)), patch=2, text_tokens=512,
             true_cfg=False, include=(("flux.1-",),), source="black-forest-labs/FLUX.1-dev"),
        Arch("flux.2-klein-9b", "Flux2Transformer2DModel", FLUX2_KLEIN_9B, _FLUX2_VAE, (QWEN3_8B,), patch=2,
             text_tokens=512, include=(("flux.2-klein", "9b"),), source="black-forest-labs/FLUX.2-klein-base-9B",
             notes="the base checkpoint runs true CFG; the step-distilled FLUX.2-klein-9B runs guidance 1 (one forward)"),
        Arch("flux.2-klein-4b", "Flux2Transformer2DModel", FLUX2_KLEIN_4B, _FLUX2_VAE, (QWEN3_4B,), patch=2,
             text_tokens=512, include=(("flux.2-klein", "4b"),), source="black-forest-labs/FLUX.2-klein-base-4B"),
        Arch("flux.2-dev", "Flux2Transformer2DModel", FLUX2_DEV, _FLUX2_VAE, (MISTRAL_SMALL_31,), patch=2,
             text_tokens=512, true_cfg=False, include=(("flux.2-dev",),), source="black-forest-labs/FLUX.2-dev"),
        Arch("sana-1.6b", "SanaTransformer2DModel", SANA_1600M, _SANA_VAE, (GEMMA2_2B,), patch=1, text_tokens=300,
             include=(("sana", "1600m"), ("sana", "1.6b")), source="Efficient-Large-Model/Sana_1600M_1024px_diffusers"),
        Arch("wan2.1-1.3b", "WanTransformer3DModel", WAN21_1_3B, _WAN_VAE, (_umt5(512),), patch=2, text_tokens=512,
             video=True, default_size=(480, 832, 81), include=(("wan2.1", "1.3b"),),
             source="Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
        Arch("wan2.1-14b", "WanTransformer3DModel", WAN_14B, _WAN_VAE, (_umt5(512),), patch=2, text_tokens=512,
             video=True, default_size=(720, 1280, 81), include=(("wan2.1", "14b"),), source="Wan-AI/Wan2.1-T2V-14B-Diffusers"),
        Arch("wan2.2-ti2v-5b", "WanTransformer3DModel", WAN22_TI2V_5B, _WAN22_VAE, (_umt5(512),), patch=2, text_tokens=512,
             video=True, default_size=(704, 1280, 121), include=(("wan2.2", "5b"),), source="Wan-AI/Wan2.2-TI2V-5B-Diffusers"),
        Arch("wan2.2-a14b", "WanTransformer3DModel", WAN_14B, _WAN_VAE, (_umt5(512),), patch=2, text_tokens=512,
             video=True, experts=2, default_size=(720, 1280, 81), include=(("wan2.2", "a14b"),),
             source="Wan-AI/Wan2.2-T2V-A14B-Diffusers", notes="two 14 B experts; one forward runs one (I2V: in_channels 36)"),
        Arch("qwen-image", "QwenImageTransformer2DModel", QWEN_IMAGE, _QWEN_VAE, (QWEN25_VL_7B,), patch=2,
             text_tokens=512, include=(("qwen-image",),), exclude=("edit",), source="Qwen/Qwen-Image"),
        Arch("qwen-image-edit", "QwenImageTransformer2DModel", QWEN_IMAGE, _QWEN_VAE, (QWEN25_VL_7B,), patch=2,
             text_tokens=1024, image_streams=2, include=(("qwen-image-edit",),), source="Qwen/Qwen-Image-Edit",
             notes="the source image's tokens ride in the sequence beside the target's"),
        Arch("z-image", "ZImageTransformer2DModel", Z_IMAGE, _FLUX_VAE, (QWEN3_4B,), patch=2, text_tokens=512,
             include=(("z-image",),), source="Tongyi-MAI/Z-Image-Turbo",
             notes="the Turbo checkpoint runs without CFG (guidance 0); the base model with it"),
        Arch("ltx-2", "LTX2VideoTransformer3DModel", LTX2, _LTX2_VAE, (GEMMA3_12B, LTX2_CONNECTORS), patch=1,
             text_tokens=1024, video=True, default_size=(512, 768, 121), include=(("ltx-2",),), source="Lightricks/LTX-2",
             notes="video and audio streams; both see the 1024 connector tokens"),
    ]
}  # fmt: skip


def family_of(model_path: str) -> Arch:
    """The family whose `matches` accepts `model_path`; a ValueError naming the families when none does."""
    found = [a for a in ARCHS.values() if a.matches(model_path)]
    if len(found) != 1:
        what = "no family" if not found else f"{len(found)} families ({', '.join(a.key for a in found)})"
        raise ValueError(f"model.path={model_path!r} matches {what}; known: {', '.join(ARCHS)}")
    return found[0]


def get(family: str | Arch) -> Arch:
    if isinstance(family, Arch):
        return family
    if family not in ARCHS:
        raise ValueError(f"family={family!r} is not one of {', '.join(ARCHS)}")
    return ARCHS[family]


# ---------------------------------------------------------------------------------------------------------------------
# meta-device builders


def build_transformer(family: str | Arch, device="meta") -> torch.nn.Module:
    """The family's transformer from its published config, constructed on `device` (meta: no memory)."""
    import diffusers

    arch = get(family)
    with torch.device(device):
        return getattr(diffusers, arch.transformer_cls)(**arch.transformer)


def build_vae(family: str | Arch, device="meta") -> torch.nn.Module:
    """The family's VAE from its published config, constructed on `device`."""
    import diffusers

    arch = get(family)
    with torch.device(device):
        return getattr(diffusers, arch.vae.cls)(**arch.vae.config)


def transformer_inputs(
    family: str | Arch, height: int, width: int, num_frames: int | None = None, text_tokens: int | None = None, device="meta"
) -> dict:
    """Keyword arguments of one forward of the family's transformer, batch 1, as tensors of the real shapes on
    `device`: latents of a height x width image (x num_frames for video), `text_tokens` text tokens (default: the
    family's), timestep, and whatever else the class takes (ids, masks, shapes)."""
    arch = get(family)
    cfg, cls = arch.transformer, arch.transformer_cls
    text = int(text_tokens or arch.text_tokens)
    h, w = int(height) // arch.vae.spatial, int(width) // arch.vae.spatial  # latent pixels
    gh, gw = h // arch.patch, w // arch.patch  # token grid
    n = gh * gw * arch.latent_frames(num_frames) * arch.image_streams

    def t(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=device)

    step = t(1)
    if cls == "SD3Transformer2DModel":
        return dict(hidden_states=t(1, cfg["in_channels"], h, w), encoder_hidden_states=t(1, text, cfg["joint_attention_dim"]),
                    pooled_projections=t(1, cfg["pooled_projection_dim"]), timestep=step)  # fmt: skip
    if cls == "FluxTransformer2DModel":
        return dict(hidden_states=t(1, n, cfg["in_channels"]), encoder_hidden_states=t(1, text, cfg["joint_attention_dim"]),
                    pooled_projections=t(1, cfg["pooled_projection_dim"]), timestep=step, img_ids=t(n, 3), txt_ids=t(text, 3),
                    guidance=step if cfg.get("guidance_embeds") else None)  # fmt: skip
    if cls == "Flux2Transformer2DModel":
        return dict(hidden_states=t(1, n, cfg["in_channels"]), encoder_hidden_states=t(1, text, cfg["joint_attention_dim"]),
                    timestep=step, img_ids=t(1, n, 4), txt_ids=t(1, text, 4),
                    guidance=step if cfg.get("guidance_embeds") else None)  # fmt: skip
    if cls == "SanaTransformer2DModel":
        return dict(hidden_states=t(1, cfg["in_channels"], h, w), encoder_hidden_states=t(1, text, cfg["caption_channels"]),
                    timestep=step)  # fmt: skip
    if cls == "WanTransformer3DModel":
        return dict(hidden_states=t(1, cfg["in_channels"], arch.latent_frames(num_frames), h, w), timestep=step,
                    encoder_hidden_states=t(1, text, cfg["text_dim"]))  # fmt: skip
    if cls == "QwenImageTransformer2DModel":
        shapes = [[(1, gh, gw)] * arch.image_streams]
        return dict(hidden_states=t(1, n, cfg["in_channels"]), encoder_hidden_states=t(1, text, cfg["joint_attention_dim"]),
                    encoder_hidden_states_mask=None, timestep=step, img_shapes=shapes)  # fmt: skip
    if cls == "ZImageTransformer2DModel":
        return dict(x=[t(cfg["in_channels"], 1, h, w)], t=step, cap_feats=[t(text, cfg["cap_feat_dim"])])
    if cls == "LTX2VideoTransformer3DModel":
        frames = arch.latent_frames(num_frames)
        audio = arch.audio_tokens(num_frames)
        return dict(hidden_states=t(1, n, cfg["in_channels"]), audio_hidden_states=t(1, audio, cfg["audio_in_channels"]),
                    encoder_hidden_states=t(1, text, cfg["caption_channels"]),
                    audio_encoder_hidden_states=t(1, text, cfg["caption_channels"]), timestep=step, num_frames=frames,
                    height=gh, width=gw, fps=LTX2_FPS, audio_num_frames=audio)  # fmt: skip
    raise ValueError(f"no inputs for {cls}")


def vae_latents(family: str | Arch, height: int, width: int, num_frames: int | None = None, device="meta") -> torch.Tensor:
    """The latents one image (video) decodes from, batch 1, on `device`."""
    arch = get(family)
    h, w = int(height) // arch.vae.spatial, int(width) // arch.vae.spatial
    c = arch.vae.latent_channels
    if arch.vae.cls == "AutoencoderKLQwenImage":
        return torch.empty(1, c, 1, h, w, device=device)
    if arch.vae.temporal:
        return torch.empty(1, c, arch.latent_frames(num_frames), h, w, device=device)
    return torch.empty(1, c, h, w, device=device)


@dataclass(frozen=True)
class RewardBackbone:
    """A reward model's network: `kind` names the builder (clip, blip, or `params` for a hand count), the config,
    what one image costs it (`image_tokens`, `text_tokens`) and a source."""

    kind: str
    config: dict
    text_tokens: int = 77
    params_b: float = 0.0  # kind == "params": parameters a token passes through
    image_tokens: int = 0  # kind == "params": tokens per image
    source: str = ""


REWARD_BACKBONES: dict[str, RewardBackbone] = {
    "clip-vit-h-14": RewardBackbone("clip", CLIP_VIT_H14, source="laion/CLIP-ViT-H-14-laion2B-s32B-b79K (PickScore_v1, HPSv2)"),
    "clip-vit-l-14": RewardBackbone("clip", CLIP_VIT_L14, source="openai/clip-vit-large-patch14"),
    "blip-vit-l": RewardBackbone("blip", dict(vision=BLIP_VIT_L, text=BLIP_TEXT), text_tokens=IMAGEREWARD_TEXT_TOKENS,
                                 source="THUDM/ImageReward: BLIP ViT-L/16 at 224 + BERT-base with cross-attention"),
    "clip-vit-b-32": RewardBackbone("open_clip", OPEN_CLIP_VIT_B32, source="open_clip ViT-B-32 (openai)"),
    # HPSv3 (MizzenAI/HPSv3): Qwen2-VL-7B-Instruct with a score head; an image at 448 x 448 -> 1024 ViT patches ->
    # 256 merged LLM tokens, plus ~100 instruction and prompt tokens (an estimate: resolution and prompt assumed)
    "qwen2-vl-7b": RewardBackbone("params", {"vision_params_b": 0.675, "vision_tokens": 1024}, text_tokens=356,
                                  params_b=6.53, source="estimate: Qwen2-VL-7B, 448 px, 256 + 100 LLM tokens"),
    # DINOv2-base (facebook/dinov2-base) at 224: 86.6 M parameters, 257 tokens
    "dinov2-base": RewardBackbone("params", {}, text_tokens=0, params_b=0.0866, image_tokens=257,
                                  source="facebook/dinov2-base model card (86.6 M) at 224 px"),
}  # fmt: skip


def build_reward_backbone(name: str, device="meta") -> dict[str, torch.nn.Module]:
    """The reward backbone `name` (a REWARD_BACKBONES key) on `device`: {"vision": module, "text": module} (only
    clip and blip kinds build; `params` kinds are hand counts)."""
    spec = REWARD_BACKBONES[name]
    if spec.kind == "clip":
        from transformers import CLIPConfig, CLIPModel

        with torch.device(device):
            model = CLIPModel(CLIPConfig(**spec.config))
        return {"vision": model.vision_model, "vision_proj": model.visual_projection, "text": model.text_model}
    if spec.kind == "blip":
        from transformers import BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

        with torch.device(device):
            vision = BlipVisionModel(BlipVisionConfig(**spec.config["vision"]))
            text = BlipTextModel(BlipTextConfig(**spec.config["text"], is_decoder=True), add_pooling_layer=False)
        return {"vision": vision, "text": text}
    if spec.kind == "open_clip":
        import open_clip

        with torch.device(device):
            model = open_clip.CLIP(**spec.config)
        return {"vision": model.visual, "text": model.transformer}
    raise ValueError(f"reward backbone {name!r} is a hand count ({spec.source}), not a module")


def params_b(module: torch.nn.Module) -> float:
    """Parameters of a module, in billions."""
    return sum(p.numel() for p in module.parameters()) / 1e9
