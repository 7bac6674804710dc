"""flowrl's GenEval rules (rewards/_geneval_rules.py) against GenEval's and flow_grpo's own code, extracted verbatim
into tests/fixtures/geneval_upstream/ by scripts/extract_geneval_rules.py (model calls stubbed).

Hundreds of seeded synthetic detection sets (labels, scores, boxes, masks, colour logits) over every task family go
to GenEval's `evaluate_image` (the official verdict and the kept boxes), to reward-server's `compute_geneval`
(flow_grpo's strict verdict and partial score) and to flowrl's functions; every verdict, score and kept box must be
equal. Edge cases are drawn on purpose: empty detections, scores at and around the thresholds, tied scores, tied
colour logits, duplicate and overlapping boxes, more objects than asked for, degenerate boxes, failed targets.
"""

from __future__ import annotations

import importlib.util
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.rewards import _geneval_rules as rules

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")  # built, never iterated
UPSTREAM = Path(__file__).resolve().parents[1] / "fixtures" / "geneval_upstream"
W, H = 64, 48
POOL = ("dog", "cat", "cup", "tv remote")  # classes the records ask for; detections also bring others
SETTINGS = {  # name -> thresholds: GenEval's defaults, and its --options varied
    "default": rules.Thresholds(),
    "overlap": rules.Thresholds(max_overlap=0.5, max_objects=3),
    "loose": rules.Thresholds(threshold=0.1, counting_threshold=0.5, position_threshold=0.25, max_overlap=0.8),
}


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"geneval_upstream_{name}", UPSTREAM / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def upstream():
    return _load("geneval_evaluate_images"), _load("reward_server_gen_eval")


def _set_thresholds(module, t: rules.Thresholds) -> None:
    module.THRESHOLD, module.COUNTING_THRESHOLD, module.MAX_OBJECTS = t.threshold, t.counting_threshold, t.max_objects
    module.NMS_THRESHOLD, module.POSITION_THRESHOLD = t.max_overlap, t.position_threshold


def _record(rng: np.random.Generator) -> dict:
    """A GenEval record of a random task family; beyond GenEval's own forms, counts above 1 with colours and
    positions, and excludes of other classes."""
    tag = rules.TASKS[rng.integers(len(rules.TASKS))]
    a, b = rng.choice(POOL, size=2, replace=False).tolist()
    colour = lambda: rules.COLORS[rng.integers(len(rules.COLORS))]  # noqa: E731
    n = int(rng.integers(1, 4))
    include: list[dict] = {
        "single_object": [{"class": a, "count": n}],
        "two_object": [{"class": a, "count": 1}, {"class": b, "count": n}],
        "counting": [{"class": a, "count": n + 1}],
        "colors": [{"class": a, "count": n, "color": colour()}],
        "position": [
            {"class": a, "count": 1},
            {"class": b, "count": n, "position": [rules.RELATIONS[rng.integers(4)], 0]},
        ],
        "color_attr": [{"class": a, "count": 1, "color": colour()}, {"class": b, "count": 1, "color": colour()}],
    }[tag]
    record = {"tag": tag, "include": include, "prompt": f"a photo of {tag}"}
    if tag == "counting":
        record["exclude"] = [{"class": a, "count": n + 2}]
    elif rng.random() < 0.2:
        record["exclude"] = [{"class": rng.choice([c for c in POOL if c not in (a, b)]).item(), "count": 1}]
    if tag == "position" and rng.random() < 0.3:
        include[1]["color"] = colour()
    return record


def _box(rng: np.random.Generator, near: np.ndarray | None = None, relation: str | None = None) -> np.ndarray:
    if near is not None and rng.random() < 0.3:  # a duplicate or a slightly moved copy: overlaps
        return near + (0 if rng.random() < 0.5 else rng.integers(-3, 4, size=4))
    x1, y1 = rng.integers(0, W - 4), rng.integers(0, H - 4)
    box = np.array([x1, y1, x1 + rng.integers(0, W - x1), y1 + rng.integers(0, H - y1)], dtype=np.float64)
    if relation is not None and near is not None:  # place it roughly in `relation` to `near`, sometimes only just
        dx, dy = {"left of": (-1, 0), "right of": (1, 0), "above": (0, -1), "below": (0, 1)}[relation]
        shift = rng.uniform(0.2, 1.5) * np.array([W, H]) * np.array([dx, dy])
        box = np.concatenate([near[:2] + shift, near[2:] + shift])
    if rng.random() < 0.5:
        box = box + rng.uniform(-0.5, 0.5, size=4)  # fractional corners, as an mmdet box may have
    return box


