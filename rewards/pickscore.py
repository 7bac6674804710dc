"""PickScore (Kirstain et al. 2023): logit_scale.exp() * cos(image, text) of the PickScore_v1 CLIP-H model,
through transformers' CLIPModel and the processor settings of laion/CLIP-ViT-H-14-laion2B-s32B-b79K.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._clip_backbone import ImagePreprocess, normalized


def _from_local(cls: Any, name: str, what: str) -> Any:
    """from_pretrained restricted to a local folder or the HF cache (never downloads)."""
    try:
        return cls.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError) as err:
        raise FileNotFoundError(
            f"pickscore: {what} {name!r} is neither a local folder nor in the HF cache ({type(err).__name__}); "
            f"get it with `huggingface-cli download {name}` or pass a local folder"
        ) from None


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
        processor = _from_local(CLIPProcessor, processor_name or model_name, "processor")
        self.tokenizer = processor.tokenizer
        if len(self.tokenizer) <= 10:
            raise FileNotFoundError(
                f"pickscore: the tokenizer of {processor_name or model_name!r} has {len(self.tokenizer)} tokens (an empty download); pass a complete processor folder"
            )
        image_processor = processor.image_processor
        self.resize = _pixel_size(image_processor.size)
        self.preprocess = ImagePreprocess(
            _pixel_size(image_processor.crop_size), tuple(image_processor.image_mean), tuple(image_processor.image_std)
        )
        self.model = _from_local(CLIPModel, model_name, "model").to(self.device, dtype).eval().requires_grad_(False)

    def _pixels(self, images: torch.Tensor) -> torch.Tensor:
        if self.resize != self.preprocess.size:  # processor resizes the short side first, then crops
            images = ImagePreprocess(self.resize, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))(images)
        return self.preprocess(images)  # [N, 3, S, S]

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        pixel_values = self._pixels(images.to(self.device, self.dtype))
        image_embeds = normalized(self.model.get_image_features(pixel_values=pixel_values).pooler_output)  # [N, D]
        with torch.no_grad():
            tokens = self.tokenizer(prompts, padding=True, truncation=True, max_length=77, return_tensors="pt").to(self.device)
            text_embeds = normalized(self.model.get_text_features(**tokens).pooler_output)  # [N, D]
        scores = self.model.logit_scale.exp() * (image_embeds * text_embeds).sum(-1)  # [N]
        return RewardOutput(scores=scores.float())
