"""The Shapes world: deterministic renders that match their spec, a closed grammar, a disjoint split, corruptions."""

import itertools

import pytest
import torch

from flowrl.toy import world
from flowrl.toy.world import (
    ALL_SPECS,
    BACKGROUND_RGB,
    COLOUR_RGB,
    CORRUPTIONS,
    HELD_OUT,
    TRAIN,
    ShapeSpec,
    corrupt,
    parse_prompt,
    render,
)


def components(mask: torch.Tensor) -> list[list[tuple[int, int]]]:
    """4-connected components of a boolean [H, W] mask (a plain flood fill, independent of the renderer)."""
    seen, found = set(), []
    h, w = mask.shape
    for start in zip(*torch.nonzero(mask, as_tuple=True)):
        start = (int(start[0]), int(start[1]))
        if start in seen:
            continue
        stack, pixels = [start], []
        seen.add(start)
        while stack:
            y, x = stack.pop()
            pixels.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and (ny, nx) not in seen:
                    seen.add((ny, nx))
                    stack.append((ny, nx))
        found.append(pixels)
    return found


def test_render_is_deterministic_per_seed():
    spec = ShapeSpec(2, "red", "circle")
    assert torch.equal(render(spec, 7), render(spec, 7))
    assert not torch.equal(render(spec, 7), render(spec, 8))
    image = render(spec, 7)
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: s.prompt.replace(" ", "_"))
def test_render_matches_its_spec(spec):
    for seed in range(3):
        image = render(spec, seed)  # [3, 32, 32]
        colour = torch.tensor(COLOUR_RGB[spec.colour])[:, None, None]
        background = torch.tensor(BACKGROUND_RGB)[:, None, None]
        # pure colour inside the shapes, pure background far from them, nothing else
        inside = (image - colour).abs().amax(0) < 1e-6  # [32, 32]
        outside = (image - background).abs().amax(0) < 1e-6
        assert inside.any() and outside.sum() > 32 * 32 // 2
        blobs = components(~outside)
        assert len(blobs) == spec.count, f"{spec.prompt} seed {seed}: {len(blobs)} blobs"
        # fill ratio of each blob's bounding box tells the shape: circle pi/4, square 1, triangle 1/2
        strength = (image - background).norm(dim=0) / (colour - background).norm(dim=0)  # [32, 32] coverage
        for blob in blobs:
            core = [(y, x) for y, x in blob if strength[y, x] > 0.5]
            ys, xs = zip(*core)
            fill = len(core) / ((max(ys) - min(ys) + 1) * (max(xs) - min(xs) + 1))
            expected = {"circle": 0.785, "square": 1.0, "triangle": 0.5}
            nearest = min(expected, key=lambda shape: abs(fill - expected[shape]))
            assert nearest == spec.shape, f"{spec.prompt} seed {seed}: fill {fill:.2f}"


def test_prompts_parse_back_to_their_attributes():
    for spec in ALL_SPECS:
        assert parse_prompt(spec.prompt) == spec
    assert ShapeSpec(2, "red", "circle").prompt == "two red circles"
    assert ShapeSpec(1, "blue", "triangle").prompt == "one blue triangle"
    assert parse_prompt("  Three YELLOW squares ") == ShapeSpec(3, "yellow", "square")
    assert ShapeSpec(3, "green", "triangle").labels == (2, 1, 2)


@pytest.mark.parametrize(
    "prompt", ["four red circles", "two red circle", "one red circles", "a blue thing", "", "red circles"]
)
def test_prompt_outside_the_grammar_shows_the_grammar(prompt):
    with pytest.raises(ValueError, match="outside the Shapes grammar: <count> <colour> <shape>"):
        parse_prompt(prompt)


def test_heldout_split_is_disjoint_and_every_pair_is_seen_in_training():
    assert len(ALL_SPECS) == 36 and len(set(ALL_SPECS)) == 36
    assert set(TRAIN).isdisjoint(HELD_OUT) and set(TRAIN) | set(HELD_OUT) == set(ALL_SPECS)
    assert len(HELD_OUT) == 8
    for a, b in itertools.combinations(range(3), 2):

        def key(s, a=a, b=b):
            return (s.count, s.colour, s.shape)[a], (s.count, s.colour, s.shape)[b]

        assert {key(s) for s in TRAIN} == {key(s) for s in ALL_SPECS}, "an attribute pair is never trained"
    assert world.split_prompts("heldout")[1] == "two red circles"
    with pytest.raises(ValueError, match="split='test' is unknown"):
        world.split_specs("test")


def test_random_batch_draws_only_from_its_split():
    images, specs = world.random_batch(64, "heldout", torch.Generator().manual_seed(0))
    assert images.shape == (64, 3, 32, 32) and set(specs) <= set(HELD_OUT)
    again, _ = world.random_batch(64, "heldout", torch.Generator().manual_seed(0))
    assert torch.equal(images, again)


