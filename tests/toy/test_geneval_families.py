"""The Shapes world's GenEval families (two objects, position): grammar, splits, records through GenEval's parser,
renders, and the grading by GenEval's rules over the exact checker's shapes (toy_geneval_exact) and over the
attribute judge's instances (toy_geneval), checked against hand-built scenes and a hand-written margin rule."""

import itertools
import json
import math

import pytest
import torch
from test_exact import box, canvas, disc, paint, triangle

from flowrl.registry import REWARDS
from flowrl.rewards import _geneval_rules as rules
from flowrl.toy import world
from flowrl.toy.detect import exact_detections, judge_detections
from flowrl.toy.judges import load_judge
from flowrl.toy.world import COLOURS, RELATIONS, SHAPES, SPLITS, PairSpec, parse_pair_prompt, parse_prompt, render

PAIR_SPLITS = {
    f"{f}_{p}": n for (f, p), n in zip(itertools.product(world.FAMILIES, ("train", "heldout")), (72, 24, 288, 96))
}
OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


@pytest.fixture(scope="module")
def gold():
    return REWARDS.build("toy_geneval_exact")


@pytest.fixture(scope="module")
def judged():
    return REWARDS.build("toy_geneval")


# ---- grammar, splits, records -----------------------------------------------------------------------------------


def test_prompts_parse_back_and_the_grammar_is_closed():
    specs = SPLITS["geneval_train"] + SPLITS["geneval_heldout"]
    assert len(specs) == len({s.prompt for s in specs}) == 4 * 3 * 4 * 2 * 5  # 96 two-object + 384 position
    for spec in specs:
        assert parse_pair_prompt(spec.prompt) == spec
        assert parse_pair_prompt("  " + spec.prompt.upper() + " ") == spec
        with pytest.raises(ValueError, match="outside the Shapes grammar"):  # the first world's parser refuses them
            parse_prompt(spec.prompt)
    assert parse_pair_prompt("a red circle left of a blue square") == PairSpec(
        ("red", "circle"), ("blue", "square"), "left of"
    )
    assert PairSpec(("green", "triangle"), ("yellow", "circle")).prompt == "a green triangle and a yellow circle"
    for prompt in (
        "two red circles",
        "a red circle and blue square",
        "a red circle next to a blue square",
        "a red circle left a blue square",
        "a purple circle and a blue square",
        "a red circle and a blue square and a green triangle",
        "a red circles and a blue square",
    ):
        with pytest.raises(ValueError, match="outside the Shapes world's GenEval families.*two different shapes"):
            parse_pair_prompt(prompt)
    with pytest.raises(ValueError, match="names one shape twice; name two different shapes"):
        parse_pair_prompt("a red circle above a blue circle")


def test_splits_hold_out_whole_pairs_and_leave_every_part_in_training():
    assert {k: len(SPLITS[k]) for k in ("train", "heldout", "all")} == {"train": 28, "heldout": 8, "all": 36}
    assert {k: len(SPLITS[k]) for k in PAIR_SPLITS} == PAIR_SPLITS
    for part in ("train", "heldout"):
        assert SPLITS[f"geneval_{part}"] == SPLITS[f"two_object_{part}"] + SPLITS[f"position_{part}"]

    def pair(spec):
        return frozenset(spec.items)

    train, heldout = SPLITS["geneval_train"], SPLITS["geneval_heldout"]
    held_pairs = {pair(s) for s in heldout}
    assert len(held_pairs) == 12 and not held_pairs & {pair(s) for s in train}
    for spec in heldout:  # a held-out pair in both orders and every relation
        for first, second in (spec.items, spec.items[::-1]):
            assert PairSpec(first, second) in heldout
            assert all(PairSpec(first, second, r) in heldout for r in RELATIONS)
    assert {o for s in train for o in s.items} == set(itertools.product(COLOURS, SHAPES))
    for key in (lambda s: frozenset(c for c, _ in s.items), lambda s: frozenset(x for _, x in s.items)):
        assert {key(s) for s in heldout} <= {key(s) for s in train}
    with pytest.raises(
        ValueError, match="split='geneval' is unknown; use one of train, heldout, all, two_object_train"
    ):
        world.split_prompts("geneval")


def spec_from_record(record: rules.Record) -> PairSpec:
    """The inverse of PairSpec.record, written from GenEval's record layout (the reference object first)."""
    if record.tag == "two_object":
        first, second = record.include
        return PairSpec((first.color, first.name), (second.color, second.name))
    reference, placed = record.include
    assert reference.position is None and placed.position[1] == 0
    return PairSpec((placed.color, placed.name), (reference.color, reference.name), placed.position[0])


