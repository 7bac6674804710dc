"""GenEval's rules (Ghosh et al. 2023, djghosh13/geneval `evaluation/evaluate_images.py`) and the strict and partial
scores flow_grpo trains on (yifan123/reward-server `reward_server/gen_eval.py`), as pure functions of detections.

A GenEval record (one line of its `evaluation_metadata.jsonl`) asks for objects: `include` entries
`{class, count[, color][, position: [relation, index of an earlier entry]]}` and `exclude` entries `{class, count}`.
The detector's output becomes, per class name, the indices of the detections kept (`keep_objects`); the verdicts
read those, the boxes, and a `colours(class_name, indices)` callable that names each object's colour (the reward
asks CLIP; `colour_names` turns its logits into names). Line numbers below are those of the two upstream files,
which `tests/rewards/test_geneval_rules.py` runs beside these functions on random detections.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")  # L76
TASKS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
RELATIONS = ("left of", "right of", "above", "below")  # L153-156
# GenEval's `evaluation/object_names.txt`: the 80 COCO thing classes in the detector's label order
OBJECT_NAMES = (
    *("person", "bicycle", "car", "motorcycle", "airplane", "bus", "train", "truck", "boat", "traffic light"),
    *("fire hydrant", "stop sign", "parking meter", "bench", "bird", "cat", "dog", "horse", "sheep", "cow"),
    *("elephant", "bear", "zebra", "giraffe", "backpack", "umbrella", "handbag", "tie", "suitcase", "frisbee"),
    *("skis", "snowboard", "sports ball", "kite", "baseball bat", "baseball glove", "skateboard", "surfboard"),
    *("tennis racket", "bottle", "wine glass", "cup", "fork", "knife", "spoon", "bowl", "banana", "apple"),
    *("sandwich", "orange", "broccoli", "carrot", "hot dog", "pizza", "donut", "cake", "chair", "couch"),
    *("potted plant", "bed", "dining table", "toilet", "tv", "laptop", "computer mouse", "tv remote"),
    *("computer keyboard", "cell phone", "microwave", "oven", "toaster", "sink", "refrigerator", "book", "clock"),
    *("vase", "scissors", "teddy bear", "hair drier", "toothbrush"),
)
# clip_benchmark's zero-shot classifier over these, each embedding the mean of the three (L111-118)
COLOUR_TEMPLATES = ("a photo of a {c} {name}", "a photo of a {c}-colored {name}", "a photo of a {c} object")
DETECTOR_MEAN = (123.675, 116.28, 103.53)  # mmdet's img_norm_cfg of GenEval's Mask2Former config, RGB in [0, 255]
DETECTOR_STD = (58.395, 57.12, 57.375)
BACKGROUND = 153  # GenEval's `bgcolor` default "#999": what surrounds an object's mask in its colour crop
Colours = Callable[[str, list[int]], list[str]]  # (class name, detection indices) -> one colour name per index
Objects = dict[str, list[int]]  # class name -> indices of the detections kept, highest score first


@dataclass(frozen=True)
class Thresholds:
    """GenEval's `--options` and their defaults (evaluate_images.py L286-290)."""

    threshold: float = 0.3  # a detection counts when its score exceeds this ...
    counting_threshold: float = 0.9  # ... or this, for prompts tagged `counting`
    max_objects: int = 16  # at most this many per class, highest scores first
    max_overlap: float = 1.0  # per-class greedy suppression at this IoU; 1 = none (GenEval's default)
    position_threshold: float = 0.1  # the margin of a relation, as a fraction of the two objects' sizes

    def __post_init__(self) -> None:
        for key, ok, allowed in (
            ("threshold", 0 <= self.threshold < 1, "in [0, 1)"),
            ("counting_threshold", 0 <= self.counting_threshold < 1, "in [0, 1)"),
            (
                "max_objects",
                not isinstance(self.max_objects, bool) and isinstance(self.max_objects, int) and self.max_objects >= 1,
                "a whole number >= 1",
            ),
            ("max_overlap", 0 < self.max_overlap <= 1, "in (0, 1]; 1 turns suppression off"),
            ("position_threshold", self.position_threshold >= 0, ">= 0"),
        ):
            if not ok:
                value, default = getattr(self, key), getattr(Thresholds, key)
                raise ValueError(f"geneval {key}={value!r} must be {allowed} (GenEval's default: {default})")


