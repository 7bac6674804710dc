"""HPS v2 / v2.1 (Wu et al. 2023): cosine of open_clip ViT-H-14 image and text features after HPS fine-tuning."""

from __future__ import annotations

import os
from typing import Any

import torch

from flowrl.hub import download_file
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._clip_backbone import load_open_clip, normalized

HPS_REPO = "xswu/HPSv2"
HPS_FILES = {"v2": "HPS_v2_compressed.pt", "v2.1": "HPS_v2.1_compressed.pt"}


@REWARDS.register("hpsv2")
class HPSv2Reward:
    modalities = ("image",)
    differentiable = True
    extra_requires = ("open-clip-torch",)

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        model_name: str = "ViT-H-14",
        checkpoint: str | None = None,
        version: str = "v2.1",
    ):
        if version not in HPS_FILES:
            raise ValueError(f"hpsv2: version={version!r} is unknown; use one of {sorted(HPS_FILES)}")
        if checkpoint is None:  # the HF cache, else a download unless HF_HUB_OFFLINE
            checkpoint = download_file(HPS_REPO, HPS_FILES[version], "hpsv2: checkpoint")
        if not os.path.isfile(checkpoint):
            raise FileNotFoundError(
                f"hpsv2: checkpoint {checkpoint!r} does not exist; download {HPS_FILES[version]} from https://huggingface.co/{HPS_REPO}"
            )
        self.device, self.dtype = torch.device(device), dtype
        self.model, self.tokenizer, self.preprocess = load_open_clip(
            model_name, None, self.device, dtype, checkpoint=checkpoint
        )

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        # [N, D]
        image_features = normalized(self.model.encode_image(self.preprocess(images.to(self.device, self.dtype))))
        with torch.no_grad():
            text_features = normalized(self.model.encode_text(self.tokenizer(prompts).to(self.device)))  # [N, D]
        return RewardOutput(scores=(image_features * text_features).sum(-1).float())
