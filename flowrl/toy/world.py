"""The Shapes world: a grammar of prompts, a seeded renderer of 32x32 images, a fixed split, corruptions.

A scene is one to three identical shapes (circle, square, triangle) of one colour on a dark background, at
random places, one random size per scene, never overlapping. Prompts read "<count> <colour> <shape>[s]",
e.g. "two red circles". Eight of the 36 combinations are held out of the model's training (`HELD_OUT`);
every pair of attribute values still appears in training, so the held-out set tests composition.

GenEval's two-object and position tasks have families of their own (`PairSpec`): two different shapes, each of its
own colour, "a red circle and a blue square" and "a red circle left of a blue square" (relations: left of, right of,
above, below). Their splits hold out whole pairs of objects (`pair_heldout`); the exact checker grades them by GenEval's
rules (rewards/toy_geneval.py, docs/toy.md#geneval-families).

Images are float32 tensors [3, H, W] in [0, 1]. Shapes are drawn from signed distances with one pixel of
anti-aliasing (coverage = clamp(0.5 - distance, 0, 1)), so rendering is exact and fast in numpy.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch

IMAGE_SIZE = 32
COUNTS = ("one", "two", "three")
COLOURS = ("red", "green", "blue", "yellow")
SHAPES = ("circle", "square", "triangle")
# RGB in [0, 1]
COLOUR_RGB = {
    "red": (0.90, 0.15, 0.15),
    "green": (0.15, 0.78, 0.22),
    "blue": (0.20, 0.35, 0.95),
    "yellow": (0.95, 0.85, 0.12),
}
BACKGROUND_RGB = (0.10, 0.10, 0.12)
GRAMMAR = (
    "<count> <colour> <shape>  with count in {one, two, three}, colour in {red, green, blue, yellow}, "
    "shape in {circle, square, triangle} (plural after two/three), e.g. 'two red circles'"
)

CORRUPTIONS = ("noise", "blocking", "stripes", "saturation")


@dataclass(frozen=True)
class ShapeSpec:
    count: int  # 1..3
    colour: str
    shape: str

    @property
    def prompt(self) -> str:
        plural = "s" if self.count > 1 else ""
        return f"{COUNTS[self.count - 1]} {self.colour} {self.shape}{plural}"

    @property
    def labels(self) -> tuple[int, int, int]:
        """(count index, colour index, shape index), the judges' class ids."""
        return self.count - 1, COLOURS.index(self.colour), SHAPES.index(self.shape)


ALL_SPECS = tuple(ShapeSpec(n, c, s) for n, c, s in itertools.product((1, 2, 3), COLOURS, SHAPES))
# Held out of the toy model's training: no two share a (count, colour), (count, shape) or (colour, shape) pair.
HELD_OUT = (
    ShapeSpec(1, "red", "triangle"),
    ShapeSpec(2, "red", "circle"),
    ShapeSpec(3, "green", "square"),
    ShapeSpec(1, "green", "circle"),
    ShapeSpec(2, "blue", "triangle"),
    ShapeSpec(3, "blue", "circle"),
    ShapeSpec(1, "yellow", "square"),
    ShapeSpec(3, "yellow", "triangle"),
)
TRAIN = tuple(s for s in ALL_SPECS if s not in HELD_OUT)

# ---- GenEval's two-object and position families ------------------------------------------------------------------

FAMILIES = ("two_object", "position")
RELATIONS = ("left of", "right of", "above", "below")  # GenEval's, read as "the first object lies ... the second"
PAIR_GRAMMAR = (
    "'a <colour> <shape> and a <colour> <shape>' (two_object) or 'a <colour> <shape> <relation> a <colour> <shape>' "
    "(position), relation in {left of, right of, above, below}, two different shapes, e.g. 'a red circle left of a "
    "blue square'"
)


@dataclass(frozen=True)
class PairSpec:
    """Two objects of different shapes, each (colour, shape); with a relation, where the first lies relative to the
    second (GenEval's position task), without one GenEval's two-object task."""

    first: tuple[str, str]
    second: tuple[str, str]
    relation: str | None = None

    @property
    def family(self) -> str:
        return "two_object" if self.relation is None else "position"

    @property
    def items(self) -> list[tuple[str, str]]:
        return [self.first, self.second]

    @property
    def prompt(self) -> str:
        link = "and" if self.relation is None else self.relation
        return f"a {' '.join(self.first)} {link} a {' '.join(self.second)}"

    @property
    def record(self) -> dict:
        """GenEval's metadata record of the prompt (a line of its evaluation_metadata.jsonl): one object of each shape
        in its colour; for position the reference object first and the placed one second with `position: [relation,
        0]`, as GenEval writes them. Nothing is excluded, as in GenEval's two-object and position records."""
        first, second = ({"class": shape, "count": 1, "color": colour} for colour, shape in self.items)
        include = [first, second] if self.relation is None else [second, {**first, "position": [self.relation, 0]}]
        return {"tag": self.family, "include": include, "exclude": [], "prompt": self.prompt}


