"""Wan 2.1 / 2.2 text-to-video (WanPipeline): 3D DiT on Wan-VAE latents [N, C, F, H, W], UMT5 text encoder.

True CFG makes two forward calls (conditional, then unconditional) exactly as the pipeline does. Wan 2.2's
two-expert checkpoints (A14B: `transformer_2` with a `boundary_ratio`) pick the expert per sample by timestep, as
the pipeline picks it per step (`transformer` at t >= boundary_ratio·1000, `transformer_2` below), with the same
guidance scale for both (the pipeline's default for `guidance_scale_2`); the trained module (where LoRA lives) is
`transformer`, the high-noise expert, unless `train_expert="low"` is passed; `trainable_sigma_range()` says where
the trained expert runs, and samplers and trainers train only there. Wan 2.2 TI2V-5B text-to-video
(`expand_timesteps`) hands the transformer one timestep per latent token, as its pipeline does
(docs/models.md#wan-22).
"""

from __future__ import annotations

import torch

from flowrl.models.pipeline import PipelineFlowModel
from flowrl.types import Cond


class WanFlowModel(PipelineFlowModel):
    family = "wan"
    is_video = True
    max_sequence_length = 512  # the pipeline's default
    default_guidance_scale = 5.0
    lora_target_modules = (
        "attn1.to_q",
        "attn1.to_k",
        "attn1.to_v",
        "attn1.to_out.0",
        "attn2.to_q",
        "attn2.to_k",
        "attn2.to_v",
        "attn2.to_out.0",
    )

    def __init__(self, pipe, device="cpu", dtype=torch.float32, train_expert: str = "high"):
        super().__init__(pipe, device, dtype)
        if train_expert not in ("high", "low"):
            raise ValueError(f"train_expert={train_expert!r} must be 'high' or 'low'")
        if train_expert == "low" and getattr(pipe, "transformer_2", None) is not None:
            self.transformer = pipe.transformer_2

    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        cfg = negative_prompt is not None
        embeds, neg_embeds = self.pipe.encode_prompt(
            prompt=prompts,
            negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
            do_classifier_free_guidance=cfg,
            num_videos_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            device=self.device,
        )
        cond = {"prompt_embeds": embeds}  # [N, L, D]
        if cfg:
            cond["negative_prompt_embeds"] = neg_embeds
        return cond

    @property
    def native_size(self) -> tuple[int, int, int | None]:
        return 480, 832, 81  # WanPipeline's defaults

    def size_factor(self) -> int:
        return self.pipe.vae_scale_factor_spatial * self.pipe.transformer.config.patch_size[1]

    def check_size(self, height, width, num_frames=None):
        super().check_size(height, width)
        tf = self.pipe.vae_scale_factor_temporal
        if num_frames is None or num_frames < 1 or (num_frames - 1) % tf:
            raise ValueError(f"num_frames={num_frames} must be 1 + a multiple of {tf} for Wan (e.g. {4 * tf + 1})")

    def latent_shape(self, height: int, width: int, num_frames: int | None = None) -> tuple[int, ...]:
        if num_frames is None:
            raise ValueError("num_frames is required for Wan video models")
        s, t = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        return (self.pipe.transformer.config.in_channels, (num_frames - 1) // t + 1, height // s, width // s)

    def image_seq_len(self, height, width, num_frames=None):
        c, f, h, w = self.latent_shape(height, width, num_frames)
        p = self.pipe.transformer.config.patch_size
        return (f // p[0]) * (h // p[1]) * (w // p[2])

    def _expert_forward(self, module, latents, timestep, embeds):
        if self.pipe.config.get("expand_timesteps", False):  # TI2V: t for each token of the 2x2-patched latents
            f, h, w = latents.shape[2:]
            timestep = timestep[:, None].expand(-1, f * ((h + 1) // 2) * ((w + 1) // 2))  # [N, L]
        return module(hidden_states=latents, timestep=timestep, encoder_hidden_states=embeds, return_dict=False)[0]

    def _two_experts(self) -> bool:
        return (
            self.pipe.config.get("boundary_ratio", None) is not None
            and getattr(self.pipe, "transformer_2", None) is not None
        )

    def _high_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """[N] bool: the rows the high-noise expert (`pipe.transformer`) runs, t ≥ boundary_ratio·1000 as the
        pipeline."""
        from flowrl.sde import timesteps_from_sigmas

        return (
            timesteps_from_sigmas(sigma)
            >= self.pipe.config.boundary_ratio * self.pipe.scheduler.config.num_train_timesteps
        )

    def trainable_sigma_range(self) -> tuple[float, float]:
        """[lo, hi]: the σ (float32) at which `velocity` runs the trained expert; (0, 1) with one expert. High:
        [boundary_ratio, 1], low: [0, the float32 just below boundary_ratio] (docs/models.md#wan-22)."""
        if not self._two_experts():
            return 0.0, 1.0
        edge = torch.tensor(self.pipe.config.boundary_ratio, dtype=torch.float32)  # the smallest high-noise σ
        down, up = torch.tensor(0.0), torch.tensor(1.0)
        while edge < 1 and not self._high_noise(edge):
            edge = torch.nextafter(edge, up)
        while edge > 0 and self._high_noise(torch.nextafter(edge, down)):
            edge = torch.nextafter(edge, down)
        if self.transformer is self.pipe.transformer:
            return float(edge), 1.0
        return 0.0, float(torch.nextafter(edge, down))

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        from flowrl.sde import timesteps_from_sigmas

        timestep = timesteps_from_sigmas(sigma)  # [N]
        if not self._two_experts():
            return self._guided(self.pipe.transformer, latents, timestep, cond, guidance_scale)
        transformer_2 = self.pipe.transformer_2
        high = self._high_noise(sigma)  # [N]
        out = torch.empty_like(latents)
        for mask, module in ((high, self.pipe.transformer), (~high, transformer_2)):
            if mask.any():
                rows = {k: v[mask] for k, v in cond.items()}
                out[mask] = self._guided(module, latents[mask], timestep[mask], rows, guidance_scale).to(out.dtype)
        return out

    def _guided(self, module, latents, timestep, cond, guidance_scale):
        out = self._expert_forward(module, latents, timestep, cond["prompt_embeds"])
        if self.uses_cfg(guidance_scale):
            uncond = self._expert_forward(module, latents, timestep, cond["negative_prompt_embeds"])
            out = uncond + guidance_scale * (out - uncond)
        return out

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean, device=latents.device).view(1, z, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=latents.device).view(1, z, 1, 1, 1)
        latents = (latents.float() * std + mean).to(vae.dtype)
        video = vae.decode(latents, return_dict=False)[0]  # [N, 3, F, H, W]
        return (video.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)  # [N, F, 3, H, W]
