"""Qwen-Image (QwenImagePipeline): MMDiT on 2x2-packed Qwen-Image-VAE latents, Qwen2.5-VL text encoder, true CFG
with the pipeline's norm-preserving rescale.

The guidance scale is the pipeline's `true_cfg_scale`: with it above 1 each step runs the prompt and the negative
prompt as two transformer calls, combines them as `neg + s·(cond − neg)` and rescales every token of the result
to the conditional prediction's norm, as `QwenImagePipeline.__call__` does (docs/models.md#qwen-image). The
pipeline trims each prompt's embeddings to its own token count; flowrl pads every prompt to `max_sequence_length`
with a zero mask instead (the transformer masks those tokens out of attention), so a sample's conditioning never
depends on which prompts share its batch. Setting `max_sequence_length` lower than the pipeline's 512 both truncates
long prompts (as the pipeline does) and shortens that padding.
"""

from __future__ import annotations

import numpy as np
import torch

from flowrl.models.lora import JOINT_ATTENTION_TARGETS
from flowrl.models.pipeline import PackedLatentsMixin, PipelineFlowModel
from flowrl.types import Cond


class QwenImageFlowModel(PackedLatentsMixin, PipelineFlowModel):
    family = "qwen_image"
    max_sequence_length = 512  # the pipeline's default
    default_guidance_scale = 4.0  # the pipeline's true_cfg_scale default
    lora_target_modules = JOINT_ATTENTION_TARGETS

    def __init__(self, pipe, device="cpu", dtype=torch.float32):
        super().__init__(pipe, device, dtype)
        if self.transformer.config.guidance_embeds:
            raise ValueError(
                "the Qwen-Image transformer has guidance_embeds=True (a guidance-distilled variant), which flowrl does "
                "not support; use a checkpoint with guidance_embeds=False"
            )

    def set_max_sequence_length(self, length: int) -> None:
        if isinstance(length, int) and length > 1024:
            raise ValueError(
                f"model.max_sequence_length={length} is above Qwen-Image's 1024 text tokens; use at most 1024"
            )
        super().set_max_sequence_length(length)

    # ----------------------------------------------------------------------------------------- prompts
    def _embeds(self, prompt: str, **image) -> tuple[torch.Tensor, torch.Tensor]:
        """One prompt's embeddings [1, L, D] and mask [1, L], zero-padded to max_sequence_length tokens (`image`:
        the edit pipelines' prompt image)."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=[prompt],
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self.max_sequence_length,
            **image,
        )
        length = embeds.shape[1]
        if length > self.max_sequence_length:  # the edit pipelines do not truncate (their prompt holds the image)
            raise ValueError(
                f"prompt {prompt[:40]!r} encodes to {length} text tokens (with its image), above "
                f"model.max_sequence_length={self.max_sequence_length}; raise model.max_sequence_length to {length} "
                "or more"
            )
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(1, length, dtype=torch.long, device=embeds.device)
        pad = self.max_sequence_length - length
        embeds = torch.cat([embeds, embeds.new_zeros(1, pad, embeds.shape[2])], dim=1)
        mask = torch.cat([mask, mask.new_zeros(1, pad)], dim=1)
        return embeds, mask

    def _encode_batch(self, prompts: list[str], negative_prompt: str | None) -> Cond:
        (prompt,) = prompts  # the cache encodes one prompt per call
        embeds, mask = self._embeds(prompt)
        cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}  # [1, L, D], [1, L]
        if negative_prompt is not None:
            cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"] = self._embeds(negative_prompt)
        return cond

    # ----------------------------------------------------------------------------------------- latents
    def _noise_shape(self, num, height, width, num_frames):
        n, c, h, w = super()._noise_shape(num, height, width, num_frames)
        return (n, 1, c, h, w)  # the pipeline draws one frame of the video VAE's latents

    def custom_sigmas(self, num_steps: int) -> list[float] | None:
        return np.linspace(1.0, 1 / num_steps, num_steps).tolist()

    # ----------------------------------------------------------------------------------------- network
    text_padding_multiple = 64
    """A transformer call pads each prompt to its own token count rounded up to this, not to max_sequence_length."""

    def _text_groups(self, mask: torch.Tensor) -> list[tuple[int, torch.Tensor | None]]:
        """(text length, rows) of each transformer call: a row's prompt tokens (through its last unmasked one) rounded
        up to `text_padding_multiple`, at most the cache's width. A sample's padding thus depends on its own prompt
        only, never on its batch-mates; rows None: every row shares one length. Under FSDP2 every process makes one
        call at the longest length over all processes' rows (`_sharded`)."""
        m, width = self.text_padding_multiple, mask.shape[1]
        last = width - mask.bool().flip(1).int().argmax(1)  # [N] one past the last unmasked token (all masked: width)
        lengths = ((last + m - 1) // m * m).clamp(min=m, max=width)
        if self._sharded():
            longest = lengths.max().reshape(1).clone()
            torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX)
            return [(int(longest), None)]
        values = lengths.unique().tolist()
        if len(values) == 1:
            return [(values[0], None)]
        return [(length, (lengths == length).nonzero().flatten()) for length in values]

    def _sharded(self) -> bool:
        """Whether FSDP2 shards the transformer over processes. Each call then all-gathers its weights, a collective:
        every process must make the same number of calls, which a call per padded length per process would not
        (processes hold prompts of different lengths), so all of them pad to one length agreed with an all-reduce."""
        from torch.distributed.fsdp import FSDPModule

        return isinstance(self.transformer, FSDPModule) and torch.distributed.get_world_size() > 1

    def _forward(self, latents, timestep, embeds, mask, img_shapes):
        """The transformer over text trimmed per row (`_text_groups`): the masked padding past a prompt's own
        tokens changes no prediction (the transformer masks it out of attention) but costs every layer."""
        out = None
        for length, rows in self._text_groups(mask):
            if rows is None:
                return self._transformer_call(latents, timestep, embeds[:, :length], mask[:, :length], img_shapes)
            part = self._transformer_call(
                latents[rows], timestep[rows], embeds[rows, :length], mask[rows, :length], [img_shapes[i] for i in rows]
            )
            out = part.new_empty(latents.shape[0], *part.shape[1:]) if out is None else out
            out[rows] = part
        return out

    def _transformer_call(self, latents, timestep, embeds, mask, img_shapes):
        return self.transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=img_shapes,
            return_dict=False,
        )[0]

    def _transformer_input(self, latents: torch.Tensor, cond: Cond) -> tuple[torch.Tensor, list]:
        """The transformer's hidden states and `img_shapes` for packed latents [N, L, 4C] (the edit pipelines
        append the source image's tokens)."""
        return latents, [[(1, *self._grid(latents.shape[1]))]] * latents.shape[0]

    def _velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: Cond, guidance_scale: float) -> torch.Tensor:
        from flowrl.sde import timesteps_from_sigmas

        seq_len = latents.shape[1]
        hidden, img_shapes = self._transformer_input(latents, cond)
        timestep = timesteps_from_sigmas(sigma).to(latents.dtype) / 1000  # the pipeline's t / 1000
        out = self._forward(hidden, timestep, cond["prompt_embeds"], cond["prompt_embeds_mask"], img_shapes)[
            :, :seq_len
        ]
        if self.uses_cfg(guidance_scale):
            neg = self._forward(
                hidden, timestep, cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"], img_shapes
            )[:, :seq_len]
            combined = neg + guidance_scale * (out - neg)
            # rescaled per token to the conditional prediction's norm over channels
            out = combined * (torch.norm(out, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))
        return out

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = self._unpacked(latents).to(vae.dtype)  # [N, C, 1, h, w]
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        image = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)  # [N, 3, H, W]
