"""JPEG compressibility (DDPO, Black et al. 2023): minus the JPEG-encoded size in kB at quality 95.

Smaller files score higher; a reward with no weights, useful as a smoke test and as DDPO's baseline task.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput


def jpeg_sizes_kb(images: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """JPEG size of each image in kB (bytes / 1000), from 8-bit RGB as DDPO encodes it. -> [N] float32"""
    # [N, H, W, 3]
    pixels = (images.detach() * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    sizes = []
    for array in pixels:
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(array)).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)  # [N]


@REWARDS.register("jpeg_compressibility")
class JpegCompressibilityReward:
    modalities = ("image",)
    differentiable = False
    extra_requires: tuple[str, ...] = ()
    sign = -1.0

    def __init__(self, device: Any = "cpu", dtype: torch.dtype = torch.float32, quality: int = 95):
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"quality={quality} is outside 1..100; use DDPO's 95")
        self.device, self.dtype, self.quality = torch.device(device), dtype, int(quality)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs(self.registry_name, images, prompts, metadata)
        scores = self.sign * jpeg_sizes_kb(images, self.quality)  # [N]
        return RewardOutput(scores=scores.to(self.device))
