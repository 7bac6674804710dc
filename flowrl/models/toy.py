"""The embedded toy model: a text-conditioned flow-matching UNet over the Shapes world's 32x32 pixels.

Denoiser: diffusers' `UNet2DConditionModel` in pixel space. Latents are the pixels in [-1, 1], [N, 3, 32, 32];
inside `velocity` they are packed into 2x2 patches ([N, 12, 16, 16], like FLUX's packed latents), so the UNet
runs at 16, 8 and 4 px with cross-attention at 8 and 4. Quick measurements on this shared 2-core machine
(fwd+bwd, CPU seconds per step): a full-resolution 32 px UNet with cross-attention at 16 px costs 2.9 s at
batch 64, the 32 px UNet with attention at 8 px only 0.58 s at batch 32, this packed UNet 0.33 s at batch 32;
SD3Transformer2DModel with patch 2 costs 0.85 s/step at batch 64 and its patch-4 variant draws 4x4 blocks
(docs/toy.md#shipped-model). The packed convolutional UNet is the one that fits the 30-minute budget.

Text encoder: a tiny transformers `CLIPTextModel` over a word-level vocabulary of the grammar (the grammar is
closed, so one token per word is exact and needs no tokenizer file); its contextual embeddings let
cross-attention bind "red" to "circles". It is trained jointly during pretraining and frozen afterwards.
Training drops the prompt to "" 10% of the time, so classifier-free guidance is meaningful.

Toy image-to-video ("toy I2V"): `source_weight` W > 0 conditions the model on a source image as well (a one-frame
image-to-video model; `conditioning = "image"`, the source from `metadata["image"]`,
docs/models.md#conditioning-images). The UNet is not retrained: `velocity` pulls the denoised estimate toward the
source in proportion to the noise level (see `ToyFlowModel.velocity`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from flowrl import work
from flowrl.models.lora import LoRAMixin
from flowrl.models.precision import AutocastMixin
from flowrl.schedules import scheduler_sigmas
from flowrl.toy.manifest import weights_or_checkpoint
from flowrl.toy.world import COLOURS, COUNTS, IMAGE_SIZE, SHAPES, parse_pair_prompt, parse_prompt
from flowrl.types import Cond

MODEL_FILE = "toy_model.safetensors"  # in flowrl/toy/weights/, checked by flowrl.toy.manifest

# word-level vocabulary: special tokens, then every word of the grammar (singular and plural shapes)
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>")
VOCAB = {word: i for i, word in enumerate(SPECIAL_TOKENS + COUNTS + COLOURS + SHAPES + tuple(s + "s" for s in SHAPES))}
MAX_LENGTH = 5  # <bos> count colour shape <eos>

# The second toy model reads both grammars: the first's words, then those of GenEval's two-object and position prompts
# ("a red circle and a blue square", "a red circle left of a blue square"; docs/toy.md#geneval-families).
GRAMMARS = ("shapes", "geneval")
GENEVAL_MODEL_FILE = "toy_geneval_model.safetensors"  # in flowrl/toy/weights/, checked by flowrl.toy.manifest
PAIR_WORDS = ("a", "and", "left", "right", "of", "above", "below")
GENEVAL_VOCAB = {word: i for i, word in enumerate((*VOCAB, *PAIR_WORDS))}  # VOCAB's ids, then the pair words
GENEVAL_MAX_LENGTH = 10  # <bos> a colour shape left of a colour shape <eos>

PATCH = 2  # the UNet sees 2x2 pixel patches packed into channels: [N, 3, 32, 32] <-> [N, 12, 16, 16]
UNET_CONFIG = dict(
    sample_size=IMAGE_SIZE // PATCH,
    in_channels=3 * PATCH**2,
    out_channels=3 * PATCH**2,
    block_out_channels=(32, 64, 64),
    layers_per_block=1,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=64,
    attention_head_dim=8,
    norm_num_groups=8,
)
TEXT_CONFIG = dict(
    vocab_size=len(VOCAB),
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=MAX_LENGTH,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    projection_dim=64,
)
GENEVAL_TEXT_CONFIG = {**TEXT_CONFIG, "vocab_size": len(GENEVAL_VOCAB), "max_position_embeddings": GENEVAL_MAX_LENGTH}
SCHEDULER_CONFIG = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 1.0}
DEFAULT_NUM_STEPS = 10
DEFAULT_GUIDANCE_SCALE = 1.0  # the learned conditional; CFG 3 raises held-out accuracy from 34% to 58%


def tokenize(prompts: list[str], grammar: str = "shapes") -> torch.Tensor:
    """Token ids [N, L]; "" is the unconditional prompt, anything else must parse in the grammar. `grammar` "shapes"
    (L = MAX_LENGTH): the first grammar's prompts; "geneval" (L = GENEVAL_MAX_LENGTH): those and the pair prompts."""
    if grammar not in GRAMMARS:
        raise ValueError(f"toy grammar={grammar!r} is unknown; use one of {', '.join(GRAMMARS)}")
    vocab, length = (VOCAB, MAX_LENGTH) if grammar == "shapes" else (GENEVAL_VOCAB, GENEVAL_MAX_LENGTH)
    rows = []
    for prompt in prompts:
        words = [] if prompt.strip() == "" else _words(prompt, grammar)
        ids = [vocab["<bos>"]] + [vocab[w] for w in words] + [vocab["<eos>"]]
        rows.append(ids + [vocab["<pad>"]] * (length - len(ids)))
    return torch.tensor(rows, dtype=torch.long)  # [N, L]


