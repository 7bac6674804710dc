"""Qwen-Image-Edit and Edit Plus against their diffusers pipelines: σ grid, initial latents and the source image's
latents, sampling, LoRA, the on-policy ratio; and the source image's errors.

The pipelines resize a source image to a 1024x1024 area; flowrl resizes it to the sample's size (the pipelines'
default regime, where the edited image has the source's size). `sample_area` runs the pipelines at the tiny
sample's 32x32 area instead, their own arithmetic otherwise, so the two are compared on the same source pixels.
"""

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

EDIT = ("qwen_image_edit", "qwen_image_edit_plus")
H, W, _ = TINY_SIZES["qwen_image_edit"]
PROMPT, SEED, STEPS, SCALE = "make the sky red", 5, 2, 4.0


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 32x32 source image: a smooth colour ramp (what an edit model sees; pure noise would do as well)."""
    y, x = np.mgrid[0:H, 0:W] / (H - 1)
    pixels = np.stack([x, y, 1 - x * y], axis=-1) * 255
    path = tmp_path_factory.mktemp("sources") / "ramp.png"
    Image.fromarray(pixels.astype(np.uint8)).save(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tiny_pipeline):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_flow_model(tiny_pipeline(family), max_sequence_length=512)
        return cache[family]

    return get


@pytest.fixture
def sample_area(monkeypatch):
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    original = edit.calculate_dimensions
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: original(H * W, ratio))
    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", H * W)


def batch(source, prompts=(PROMPT,), seeds=(SEED,)):
    meta = [{"image": source} for _ in prompts]
    return PromptBatch(list(prompts), torch.arange(len(prompts)), meta, seeds=torch.tensor(seeds))


def pipeline_call(pipe, source, steps=STEPS, scale=SCALE):
    """The pipeline's images (output_type="pt") and its final latents (packed tokens, read by a step callback)."""
    final = {}

    def keep(pipe, i, t, kwargs):
        final["latents"] = kwargs["latents"]
        return kwargs

    out = pipe(
        image=Image.open(source).convert("RGB"),
        prompt=PROMPT,
        negative_prompt="",
        true_cfg_scale=scale,
        height=H,
        width=W,
        num_inference_steps=steps,
        output_type="pt",
        generator=torch.Generator().manual_seed(SEED),
        callback_on_step_end=keep,
    )
    return out.images.float(), final["latents"].float()


@pytest.mark.parametrize("family", EDIT)
def test_sigma_grid_and_initial_latents_equal_the_pipeline(models, family, source, sample_area):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_shift

    model = models(family)
    scheduler = model.pipe.scheduler
    c = scheduler.config
    mu = calculate_shift(
        model.image_seq_len(H, W), c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift
    )
    scheduler.set_timesteps(3, sigmas=np.linspace(1.0, 1 / 3, 3), mu=mu)  # what the pipelines hand their scheduler
    torch.testing.assert_close(model.sigmas(3, H, W), scheduler.sigmas.float(), rtol=0, atol=1e-6)
    # the same seed gives the pipeline's noise; the source's latents are the pipeline's, packed the same way
    pipe = model.pipe
    pixels = pipe.image_processor.preprocess(Image.open(source).convert("RGB"), H, W).unsqueeze(2)
    noise, image_latents = pipe.prepare_latents(
        pixels,
        1,
        pipe.transformer.config.in_channels // 4,
        H,
        W,
        torch.float32,
        "cpu",
        torch.Generator().manual_seed(SEED),
    )
    ours = model.prepare_latents(1, H, W, torch.Generator().manual_seed(SEED))
    torch.testing.assert_close(ours, noise, rtol=0, atol=0)
    cond = model.encode([PROMPT], guidance_scale=SCALE, images=[source], size=(H, W, None))
    torch.testing.assert_close(cond["image_latents"], image_latents, rtol=0, atol=1e-6)
    assert cond["image_latents"].abs().max() > 0.1


