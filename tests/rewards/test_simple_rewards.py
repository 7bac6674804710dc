"""ocr (real rapidocr and tesseract on PIL-rendered text), jpeg rewards, per_frame, media I/O and the CLI commands."""

from __future__ import annotations

import io
import json
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from flowrl import media
from flowrl.cli import main
from flowrl.registry import REWARDS
from flowrl.reward_contract import score_checked
from flowrl.rewards.jpeg_compressibility import jpeg_sizes_kb
from flowrl.rewards.ocr import edit_distance, quoted_text, text_similarity
from flowrl.types import RewardOutput


def render_text(text: str, width: int = 256, height: int = 64) -> torch.Tensor:
    image = Image.new("RGB", (width, height), "white")
    ImageDraw.Draw(image).text((10, 10), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1).float() / 255  # [3, H, W]


@pytest.mark.parametrize(
    "a, b, distance",
    [("kitten", "sitting", 3), ("flaw", "lawn", 2), ("", "abc", 3), ("same", "same", 0), ("ab", "ba", 2)],
)
def test_edit_distance_by_hand(a, b, distance):
    assert edit_distance(a, b) == distance == edit_distance(b, a)


def test_quoted_text_and_similarity():
    assert quoted_text('a sign saying "Open Late" in neon') == "Open Late"
    assert quoted_text('a “café” and a "bar"') == "café bar"
    assert quoted_text("no quotes here, it's plain") is None
    assert text_similarity("Open Late", "open  late\n") == 1.0
    assert text_similarity("flow", "flaw") == pytest.approx(0.75)  # 1 substitution over 4 characters
    assert text_similarity("abc", "") == 0.0


def test_ocr_rapidocr_reads_rendered_text_exactly():
    reward = REWARDS.build("ocr")  # the default backend
    assert reward.backend == "rapidocr" and reward.extra_requires == ("rapidocr", "onnxruntime")
    for text in ["FLOW RL", "HELLO", "Open Late", "QUIET ZONE"]:
        assert reward.read(render_text(text)) == text
    images = torch.stack([render_text("FLOW RL"), render_text("HELLO"), render_text("FLOW RL")])
    prompts = ['a poster that says "FLOW RL"', 'a poster that says "FLOW RL"', "a poster with no text"]
    scores = reward(images, prompts, [{}] * 3).scores
    assert scores[0] == 1.0
    assert scores[1] <= 0.5
    assert torch.isnan(scores[2])
    assert reward.read(torch.full((3, 64, 64), 0.5)) == ""  # no text found: an empty read, score 0 for any target


def test_ocr_rapidocr_never_downloads(monkeypatch):
    """Its models are the files inside the rapidocr wheel: building and reading work with every connection refused."""
    import rapidocr

    from flowrl.rewards._ocr_backends import RAPIDOCR_MODELS

    def refuse(*args, **kwargs):
        raise AssertionError(f"ocr: a network connection was attempted: {args[1:]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    models = Path(rapidocr.__file__).parent / "models"
    before = {p.name: p.stat().st_mtime for p in models.iterdir()}  # the wheel's files, unchanged after: none fetched
    assert set(RAPIDOCR_MODELS.values()) <= set(before)
    reward = REWARDS.build("ocr", backend="rapidocr")
    assert reward.read(render_text("HELLO")) == "HELLO"
    assert {p.name: p.stat().st_mtime for p in models.iterdir()} == before


def test_ocr_tesseract_reads_rendered_text(require_program):
    require_program("tesseract", "apt-get install -y tesseract-ocr")
    reward = REWARDS.build("ocr", backend="tesseract")
    assert reward.extra_requires == ("pytesseract",)
    images = torch.stack([render_text("FLOW RL"), render_text("HELLO"), render_text("FLOW RL")])
    prompts = ['a poster that says "FLOW RL"', 'a poster that says "FLOW RL"', "a poster with no text"]
    scores = reward(images, prompts, [{}] * 3).scores
    assert scores[0] >= 0.9
    assert scores[1] <= scores[0] - 0.5
    assert torch.isnan(scores[2])


def test_ocr_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match=r"ocr: backend='easyocr' .*valid values: 'rapidocr', 'tesseract'"):
        REWARDS.build("ocr", backend="easyocr")


