"""The toy FlowModel adapter: time grid, noise, packing, CFG, encoding cache, shipped weights and their checks."""

import shutil

import numpy as np
import pytest
import torch

from flowrl.models import toy
from flowrl.models.toy import ToyFlowModel, build_text_encoder, build_unet, load_toy_model
from flowrl.toy.manifest import WEIGHTS_DIR, verified_weights
from flowrl.types import FlowModel


@pytest.fixture(scope="module")
def random_model():
    torch.manual_seed(0)
    return ToyFlowModel(build_unet(), build_text_encoder())


def test_is_a_flow_model(random_model):
    assert isinstance(random_model, FlowModel)
    assert random_model.family == "toy" and random_model.latent_shape(32, 32) == (3, 32, 32)
    assert random_model.native_size == (32, 32, None)
    with pytest.raises(ValueError, match="height=30 width=32"):
        random_model.latent_shape(30, 32)


@pytest.mark.parametrize("num_steps", [1, 10, 16])
def test_sigmas_equal_diffusers_scheduler(random_model, num_steps):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1.0 / num_steps, num_steps))
    sigmas = random_model.sigmas(num_steps, 32, 32)
    assert sigmas.dtype == torch.float32 and sigmas.shape == (num_steps + 1,)
    torch.testing.assert_close(sigmas, scheduler.sigmas.float(), rtol=0, atol=1e-7)
    if num_steps == 10:  # by hand: 1, 0.9, ..., 0.1, 0
        torch.testing.assert_close(sigmas, torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0]))


def test_prepare_latents_is_randn_of_the_generator(random_model):
    latents = random_model.prepare_latents(4, 32, 32, torch.Generator().manual_seed(3))
    torch.testing.assert_close(latents, torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(3)))
    per_sample = random_model.prepare_latents(2, 32, 32, [torch.Generator().manual_seed(s) for s in (5, 6)])
    torch.testing.assert_close(per_sample[1], torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(6)))


def test_pack_puts_each_2x2_patch_into_channels():
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    packed = toy.pack(x)  # [2, 12, 2, 2]
    # by hand: channel c*4 + 2*i + j at (Y, X) holds pixel (c, 2Y + i, 2X + j)
    assert packed[1, 2 * 4 + 2 * 1 + 0, 1, 0] == x[1, 2, 3, 0]
    assert packed[0, 0 * 4 + 2 * 0 + 1, 0, 1] == x[0, 0, 0, 3]
    assert torch.equal(toy.unpack(packed), x)


def test_velocity_is_the_unet_on_packed_pixels(random_model):
    latents = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    cond = random_model.encode(["two red circles", "one blue square", "three green triangles"])
    v = random_model.velocity(latents, 0.7, cond, 1.0)
    packed = latents.reshape(3, 3, 16, 2, 16, 2).permute(0, 1, 3, 5, 2, 4).reshape(3, 12, 16, 16)
    with torch.no_grad():
        out = random_model.transformer(
            packed, torch.full((3,), 700.0), encoder_hidden_states=cond["prompt_embeds"]
        ).sample
    expected = out.reshape(3, 3, 2, 2, 16, 16).permute(0, 1, 4, 2, 5, 3).reshape(3, 3, 32, 32)
    torch.testing.assert_close(v, expected)
    assert v.dtype == torch.float32
    torch.testing.assert_close(random_model.velocity(latents, torch.full((3,), 0.7), cond, 1.0), v)


def test_cfg_combines_the_two_branches(random_model):
    latents = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 0.9])
    cond = random_model.encode(["two red circles", "one blue square"], guidance_scale=4.0)
    assert set(cond) == {"prompt_embeds", "negative_prompt_embeds"}
    v_text = random_model.velocity(latents, sigma, {"prompt_embeds": cond["prompt_embeds"]}, 1.0)
    v_uncond = random_model.velocity(latents, sigma, {"prompt_embeds": cond["negative_prompt_embeds"]}, 1.0)
    guided = random_model.velocity(latents, sigma, cond, 4.0)
    torch.testing.assert_close(guided, v_uncond + 4.0 * (v_text - v_uncond), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="guidance_scale=4.0 needs cond"):
        random_model.velocity(latents, sigma, {"prompt_embeds": cond["prompt_embeds"]}, 4.0)


def test_encode_caches_per_prompt_and_checks_the_grammar(random_model):
    cond = random_model.encode(["two red circles", "one blue square", "two red circles"])
    assert cond["prompt_embeds"].shape == (3, toy.MAX_LENGTH, 64) and "negative_prompt_embeds" not in cond
    torch.testing.assert_close(cond["prompt_embeds"][0], cond["prompt_embeds"][2])
    with torch.no_grad():
        direct = random_model.embed(["one blue square"])[0]
    torch.testing.assert_close(cond["prompt_embeds"][1], direct)
    assert toy.tokenize(["two red circles", ""]).tolist() == [
        [toy.VOCAB["<bos>"], toy.VOCAB["two"], toy.VOCAB["red"], toy.VOCAB["circles"], toy.VOCAB["<eos>"]],
        [toy.VOCAB["<bos>"], toy.VOCAB["<eos>"], 0, 0, 0],
    ]
    with pytest.raises(ValueError, match="'five red circles' is outside the Shapes grammar"):
        random_model.encode(["five red circles"])