@pytest.mark.parametrize("family", EDIT)
def test_ode_sampler_matches_the_pipeline_with_the_same_source_image(models, family, source, sample_area):
    model = models(family)
    rollout = SAMPLERS.get("ode")(num_steps=STEPS, height=H, width=W, guidance_scale=SCALE)(model, batch(source))
    images, latents = pipeline_call(model.pipe, source)
    assert rollout.latents[:, -1].abs().max() > 0.1
    torch.testing.assert_close(rollout.latents[:, -1], latents, rtol=0, atol=1e-4)
    torch.testing.assert_close(rollout.images, images, rtol=0, atol=1e-4)
    # the source image conditions the sample: another source, another edit (weakly, in a random 1-layer transformer;
    # float rounding differs by ~1e-7)
    other = SAMPLERS.get("ode")(num_steps=STEPS, height=H, width=W, guidance_scale=SCALE)
    flipped = source.replace(".png", "_flipped.png")
    Image.open(source).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(flipped)
    assert (other(model, batch(flipped)).latents[:, -1] - rollout.latents[:, -1]).abs().max() > 1e-4


@pytest.mark.parametrize("family", EDIT)
def test_lora_saved_by_flowrl_changes_the_pipeline_output_identically(
    tiny_pipeline, family, source, sample_area, tmp_path
):
    model = load_flow_model(tiny_pipeline(family), max_sequence_length=512)
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    sampler = SAMPLERS.get("ode")(num_steps=STEPS, height=H, width=W, guidance_scale=SCALE, decode=False)
    with_lora = sampler(model, batch(source)).latents[:, -1]
    with model.adapter_disabled():
        base = sampler(model, batch(source)).latents[:, -1]
    assert (with_lora - base).abs().max() > 1e-3
    model.save_lora(tmp_path / "lora")
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline(family))
    pipe.set_progress_bar_config(disable=True)
    _, before = pipeline_call(pipe, source)
    pipe.load_lora_weights(str(tmp_path / "lora"))
    _, after = pipeline_call(pipe, source)
    torch.testing.assert_close(before, base, rtol=0, atol=1e-4)
    torch.testing.assert_close(after, with_lora, rtol=0, atol=1e-4)


@pytest.mark.parametrize("family, dtype", [(f, "float32") for f in EDIT] + [("qwen_image_edit", "bfloat16")])
def test_on_policy_ratio_is_exactly_one(models, tiny_pipeline, family, dtype, source):
    model = (
        models(family)
        if dtype == "float32"
        else load_flow_model(tiny_pipeline(family), dtype=dtype, max_sequence_length=512)
    )
    r = SAMPLERS.get("sde")(num_steps=3, height=H, width=W, guidance_scale=SCALE, noise_level=0.8, decode=False)(
        model, batch(source, prompts=(PROMPT, "add a moon"), seeds=(1, 2))
    )
    assert_log_probs_rescore_exactly(model, r)


# ------------------------------------------------------------------------------------------- bad input
def test_an_edit_model_without_a_source_image(models):
    sampler = SAMPLERS.get("ode")(num_steps=2, height=H, width=W)
    with pytest.raises(
        ValueError, match=r"prompt 'make the sky red' has no source image, which the qwen_image_edit model"
    ):
        sampler(models("qwen_image_edit"), PromptBatch([PROMPT], torch.arange(1), seeds=torch.tensor([0])))


def test_a_source_image_of_another_aspect_ratio(models, tmp_path):
    wide = tmp_path / "wide.png"
    Image.new("RGB", (64, 32), "red").save(wide)
    sampler = SAMPLERS.get("ode")(num_steps=2, height=H, width=W)
    with pytest.raises(ValueError, match=r"is 64x32 \(aspect 2.000\) but samples are 32x32 .* would be stretched"):
        sampler(models("qwen_image_edit"), batch(str(wide)))


def test_a_text_only_model_given_a_source_image(source):
    sampler = SAMPLERS.get("ode")(num_steps=1)
    with pytest.raises(ValueError, match=r"given to the text-only toy model; drop the prompts' images"):
        sampler(load_flow_model("toy"), batch(source, prompts=("two red circles",)))
