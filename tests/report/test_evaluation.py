"""flowrl.training.evaluation: fixed prompts x seeds through the ODE sampler, every reward, diversity, scores.json."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from flowrl import media
from flowrl.training.evaluation import evaluate, mean_pairwise_distance, pixel_features
from flowrl.types import PromptBatch


def _png(path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)  # [H, W, 3]


def test_mean_pairwise_distance_by_hand():
    points = torch.tensor([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])  # distances 5, 10, 5
    assert mean_pairwise_distance(points) == pytest.approx(20.0 / 3.0)
    assert mean_pairwise_distance(points[:1]) is None
    a, b = torch.zeros(1, 3, 2, 2), torch.full((1, 3, 2, 2), 0.5)  # every pixel differs by 0.5 -> RMS 0.5
    assert mean_pairwise_distance(pixel_features(torch.cat([a, b]))) == pytest.approx(0.5)


def test_saved_images_are_the_samplers_output_for_each_prompt_and_seed(evaluated_run):
    r = evaluated_run
    run, later = r["run"], r["later"]
    assert later["prompts"] == r["prompts"] and later["seeds"] == r["seeds"]
    assert len(later["samples"]) == len(r["prompts"]) * len(r["seeds"])
    # sample (p, s) is the sampler's output for that prompt alone with that seed
    for p, s in [(0, 1), (1, 2)]:
        batch = PromptBatch([r["prompts"][p]], torch.tensor([0]), seeds=torch.tensor([r["seeds"][s]]))
        direct = media.to_uint8(r["sampler"](r["model"], batch).images[0]).permute(1, 2, 0).numpy().astype(np.int16)
        sample = next(x for x in later["samples"] if x["prompt_index"] == p and x["seed_index"] == s)
        assert sample["seed"] == r["seeds"][s]
        assert np.abs(_png(run / "eval" / "step_000002" / sample["image"]) - direct).max() <= 1
        other = next(x for x in later["samples"] if x["prompt_index"] == p and x["seed_index"] != s)
        # seeds give different images
        assert np.abs(_png(run / "eval" / "step_000002" / other["image"]) - direct).mean() > 2


def test_scores_and_means_match_the_rewards_on_the_saved_images(evaluated_run):
    r = evaluated_run
    for label, result in (("base", r["base"]), ("step_000002", r["later"])):
        folder = r["run"] / "eval" / label
        on_disk = json.loads((folder / "scores.json").read_text())
        assert on_disk == json.loads(json.dumps(result))
        assert on_disk["rewards"] == {"train": ["jpeg_incompressibility"], "gold": ["jpeg_compressibility"]}
        assert on_disk["is_video"] is False and on_disk["step"] == (0 if label == "base" else 2)
        assert (
            on_disk["environment"]["device"] == "cpu"
            and on_disk["environment"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
        )
        images = media.load_images([str(folder / x["image"]) for x in on_disk["samples"]])
        rescored = r["rewards"]["jpeg_compressibility"](images, ["x"] * len(images), [{}] * len(images)).scores
        stored = [x["scores"]["jpeg_compressibility"] for x in on_disk["samples"]]
        assert stored == pytest.approx(rescored.tolist(), rel=1e-6)
        assert [x["scores"]["jpeg_incompressibility"] for x in on_disk["samples"]] == pytest.approx(
            [-v for v in stored]
        )
        num_seeds = len(r["seeds"])
        for p in range(len(r["prompts"])):
            own = [x["scores"]["jpeg_compressibility"] for x in on_disk["samples"] if x["prompt_index"] == p]
            assert len(own) == num_seeds
            assert on_disk["per_prompt"]["jpeg_compressibility"][p] == pytest.approx(sum(own) / num_seeds)
        assert on_disk["means"]["jpeg_compressibility"] == pytest.approx(sum(stored) / len(stored))


def test_pixel_diversity_is_the_mean_rms_difference_of_the_prompts_images(evaluated_run):
    r = evaluated_run
    result, folder = r["later"], r["run"] / "eval" / "step_000002"
    assert result["diversity"]["space"] == "pixel"
    for p in range(len(r["prompts"])):
        images = [_png(folder / x["image"]) / 255.0 for x in result["samples"] if x["prompt_index"] == p]
        by_hand = np.mean([math.sqrt(np.mean((a - b) ** 2)) for a, b in itertools.combinations(images, 2)])
        assert result["diversity"]["per_prompt"][p] == pytest.approx(by_hand, abs=2e-3)  # PNG rounding <= 0.5/255
        assert result["diversity"]["per_prompt"][p] > 0.01
    assert result["diversity"]["mean"] == pytest.approx(np.mean(result["diversity"]["per_prompt"]))


def test_feature_diversity_and_batch_size_independence(evaluated_run, tmp_path):
    r = evaluated_run
    seen: list[torch.Tensor] = []

    def mean_colour(images: torch.Tensor) -> torch.Tensor:
        seen.append(images.clone())
        return images.mean(dim=(-2, -1))  # [M, 3]

    result = evaluate(
        r["model"],
        r["rewards"],
        tmp_path,
        prompts=r["prompts"][:1],
        seeds=r["seeds"],
        sampler=r["sampler"],
        train_reward_names=["jpeg_compressibility"],
        step=2,
        label="again",
        batch_size=2,
        diversity_features=mean_colour,
    )
    colours = [tuple(c.tolist()) for c in torch.cat(seen).mean(dim=(-2, -1))]
    by_hand = np.mean([math.dist(a, b) for a, b in itertools.combinations(colours, 2)])
    assert result["diversity"]["space"] == "mean_colour"
    # float32 means, summed in another order
    assert result["diversity"]["per_prompt"][0] == pytest.approx(by_hand, rel=1e-4)
    # batch size 2 instead of 4, one prompt instead of two: the same images and scores for the same prompt and seeds
    for new, old in zip(result["samples"], r["later"]["samples"][: len(r["seeds"])]):
        assert np.abs(_png(tmp_path / new["image"]) - _png(r["run"] / "eval" / "step_000002" / old["image"])).max() <= 1
        assert new["scores"]["jpeg_compressibility"] == pytest.approx(old["scores"]["jpeg_compressibility"], abs=0.01)


def test_video_samples_are_frame_strips_and_gifs(tiny_model, tmp_path):
    from flowrl.registry import REWARDS, SAMPLERS

    model = tiny_model("wan")
    sampler = SAMPLERS.get("ode")(num_steps=1, height=32, width=32, num_frames=5, guidance_scale=1.0)
    reward = REWARDS.build("per_frame", device="cpu", dtype=torch.float32, reward="jpeg_compressibility")
    with pytest.raises(ValueError, match="jpeg_compressibility.*videos"):
        evaluate(
            model,
            {"jpeg_compressibility": REWARDS.build("jpeg_compressibility")},
            tmp_path,
            prompts=["a"],
            seeds=[0],
            sampler=sampler,
            train_reward_names=[],
            step=0,
            label="base",
        )
    result = evaluate(
        model,
        {"per_frame": reward},
        tmp_path,
        prompts=["a cat walking"],
        seeds=[1, 2],
        sampler=sampler,
        train_reward_names=["per_frame"],
        step=0,
        label="base",
    )
    assert result["is_video"] is True
    for sample in result["samples"]:
        strip = _png(tmp_path / sample["image"])
        frames = 1 + (5 - 1) // 4 * 4  # Wan's VAE keeps 4k+1 frames: 5 -> 5
        assert strip.shape == (32, 32 * frames, 3)
        with Image.open(tmp_path / sample["animation"]) as gif:
            gif_frames = [np.asarray(f.convert("RGB"), dtype=np.int16) for f in ImageSequence.Iterator(gif)]
        assert len(gif_frames) == frames
        for k, frame in enumerate(gif_frames):  # GIF palettes quantise colours: close, not equal
            assert np.abs(frame - strip[:, 32 * k : 32 * (k + 1)]).mean() < 12
    assert result["per_prompt"]["per_frame"][0] == pytest.approx(
        np.mean([x["scores"]["per_frame"] for x in result["samples"]])
    )


def test_bad_inputs_name_the_field(evaluated_run, tmp_path):
    r = evaluated_run
    base = dict(sampler=r["sampler"], step=0, label="base")
    cases = [
        (dict(prompts=[], seeds=[0], train_reward_names=[]), "prompts"),
        (dict(prompts=["a"], seeds=[1, 1], train_reward_names=[]), "seeds=.*repeat"),
        (dict(prompts=["a"], seeds=[0], train_reward_names=["pickscore"]), "train_reward_names"),
        (dict(prompts=["a"], seeds=[0], train_reward_names=[], metadata=[{}, {}]), "metadata"),
        (dict(prompts=["a"], seeds=[0], train_reward_names=[], batch_size=0), "batch_size=0"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            evaluate(r["model"], r["rewards"], tmp_path, **base, **kwargs)
    assert not (tmp_path / "scores.json").exists()
