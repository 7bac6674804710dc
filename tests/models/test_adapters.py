"""Every family's adapter against the diffusers pipeline it wraps: sigma grids, initial noise, sampling, LoRA."""

import json
import shutil

import pytest
import torch
from diffusers import DiffusionPipeline
from model_checks import assert_checkpointing_keeps_lora_gradients

from flowrl.models import load_flow_model
from flowrl.models.tiny import FAMILIES, TINY_SIZES
from flowrl.registry import SAMPLERS
from flowrl.types import PromptBatch

# one torch thread: the tiny models' kernels are too small for two, which spin-wait on a shared 2-core machine
pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["a red cat", "two blue dogs on a hill"]
SEEDS = [3, 11]


def pipeline_call(pipe, family, prompts, seeds, steps, guidance, output_type, **extra):
    h, w, f = TINY_SIZES[family]
    kwargs = {"num_frames": f, **extra} if f else dict(extra)
    if family == "sana":
        kwargs["use_resolution_binning"] = False
    if family == "qwen_image":  # true CFG is `true_cfg_scale` and needs a negative prompt; guidance_scale is distilled
        kwargs.update(true_cfg_scale=guidance, negative_prompt="")
    else:
        kwargs["guidance_scale"] = guidance
    out = pipe(
        prompt=list(prompts),  # by name: FLUX.2 [klein]'s first argument is an image; a copy: Z-Image's rewrites it
        height=h,
        width=w,
        num_inference_steps=steps,
        output_type=output_type,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        **kwargs,
    )
    if family == "flux2_klein" and output_type == "latent":  # [klein] returns the VAE's latents: packed back
        return packed_flux2_latents(pipe, out.images).float()
    return (out.frames if family.startswith("wan") else out.images).float()


def packed_flux2_latents(pipe, latents):
    """FLUX.2's VAE latents [N, C, H, W] -> the packed, batch-normalised tokens [N, L, 4C] its transformer denoises."""
    patches = pipe._patchify_latents(latents)
    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return pipe._pack_latents((patches - mean) / std)


def ode(family, steps, guidance, decode=True):
    h, w, f = TINY_SIZES[family]
    return SAMPLERS.get("ode")(num_steps=steps, height=h, width=w, num_frames=f, guidance_scale=guidance, decode=decode)


def batch(prompts=PROMPTS, seeds=SEEDS):
    return PromptBatch(list(prompts), torch.arange(len(prompts)), seeds=torch.tensor(seeds))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("steps", [1, 4])