def test_records_round_trip_through_genevals_parser():
    for spec in SPLITS["geneval_train"] + SPLITS["geneval_heldout"]:
        line = json.loads(json.dumps(spec.record))  # as a line of a JSONL file
        assert list(line) == ["tag", "include", "exclude", "prompt"] and line["prompt"] == spec.prompt
        assert line["tag"] == spec.family and line["exclude"] == []
        record = rules.parse_record(line, "record", names=SHAPES)
        assert all(r.count == 1 for r in record.include) and record.exclude == ()
        assert spec_from_record(record) == spec == parse_pair_prompt(line["prompt"])
    record = PairSpec(("red", "circle"), ("blue", "square"), "left of").record
    assert record["include"] == [
        {"class": "square", "count": 1, "color": "blue"},
        {"class": "circle", "count": 1, "color": "red", "position": ["left of", 0]},
    ]
    with pytest.raises(ValueError, match=r"include\[0\].class='square' is not one of GenEval's 80 COCO names"):
        rules.parse_record(record, "record")
    with pytest.raises(ValueError, match=r"include\[0\].class='dog' is not a class of this detector"):
        rules.parse_record({"tag": "single_object", "include": [{"class": "dog", "count": 1}]}, "record", SHAPES)


# ---- renders ----------------------------------------------------------------------------------------------------


def centres(image: torch.Tensor, spec: PairSpec) -> list[tuple[float, float]]:
    """(x, y) of each object's pixels by colour (the objects of a test scene have different colours)."""
    out = []
    for colour, _ in spec.items:
        mask = (image - torch.tensor(world.COLOUR_RGB[colour])[:, None, None]).abs().amax(0) < 0.3  # [32, 32]
        ys, xs = torch.nonzero(mask, as_tuple=True)
        out.append((xs.float().mean().item() + 0.5, ys.float().mean().item() + 0.5))
    return out


def test_renders_are_deterministic_and_show_their_relation():
    spec = PairSpec(("red", "circle"), ("blue", "square"), "above")
    assert torch.equal(render(spec, 3), world.render_pair(spec, 3)) and not torch.equal(
        render(spec, 3), render(spec, 4)
    )
    two = PairSpec(("red", "circle"), ("blue", "square"))
    assert torch.equal(render(two, 5), world.render_items(two.items, 5))
    for relation in RELATIONS:
        for seed in range(20):
            spec = PairSpec(("red", "triangle"), ("green", "square"), relation)
            (xa, ya), (xb, yb) = centres(render(spec, seed), spec)
            along, across = {"left of": (xb - xa, ya - yb), "right of": (xa - xb, ya - yb)}.get(
                relation, (yb - ya, xa - xb) if relation == "above" else (ya - yb, xa - xb)
            )
            assert along > 2 * abs(across) - 1, (relation, seed, along, across)  # pixel means: within a pixel


def test_gold_and_judge_pass_every_render_and_fail_the_opposite_relation(gold, judged):
    specs = list(SPLITS["geneval_train"][::3] + SPLITS["geneval_heldout"])  # 240
    images = world.render_batch(specs, list(range(len(specs))))
    soft = world.soften(images, torch.Generator().manual_seed(0))
    prompts = [s.prompt for s in specs]
    for batch in (images, soft):
        assert gold(batch, prompts).scores.mean() == 1.0
        assert judged(batch, prompts).parts["correct"].mean() >= 0.99
    positions = [i for i, s in enumerate(specs) if s.relation]
    swapped = [PairSpec(specs[i].first, specs[i].second, OPPOSITE[specs[i].relation]).prompt for i in positions]
    assert gold(images[positions], swapped).scores.sum() == 0
    assert judged(images[positions], swapped).parts["correct"].sum() == 0


# ---- the exact grading on hand-built scenes ---------------------------------------------------------------------


def extent(mask: torch.Tensor) -> tuple[int, int, int, int]:
    """GenEval's box of a mask: first column and row, one past the last."""
    ys, xs = torch.nonzero(mask, as_tuple=True)
    return xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1