def pair_heldout(spec: PairSpec) -> bool:
    """Whether a pair is held out: the sum of its four attribute indices (colours and shapes) divides by 4. That holds
    out 12 of the 48 unordered pairs, in either order and every relation; each object, each pair of colours and each
    pair of shapes still occurs in training, so the held-out pairs test composition."""
    indices = [COLOURS.index(c) + SHAPES.index(s) for c, s in spec.items]
    return sum(indices) % 4 == 0


_OBJECTS = tuple(itertools.product(COLOURS, SHAPES))
_PAIRS = tuple((a, b) for a in _OBJECTS for b in _OBJECTS if a[1] != b[1])  # ordered, two different shapes
PAIR_SPECS = {
    "two_object": tuple(PairSpec(a, b) for a, b in _PAIRS),
    "position": tuple(PairSpec(a, b, r) for a, b in _PAIRS for r in RELATIONS),
}
SPLITS = {"train": TRAIN, "heldout": HELD_OUT, "all": ALL_SPECS}
for _family, _specs in PAIR_SPECS.items():
    SPLITS[f"{_family}_train"] = tuple(s for s in _specs if not pair_heldout(s))
    SPLITS[f"{_family}_heldout"] = tuple(s for s in _specs if pair_heldout(s))
for _part in ("train", "heldout"):
    SPLITS[f"geneval_{_part}"] = SPLITS[f"two_object_{_part}"] + SPLITS[f"position_{_part}"]


def split_specs(split: str) -> tuple[ShapeSpec | PairSpec, ...]:
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is unknown; use one of {', '.join(SPLITS)}")
    return SPLITS[split]


def split_prompts(split: str) -> list[str]:
    return [spec.prompt for spec in split_specs(split)]


def parse_prompt(prompt: str) -> ShapeSpec:
    """'two red circles' -> ShapeSpec(2, 'red', 'circle'); anything outside the grammar raises ValueError."""
    words = prompt.strip().lower().split()
    if len(words) == 3 and words[0] in COUNTS and words[1] in COLOURS:
        count = COUNTS.index(words[0]) + 1
        shape = words[2][:-1] if count > 1 and words[2].endswith("s") else words[2]
        if shape in SHAPES and (count > 1) == (words[2] != shape):
            return ShapeSpec(count, words[1], shape)
    raise ValueError(f"prompt {prompt!r} is outside the Shapes grammar: {GRAMMAR}")


def parse_pair_prompt(prompt: str) -> PairSpec:
    """'a red circle left of a blue square' -> PairSpec(('red', 'circle'), ('blue', 'square'), 'left of'); anything
    outside `PAIR_GRAMMAR` raises ValueError."""
    words = prompt.strip().lower().split()
    link = " ".join(words[3:-3])
    if (
        len(words) in (7, 8)
        and words[0] == words[-3] == "a"
        and (link == "and" or link in RELATIONS)
        and {words[1], words[-2]} <= set(COLOURS)
        and {words[2], words[-1]} <= set(SHAPES)
    ):
        if words[2] == words[-1]:
            raise ValueError(
                f"prompt {prompt!r} names one shape twice; name two different shapes (GenEval's rules give each "
                "object the best detection of its class, so two objects of one class would compete for one)"
            )
        return PairSpec((words[1], words[2]), (words[-2], words[-1]), None if link == "and" else link)
    raise ValueError(f"prompt {prompt!r} is outside the Shapes world's GenEval families: {PAIR_GRAMMAR}")


def _place(rng: np.random.Generator, count: int, extent: float, size: int) -> list[tuple[float, float]] | None:
    centres: list[tuple[float, float]] = []
    lo, hi = extent + 0.5, size - extent - 0.5
    for _ in range(200):
        x, y = rng.uniform(lo, hi, size=2)
        if all(math.hypot(x - cx, y - cy) >= 2 * extent + 1.5 for cx, cy in centres):
            centres.append((float(x), float(y)))
            if len(centres) == count:
                return centres
    return None


