"""FLUX.2 specifics: the empirical dynamic shift, [klein]'s step-distilled flag, LoRA on the single-stream blocks."""

import json
import shutil

import pytest
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from test_adapters import PROMPTS, SEEDS, batch, ode, pipeline_call

from flowrl import schedules
from flowrl.models import load_flow_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as in test_adapters.py


@pytest.mark.parametrize("seq_len", [16, 64, 256, 1024, 4096, 4300, 4301, 16384])
@pytest.mark.parametrize("num_steps", [1, 4, 28, 50, 200])
def test_flux2_shift_is_the_pipelines_float(seq_len, num_steps):
    assert schedules.flux2_shift(seq_len, num_steps) == compute_empirical_mu(seq_len, num_steps)


def test_flux2_shift_by_hand():
    # 1024 tokens: μ(10 steps) = 8.73809524e-05·1024 + 1.89833333, μ(200) = 0.00016927·1024 + 0.45666666;
    # 28 steps lies 18/190 of the way from the first to the second
    at_10, at_200 = 8.73809524e-05 * 1024 + 1.89833333, 0.00016927 * 1024 + 0.45666666
    assert schedules.flux2_shift(1024, 28) == pytest.approx(at_10 + (at_200 - at_10) * 18 / 190, rel=1e-12)
    # above 4300: no step term
    assert schedules.flux2_shift(8192, 28) == pytest.approx(0.00016927 * 8192 + 0.45666666, rel=1e-12)


@pytest.fixture(scope="module")
def distilled_folder(tiny_pipeline, tmp_path_factory):
    folder = tmp_path_factory.mktemp("klein-distilled") / "pipe"
    shutil.copytree(tiny_pipeline("flux2_klein"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["is_distilled"] = True
    (folder / "model_index.json").write_text(json.dumps(index))
    return str(folder)


def test_step_distilled_klein_ignores_guidance_as_the_pipeline_does(distilled_folder):
    model = load_flow_model(distilled_folder)
    assert model.distilled and model.default_guidance_scale == 1.0 and not model.uses_cfg(4.0)
    assert "negative_prompt_embeds" not in model.encode(PROMPTS, guidance_scale=4.0)
    final = ode("flux2_klein", 3, 4.0, decode=False)(model, batch()).latents[:, -1]
    reference = pipeline_call(model.pipe, "flux2_klein", PROMPTS, SEEDS, 3, 4.0, "latent")
    torch.testing.assert_close(final, reference, rtol=0, atol=1e-4)
    plain = ode("flux2_klein", 3, 1.0, decode=False)(model, batch()).latents[:, -1]
    torch.testing.assert_close(final, plain, rtol=0, atol=0)


def test_base_klein_guides_with_two_calls(tiny_model):
    model = tiny_model("flux2_klein")
    assert model.klein and not model.distilled and model.uses_cfg(4.0) and not model.uses_cfg(1.0)
    x = model.prepare_latents(1, 32, 32, torch.Generator().manual_seed(0))
    cond = model.encode(PROMPTS[:1], guidance_scale=4.0)
    with torch.no_grad():
        guided = model.velocity(x, torch.tensor([0.5]), cond, 4.0)
        text = model.velocity(x, torch.tensor([0.5]), cond, 1.0)
        empty = model.velocity(x, torch.tensor([0.5]), {"prompt_embeds": cond["negative_prompt_embeds"]}, 1.0)
    torch.testing.assert_close(guided, empty + 4.0 * (text - empty), rtol=1e-5, atol=1e-6)


def test_lora_reaches_the_single_stream_blocks(tiny_model):
    model = tiny_model("flux2_klein")
    model.add_lora(rank=2)
    names = [n for n, p in model.transformer.named_parameters() if p.requires_grad]
    assert any(n.startswith("single_transformer_blocks.") and "to_qkv_mlp_proj" in n for n in names)
    assert any(n.startswith("transformer_blocks.") and "add_q_proj" in n for n in names)


@torch.no_grad()
def test_dev_feeds_guidance_to_its_embedding_with_one_call(tiny_model):
    model = tiny_model("flux2_dev")
    assert not model.klein and model.transformer.config.guidance_embeds and not model.uses_cfg(4.0)
    cond = model.encode(PROMPTS[:1], guidance_scale=4.0)
    assert set(cond) == {"prompt_embeds"} and cond["prompt_embeds"].shape[1] == 512  # padded by the pipeline
    x = model.prepare_latents(1, 32, 32, torch.Generator().manual_seed(0))
    seen = []
    hook = model.transformer.register_forward_pre_hook(lambda m, a, k: seen.append(k["guidance"]), with_kwargs=True)
    low, high = (model.velocity(x, torch.tensor([0.5]), cond, s) for s in (1.5, 4.0))
    hook.remove()
    assert [g.tolist() for g in seen] == [[1.5], [4.0]]  # one forward per call, the scale as the embedding's input
    assert (low - high).abs().max() > 1e-4
