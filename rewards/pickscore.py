"""PickScore (Kirstain et al. 2023): logit_scale.exp() * cos(image, text) of the PickScore_v1 CLIP-H model,
through transformers' CLIPModel and the processor settings of laion/CLIP-ViT-H-14-laion2B-s32B-b79K.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from flowrl.hub import hub_errors, is_hub_id
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._clip_backbone import ImagePreprocess, normalized


def _pretrained(cls: Any, name: str, what: str, **kwargs: Any) -> Any:
    """from_pretrained of a local folder, or of a hub id as transformers does it (the cache, else a download unless
    HF_HUB_OFFLINE), with one-line errors."""
    if os.path.isdir(name):
        return cls.from_pretrained(name, **kwargs)
    if not is_hub_id(name):
        raise FileNotFoundError(
            f"pickscore: {what} {name!r} is neither a local folder nor a hub id (org/name); pass one of those"
        )
    with hub_errors(name, f"pickscore: {what}"):
        return cls.from_pretrained(name, **kwargs)


def features(output: Any) -> torch.Tensor:
    """CLIPModel.get_image_features / get_text_features: a tensor [N, D] in transformers 4.x, an output whose
    `pooler_output` is that tensor in 5.x."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


def _pixel_size(value: Any) -> int:
    if isinstance(value, dict):
        return int(value.get("shortest_edge") or value.get("height"))
    return int(getattr(value, "shortest_edge", None) or value.height)


@REWARDS.register("pickscore")
class PickScoreReward:
    modalities = ("image",)
    differentiable = True
    extra_requires = ("transformers",)

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        model_name: str = "yuvalkirstain/PickScore_v1",
        processor_name: str | None = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
    ):
        from transformers import CLIPModel, CLIPProcessor

        self.device, self.dtype = torch.device(device), dtype
        processor = _pretrained(CLIPProcessor, processor_name or model_name, "processor")
        self.tokenizer = processor.tokenizer
        if len(self.tokenizer) <= 10:
            raise FileNotFoundError(
                f"pickscore: the tokenizer of {processor_name or model_name!r} has {len(self.tokenizer)} tokens "
                "(an empty download); pass a complete processor folder"
            )
        image_processor = processor.image_processor
        self.resize = _pixel_size(image_processor.size)
        self.preprocess = ImagePreprocess(
            _pixel_size(image_processor.crop_size), tuple(image_processor.image_mean), tuple(image_processor.image_std)
        )
        model = _pretrained(CLIPModel, model_name, "model", dtype=dtype)  # loaded in `dtype`: no float32 copy first
        self.model = model.to(self.device, dtype).eval().requires_grad_(False)

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        if self.resize != self.preprocess.size:  # processor resizes the short side first, then crops
            images = ImagePreprocess(self.resize, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))(images)
        return self.preprocess(images)  # [N, 3, S, S]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        pixel_values = self._pixels(images.to(self.device, self.dtype))
        image_embeds = normalized(features(self.model.get_image_features(pixel_values=pixel_values)))  # [N, D]
        with torch.no_grad():
            tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt").to(
                self.device
            )
            text_embeds = normalized(features(self.model.get_text_features(**tokens)))  # [N, D]
        scores = self.model.logit_scale.exp() * (image_embeds * text_embeds).sum(-1)  # [N]
        return RewardOutput(scores=scores.float())
