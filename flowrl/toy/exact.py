"""The Shapes world read from pixels by fixed rules, with no learned part: the `toy_exact` reward's checker.

1. Pixel colour and coverage. Every pixel p is explained as a mix of the background b and one palette colour c:
   p ~ b + a (c - b), a in [0, 1]. Its colour is the palette colour whose mixing line passes nearest to p, its
   coverage the `a` on that line. Anti-aliased edges and blur mix a shape with the background, so they stay on the
   shape's line; a pixel is foreground when a > 0.5 (for a clean render: its centre lies inside a shape).
2. Shapes are the 4-connected components of foreground pixels of one colour; components of fewer than `MIN_AREA`
   pixels are specks (noise, a stray edge pixel) and are ignored. Two shapes of one colour that touch are one
   component (the world never draws that: it keeps shapes at least a pixel and a half apart); touching shapes of
   different colours stay two.
3. The shape of a component is read from its geometry (`measure`, `classify_shape`), on its coverage over its
   pixels and the one-pixel ring around them (less other shapes' pixels), so anti-aliased edges count by their
   coverage: how much of its box it fills (square ~1, circle ~pi/4, upright triangle ~1/2; the box is the sum of
   the row and of the column maxima, sub-pixel exact) and how far its mass sits below the box's middle (a
   triangle's apex points up, so its centroid lies a third of its height above its base: ~1/6 of a box height
   low; circles and squares ~0). A shape clipped by the image border is read from its visible part.

Images of another size than 32x32 are resized to 32x32 first (bilinear, antialiased), as the judges do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrl.toy.world import BACKGROUND_RGB, COLOUR_RGB, COLOURS, FAINT_SCALE, FAINT_STRENGTH, IMAGE_SIZE, render_items

MIN_AREA = 6  # pixels; the smallest shape the world draws covers about 20
COVERAGE_THRESHOLD = 0.5


@dataclass(frozen=True)
class Blob:
    """One shape found in an image: its colour, shape and the geometry the shape was read from."""

    colour: str
    shape: str
    area: int  # foreground pixels
    box: tuple[int, int, int, int]  # (top, left, bottom, right), inclusive
    fill: float  # area / box area
    drop: float  # (centroid row - box middle row) / box height: ~0 for circles and squares, ~1/6 for triangles


def classify_shape(fill: float, drop: float) -> str:
    """Circle, square or triangle from a shape's box fill and centroid drop (module docstring, step 3). On 3000 fresh
    renders, raw and softened, triangles measured fill 0.52-0.79 and drop 0.08-0.17, circles fill 0.76-0.84 and
    squares 0.92-1.03 (both |drop| < 0.013); the cuts lie midway."""
    if drop > 0.045 or fill < 0.65:
        return "triangle"
    return "square" if fill > 0.885 else "circle"


def pixel_colours(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Images [N, 3, H, W] -> (palette index [N, H, W], coverage on every colour's mixing line [N, K, H, W]) of each
    pixel (module docstring, step 1); the pixel's own coverage is the one at its index."""
    background = torch.tensor(BACKGROUND_RGB, dtype=torch.float32)
    directions = torch.tensor([COLOUR_RGB[c] for c in COLOURS], dtype=torch.float32) - background  # [K, 3]
    offsets = images.float() - background[None, :, None, None]  # [N, 3, H, W]
    along = torch.einsum("nchw,kc->nkhw", offsets, directions) / directions.square().sum(1)[None, :, None, None]
    along = along.clamp(0.0, 1.0)  # [N, K, H, W]
    nearest = offsets[:, None] - along[:, :, None] * directions[None, :, :, None, None]  # [N, K, 3, H, W]
    return nearest.square().sum(2).argmin(1), along


