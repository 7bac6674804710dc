"""The real architectures as data: each family's published transformer config, its VAE, its text encoders and its
token geometry, and functions that build them on the meta device (no memory, seconds on a CPU).

The configs themselves are in flowrl.plan.arch_configs. A family is found from a run config's `model.path` with
`family_of(path)` (each `Arch.matches` reads the hub id or folder name). `build_transformer(key)`, `build_vae(key)` and
`build_reward_backbone(name)` construct the diffusers / transformers modules under `torch.device("meta")`;
`transformer_inputs(key, ...)` gives meta tensors of the real shapes for one forward (batch 1, no CFG), which is what
`flowrl.plan.cost` counts FLOPs on.

Sources: each transformer config is its `transformer/config.json` on the Hugging Face hub (the comment above each
names where the values were read: the diffusers class defaults, diffusers' conversion scripts, or copies of the
hub file); no weights are read and nothing downloads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flowrl.plan.arch_configs import (
    BLIP_TEXT,
    BLIP_VIT_L,
    CLIP_VIT_H14,
    CLIP_VIT_L14,
    FLUX1_DEV,
    FLUX2_DEV,
    FLUX2_KLEIN_4B,
    FLUX2_KLEIN_9B,
    FLUX2_VAE,
    FLUX_VAE,
    IMAGEREWARD_TEXT_TOKENS,
    LTX2,
    LTX2_AUDIO_LATENTS_PER_SECOND,
    LTX2_FPS,
    LTX2_VAE,
    OPEN_CLIP_VIT_B32,
    QWEN_IMAGE,
    QWEN_VAE,
    SANA_1600M,
    SANA_DC_AE,
    SD3_VAE,
    SD35_LARGE,
    SD35_MEDIUM,
    WAN21_1_3B,
    WAN22_TI2V_5B,
    WAN22_VAE,
    WAN_14B,
    WAN_VAE,
    Z_IMAGE,
)

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
    transformer's patch size, or the 2x2 packing of FLUX.1 / Qwen-Image latents and FLUX.2's VAE; `text_tokens` the
    default number of text tokens the transformer sees (SD3: 77 CLIP + 256 T5); `true_cfg` False for guidance-distilled
    models (one forward per step); `experts` the transformers resident (Wan2.2-A14B: two, one runs per forward);
    `image_streams` how many images' tokens ride in the sequence (Qwen-Image-Edit: the target and its source)."""

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
MISTRAL_SMALL_31 = TextEncoder(
    "Mistral-Small-3.1-24B", 24.0, 22.2, 512, source="model card 24.0 B; - vision 0.44 - 2 x 131072 x 5120"
)
QWEN3_8B = TextEncoder("Qwen3-8B", 8.19, 6.95, 512, source="Qwen3-8B model card: 8.2 B, 6.95 B non-embedding")
QWEN3_4B = TextEncoder("Qwen3-4B", 4.02, 3.6, 512, source="Qwen3-4B model card: 4.0 B, 3.6 B non-embedding")
GEMMA2_2B = TextEncoder("Gemma-2-2B", 2.61, 2.02, 300, source="model card 2.61 B; - 256000 x 2304 (tied)")
QWEN25_VL_7B = TextEncoder(
    "Qwen2.5-VL-7B", 8.29, 6.53, 512, source="model card 8.29 B; LLM 6.53 B non-embedding (Qwen2.5-7B card)"
)
GEMMA3_12B = TextEncoder(
    "Gemma-3-12B", 12.19, 10.76, 1024, source="model card 12.19 B; - vision 0.42 - 262208 x 3840 (tied)"
)
LTX2_CONNECTORS = TextEncoder(
    "LTX-2 text connectors", 1.431, 1.431, 1024, source="counted on meta (LTX2TextConnectors)"
)