def test_sigma_grid_equals_pipeline_scheduler(tiny_model, family, steps):
    model = tiny_model(family)
    h, w, f = TINY_SIZES[family]
    scheduler = model.pipe.scheduler
    kwargs = {}
    if family in ("flux", "qwen_image"):  # what FluxPipeline and QwenImagePipeline hand their scheduler
        import numpy as np
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        c = scheduler.config
        mu = calculate_shift(
            model.image_seq_len(h, w), c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift
        )
        kwargs = {"sigmas": np.linspace(1.0, 1 / steps, steps), "mu": mu}
    if family == "z_image":  # ZImagePipeline's default grid: a float32 linspace (static shift, so no μ)
        kwargs = {"sigmas": torch.linspace(1.0, 1 / steps, steps).tolist()}
    if family.startswith("flux2"):  # FLUX.2's empirical μ, from the pipeline module itself
        import numpy as np
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        mu = compute_empirical_mu(model.image_seq_len(h, w), steps)
        kwargs = {"sigmas": np.linspace(1.0, 1 / steps, steps), "mu": mu}
    if steps == 1 and scheduler.config.get("shift_terminal"):  # Qwen-Image: diffusers' one-step grid is NaN (0/0)
        with pytest.raises(ValueError, match="num_steps=1 with scheduler config shift_terminal"):
            model.sigmas(steps, h, w, f)
        return
    scheduler.set_timesteps(steps, **kwargs)
    torch.testing.assert_close(model.sigmas(steps, h, w, f), scheduler.sigmas.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_initial_latents_equal_pipeline_for_same_seed(tiny_model, family):
    model = tiny_model(family)
    h, w, f = TINY_SIZES[family]
    ours = model.prepare_latents(1, h, w, torch.Generator().manual_seed(42), f)
    pipe = model.pipe
    if family.startswith("flux2"):
        theirs, _ = pipe.prepare_latents(
            1, pipe.transformer.config.in_channels // 4, h, w, torch.float32, "cpu", torch.Generator().manual_seed(42)
        )
    elif family in ("flux", "qwen_image"):
        theirs = pipe.prepare_latents(
            1, pipe.transformer.config.in_channels // 4, h, w, torch.float32, "cpu", torch.Generator().manual_seed(42)
        )
        theirs = theirs[0] if family == "flux" else theirs  # FLUX also returns the image ids
    elif family.startswith("wan"):
        theirs = pipe.prepare_latents(
            1, pipe.transformer.config.in_channels, h, w, f, torch.float32, "cpu", torch.Generator().manual_seed(42)
        )
    else:
        theirs = pipe.prepare_latents(
            1, pipe.transformer.config.in_channels, h, w, torch.float32, "cpu", torch.Generator().manual_seed(42)
        )
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_ode_sampler_matches_pipeline(tiny_model, family):
    """Same prompts, seeds, steps and guidance: latents and images equal diffusers' to 1e-4."""
    model = tiny_model(family)
    guidance = 4.5
    rollout = ode(family, 4, guidance)(model, batch())
    ref_latents = pipeline_call(model.pipe, family, PROMPTS, SEEDS, 4, guidance, "latent")
    ref_images = pipeline_call(model.pipe, family, PROMPTS, SEEDS, 4, guidance, "pt")
    final = rollout.latents[:, -1]  # FLUX: packed tokens, as the pipeline returns them for output_type="latent"
    assert final.abs().max() > 0.1  # a real trajectory, not zeros
    torch.testing.assert_close(final, ref_latents, rtol=0, atol=1e-4)
    torch.testing.assert_close(rollout.images, ref_images, rtol=0, atol=1e-4)
    assert rollout.latents.shape[1] == 5 and rollout.log_probs.abs().max() == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_saved_by_flowrl_loads_into_pipeline(tiny_model, tiny_pipeline, family, tmp_path):
    model = tiny_model(family)
    # random up-projection (the adapter changes the output); alpha != rank as in the shipped configs (32 / 64)
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    sampler = ode(family, 3, 2.0, decode=False)
    with_lora = sampler(model, batch(PROMPTS[:1], SEEDS[:1])).latents[:, -1]
    with model.adapter_disabled():
        base = sampler(model, batch(PROMPTS[:1], SEEDS[:1])).latents[:, -1]
    assert (with_lora - base).abs().max() > 1e-3
    # checkpoints export the adapter from whole tensors by parameter name: the same state dict peft gives
    named = {n: p.detach() for n, p in model.transformer.named_parameters() if p.requires_grad}
    from_peft, from_names = model.lora_state_dict(), model.lora_state_dict(named)
    assert from_peft.keys() == from_names.keys() and all(torch.equal(from_peft[k], from_names[k]) for k in from_peft)
    model.save_lora(tmp_path / "lora", named)
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline(family))
    before = pipeline_call(pipe, family, PROMPTS[:1], SEEDS[:1], 3, 2.0, "latent")
    pipe.load_lora_weights(str(tmp_path / "lora"))
    after = pipeline_call(pipe, family, PROMPTS[:1], SEEDS[:1], 3, 2.0, "latent")
    torch.testing.assert_close(before, base, rtol=0, atol=1e-4)
    torch.testing.assert_close(after, with_lora, rtol=0, atol=1e-4)
    # and flowrl loads it back the same way
    reloaded = tiny_model(family)
    reloaded.load_lora(tmp_path / "lora")
    again = sampler(reloaded, batch(PROMPTS[:1], SEEDS[:1])).latents[:, -1]
    torch.testing.assert_close(again, with_lora, rtol=0, atol=1e-5)


def test_adapter_disabled_needs_an_adapter(tiny_model):
    with pytest.raises(RuntimeError, match="LoRA"):
        with tiny_model("sd3").adapter_disabled():
            pass


def test_tiny_pipeline_round_trips_offline(tiny_pipeline, tmp_path):
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline("sd3"))
    pipe.save_pretrained(tmp_path / "copy")
    again = DiffusionPipeline.from_pretrained(tmp_path / "copy")
    a = pipeline_call(pipe, "sd3", PROMPTS[:1], SEEDS[:1], 2, 3.0, "latent")
    b = pipeline_call(again, "sd3", PROMPTS[:1], SEEDS[:1], 2, 3.0, "latent")
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(again.tokenizer) == 514 and len(again.tokenizer_3) > 100  # real tokenizers, not empty stand-ins


def test_prompt_cache_encodes_each_prompt_once(tiny_model):
    model = tiny_model("sd3")
    calls = []
    original = model.pipe.encode_prompt
    model.pipe.encode_prompt = lambda *a, **k: calls.append(k["prompt"]) or original(*a, **k)
    first = model.encode(["a", "b", "a"], guidance_scale=4.5)
    second = model.encode(["b", "a"], guidance_scale=4.5)
    assert calls == [["a"], ["b"]]  # each prompt once, alone
    torch.testing.assert_close(first["prompt_embeds"][1], second["prompt_embeds"][0])
    assert first["negative_prompt_embeds"].shape == first["prompt_embeds"].shape


