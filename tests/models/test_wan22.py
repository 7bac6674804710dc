"""Wan 2.2: the two-expert A14B layout (the expert picked per sample by σ, LoRA on the trained expert only) and
TI2V-5B's per-token timesteps."""

import pytest
import torch
from test_adapters import PROMPTS

from flowrl.models import load_flow_model
from flowrl.models.tiny import TINY_SIZES

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as in test_adapters.py


def inputs(model, family):
    h, w, f = TINY_SIZES[family]
    x = torch.randn(2, *model.latent_shape(h, w, f), generator=torch.Generator().manual_seed(0))
    return x, model.encode(PROMPTS, guidance_scale=3.0)


def expert_velocity(model, module, x, sigma, cond, scale):
    """What the pipeline computes at one step with `module`: two calls, plain CFG, timestep σ·1000."""
    t = sigma * 1000
    text = module(hidden_states=x, timestep=t, encoder_hidden_states=cond["prompt_embeds"], return_dict=False)[0]
    empty = module(
        hidden_states=x, timestep=t, encoder_hidden_states=cond["negative_prompt_embeds"], return_dict=False
    )[0]
    return empty + scale * (text - empty)


@torch.no_grad()
def test_each_sample_uses_the_expert_of_its_sigma(tiny_model):
    model = tiny_model("wan22_a14b")
    assert model.pipe.config.boundary_ratio == 0.7 and model.transformer is model.pipe.transformer
    x, cond = inputs(model, "wan22_a14b")
    sigma = torch.tensor([0.9, 0.3])  # one sample on each side of the boundary
    mixed = model.velocity(x, sigma, cond, 3.0)
    high = expert_velocity(model, model.pipe.transformer, x[:1], sigma[:1], {k: v[:1] for k, v in cond.items()}, 3.0)
    low = expert_velocity(model, model.pipe.transformer_2, x[1:], sigma[1:], {k: v[1:] for k, v in cond.items()}, 3.0)
    torch.testing.assert_close(mixed[:1], high, rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed[1:], low, rtol=0, atol=1e-5)
    wrong = expert_velocity(model, model.pipe.transformer_2, x[:1], sigma[:1], {k: v[:1] for k, v in cond.items()}, 3.0)
    assert (wrong - high).abs().max() > 1e-3  # the experts differ, so the choice is visible


@pytest.mark.parametrize("expert,changed", [("high", 0), ("low", 1)])
@torch.no_grad()
def test_lora_trains_only_the_configured_expert(tiny_pipeline, expert, changed):
    model = load_flow_model(tiny_pipeline("wan22_a14b"), train_expert=expert)
    trained = model.pipe.transformer if expert == "high" else model.pipe.transformer_2
    assert model.transformer is trained
    x, cond = inputs(model, "wan22_a14b")
    sigma = torch.tensor([0.9, 0.3])
    before = model.velocity(x, sigma, cond, 3.0)
    torch.manual_seed(0)
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    after = model.velocity(x, sigma, cond, 3.0)
    assert (after[changed] - before[changed]).abs().max() > 1e-3
    torch.testing.assert_close(after[1 - changed], before[1 - changed], rtol=0, atol=0)
    with model.adapter_disabled():
        torch.testing.assert_close(model.velocity(x, sigma, cond, 3.0), before, rtol=0, atol=0)


def test_train_expert_is_checked(tiny_pipeline):
    with pytest.raises(ValueError, match="train_expert='middle' must be 'high' or 'low'"):
        load_flow_model(tiny_pipeline("wan22_a14b"), train_expert="middle")


@torch.no_grad()
def test_ti2v_hands_every_latent_token_its_timestep(tiny_model):
    model = tiny_model("wan22_ti2v")
    assert model.pipe.config.expand_timesteps
    x, cond = inputs(model, "wan22_ti2v")
    seen = []
    hook = model.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["timestep"]), with_kwargs=True)
    model.velocity(x, torch.tensor([0.9, 0.3]), cond, 1.0)
    hook.remove()
    f, h, w = x.shape[2:]
    (timestep,) = seen
    assert timestep.shape == (2, f * (h // 2) * (w // 2))  # [N, tokens of the 2x2-patched latents]
    torch.testing.assert_close(timestep, torch.tensor([[900.0], [300.0]]).expand_as(timestep), rtol=0, atol=1e-3)


def test_train_expert_refused_where_there_are_no_experts(tiny_pipeline):
    with pytest.raises(ValueError, match="model.train_expert='low' does not apply to StableDiffusion3Pipeline"):
        load_flow_model(tiny_pipeline("sd3"), train_expert="low")
