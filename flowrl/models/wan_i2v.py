"""Wan image-to-video (WanImageToVideoPipeline): Wan's video DiT denoising noise beside a conditioning video made
from the source image.

Each sample's source image is resized to the sample's height x width and encoded, as the pipeline does, into the
VAE latents of [image, F-1 black frames] with a first-frame mask (4 + 16 channels concatenated to the noise's 16 at
every call) and, where the checkpoint has an image encoder (Wan 2.1 I2V: CLIP vision, its second-last hidden
states), into image tokens the transformer cross-attends to (`encoder_hidden_states_image`). Both branches of CFG
see the same image. Guidance, the σ grid, two experts (Wan 2.2 I2V A14B) and decoding are Wan's (wan.py). The
TI2V-5B image-to-video mode (`expand_timesteps`: the first latent frame replaced by the image's) is refused
(docs/models.md#wan-image-to-video).
"""

from __future__ import annotations

import torch

from flowrl.models.conditioning import source_image
from flowrl.models.wan import WanFlowModel
from flowrl.types import Cond


class WanI2VFlowModel(WanFlowModel):
    family = "wan_i2v"
    conditioning = "image"

    def __init__(self, pipe, device="cpu", dtype=torch.float32, train_expert: str = "high"):
        if pipe.config.get("expand_timesteps", False):
            raise ValueError(
                "WanImageToVideoPipeline with expand_timesteps (Wan 2.2 TI2V-5B's image-to-video mode) is not "
                "supported; use the checkpoint as a text-to-video WanPipeline, or a Wan 2.1 / 2.2 A14B image-to-video "
                "checkpoint"
            )
        super().__init__(pipe, device, dtype, train_expert)

    @property
    def noise_dtype(self) -> torch.dtype:
        return torch.float32  # the pipeline draws its noise in float32 whatever the weights' dtype

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        c, f, h, w = super().latent_shape(height, width, num_frames)
        return (self.pipe.vae.config.z_dim, f, h, w)  # the noise's channels (the transformer's are noise + condition)

    def _encode_batch(self, prompts, negative_prompt):
        raise ValueError(
            f"the {self.family} model needs a source image per prompt; encode through flowrl.models.conditioning"
        )

    def _encode_source(self, prompt: str, negative_prompt: str | None, path: str, size: tuple) -> Cond:
        height, width, num_frames = size
        self.check_size(height, width, num_frames)
        image = source_image(path, height, width)
        cond = super()._encode_batch([prompt], negative_prompt)  # [1, L, D] (and the negative)
        module = self.pipe.transformer if self.pipe.transformer is not None else self.pipe.transformer_2
        if module.config.image_dim is not None:  # Wan 2.1 I2V's CLIP image tokens
            cond["image_embeds"] = self.pipe.encode_image(image, self.device)  # [1, L_img, D_img]
        pixels = self.pipe.video_processor.preprocess(image, height=height, width=width).to(self.device, torch.float32)
        shape = (1, *self.latent_shape(height, width, num_frames))
        placeholder = torch.zeros(shape, device=self.device)  # the pipeline's own prepare_latents, noise not drawn
        _, condition = self.pipe.prepare_latents(
            pixels, 1, shape[1], height, width, num_frames, torch.float32, self.device, None, placeholder
        )
        cond["condition"] = condition  # [1, 4 + C, F', h, w] first-frame mask and the image video's latents
        return cond

    def _guided(self, module, latents, timestep, cond, guidance_scale):
        hidden = torch.cat([latents, cond["condition"].to(latents.dtype)], dim=1)
        image = cond.get("image_embeds")
        image = None if image is None else image.to(latents.dtype)

        def forward(embeds):
            return module(
                hidden_states=hidden,
                timestep=timestep,
                encoder_hidden_states=embeds,
                encoder_hidden_states_image=image,
                return_dict=False,
            )[0]

        out = forward(cond["prompt_embeds"])
        if self.uses_cfg(guidance_scale):
            uncond = forward(cond["negative_prompt_embeds"])
            out = uncond + guidance_scale * (out - uncond)
        return out