ARCHS: dict[str, Arch] = {
    a.key: a
    for a in [
        Arch("sd3.5-medium", "SD3Transformer2DModel", SD35_MEDIUM, _SD3_VAE, _SD3_TEXT, patch=2, text_tokens=333,
             include=(("stable-diffusion-3.5-medium",), ("sd3.5-medium",)),
             source="stabilityai/stable-diffusion-3.5-medium"),
        Arch("sd3.5-large", "SD3Transformer2DModel", SD35_LARGE, _SD3_VAE, _SD3_TEXT, patch=2, text_tokens=333,
             include=(("stable-diffusion-3.5-large",), ("sd3.5-large",)),
             source="stabilityai/stable-diffusion-3.5-large"),
        Arch("flux.1-dev", "FluxTransformer2DModel", FLUX1_DEV, _FLUX_VAE, (CLIP_L_TEXT, _t5(512)), patch=2,
             text_tokens=512, true_cfg=False, include=(("flux.1-",),), source="black-forest-labs/FLUX.1-dev"),
        Arch("flux.2-klein-9b", "Flux2Transformer2DModel", FLUX2_KLEIN_9B, _FLUX2_VAE, (QWEN3_8B,), patch=2,
             text_tokens=512, include=(("flux.2-klein", "9b"),), source="black-forest-labs/FLUX.2-klein-base-9B",
             notes="the base checkpoint runs true CFG; the step-distilled FLUX.2-klein-9B runs guidance 1 "
                   "(one forward)"),
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
             video=True, default_size=(720, 1280, 81), include=(("wan2.1", "14b"),),
             source="Wan-AI/Wan2.1-T2V-14B-Diffusers"),
        Arch("wan2.2-ti2v-5b", "WanTransformer3DModel", WAN22_TI2V_5B, _WAN22_VAE, (_umt5(512),), patch=2,
             text_tokens=512, video=True, default_size=(704, 1280, 121), include=(("wan2.2", "5b"),),
             source="Wan-AI/Wan2.2-TI2V-5B-Diffusers"),
        Arch("wan2.2-a14b", "WanTransformer3DModel", WAN_14B, _WAN_VAE, (_umt5(512),), patch=2, text_tokens=512,
             video=True, experts=2, default_size=(720, 1280, 81), include=(("wan2.2", "a14b"),),
             source="Wan-AI/Wan2.2-T2V-A14B-Diffusers",
             notes="two 14 B experts; one forward runs one (I2V: in_channels 36)"),
        Arch("qwen-image", "QwenImageTransformer2DModel", QWEN_IMAGE, _QWEN_VAE, (QWEN25_VL_7B,), patch=2,
             text_tokens=512, include=(("qwen-image",),), exclude=("edit",), source="Qwen/Qwen-Image"),
        Arch("qwen-image-edit", "QwenImageTransformer2DModel", QWEN_IMAGE, _QWEN_VAE, (QWEN25_VL_7B,), patch=2,
             text_tokens=1024, image_streams=2, include=(("qwen-image-edit",),), source="Qwen/Qwen-Image-Edit",
             notes="the source image's tokens ride in the sequence beside the target's"),
        Arch("z-image", "ZImageTransformer2DModel", Z_IMAGE, _FLUX_VAE, (QWEN3_4B,), patch=2, text_tokens=512,
             include=(("z-image",),), source="Tongyi-MAI/Z-Image-Turbo",
             notes="the Turbo checkpoint runs without CFG (guidance 0); the base model with it"),
        Arch("ltx-2", "LTX2VideoTransformer3DModel", LTX2, _LTX2_VAE, (GEMMA3_12B, LTX2_CONNECTORS), patch=1,
             text_tokens=1024, video=True, default_size=(512, 768, 121), include=(("ltx-2",),),
             source="Lightricks/LTX-2", notes="video and audio streams; both see the 1024 connector tokens"),
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
    family: str | Arch,
    height: int,
    width: int,
    num_frames: int | None = None,
    text_tokens: int | None = None,
    device="meta",
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
        return dict(
            hidden_states=t(1, cfg["in_channels"], h, w),
            encoder_hidden_states=t(1, text, cfg["joint_attention_dim"]),
            pooled_projections=t(1, cfg["pooled_projection_dim"]),
            timestep=step,
        )
    if cls == "FluxTransformer2DModel":
        return dict(
            hidden_states=t(1, n, cfg["in_channels"]),
            encoder_hidden_states=t(1, text, cfg["joint_attention_dim"]),
            pooled_projections=t(1, cfg["pooled_projection_dim"]),
            timestep=step,
            img_ids=t(n, 3),
            txt_ids=t(text, 3),
            guidance=step if cfg.get("guidance_embeds") else None,
        )
    if cls == "Flux2Transformer2DModel":
        return dict(
            hidden_states=t(1, n, cfg["in_channels"]),
            encoder_hidden_states=t(1, text, cfg["joint_attention_dim"]),
            timestep=step,
            img_ids=t(1, n, 4),
            txt_ids=t(1, text, 4),
            guidance=step if cfg.get("guidance_embeds") else None,
        )
    if cls == "SanaTransformer2DModel":
        return dict(
            hidden_states=t(1, cfg["in_channels"], h, w),
            encoder_hidden_states=t(1, text, cfg["caption_channels"]),
            timestep=step,
        )
    if cls == "WanTransformer3DModel":
        return dict(
            hidden_states=t(1, cfg["in_channels"], arch.latent_frames(num_frames), h, w),
            timestep=step,
            encoder_hidden_states=t(1, text, cfg["text_dim"]),
        )
    if cls == "QwenImageTransformer2DModel":
        shapes = [[(1, gh, gw)] * arch.image_streams]
        return dict(
            hidden_states=t(1, n, cfg["in_channels"]),
            encoder_hidden_states=t(1, text, cfg["joint_attention_dim"]),
            encoder_hidden_states_mask=None,
            timestep=step,
            img_shapes=shapes,
        )
    if cls == "ZImageTransformer2DModel":
        return dict(x=[t(cfg["in_channels"], 1, h, w)], t=step, cap_feats=[t(text, cfg["cap_feat_dim"])])
    if cls == "LTX2VideoTransformer3DModel":
        frames = arch.latent_frames(num_frames)
        audio = arch.audio_tokens(num_frames)
        return dict(
            hidden_states=t(1, n, cfg["in_channels"]),
            audio_hidden_states=t(1, audio, cfg["audio_in_channels"]),
            encoder_hidden_states=t(1, text, cfg["caption_channels"]),
            audio_encoder_hidden_states=t(1, text, cfg["caption_channels"]),
            timestep=step,
            num_frames=frames,
            height=gh,
            width=gw,
            fps=LTX2_FPS,
            audio_num_frames=audio,
        )
    raise ValueError(f"no inputs for {cls}")


def vae_latents(
    family: str | Arch, height: int, width: int, num_frames: int | None = None, device="meta"
) -> torch.Tensor:
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
    "clip-vit-h-14": RewardBackbone("clip", CLIP_VIT_H14,
                                    source="laion/CLIP-ViT-H-14-laion2B-s32B-b79K (PickScore_v1, HPSv2)"),
    "clip-vit-l-14": RewardBackbone("clip", CLIP_VIT_L14, source="openai/clip-vit-large-patch14"),
    "blip-vit-l": RewardBackbone("blip", dict(vision=BLIP_VIT_L, text=BLIP_TEXT), text_tokens=IMAGEREWARD_TEXT_TOKENS,
                                 source="THUDM/ImageReward: BLIP ViT-L/16 at 224 + BERT-base with cross-attention"),
    "clip-vit-b-32": RewardBackbone("open_clip", OPEN_CLIP_VIT_B32, source="open_clip ViT-B-32 (openai)"),
    # HPSv3 (MizzenAI/HPSv3, rewards/hpsv3.py): Qwen2-VL-7B-Instruct with a ranknet head; an image at 448 x 448 ->
    # 1024 ViT patches -> 256 merged LLM tokens, in a chat of ~790 LLM tokens (HPSv3's rating instruction is ~500 of
    # them, a prompt ~15). Parameters of the config built on meta: ViT + merger 0.676 B, LLM 6.526 B without the
    # embedding. A hand count (2 x parameters x tokens): the vision tower does not run on meta (it reads grid_thw);
    # the LLM counted on meta at 750 tokens is 2.3% above the hand count (attention)
    "qwen2-vl-7b": RewardBackbone("params", {"vision_params_b": 0.676, "vision_tokens": 1024}, text_tokens=790,
                                  params_b=6.526,
                                  source="hand count: Qwen2-VL-7B at 448 px, 1024 patches, ~790 LLM tokens"),
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
