"""image_consistency against the cosine similarity computed by hand from a separately loaded copy of its CLIP model:
images at the tiny CLIP's own 32x32 (so its preprocessing is the normalisation alone), videos frame by frame."""

import open_clip
import pytest
import torch

from flowrl import media
from flowrl.registry import REWARDS
from flowrl.rewards._tiny import OPENAI_MEAN, OPENAI_STD, TINY_REWARDS


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("image_consistency")
    kwargs = TINY_REWARDS["image_consistency"](folder)
    generator = torch.Generator().manual_seed(0)
    sources = [
        media.save_image(torch.rand(3, 32, 32, generator=generator), str(folder / f"s{i}.png")) for i in range(2)
    ]
    clip = open_clip.create_model(f"local-dir:{kwargs['model_name']}").eval()  # a copy of the reward's weights
    return kwargs, sources, clip


def by_hand(clip, image, source):
    mean, std = torch.tensor(OPENAI_MEAN).view(3, 1, 1), torch.tensor(OPENAI_STD).view(3, 1, 1)
    with torch.no_grad():
        a, b = clip.encode_image(torch.stack([(image - mean) / std, (source - mean) / std]))
    return float(a @ b / (a.norm() * b.norm()))


def test_images_score_the_clip_cosine_to_their_source_nan_without_one(setup):
    kwargs, sources, clip = setup
    reward = REWARDS.build("image_consistency", **kwargs)
    images = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    images[1] = media.load_image(sources[1])  # the source itself: cosine 1
    metadata = [{"image": sources[0]}, {"image": sources[1]}, {}]
    out = reward(images, ["edit a", "edit b", "no source"], metadata)
    expected = [by_hand(clip, images[i], media.load_image(sources[i])) for i in range(2)]
    torch.testing.assert_close(out.scores[:2], torch.tensor(expected), rtol=0, atol=1e-5)
    assert out.scores[1] == pytest.approx(1.0, abs=1e-5) and abs(expected[0]) < 0.999
    assert torch.isnan(out.scores[2]) and torch.isnan(out.parts["min_frame"][2])


def test_videos_score_the_mean_over_every_kth_frame(setup):
    kwargs, sources, clip = setup
    reward = REWARDS.build("image_consistency", every_k_frames=2, **kwargs)
    video = torch.rand(1, 5, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    out = reward(video, ["a cat turns"], [{"image": sources[0]}])
    source = media.load_image(sources[0])
    per_frame = [by_hand(clip, video[0, f], source) for f in (0, 2, 4)]
    assert out.scores[0].item() == pytest.approx(sum(per_frame) / 3, abs=1e-5)
    assert out.parts["min_frame"][0].item() == pytest.approx(min(per_frame), abs=1e-5)


def test_every_k_frames_must_be_a_positive_whole_number(setup):
    with pytest.raises(ValueError, match=r"image_consistency every_k_frames=0 must be a whole number >= 1"):
        REWARDS.build("image_consistency", every_k_frames=0, **setup[0])