def _signed_distance(shape: str, px: np.ndarray, py: np.ndarray, radius: float) -> np.ndarray:
    if shape == "circle":
        return np.hypot(px, py) - radius
    if shape == "square":  # axis-aligned, half side 0.85 r (about the circle's area)
        return np.maximum(np.abs(px), np.abs(py)) - 0.85 * radius
    # upright equilateral triangle (apex up, image y grows downwards), circumradius 1.25 r, centred on its centroid
    inradius = 0.625 * radius
    edges = (py, 0.8660254 * px - 0.5 * py, -0.8660254 * px - 0.5 * py)
    return np.maximum.reduce(edges) - inradius


def _scene(spec: ShapeSpec, rng: np.random.Generator, size: int) -> list[tuple[float, float, float]]:
    """[(cx, cy, radius)] for one scene; the radius shrinks until the shapes fit without overlap."""
    radius = rng.uniform(3.5, 6.0) * size / IMAGE_SIZE
    while True:
        extent = 1.25 * radius if spec.shape == "triangle" else 1.2 * radius
        centres = _place(rng, spec.count, extent, size)
        if centres is not None:
            return [(cx, cy, radius) for cx, cy in centres]
        radius *= 0.9


def render(spec: ShapeSpec | PairSpec, seed: int, size: int = IMAGE_SIZE) -> torch.Tensor:
    """One scene [3, size, size] float32 in [0, 1]; the same (spec, seed) always gives the same image."""
    if isinstance(spec, PairSpec):
        return render_pair(spec, seed, size)
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5  # pixel centres, [size, size]
    coverage = np.zeros((size, size))
    for cx, cy, radius in _scene(spec, rng, size):
        alpha = np.clip(0.5 - _signed_distance(spec.shape, xs - cx, ys - cy, radius), 0.0, 1.0)
        coverage = np.maximum(coverage, alpha)
    colour = np.asarray(COLOUR_RGB[spec.colour])[:, None, None]  # [3, 1, 1]
    background = np.asarray(BACKGROUND_RGB)[:, None, None]
    image = background * (1 - coverage) + colour * coverage  # [3, size, size]
    return torch.from_numpy(image.astype(np.float32))


def _place_related(
    rng: np.random.Generator, relation: str, extent: float, size: int
) -> list[tuple[float, float]] | None:
    """Centres [first, second] with the first in `relation` to the second, clearly: apart along the relation's axis
    by at least half as much again as across it (so no other relation of GenEval's holds), and as far apart as
    `_place` keeps shapes; None after 200 tries."""
    lo, hi = extent + 0.5, size - extent - 0.5
    axis, sign = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}[relation]
    for _ in range(200):
        first, second = rng.uniform(lo, hi, size=2), rng.uniform(lo, hi, size=2)
        along, across = sign * (first[axis] - second[axis]), abs(first[1 - axis] - second[1 - axis])
        if along > 0 and across <= along / 2 and math.hypot(*(first - second)) >= 2 * extent + 1.5:
            return [(float(first[0]), float(first[1])), (float(second[0]), float(second[1]))]
    return None


def render_pair(spec: PairSpec, seed: int, size: int = IMAGE_SIZE) -> torch.Tensor:
    """The scene [3, size, size] of a GenEval-family prompt: its two objects, one radius per scene as `render` draws
    them, placed at random for two_object (`render_items`) and in the prompt's relation for position."""
    if spec.relation is None:
        return render_items(spec.items, seed, size)
    rng = np.random.default_rng(seed)
    radius = rng.uniform(3.5, 6.0) * size / IMAGE_SIZE
    while True:
        extent = radius * max(1.25 if shape == "triangle" else 1.2 for _, shape in spec.items)
        centres = _place_related(rng, spec.relation, extent, size)
        if centres is not None:
            return _paint(spec.items, centres, radius, size)
        radius *= 0.9


def render_batch(specs: list[ShapeSpec], seeds: list[int], size: int = IMAGE_SIZE) -> torch.Tensor:
    """Scenes [N, 3, size, size] float32 in [0, 1]."""
    if len(specs) != len(seeds):
        raise ValueError(f"render_batch: {len(specs)} specs but {len(seeds)} seeds; give one seed per spec")
    return torch.stack([render(spec, seed, size) for spec, seed in zip(specs, seeds)])


def sample_specs(num: int, split: str, generator: torch.Generator) -> list[ShapeSpec]:
    """`num` specs drawn uniformly from a split."""
    pool = split_specs(split)
    index = torch.randint(len(pool), (num,), generator=generator)  # [N]
    return [pool[i] for i in index.tolist()]


