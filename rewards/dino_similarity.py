"""Visual similarity to reference images: the cosine similarity of DINOv2 image embeddings (the normalised CLS token
of `transformers.Dinov2Model`) of a sample and of its references, in [-1, 1] (the visual reward of Adv-GRPO).

A sample's references are the image paths in `metadata[reference_key]` (one path or a list: a prompt's own reference
set), else the reward's `references` (one set for every prompt); several references score against the normalised
mean of their embeddings. NaN for a sample with neither (not applicable). A video scores the mean over its frames.
Preprocessing is differentiable: the shorter side resized to `image_size` (bilinear, antialiased), a centre crop of
`image_size`, ImageNet normalisation.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from flowrl.hub import hub_errors, is_hub_id
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@REWARDS.register("dino_similarity")
class DinoSimilarityReward:
    modalities = ("image", "video")
    differentiable = True
    extra_requires = ()  # transformers is a core dependency

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        model: str = "facebook/dinov2-base",
        references: list[str] | None = None,
        reference_key: str = "reference",
        image_size: int = 224,
    ):
        from transformers import Dinov2Model

        if not isinstance(image_size, int) or image_size < 1:
            raise ValueError(f"dino_similarity image_size={image_size!r} must be a whole number >= 1 (DINOv2: 224)")
        if not os.path.isdir(model) and not is_hub_id(model):
            raise FileNotFoundError(
                f"dino_similarity: model {model!r} is neither a local folder nor a hub id (org/name); pass one of those"
            )
        self.device, self.dtype, self.image_size, self.reference_key = (
            torch.device(device),
            dtype,
            image_size,
            reference_key,
        )
        with hub_errors(model, "dino_similarity: model"):
            self.model = Dinov2Model.from_pretrained(model).to(self.device, dtype).eval().requires_grad_(False)
        self.mean = torch.tensor(IMAGENET_MEAN, device=self.device, dtype=dtype).view(1, 3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD, device=self.device, dtype=dtype).view(1, 3, 1, 1)
        self._references: dict[tuple[str, ...], torch.Tensor] = {}  # paths -> [D] normalised mean embedding
        self.references = tuple(references or ())
        if self.references:
            self.reference_embedding(self.references)  # a missing file fails here, not at the first step

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised DINOv2 embeddings [M, D] of images [M, 3, H, W] in [0, 1]."""
        # resize: no bf16 kernel
        x = images.to(self.device, torch.float64 if self.dtype == torch.float64 else torch.float32)
        h, w = x.shape[-2:]
        scale = self.image_size / min(h, w)
        size = (max(self.image_size, round(h * scale)), max(self.image_size, round(w * scale)))
        x = torch.nn.functional.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
        top, left = (size[0] - self.image_size) // 2, (size[1] - self.image_size) // 2
        x = x[..., top : top + self.image_size, left : left + self.image_size].to(self.dtype)
        cls = self.model(pixel_values=(x - self.mean) / self.std).pooler_output  # [M, D] the layer-normed CLS token
        return torch.nn.functional.normalize(cls, dim=-1)

    @torch.no_grad()
    def reference_embedding(self, paths: tuple[str, ...]) -> torch.Tensor:
        if paths not in self._references:
            from flowrl.media import load_image

            embedded = torch.cat([self.embed(load_image(p)[None]) for p in paths])  # [R, D]
            self._references[paths] = torch.nn.functional.normalize(embedded.mean(0), dim=-1)
        return self._references[paths]

    def _paths(self, meta: dict[str, Any]) -> tuple[str, ...]:
        own = meta.get(self.reference_key)
        if own:
            return (own,) if isinstance(own, str) else tuple(own)
        return self.references

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata, modality="video" if images.dim() == 5 else "image")
        paths = [self._paths(meta) for meta in metadata]
        rows = [i for i, p in enumerate(paths) if p]
        scores = torch.full((len(prompts),), float("nan"), device=self.device, dtype=self.dtype)  # [N]
        if rows:
            chosen = images[rows]  # [R, 3, H, W] or [R, F, 3, H, W]
            frames = chosen if chosen.dim() == 5 else chosen[:, None]
            embedded = self.embed(frames.flatten(0, 1)).view(len(rows), frames.shape[1], -1)  # [R, F, D]
            targets = torch.stack([self.reference_embedding(paths[i]) for i in rows])  # [R, D]
            similarity = (embedded * targets[:, None]).sum(-1).mean(1)  # [R]
            scores = scores.index_put((torch.tensor(rows, device=self.device),), similarity)
        return RewardOutput(scores=scores.float().cpu())