def test_corruptions_leave_their_signature():
    generator = torch.Generator().manual_seed(0)
    clean, _ = world.random_batch(16, "all", generator)
    background = torch.tensor(BACKGROUND_RGB)[None, :, None, None]
    flat = (clean - background).abs().amax(1) < 1e-6  # [N, 32, 32] background pixels of the clean scenes
    for kind in CORRUPTIONS:
        out = corrupt(clean, kind, generator)
        assert out.shape == clean.shape and out.min() >= 0 and out.max() <= 1
        moved = (out - background).abs().amax(1)[flat]  # how far the flat background moved
        if kind in ("noise", "saturation"):
            assert moved.mean() > 0.05, kind
        if kind == "stripes":  # a periodic pattern: rows (or columns) of the background alternate
            rows = (out - clean).abs().sum(1)  # [N, 32, 32]
            assert (rows.std(dim=1).mean() > 0.02) or (rows.std(dim=2).mean() > 0.02)
        if kind == "blocking":  # blended towards 4x4 or 8x8 block means: variance inside 4x4 blocks collapses
            blocks = torch.nn.functional.unfold(out, 4, stride=4).view(16, 3, 16, 64)
            clean_blocks = torch.nn.functional.unfold(clean, 4, stride=4).view(16, 3, 16, 64)
            assert blocks.var(2).sum() < 0.2 * clean_blocks.var(2).sum()
    with pytest.raises(ValueError, match="corruption kind='blur' is unknown"):
        corrupt(clean, "blur", generator)


def test_render_items_draws_what_render_draws_and_what_it_never_does():
    for spec in ALL_SPECS[::5]:
        assert torch.equal(world.render_items([(spec.colour, spec.shape)] * spec.count, 11), render(spec, 11))
    background = torch.tensor(BACKGROUND_RGB)[:, None, None]
    assert torch.equal(world.render_items([], 0), background.expand(3, 32, 32))
    items = [("red", "circle"), ("blue", "square"), ("blue", "triangle"), ("yellow", "circle"), ("green", "square")]
    image = world.render_items(items, 3)  # five shapes, four colours, three shapes
    outside = (image - background).abs().amax(0) < 1e-6
    blobs = components(~outside)
    assert len(blobs) == 5
    for colour in ("red", "blue", "yellow", "green"):  # each colour's pure pixels are there
        assert ((image - torch.tensor(COLOUR_RGB[colour])[:, None, None]).abs().amax(0) < 1e-6).any(), colour
    with pytest.raises(ValueError, match=r"item \('pink', 'circle'\) is unknown"):
        world.render_items([("pink", "circle")], 0)


def test_impossible_scenes_are_outside_the_world():
    generator = torch.Generator().manual_seed(0)
    for kind in world.IMPOSSIBLE_KINDS:
        for _ in range(30):
            items = world.impossible_items(kind, generator)
            colours, shapes = {c for c, _ in items}, {s for _, s in items}
            expected = {"empty": (0, 0, 0), "four": (4, 1, 1), "five": (5, 1, 1)}.get(kind)
            if expected is not None:
                assert (len(items), len(colours), len(shapes)) == expected, (kind, items)
            else:
                assert 2 <= len(items) <= 3 and (len(colours) >= 2) == (kind == "mixed_colours"), (kind, items)
                assert (len(shapes) >= 2) == (kind == "mixed_shapes"), (kind, items)
    images, items = world.impossible_batch(10, generator, ("four",))
    assert images.shape == (10, 3, 32, 32) and all(len(i) == 4 for i in items)
    with pytest.raises(ValueError, match="impossible scene kind='six' is unknown"):
        world.impossible_items("six", generator)


def test_faint_items_fades_and_shrinks_one_shape_where_the_gold_still_reads_it():
    from flowrl.toy.exact import faint_items, find_blobs

    background, red, green = (torch.tensor(rgb) for rgb in (BACKGROUND_RGB, COLOUR_RGB["red"], COLOUR_RGB["green"]))
    full = world.render_items([("red", "square")], 4)
    faded = world.render_items([("red", "square")], 4, faint=(0, 0.7, 1.0))
    inside = (full - red[:, None, None]).abs().amax(0) < 1e-6  # pixels fully inside the square
    assert inside.any()
    # by hand: a pixel fully inside the faded square is 0.7 of the way from the background to red
    torch.testing.assert_close(
        faded[:, inside], (background + 0.7 * (red - background))[:, None].expand(3, int(inside.sum()))
    )
    shrunk = world.render_items([("red", "square")], 4, faint=(0, 1.0, 0.6))
    drawn = [int(((image - background[:, None, None]).abs().amax(0) > 1e-6).sum()) for image in (full, shrunk)]
    assert drawn[1] < 0.6 * drawn[0], drawn  # radius x 0.6: about 0.36 of the area, plus the anti-aliased rim
    generator = torch.Generator().manual_seed(0)
    kept = 0
    for seed in range(20):
        items = [("green", "triangle")] * 4
        image = faint_items(items, seed, generator)
        if image is not None:  # the gold still reads four green triangles, one of them fainter or smaller than the rest
            kept += 1
            blobs = find_blobs(image[None])[0]
            assert [(b.colour, b.shape) for b in blobs] == items and min(b.area for b in blobs) < max(
                b.area for b in blobs
            )
            # independently of the checker: each drawn component's peak share of green (projection onto the
            # background-to-green line, by the test's own flood fill); exactly one is faint, at most FAINT_STRENGTH[1]
            offsets, line = image - background[:, None, None], green - background
            share = torch.einsum("chw,c->hw", offsets, line) / line.square().sum()  # [H, W]
            peaks = sorted(max(share[y, x].item() for y, x in c) for c in components(offsets.abs().amax(0) > 1e-6))
            assert len(peaks) == 4 and peaks[0] <= world.FAINT_STRENGTH[1] + 1e-5 < 0.99 < peaks[1], peaks
        circles = faint_items([("green", "circle")] * 4, seed, generator, same_shapes=False)
        # count, colour
        assert circles is not None and [b.colour for b in find_blobs(circles[None])[0]] == ["green"] * 4
    assert kept >= 10 and faint_items([], 0, generator) is None
