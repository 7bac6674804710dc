"""Wan image-to-video against WanImageToVideoPipeline: σ grid, initial noise and the image's conditioning video,
sampling, LoRA, the on-policy ratio; the TI2V image-to-video mode refused."""

import json
import shutil

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from model_checks import assert_log_probs_rescore_exactly
from PIL import Image

from flowrl.models import load_flow_model
from flowrl.models.tiny import TINY_SIZES
from flowrl.registry import SAMPLERS
from flowrl.types import PromptBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, W, F = TINY_SIZES["wan_i2v"]
PROMPT, SEED, STEPS, SCALE = "the cat turns its head", 5, 2, 4.0


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    y, x = np.mgrid[0:H, 0:W] / (H - 1)
    path = tmp_path_factory.mktemp("sources") / "ramp.png"
    Image.fromarray((np.stack([x, y, 1 - x * y], axis=-1) * 255).astype(np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def model(tiny_pipeline):
    return load_flow_model(tiny_pipeline("wan_i2v"))


def batch(source, prompts=(PROMPT,), seeds=(SEED,)):
    return PromptBatch(
        list(prompts), torch.arange(len(prompts)), [{"image": source}] * len(prompts), seeds=torch.tensor(seeds)
    )


def ode(steps=STEPS, decode=True):
    return SAMPLERS.get("ode")(num_steps=steps, height=H, width=W, num_frames=F, guidance_scale=SCALE, decode=decode)


def pipeline_call(pipe, source):
    """The pipeline's frames (output_type="pt") and final latents (read by a step callback)."""
    final = {}

    def keep(pipe, i, t, kwargs):
        final["latents"] = kwargs["latents"]
        return kwargs

    out = pipe(
        image=Image.open(source).convert("RGB"),
        prompt=PROMPT,
        negative_prompt="",
        height=H,
        width=W,
        num_frames=F,
        num_inference_steps=STEPS,
        guidance_scale=SCALE,
        output_type="pt",
        generator=torch.Generator().manual_seed(SEED),
        callback_on_step_end=keep,
    )
    return out.frames.float(), final["latents"].float()


def test_sigma_grid_noise_and_conditioning_equal_the_pipeline(model, source):
    scheduler = model.pipe.scheduler
    scheduler.set_timesteps(3)
    torch.testing.assert_close(model.sigmas(3, H, W, F), scheduler.sigmas.float(), rtol=0, atol=1e-6)
    pipe = model.pipe
    pixels = pipe.video_processor.preprocess(Image.open(source).convert("RGB"), height=H, width=W)
    noise, condition = pipe.prepare_latents(
        pixels, 1, pipe.vae.config.z_dim, H, W, F, torch.float32, "cpu", torch.Generator().manual_seed(SEED)
    )
    torch.testing.assert_close(
        model.prepare_latents(1, H, W, torch.Generator().manual_seed(SEED), F), noise, rtol=0, atol=0
    )
    cond = model.encode([PROMPT], guidance_scale=SCALE, images=[source], size=(H, W, F))
    torch.testing.assert_close(cond["condition"], condition, rtol=0, atol=1e-6)
    assert cond["condition"].shape[1] == 4 + pipe.vae.config.z_dim and cond["condition"][:, 4:].abs().max() > 0.1
    # the image encoder's tokens (the tiny transformer has image_dim): CLIP's second-last hidden states
    torch.testing.assert_close(cond["image_embeds"], pipe.encode_image(Image.open(source).convert("RGB"), "cpu"))


def test_ode_sampler_matches_the_pipeline_with_the_same_source_image(model, source):
    rollout = ode()(model, batch(source))
    frames, latents = pipeline_call(model.pipe, source)
    assert rollout.latents[:, -1].abs().max() > 0.1 and rollout.images.shape == (1, F, 3, H, W)
    torch.testing.assert_close(rollout.latents[:, -1], latents, rtol=0, atol=1e-4)
    torch.testing.assert_close(rollout.images, frames, rtol=0, atol=1e-4)


def test_lora_saved_by_flowrl_changes_the_pipeline_output_identically(tiny_pipeline, source, tmp_path):
    model = load_flow_model(tiny_pipeline("wan_i2v"))
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    with_lora = ode(decode=False)(model, batch(source)).latents[:, -1]
    with model.adapter_disabled():
        base = ode(decode=False)(model, batch(source)).latents[:, -1]
    assert (with_lora - base).abs().max() > 1e-3
    model.save_lora(tmp_path / "lora")
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline("wan_i2v"))
    pipe.set_progress_bar_config(disable=True)
    _, before = pipeline_call(pipe, source)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    _, after = pipeline_call(pipe, source)
    torch.testing.assert_close(before, base, rtol=0, atol=1e-4)
    torch.testing.assert_close(after, with_lora, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_policy_ratio_is_exactly_one(model, tiny_pipeline, dtype, source):
    model = model if dtype == "float32" else load_flow_model(tiny_pipeline("wan_i2v"), dtype=dtype)
    sampler = SAMPLERS.get("sde")(num_steps=3, height=H, width=W, num_frames=F, guidance_scale=SCALE, noise_level=0.8)
    assert_log_probs_rescore_exactly(
        model, sampler(model, batch(source, prompts=(PROMPT, "the cat jumps"), seeds=(1, 2)))
    )


def test_an_i2v_model_without_a_source_image(model):
    with pytest.raises(ValueError, match=r"has no source image, which the wan_i2v model needs"):
        ode()(model, PromptBatch([PROMPT], torch.arange(1), seeds=torch.tensor([0])))


def test_the_ti2v_image_to_video_mode_is_refused(tiny_pipeline, tmp_path):
    folder = tmp_path / "ti2v"
    shutil.copytree(tiny_pipeline("wan_i2v"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["expand_timesteps"] = True
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="expand_timesteps .* is not supported"):
        load_flow_model(str(folder))
