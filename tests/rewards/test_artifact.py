"""artifact: the classifier backend trained by scripts/train_artifact_reward.py on a synthetic clean/artifact
folder, its safetensors format, and the VLM-judge backend on a tiny random LLaVA against a second formula."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from flowrl.registry import REWARDS
from flowrl.rewards.artifact import ArtifactCNN, load_artifact_classifier, save_artifact_classifier

ROOT = Path(__file__).resolve().parents[2]


def _smooth(generator: torch.Generator, n: int, size: int = 32) -> torch.Tensor:
    coarse = torch.rand((n, 3, 4, 4), generator=generator)
    return F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)  # [n, 3, S, S]


def _corrupt(images: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Paste an 8x8 black/white checkerboard patch at a random place (blocky, high-frequency damage)."""
    out = images.clone()
    checker = ((torch.arange(12)[:, None] // 2 + torch.arange(12)[None] // 2) % 2).float()  # [12, 12]
    for image in out:
        y, x = torch.randint(0, 20, (2,), generator=generator).tolist()
        image[:, y : y + 12, x : x + 12] = checker
    return out


def _write(folder: Path, images: torch.Tensor) -> None:
    folder.mkdir(parents=True)
    for i, image in enumerate(images):
        Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy()).save(folder / f"{i:03d}.png")


def test_train_script_learns_and_reward_prefers_clean(tmp_path):
    generator = torch.Generator().manual_seed(0)
    _write(tmp_path / "data" / "clean", _smooth(generator, 32))
    _write(tmp_path / "data" / "artifact", _corrupt(_smooth(generator, 32), generator))
    out = tmp_path / "artifact.safetensors"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train_artifact_reward.py"),
            "--data",
            str(tmp_path / "data"),
            "--out",
            str(out),
            "--epochs",
            "15",
            "--image-size",
            "32",
            "--seed",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-1000:]
    record = json.loads(result.stdout.strip().splitlines()[-1])
    assert record["train_accuracy"] >= 0.9

    reward = REWARDS.build("artifact", checkpoint=str(out))
    held_out = torch.Generator().manual_seed(123)
    clean = _smooth(held_out, 16)
    damaged = _corrupt(clean, held_out)
    clean_scores = reward(clean, [""] * 16, [{}] * 16).scores
    damaged_scores = reward(damaged, [""] * 16, [{}] * 16).scores
    assert clean_scores.mean() > damaged_scores.mean() + 0.3
    assert (clean_scores > damaged_scores).float().mean() >= 0.8


def test_classifier_file_roundtrip_and_formula(tmp_path):
    torch.manual_seed(0)
    model = ArtifactCNN(image_size=16, channels=(4, 8)).eval()
    save_artifact_classifier(model, str(tmp_path / "a.safetensors"), {"note": "test"})
    reward = REWARDS.build("artifact", checkpoint=str(tmp_path / "a.safetensors"))
    images = torch.rand(3, 3, 16, 16)
    logits = model(images).detach()
    torch.testing.assert_close(reward(images, ["x"] * 3, [{}] * 3).scores, 1 / (1 + torch.exp(logits)))  # 1 - sigmoid
    assert load_artifact_classifier(str(tmp_path / "a.safetensors")).config == {"image_size": 16, "channels": [4, 8]}
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a flowrl-artifact-classifier file"):
        REWARDS.build("artifact", checkpoint=str(tmp_path / "other.safetensors"))
    with pytest.raises(FileNotFoundError, match="train_artifact_reward.py"):
        REWARDS.build("artifact", checkpoint=str(tmp_path / "missing.safetensors"))
    with pytest.raises(FileNotFoundError, match="train_artifact_reward.py"):
        REWARDS.build("artifact")


def build_tiny_llava(folder: Path) -> None:
    """A tiny random LLaVA (CLIP vision tower + Llama) with a word-level tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    words = [
        "<unk>",
        "<pad>",
        "<s>",
        "</s>",
        "<image>",
        "USER:",
        "ASSISTANT:",
        "yes",
        "no",
        "Yes",
        "No",
        "YES",
        "NO",
        "is",
        "it",
        "broken?",
    ]
    vocab = {w: i for i, w in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens={"image_token": "<image>"},
    )
    template = (
        "{% for m in messages %}USER: {% for c in m['content'] %}{% if c['type'] == 'image' %}<image> {% else %}"
        "{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}{% if add_generation_prompt %} ASSISTANT:{% endif %}"
    )
    image_processor = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=template,
    ).save_pretrained(folder)
    config = LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=16,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            vocab_size=len(vocab),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=3,
        ),
        image_token_index=vocab["<image>"],
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():  # larger output weights so that the image visibly moves the answer
        model.lm_head.weight.mul_(50)
    model.save_pretrained(folder)


def test_vlm_judge_equals_probability_ratio(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    build_tiny_llava(tmp_path / "vlm")
    reward = REWARDS.build("artifact", backend="vlm", model_name=str(tmp_path / "vlm"), question="is it broken?")
    assert reward.differentiable is False
    images = torch.randint(0, 256, (2, 3, 16, 16), generator=torch.Generator().manual_seed(0)).float() / 255
    scores = reward(images, ["a", "b"], [{}, {}]).scores

    processor = AutoProcessor.from_pretrained(tmp_path / "vlm")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm").eval()
    expected = []
    for image in images:
        pil = Image.fromarray((image * 255).round().byte().permute(1, 2, 0).numpy())
        inputs = processor(images=[pil], text=["USER: <image> is it broken? ASSISTANT:"], return_tensors="pt")
        with torch.no_grad():
            probs = model(**inputs).logits[0, -1].softmax(-1)
        p_yes, p_no = probs[[7, 9, 11]].sum(), probs[[8, 10, 12]].sum()
        expected.append(p_no / (p_yes + p_no))  # 1 - sigmoid(log p_yes - log p_no)
    torch.testing.assert_close(scores, torch.stack(expected), atol=1e-5, rtol=1e-5)
    assert abs(float(scores[0] - scores[1])) > 1e-4, "the judge ignores the image"
    with pytest.raises(ValueError, match="model_name"):
        REWARDS.build("artifact", backend="vlm")
