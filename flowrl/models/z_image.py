"""Z-Image (ZImagePipeline): a single-stream DiT over image and caption tokens on FLUX.1-VAE latents, Qwen3 text
encoder, and the pipeline's own guidance convention.

The pipeline's guidance is `pos + s·(pos − neg)` (CFG at scale 1 + s), on whenever s > 0; s = 0 is a single
forward (what Z-Image-Turbo is run with). flowrl follows it: here `guidance_scale` is that s, not the usual
"1 = no guidance". The transformer takes lists of per-sample latents and of per-prompt caption embeddings of each
prompt's own length, is fed 1 − σ as its time, and predicts the negated velocity; the adapter negates it back.
Noise is drawn in float32 whatever the weights' dtype, as the pipeline does. The pipeline's optional
`cfg_normalization` and `cfg_truncation` (off by default) are not offered.
"""

from __future__ import annotations

import torch

from flowrl.models.pipeline import PipelineFlowModel
from flowrl.types import Cond


class ZImageFlowModel(PipelineFlowModel):
    family = "z_image"
    max_sequence_length = 512  # the pipeline's default
    default_guidance_scale = 5.0  # the pipeline's default (Turbo checkpoints are run with 0)
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")

    def uses_cfg(self, guidance_scale: float) -> bool:
        return guidance_scale > 0.0

    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        def padded(texts):
            (embeds,) = self.pipe._encode_prompt(
                prompt=list(texts), device=self.device, max_sequence_length=self.max_sequence_length
            )
            pad = self.max_sequence_length - embeds.shape[0]  # the pipeline keeps only the prompt's own tokens
            mask = torch.cat([torch.ones(embeds.shape[0], dtype=torch.bool), torch.zeros(pad, dtype=torch.bool)])
            return torch.cat([embeds, embeds.new_zeros(pad, embeds.shape[1])])[None], mask[None].to(embeds.device)

        (prompt,) = prompts  # the cache encodes one prompt per call
        cond = dict(zip(("prompt_embeds", "prompt_embeds_mask"), padded([prompt])))  # [1, L, D], [1, L]
        if negative_prompt is not None:
            cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"] = padded([negative_prompt])
        return cond

    # ----------------------------------------------------------------------------------------- latents
    @property
    def noise_dtype(self) -> torch.dtype:
        return torch.float32

    def size_factor(self) -> int:
        return self.pipe.vae_scale_factor * 2

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        f = self.pipe.vae_scale_factor * 2
        return (self.transformer.config.in_channels, 2 * (height // f), 2 * (width // f))

    def image_seq_len(self, height: int, width: int, num_frames: int | None = None) -> int:
        _, h, w = self.latent_shape(height, width)
        return (h // 2) * (w // 2)  # the pipeline's count, for its shift

    def custom_sigmas(self, num_steps: int) -> list[float] | None:
        return torch.linspace(1.0, 1 / num_steps, num_steps).tolist()  # the pipeline's default grid (float32 linspace)

    # ----------------------------------------------------------------------------------------- network
    @staticmethod
    def _captions(embeds: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
        return [e[m.bool()] for e, m in zip(embeds, mask)]  # each prompt's own tokens [L_i, D]

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        from flowrl.sde import timesteps_from_sigmas

        n = latents.shape[0]
        timestep = (1000 - timesteps_from_sigmas(sigma)) / 1000  # [N] the pipeline's (1000 − t) / 1000, float32
        captions = self._captions(cond["prompt_embeds"], cond["prompt_embeds_mask"])
        cfg = self.uses_cfg(guidance_scale)
        if cfg:  # one call over [cond; uncond], as the pipeline does
            latents = latents.repeat(2, 1, 1, 1)
            captions += self._captions(cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"])
            timestep = timestep.repeat(2)
        outs = self.transformer(list(latents.unsqueeze(2).unbind(dim=0)), timestep, captions, return_dict=False)[0]
        outs = [o.float() for o in outs]  # [C, 1, h, w] each
        if cfg:
            pred = torch.stack([p + guidance_scale * (p - q) for p, q in zip(outs[:n], outs[n:])])
        else:
            pred = torch.stack(outs)
        return -pred.squeeze(2)  # the transformer predicts x0 − noise

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(latents, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]
