"""Qwen-Image specifics: the norm-preserving true CFG, padded prompts that never change a prediction, each call's
padding trimmed per prompt, the text cap."""

import pytest
import torch
from test_adapters import PROMPTS

from flowrl.models import load_flow_model
from flowrl.models.tiny import TINY_SIZES

# one torch thread: the tiny models' kernels are too small for two, which spin-wait on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_pipeline):
    return load_flow_model(tiny_pipeline("qwen_image"))


def noisy_latents(model, n=2):
    h, w, _ = TINY_SIZES["qwen_image"]
    return torch.randn(n, *model.latent_shape(h, w), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_true_cfg_keeps_each_tokens_norm_and_the_guided_direction(model):
    x, sigma, scale = noisy_latents(model), torch.tensor([0.8, 0.3]), 4.0
    cond = model.encode(PROMPTS, guidance_scale=scale)
    guided = model.velocity(x, sigma, cond, scale)
    positive = model.velocity(x, sigma, cond, 1.0)  # the conditional prediction alone
    negative = model.velocity(
        x,
        sigma,
        {"prompt_embeds": cond["negative_prompt_embeds"], "prompt_embeds_mask": cond["negative_prompt_embeds_mask"]},
        1.0,
    )
    combined = negative + scale * (positive - negative)  # plain CFG, before the rescale
    # the rescale: every token keeps the conditional prediction's norm over channels ...
    torch.testing.assert_close(guided.norm(dim=-1), positive.norm(dim=-1), rtol=1e-5, atol=1e-6)
    # ... and points where plain CFG points (cosine 1), which it is not already (norms differ)
    cosine = torch.nn.functional.cosine_similarity(guided, combined, dim=-1)
    torch.testing.assert_close(cosine, torch.ones_like(cosine), rtol=0, atol=1e-5)
    assert (combined.norm(dim=-1) - positive.norm(dim=-1)).abs().max() > 1e-2


@torch.no_grad()
def test_padding_to_max_sequence_length_changes_no_prediction(model):
    """A prompt padded with masked tokens predicts what the transformer predicts on its own tokens (the pipeline's
    single-prompt call, no mask), and the same alone or beside a longer prompt."""
    x, sigma = noisy_latents(model), torch.tensor([0.6, 0.6])
    cond = model.encode(PROMPTS)
    assert cond["prompt_embeds"].shape[1] == model.max_sequence_length == 512
    lengths = cond["prompt_embeds_mask"].sum(1)
    assert lengths[0] < lengths[1] < 512 and (cond["prompt_embeds"][0, lengths[0] :] == 0).all()
    batched = model.velocity(x, sigma, cond, 1.0)
    alone = model.velocity(x[:1], sigma[:1], model.encode(PROMPTS[:1]), 1.0)
    torch.testing.assert_close(alone, batched[:1], rtol=0, atol=1e-6)
    embeds, mask = model.pipe.encode_prompt(prompt=PROMPTS[:1], device="cpu", max_sequence_length=512)
    assert mask is None and embeds.shape[1] == lengths[0]  # the pipeline's own layout: exactly the prompt's tokens
    unpadded = model.transformer(
        hidden_states=x[:1],
        timestep=sigma[:1],  # σ·1000 / 1000, as the pipeline hands it
        encoder_hidden_states=embeds,
        img_shapes=[[(1, 4, 4)]],
        return_dict=False,
    )[0]
    torch.testing.assert_close(alone, unpadded, rtol=0, atol=1e-5)


def test_text_groups_round_each_prompt_up_to_64_tokens_by_hand(model):
    mask = torch.zeros(3, 100, dtype=torch.long)
    mask[0, :90], mask[1, :3], mask[2, :64] = 1, 1, 1  # 90 -> 128, capped at the width 100; 3 -> 64; 64 -> 64
    assert [(length, rows.tolist()) for length, rows in model._text_groups(mask)] == [(64, [1, 2]), (100, [0])]
    ((length, rows),) = model._text_groups(mask[1:])
    assert length == 64 and rows is None  # one length: one call over every row


@torch.no_grad()
def test_each_call_trims_a_prompts_padding_to_its_own_length(model):
    """Rows padded to their own tokens rounded up to 64 (a call per length) predict what the whole 512-token padding
    predicts, and a sample predicts bit for bit the same alone as beside a prompt of another length."""
    cond = model.encode([PROMPTS[0], "a red cat on a mat " * 6])
    lengths = cond["prompt_embeds_mask"].sum(1).tolist()
    assert -(-lengths[0] // 64) != -(-lengths[1] // 64)  # two padded lengths, two calls
    x, t = noisy_latents(model), torch.tensor([0.6, 0.6])
    img_shapes = [[(1, *model._grid(x.shape[1]))]] * 2
    embeds, mask = cond["prompt_embeds"], cond["prompt_embeds_mask"]
    trimmed = model._forward(x, t, embeds, mask, img_shapes)
    full = model._transformer_call(x, t, embeds, mask, img_shapes)
    torch.testing.assert_close(trimmed, full, rtol=0, atol=1e-5)
    alone = model._forward(x[:1], t[:1], embeds[:1], mask[:1], img_shapes[:1])
    torch.testing.assert_close(alone, trimmed[:1], rtol=0, atol=0)


def test_max_sequence_length_above_the_pipelines_cap(tiny_pipeline):
    with pytest.raises(ValueError, match="max_sequence_length=2048 is above Qwen-Image's 1024"):
        load_flow_model(tiny_pipeline("qwen_image"), max_sequence_length=2048)
