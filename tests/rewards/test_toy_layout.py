"""toy_size and toy_midline (rewards/toy_layout.py) on scenes drawn here pixel by pixel, values worked out by hand,
and toy_artifact's log-odds output against its probability output."""

from __future__ import annotations

import math

import pytest
import torch

from flowrl.registry import REWARDS
from flowrl.toy.world import BACKGROUND_RGB, COLOUR_RGB, ShapeSpec, render

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def scene(*boxes: tuple[int, int, int, int], colour: str = "red") -> torch.Tensor:
    """A 32x32 image with solid rectangles (top, left, height, width) of a palette colour on the world's background."""
    image = torch.tensor(BACKGROUND_RGB, dtype=torch.float32)[:, None, None].repeat(1, 32, 32)
    for top, left, height, width in boxes:
        image[:, top : top + height, left : left + width] = torch.tensor(COLOUR_RGB[colour])[:, None, None]
    return image


def test_size_and_midline_by_hand():
    images = torch.stack(
        [
            scene((13, 4, 6, 6)),  # one 6x6 square, rows 13-18: centre row 15.5, on the midline; area 36
            scene((13, 4, 6, 6), (14, 20, 4, 4)),  # beside it a 4x4 one, rows 14-17 (centre 15.5): areas 36 and 16
            scene((13, 4, 6, 6), (2, 20, 4, 4)),  # the 4x4 one at rows 2-5: centre 3.5, 12 px off the midline
            scene((10, 4, 6, 6)),  # rows 10-15: centre 12.5, 3 px off: inside the default band of 3
            scene((9, 4, 6, 6)),  # rows 9-14: centre 11.5, 4 px off
            scene(),  # no shape: size 0, midline 0
            scene((13, 4, 2, 2)),  # a 4-pixel speck, under the checker's MIN_AREA of 6: no shape
        ]
    )
    prompts, meta = ["one red square"] * len(images), [{}] * len(images)
    size = REWARDS.build("toy_size")(images, prompts, meta)
    assert size.scores.tolist() == [36.0, 26.0, 26.0, 36.0, 36.0, 0.0, 0.0]
    assert size.parts["num_shapes"].tolist() == [1, 2, 2, 1, 1, 0, 0]
    midline = REWARDS.build("toy_midline")(images, prompts, meta)
    assert midline.scores.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    assert REWARDS.build("toy_midline", band=4.0)(images, prompts, meta).scores.tolist() == [1, 1, 0, 1, 1, 0, 0]
    assert REWARDS.build("toy_midline", band=0.5)(images, prompts, meta).scores.tolist() == [1, 1, 0, 0, 0, 0, 0]
    with pytest.raises(ValueError, match="band=0"):
        REWARDS.build("toy_midline", band=0)


def test_size_counts_the_pixels_of_a_rendered_scene():
    image = render(ShapeSpec(2, "blue", "square"), seed=3)
    blue = torch.tensor(COLOUR_RGB["blue"])[:, None, None]
    background = torch.tensor(BACKGROUND_RGB)[:, None, None]
    coverage = ((image - background) * (blue - background)).sum(0) / (blue - background).square().sum()  # [32, 32]
    expected = float((coverage > 0.5).sum()) / 2  # two squares, the checker's foreground rule (coverage > 0.5)
    got = REWARDS.build("toy_size")(image[None], ["two blue squares"], [{}])
    assert got.parts["num_shapes"].item() == 2 and got.scores.item() == pytest.approx(expected)


def test_artifact_log_odds_is_the_logit_of_the_probability_output():
    images = torch.stack(
        [render(ShapeSpec(1, "red", "circle"), 0), torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))]
    )
    clean = REWARDS.build("toy_artifact")(images, ["one red circle"] * 2, [{}] * 2).scores  # 1 - P(artifact)
    odds = REWARDS.build("toy_artifact", output="log_odds")(images, ["one red circle"] * 2, [{}] * 2).scores
    for p, value in zip(clean.double().tolist(), odds.double().tolist()):
        if 1e-6 < p < 1 - 1e-6:  # where float32 still holds the probability
            assert value == pytest.approx(math.log(p / (1 - p)), rel=1e-3, abs=1e-3)
    assert odds[0] > odds[1]  # the clean render beats uniform noise
    with pytest.raises(ValueError, match="output='odds'"):
        REWARDS.build("toy_artifact", output="odds")
