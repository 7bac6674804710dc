"""imagereward: a random checkpoint in the official ImageReward.pt layout (BLIP ViT + med BERT + MLP) scores
the same through the plugin (transformers Blip classes + key mapping) as through an independent plain-torch
forward written here from BLIP's architecture, with the package's own torchvision preprocessing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from tiny_checkpoints import VISION, WORDS, make_imagereward_files

from flowrl.registry import REWARDS


def _heads(x, n):  # [N, L, D] -> [N, n, L, D/n]
    return x.view(x.shape[0], x.shape[1], n, -1).transpose(1, 2)


def _attend(q, k, v, n, additive=None):
    scores = _heads(q, n) @ _heads(k, n).transpose(-1, -2) / (q.shape[-1] // n) ** 0.5
    if additive is not None:
        scores = scores + additive
    out = scores.softmax(-1) @ _heads(v, n)
    return out.transpose(1, 2).reshape(q.shape)


def reference_score(s, med, pixels, input_ids, attention_mask):
    """BLIP ViT (timm layout, pre-norm, eps 1e-6) -> med BERT with cross-attention in every layer -> MLP."""
    lin = lambda x, name: F.linear(x, s[f"{name}.weight"], s[f"{name}.bias"])  # noqa: E731
    ln = lambda x, name, eps: F.layer_norm(x, x.shape[-1:], s[f"{name}.weight"], s[f"{name}.bias"], eps)  # noqa: E731
    v = "blip.visual_encoder"
    x = F.conv2d(pixels, s[f"{v}.patch_embed.proj.weight"], s[f"{v}.patch_embed.proj.bias"], stride=VISION["patch"])
    x = x.flatten(2).transpose(1, 2)  # [N, P, W]
    x = torch.cat([s[f"{v}.cls_token"].expand(len(x), -1, -1), x], 1) + s[f"{v}.pos_embed"]
    for i in range(VISION["depth"]):
        b = f"{v}.blocks.{i}"
        q, k, val = lin(ln(x, f"{b}.norm1", 1e-6), f"{b}.attn.qkv").chunk(3, dim=-1)
        x = x + lin(_attend(q, k, val, VISION["heads"]), f"{b}.attn.proj")
        x = x + lin(F.gelu(lin(ln(x, f"{b}.norm2", 1e-6), f"{b}.mlp.fc1")), f"{b}.mlp.fc2")
    image = ln(x, f"{v}.norm", 1e-6)  # [N, 1+P, W]

    t, eps, n = "blip.text_encoder", med["layer_norm_eps"], med["num_attention_heads"]
    h = (
        s[f"{t}.embeddings.word_embeddings.weight"][input_ids]
        + s[f"{t}.embeddings.position_embeddings.weight"][: input_ids.shape[1]]
    )
    h = ln(h, f"{t}.embeddings.LayerNorm", eps)
    pad = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0  # BERT's additive mask
    for i in range(med["num_hidden_layers"]):
        b = f"{t}.encoder.layer.{i}"
        a = _attend(
            lin(h, f"{b}.attention.self.query"),
            lin(h, f"{b}.attention.self.key"),
            lin(h, f"{b}.attention.self.value"),
            n,
            pad,
        )
        h = ln(lin(a, f"{b}.attention.output.dense") + h, f"{b}.attention.output.LayerNorm", eps)
        c = _attend(
            lin(h, f"{b}.crossattention.self.query"),
            lin(image, f"{b}.crossattention.self.key"),
            lin(image, f"{b}.crossattention.self.value"),
            n,
        )
        h = ln(lin(c, f"{b}.crossattention.output.dense") + h, f"{b}.crossattention.output.LayerNorm", eps)
        h = ln(lin(F.gelu(lin(h, f"{b}.intermediate.dense")), f"{b}.output.dense") + h, f"{b}.output.LayerNorm", eps)
    r = h[:, 0]
    for i in (0, 2, 4, 6, 7):
        r = lin(r, f"mlp.layers.{i}")
    return (r.squeeze(-1) - 0.16717362830052426) / 1.0333394966054072


def test_imagereward_matches_independent_forward(tmp_path):
    from torchvision import transforms
    from transformers import BertTokenizer

    files = make_imagereward_files(tmp_path)
    reward = REWARDS.build("imagereward", **files)
    images = torch.randint(0, 256, (3, 3, 16, 16), generator=torch.Generator().manual_seed(1)).float() / 255
    prompts = ["a red circle", "two blue squares and a photo of the sign", "a cat"]
    got = reward(images, prompts, [{}] * 3).scores

    state = torch.load(files["checkpoint"], weights_only=True)
    med = json.loads(Path(files["med_config"]).read_text())
    package_transform = transforms.Compose(
        [  # ImageReward._transform(n_px)
            transforms.Resize(16, interpolation=transforms.InterpolationMode.BICUBIC),
            transforms.CenterCrop(16),
            transforms.ToTensor(),
            transforms.Normalize((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)),
        ]
    )
    pixels = torch.stack(
        [package_transform(Image.fromarray((x * 255).round().byte().permute(1, 2, 0).numpy())) for x in images]
    )
    tokenizer = BertTokenizer.from_pretrained(files["tokenizer"])
    tokenizer.add_special_tokens({"bos_token": "[DEC]", "additional_special_tokens": ["[ENC]"]})
    tokens = tokenizer(prompts, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    assert tokens.input_ids[0, 0] == WORDS.index("[CLS]") and tokens.attention_mask[0, -1] == 0  # padded to 35
    with torch.no_grad():
        expected = reference_score(state, med, pixels, tokens.input_ids, tokens.attention_mask)
    assert expected.std() > 1e-3  # the images and prompts matter
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_imagereward_missing_files_and_bad_checkpoint(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(
        FileNotFoundError, match="ImageReward.pt of 'THUDM/ImageReward'.*`hf download THUDM/ImageReward ImageReward.pt`"
    ):
        REWARDS.build("imagereward")
    files = make_imagereward_files(tmp_path / "ir")
    torch.save({"something.else": torch.zeros(1)}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="lacks blip.visual_encoder"):
        REWARDS.build("imagereward", **dict(files, checkpoint=str(tmp_path / "bad.pt")))
