"""Temporal consistency of a video: mean cosine similarity of CLIP embeddings of consecutive frames, in
[-1, 1] (1 = frames embed identically). Flicker and identity drift lower it; a frozen video maximises it,
so pair it with a motion or prompt reward.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._clip_backbone import load_open_clip, normalized


@REWARDS.register("temporal_consistency")
class TemporalConsistencyReward:
    modalities = ("video",)
    differentiable = True
    extra_requires = ("open-clip-torch",)

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        model_name: str = "ViT-B-32",
        pretrained: str | None = None,
    ):
        self.device, self.dtype = torch.device(device), dtype
        self.model, _, self.preprocess = load_open_clip(model_name, pretrained, self.device, dtype)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata, modality="video")
        n, f = images.shape[:2]
        if f < 2:
            raise ValueError(f"temporal_consistency: videos have {f} frame; pass at least 2 frames")
        frames = self.preprocess(images.flatten(0, 1).to(self.device, self.dtype))  # [N*F, 3, S, S]
        embeddings = normalized(self.model.encode_image(frames)).view(n, f, -1)  # [N, F, D]
        similarity = (embeddings[:, 1:] * embeddings[:, :-1]).sum(-1)  # [N, F-1]
        return RewardOutput(
            scores=similarity.mean(1).float(), parts={"min_pair": similarity.detach().min(1).values.float()}
        )
