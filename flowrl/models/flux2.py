"""FLUX.2 (Flux2Pipeline, [dev]) and FLUX.2 [klein] (Flux2KleinPipeline): an MMDiT with fused single-stream blocks on
2x2-patchified, batch-normalised FLUX.2-VAE latents, packed one token per patch; 4-axis position ids.

[dev] (Mistral-3 text encoder) feeds `guidance_scale` to a distilled guidance embedding, one forward per step.
[klein] (Qwen3 text encoder) runs true CFG with two calls against the empty prompt, unless the checkpoint is
step-distilled (`is_distilled` in its model_index.json), which ignores guidance as the pipeline does. Prompts are
padded to `max_sequence_length` tokens by the pipeline itself, so every prompt has the same length. The σ grid is
the pipeline's `linspace(1, 1/T, T)` with FLUX.2's empirical μ (`schedules.flux2_shift`, which moves with T).
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.models.lora import JOINT_ATTENTION_TARGETS
from flowrl.models.pipeline import PackedLatentsMixin, PipelineFlowModel
from flowrl.types import Cond


class Flux2FlowModel(PackedLatentsMixin, PipelineFlowModel):
    family = "flux2"
    max_sequence_length = 512  # both pipelines' default
    default_guidance_scale = 4.0  # both pipelines' default
    # the double-stream attention and the single-stream blocks' fused QKV + MLP input projection
    lora_target_modules = (*JOINT_ATTENTION_TARGETS, "attn.to_qkv_mlp_proj")

    def __init__(self, pipe, device="cpu", dtype=torch.float32):
        super().__init__(pipe, device, dtype)
        self.klein = type(pipe).__name__ == "Flux2KleinPipeline"
        self.distilled = self.klein and bool(pipe.config.get("is_distilled", False))
        if self.distilled:
            self.default_guidance_scale = 1.0

    def uses_cfg(self, guidance_scale: float) -> bool:
        return self.klein and not self.distilled and guidance_scale > 1.0

    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        def embeds(texts):
            out, _text_ids = self.pipe.encode_prompt(
                prompt=texts, device=self.device, num_images_per_prompt=1, max_sequence_length=self.max_sequence_length
            )
            return out  # [N, L, D]

        cond = {"prompt_embeds": embeds(prompts)}
        if negative_prompt is not None:
            cond["negative_prompt_embeds"] = embeds([negative_prompt] * len(prompts))
        return cond

    # ----------------------------------------------------------------------------------------- latents
    def _noise_shape(self, num, height, width, num_frames):
        h, w = self._latent_hw(height, width)
        self.latent_shape(height, width)
        return (num, self.transformer.config.in_channels, h // 2, w // 2)  # already patchified channels

    def _pack(self, noise: torch.Tensor) -> torch.Tensor:
        return self.pipe._pack_latents(noise)

    def custom_sigmas(self, num_steps: int) -> list[float] | None:
        if self.pipe.scheduler.config.get("use_flow_sigmas", False):
            return None
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()

    def shift_mu(self, num_steps, height, width, num_frames=None) -> float:
        from flowrl import schedules

        return schedules.flux2_shift(self.image_seq_len(height, width), num_steps)

    # ----------------------------------------------------------------------------------------- network
    def _forward(self, latents, timestep, guidance, embeds, img_ids):
        return self.transformer(
            hidden_states=latents,
            timestep=timestep,
            guidance=guidance,
            encoder_hidden_states=embeds,
            txt_ids=self.pipe._prepare_text_ids(embeds).to(latents.device),
            img_ids=img_ids,
            return_dict=False,
        )[0][:, : latents.shape[1]]

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        from flowrl.sde import timesteps_from_sigmas

        n, seq_len, _ = latents.shape
        img_ids = self.pipe._prepare_latent_ids(latents.new_empty(n, 0, *self._grid(seq_len))).to(latents.device)
        timestep = timesteps_from_sigmas(sigma).to(latents.dtype) / 1000  # the pipeline's t / 1000
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full([n], guidance_scale, device=latents.device, dtype=torch.float32)
        out = self._forward(latents, timestep, guidance, cond["prompt_embeds"], img_ids)
        if self.uses_cfg(guidance_scale):
            neg = self._forward(latents, timestep, guidance, cond["negative_prompt_embeds"], img_ids)
            out = neg + guidance_scale * (out - neg)
        return out

    def pipeline_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """Packed tokens [N, L, 4C] -> the VAE's latents [N, C, H/8, W/8] (what [klein] returns as "latent" output)."""
        gh, gw = self._grid(latents.shape[1])
        ids = self.pipe._prepare_latent_ids(latents.new_empty(latents.shape[0], 0, gh, gw)).to(latents.device)
        latents = self.pipe._unpack_latents_with_ids(latents, ids)  # [N, 4C, h/2, w/2]
        vae = self.pipe.vae
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
            latents.device, latents.dtype
        )
        return self.pipe._unpatchify_latents(latents * std + mean)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        image = vae.decode(self.pipeline_latents(latents.to(vae.dtype)), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]
