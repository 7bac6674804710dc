"""dino_similarity: the score against an independent computation with transformers' Dinov2Model, whose references
count (a sample's own before the reward's set), and NaN where a sample has none."""

import math

import pytest
import torch
from transformers import Dinov2Model

from flowrl import media
from flowrl.registry import REWARDS
from flowrl.rewards._tiny import TINY_REWARDS
from flowrl.rewards.dino_similarity import IMAGENET_MEAN, IMAGENET_STD


def test_scores_are_cosines_of_dinov2_cls_embeddings_to_the_right_references(tmp_path):
    kwargs = TINY_REWARDS["dino_similarity"](tmp_path)
    reward = REWARDS.build("dino_similarity", **kwargs)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(3, 3, 32, 32, generator=generator)  # already image_size: the resize and crop are identities
    own = media.save_image(images[1], str(tmp_path / "own.png"))
    metadata = [{}, {"reference": own}, {"reference": [own, kwargs["references"][0]]}]
    scores = reward(images, ["a", "b", "c"], metadata).scores

    model = Dinov2Model.from_pretrained(kwargs["model"]).eval()
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)

    def cls(x):  # [M, 3, 32, 32] -> [M, D], normalised pooler output, computed here apart from the reward
        with torch.no_grad():
            out = model(pixel_values=(x - mean) / std).pooler_output
        return out / out.norm(dim=-1, keepdim=True)

    ref_global = reward.reference_embedding(tuple(kwargs["references"]))  # a 30 x 26 image: through the resize
    own_loaded = media.load_image(own)[None]  # the PNG round trip: k/255 values
    both = cls(own_loaded)[0] + ref_global
    expected = [
        float(cls(images[:1])[0] @ ref_global),
        float(cls(images[1:2])[0] @ cls(own_loaded)[0]),
        float(cls(images[2:3])[0] @ (both / both.norm())),
    ]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)


def test_a_sample_without_references_is_not_applicable(tmp_path):
    kwargs = TINY_REWARDS["dino_similarity"](tmp_path)
    kwargs.pop("references")
    reward = REWARDS.build("dino_similarity", **kwargs)
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    scores = reward(
        images, ["a", "b"], [{}, {"reference": media.save_image(images[1], str(tmp_path / "r.png"))}]
    ).scores
    assert math.isnan(scores[0]) and 0.99 < scores[1] <= 1.0 + 1e-6  # the image against (its PNG copy of) itself
