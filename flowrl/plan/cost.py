"""The price of one unit of work at the real architectures' sizes, and of a training step's metered work.

Counted (on the meta device, no weights, seconds on a CPU):

- one transformer forward (batch 1, no CFG): `torch.utils.flop_counter.FlopCounterMode` around a forward of the
  family's published transformer (flowrl.plan.archs) with meta inputs of the real shapes. Attention FLOPs are what
  the counter attributes to the attention products (SDPA runs as batched matmuls on meta: `bmm`), linear FLOPs the
  rest (`mm`, `addmm`, convolutions). `hand_count` is an independent second formula, 2 x (parameters a token
  passes through) x tokens + 4 x S_q x S_k x d per attention, and agrees within a few percent for every family;
- one VAE decode, per image or per video (the decoder on meta);
- one reward forward per image for the CLIP and BLIP backbones (vision tower at 224 px, text tower at its length).

Estimated (a published number or a hand count, each with its source beside it in this module): text encoders
(2 x parameters x tokens), the HPSv3 and DINOv2 rewards, the LoRA backward (linear + 2 x attention), the full
backward (2 F), checkpointing's recompute (1 F), the GPUs' peak throughput, the efficiency η and the preview
backends' speed-ups. docs/cost.md has the tables, the hand-count check per family and the calibration against the
published iteration-time ratios of DanceGRPO, MixGRPO and BranchGRPO.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch

from flowrl.plan import archs

# ---------------------------------------------------------------------------------------------------------------------
# one forward


@dataclass(frozen=True)
class ForwardCost:
    """One transformer forward, batch 1, no CFG: TFLOP in all, of linear layers (matmuls with a weight, convolutions)
    and of attention (activation x activation products); the transformer's parameters (B) and the tokens."""

    tflops: float
    linear_tflops: float
    attention_tflops: float
    params_b: float
    image_tokens: int
    text_tokens: int


def _is_attention(op) -> bool:
    name = str(op)
    return "bmm" in name or "scaled_dot_product" in name or "attention" in name