def _score(rng: np.random.Generator, previous: list[float], limit: float) -> float:
    pick = rng.random()
    if pick < 0.15 and previous:
        return previous[rng.integers(len(previous))]  # a tie
    if pick < 0.3:
        return limit + rng.choice([0.0, -1e-7, 1e-7, -1e-4, 1e-4])  # at and around the threshold
    return float(rng.uniform(limit - 0.2, 1.0)) if pick < 0.8 else float(rng.random())


def _detections(rng: np.random.Generator, record: dict, t: rules.Thresholds) -> list[dict]:
    """Detections that often come near to meeting the record, so that every branch of the rules is reached."""
    limit = t.counting_threshold if record["tag"] == "counting" else t.threshold
    out: list[dict] = []
    if rng.random() < 0.08:
        return out  # nothing detected
    anchors: dict[int, np.ndarray] = {}
    for j, req in enumerate(record["include"]):
        count = max(0, req["count"] + int(rng.choice([0, 0, 0, -1, 1, 2])))
        position = req.get("position")
        for _ in range(count):
            near = anchors.get(position[1]) if position else None
            box = _box(rng, near, position[0] if position and rng.random() < 0.8 else None)
            anchors.setdefault(j, box)
            logits = rng.normal(size=len(rules.COLORS))
            if req.get("color") and rng.random() < 0.8:
                logits[rules.COLORS.index(req["color"])] = logits.max() + rng.choice([0.0, 0.5])  # 0.0: a tie
            score = float(rng.uniform(limit, 1))
            if rng.random() < 0.5:
                score = _score(rng, [d["score"] for d in out], limit)
            out.append({"label": rules.OBJECT_NAMES.index(req["class"]), "box": box, "score": score, "logits": logits})
    for _ in range(int(rng.integers(0, 8))):  # others: any class of the pool or beyond, any score
        name = rng.choice(POOL) if rng.random() < 0.7 else rules.OBJECT_NAMES[rng.integers(80)]
        near = out[rng.integers(len(out))]["box"] if out and rng.random() < 0.5 else None
        out.append(
            {
                "label": rules.OBJECT_NAMES.index(str(name)),
                "box": _box(rng, near),
                "score": _score(rng, [d["score"] for d in out], limit),
                "logits": rng.normal(size=len(rules.COLORS)).round(int(rng.integers(0, 3))),  # rounded: ties
            }
        )
    order = rng.permutation(len(out))
    for d in out:
        d["mask"] = rng.random((H, W)) < 0.5
    return [out[i] for i in order]


def _mmdet_result(detections: list[dict]) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """mmdet 2.x's instance result: per class a [k, 5] float32 array (box, score) and a list of k masks."""
    bbox = [np.zeros((0, 5), dtype=np.float32) for _ in range(80)]
    segm: list[list[np.ndarray]] = [[] for _ in range(80)]
    for d in detections:
        row = np.append(d["box"], d["score"]).astype(np.float32)[None]
        bbox[d["label"]] = np.concatenate([bbox[d["label"]], row])
        segm[d["label"]].append(d["mask"])
    return bbox, segm


def _flowrl(detections: list[dict], record: dict, t: rules.Thresholds) -> dict:
    labels = [d["label"] for d in detections]
    scores = np.array([d["score"] for d in detections], dtype=np.float32)
    boxes = np.array([d["box"] for d in detections], dtype=np.float32).reshape(-1, 4)
    logits = torch.tensor(np.array([d["logits"] for d in detections]), dtype=torch.float32)
    parsed = rules.parse_record(record, "metadata[0]")
    objects = rules.keep_objects(labels, scores, boxes, parsed.tag, t)
    asked: Counter = Counter()

    def colours(name: str, indices: list[int]) -> list[str]:
        asked[name] += 1
        return rules.colour_names(logits[indices])

    args = (parsed, objects, boxes, colours, t.position_threshold)
    kept = {name: [[*boxes[i].tolist(), float(scores[i])] for i in idx] for name, idx in objects.items()}
    verdicts = rules.geneval_correct(*args), rules.flowgrpo_strict(*args), rules.flowgrpo_partial(*args)
    return {"correct": verdicts[0], "strict": verdicts[1], "partial": verdicts[2], "kept": kept}


