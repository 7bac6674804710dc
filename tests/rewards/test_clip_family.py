"""clipscore, hpsv2, aesthetic, pickscore, temporal_consistency against independent computations: each
library's own (PIL) preprocessing and forward, and the published scoring formulas written out here."""

from __future__ import annotations

import pytest
import torch
from PIL import Image
from tiny_checkpoints import tiny_aesthetic_head, tiny_open_clip, tiny_pickscore

from flowrl.registry import REWARDS

PROMPTS = ["a red circle", "two blue squares"]


def _images(n=2, size=32, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), generator=generator).float() / 255  # [N, 3, S, S], k/255


def _pil(images: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy()) for x in images]


def _open_clip_reference(folder: str, images, prompts, state=None):
    """open_clip's own transform (PIL resize/crop/ToTensor/Normalize) and encoders, features L2-normalized."""
    import open_clip

    model, _, transform = open_clip.create_model_and_transforms(f"local-dir:{folder}")
    if state is not None:
        model.load_state_dict(state)
    model.eval()
    tokenizer = open_clip.get_tokenizer(f"local-dir:{folder}")
    with torch.no_grad():
        pixels = torch.stack([transform(p) for p in _pil(images)])
        image = model.encode_image(pixels)
        text = model.encode_text(tokenizer(prompts))
    return image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)


def test_clipscore_matches_hessel_formula_on_open_clip(tmp_path):
    folder, _ = tiny_open_clip(tmp_path / "clip")
    reward = REWARDS.build("clipscore", model_name=folder, pretrained=None)
    images = _images()
    image, text = _open_clip_reference(folder, images, PROMPTS)
    expected = 2.5 * (image * text).sum(-1).clamp(min=0)
    out = reward(images, PROMPTS, [{}, {}])
    torch.testing.assert_close(out.scores, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.parts["cosine"], (image * text).sum(-1), atol=1e-5, rtol=1e-5)


def test_resize_path_close_to_pil_bicubic(tmp_path):
    """Larger inputs go through the torch resize; PIL's bicubic differs slightly but must stay close."""
    folder, _ = tiny_open_clip(tmp_path / "clip")
    reward = REWARDS.build("clipscore", model_name=folder, pretrained=None)
    smooth = torch.nn.functional.interpolate(_images(2, 16), size=(96, 80), mode="bilinear")
    smooth = (smooth * 255).round() / 255
    image, text = _open_clip_reference(folder, smooth, PROMPTS)
    got = reward(smooth, PROMPTS, [{}, {}]).parts["cosine"]
    torch.testing.assert_close(got, (image * text).sum(-1), atol=2e-2, rtol=0)


def test_hpsv2_matches_hps_scoring(tmp_path):
    folder, state = tiny_open_clip(tmp_path / "clip", seed=5, with_weights=False)
    torch.save({"state_dict": state}, tmp_path / "HPS_v2.1_compressed.pt")
    reward = REWARDS.build("hpsv2", model_name=folder, checkpoint=str(tmp_path / "HPS_v2.1_compressed.pt"))
    images = _images()
    image, text = _open_clip_reference(folder, images, PROMPTS, state=state)
    expected = torch.diagonal(image @ text.T)  # hpsv2.img_score: diag of image_features @ text_features.T
    torch.testing.assert_close(reward(images, PROMPTS, [{}, {}]).scores, expected, atol=1e-5, rtol=1e-5)


def test_hpsv2_missing_checkpoint_names_file(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(FileNotFoundError, match="HPS_v2.1_compressed.pt"):
        REWARDS.build("hpsv2")


def test_aesthetic_mlp_head_by_hand(tmp_path):
    folder, _ = tiny_open_clip(tmp_path / "clip")
    state = tiny_aesthetic_head(tmp_path / "head.pth")
    reward = REWARDS.build("aesthetic", model_name=folder, pretrained=None, checkpoint=str(tmp_path / "head.pth"))
    images = _images()
    image, _ = _open_clip_reference(folder, images, PROMPTS)
    x = image
    for i in (0, 2, 4, 6, 7):  # no activations between the Linears, as in the LAION predictor
        x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(reward(images, PROMPTS, [{}, {}]).scores, x.squeeze(-1), atol=1e-5, rtol=1e-5)


def test_aesthetic_linear_head_and_missing_weights(tmp_path):
    folder, _ = tiny_open_clip(tmp_path / "clip")
    torch.manual_seed(2)
    head = {"weight": torch.randn(1, 16), "bias": torch.randn(1)}
    torch.save(head, tmp_path / "linear.pth")
    reward = REWARDS.build("aesthetic", model_name=folder, pretrained=None, checkpoint=str(tmp_path / "linear.pth"))
    image, _ = _open_clip_reference(folder, _images(), PROMPTS)
    torch.testing.assert_close(
        reward(_images(), PROMPTS, [{}, {}]).scores,
        (image @ head["weight"].T + head["bias"]).squeeze(-1),
        atol=1e-5,
        rtol=1e-5,
    )
    with pytest.raises(FileNotFoundError, match="sac\\+logos\\+ava1-l14-linearMSE.pth"):
        REWARDS.build("aesthetic", model_name=folder, pretrained=None, checkpoint=str(tmp_path / "missing.pth"))


def test_pickscore_matches_official_processor_path(tmp_path):
    from transformers import CLIPModel, CLIPProcessor

    kwargs = tiny_pickscore(tmp_path)
    reward = REWARDS.build("pickscore", **kwargs)
    images = _images()
    processor = CLIPProcessor.from_pretrained(kwargs["processor_name"])
    model = CLIPModel.from_pretrained(kwargs["model_name"]).eval()
    with torch.no_grad():  # the PickScore README's computation
        image_inputs = processor(images=_pil(images), return_tensors="pt")
        text_inputs = processor(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
        image_embs = model.get_image_features(**image_inputs).pooler_output
        text_embs = model.get_text_features(**text_inputs).pooler_output
        image_embs = image_embs / image_embs.norm(dim=-1, keepdim=True)
        text_embs = text_embs / text_embs.norm(dim=-1, keepdim=True)
        expected = model.logit_scale.exp() * torch.diagonal(text_embs @ image_embs.T)
    torch.testing.assert_close(reward(images, PROMPTS, [{}, {}]).scores, expected, atol=1e-4, rtol=1e-5)


def test_pickscore_missing_model_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local folder nor a hub id"):
        REWARDS.build("pickscore", model_name=str(tmp_path / "nowhere"), processor_name=str(tmp_path / "nowhere"))


def test_open_clip_tag_not_in_cache_is_file_not_found(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    with pytest.raises(FileNotFoundError, match="`hf download timm/vit_base_patch32_clip_224.openai open_clip_model"):
        REWARDS.build("clipscore", model_name="ViT-B-32", pretrained="openai")


def test_temporal_consistency_by_hand(tmp_path):
    folder, _ = tiny_open_clip(tmp_path / "clip")
    reward = REWARDS.build("temporal_consistency", model_name=folder, pretrained=None)
    frames = _images(3, seed=1)  # [F, 3, S, S]
    video = torch.stack([frames, frames[[0, 0, 0]]])  # [2, 3, 3, S, S]: a changing video and a frozen one
    image, _ = _open_clip_reference(folder, frames, ["x"] * 3)
    expected = ((image[0] * image[1]).sum() + (image[1] * image[2]).sum()) / 2
    scores = reward(video, PROMPTS, [{}, {}]).scores
    torch.testing.assert_close(scores, torch.stack([expected, torch.tensor(1.0)]), atol=1e-5, rtol=1e-5)
