"""toy_size and toy_midline: two layout rewards of the Shapes world, read from the pixels by the exact checker's rules.

Both read the shapes as `toy_exact` does (flowrl/toy/exact.py: connected components of one palette colour, specks
under `MIN_AREA` pixels ignored), so each is its own exact gold: no learned part, nothing to hack but the world.
Images of any size (resized to 32x32); prompts are ignored (the layout asks nothing of the prompt); not
differentiable; scores on the reward's device.

* `toy_size` (dense, pixels): the mean area in pixels of the shapes found, 0 when none is. The world draws radii of
  3.5-6 px (a circle of 38-113 px); the toy model's samples measure 54 +- 21 px. Bigger shapes crowd: three large
  ones touch and read as fewer (the count `toy_exact` grades), and three in a row fit only when small.
* `toy_midline` (sparse, binary): 1 when at least one shape is found and every shape's centre (the middle of its
  box) lies within `band` pixels of the image's middle row. The toy model's samples: 15% of one-shape, 9% of
  two-shape and 10% of three-shape prompts (band 3). Three shapes side by side on the middle row fit only when small:
  the conflict with `toy_size`.

Parts (both rewards): `num_shapes` (shapes found) and `mean_area` (pixels; 0 with no shape).
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

MIDDLE_ROW = 15.5  # the 32-pixel image's middle, in pixel-centre coordinates (rows 0..31)


def layout(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Images [N, 3, H, W] -> (shapes found [N], mean area in pixels [N], largest |centre row - middle row| [N];
    the last is +inf with no shape)."""
    from flowrl.toy.exact import find_blobs

    rows = []
    for blobs in find_blobs(images.detach().cpu()):
        areas = [b.area for b in blobs]
        offsets = [abs((b.box[0] + b.box[2]) / 2 - MIDDLE_ROW) for b in blobs]
        rows.append((len(blobs), sum(areas) / len(areas) if areas else 0.0, max(offsets, default=float("inf"))))
    table = torch.tensor(rows, dtype=torch.float32).view(-1, 3)  # [N, 3]
    return table[:, 0], table[:, 1], table[:, 2]


class _LayoutReward:
    modalities = ("image",)
    differentiable = False
    extra_requires = ()

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
        self.device, self.dtype = torch.device(device), dtype

    def _parts(self, images, prompts, metadata) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        check_inputs(self.registry_name, images, prompts, metadata)
        count, area, offset = layout(images)
        return {"num_shapes": count.to(self.device), "mean_area": area.to(self.device)}, offset


@REWARDS.register("toy_size")
class ToySizeReward(_LayoutReward):
    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> RewardOutput:
        parts, _ = self._parts(images, prompts, metadata)
        return RewardOutput(scores=parts["mean_area"], parts=parts)


@REWARDS.register("toy_midline")
class ToyMidlineReward(_LayoutReward):
    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, band: float = 3.0):
        if not 0 < float(band) < 16:
            raise ValueError(
                f"toy_midline: band={band} must be in (0, 16) pixels; the default 3 gives a base rate of ~11%"
            )
        super().__init__(device, dtype)
        self.band = float(band)

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> RewardOutput:
        parts, offset = self._parts(images, prompts, metadata)
        return RewardOutput(scores=(offset <= self.band).float().to(self.device), parts=parts)
