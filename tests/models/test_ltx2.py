"""LTX-2 (LTX2Pipeline) against the pipeline: σ grid, both initial noises, the ODE sampler with and without guidance
(video frames, final video and audio latents, the audio waveform), CFG with its rescale, STG and modality-isolation
guidance, LoRA, prompt length, the on-policy ratio, gradient checkpointing, the offline round trip and the refused
inputs."""

import pytest
import torch
from diffusers import DiffusionPipeline
from model_checks import assert_checkpointing_keeps_lora_gradients, assert_log_probs_rescore_exactly

from flowrl.models import load_flow_model
from flowrl.models.conditioning import encode_prompts
from flowrl.models.ltx2 import LTX2FlowModel, rescale_guidance
from flowrl.models.tiny import TINY_SIZES
from flowrl.registry import SAMPLERS
from flowrl.types import PromptBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as in test_adapters.py

H, W, F = TINY_SIZES["ltx2"]
PROMPTS, SEEDS = ["a red cat", "two blue dogs on a hill"], [3, 11]
SHORT = 16  # text tokens in most tests (a multiple of the tiny connectors' 8 registers; the pipeline pads to it)


@pytest.fixture(scope="module")
def folder(tiny_pipeline):
    return tiny_pipeline("ltx2")


@pytest.fixture(scope="module")
def model(folder):
    return load_flow_model(folder, max_sequence_length=SHORT)


def batch(prompts=PROMPTS, seeds=SEEDS):
    return PromptBatch(list(prompts), torch.arange(len(prompts)), seeds=torch.tensor(seeds))


def ode(steps, guidance, decode=True):
    return SAMPLERS.get("ode")(num_steps=steps, height=H, width=W, num_frames=F, guidance_scale=guidance, decode=decode)


def pipeline_call(
    pipe, steps, guidance, output_type, prompts=PROMPTS, seeds=SEEDS, rescale=0.0, audio_scale=None, **extra
):
    """LTX2Pipeline with CFG (and its rescale) only: STG and modality-isolation guidance off for both modalities.
    The pipeline reads a falsy audio setting as "the video value"; None passes that."""
    return pipe(
        prompt=list(prompts),
        height=H,
        width=W,
        num_frames=F,
        num_inference_steps=steps,
        guidance_scale=guidance,
        guidance_rescale=rescale,
        audio_guidance_scale=audio_scale,
        audio_guidance_rescale=None,
        stg_scale=0.0,
        audio_stg_scale=0.0,
        modality_scale=1.0,
        audio_modality_scale=1.0,
        output_type=output_type,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        **extra,
    )