def random_batch(num: int, split: str, generator: torch.Generator) -> tuple[torch.Tensor, list[ShapeSpec]]:
    """Fresh renders [N, 3, 32, 32] of random specs from a split, seeded by the generator."""
    specs = sample_specs(num, split, generator)
    seeds = torch.randint(2**31 - 1, (num,), generator=generator).tolist()  # [N]
    return render_batch(specs, seeds), specs


# ---- corruptions (the artifact judge's negatives) ---------------------------------------------------------


def corrupt(images: torch.Tensor, kind: str, generator: torch.Generator) -> torch.Tensor:
    """Apply one corruption with a random strength per image; images [N, 3, H, W] in [0, 1] -> same shape."""
    n, _, h, w = images.shape

    def uniform(lo: float, hi: float) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(n, 1, 1, 1, generator=generator)  # [N, 1, 1, 1]

    if kind == "noise":  # additive Gaussian noise, std 0.08..0.25
        out = images + uniform(0.08, 0.25) * torch.randn(images.shape, generator=generator)
    elif kind == "blocking":  # 4x4 (or 8x8) block averages blended in: pixelation / codec blocks
        block = 4 if torch.rand((), generator=generator) < 0.75 else 8
        pooled = torch.nn.functional.avg_pool2d(images, block)
        pooled = torch.nn.functional.interpolate(pooled, size=(h, w), mode="nearest")  # [N, 3, H, W]
        out = images + uniform(0.7, 1.0) * (pooled - images)
    elif kind == "stripes":  # periodic lines, horizontal or vertical, period 2..4 px
        period = torch.randint(2, 5, (n,), generator=generator).float()[:, None]  # [N, 1]
        phase = torch.rand(n, 1, generator=generator) * period
        coord = torch.arange(h).float()[None, :]  # [1, H]
        lines = (((coord + phase) % period) < 1).float()  # [N, H]
        vertical = torch.rand(n, generator=generator) < 0.5
        pattern = torch.where(
            vertical[:, None, None], lines[:, None, :].expand(n, h, w), lines[:, :, None].expand(n, h, w)
        )
        sign = torch.where(torch.rand(n, 1, 1, 1, generator=generator) < 0.5, -1.0, 1.0)
        tint = 0.5 + 0.5 * torch.rand(n, 3, 1, 1, generator=generator)  # [N, 3, 1, 1]
        out = images + sign * uniform(0.15, 0.35) * tint * pattern[:, None]
    elif kind == "saturation":  # chroma blown up and a colour cast, clipped: the over-saturated look
        grey = images.mean(dim=1, keepdim=True)  # [N, 1, H, W]
        cast = torch.rand(n, 3, 1, 1, generator=generator) * uniform(0.25, 0.5)  # [N, 3, 1, 1]
        out = grey + uniform(2.0, 3.5) * (images - grey) + cast
    else:
        raise ValueError(f"corruption kind={kind!r} is unknown; use one of {', '.join(CORRUPTIONS)}")
    return out.clamp(0.0, 1.0)


