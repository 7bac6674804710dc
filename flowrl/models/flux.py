"""FLUX.1 (FluxPipeline): packed 2x2 latent tokens, distilled guidance embedding, resolution-dependent shift.

`guidance_scale` feeds the transformer's guidance embedding (FLUX.1-dev); FLUX has no true CFG here, so a
single forward per step is made, as in the pipeline's default.
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.models.lora import JOINT_ATTENTION_TARGETS
from flowrl.models.pipeline import PackedLatentsMixin, PipelineFlowModel
from flowrl.types import Cond


class FluxFlowModel(PackedLatentsMixin, PipelineFlowModel):
    family = "flux"
    max_sequence_length = 512  # the pipeline's default
    default_guidance_scale = 3.5
    lora_target_modules = JOINT_ATTENTION_TARGETS

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

    def custom_sigmas(self, num_steps: int) -> list[float] | None:
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):
            return None
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()

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

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = self._unpacked(latents).to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]
