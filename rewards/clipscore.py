"""CLIPScore (Hessel et al. 2021): w * max(cos(E_image, E_text), 0) with w = 2.5, on an open_clip model."""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._clip_backbone import load_open_clip, normalized


@REWARDS.register("clipscore")
class ClipScoreReward:
    modalities = ("image",)
    differentiable = True
    extra_requires = ("open-clip-torch",)

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        model_name: str = "ViT-L-14",
        pretrained: str | None = None,
        weight: float = 2.5,
    ):
        self.device, self.dtype, self.weight = torch.device(device), dtype, float(weight)
        self.model, self.tokenizer, self.preprocess = load_open_clip(model_name, pretrained, self.device, dtype)

    @torch.no_grad()
    def text_features(self, prompts: list[str]) -> torch.Tensor:
        return normalized(self.model.encode_text(self.tokenizer(prompts).to(self.device)))  # [N, D]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        # [N, D]
        image_features = normalized(self.model.encode_image(self.preprocess(images.to(self.device, self.dtype))))
        cosine = (image_features * self.text_features(prompts)).sum(-1)  # [N]
        return RewardOutput(
            scores=(self.weight * cosine.clamp(min=0)).float(), parts={"cosine": cosine.detach().float()}
        )