def count_flops(fn, *args, **kwargs) -> tuple[float, float]:
    """(total, attention) TFLOP that FlopCounterMode counts while `fn(*args, **kwargs)` runs without autograd."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    ops = counter.get_flop_counts().get("Global", {})
    attention = sum(v for op, v in ops.items() if _is_attention(op))
    return counter.get_total_flops() / 1e12, attention / 1e12


@functools.cache
def _meta_transformer(family: str) -> torch.nn.Module:
    return archs.build_transformer(family)


def _same_network(a: archs.Arch, b: archs.Arch) -> bool:
    return (a.transformer_cls, a.transformer, a.vae, a.patch, a.image_streams) == (
        b.transformer_cls, b.transformer, b.vae, b.patch, b.image_streams
    )  # fmt: skip


def _key(family, height, width, num_frames, text_tokens) -> tuple:
    """The cache key of a count: the first family with the same network and geometry (Wan2.2-A14B's experts are
    Wan2.1-14B's network), the size, the frames (None for images) and the text tokens."""
    arch = archs.get(family)
    frames = int(num_frames) if (arch.video and num_frames) else None
    first = next((a for a in archs.ARCHS.values() if _same_network(a, arch)), arch)
    return first.key, int(height), int(width), frames, int(text_tokens or arch.text_tokens)


def transformer_forward(
    family: str, height: int, width: int, num_frames: int | None = None, text_tokens: int | None = None
) -> ForwardCost:
    """One forward of `family`'s transformer at height x width (x num_frames for video) with `text_tokens` text
    tokens (default: the family's; SD3 counts its 77 CLIP tokens in), counted on the meta device. Cached."""
    return _transformer_forward(*_key(family, height, width, num_frames, text_tokens))


@functools.lru_cache(maxsize=256)
def _transformer_forward(family: str, height: int, width: int, num_frames: int | None, text_tokens: int) -> ForwardCost:
    arch = archs.get(family)
    module = _meta_transformer(family)
    inputs = archs.transformer_inputs(arch, height, width, num_frames, text_tokens)
    total, attention = count_flops(module, **inputs)
    return ForwardCost(
        tflops=total,
        linear_tflops=total - attention,
        attention_tflops=attention,
        params_b=archs.params_b(module),
        image_tokens=arch.image_tokens(height, width, num_frames),
        text_tokens=text_tokens,
    )


# ---------------------------------------------------------------------------------------------------------------------
# the hand count: which tokens pass through which parameters, and the attention products

# (pattern on the parameter name, the tokens it is applied to); the first match wins, the rest is "image".
# once: per sample (timestep / guidance embedders, adaLN modulation from the timestep vector, tables); image: image
# (video) tokens; text: text tokens; joint: both (single-stream blocks); audio / text_audio: LTX-2's audio stream
_JOINT_TEXT = r"^context_embedder|\.add_[qkv]_proj\.|\.to_add_out\.|\.ff_context\.|\.norm_added_[qk]\."
STREAMS: dict[str, list[tuple[str, str]]] = {
    "SD3Transformer2DModel": [
        (r"\.norm1(_context)?\.linear\.|^norm_out\.|^time_text_embed\.", "once"),
        (_JOINT_TEXT, "text"),
    ],
    "FluxTransformer2DModel": [
        (r"\.norm1(_context)?\.linear\.|\.norm\.linear\.|^norm_out\.|^time_text_embed\.", "once"),
        (r"^single_transformer_blocks\.", "joint"),
        (_JOINT_TEXT, "text"),
    ],
    "Flux2Transformer2DModel": [
        (r"_modulation|^time_guidance_embed\.|^norm_out\.", "once"),
        (r"^single_transformer_blocks\.", "joint"),
        (_JOINT_TEXT, "text"),
    ],
    "QwenImageTransformer2DModel": [
        (r"\.(img|txt)_mod\.|^time_text_embed\.|^norm_out\.", "once"),
        (r"^txt_in|^txt_norm|\.add_[qkv]_proj\.|\.to_add_out\.|\.txt_mlp\.|\.norm_added_[qk]\.", "text"),
    ],
    "SanaTransformer2DModel": [
        (r"table$|^time_embed\.", "once"),
        (r"^caption_projection|^caption_norm|\.attn2\.(to_[kv]|norm_k)\.", "text"),
    ],
    "WanTransformer3DModel": [
        (r"table$|^condition_embedder\.time_", "once"),
        (r"^condition_embedder\.text_embedder|\.attn2\.(to_[kv]|norm_k)\.", "text"),
    ],
    "ZImageTransformer2DModel": [
        (r"adaLN_modulation|^t_embedder\.", "once"),
        (r"^cap_embedder|^context_refiner\.|^cap_pad_token", "text"),
        (r"^layers\.", "joint"),
    ],
    "LTX2VideoTransformer3DModel": [
        (r"table$|(^|\.)(audio_)?time_embed\.|^av_cross_attn_", "once"),
        (r"\.audio_to_video_attn\.(to_[kv]|norm_k)\.", "audio"),  # keys and values from the audio tokens
        (r"\.audio_to_video_attn\.", "image"),  # queries and output on the video tokens
        (r"\.video_to_audio_attn\.(to_[kv]|norm_k)\.", "image"),
        (r"\.video_to_audio_attn\.", "audio"),
        (r"^audio_caption_projection|\.audio_attn2\.(to_[kv]|norm_k)\.", "text_audio"),
        (r"^caption_projection|\.attn2\.(to_[kv]|norm_k)\.", "text"),
        (r"^audio_|\.audio_", "audio"),
    ],
}


def stream_params(family: str) -> dict[str, float]:
    """Parameters (B) of `family`'s transformer by the tokens they apply to (STREAMS)."""
    arch = archs.get(family)
    rules = [(re.compile(p), group) for p, group in STREAMS[arch.transformer_cls]]
    out: dict[str, float] = {}
    for name, p in _meta_transformer(arch.key).named_parameters():
        group = next((g for rx, g in rules if rx.search(name)), "image")
        out[group] = out.get(group, 0.0) + p.numel() / 1e9
    return out


def attention_terms(family: str, image_tokens: int, text_tokens: int, audio_tokens: int = 0) -> list[tuple]:
    """The attention products of one forward: (layers, S_q, S_k, d), each costing 4 x S_q x S_k x d FLOPs per layer
    (Q·K^T and P·V, 2 FLOPs a multiply-add)."""
    arch = archs.get(family)
    c, cls = arch.transformer, arch.transformer_cls
    n, t, a = image_tokens, text_tokens, audio_tokens
    if cls == "SD3Transformer2DModel":
        d = c["num_attention_heads"] * c["attention_head_dim"]
        return [(c["num_layers"], n + t, n + t, d), (len(c["dual_attention_layers"]), n, n, d)]
    if cls in ("FluxTransformer2DModel", "Flux2Transformer2DModel"):
        d = c["num_attention_heads"] * c["attention_head_dim"]
        return [(c["num_layers"] + c["num_single_layers"], n + t, n + t, d)]
    if cls == "QwenImageTransformer2DModel":
        return [(c["num_layers"], n + t, n + t, c["num_attention_heads"] * c["attention_head_dim"])]
    if cls == "SanaTransformer2DModel":
        d = c["num_attention_heads"] * c["attention_head_dim"]
        cross = c["num_cross_attention_heads"] * c["cross_attention_head_dim"]
        # linear attention: (V padded with a row of ones) x K^T, then x Q: 4 x N x (d_h + 1) x d per layer
        return [(c["num_layers"], n, c["attention_head_dim"] + 1, d), (c["num_layers"], n, t, cross)]
    if cls == "WanTransformer3DModel":
        d = c["num_attention_heads"] * c["attention_head_dim"]
        return [(c["num_layers"], n, n, d), (c["num_layers"], n, t, d)]
    if cls == "ZImageTransformer2DModel":
        n, t = -(-n // 32) * 32, -(-t // 32) * 32  # both sequences padded to multiples of 32
        d, r = c["dim"], c["n_refiner_layers"]
        return [(r, n, n, d), (r, t, t, d), (c["n_layers"], n + t, n + t, d)]
    if cls == "LTX2VideoTransformer3DModel":
        dv = c["num_attention_heads"] * c["attention_head_dim"]
        da = c["audio_num_attention_heads"] * c["audio_attention_head_dim"]
        layers = c["num_layers"]
        return [(layers, n, n, dv), (layers, n, t, dv), (layers, a, a, da), (layers, a, t, da), (layers, n, a, da),
                (layers, a, n, da)]  # fmt: skip
    raise ValueError(f"no attention terms for {cls}")


def hand_count(
    family: str, height: int, width: int, num_frames: int | None = None, text_tokens: int | None = None
) -> ForwardCost:
    """The forward's FLOPs by hand: 2 x (parameters a token passes through) x tokens, each group of parameters
    (STREAMS) times the tokens it applies to, plus 4 x S_q x S_k x d per attention product (`attention_terms`)."""
    family, height, width, num_frames, text = _key(family, height, width, num_frames, text_tokens)
    arch = archs.get(family)
    n, a = arch.image_tokens(height, width, num_frames), arch.audio_tokens(num_frames)
    if arch.transformer_cls == "ZImageTransformer2DModel":
        n, text = -(-n // 32) * 32, -(-text // 32) * 32
    tokens = {"once": 1, "image": n, "text": text, "joint": n + text, "audio": a, "text_audio": text}
    p = stream_params(family)
    linear = 2 * sum(p[g] * 1e9 * tokens[g] for g in p) / 1e12
    attention = sum(4 * layers * sq * sk * d for layers, sq, sk, d in attention_terms(family, n, text, a)) / 1e12
    image_tokens = arch.image_tokens(height, width, num_frames)
    return ForwardCost(linear + attention, linear, attention, sum(p.values()), image_tokens, text)


# ---------------------------------------------------------------------------------------------------------------------
# backward

FULL_BACKWARD_FACTOR = 2.0  # gradients of the inputs and of the weights: 2 F (the 6·N·tokens rule of training)


def lora_backward_factor(cost: ForwardCost) -> float:
    """A LoRA backward in forwards: frozen weights need no weight gradient, so a linear layer's backward is its input
    gradient (1 x its forward FLOPs) while attention's backward needs the gradients of Q, K and V (≈ 2 x): (linear + 2
    x attention) / total. The adapters' own FLOPs (rank r << d) are left out."""
    return (cost.linear_tflops + 2 * cost.attention_tflops) / cost.tflops


# ---------------------------------------------------------------------------------------------------------------------
# VAE, text encoders, rewards

VAE_DECODE_512_TFLOP = 2.539  # NVIDIA's Stable Diffusion TensorRT material: the SD VAE decoder at 512², 2.539e12


@functools.lru_cache(maxsize=64)
def _vae_decode(family: str, height: int, width: int, num_frames: int | None) -> float:
    arch = archs.get(family)
    try:
        vae = archs.build_vae(arch)
        latents = archs.vae_latents(arch, height, width, num_frames)
        return count_flops(vae.decode, latents, return_dict=False)[0]
    except (RuntimeError, NotImplementedError, TypeError, ValueError):  # a decoder that cannot run on meta
        frames = num_frames if arch.video and num_frames else 1
        return VAE_DECODE_512_TFLOP * height * width / 512**2 * frames


def vae_decode_tflops(family: str, height: int, width: int, num_frames: int | None = None) -> float:
    """TFLOP of decoding one image (one video of num_frames frames): the family's VAE decoder counted on meta, or
    NVIDIA's 2.539 TFLOP per 512² image (VAE_DECODE_512_TFLOP) scaled by pixels where a decoder cannot run there.
    Cached."""
    family, height, width, frames, _ = _key(family, height, width, num_frames, None)
    return _vae_decode(family, height, width, frames)


def text_encode_tflops(family: str, text_tokens: int | None = None) -> float:
    """TFLOP of encoding one prompt: 2 x parameters x tokens over the family's text encoders (parameters a token
    passes through, embedding tables left out). `text_tokens` counts as `transformer_forward`'s (SD3: 77 + T5)."""
    arch = archs.get(family)
    variable = int(text_tokens or arch.text_tokens) - arch.fixed_text_tokens
    return sum(2 * e.token_params_b * 1e9 * (e.tokens if e.fixed else variable) for e in arch.text_encoders) / 1e12


@dataclass(frozen=True)
class RewardCost:
    """What one image costs a reward: `backbone` (an archs.REWARD_BACKBONES key, or None: no GPU work), the towers
    that run (`vision`, `text`), how many vision passes (`images`), and a note."""

    backbone: str | None
    towers: tuple[str, ...] = ("vision", "text")
    images: int = 1
    note: str = ""


REWARDS: dict[str, RewardCost] = {
    "pickscore": RewardCost("clip-vit-h-14", note="PickScore_v1: CLIP ViT-H-14 image + prompt"),
    "hpsv2": RewardCost("clip-vit-h-14", note="HPSv2.1: open_clip ViT-H-14 image + prompt"),
    "hpsv3": RewardCost("qwen2-vl-7b", note="HPSv3: Qwen2-VL-7B, hand count (448 px, ~790 LLM tokens)"),
    "clipscore": RewardCost("clip-vit-l-14", note="CLIP ViT-L/14 image + prompt"),
    "aesthetic": RewardCost("clip-vit-l-14", ("vision",), note="CLIP ViT-L/14 image + an MLP head"),
    "image_consistency": RewardCost(
        "clip-vit-l-14", ("vision",), images=2, note="CLIP ViT-L/14: the image and its source"
    ),
    "imagereward": RewardCost("blip-vit-l", note="BLIP ViT-L/16 image + BERT-base prompt with cross-attention"),
    "temporal_consistency": RewardCost("clip-vit-b-32", ("vision",), note="open_clip ViT-B-32 per frame"),
    "dino_similarity": RewardCost("dinov2-base", ("vision",), note="DINOv2-base at 224 px (references cached)"),
    "adversarial": RewardCost(
        "dinov2-base", ("vision",), note="adv_grpo's RM: DINOv2-base (priced at 224 px) + a small head"
    ),
    "ocr": RewardCost(None, note="RapidOCR / tesseract on the CPU: no GPU work"),
    "jpeg_compressibility": RewardCost(None, note="a JPEG encode on the CPU"),
    "jpeg_incompressibility": RewardCost(None, note="a JPEG encode on the CPU"),
    "toy_exact": RewardCost(None, note="pixel rules on the CPU"),
    "toy_geneval_exact": RewardCost(None, note="GenEval's rules over the exact checker's shapes, on the CPU"),
    "toy_geneval": RewardCost(None, note="the toy attribute judge on each instance, on the CPU"),
    "remote": RewardCost(None, note="served on another machine: not this run's GPUs"),
    "remote_flowgrpo": RewardCost(None, note="served on another machine: not this run's GPUs"),
    "openai_judge": RewardCost(None, note="served on another machine: not this run's GPUs"),
}
# a reward this table does not know is priced as a CLIP ViT-H-14 (image at 224 px + a 77-token prompt), the backbone
# of the most common preference rewards (PickScore, HPSv2)
DEFAULT_REWARD = RewardCost("clip-vit-h-14", note="unknown reward: priced as CLIP ViT-H-14 at 224 px")


@functools.cache
def _backbone_tflops(name: str) -> dict[str, float]:
    """{tower: TFLOP per image} of a reward backbone: counted on meta, or the hand count of its spec."""
    spec = archs.REWARD_BACKBONES[name]
    if spec.kind == "params":
        vision = 2 * spec.config.get("vision_params_b", 0.0) * 1e9 * spec.config.get("vision_tokens", 0)
        vision += 2 * spec.params_b * 1e9 * spec.image_tokens
        return {"vision": vision / 1e12, "text": 2 * spec.params_b * 1e9 * spec.text_tokens / 1e12}
    parts = archs.build_reward_backbone(name)
    size = spec.config["vision"]["image_size"] if spec.kind == "blip" else 224
    pixels = torch.empty(1, 3, size, size, device="meta")
    ids = torch.zeros(1, spec.text_tokens, dtype=torch.long, device="meta")
    if spec.kind == "open_clip":
        return {"vision": count_flops(parts["vision"], pixels)[0], "text": 0.0}
    vision = count_flops(parts["vision"], pixel_values=pixels)[0]
    if spec.kind == "blip":
        vision_cfg = spec.config["vision"]
        image = torch.empty(1, (size // vision_cfg["patch_size"]) ** 2 + 1, vision_cfg["hidden_size"], device="meta")
        return {"vision": vision, "text": count_flops(parts["text"], input_ids=ids, encoder_hidden_states=image)[0]}
    return {"vision": vision, "text": count_flops(parts["text"], input_ids=ids)[0]}


def reward_tflops(name: str) -> float:
    """TFLOP of scoring one image with reward `name` (REWARDS; an unknown name is priced as DEFAULT_REWARD)."""
    spec = REWARDS.get(name, DEFAULT_REWARD)
    if spec.backbone is None:
        return 0.0
    towers = _backbone_tflops(spec.backbone)
    return sum(towers[t] * (spec.images if t == "vision" else 1) for t in spec.towers)


# Qwen2-VL-7B as HPSv3 holds it (its config on meta: 8.29 B less the 0.54 B LM head it does not load), dinov2-base card
_BACKBONE_PARAMS = {"qwen2-vl-7b": 7.75e9, "dinov2-base": 86.6e6}


@functools.cache
def reward_params(name: str) -> float:
    """Parameters (a count, not billions) of reward `name`'s model resident on the GPU; 0 for CPU or remote ones."""
    spec = REWARDS.get(name, DEFAULT_REWARD)
    if spec.backbone is None:
        return 0.0
    if spec.backbone in _BACKBONE_PARAMS:
        return _BACKBONE_PARAMS[spec.backbone]
    return sum(archs.params_b(m) for m in archs.build_reward_backbone(spec.backbone).values()) * 1e9


# ---------------------------------------------------------------------------------------------------------------------
# hardware, efficiency, preview backends


@dataclass(frozen=True)
class GPU:
    """Dense (no sparsity) peak TFLOP/s per format, memory and where the numbers come from."""

    name: str
    bf16: float
    fp8: float
    fp4: float | None
    memory_gib: float
    source: str


_DATASHEETS = "vendor datasheet figures (dense), as collected on glennklockwood.com"
HARDWARE: dict[str, GPU] = {
    "h100": GPU("H100 SXM", 989.0, 1979.0, None, 80.0, _DATASHEETS),
    "h200": GPU("H200", 989.0, 1979.0, None, 141.0, _DATASHEETS + "; the H100's compute, 4.8 TB/s memory"),
    "b200": GPU("B200 (HGX)", 2250.0, 4500.0, 9000.0, 180.0, _DATASHEETS),
}

ETA = {"research": 0.11, "tuned": 0.4}
"""Achieved / peak BF16 throughput. `research` ≈ 0.11: DanceGRPO's README trains FLUX.1-dev 200 iterations at
720 px on 16 H800 in ~12 h (~216 s an iteration); its scripts/finetune/finetune_flux_grpo.sh runs one prompt x 12
images per GPU, 16 sampling steps, 60% of them trained (9) with full fine-tuning and checkpointing, so one GPU's
iteration is 12 x (16 F + 9 x 4 F) + decodes, HPSv2 and text encodes ≈ 23,400 TFLOP at F = 37.3 TFLOP, in 216 s at
989 TFLOP/s (an H800's dense BF16 equals an H100's): η ≈ 0.11 (`dancegrpo_eta` recomputes it). `tuned` ≈ 0.4: an
estimate for compiled, fused code. Report projections at both until a GPU measures it."""

# end-to-end speed-up of a transformer forward over BF16, per GPU and format: fp8 ≈ 1.5 (an estimate;
# huggingface/flux-fast reports ~2.5x on an H100 with compile + FP8 attention + torchao float8 together); nvfp4 ≈ 2.4
# on a B200 (Sol-RL's own claim for rollouts); an H100 / H200 has no FP4 matmul, so an nvfp4 request runs fp8 there.
PREVIEW_SPEEDUP: dict[str, dict[str, float]] = {
    "h100": {"bf16": 1.0, "fp8": 1.5, "nvfp4": 1.5},
    "h200": {"bf16": 1.0, "fp8": 1.5, "nvfp4": 1.5},
    "b200": {"bf16": 1.0, "fp8": 1.5, "nvfp4": 2.4},
}
# the format a backend tag prices as: the fake-quant backends as the real format they emulate, int8 as fp8, the
# policy and its preview pass (`preview`) and diffusers' cache hooks (`cached`, conservatively: no speed-up counted,
# though a cache hit skips blocks) as BF16; `few_step` changes the rows, not their price
BACKEND_FORMAT = {
    "policy": "bf16", "preview": "bf16", "bf16": "bf16", "cached": "bf16", "few_step": "bf16",
    "fp8": "fp8", "fake_fp8": "fp8", "int8": "fp8",
    "nvfp4": "nvfp4", "fake_nvfp4": "nvfp4", "fake_mxfp4": "nvfp4", "mxfp4": "nvfp4",
}  # fmt: skip


def preview_speedup(backend: str, gpu: str) -> float:
    """Speed-up over BF16 of a forward at `backend` (a tag, possibly '+'-joined: the product) on `gpu`."""
    table = _gpu_table(PREVIEW_SPEEDUP, gpu)
    out = 1.0
    for part in backend.split("+"):
        if part not in BACKEND_FORMAT:
            raise ValueError(f"backend {part!r} (in {backend!r}) is not one of {', '.join(BACKEND_FORMAT)}")
        out *= table[BACKEND_FORMAT[part]]
    return out


def _gpu_table(table: dict, gpu: str):
    if gpu not in table:
        raise ValueError(f"gpu={gpu!r} is not one of {', '.join(table)}")
    return table[gpu]


# ---------------------------------------------------------------------------------------------------------------------
# one configuration's unit prices, and a step's price


@dataclass(frozen=True)
class RealSize:
    """The unit prices of one configuration (family, height x width [x frames], text tokens): the forward, a VAE
    decode per image (video), a text encode per prompt, and a reward forward per image by reward name."""

    family: str
    height: int
    width: int
    num_frames: int | None
    text_tokens: int
    forward: ForwardCost
    vae_decode_tflops: float
    text_tflops: float
    reward_tflops: dict[str, float] = field(default_factory=dict)

    @property
    def lora_backward_factor(self) -> float:
        return lora_backward_factor(self.forward)

    def reward(self, name: str) -> float:
        """TFLOP per image of reward `name` (those not given at construction: `reward_tflops(name)`)."""
        return self.reward_tflops[name] if name in self.reward_tflops else reward_tflops(name)


def real_size(
    family: str, height: int, width: int, num_frames: int | None = None, text_tokens: int | None = None, rewards=()
) -> RealSize:
    """The unit prices of `family` at height x width (x num_frames) with `text_tokens` text tokens and `rewards`."""
    _, height, width, frames, text = _key(family, height, width, num_frames, text_tokens)
    family = archs.get(family).key
    return RealSize(
        family=family,
        height=height,
        width=width,
        num_frames=frames,
        text_tokens=text,
        forward=transformer_forward(family, height, width, frames, text),
        vae_decode_tflops=vae_decode_tflops(family, height, width, frames),
        text_tflops=text_encode_tflops(family, text),
        reward_tflops={name: reward_tflops(name) for name in rewards},
    )


PHASES = ("rollout", "score", "train", "other")


def unit_price(kind: str, detail: str, size: RealSize, gpu: str) -> tuple[float, float]:
    """(TFLOP per count, speed-up over BF16) of one count of `kind`/`detail`; a ValueError for an unknown pair."""
    f = size.forward.tflops
    if kind == "forward":
        return f, preview_speedup(detail, gpu)
    if kind == "forward_grad":
        preview_speedup(detail, gpu)  # a known backend, priced under `forward`
        return 0.0, 1.0
    if kind == "recompute":
        return f, preview_speedup(detail, gpu)
    simple = {
        ("backward", "lora"): lora_backward_factor(size.forward) * f,
        ("backward", "full"): FULL_BACKWARD_FACTOR * f,
        ("decode", "images"): size.vae_decode_tflops,
        ("decode", "pixels"): 0.0,
        ("decode_backward", "images"): 2 * size.vae_decode_tflops,
        ("encode", "prompts"): size.text_tflops,
        ("encode", "tokens"): 0.0,
    }
    if (kind, detail) in simple:
        return simple[(kind, detail)], 1.0
    if kind == "reward":
        return size.reward(detail), 1.0
    if kind == "reward_backward":
        return 2 * size.reward(detail), 1.0
    kinds = "forward, forward_grad, recompute (/<backend>), reward, reward_backward (/<name>), " + ", ".join(
        "/".join(k) for k in simple
    )
    raise ValueError(f"{kind}/{detail} is not priced (one of: {kinds})")


def price(work: dict[str, float], size: RealSize, gpu: str, eta: float) -> dict:
    """GPU-seconds of one step's work (the work meter's `work/<phase>/<kind>/<detail>` counts; other keys are not
    work and are skipped) at `size` on `gpu` with efficiency `eta`: each count x its TFLOP / (peak BF16 x eta) /
    the backend's speed-up. {"seconds", "by_phase": {phase: s}, "by_kind": {kind: s}, "tflop"}; an unknown key
    under work/ is a ValueError naming it."""
    peak = _gpu_table(HARDWARE, gpu).bf16
    seconds, tflop = 0.0, 0.0
    by_phase: dict[str, float] = {}
    by_kind: dict[str, float] = {}
    for key, count in work.items():
        if not key.startswith("work/"):
            continue
        parts = key.split("/", 3)
        if len(parts) != 4 or parts[1] not in PHASES:
            raise ValueError(f"unknown work key {key!r}: expected work/<{'|'.join(PHASES)}>/<kind>/<detail>")
        _, phase, kind, detail = parts
        try:
            unit, speedup = unit_price(kind, detail, size, gpu)
        except ValueError as e:
            raise ValueError(f"unknown work key {key!r}: {e}") from None
        t = float(count) * unit
        s = t / (peak * eta) / speedup
        tflop += t
        seconds += s
        by_phase[phase] = by_phase.get(phase, 0.0) + s
        by_kind[kind] = by_kind.get(kind, 0.0) + s
    return {"seconds": seconds, "by_phase": by_phase, "by_kind": by_kind, "tflop": tflop}


# ---------------------------------------------------------------------------------------------------------------------
# calibration: the published iteration-time ratios the model must reproduce (docs/cost.md#calibration)

# (baseline rollout NFE, trained NFE), {variant: (rollout NFE, trained NFE, published speed-up)}
PUBLISHED = {
    "MixGRPO (arXiv 2507.21802), vs DanceGRPO 25/14": (
        (25, 14),
        {"MixGRPO 25/4": (25, 4, 1.93), "MixGRPO-Flash 16/4": (16, 4, 2.59), "MixGRPO-Flash* 8/4": (8, 4, 3.50)},
    ),
    "BranchGRPO (arXiv 2509.06040), vs DanceGRPO 20/20": (
        (20, 20),
        {
            "DanceGRPO tf=0.6 20/12": (20, 12, 1.49),
            "MixGRPO 20/5": (20, 5, 2.42),
            "BranchGRPO 13.68/13.68": (13.68, 13.68, 1.42),
            "BranchGRPO pruned 13.68/8.6": (13.68, 8.6, 2.22),
            "BranchGRPO-Mix 13.68/4.25": (13.68, 4.25, 4.72),
        },
    ),
}
CALIBRATION_SIZE = ("flux.1-dev", 720, 720, None, 512, ("hpsv2",))  # the papers' setting: FLUX.1-dev at 720 px, HPSv2


def sample_work(rollout_nfe: float, trained_nfe: float, reward: str = "hpsv2") -> dict[str, float]:
    """One sample's work in these papers' setting: `rollout_nfe` forwards without grad; `trained_nfe` forwards with
    grad, each with a full backward and checkpointing's recompute; one decode, one reward, one text encode."""
    return {
        "work/rollout/encode/prompts": 1,
        "work/rollout/forward/policy": rollout_nfe,
        "work/rollout/decode/images": 1,
        "work/score/reward/" + reward: 1,
        "work/train/forward/policy": trained_nfe,
        "work/train/forward_grad/policy": trained_nfe,
        "work/train/backward/full": trained_nfe,
        "work/train/recompute/policy": trained_nfe,
    }


def published_ratios(gpu: str = "h100", eta: float = ETA["research"]) -> dict[str, tuple[float, float]]:
    """{variant: (predicted speed-up vs its DanceGRPO baseline, published speed-up)} for every row of PUBLISHED,
    priced with `price` at CALIBRATION_SIZE."""
    size = real_size(*CALIBRATION_SIZE)
    out = {}
    for baseline, variants in PUBLISHED.values():
        base = price(sample_work(*baseline), size, gpu, eta)["seconds"]
        for name, (r, t, published) in variants.items():
            out[name] = (base / price(sample_work(r, t), size, gpu, eta)["seconds"], published)
    return out


def dancegrpo_eta() -> float:
    """The η implied by DanceGRPO's README (200 FLUX.1-dev iterations at 720 px on 16 H800 in ~12 h) and its
    16-GPU script (12 images per GPU an iteration, 16 steps, 9 trained with full fine-tuning and checkpointing)."""
    size = real_size(*CALIBRATION_SIZE)
    work = {k: 12 * v for k, v in sample_work(16, 9).items()}
    seconds_at_eta_1 = price(work, size, "h100", 1.0)["seconds"]
    return seconds_at_eta_1 / (12 * 3600 / 200)