def test_jpeg_rewards_follow_encoded_size():
    generator = torch.Generator().manual_seed(0)
    flat = torch.full((1, 3, 64, 64), 0.5)
    noise = torch.rand((1, 3, 64, 64), generator=generator)
    images = torch.cat([flat, noise])
    compress = REWARDS.build("jpeg_compressibility")(images, ["a", "b"], [{}, {}]).scores
    incompress = REWARDS.build("jpeg_incompressibility")(images, ["a", "b"], [{}, {}]).scores
    torch.testing.assert_close(compress, -incompress)
    assert compress[0] > compress[1]  # a flat image compresses better than noise
    buffer = io.BytesIO()  # DDPO: size of the quality-95 JPEG in kB
    Image.fromarray((noise[0] * 255).round().byte().permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=95)
    assert incompress[1].item() == pytest.approx(len(buffer.getvalue()) / 1000)
    assert 3.0 < incompress[1] < 30.0 and incompress[0] < 1.5  # 64x64: noise ~ 10 kB, flat ~ 0.7 kB
    assert torch.equal(jpeg_sizes_kb(images), incompress)


def test_per_frame_mean_min_every_k():
    generator = torch.Generator().manual_seed(0)
    video = torch.rand((2, 5, 3, 16, 16), generator=generator)  # [N, F, 3, H, W]
    video[0, 2] = 0.5  # a flat frame scores far higher under compressibility
    inner = REWARDS.build("jpeg_compressibility")
    frame_scores = torch.stack([inner(v, ["p"] * 5, [{}] * 5).scores for v in video])  # [N, F]
    mean = REWARDS.build("per_frame", reward="jpeg_compressibility")(video, ["p", "q"], [{}, {}]).scores
    torch.testing.assert_close(mean, frame_scores.mean(1))
    low = REWARDS.build("per_frame", reward="jpeg_compressibility", reduce="min", every_k_frames=2)(
        video, ["p", "q"], [{}, {}]
    ).scores
    torch.testing.assert_close(low, frame_scores[:, ::2].min(1).values)
    with pytest.raises(ValueError, match="reduce='max'"):
        REWARDS.build("per_frame", reward="jpeg_compressibility", reduce="max")


def test_unknown_reward_lists_names_and_closest_and_dotted_path_works():
    with pytest.raises(KeyError, match="Did you mean 'clipscore'.*Registered: .*pickscore"):
        REWARDS.get("clipscor")
    from flowrl.rewards.jpeg_compressibility import JpegCompressibilityReward

    assert REWARDS.get("flowrl.rewards.jpeg_compressibility.JpegCompressibilityReward") is JpegCompressibilityReward


class _Broken:
    registry_name = "broken"
    modalities = ("image",)
    differentiable = False

    def __init__(self, fail_on: int | None = None, length: int | None = None, value: float = 0.0):
        self.fail_on, self.length, self.value = fail_on, length, value

    def __call__(self, images, prompts, metadata):
        if self.fail_on is not None and any(m.get("i") == self.fail_on for m in metadata):
            raise RuntimeError("boom")
        scores = torch.zeros(self.length or len(prompts))
        scores[-1] = self.value
        return RewardOutput(scores=scores)


def test_score_checked_names_reward_and_sample():
    images = torch.rand(3, 3, 8, 8)
    metadata = [{"i": i} for i in range(3)]
    with pytest.raises(RuntimeError, match="reward broken raised RuntimeError at sample index 1"):
        score_checked(_Broken(fail_on=1), images, ["a"] * 3, metadata)
    with pytest.raises(ValueError, match=r"broken: returned scores of shape \(2,\) for 3 samples"):
        score_checked(_Broken(length=2), images, ["a"] * 3, metadata)
    with pytest.raises(ValueError, match="broken: non-finite score inf at sample index 2"):
        score_checked(_Broken(value=float("inf")), images, ["a"] * 3, metadata)
    assert torch.isnan(score_checked(_Broken(value=float("nan")), images, ["a"] * 3, metadata).scores[2])