def soften(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mild clean-side augmentation (slight blur on half the images, faint noise): model samples look like this."""
    n = images.shape[0]
    kernel = torch.tensor([0.25, 0.5, 0.25])
    kernel2d = (kernel[:, None] * kernel[None, :]).expand(3, 1, 3, 3)  # [3, 1, 3, 3]
    blurred = torch.nn.functional.conv2d(
        torch.nn.functional.pad(images, (1, 1, 1, 1), mode="replicate"), kernel2d, groups=3
    )
    mix = (torch.rand(n, 1, 1, 1, generator=generator) < 0.5).float() * torch.rand(n, 1, 1, 1, generator=generator)
    out = images + mix * (blurred - images)
    out = out + 0.03 * torch.rand(n, 1, 1, 1, generator=generator) * torch.randn(images.shape, generator=generator)
    return out.clamp(0.0, 1.0)


# ---- scenes the world never draws (the attribute judge's negatives, the exact checker's tests) ---------------

IMPOSSIBLE_KINDS = ("empty", "four", "five", "mixed_colours", "mixed_shapes")


def render_items(
    items: list[tuple[str, str]], seed: int, size: int = IMAGE_SIZE, faint: tuple[int, float, float] | None = None
) -> torch.Tensor:
    """Any scene [3, size, size] of `items` = [(colour, shape), ...], placed and sized as `render` places them (one
    radius per scene, shrunk until nothing overlaps), so `render_items([(c, s)] * n, seed) == render(ShapeSpec(n, c,
    s), seed)`. It also draws what `render` never does: no shape, four or five, several colours or shapes at once,
    and with `faint` = (item index, strength, scale) that item faded to `strength` of its colour and shrunk to `scale`
    of the scene's radius (`faint_items`: what a policy draws to slip an extra shape past the attribute judge)."""
    for colour, shape in items:
        if colour not in COLOURS or shape not in SHAPES:
            raise ValueError(f"item ({colour!r}, {shape!r}) is unknown; colours are {COLOURS}, shapes {SHAPES}")
    rng = np.random.default_rng(seed)
    radius, centres = 0.0, []
    if items:
        radius = rng.uniform(3.5, 6.0) * size / IMAGE_SIZE
        centres = None
        while centres is None:
            extent = radius * max(1.25 if shape == "triangle" else 1.2 for _, shape in items)
            centres = _place(rng, len(items), extent, size)
            radius = radius if centres is not None else radius * 0.9
    return _paint(items, centres, radius, size, faint)


def _paint(
    items: list[tuple[str, str]],
    centres: list[tuple[float, float]],
    radius: float,
    size: int,
    faint: tuple[int, float, float] | None = None,
) -> torch.Tensor:
    """The scene [3, size, size] of `items` at `centres` [(x, y)], all of one `radius` (`render_items`' drawing)."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5  # pixel centres, [size, size]
    coverage = {colour: np.zeros((size, size)) for colour, _ in items}  # one coverage map per colour
    for i, ((colour, shape), (cx, cy)) in enumerate(zip(items, centres)):
        strength, scale = (faint[1], faint[2]) if faint is not None and faint[0] == i else (1.0, 1.0)
        alpha = np.clip(0.5 - _signed_distance(shape, xs - cx, ys - cy, radius * scale), 0.0, 1.0)
        coverage[colour] = np.maximum(coverage[colour], strength * alpha)
    background = np.asarray(BACKGROUND_RGB)[:, None, None]  # [3, 1, 1]
    total = sum(coverage.values(), np.zeros((size, size)))  # shapes never overlap, so this is at most 1
    image = background * (1 - total) + sum(
        (np.asarray(COLOUR_RGB[c])[:, None, None] * a for c, a in coverage.items()), 0.0
    )
    return torch.from_numpy(np.broadcast_to(image, (3, size, size)).astype(np.float32))


def impossible_items(kind: str, generator: torch.Generator) -> list[tuple[str, str]]:
    """The (colour, shape) items of one scene the world never renders: "empty" (no shape), "four" or "five" alike
    shapes, "mixed_colours" (two or three alike shapes in at least two colours), "mixed_shapes" (at least two shapes
    in one colour)."""

    def pick(pool: tuple[str, ...], num: int = 1) -> list[str]:
        return [pool[i] for i in torch.randint(len(pool), (num,), generator=generator).tolist()]

    def mixed(pool: tuple[str, ...]) -> list[str]:
        num = int(torch.randint(2, 4, (), generator=generator))
        first, second = (pool[i] for i in torch.randperm(len(pool), generator=generator)[:2].tolist())
        return [first, second] + pick(pool, num - 2)  # at least two distinct values

    if kind == "empty":
        return []
    if kind in ("four", "five"):
        return [(pick(COLOURS)[0], pick(SHAPES)[0])] * (4 if kind == "four" else 5)
    if kind == "mixed_colours":
        shape = pick(SHAPES)[0]
        return [(colour, shape) for colour in mixed(COLOURS)]
    if kind == "mixed_shapes":
        colour = pick(COLOURS)[0]
        return [(colour, shape) for shape in mixed(SHAPES)]
    raise ValueError(f"impossible scene kind={kind!r} is unknown; use one of {', '.join(IMPOSSIBLE_KINDS)}")


FAINT_STRENGTH = (0.6, 0.9)  # a faint shape's share of its colour: above toy_exact's coverage threshold (0.5)
FAINT_SCALE = (0.6, 1.0)  # its radius as a share of the scene's


def impossible_batch(num: int, generator: torch.Generator, kinds: tuple[str, ...] = IMPOSSIBLE_KINDS):
    """Renders [N, 3, 32, 32] of scenes outside the world, the kind drawn uniformly from `kinds` per scene, and their
    items [N] (lists of (colour, shape)), seeded by the generator."""
    which = torch.randint(len(kinds), (num,), generator=generator).tolist()  # [N]
    items = [impossible_items(kinds[k], generator) for k in which]
    seeds = torch.randint(2**31 - 1, (num,), generator=generator).tolist()  # [N]
    return torch.stack([render_items(scene, seed) for scene, seed in zip(items, seeds)]), items
