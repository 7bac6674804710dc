"""hpsv3: the score against an independent computation (transformers' own loading of the 4.45-named checkpoint, the
processor with the real chat template, Qwen2VLModel with HPSv3's sequential positions, the head by hand), the
release's prompt text and image sizing, and one-line errors for a wrong checkpoint."""

import hashlib
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from flowrl.registry import REWARDS
from flowrl.rewards import _hpsv3_format as fmt
from flowrl.rewards._tiny import tiny_hpsv3

PROMPTS = ["a red cube on a table", 'a sign that says "hello", in a much longer prompt than the others', "a cat"]
# sha256 of hpsv3 1.0.0's INSTRUCTION.format(text_prompt="<P>") + prompt_with_special_token
# (dataset/data_collator_qwen.py)
RELEASE_TEXT_SHA256 = "c85e3188dd3d6be9578e752d7fc4e8990b56298396c5f12bed66970dd8530449"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hpsv3")
    return folder, tiny_hpsv3(folder)


def _images(n: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), generator=generator).float() / 255  # 8-bit values, as files hold


def test_prompt_text_and_sizes_are_the_release_ones():
    text = fmt.INSTRUCTION.replace("{prompt}", "<P>") + fmt.RATING_REQUEST
    assert hashlib.sha256(text.encode()).hexdigest() == RELEASE_TEXT_SHA256
    assert fmt.resized_size(512, 512, 28, fmt.PIXELS, fmt.PIXELS) == (448, 448)  # 32 x 32 patches -> 256 tokens
    assert fmt.resized_size(1024, 768, 28, fmt.PIXELS, fmt.PIXELS) == (504, 364)
    assert fmt.resized_size(100, 100, 28, fmt.PIXELS, fmt.PIXELS) == (448, 448)  # small images are enlarged
    with pytest.raises(ValueError, match="aspect ratio"):
        fmt.resized_size(2, 500, 28, fmt.PIXELS, fmt.PIXELS)