def test_decode_maps_minus_one_one_to_zero_one(random_model):
    latents = torch.tensor([-1.0, 0.0, 1.0, 3.0, -3.0]).view(1, 1, 1, 5).expand(1, 3, 1, 5)
    torch.testing.assert_close(random_model.decode(latents)[0, 0, 0], torch.tensor([0.0, 0.5, 1.0, 1.0, 0.0]))


def test_missing_or_corrupted_weights_name_the_file_and_the_script(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="toy_model.safetensors are missing; rebuild them with `python scripts/pretrain_toy.py`"
    ):
        verified_weights("toy_model.safetensors", tmp_path)
    for name in ("toy_model.safetensors", "manifest.json"):
        shutil.copy(WEIGHTS_DIR / name, tmp_path / name)
    assert verified_weights("toy_model.safetensors", tmp_path) == tmp_path / "toy_model.safetensors"
    data = bytearray((tmp_path / "toy_model.safetensors").read_bytes())
    data[-10] ^= 0xFF  # same size, different hash
    (tmp_path / "toy_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="toy_model.safetensors are corrupted .*scripts/pretrain_toy.py"):
        verified_weights("toy_model.safetensors", tmp_path)
    (tmp_path / "toy_model.safetensors").write_bytes(bytes(data[:-1]))
    with pytest.raises(ValueError, match="size .* vs"):
        verified_weights("toy_model.safetensors", tmp_path)
    with pytest.raises(FileNotFoundError, match="checkpoint='nowhere.safetensors' does not exist"):
        load_toy_model(checkpoint="nowhere.safetensors")


def test_shipped_model_draws_the_prompted_colours_and_mostly_the_attributes():
    from flowrl.heldout import sample_images
    from flowrl.toy.judges import load_judge
    from flowrl.toy.world import split_prompts

    model = load_toy_model()
    judge = load_judge("attributes")
    prompts = split_prompts("train")[::2]  # 14 training prompts, one seed each
    images = sample_images(
        model,
        prompts,
        list(range(len(prompts))),
        num_steps=toy.DEFAULT_NUM_STEPS,
        guidance_scale=toy.DEFAULT_GUIDANCE_SCALE,
    )
    assert images.shape == (14, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    from flowrl.heldout import judge_accuracy

    metrics = judge_accuracy(judge, images, prompts)
    # shapes are never corrupted in pretraining, counts and colours deliberately are (scripts/pretrain_toy.py)
    assert metrics["shape_accuracy"] >= 0.9 and metrics["colour_accuracy"] >= 0.5, metrics
    assert 0.0 < metrics["accuracy"] < 1.0, metrics


def test_ode_sampler_runs_the_toy_model_as_a_hand_written_euler_loop(random_model):
    from flowrl.heldout import sample_images

    prompts, seeds = ["two red circles", "one blue square", "three green triangles"], [11, 12, 13]
    images = sample_images(random_model, prompts, seeds, num_steps=4, guidance_scale=2.0, batch_size=2)
    latents = torch.stack([torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(s)) for s in seeds])
    cond = random_model.encode(prompts, guidance_scale=2.0)
    sigmas = [1.0, 0.75, 0.5, 0.25, 0.0]  # linspace(1, 1/T, T) and 0, by hand
    with torch.no_grad():
        for k in range(4):
            latents = latents + (sigmas[k + 1] - sigmas[k]) * random_model.velocity(latents, sigmas[k], cond, 2.0)
    torch.testing.assert_close(images, (latents / 2 + 0.5).clamp(0, 1), rtol=1e-4, atol=1e-5)


def test_flowrl_sample_cli_draws_the_shipped_toy_model(tmp_path):
    import numpy as np
    from PIL import Image

    from flowrl.cli import main
    from flowrl.heldout import sample_images

    prompts = ["two red circles", "three blue triangles"]
    assert (
        main(
            [
                "sample",
                "--model",
                "toy",
                "--prompt",
                prompts[0],
                "--prompt",
                prompts[1],
                "--num-steps",
                "10",
                "--seed",
                "3",
                "--out",
                str(tmp_path),
            ]
        )
        == 0
    )
    files = sorted(tmp_path.glob("*.png"))
    assert [f.name for f in files] == ["000_seed3_two_red_circles.png", "001_seed3_three_blue_triangles.png"]
    expected = sample_images(load_toy_model(), prompts, [3, 3], num_steps=10, guidance_scale=toy.DEFAULT_GUIDANCE_SCALE)
    for f, image in zip(files, expected):
        png = torch.from_numpy(np.array(Image.open(f).convert("RGB"))).permute(2, 0, 1).float() / 255  # [3, 32, 32]
        assert (png - image).abs().max() <= 1 / 255 + 1e-6