def _words(prompt: str, grammar: str) -> list[str]:
    """The prompt's words as its grammar writes them (ValueError quoting the grammar for anything else)."""
    if grammar == "shapes":
        return parse_prompt(prompt).prompt.split()
    try:
        return parse_prompt(prompt).prompt.split()
    except ValueError:
        pass
    try:
        return parse_pair_prompt(prompt).prompt.split()
    except ValueError as error:
        raise ValueError(f"{error} (the geneval toy model also reads the first grammar's prompts)") from None


def pack(latents: torch.Tensor) -> torch.Tensor:
    """Pixels [N, 3, H, W] -> UNet input [N, 12, H/2, W/2] (2x2 patches into channels, as FLUX packs latents)."""
    return torch.nn.functional.pixel_unshuffle(latents, PATCH)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """UNet output [N, 12, H/2, W/2] -> pixels [N, 3, H, W]; the inverse of `pack`."""
    return torch.nn.functional.pixel_shuffle(packed, PATCH)


def build_unet():
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(**UNET_CONFIG)


def build_text_encoder(grammar: str = "shapes"):
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(**(TEXT_CONFIG if grammar == "shapes" else GENEVAL_TEXT_CONFIG)))


class ToyFlowModel(LoRAMixin, AutocastMixin):
    """FlowModel over the Shapes world (flowrl.types.FlowModel); latents [N, 3, 32, 32] are pixels in [-1, 1]."""

    family = "toy"
    is_video = False
    default_num_steps = DEFAULT_NUM_STEPS
    default_guidance_scale = DEFAULT_GUIDANCE_SCALE

    def __init__(
        self,
        transformer,
        text_encoder,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        source_weight: float = 0.0,
        grammar: str = "shapes",
    ):
        if grammar not in GRAMMARS:
            raise ValueError(f"model.family_kwargs.grammar={grammar!r} is unknown; use one of {', '.join(GRAMMARS)}")
        if not source_weight >= 0.0:
            raise ValueError(
                f"model.family_kwargs.source_weight={source_weight!r} must be >= 0 (0: the text-only model)"
            )
        self.device = torch.device(device)
        self.dtype = dtype
        # (diffusers warns on any .to(dtype), so cast only when the dtype changes)
        cast = {"dtype": dtype} if next(transformer.parameters()).dtype != dtype else {}
        self.transformer = transformer.to(self.device, **cast).eval()  # the UNet; training updates it
        work.meter_transformer(self.transformer)  # the work meter counts every forward (flowrl.work)
        self.text_encoder = text_encoder.to(self.device, dtype).eval().requires_grad_(False)
        self._cache: dict[str, torch.Tensor] = {}  # prompt -> [L, D]
        self.source_weight = float(source_weight)
        self.grammar = grammar  # the prompts `embed` reads (`tokenize`)
        if self.source_weight > 0.0:  # an instance attribute only here: the text-only model has no `conditioning`
            self.conditioning = "image"
            self._source_cache: dict[tuple[str, int, int], torch.Tensor] = {}  # (path, H, W) -> [3, H, W] in [-1, 1]

    # -- conditioning -------------------------------------------------------------------------------------
    def embed(self, prompts: list[str]) -> torch.Tensor:
        """Text embeddings [N, L, D] through the text encoder (with grad if the caller allows it)."""
        ids = tokenize(prompts, self.grammar).to(self.device)  # [N, L]
        work.encoded(ids.shape[0], ids.numel())
        return self.text_encoder(input_ids=ids).last_hidden_state

    def _cached(self, prompts: list[str]) -> torch.Tensor:
        # one prompt per text-encoder call, so an embedding never depends on the batch it came with
        with torch.no_grad():
            for prompt in dict.fromkeys(p for p in prompts if p not in self._cache):
                self._cache[prompt] = self.embed([prompt])[0]
        return torch.stack([self._cache[p] for p in prompts])  # [N, L, D]

    def uses_cfg(self, guidance_scale: float) -> bool:
        """Whether `guidance_scale` means true classifier-free guidance (two branches): any scale above 1."""
        return guidance_scale > 1.0

    def encode(
        self,
        prompts: list[str],
        negative_prompt: str = "",
        guidance_scale: float = 1.0,
        images: list[str] | None = None,
        size: tuple[int, int, int | None] | None = None,
    ) -> Cond:
        """Prompts [N] (and, with source_weight > 0, each one's source image path and the sample size (height, width,
        num_frames) it is resized to; flowrl.models.conditioning.encode_prompts hands both)."""
        for prompt in prompts:  # "" is the unconditional (negative) prompt only: a blank prompt is refused as any other
            if not prompt.strip():
                _words(prompt, self.grammar)
        if getattr(self, "conditioning", None) is None:
            if images is not None and any(i is not None for i in images):
                raise ValueError(f"images={images[:1]!r}...: the {self.family} model is text-only; pass no images")
        elif images is None or size is None or len(images) != len(prompts) or any(i is None for i in images):
            raise ValueError(
                f"the {self.family} model with source_weight={self.source_weight} needs one source image per prompt "
                "and the sample size; encode through flowrl.models.conditioning.encode_prompts"
            )
        cond = {"prompt_embeds": self._cached(list(prompts))}  # [N, L, D]
        if guidance_scale > 1.0:
            cond["negative_prompt_embeds"] = self._cached([negative_prompt] * len(prompts))  # [N, L, D]
        if getattr(self, "conditioning", None) is not None:
            height, width = size[0], size[1]
            self.latent_shape(height, width)  # the size checks
            cond["source_latents"] = torch.stack([self._source(p, height, width) for p in images])  # [N, 3, H, W]
        return cond

    def _source(self, path: str, height: int, width: int) -> torch.Tensor:
        """A source image as latents [3, H, W] in [-1, 1], resized to the sample size (cached by path and size)."""
        key = (path, height, width)
        if key not in self._source_cache:
            from PIL import Image

            from flowrl.models.conditioning import source_image

            image = source_image(path, height, width)  # the shared aspect check and one-line file errors
            if image.size != (width, height):
                image = image.resize((width, height), Image.Resampling.BICUBIC)
            from flowrl.media import pil_to_tensor

            pixels = pil_to_tensor(image)  # [3, H, W] in [0, 1]
            self._source_cache[key] = (pixels * 2.0 - 1.0).to(self.device)
        return self._source_cache[key]

    # -- geometry and time ------------------------------------------------------------------------------
    @property
    def native_size(self) -> tuple[int, int, None]:
        """(height, width, num_frames) the model was trained at."""
        return IMAGE_SIZE, IMAGE_SIZE, None

    def latent_shape(
        self, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, num_frames: int | None = None
    ) -> tuple[int, ...]:
        if height % 8 or width % 8 or height <= 0 or width <= 0:
            raise ValueError(f"toy model height={height} width={width}: use positive multiples of 8 (trained at 32)")
        return (3, height, width)

    def prepare_latents(
        self, num: int, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, generator=None, num_frames=None
    ) -> torch.Tensor:
        shape = self.latent_shape(height, width)
        if isinstance(generator, list):
            return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generator]).to(
                self.device
            )
        return torch.randn((num, *shape), generator=generator, dtype=torch.float32).to(self.device)  # [N, 3, H, W]

    def sigmas(
        self, num_steps: int, height: int = IMAGE_SIZE, width: int = IMAGE_SIZE, num_frames=None
    ) -> torch.Tensor:
        """[T+1]: FLUX-style custom grid linspace(1, 1/T, T) through the scheduler, then 0 (all steps useful)."""
        grid = np.linspace(1.0, 1.0 / num_steps, num_steps)
        return scheduler_sigmas(SCHEDULER_CONFIG, num_steps, sigmas=grid)

    # -- denoiser ---------------------------------------------------------------------------------------
    def velocity(
        self, latents: torch.Tensor, sigma: float | torch.Tensor, cond: Cond, guidance_scale: float = 1.0
    ) -> torch.Tensor:
        """Velocity [N, 3, H, W] of the text-conditioned UNet (CFG inside); with source_weight W > 0, pulled toward the
        source: with x0_hat = x - sigma * v the denoised estimate of v (after CFG), it returns
        v_c = v - W * (source - x0_hat), whose denoised estimate x - sigma * v_c is
        x0_c = x0_hat + W * sigma * (source - x0_hat): the estimate moved toward the source in proportion to the noise
        level, vanishing as sigma -> 0. So the source sets the layout in the early, noisy steps and the model finishes
        the image in the late ones. Gradients flow through v (the LoRA trains through it); the source is a constant."""
        v = self._text_velocity(latents, sigma, cond, guidance_scale)
        if getattr(self, "conditioning", None) is None:
            return v
        if "source_latents" not in cond:
            raise ValueError(
                f"the {self.family} model with source_weight={self.source_weight} needs cond['source_latents']: "
                "encode through flowrl.models.conditioning.encode_prompts with each prompt's source image"
            )
        n = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=v.device).reshape(-1).expand(n)[:, None, None, None]
        x0_hat = latents.float() - sigma * v  # [N, 3, H, W]
        return v - self.source_weight * (cond["source_latents"].float() - x0_hat)

    def _text_velocity(
        self, latents: torch.Tensor, sigma: float | torch.Tensor, cond: Cond, guidance_scale: float
    ) -> torch.Tensor:
        n = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(n)  # [N]
        embeds = cond["prompt_embeds"]
        x = latents.to(self.dtype)
        if guidance_scale > 1.0:
            if "negative_prompt_embeds" not in cond:
                raise ValueError(
                    f"guidance_scale={guidance_scale} needs cond from encode(..., guidance_scale={guidance_scale})"
                )
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])  # [2N, L, D]
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        with self.autocast():
            out = unpack(
                self.transformer(pack(x), sigma * 1000.0, encoder_hidden_states=embeds.to(self.dtype)).sample
            ).float()
        if guidance_scale > 1.0:
            uncond, text = out.chunk(2)
            return uncond + guidance_scale * (text - uncond)  # [N, 3, H, W]
        return out

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return work.decoded((latents.float() / 2 + 0.5).clamp(0, 1))  # [N, 3, H, W]

    def enable_gradient_checkpointing(self) -> None:
        self.transformer.enable_gradient_checkpointing()

    def trainable_sigma_range(self) -> tuple[float, float]:
        """[lo, hi]: the σ at which `velocity` runs the trained module; every σ (two-expert families narrow it)."""
        return 0.0, 1.0