def test_score_equals_transformers_qwen2vl_with_the_head_by_hand(tiny, tmp_path):
    from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration

    folder, kwargs = tiny
    reward = REWARDS.build("hpsv3", **kwargs)
    images = _images(3, 32, 24)  # already HPSv3's size for 768 pixels: the resize is skipped
    out = reward(images, PROMPTS, [{}] * 3)

    # transformers loads the 4.45-named file itself (its Qwen2-VL key conversion); rm_head is left out of the model
    config = AutoConfig.from_pretrained(kwargs["model_name"])
    state = load_file(kwargs["checkpoint"])
    config.text_config.vocab_size = state["model.embed_tokens.weight"].shape[0]
    config.save_pretrained(tmp_path / "ref")
    (tmp_path / "ref" / "model.safetensors").symlink_to(kwargs["checkpoint"])
    model = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path / "ref", dtype=torch.float32).eval()
    torch.testing.assert_close(model.model.visual.merger.mlp[0].weight, state["visual.merger.mlp.0.weight"].float())

    processor = AutoProcessor.from_pretrained(kwargs["model_name"])
    processor.tokenizer.add_special_tokens({"additional_special_tokens": ["<|Reward|>"]})
    processor.tokenizer.padding_side = "right"
    user = [fmt.INSTRUCTION.replace("{prompt}", p) + fmt.RATING_REQUEST for p in PROMPTS]  # as the release builds it
    messages = [[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": u}]}] for u in user]
    texts = [processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    pictures = [Image.fromarray((x.permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()) for x in images]
    batch = processor(text=texts, images=pictures, padding=True, return_tensors="pt")
    ids = batch["input_ids"]
    positions = torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, ids.shape[0], -1)  # HPSv3: no multimodal positions
    with torch.no_grad():
        hidden = model.model(
            input_ids=ids,
            attention_mask=batch["attention_mask"],
            pixel_values=batch["pixel_values"],
            image_grid_thw=batch["image_grid_thw"],
            position_ids=positions,
        ).last_hidden_state
    h = hidden[ids == processor.tokenizer.convert_tokens_to_ids("<|Reward|>")]  # [3, D]
    assert h.shape == (3, 32)
    for i in (0, 3):
        h = torch.relu(h @ state[f"rm_head.{i}.weight"].T + state[f"rm_head.{i}.bias"])
    expected = h @ state["rm_head.5.weight"].T + state["rm_head.5.bias"]  # [3, 2]: mu, log sigma
    torch.testing.assert_close(out.scores, expected[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.parts["log_sigma"], expected[:, 1], atol=1e-5, rtol=1e-5)
    assert out.scores.std() > 1e-3  # the three samples differ

    alone = [reward(images[i : i + 1], PROMPTS[i : i + 1], [{}]).scores for i in range(3)]  # right padding: no effect
    torch.testing.assert_close(torch.cat(alone), out.scores, atol=1e-5, rtol=1e-5)


def test_a_prompt_holding_a_special_token_fails_in_one_line(tiny):
    _, kwargs = tiny
    reward = REWARDS.build("hpsv3", **kwargs)
    with pytest.raises(ValueError, match=r"prompt 1 contains <\|Reward\|> or <\|image_pad\|>; remove the token"):
        reward(_images(2, 32, 24), ["a cat", "rate this <|Reward|>"], [{}, {}])


def test_resize_matches_pil_bicubic(tiny):
    _, kwargs = tiny
    reward = REWARDS.build("hpsv3", **dict(kwargs, min_pixels=56 * 48, max_pixels=56 * 48))
    images = torch.nn.functional.interpolate(_images(1, 12, 10), size=(70, 60), mode="bilinear")  # smooth content
    pixels, h, w = reward.pixels(images)
    assert (h, w) == (56, 48)
    picture = Image.fromarray((images[0].permute(1, 2, 0) * 255).round().to(torch.uint8).numpy())
    pil = torch.from_numpy(np.array(picture.resize((w, h), Image.BICUBIC))).permute(2, 0, 1).float() / 255
    ours = pixels[0] * reward.std[0] + reward.mean[0]  # back to [0, 1]
    assert float((ours - pil).abs().max()) < 2.5 / 255 and float((ours - pil).abs().mean()) < 0.6 / 255


def test_a_checkpoint_saved_by_transformers_5_scores_the_same(tiny, tmp_path):
    _, kwargs = tiny
    state = load_file(kwargs["checkpoint"])
    renamed = {
        (
            "model.language_model." + k[6:]
            if k.startswith("model.")
            else "model." + k
            if k.startswith("visual.")
            else k
        ): v
        for k, v in state.items()
    }
    save_file(renamed, str(tmp_path / "v5.safetensors"))
    images = _images(2, 40, 36)
    expected = REWARDS.build("hpsv3", **kwargs)(images, PROMPTS[:2], [{}, {}]).scores
    got = REWARDS.build("hpsv3", **dict(kwargs, checkpoint=str(tmp_path / "v5.safetensors")))(
        images, PROMPTS[:2], [{}, {}]
    )
    torch.testing.assert_close(got.scores, expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda s: s.update(
                {"rm_head.5.weight": s["rm_head.5.weight"][:1], "rm_head.5.bias": s["rm_head.5.bias"][:1]}
            ),
            r"checkpoint rm_head\.5\.weight has shape \(1, 16\), not \(2, 16\) "
            r"\(HPSv3's \(mu, log sigma\) ranknet head\); "
            r"pass the full reward checkpoint, HPSv3\.safetensors from https://huggingface\.co/MizzenAI/HPSv3",
        ),
        (
            lambda s: [s.pop(k) for k in list(s) if k.startswith("rm_head.")],
            r"has no rm_head\.0\.weight \(the ranknet reward head\); "
            r"pass the full reward checkpoint, HPSv3\.safetensors",
        ),
        (
            lambda s: s.pop("model.layers.1.mlp.up_proj.weight"),
            r"lacks language_model\.layers\.1\.mlp\.up_proj\.weight \(1 missing, 0 unknown",
        ),
    ],
    ids=["head-width", "no-head", "missing-layer"],
)
def test_a_wrong_checkpoint_fails_in_one_line(tiny, tmp_path, change, message):
    _, kwargs = tiny
    state = load_file(kwargs["checkpoint"])
    change(state)
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=message) as info:
        REWARDS.build("hpsv3", **dict(kwargs, checkpoint=str(tmp_path / "bad.safetensors")))
    assert "\n" not in str(info.value)


def test_bad_settings_fail_in_one_line(tiny, tmp_path):
    _, kwargs = tiny
    with pytest.raises(FileNotFoundError, match="does not exist; download HPSv3.safetensors"):
        REWARDS.build("hpsv3", **dict(kwargs, checkpoint=str(tmp_path / "missing.safetensors")))
    with pytest.raises(ValueError, match="max_pixels=0 must be a whole number >= 1"):
        REWARDS.build("hpsv3", **dict(kwargs, max_pixels=0))
    other = tmp_path / "clip"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "clip"}))
    with pytest.raises(ValueError, match="is a 'clip' config, not qwen2_vl"):
        REWARDS.build("hpsv3", **dict(kwargs, model_name=str(other)))