@dataclass(frozen=True)
class Requirement:
    name: str
    count: int
    color: str | None = None
    position: tuple[str, int] | None = None  # (relation, index of the include entry it is relative to)


@dataclass(frozen=True)
class Record:
    tag: str
    include: tuple[Requirement, ...]
    exclude: tuple[tuple[str, int], ...]


# ---- records ----------------------------------------------------------------------------------------------------


def _closest(value: Any, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(value), allowed, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}.count={value!r} must be a whole number >= 1; write how many objects, e.g. 2")
    return value


def _name(value: Any, where: str, names: tuple[str, ...] = OBJECT_NAMES) -> str:
    if value not in names:
        if names is not OBJECT_NAMES:
            raise ValueError(
                f"{where}.class={value!r} is not a class of this detector{_closest(value, names)}; use one of {names}"
            )
        raise ValueError(
            f"{where}.class={value!r} is not one of GenEval's 80 COCO names{_closest(value, OBJECT_NAMES)}; "
            "use a name of OBJECT_NAMES in rewards/_geneval_rules.py"
        )
    return value


def _entries(value: Any, where: str, keys: tuple[str, ...], required: bool) -> list[dict[str, Any]]:
    if not isinstance(value, list) or (required and not value):
        need = "a non-empty list" if required else "a list"
        raise ValueError(
            f"{where}={value!r} must be {need} of {{{', '.join(keys)}}} dicts, e.g. [{{'class': 'dog', 'count': 2}}]"
        )
    for j, entry in enumerate(value):
        if not isinstance(entry, dict) or "class" not in entry or "count" not in entry:
            raise ValueError(
                f"{where}[{j}]={entry!r} must be a dict with 'class' and 'count'; e.g. {{'class': 'dog', 'count': 2}}"
            )
        for key in entry:
            if key not in keys:
                raise ValueError(f"{where}[{j}] has the key {key!r}{_closest(key, keys)}; GenEval reads only {keys}")
    return value


def parse_record(meta: Any, where: str, names: tuple[str, ...] = OBJECT_NAMES) -> Record | None:
    """A sample's metadata as a GenEval record; None when it holds neither `tag` nor `include` (not a GenEval
    prompt: its scores are NaN). A malformed record raises a ValueError naming the field and the fix. `names`: the
    detector's class names (GenEval's 80 COCO ones; the Shapes world's detectors name its shapes)."""
    if not isinstance(meta, dict):
        raise ValueError(f"{where} is a {type(meta).__name__}; pass a dict (a GenEval record or {{}})")
    if "tag" not in meta and "include" not in meta:
        return None
    tag = meta.get("tag")
    if tag not in TASKS:
        raise ValueError(f"{where}.tag={tag!r} is not a GenEval task{_closest(tag, TASKS)}; use one of {TASKS}")
    include = []
    entries = _entries(meta.get("include"), f"{where}.include", ("class", "count", "color", "position"), True)
    for j, entry in enumerate(entries):
        at = f"{where}.include[{j}]"
        color, position = entry.get("color"), entry.get("position")
        if "color" in entry and color not in COLORS:
            hint = _closest(color, COLORS)
            raise ValueError(f"{at}.color={color!r} is not a GenEval colour{hint}; use one of {COLORS}")
        if "position" in entry:
            ok = isinstance(position, (list, tuple)) and len(position) == 2 and position[0] in RELATIONS
            if not ok or isinstance(position[1], bool) or not isinstance(position[1], int) or not 0 <= position[1] < j:
                raise ValueError(
                    f"{at}.position={position!r} must be [relation, index of an earlier include entry], the "
                    f"relation one of {RELATIONS}; e.g. ['left of', 0]"
                )
            position = (position[0], position[1])
        include.append(Requirement(_name(entry["class"], at, names), _count(entry["count"], at), color, position))
    exclude = tuple(
        (_name(e["class"], f"{where}.exclude[{j}]", names), _count(e["count"], f"{where}.exclude[{j}]"))
        for j, e in enumerate(_entries(meta.get("exclude", []), f"{where}.exclude", ("class", "count"), False))
    )
    return Record(tag, tuple(include), exclude)


