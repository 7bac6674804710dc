"""Qwen-Image-Edit (QwenImageEditPipeline) and Edit Plus / 2509 (QwenImageEditPlusPipeline): Qwen-Image with a
source image per sample.

The source image reaches the model twice, as in the pipelines: inside the prompt (Qwen2.5-VL reads it through the
pipeline's processor and chat template) and as VAE latents, packed 2x2 like the noise and appended to the
transformer's image tokens (`img_shapes` lists both grids; the prediction is read off the noise's tokens only).
Guidance, prompt padding, σ grid and decoding are Qwen-Image's (qwen_image.py). Size policy
(docs/models.md#conditioning-images): the source is resized to the sample's height x width for the VAE (the
pipelines' default regime, where the edited image has the source's size; they resize to a 1024x1024 area); Edit
Plus resizes the prompt's copy to its own 384x384 area, as its pipeline does. One source image per sample.
"""

from __future__ import annotations

import torch

from flowrl.models.conditioning import source_image
from flowrl.models.qwen_image import QwenImageFlowModel
from flowrl.types import Cond


class QwenImageEditFlowModel(QwenImageFlowModel):
    family = "qwen_image_edit"
    conditioning = "image"
    max_sequence_length = 1024  # the prompt holds the source image's tokens: padded further than Qwen-Image's 512

    @property
    def plus(self) -> bool:
        return type(self.pipe).__name__ == "QwenImageEditPlusPipeline"

    def set_max_sequence_length(self, length: int) -> None:
        # the edit pipelines never truncate (the cap of Qwen-Image's text prompt does not apply to image tokens)
        super(QwenImageFlowModel, self).set_max_sequence_length(length)

    def _encode_batch(self, prompts, negative_prompt):
        raise ValueError(
            f"the {self.family} model needs a source image per prompt; encode through flowrl.models.conditioning"
        )

    def _prompt_image(self, image, height: int, width: int):
        """The copy of the source the prompt holds: Edit's VAE-sized image, Edit Plus' own 384x384-area one."""
        if not self.plus:
            return self.pipe.image_processor.resize(image, height, width)
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

        w, h = plus.calculate_dimensions(plus.CONDITION_IMAGE_SIZE, image.width / image.height)
        return [self.pipe.image_processor.resize(image, h, w)]

    def _encode_source(self, prompt: str, negative_prompt: str | None, path: str, size: tuple) -> Cond:
        height, width, _ = size
        self.check_size(height, width)
        image = source_image(path, height, width)
        prompt_image = self._prompt_image(image, height, width)
        embeds, mask = self._embeds(prompt, image=prompt_image)
        cond = {"prompt_embeds": embeds, "prompt_embeds_mask": mask}  # [1, L, D], [1, L]
        if negative_prompt is not None:  # the pipelines encode the negative prompt with the same image
            cond["negative_prompt_embeds"], cond["negative_prompt_embeds_mask"] = self._embeds(
                negative_prompt, image=prompt_image
            )
        vae_input = image if self.plus else self.pipe.image_processor.resize(image, height, width)
        pixels = self.pipe.image_processor.preprocess(vae_input, height, width).unsqueeze(2)  # [1, 3, 1, H, W]
        # [1, C, 1, h, w]
        latents = self.pipe._encode_vae_image(pixels.to(self.device, self.pipe.vae.dtype), generator=None)
        c, h, w = latents.shape[1], latents.shape[3], latents.shape[4]
        self.latent_shape(height, width)  # records the source grid (the sample's)
        cond["image_latents"] = self.pipe._pack_latents(latents, 1, c, h, w)  # [1, L_src, 4C]
        return cond

    def _transformer_input(self, latents: torch.Tensor, cond: Cond) -> tuple[torch.Tensor, list]:
        source = cond["image_latents"].to(latents.dtype)  # [N, L_src, 4C]
        grids = [(1, *self._grid(latents.shape[1])), (1, *self._grid(source.shape[1]))]
        return torch.cat([latents, source], dim=1), [grids] * latents.shape[0]
