"""The Shapes world read as GenEval reads a photo: per image, instances with a class (a shape), a score, a box and a
colour, the input of GenEval's rules (rewards/toy_geneval.py grades the two-object and position prompts with them).

Two detectors, of the world's shapes as GenEval's Mask2Former is of COCO's classes:

* `exact_detections`, the gold: the exact checker's shapes (flowrl/toy/exact.py: connected components of one palette
  colour, each shape read from its geometry, its colour the palette's), every one scored 1.
* `judge_detections`, learned: instances are the 4-connected components of pixels off the background (any colour:
  touching shapes merge, as a detector's masks can), each one pasted alone, with the ring of pixels around it, onto an
  empty scene and read by the attribute judge (flowrl/toy/judges.py). Its class is the shape head's best shape, its
  score P(that shape) * P(count one), its colour the colour head's best palette colour: the judge names an object's
  colour on its masked crop as CLIP does on GenEval's. Components under `MIN_AREA` pixels are not instances.

Boxes are GenEval's (x1, y1, x2, y2) in pixels, as mmdet's mask2bbox draws them around a mask: the first column and row
of the instance, and one past its last. Images of another size than 32x32 are resized to 32x32 first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.toy.exact import MIN_AREA, find_blobs, label_components
from flowrl.toy.world import BACKGROUND_RGB, COLOURS, IMAGE_SIZE, SHAPES

FOREGROUND_DISTANCE = 0.3  # RGB distance from the background above which the judge's detector sees an object


@dataclass(frozen=True)
class Detections:
    """One image's instances: `labels` [K] index `SHAPES`, `scores` [K] in [0, 1], `boxes` [K, 4] (x1, y1, x2, y2)
    float32 in pixels, `colours` [K] palette colour names."""

    labels: torch.Tensor
    scores: torch.Tensor
    boxes: torch.Tensor
    colours: tuple[str, ...]


def _resized(images: torch.Tensor, who: str) -> torch.Tensor:
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images shape {tuple(images.shape)}: the {who} takes [N, 3, H, W] RGB in [0, 1]")
    images = images.detach().float().cpu()
    if images.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        images = torch.nn.functional.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True)
    return images


def exact_detections(images: torch.Tensor) -> list[Detections]:
    """Images [N, 3, H, W] in [0, 1] -> the exact checker's shapes of each image as detections, in reading order."""
    found = []
    for blobs in find_blobs(_resized(images, "exact detector")):
        boxes = [(left, top, right + 1, bottom + 1) for top, left, bottom, right in (b.box for b in blobs)]
        found.append(
            Detections(
                labels=torch.tensor([SHAPES.index(b.shape) for b in blobs], dtype=torch.long),
                scores=torch.ones(len(blobs)),
                boxes=torch.tensor(boxes, dtype=torch.float32).view(-1, 4),
                colours=tuple(b.colour for b in blobs),
            )
        )
    return found


@torch.no_grad()
def judge_detections(images: torch.Tensor, judge: torch.nn.Module) -> list[Detections]:
    """Images [N, 3, H, W] in [0, 1] -> each image's instances read by the attribute `judge` (module docstring), in
    reading order."""
    images = _resized(images, "judge detector")
    background = torch.tensor(BACKGROUND_RGB).view(1, 3, 1, 1)
    foreground = (images - background).norm(dim=1) > FOREGROUND_DISTANCE  # [N, H, W]
    labels = label_components(foreground, torch.zeros_like(foreground, dtype=torch.long))  # [N, H, W]
    crops, owners, boxes = [], [], []
    for n in range(images.shape[0]):
        instances = []
        for label in labels[n].unique().tolist():
            pixels = labels[n] == label  # [H, W]
            if label == 0 or int(pixels.sum()) < MIN_AREA:
                continue
            ys, xs = torch.nonzero(pixels, as_tuple=True)
            instances.append(((ys.min().item(), xs.min().item(), ys.max().item(), xs.max().item()), pixels))
        for (top, left, bottom, right), pixels in sorted(instances, key=lambda item: item[0][:2]):  # reading order
            ring = torch.nn.functional.max_pool2d(pixels[None, None].float(), 3, stride=1, padding=1)[0, 0] > 0
            ring &= (labels[n] == 0) | pixels  # never another instance's pixels
            crops.append(torch.where(ring, images[n], background[0]))  # [3, H, W]: the instance alone
            boxes.append((left, top, right + 1, bottom + 1))
            owners.append(n)
    heads = {name: torch.zeros(0, 8) for name in ("count", "colour", "shape")}  # no instance in the batch
    if crops:
        device, dtype = next(judge.parameters()).device, next(judge.parameters()).dtype
        logits = judge(torch.stack(crops).to(device, dtype))
        heads = {name: logits[name].float().softmax(1).cpu() for name in heads}  # [K, classes]
    found = []
    for n in range(images.shape[0]):
        rows = [k for k, owner in enumerate(owners) if owner == n]
        score, label = heads["shape"][rows, : len(SHAPES)].max(1)  # [K], [K]
        colours = heads["colour"][rows, : len(COLOURS)].argmax(1).tolist()
        found.append(
            Detections(
                labels=label,
                scores=score * heads["count"][rows, 0],
                boxes=torch.tensor([boxes[k] for k in rows], dtype=torch.float32).view(-1, 4),
                colours=tuple(COLOURS[c] for c in colours),
            )
        )
    return found