def relation_holds(a: tuple, b: tuple, relation: str, margin: float) -> bool:
    """GenEval's position rule written out in float64: A's centre minus B's, each axis shrunk toward 0 by `margin` times
    the two boxes' summed size on it, over the unshrunk distance; the relation's component must pass 0.5."""
    dx, dy = (a[0] + a[2] - b[0] - b[2]) / 2, (a[1] + a[3] - b[1] - b[3]) / 2
    sx, sy = (a[2] - a[0]) + (b[2] - b[0]), (a[3] - a[1]) + (b[3] - b[1])
    x = math.copysign(max(abs(dx) - margin * sx, 0.0), dx) / math.hypot(dx, dy)
    y = math.copysign(max(abs(dy) - margin * sy, 0.0), dy) / math.hypot(dx, dy)
    return {"left of": x < -0.5, "right of": x > 0.5, "above": y < -0.5, "below": y > 0.5}[relation]


def test_position_by_relative_centres_on_both_sides_of_the_margin(gold):
    """A red square 6 px wide at rising heights left of a blue circle: each relation's verdict as the hand-written rule
    gives it, at GenEval's margin 0.1 and at 0. Level, the square is left of the circle; raised, it is above it; on the
    diagonal both hold; at the last lifts only the margin says it is not left of the circle."""
    images, prompts, expected = [], [], {0.1: [], 0.0: []}
    for lift in range(18):
        square, circle = box(21 - lift, 6, 27 - lift, 12), disc(24, 18, 4)
        images.append(paint(canvas(), (square, "red"), (circle, "blue")))
        a, b = extent(square), extent(circle)
        for relation in RELATIONS:
            prompts.append(f"a red square {relation} a blue circle")
            for margin in expected:
                expected[margin].append(float(relation_holds(a, b, relation, margin)))
    images = torch.stack(images).repeat_interleave(len(RELATIONS), 0)
    assert gold(images, prompts).scores.tolist() == expected[0.1]
    loose = REWARDS.build("toy_geneval_exact", position_threshold=0.0)
    assert loose(images, prompts).scores.tolist() == expected[0.0]
    verdicts = {r: "".join(str(int(expected[0.1][i])) for i, p in enumerate(prompts) if r in p) for r in RELATIONS}
    loose_left = "".join(str(int(expected[0.0][i])) for i, p in enumerate(prompts) if "left of" in p)
    assert verdicts["left of"] == "1" * 13 + "0" * 5 and loose_left == "1" * 16 + "0" * 2
    # by hand at lift 8: square box y 13-19, circle's 20-28: dy = -8, dx = -9, shrunk (8 - 1.4) / 12.04 = 0.548
    assert verdicts["above"] == "0" * 8 + "1" * 10 and verdicts["right of"] == verdicts["below"] == "0" * 18


def test_objects_colours_and_counts_by_genevals_rules(gold):
    red_square, blue_circle = (box(12, 3, 18, 9), "red"), (disc(15, 22, 4), "blue")
    scenes = {
        "both": paint(canvas(), red_square, blue_circle),
        "square only": paint(canvas(), red_square),
        "empty": canvas(),
        "green square": paint(canvas(), (box(12, 3, 18, 9), "green"), blue_circle),
        "plus a yellow triangle": paint(canvas(), red_square, blue_circle, (triangle(26, 15, 5), "yellow")),
        "plus a yellow square below": paint(canvas(), red_square, blue_circle, (box(24, 14, 29, 19), "yellow")),
        "two red squares": paint(canvas(), red_square, (box(24, 3, 30, 9), "red"), blue_circle),
    }
    images = torch.stack(list(scenes.values()))
    out = gold(images, ["a red square and a blue circle"] * len(scenes))
    parts = {k: dict(zip(scenes, out.parts[k].tolist())) for k in ("correct", "strict", "partial")}
    # GenEval: each object present with its colour, extra objects not read (its two-object records exclude nothing)
    assert parts["correct"] == {
        "both": 1,
        "square only": 0,
        "empty": 0,
        "green square": 0,
        "plus a yellow triangle": 1,
        "plus a yellow square below": 0,  # all shapes score 1: GenEval's tie order takes the last square found
        "two red squares": 1,
    }
    # flow_grpo's strict verdict wants exact counts; its partial score by hand: terms per object, count then colour
    assert parts["strict"]["two red squares"] == 0 and parts["strict"]["plus a yellow triangle"] == 1
    assert parts["partial"] == pytest.approx(
        {
            "both": 1,
            "square only": (1 + 1 + 0 + 0) / 4,  # square: count, colour; circle: count 0, a 0 for its colour
            "empty": 0,
            "green square": (1 + 0 + 1 + 1) / 4,
            "plus a yellow triangle": 1,
            "plus a yellow square below": (0 + 0 + 1 + 1) / 4,
            "two red squares": (0 + 0 + 1 + 1) / 4,  # two squares for one: count term 1 - 1/1, a 0 for its colour
        }
    )
    assert out.parts["two_object"].tolist() == out.parts["correct"].tolist() and out.parts["position"].isnan().all()
    # a misplaced object: five terms of 1 and, as flow_grpo's server appends them, a 0 then a 1
    wrong = gold(images[:1], ["a red square right of a blue circle"])
    assert wrong.scores.tolist() == [0.0] and wrong.parts["partial"].tolist() == pytest.approx([5 / 6])


