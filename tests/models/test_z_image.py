"""Z-Image specifics: the pipeline's guidance convention (pos + s·(pos − neg), on for s > 0), float32 noise."""

import pytest
import torch
from test_adapters import PROMPTS, SEEDS, batch, ode, pipeline_call

from flowrl.models import load_flow_model
from flowrl.models.tiny import TINY_SIZES

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as in test_adapters.py


@torch.no_grad()
def test_guidance_is_the_pipelines_one_plus_s_convention(tiny_model):
    model = tiny_model("z_image")
    h, w, _ = TINY_SIZES["z_image"]
    x = model.prepare_latents(2, h, w, torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.4])
    cond = model.encode(PROMPTS, guidance_scale=2.0)
    plain = model.velocity(x, sigma, cond, 0.0)  # s = 0: one forward, the prompt alone
    negative = {
        "prompt_embeds": cond["negative_prompt_embeds"],
        "prompt_embeds_mask": cond["negative_prompt_embeds_mask"],
    }
    empty = model.velocity(x, sigma, negative, 0.0)
    guided = model.velocity(x, sigma, cond, 2.0)
    torch.testing.assert_close(guided, plain + 2.0 * (plain - empty), rtol=1e-4, atol=1e-5)  # one batched call vs two
    assert model.uses_cfg(1.0) and not model.uses_cfg(0.0)  # s = 1 already guides (CFG scale 2)
    assert "negative_prompt_embeds" not in model.encode(PROMPTS, guidance_scale=0.0)


def test_turbo_guidance_zero_equals_the_pipeline(tiny_model):
    model = tiny_model("z_image")
    final = ode("z_image", 3, 0.0, decode=False)(model, batch()).latents[:, -1]
    reference = pipeline_call(model.pipe, "z_image", PROMPTS, SEEDS, 3, 0.0, "latent")
    torch.testing.assert_close(final, reference, rtol=0, atol=1e-4)


def test_noise_is_float32_draws_whatever_the_weights_dtype(tiny_pipeline):
    model = load_flow_model(tiny_pipeline("z_image"), dtype="bfloat16")
    assert model.transformer.dtype == torch.bfloat16
    ours = model.prepare_latents(1, 32, 32, torch.Generator().manual_seed(5))
    theirs = model.pipe.prepare_latents(1, 4, 32, 32, torch.float32, "cpu", torch.Generator().manual_seed(5))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