def pipeline_state(pipe, out):
    """The pipeline's latent output (denormalised video [N, C, F', H', W'] and audio [N, C, L, M]) as flowrl's state:
    normalised, packed, video tokens then audio tokens."""
    vae, audio_vae = pipe.vae, pipe.audio_vae
    video = pipe._pack_latents(
        pipe._normalize_latents(out.frames, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    )
    audio = pipe._normalize_audio_latents(
        pipe._pack_audio_latents(out.audio), audio_vae.latents_mean, audio_vae.latents_std
    )
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


@pytest.mark.parametrize("steps", [2, 4])
def test_sigma_grid_equals_the_pipelines_scheduler(model, steps):
    import numpy as np
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    scheduler = model.pipe.scheduler
    c = scheduler.config
    video_tokens = 3 * (H // 2) * (W // 2)  # 3 latent frames of 16x16 (the tiny VAE: 2x spatial and temporal)
    mu = calculate_shift(video_tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    scheduler.set_timesteps(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    torch.testing.assert_close(model.sigmas(steps, H, W, F), scheduler.sigmas.float(), rtol=0, atol=1e-6)
    assert scheduler.sigmas[-2].item() == pytest.approx(0.1, abs=1e-6)  # the stretch to shift_terminal


def test_initial_latents_are_the_pipelines_video_then_audio_noise(model):
    pipe = model.pipe
    ours = model.prepare_latents(1, H, W, [torch.Generator().manual_seed(42)], F)
    generator = [torch.Generator().manual_seed(42)]
    video = pipe.prepare_latents(1, 4, H, W, F, 0.0, torch.float32, "cpu", generator)
    audio_frames = round(F / 24.0 * 16000 / 160 / 4)  # duration x audio latents per second (= 5)
    audio = pipe.prepare_audio_latents(1, 2, audio_frames, 8, 0.0, torch.float32, "cpu", generator)
    assert video.shape == (1, 768, 4) and audio.shape == (1, 5, 4)
    assert ours.shape == (1, 768 * 4 + 5 * 4) == (1, *model.latent_shape(H, W, F))
    torch.testing.assert_close(ours, torch.cat([video.flatten(1), audio.flatten(1)], dim=1), rtol=0, atol=0)


@pytest.mark.parametrize(
    "guidance,options",
    [(1.0, {}), (4.0, {}), (4.0, {"guidance_rescale": 0.7, "audio_guidance_scale": 7.0})],
    ids=["no-guidance", "cfg", "cfg-rescale-audio7"],
)
def test_ode_sampler_matches_the_pipeline(folder, guidance, options):
    """Same prompts, seeds, steps and guidance: frames, video and audio latents and the waveform equal the
    pipeline's."""
    model = load_flow_model(folder, max_sequence_length=SHORT, **options)
    rollout = ode(3, guidance)(model, batch())
    extra = {"rescale": options.get("guidance_rescale", 0.0), "audio_scale": options.get("audio_guidance_scale")}
    extra["max_sequence_length"] = SHORT
    latents = pipeline_call(model.pipe, 3, guidance, "latent", **extra)
    frames = pipeline_call(model.pipe, 3, guidance, "pt", **extra)
    final = rollout.latents[:, -1]
    assert final.abs().max() > 0.1 and rollout.images.shape == (2, F, 3, H, W)
    torch.testing.assert_close(final, pipeline_state(model.pipe, latents), rtol=0, atol=1e-4)
    torch.testing.assert_close(rollout.images, frames.frames.float(), rtol=0, atol=1e-4)
    waveform = model.decode_audio(final)
    assert waveform.shape == frames.audio.shape and model.audio_sample_rate == 16000
    torch.testing.assert_close(waveform, frames.audio.float(), rtol=0, atol=1e-4)
    assert rollout.latents.shape[1] == 4 and rollout.log_probs.abs().max() == 0


@pytest.mark.parametrize(
    "guidance,options,pipeline_options",
    [
        # the pipeline's own defaults (CFG 3 with rescale 0.7, audio CFG 7, STG 1, modality 3), STG at the tiny's block
        (
            3.0,
            {"guidance_rescale": 0.7, "audio_guidance_scale": 7.0, "stg_scale": 1.0, "stg_blocks": [0],
             "modality_scale": 3.0},
            {},
        ),
        # STG and modality isolation without CFG, audio scales of their own
        (
            1.0,
            {"stg_scale": 0.5, "audio_stg_scale": 2.0, "stg_blocks": [0], "modality_scale": 2.0,
             "audio_modality_scale": 1.5},
            {"audio_guidance_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_rescale": None, "stg_scale": 0.5,
             "audio_stg_scale": 2.0, "modality_scale": 2.0, "audio_modality_scale": 1.5},
        ),
    ],
    ids=["pipeline-defaults", "stg-modality-no-cfg"],
)  # fmt: skip
def test_stg_and_modality_guidance_match_the_pipeline(model, folder, guidance, options, pipeline_options):
    plain, model = model, load_flow_model(folder, max_sequence_length=SHORT, **options)
    final = ode(2, guidance, decode=False)(model, batch()).latents[:, -1]
    out = model.pipe(
        prompt=PROMPTS,
        height=H,
        width=W,
        num_frames=F,
        num_inference_steps=2,
        guidance_scale=guidance,
        spatio_temporal_guidance_blocks=[0],
        max_sequence_length=SHORT,
        output_type="latent",
        generator=[torch.Generator().manual_seed(s) for s in SEEDS],
        **pipeline_options,
    )
    torch.testing.assert_close(final, pipeline_state(model.pipe, out), rtol=0, atol=1e-4)
    plain = ode(2, guidance, decode=False)(plain, batch()).latents[:, -1]  # CFG alone (the adapter's defaults)
    assert (plain - final).abs().max() > 1e-3  # the extra guidance terms change the result


def test_cfg_runs_when_only_the_audio_is_guided(folder):
    """The pipeline guides both modalities when either scale is above 1; the video term is then zero."""
    model = load_flow_model(folder, max_sequence_length=SHORT, audio_guidance_scale=5.0)
    assert model.uses_cfg(1.0) and "negative_prompt_embeds" in model.encode(PROMPTS, guidance_scale=1.0)
    final = ode(2, 1.0, decode=False)(model, batch()).latents[:, -1]
    reference = pipeline_call(model.pipe, 2, 1.0, "latent", audio_scale=5.0, max_sequence_length=SHORT)
    torch.testing.assert_close(final, pipeline_state(model.pipe, reference), rtol=0, atol=1e-4)


def test_guidance_rescale_equals_diffusers():
    from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

    g = torch.Generator().manual_seed(0)
    guided, conditional = torch.randn(2, 7, 3, generator=g) * 3, torch.randn(2, 7, 3, generator=g)
    for phi in (0.0, 0.7, 1.0):
        torch.testing.assert_close(
            rescale_guidance(guided, conditional, phi), rescale_noise_cfg(guided, conditional, phi)
        )
    # phi = 1: each sample's standard deviation becomes the conditional one's
    out = rescale_guidance(guided, conditional, 1.0)
    torch.testing.assert_close(out.flatten(1).std(dim=1), conditional.flatten(1).std(dim=1))


def test_max_sequence_length_equals_the_pipeline_called_with_it(model, folder):
    default = load_flow_model(folder)
    assert model.max_sequence_length == SHORT != default.max_sequence_length == 1024  # the pipeline's default
    assert model.encode(PROMPTS[1:])["prompt_embeds"].shape[1] == SHORT
    embeds, mask, _, _ = default.pipe.encode_prompt(PROMPTS[1:], do_classifier_free_guidance=False, device="cpu")
    assert embeds.shape[1] == default.encode(PROMPTS[1:])["prompt_embeds"].shape[1] == 1024
    final = ode(2, 4.0, decode=False)(model, batch(PROMPTS[1:], SEEDS[1:])).latents[:, -1]
    reference = pipeline_call(model.pipe, 2, 4.0, "latent", PROMPTS[1:], SEEDS[1:], max_sequence_length=SHORT)
    torch.testing.assert_close(final, pipeline_state(model.pipe, reference), rtol=0, atol=1e-4)


def test_lora_saved_by_flowrl_changes_the_pipeline_output_identically(folder, tmp_path):
    model = load_flow_model(folder, max_sequence_length=SHORT)
    torch.manual_seed(0)
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    sampler = ode(2, 3.0, decode=False)
    with_lora = sampler(model, batch(PROMPTS[:1], SEEDS[:1])).latents[:, -1]
    with model.adapter_disabled():
        base = sampler(model, batch(PROMPTS[:1], SEEDS[:1])).latents[:, -1]
    video, audio = model.split_latents(with_lora - base)
    assert video.abs().max() > 1e-3 and audio.abs().max() > 1e-3  # the adapter moves both modalities
    model.save_lora(tmp_path / "lora")
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    call = dict(prompts=PROMPTS[:1], seeds=SEEDS[:1], max_sequence_length=SHORT)
    before = pipeline_state(pipe, pipeline_call(pipe, 2, 3.0, "latent", **call))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    after = pipeline_state(pipe, pipeline_call(pipe, 2, 3.0, "latent", **call))
    torch.testing.assert_close(before, base, rtol=0, atol=1e-4)
    torch.testing.assert_close(after, with_lora, rtol=0, atol=1e-4)
    reloaded = load_flow_model(folder, max_sequence_length=SHORT)
    reloaded.load_lora(tmp_path / "lora")
    torch.testing.assert_close(
        sampler(reloaded, batch(PROMPTS[:1], SEEDS[:1])).latents[:, -1], with_lora, rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_policy_ratio_is_exactly_one(model, folder, dtype):
    model = model if dtype == "float32" else load_flow_model(folder, dtype=dtype, max_sequence_length=SHORT)
    sampler = SAMPLERS.get("sde")(num_steps=3, height=H, width=W, num_frames=F, guidance_scale=3.0, noise_level=0.8)
    assert_log_probs_rescore_exactly(model, sampler(model, batch()))


def test_gradient_checkpointing_gives_the_same_lora_gradients(folder):
    model = load_flow_model(folder, max_sequence_length=SHORT, guidance_rescale=0.7)
    torch.manual_seed(0)
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    x = torch.randn(2, *model.latent_shape(H, W, F), generator=torch.Generator().manual_seed(0))
    assert_checkpointing_keeps_lora_gradients(model, x, model.encode(PROMPTS, guidance_scale=3.0))


def test_tiny_pipeline_round_trips_offline(folder, tmp_path):
    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.save_pretrained(tmp_path / "copy")
    again = DiffusionPipeline.from_pretrained(tmp_path / "copy")
    for p in (pipe, again):
        p.set_progress_bar_config(disable=True)
    call = dict(prompts=PROMPTS[:1], seeds=SEEDS[:1], max_sequence_length=SHORT)
    a, b = (pipeline_call(p, 2, 3.0, "latent", **call) for p in (pipe, again))
    torch.testing.assert_close(a.frames, b.frames, rtol=0, atol=0)
    torch.testing.assert_close(a.audio, b.audio, rtol=0, atol=0)
    # a real tokenizer, not an empty stand-in
    assert type(again).__name__ == "LTX2Pipeline" and len(again.tokenizer) > 90


# ------------------------------------------------------------------------------------------- bad input
def test_an_image_given_to_the_text_only_family(model):
    with pytest.raises(ValueError, match=r"metadata image='cat\.png' given to the text-only ltx2 model"):
        encode_prompts(model, PROMPTS[:1], [{"image": "cat.png"}], "", 3.0, (H, W, F))
    with pytest.raises(ValueError, match="the ltx2 model is text-only; pass no images"):
        model.encode(PROMPTS[:1], images=["cat.png"])


@pytest.mark.parametrize(
    "options,match",
    [
        ({"stg_scale": 1.0}, r"stg_scale > 0 needs stg_blocks, the blocks whose self-attention STG skips"),
        ({"stg_scale": 1.0, "stg_blocks": [1]}, r"stg_blocks=\[1\] must index the transformer's 1 blocks \(0 to 0\)"),
        ({"audio_modality_scale": -1.0}, r"audio_modality_scale=-1.0 must be >= 0"),
        ({"guidance_rescale": 1.5}, r"guidance_rescale=1.5 must be in \[0, 1\]"),
        ({"frame_rate": 0}, r"frame_rate=0 must be a positive number"),
        ({"max_sequence_length": 12}, r"max_sequence_length=12 must be a multiple of the LTX-2 text connectors' 8"),
        ({"train_expert": "low"}, r"model.train_expert='low' does not apply to LTX2Pipeline"),
    ],
)
def test_settings_it_does_not_support_are_refused(model, folder, options, match):
    with pytest.raises(ValueError, match=match):
        if {"max_sequence_length", "train_expert"} & set(options):  # load_flow_model's arguments
            load_flow_model(folder, **options)
        else:  # the adapter's own: built over the loaded pipeline
            LTX2FlowModel(model.pipe, **options)


@pytest.mark.parametrize(
    "size,match",
    [
        ((48, 32, 5), "height=48 is not a positive multiple of 32"),
        ((32, 32, 4), "num_frames=4 must be 1 \\+ a multiple of 2"),
    ],
)
def test_sizes_the_pipeline_refuses(model, size, match):
    with pytest.raises(ValueError, match=match):
        model.prepare_latents(1, size[0], size[1], None, size[2])


def test_guidance_needs_a_positive_sigma(model):
    x = model.prepare_latents(1, H, W, [torch.Generator().manual_seed(0)], F)
    cond = model.encode(PROMPTS[:1], guidance_scale=3.0)
    with pytest.raises(ValueError, match="LTX-2 guidance runs in x0 space .*: call it at σ > 0"):
        model.velocity(x, 0.0, cond, 3.0)
    assert model.velocity(x, 0.0, model.encode(PROMPTS[:1]), 1.0).isfinite().all()  # unguided: any σ


def test_a_state_of_unknown_size(model):
    with pytest.raises(ValueError, match="an LTX-2 state of 7 values has no known size"):
        model.decode(torch.zeros(1, 7))


def test_stg_is_refused_where_it_changes_nothing(folder, tmp_path):
    """An LTX-2.0 transformer (perturbed_attn=False) runs STG's extra call to the same prediction: refused."""
    import json
    import shutil

    copy = tmp_path / "ltx20"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "transformer" / "config.json").read_text())
    (copy / "transformer" / "config.json").write_text(json.dumps({**config, "perturbed_attn": False}))
    with pytest.raises(ValueError, match="perturbed_attn=False .* where STG changes nothing; set stg_scale to 0"):
        load_flow_model(str(copy), stg_scale=1.0, stg_blocks=[0])