def label_components(mask: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
    """4-connected components of `mask` [N, H, W] among pixels of equal `colour` [N, H, W] -> labels [N, H, W]
    (0 = background; a component's label is the largest 1-based flat index of its pixels)."""
    n, h, w = mask.shape
    labels = torch.where(mask, torch.arange(1, h * w + 1).view(1, h, w).expand(n, h, w), 0)  # [N, H, W]
    key = torch.where(mask, colour, -1)
    for _ in range(h * w):  # each sweep carries the largest label one pixel further; usually done within ~20
        grown = labels
        for dim, step in ((1, 1), (1, -1), (2, 1), (2, -1)):
            neighbour = torch.roll(labels, step, dims=dim)
            same = torch.roll(key, step, dims=dim) == key
            edge = torch.zeros_like(mask)  # the wrapped-around row or column of the roll is not a neighbour
            edge.select(dim, 0 if step == 1 else -1).fill_(True)
            grown = torch.where(mask & same & ~edge, torch.maximum(grown, neighbour), grown)
        if torch.equal(grown, labels):
            return labels
        labels = grown
    return labels


def measure(coverage: torch.Tensor) -> tuple[float, float]:
    """(fill, drop) of one shape's coverage map [H, W] (its pixels and the ring around them, zero elsewhere): the area
    over the box of its row and column profiles (sub-pixel exact on anti-aliased edges), and how far its centroid
    lies below the middle of that box, in box heights."""
    rows, cols = coverage.amax(1), coverage.amax(0)  # [H], [W]
    area, height, width = coverage.sum(), rows.sum(), cols.sum()
    y = torch.arange(coverage.shape[0], dtype=torch.float32)
    drop = ((coverage.sum(1) * y).sum() / area - (rows * y).sum() / height) / height
    return (area / (height * width)).item(), drop.item()


def find_blobs(images: torch.Tensor) -> list[list[Blob]]:
    """Images [N, 3, H, W] in [0, 1] -> the shapes found in each image, in reading order (top to bottom)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images shape {tuple(images.shape)}: the exact checker takes [N, 3, H, W] RGB in [0, 1]")
    if images.shape[-2:] != (IMAGE_SIZE, IMAGE_SIZE):
        images = torch.nn.functional.interpolate(
            images.float(), size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", antialias=True
        )
    colour, along = pixel_colours(images.detach())
    labels = label_components(along.gather(1, colour[:, None]).squeeze(1) > COVERAGE_THRESHOLD, colour)  # [N, H, W]
    found: list[list[Blob]] = []
    for n in range(images.shape[0]):
        blobs = []
        for label in labels[n].unique().tolist():
            pixels = labels[n] == label  # [H, W]
            area = int(pixels.sum())
            if label == 0 or area < MIN_AREA:
                continue
            ys, xs = torch.nonzero(pixels, as_tuple=True)
            k = colour[n, ys[0], xs[0]].item()
            # [H, W]
            ring = torch.nn.functional.max_pool2d(pixels[None, None].float(), 3, stride=1, padding=1)[0, 0] > 0
            ring &= (labels[n] == 0) | pixels  # never another shape's pixels
            fill, drop = measure(along[n, k] * ring)
            box = (ys.min().item(), xs.min().item(), ys.max().item(), xs.max().item())
            blobs.append(Blob(COLOURS[k], classify_shape(fill, drop), area, box, round(fill, 4), round(drop, 4)))
        found.append(sorted(blobs, key=lambda b: (b.box[0], b.box[1])))
    return found


def faint_items(
    items: list[tuple[str, str]], seed: int, generator: torch.Generator, same_shapes: bool = True
) -> torch.Tensor | None:
    """The scene of `items` with one item (drawn at random) faint: its colour faded to U(FAINT_STRENGTH) and its
    radius shrunk to U(FAINT_SCALE). None when the exact checker would not read the faint scene as the same number
    of shapes in the items' colours (and, with `same_shapes`, their shapes: the checker reads a faint circle's fill
    as a square's), so a judge trained on it learns to count what the gold counts. Used by
    scripts/train_toy_judges.py against the hack it closes: four shapes for "three", one of them dim or small, which
    the judge trained on full-strength scenes called three."""
    if not items:
        return None
    index = int(torch.randint(len(items), (), generator=generator))
    strength = FAINT_STRENGTH[0] + (FAINT_STRENGTH[1] - FAINT_STRENGTH[0]) * float(torch.rand((), generator=generator))
    scale = FAINT_SCALE[0] + (FAINT_SCALE[1] - FAINT_SCALE[0]) * float(torch.rand((), generator=generator))
    image = render_items(items, seed, faint=(index, strength, scale))
    blobs = find_blobs(image[None])[0]
    if same_shapes:
        same = sorted((b.colour, b.shape) for b in blobs) == sorted(items)
    else:
        same = sorted(b.colour for b in blobs) == sorted(c for c, _ in items)
    return image if same else None