# ------------------------------------------------------------------------------------------- bad input
def test_folder_without_model_index(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        load_flow_model(str(tmp_path))


def test_unsupported_pipeline_class(tiny_pipeline, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(tiny_pipeline("sd3"), folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["_class_name"] = "StableDiffusionXLPipeline"
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="StableDiffusionXLPipeline.*supported"):
        load_flow_model(str(folder))


def test_not_a_path_nor_hub_id():
    with pytest.raises(FileNotFoundError, match="neither an existing folder nor a hub id"):
        load_flow_model("./no/such/folder")


@pytest.mark.parametrize("family,height", [("sd3", 33), ("flux", 30), ("wan", 20)])
def test_size_not_divisible(tiny_model, family, height):
    model = tiny_model(family)
    with pytest.raises(ValueError, match=f"height={height} is not a positive multiple"):
        model.prepare_latents(1, height, 32, None, 5)


def test_wan_frames_must_fit_temporal_factor(tiny_model):
    with pytest.raises(ValueError, match="num_frames=4"):
        tiny_model("wan").prepare_latents(1, 16, 16, None, 4)


def test_empty_prompt_list(tiny_model):
    with pytest.raises(ValueError, match="prompts is empty"):
        tiny_model("sd3").encode([])


@pytest.mark.parametrize("family", FAMILIES)
def test_max_sequence_length_equals_the_pipeline_called_with_it(tiny_pipeline, family):
    """model.max_sequence_length=N samples what `pipe(..., max_sequence_length=N)` does, and N changes the text."""
    default = load_flow_model(tiny_pipeline(family))
    model = load_flow_model(tiny_pipeline(family), max_sequence_length=8)
    assert model.max_sequence_length == 8 != default.max_sequence_length
    short = model.encode(PROMPTS[1:])["prompt_embeds"]
    assert short.shape[1] < default.encode(PROMPTS[1:])["prompt_embeds"].shape[1]
    guidance = 4.5
    final = ode(family, 3, guidance, decode=False)(model, batch(PROMPTS[1:], SEEDS[1:])).latents[:, -1]
    reference = pipeline_call(model.pipe, family, PROMPTS[1:], SEEDS[1:], 3, guidance, "latent", max_sequence_length=8)
    torch.testing.assert_close(final, reference, rtol=0, atol=1e-4)


def test_toy_model_refuses_a_sequence_length():
    with pytest.raises(ValueError, match="fixed prompt length"):
        load_flow_model("toy", max_sequence_length=16)


def test_sd3_passes_float32_timesteps_as_the_pipeline_does(tiny_pipeline):
    """In bf16, sigma 0.70728 must reach the transformer as timestep 707.28 (float32), not bf16's 708."""
    model = load_flow_model(tiny_pipeline("sd3"), dtype="bfloat16")
    x = torch.randn(1, *model.latent_shape(32, 32), generator=torch.Generator().manual_seed(0))
    cond = model.encode(PROMPTS[:1])
    sigma = torch.tensor([0.70728])
    with torch.no_grad():
        v = model.velocity(x, sigma, cond, 1.0)

        def call(timestep):
            return model.transformer(
                hidden_states=x.bfloat16(),
                timestep=timestep,
                encoder_hidden_states=cond["prompt_embeds"],
                pooled_projections=cond["pooled_prompt_embeds"],
                return_dict=False,
            )[0].float()

        float32 = call(sigma * 1000)
        rounded = call((sigma * 1000).bfloat16())
    torch.testing.assert_close(v, float32, rtol=0, atol=0)
    assert (float32 - rounded).abs().max() > 0


def test_sample_cli_max_sequence_length_equals_the_pipeline(tiny_pipeline, tmp_path):
    import numpy as np
    from PIL import Image

    from flowrl.cli import main

    rc = main(
        [
            "sample",
            "--model",
            tiny_pipeline("sd3"),
            "--prompt",
            PROMPTS[1],
            "--seed",
            str(SEEDS[1]),
            "--num-steps",
            "3",
            "--guidance-scale",
            "4.5",
            "--height",
            "32",
            "--width",
            "32",
            "--max-sequence-length",
            "8",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    (png,) = tmp_path.glob("*.png")
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline("sd3"))
    image = pipeline_call(pipe, "sd3", PROMPTS[1:], SEEDS[1:], 3, 4.5, "pt", max_sequence_length=8)[0]
    expected = (image * 255).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
    # uint8 rounding of 1e-4 differences
    assert np.abs(np.asarray(Image.open(png)).astype(int) - expected.astype(int)).max() <= 1


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_gives_the_same_lora_gradients(tiny_model, family):
    model = tiny_model(family)
    torch.manual_seed(0)
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    h, w, f = TINY_SIZES[family]
    x = torch.randn(2, *model.latent_shape(h, w, f), generator=torch.Generator().manual_seed(0))
    assert_checkpointing_keeps_lora_gradients(model, x, model.encode(PROMPTS, guidance_scale=3.0))