def test_metadata_records_are_read_and_checked(gold, tmp_path):
    """A JSONL prompts file's records reach the reward as metadata and are graded as written; a bad one is refused."""
    from flowrl.training.prompts import load_prompt_records

    specs = [PairSpec(("red", "square"), ("blue", "circle"), r) for r in ("left of", "right of")]
    path = tmp_path / "toy_geneval.jsonl"
    path.write_text("".join(json.dumps(s.record) + "\n" for s in specs))
    prompts, metadata = load_prompt_records(None, str(path), None, "data")
    assert prompts == [s.prompt for s in specs] and metadata[0]["include"] == specs[0].record["include"]
    image = paint(canvas(), (box(12, 3, 18, 9), "red"), (disc(15, 22, 4), "blue"))[None].expand(2, -1, -1, -1)
    assert gold(image, prompts, metadata).scores.tolist() == [1.0, 0.0]
    # the record wins over the prompt's words: a record of the right-of scene under the left-of prompt fails
    assert gold(image[:1], prompts[:1], metadata[1:]).scores.tolist() == [0.0]
    bad = {**specs[0].record, "include": [{"class": "square", "count": 1, "color": "teal"}]}
    with pytest.raises(ValueError, match=r"toy_geneval_exact: metadata\[0\].include\[0\].color='teal'"):
        gold(image[:1], prompts[:1], [bad])
    with pytest.raises(ValueError, match="'two red circles' is outside the Shapes world's GenEval families"):
        gold(image[:1], ["two red circles"], [{}])


def test_options_and_bad_input(gold):
    image = render(PairSpec(("red", "circle"), ("blue", "square")), 0)[None]
    assert REWARDS.get("toy_geneval").differentiable is False and REWARDS.get("toy_geneval_exact").modalities == (
        "image",
    )
    out = REWARDS.build("toy_geneval_exact", score="partial")(image, ["a red circle and a blue triangle"])
    assert out.scores.tolist() == [0.5] and out.parts["correct"].tolist() == [0.0]  # terms 1, 1 (circle); 0, 0
    assert gold(torch.nn.functional.interpolate(image, size=64), ["a red circle and a blue square"]).scores == 1
    with pytest.raises(ValueError, match="toy_geneval: score='best' is not one of"):
        REWARDS.build("toy_geneval", score="best")
    with pytest.raises(ValueError, match="geneval position_threshold=-1 must be >= 0"):
        REWARDS.build("toy_geneval_exact", position_threshold=-1)
    with pytest.raises(ValueError, match="toy_geneval_exact: 2 prompts for 1 images"):
        gold(image, ["a red circle and a blue square"] * 2)


# ---- the judge's detector ---------------------------------------------------------------------------------------


def test_judge_detector_reads_what_the_exact_checker_reads_and_merges_touching_shapes():
    specs = list(SPLITS["geneval_heldout"])
    images = world.render_batch(specs, [100 + i for i in range(len(specs))])
    judge = load_judge("attributes")
    for exact, read in zip(exact_detections(images), judge_detections(images, judge)):
        assert (read.scores > 0.9).all()
        objects = [sorted(zip(d.labels.tolist(), d.colours, d.boxes.tolist())) for d in (exact, read)]
        assert [o[:2] for o in objects[0]] == [o[:2] for o in objects[1]]  # the same shapes in the same colours
        assert all(abs(a - b) <= 1 for e, r in zip(*objects) for a, b in zip(e[2], r[2]))  # boxes within a pixel
    # touching shapes of two colours: two shapes for the exact checker, one instance off the background for the judge
    touching = paint(canvas(), (box(10, 4, 16, 10), "red"), (box(10, 10, 16, 16), "blue"))[None]
    assert len(exact_detections(touching)[0].labels) == 2 and len(judge_detections(touching, judge)[0].labels) == 1
    assert judge_detections(canvas()[None], judge)[0].boxes.shape == (0, 4)
