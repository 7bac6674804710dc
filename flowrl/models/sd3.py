"""Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline): MMDiT on 16-channel VAE latents, true CFG."""

from __future__ import annotations

import torch

from flowrl.models.lora import JOINT_ATTENTION_TARGETS
from flowrl.models.pipeline import PipelineFlowModel
from flowrl.types import Cond


class SD3FlowModel(PipelineFlowModel):
    family = "sd3"
    max_sequence_length = 256  # the pipeline's default
    default_guidance_scale = 4.5
    lora_target_modules = JOINT_ATTENTION_TARGETS

    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        cfg = negative_prompt is not None
        embeds, neg_embeds, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompts,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=cfg,
            negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
            max_sequence_length=self.max_sequence_length,
        )
        cond = {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}  # [N, L, D], [N, P]
        if cfg:
            cond.update(negative_prompt_embeds=neg_embeds, negative_pooled_prompt_embeds=neg_pooled)
        return cond

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        from flowrl.sde import timesteps_from_sigmas

        timestep = timesteps_from_sigmas(sigma)  # [N]
        embeds, pooled = cond["prompt_embeds"], cond["pooled_prompt_embeds"]
        cfg = self.uses_cfg(guidance_scale)
        if cfg:  # one batched call over [uncond; cond], as the pipeline does
            latents = torch.cat([latents, latents])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            pooled = torch.cat([cond["negative_pooled_prompt_embeds"], pooled])
        out = self.transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=embeds,  # float32, as the pipeline
            pooled_projections=pooled,
            return_dict=False,
        )[0]
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + guidance_scale * (text - uncond)
        return out

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]
