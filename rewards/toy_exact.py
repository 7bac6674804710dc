"""toy_exact: 1 when the image shows exactly the prompt's count, colour and shape, read from the pixels by fixed rules.

No learned part, so nothing to hack but the world itself (flowrl/toy/exact.py): shapes are the connected components
of pixels off the background (specks under `MIN_AREA` pixels ignored), each one's colour is the nearest palette
colour, its shape is read from how it fills its box and where its mass sits. The prompt is parsed with the world's
grammar; a prompt outside it raises ValueError naming the prompt.

Score = count * colour * shape, in {0, 1}. Parts, each [N] float32 in {0, 1}:
`count` (as many shapes found as the prompt says), `colour` / `shape` (at least one shape found and every shape has
the prompt's colour / shape), `impossible_count` (no shape or four and more: counts the world never draws) and
`mixed_colours` (the shapes have more than one palette colour). Not differentiable; images of any size (resized to
32x32); the scores are returned on the reward's device.
"""

from __future__ import annotations

from typing import Any

import torch

from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

PARTS = ("count", "colour", "shape", "impossible_count", "mixed_colours")


@REWARDS.register("toy_exact")
class ToyExactReward:
    modalities = ("image",)
    differentiable = False
    extra_requires = ()

    def __init__(self, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, **kwargs: Any):
        if kwargs:
            raise ValueError(
                f"toy_exact: unknown option(s) {', '.join(sorted(kwargs))}; it has no weights and no settings"
            )
        self.device, self.dtype = torch.device(device), dtype

    def __call__(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]] | None = None
    ) -> RewardOutput:
        from flowrl.toy.exact import find_blobs
        from flowrl.toy.world import parse_prompt

        check_inputs("toy_exact", images, prompts, metadata)
        specs = [parse_prompt(p) for p in prompts]  # ValueError naming a prompt outside the grammar
        values = []
        for spec, blobs in zip(specs, find_blobs(images.detach().cpu())):
            colours = {b.colour for b in blobs}
            row = {
                "count": len(blobs) == spec.count,
                "colour": bool(blobs) and colours == {spec.colour},
                "shape": bool(blobs) and all(b.shape == spec.shape for b in blobs),
                "impossible_count": len(blobs) == 0 or len(blobs) >= 4,
                "mixed_colours": len(colours) > 1,
            }
            values.append([float(row[name]) for name in PARTS])
        table = torch.tensor(values, dtype=torch.float32, device=self.device)  # [N, 5]
        parts = {name: table[:, i] for i, name in enumerate(PARTS)}
        return RewardOutput(scores=parts["count"] * parts["colour"] * parts["shape"], parts=parts)
