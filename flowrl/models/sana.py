"""SANA (SanaPipeline): linear-attention DiT on a deep-compression autoencoder, Gemma-2 text encoder, true CFG.

SANA checkpoints ship a multistep (DPM-Solver) scheduler; flowrl steps with the flow-matching Euler grid at
the checkpoint's flow shift (its scheduler config's `flow_shift`, or `shift`).
"""

from __future__ import annotations

import inspect

import torch

from flowrl.models.pipeline import PipelineFlowModel
from flowrl.types import Cond


class SanaFlowModel(PipelineFlowModel):
    family = "sana"
    max_sequence_length = 300  # the pipeline's default
    default_guidance_scale = 4.5
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")

    def __init__(self, pipe, device="cpu", dtype=torch.float32):
        super().__init__(pipe, device, dtype)
        # The pipeline's default instruction prepended to every prompt (part of what SANA was trained on).
        self.complex_human_instruction = (
            inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default
        )
        self.scheduler_config = _flow_euler_config(pipe.scheduler.config)

    def sigmas(self, num_steps, height, width, num_frames=None):
        from flowrl import schedules

        return schedules.scheduler_sigmas(self.scheduler_config, num_steps)

    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        cfg = negative_prompt is not None
        embeds, mask, neg_embeds, neg_mask = self.pipe.encode_prompt(
            prompts,
            cfg,
            negative_prompt=negative_prompt or "",
            num_images_per_prompt=1,
            device=self.device,
            clean_caption=False,
            max_sequence_length=self.max_sequence_length,
            complex_human_instruction=self.complex_human_instruction,
        )
        cond = {"prompt_embeds": embeds, "prompt_attention_mask": mask}  # [N, L, D], [N, L]
        if cfg:
            cond.update(negative_prompt_embeds=neg_embeds, negative_prompt_attention_mask=neg_mask)
        return cond

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        from flowrl.sde import timesteps_from_sigmas

        timestep = timesteps_from_sigmas(sigma)
        embeds, mask = cond["prompt_embeds"], cond["prompt_attention_mask"]
        cfg = self.uses_cfg(guidance_scale)
        if cfg:
            latents = torch.cat([latents, latents])
            timestep = torch.cat([timestep, timestep])
            embeds = torch.cat([cond["negative_prompt_embeds"], embeds])
            mask = torch.cat([cond["negative_prompt_attention_mask"], mask])
        out = self.transformer(
            latents,
            encoder_hidden_states=embeds.to(latents.dtype),
            encoder_attention_mask=mask,
            timestep=timestep * self.transformer.config.timestep_scale,
            return_dict=False,
        )[0].float()
        if cfg:
            uncond, text = out.chunk(2)
            out = uncond + guidance_scale * (text - uncond)
        if self.transformer.config.out_channels // 2 == latents.shape[1]:  # learned-sigma heads
            out = out.chunk(2, dim=1)[0]
        return out

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        image = vae.decode(latents.to(vae.dtype) / vae.config.scaling_factor, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]


def _flow_euler_config(config) -> dict:
    """A FlowMatchEulerDiscreteScheduler config for a SANA checkpoint's scheduler config."""
    if config.get("_class_name") == "FlowMatchEulerDiscreteScheduler":
        return dict(config)
    return {
        "num_train_timesteps": config.get("num_train_timesteps", 1000),
        "shift": float(config.get("flow_shift", 1.0) or 1.0),
    }
