"""Image consistency with the source image of edit and image-to-video runs: the cosine similarity of CLIP image
embeddings of the sample and of its source (`metadata["image"]`, a path), in [-1, 1]; a video scores the mean
over its frames (or every k-th frame). NaN for a sample without a source image (not applicable).

It rewards keeping the source's content; alone it is maximised by copying the source, so pair it with a reward
for following the instruction (or the prompt).
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._clip_backbone import load_open_clip, normalized


@REWARDS.register("image_consistency")
class ImageConsistencyReward:
    modalities = ("image", "video")
    differentiable = True
    extra_requires = ("open-clip-torch",)

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        model_name: str = "ViT-L-14",
        pretrained: str | None = None,
        every_k_frames: int = 1,
    ):
        if not isinstance(every_k_frames, int) or every_k_frames < 1:
            raise ValueError(f"image_consistency every_k_frames={every_k_frames!r} must be a whole number >= 1")
        self.device, self.dtype, self.every_k_frames = torch.device(device), dtype, every_k_frames
        self.model, _, self.preprocess = load_open_clip(model_name, pretrained, self.device, dtype)
        self._sources: dict[str, torch.Tensor] = {}  # path -> [D] normalised embedding (the source never changes)

    @torch.no_grad()
    def source_embedding(self, path: str) -> torch.Tensor:
        if path not in self._sources:
            from flowrl.media import load_image

            image = load_image(path)[None].to(self.device, self.dtype)  # [1, 3, H, W]
            self._sources[path] = normalized(self.model.encode_image(self.preprocess(image)))[0]
        return self._sources[path]

    def embed(self, images: torch.Tensor) -> torch.Tensor:
        """Normalised CLIP embeddings [N, F, D] of images [N, 3, H, W] (F = 1) or videos [N, F, 3, H, W]."""
        frames = images[:, :: self.every_k_frames] if images.dim() == 5 else images[:, None]  # [N, F', 3, H, W]
        n, f = frames.shape[:2]
        flat = self.preprocess(frames.flatten(0, 1).to(self.device, self.dtype))  # [N*F', 3, S, S]
        return normalized(self.model.encode_image(flat)).view(n, f, -1)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata, modality="video" if images.dim() == 5 else "image")
        rows = [i for i, meta in enumerate(metadata) if meta.get("image")]
        scores = torch.full((len(prompts),), float("nan"), device=self.device, dtype=self.dtype)  # [N]
        frame_min = scores.clone()
        if rows:
            sources = torch.stack([self.source_embedding(metadata[i]["image"]) for i in rows])  # [R, D]
            similarity = (self.embed(images[rows]) * sources[:, None]).sum(-1)  # [R, F']
            scores = scores.index_put((torch.tensor(rows, device=self.device),), similarity.mean(1))
            frame_min[rows] = similarity.detach().min(1).values
        return RewardOutput(scores=scores.float().cpu(), parts={"min_frame": frame_min.float().cpu()})