def test_rules_match_geneval_and_flow_grpo_on_random_detections(upstream, tmp_path):
    geneval, server = upstream
    image_path = str(tmp_path / "0000.png")
    Image.new("RGB", (W, H), (10, 20, 30)).save(image_path)
    rng = np.random.default_rng(46)
    seen: Counter = Counter()
    for case in range(600):
        setting = ("default", "default", "overlap", "loose")[case % 4]
        t = SETTINGS[setting]
        record = _record(rng)
        detections = _detections(rng, record, t)
        result = _mmdet_result(detections)
        by_mask = {id(d["mask"]): d["logits"] for d in detections}
        for module in (geneval, server):
            _set_thresholds(module, t)
            module.COLOR_CLASSIFIERS.clear()
            module.CLIP_LOGITS = lambda box, mask: by_mask[id(mask)]  # noqa: B023
            module.DETECT = lambda inputs: [result] * len(inputs) if isinstance(inputs, list) else result  # noqa: B023
        official = geneval.evaluate_image(image_path, record)
        scores, correct, strict, _, _ = server.compute_geneval([Image.open(image_path)], [record], only_strict=False)
        ours = _flowrl(detections, record, t)
        where = f"case {case} ({setting}): {json.dumps(record)}"
        assert ours["correct"] == official["correct"] == bool(correct[0]), where
        assert ours["strict"] == bool(strict[0]), where
        assert ours["partial"] == scores[0], where  # the same float operations: equal, not close
        assert ours["kept"] == json.loads(official["details"]), where
        seen[(record["tag"], ours["correct"], ours["strict"])] += 1
        seen["no detections"] += not detections
        seen["ties kept"] += any(
            len(v) != len({b[4] for b in v}) for v in ours["kept"].values()
        )  # equal scores among the kept objects of a class
        seen[f"partial {ours['partial']:.2f}"] += 1
        seen["negative partial"] += ours["partial"] < 0
    for tag in rules.TASKS:  # every family reached both verdicts
        assert any(seen[(tag, True, s)] for s in (True, False)), (tag, seen)
        assert any(seen[(tag, False, s)] for s in (True, False)), (tag, seen)
    assert seen["no detections"] >= 20 and seen["ties kept"] >= 20 and seen["negative partial"] >= 5, seen
    assert len([k for k in seen if str(k).startswith("partial")]) >= 10, seen


def _corners(values: np.ndarray) -> np.ndarray:
    """(x1, y1, x2, y2) float32 with x1 <= x2 and y1 <= y2 from four numbers."""
    x1, x2 = sorted(values[:2])
    y1, y2 = sorted(values[2:])
    return np.array([x1, y1, x2, y2], dtype=np.float32)


def test_relations_and_iou_match_geneval_on_random_boxes(upstream):
    """The two geometric primitives over thousands of box pairs: integer boxes on a small grid (the detector's boxes
    are integers; there a shrunk component often lands exactly on 0.5), fractional ones, identical and degenerate
    boxes, and offsets just above and below the 1e-3 dead zone."""
    geneval, _ = upstream
    rng = np.random.default_rng(7)
    for case in range(6000):
        margin = (0.1, 0.0, 0.25)[case % 3]
        kind = case % 6
        a = _corners(rng.integers(0, 12, size=4)) if kind < 4 else _corners(rng.uniform(0, 40, size=4))
        if kind == 0:
            b = a.copy()
        elif kind in (1, 2):
            b = _corners(rng.integers(0, 12, size=4))
        elif kind == 3:
            b = a + np.float32(rng.integers(-6, 7))
        elif kind == 4:
            b = _corners(rng.uniform(0, 40, size=4))
        else:  # a point-sized A and B a hair away: the shrunk offset is the offset itself
            a = np.repeat(a[:2], 2)[[0, 2, 1, 3]]
            b = a + rng.choice([5e-4, 9e-4, 2e-3, 5e-3, -5e-3]) * rng.choice([-1, 0, 1], size=2).repeat(2)
        geneval.POSITION_THRESHOLD = margin
        want = geneval.relative_position((np.append(a, 0.5),), (np.append(b, 0.5),))
        assert rules.relations(a, b, margin) == want, (a, b, margin)
        assert rules.box_iou(a, b) == geneval.compute_iou(a, b), (a, b)
    geneval.POSITION_THRESHOLD = 0.1
