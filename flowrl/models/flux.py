"""FLUX.1 (FluxPipeline): packed 2x2 latent tokens, distilled guidance embedding, resolution-dependent shift.

`guidance_scale` feeds the transformer's guidance embedding (FLUX.1-dev); FLUX has no true CFG here, so a
single forward per step is made, as in the pipeline's default.
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.models.lora import JOINT_ATTENTION_TARGETS
from flowrl.models.pipeline import PipelineFlowModel
from flowrl.types import Cond


class FluxFlowModel(PipelineFlowModel):
    family = "flux"
    pipeline_classes = ("FluxPipeline",)
    max_sequence_length = 512  # the pipeline's default
    default_guidance_scale = 3.5
    lora_target_modules = JOINT_ATTENTION_TARGETS

    def __init__(self, pipe, device="cpu", dtype=torch.float32):
        super().__init__(pipe, device, dtype)
        self._grid_by_seq_len: dict[int, tuple[int, int]] = {}  # token count -> packed (h, w), for image ids

    def uses_cfg(self, guidance_scale: float) -> bool:
        return False

    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        embeds, pooled, _text_ids = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
        )
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}  # [N, L, D], [N, P]

    def size_factor(self) -> int:
        return self.pipe.vae_scale_factor * 2

    def _latent_hw(self, height: int, width: int) -> tuple[int, int]:
        f = self.pipe.vae_scale_factor * 2
        return 2 * (height // f), 2 * (width // f)

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        h, w = self._latent_hw(height, width)
        seq_len = (h // 2) * (w // 2)
        self._grid_by_seq_len[seq_len] = (h // 2, w // 2)
        return (seq_len, self.transformer.config.in_channels)  # packed tokens [L, 4C]

    def image_seq_len(self, height: int, width: int, num_frames: int | None = None) -> int:
        return self.latent_shape(height, width)[0]

    def _noise_shape(self, num, height, width, num_frames):
        h, w = self._latent_hw(height, width)
        self.latent_shape(height, width)
        return (num, self.transformer.config.in_channels // 4, h, w)

    def _pack(self, noise: torch.Tensor) -> torch.Tensor:
        n, c, h, w = noise.shape
        return self.pipe._pack_latents(noise, n, c, h, w)

    def custom_sigmas(self, num_steps: int) -> list[float] | None:
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):
            return None
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()

    def _grid(self, seq_len: int) -> tuple[int, int]:
        if seq_len in self._grid_by_seq_len:
            return self._grid_by_seq_len[seq_len]
        side = int(round(seq_len**0.5))
        if side * side != seq_len:
            raise ValueError(f"cannot infer the latent grid of {seq_len} FLUX tokens; call latent_shape(height, width) first")
        return side, side

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        from flowrl.sde import timesteps_from_sigmas

        n, seq_len, _ = latents.shape
        gh, gw = self._grid(seq_len)
        img_ids = self.pipe._prepare_latent_image_ids(n, gh, gw, latents.device, latents.dtype)
        embeds = cond["prompt_embeds"]
        txt_ids = torch.zeros(embeds.shape[1], 3, device=latents.device, dtype=embeds.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([n], guidance_scale, device=latents.device, dtype=torch.float32)
        timestep = timesteps_from_sigmas(sigma).to(latents.dtype) / 1000  # the pipeline's t / 1000
        return self.transformer(
            hidden_states=latents,
            timestep=timestep,
            guidance=guidance,
            pooled_projections=cond["pooled_prompt_embeds"],
            encoder_hidden_states=embeds,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        gh, gw = self._grid(latents.shape[1])
        f = self.pipe.vae_scale_factor
        latents = self.pipe._unpack_latents(latents, gh * 2 * f, gw * 2 * f, f)
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]
