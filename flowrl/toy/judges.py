"""The Shapes world's judges: small CNNs trained on the renderer's ground truth (scripts/train_toy_judges.py).

`AttributeJudge` reads count, colour and shape (three softmax heads; the "GenEval" of this world);
`ArtifactJudge` tells clean renders from corrupted ones (one logit, P(artifact) = sigmoid). Both take images
[N, 3, 32, 32] in [0, 1] and are plain torch modules, so rewards built on them are differentiable.

The shipped attribute judge also knows what the world never draws: each head has one more class, "other" (a count
outside one..three, no single colour, no single shape), trained on `world.impossible_batch` scenes, so four
circles do not read as "three". The first judge had no "other" classes (it is kept as a test fixture, the
"count-blind" judge); `load_judge` builds whichever heads a file holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flowrl.toy.manifest import weights_or_checkpoint
from flowrl.toy.world import COLOURS, COUNTS, IMAGE_SIZE, SHAPES

ATTRIBUTE_FILE = "toy_attributes.safetensors"
ARTIFACT_FILE = "toy_artifact.safetensors"


def _conv(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1), nn.GroupNorm(8, c_out), nn.GELU())


OTHER_CLASS = {"count": len(COUNTS), "colour": len(COLOURS), "shape": len(SHAPES)}  # index of each head's "other"


def scene_labels(items: list[tuple[str, str]]) -> tuple[int, int, int]:
    """(count, colour, shape) class ids of any scene [(colour, shape), ...]: a spec's `labels` for a scene the world
    draws, each head's "other" class (`OTHER_CLASS`) for a count outside 1..3, no single colour or no single shape."""
    colours, shapes = {c for c, _ in items}, {s for _, s in items}
    return (
        len(items) - 1 if 1 <= len(items) <= len(COUNTS) else OTHER_CLASS["count"],
        COLOURS.index(colours.pop()) if len(colours) == 1 else OTHER_CLASS["colour"],
        SHAPES.index(shapes.pop()) if len(shapes) == 1 else OTHER_CLASS["shape"],
    )


class AttributeJudge(nn.Module):
    """Images [N, 3, 32, 32] -> logits {"count": [N, 3+1], "colour": [N, 4+1], "shape": [N, 3+1]}, the last class of
    each head "other" (`OTHER_CLASS`); with `other_class=False` the heads are [N, 3], [N, 4], [N, 3]."""

    def __init__(self, width: int = 16, other_class: bool = True):
        super().__init__()
        self.other_class = other_class
        extra = int(other_class)
        self.features = nn.Sequential(
            _conv(3, width),  # 32x32
            _conv(width, 2 * width, stride=2),
            _conv(2 * width, 2 * width),  # 16x16
            _conv(2 * width, 4 * width, stride=2),
            _conv(4 * width, 4 * width),  # 8x8
            _conv(4 * width, 8 * width, stride=2),  # 4x4
        )
        self.trunk = nn.Sequential(nn.Flatten(), nn.Linear(8 * width * 16, 256), nn.GELU())
        self.heads = nn.ModuleDict(
            {
                name: nn.Linear(256, len(classes) + extra)
                for name, classes in (("count", COUNTS), ("colour", COLOURS), ("shape", SHAPES))
            }
        )

    def forward(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.trunk(self.features(images * 2 - 1))  # [N, 256]
        return {name: head(hidden) for name, head in self.heads.items()}


class ArtifactJudge(nn.Module):
    """Images [N, 3, 32, 32] -> artifact logit [N] (positive = corrupted)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            _conv(3, width),
            _conv(width, width),  # 32x32: noise, stripes, block edges live at this scale
            _conv(width, 2 * width, stride=2),
            _conv(2 * width, 2 * width),  # 16x16
            _conv(2 * width, 2 * width, stride=2),  # 8x8
        )
        self.head = nn.Sequential(nn.Linear(4 * width, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        h = self.features(images * 2 - 1)  # [N, 2w, 8, 8]
        pooled = torch.cat([h.mean(dim=(2, 3)), h.amax(dim=(2, 3))], dim=1)  # [N, 4w]
        return self.head(pooled).squeeze(1)  # [N]


def judge_input(images: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Check and resize a batch for a judge: [N, 3, H, W] in [0, 1] -> [N, 3, 32, 32] in `dtype`."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images shape {tuple(images.shape)}: the toy judges take [N, 3, H, W] RGB in [0, 1]")
    if images.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        images = nn.functional.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True)
    return images.to(dtype)


def _has_other_class(state: dict[str, torch.Tensor], path: Path) -> bool:
    """Whether an attribute-judge file has the "other" classes, read from its count head's shape."""
    weight = state.get("heads.count.weight")
    found = "no heads.count.weight" if weight is None else f"heads.count.weight with {weight.shape[0]} rows"
    if weight is None or weight.shape[0] not in (len(COUNTS), len(COUNTS) + 1):
        raise ValueError(
            f"{path} has {found} (an attribute judge has {len(COUNTS)} or {len(COUNTS) + 1}); "
            "pass a file written by scripts/train_toy_judges.py --judge attributes"
        )
    return weight.shape[0] == len(COUNTS) + 1


def load_judge(kind: str, checkpoint: str | Path | None = None, device="cpu", dtype=torch.float32) -> nn.Module:
    """A judge from the shipped weights (size and sha256 checked) or from a checkpoint file."""
    from safetensors.torch import load_file

    classes = {"attributes": (AttributeJudge, ATTRIBUTE_FILE), "artifact": (ArtifactJudge, ARTIFACT_FILE)}
    if kind not in classes:
        raise ValueError(f"judge kind={kind!r} is unknown; use 'attributes' or 'artifact'")
    cls, name = classes[kind]
    path = weights_or_checkpoint(name, checkpoint)
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    judge = cls() if kind == "artifact" else AttributeJudge(other_class=_has_other_class(state, path))
    judge.load_state_dict(state)
    return judge.to(device, dtype).eval().requires_grad_(False)