# ---- shipped weights ------------------------------------------------------------------------------------


def toy_model_from_state_dict(
    state: dict[str, torch.Tensor],
    device="cpu",
    dtype=torch.float32,
    source_weight: float = 0.0,
    grammar: str = "shapes",
) -> ToyFlowModel:
    if grammar not in GRAMMARS:
        raise ValueError(f"model.family_kwargs.grammar={grammar!r} is unknown; use one of {', '.join(GRAMMARS)}")
    unet, text_encoder = build_unet(), build_text_encoder(grammar)
    unet.load_state_dict(
        {k[len("transformer.") :]: v.float() for k, v in state.items() if k.startswith("transformer.")}
    )
    text_encoder.load_state_dict(
        {k[len("text_encoder.") :]: v.float() for k, v in state.items() if k.startswith("text_encoder.")}, strict=False
    )
    return ToyFlowModel(unet, text_encoder, device=device, dtype=dtype, source_weight=source_weight, grammar=grammar)


def load_toy_model(
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    checkpoint: str | Path | None = None,
    source_weight: float = 0.0,
    grammar: str = "shapes",
) -> ToyFlowModel:
    """The shipped toy model (size and sha256 checked), or a checkpoint file written by scripts/pretrain_toy.py;
    `source_weight` > 0 makes it the toy image-to-video model (`ToyFlowModel.velocity`). `grammar` "geneval" loads the
    second shipped model, which reads the GenEval families' prompts as well (`GENEVAL_MODEL_FILE`, its checkpoints
    from `scripts/pretrain_toy.py --grammar geneval`)."""
    from safetensors.torch import load_file

    if grammar not in GRAMMARS:
        raise ValueError(f"model.family_kwargs.grammar={grammar!r} is unknown; use one of {', '.join(GRAMMARS)}")
    path = weights_or_checkpoint(MODEL_FILE if grammar == "shapes" else GENEVAL_MODEL_FILE, checkpoint)
    return toy_model_from_state_dict(
        load_file(str(path)), device=device, dtype=dtype, source_weight=source_weight, grammar=grammar
    )