# ---- detections -------------------------------------------------------------------------------------------------


def mask_boxes(masks: torch.Tensor) -> torch.Tensor:
    """[K, H, W] bool -> [K, 4] float32 boxes (x1, y1, x2 + 1, y2 + 1) around each mask; zeros for an empty one
    (mmdet's mask2bbox)."""
    boxes = torch.zeros(len(masks), 4, device=masks.device)
    columns, rows = masks.any(1), masks.any(2)  # [K, W], [K, H]
    for k in range(len(masks)):
        x, y = columns[k].nonzero().flatten().tolist(), rows[k].nonzero().flatten().tolist()
        if x and y:
            boxes[k] = torch.tensor([x[0], y[0], x[-1] + 1, y[-1] + 1], dtype=torch.float32)
    return boxes


def instances(
    class_logits: torch.Tensor,
    mask_logits: torch.Tensor,
    input_size: tuple[int, int],
    resized_size: tuple[int, int],
    image_size: tuple[int, int],
    max_detections: int,
    min_score: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mask2Former's instance detections of one image, as mmdet's MaskFormerFusionHead.instance_postprocess (the
    detector GenEval runs) makes them: the `max_detections` best (query, class) pairs by class probability, each
    scored by that probability times the mean sigmoid of its mask logits over the mask, the mask being where the
    logits (bilinearly upsampled to the padded `input_size`, cut to the `resized_size` image, resized to
    `image_size`) are positive, the box the mask's.

    class_logits [Q, C + 1] (the last: no object), mask_logits [Q, h, w]. Only pairs whose class probability
    exceeds `min_score` are returned: the others cannot exceed it, since a mask's mean sigmoid is below 1.
    Returns labels [K] (int64), scores [K], boxes [K, 4] (float32, image pixels) and masks [K, H, W] (bool).
    """
    probs = class_logits.float().softmax(-1)[:, :-1]  # [Q, C]
    top, index = probs.flatten().topk(min(max_detections, probs.numel()))  # [D]
    top, index = top[top > min_score], index[top > min_score]  # [K]
    labels, queries = index % probs.shape[1], index // probs.shape[1]
    if len(index) == 0:  # nothing can pass: interpolate takes no empty batch
        return (
            labels,
            top,
            torch.zeros(0, 4, device=top.device),
            torch.zeros(0, *image_size, dtype=torch.bool, device=top.device),
        )
    logits = F.interpolate(mask_logits[queries][None].float(), size=input_size, mode="bilinear", align_corners=False)
    logits = logits[..., : resized_size[0], : resized_size[1]]
    logits = F.interpolate(logits, size=image_size, mode="bilinear", align_corners=False)[0]  # [K, H, W]
    masks = logits > 0
    mask_scores = (logits.sigmoid() * masks).flatten(1).sum(1) / (masks.flatten(1).sum(1) + 1e-6)  # [K]
    return labels, top * mask_scores, mask_boxes(masks), masks


def detector_input(pixels: torch.Tensor, short_side: int, long_side: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """uint8 [N, 3, H, W] -> (normalised pixels padded to a multiple of 32, the resized size) as mmdet's test
    pipeline: the largest scale with the long side <= long_side and the short side <= short_side, bilinear, rounded
    to 8 bits like its uint8 resize."""
    h, w = pixels.shape[-2:]
    scale = min(long_side / max(h, w), short_side / min(h, w))
    size = (int(h * scale + 0.5), int(w * scale + 0.5))
    x = pixels.float()
    if size != (h, w):
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False).round().clamp(0, 255)
    mean, std = (torch.tensor(v, device=x.device).view(1, 3, 1, 1) for v in (DETECTOR_MEAN, DETECTOR_STD))
    pad = (0, math.ceil(size[1] / 32) * 32 - size[1], 0, math.ceil(size[0] / 32) * 32 - size[0])
    return F.pad((x - mean) / std, pad), size


def colour_crop(image: np.ndarray, mask: np.ndarray, box: Any, size: int, mean: Any, std: Any) -> torch.Tensor:
    """GenEval's colour input of one object: the mask's pixels of `image` (uint8 [H, W, 3]) on grey, cut to `box`
    (PIL rounds its corners), then open_clip's eval transform: shortest side to `size` (bicubic), centre crop."""
    crop = Image.fromarray(np.where(mask[..., None], image, BACKGROUND).astype(np.uint8)).crop(tuple(box[:4]))
    w, h = crop.size
    long = int(size * max(w, h) / min(w, h))
    crop = crop.resize((size, long) if w <= h else (long, size), Image.BICUBIC)
    top, left = int(round((crop.height - size) / 2.0)), int(round((crop.width - size) / 2.0))
    array = np.asarray(crop.crop((left, top, left + size, top + size)), dtype=np.float32) / 255
    pixels = torch.from_numpy(array).permute(2, 0, 1)  # [3, size, size] in [0, 1]
    return (pixels - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def box_iou(a: Any, b: Any) -> float:
    """IoU of two (x1, y1, x2, y2) boxes whose sides count both end pixels (width x2 - x1 + 1; L130-137)."""

    def area(x1: Any, y1: Any, x2: Any, y2: Any) -> Any:
        return max(x2 - x1 + 1, 0) * max(y2 - y1 + 1, 0)

    inter = area(max(a[0], b[0]), max(a[1], b[1]), min(a[2], b[2]), min(a[3], b[3]))
    union = area(*a[:4]) + area(*b[:4]) - inter
    return inter / union if union else 0


def keep_objects(
    labels: Any, scores: Any, boxes: Any, tag: str, thresholds: Thresholds, names: tuple[str, ...] = OBJECT_NAMES
) -> Objects:
    """Per class name, the indices of the detections that count, highest score first (L229-244): scores above the
    threshold (the counting threshold for `counting` prompts), at most `max_objects` per class, then greedy
    suppression of those overlapping a kept one at IoU >= `max_overlap` (none at 1). Classes with none are absent.
    `labels` index `names`, the detector's class names (GenEval's 80 COCO ones by default).

    Scores compare in float32, as GenEval's float32 arrays do; equal scores keep numpy's default argsort order,
    reversed, as GenEval's do.
    """
    labels, scores = np.asarray(labels), np.asarray(scores, dtype=np.float32)
    boxes = np.asarray(boxes, dtype=np.float32)
    limit = thresholds.counting_threshold if tag == "counting" else thresholds.threshold
    objects: Objects = {}
    for label in sorted(set(labels.tolist())):
        members = np.flatnonzero(labels == label)
        ranked = members[np.argsort(scores[members])[::-1]]
        ranked = ranked[scores[ranked] > limit][: thresholds.max_objects]
        kept: list[int] = []
        for i in ranked.tolist():
            if thresholds.max_overlap >= 1 or all(box_iou(boxes[k], boxes[i]) < thresholds.max_overlap for k in kept):
                kept.append(i)
        if kept:
            objects[names[label]] = kept
    return objects


# ---- verdicts ---------------------------------------------------------------------------------------------------


def relations(box_a: Any, box_b: Any, margin: float) -> set[str]:
    """Where box A lies relative to box B (L140-157): the offset between the centres, each axis shrunk towards 0 by
    `margin` times the two boxes' summed size on that axis; a relation holds when its shrunk component, divided
    by the unshrunk centre distance, passes 0.5 (so a diagonal offset can hold two). Float32, as GenEval's boxes."""
    a, b = np.asarray(box_a[:4], dtype=np.float32), np.asarray(box_b[:4], dtype=np.float32)
    offset = (a[:2] + a[2:]) / 2 - (b[:2] + b[2:]) / 2  # [dx, dy]: +x right, +y down
    sizes = np.abs(a[2:] - a[:2]) + np.abs(b[2:] - b[:2])
    shrunk = np.sign(offset) * np.maximum(np.abs(offset) - margin * sizes, 0)
    if np.all(np.abs(shrunk) < 1e-3):
        return set()
    x, y = shrunk / np.linalg.norm(offset)
    found = {"left of": x < -0.5, "right of": x > 0.5, "above": y < -0.5, "below": y > 0.5}
    return {name for name, holds in found.items() if holds}


def colour_names(logits: torch.Tensor) -> list[str]:
    """[n, len(COLORS)] CLIP logits -> the best colour's name per row (the first on a tie; L127)."""
    return [COLORS[i] for i in logits.argmax(1).tolist()]


def _placed(found: list[int], targets: list[int] | None, relation: str, boxes: Any, margin: float) -> bool:
    """Every object of `found` stands in `relation` to every object of `targets` (None: that entry failed)."""
    if targets is None:
        return False
    return all(relation in relations(boxes[a], boxes[b], margin) for a in found for b in targets)


def geneval_correct(record: Record, objects: Objects, boxes: Any, colours: Colours, margin: float) -> bool:
    """GenEval's verdict (`evaluate`, L160-220): each include entry finds at least `count` objects of its class; its
    `count` best all have its colour and stand in its relation to every object the entry it names matched (an
    entry that failed matches nothing); no exclude entry finds `count` objects or more."""
    matched: list[list[int] | None] = []
    for req in record.include:
        found = objects.get(req.name, [])[: req.count]
        met = len(found) == req.count
        if met and req.color:
            met = colours(req.name, found).count(req.color) == req.count
        if met and req.position:
            met = _placed(found, matched[req.position[1]], req.position[0], boxes, margin)
        matched.append(found if met else None)
    return all(m is not None for m in matched) and all(len(objects.get(n, [])) < c for n, c in record.exclude)


def flowgrpo_strict(record: Record, objects: Objects, boxes: Any, colours: Colours, margin: float) -> bool:
    """flow_grpo's strict verdict (reward-server `evaluate_reward`, L201-264): each include entry finds exactly
    `count` objects, all of its colour, all in its relation to the named entry's; exclude entries are not read."""
    matched: list[list[int] | None] = []
    for req in record.include:
        found = objects.get(req.name, [])
        met = len(found) == req.count
        if met and req.color:
            met = colours(req.name, found).count(req.color) == req.count
        if met and req.position:
            met = _placed(found, matched[req.position[1]], req.position[0], boxes, margin)
        matched.append(found if met else None)
    return all(m is not None for m in matched)


def flowgrpo_partial(record: Record, objects: Objects, boxes: Any, colours: Colours, margin: float) -> float:
    """flow_grpo's reward (reward-server `evaluate_reward`, L201-264): the mean of terms, per include entry
    1 - |count - found| / count (negative past twice the count); with a colour, 1 - |count - right colour| / count
    when the count is exact; with a position, 1 when placed. A wrong count adds one 0 for the colour and position
    together; a misplaced entry adds a 0 and then a 1, as the server's loop appends both; exclude is not read."""
    terms: list[float] = []
    matched: list[list[int] | None] = []
    for req in record.include:
        found = objects.get(req.name, [])
        terms.append(1 - abs(req.count - len(found)) / req.count)
        met = len(found) == req.count
        if not met and (req.color or req.position):
            terms.append(0.0)
        if met and req.color:
            right = colours(req.name, found).count(req.color)
            terms.append(1 - abs(req.count - right) / req.count)
            met = right == req.count
        if met and req.position:
            targets = matched[req.position[1]]
            met = _placed(found, targets, req.position[0], boxes, margin)
            terms += [0.0] if targets is None else ([1.0] if met else [0.0, 1.0])
        matched.append(found if met else None)
    return sum(terms) / len(terms)