def test_media_roundtrip(tmp_path):
    generator = torch.Generator().manual_seed(0)
    frames = torch.randint(0, 256, (3, 3, 12, 10), generator=generator).float() / 255  # [F, 3, H, W]
    pils = [Image.fromarray((f * 255).round().byte().permute(1, 2, 0).numpy()) for f in frames]
    (tmp_path / "frames").mkdir()
    for i, p in enumerate(pils):
        p.save(tmp_path / "frames" / f"{i:03d}.png")
    torch.testing.assert_close(media.load_video(str(tmp_path / "frames")), frames)
    torch.testing.assert_close(media.decode_png(media.encode_pngs(frames[:1])[0]), frames[0])
    torch.testing.assert_close(media.load_images([str(tmp_path / "frames" / "000.png")]), frames[:1])
    pils[0].save(tmp_path / "v.gif", save_all=True, append_images=pils[1:], duration=100)
    assert media.load_video(str(tmp_path / "v.gif")).shape == (3, 3, 12, 10)
    with pytest.raises(FileNotFoundError, match="missing.png"):
        media.load_image(str(tmp_path / "missing.png"))


def test_cli_rewards_list_and_score(tmp_path, capsys):
    assert main(["rewards", "list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["pickscore"]["differentiable"] is True and rows["ocr"]["extra_requires"] == ["rapidocr", "onnxruntime"]
    assert rows["per_frame"]["modalities"] == ["video"] and set(REWARDS.names()) == set(rows)

    images = [torch.full((3, 32, 32), 0.5), torch.rand(3, 32, 32)]
    paths = []
    for i, image in enumerate(images):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy()).save(paths[-1])
    assert (
        main(["score", "--reward", "jpeg_incompressibility", "--set", "quality=90", "--prompt", "x", *paths, "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    expected = jpeg_sizes_kb(media.load_images(paths), quality=90)
    assert [r["file"] for r in result] == paths
    assert [r["score"] for r in result] == pytest.approx(expected.tolist())
    assert (
        main(["score", "--reward", "jpeg_compressibility", "--prompt", "x", "--prompt", "y", "--prompt", "z", *paths])
        == 2
    )
    assert "--prompt given 3 times for 2 files" in capsys.readouterr().err
    assert main(["score", "--reward", "nope", "--prompt", "x", *paths]) == 2
    assert "unknown reward 'nope'" in capsys.readouterr().err


def test_cli_scores_videos_with_per_frame(tmp_path, capsys):
    generator = torch.Generator().manual_seed(0)
    video = torch.randint(0, 256, (3, 3, 16, 16), generator=generator).float() / 255  # [F, 3, H, W]
    frames = [Image.fromarray((f * 255).round().byte().permute(1, 2, 0).numpy()) for f in video]
    frames[0].save(tmp_path / "v.gif", save_all=True, append_images=frames[1:], duration=100)
    folder = tmp_path / "frames"
    folder.mkdir()
    for i, frame in enumerate(frames):
        frame.save(folder / f"{i}.png")
    assert (
        main(
            [
                "score",
                "--reward",
                "per_frame",
                "--set",
                "reward=jpeg_incompressibility",
                "--prompt",
                "x",
                str(folder),
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result[0]["score"] == pytest.approx(float(jpeg_sizes_kb(video).mean()), rel=1e-6)
    assert (
        main(
            [
                "score",
                "--reward",
                "per_frame",
                "--set",
                "reward=jpeg_incompressibility",
                "--prompt",
                "x",
                str(tmp_path / "v.gif"),
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.strip().endswith("v.gif")


def test_media_reads_mp4(tmp_path):
    pytest.importorskip("imageio_ffmpeg", reason="the video extra (imageio-ffmpeg) is not installed")
    import imageio.v3 as iio

    frames = np.zeros((5, 32, 32, 3), dtype=np.uint8)
    frames[:, :, :16] = 255  # left half white: survives lossy coding
    iio.imwrite(tmp_path / "v.mp4", frames, plugin="FFMPEG", fps=4)
    video = media.load_video(str(tmp_path / "v.mp4"))
    assert video.shape == (5, 3, 32, 32)
    assert video[:, :, :, 4:12].mean() > 0.9 and video[:, :, :, 20:28].mean() < 0.1
