"""The published configs of the real models, as data: each family's transformer (its `transformer/config.json` on
the Hugging Face hub), the text encoders, the VAEs and the reward backbones. flowrl.plan.archs builds them on the
meta device; the comment above each config names where its values were read (the diffusers class defaults,
diffusers' conversion scripts, or copies of the hub file). No weights are read and nothing downloads.
"""

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
              feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
              relative_attention_max_distance=128)  # fmt: skip
UMT5_XXL = dict(T5_XXL, vocab_size=256384)

# ---------------------------------------------------------------------------------------------------------------------
# VAEs (each model's vae/config.json)

SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
               down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
               layers_per_block=2, norm_num_groups=32, sample_size=1024, scaling_factor=1.5305, shift_factor=0.0609,
               use_quant_conv=False, use_post_quant_conv=False)  # fmt: skip
FLUX_VAE = dict(SD3_VAE, scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1 and Z-Image
# black-forest-labs/FLUX.2-dev vae/config.json: the AutoencoderKLFlux2 defaults (32 latent channels, 2x2 patchified
# to the transformer's 128)
FLUX2_VAE: dict = {}
WAN_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
# Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json (the Wan2.2 VAE: 16x spatial, 48 latent channels)
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12,
                 patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4)  # fmt: skip
# Qwen/Qwen-Image vae/config.json (the AutoencoderKLQwenImage defaults)
QWEN_VAE: dict = {}
# Efficient-Large-Model/Sana_1600M_1024px_diffusers vae/config.json (DC-AE f32c32, SANA 1.0)
SANA_DC_AE = dict(
    in_channels=3,
    latent_channels=32,
    attention_head_dim=32,
    encoder_block_types=(
        "ResBlock",
        "ResBlock",
        "ResBlock",
        "EfficientViTBlock",
        "EfficientViTBlock",
        "EfficientViTBlock",
    ),
    decoder_block_types=(
        "ResBlock",
        "ResBlock",
        "ResBlock",
        "EfficientViTBlock",
        "EfficientViTBlock",
        "EfficientViTBlock",
    ),
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
BLIP_VIT_L = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                  image_size=224, patch_size=16)  # fmt: skip
BLIP_TEXT = dict(vocab_size=30524, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, encoder_hidden_size=1024, max_position_embeddings=512)  # fmt: skip
IMAGEREWARD_TEXT_TOKENS = 35
# temporal consistency's default CLIP (open_clip ViT-B-32)
OPEN_CLIP_VIT_B32 = {
    "embed_dim": 512,
    "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 32},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 512, "heads": 8, "layers": 12},
}
