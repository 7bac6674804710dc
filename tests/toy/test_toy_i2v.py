"""The toy image-to-video model ("toy I2V"): the toy model pulled toward a source image, its source records and
config."""

import os

import pytest
import torch
import yaml

from flowrl.config import ConfigError
from flowrl.media import load_image
from flowrl.models.conditioning import conditioning_kind, encode_prompts
from flowrl.models.toy import load_toy_model, pack, unpack
from flowrl.samplers.ode import ODESampler
from flowrl.toy import sources
from flowrl.toy.world import parse_prompt, render
from flowrl.training.prompts import load_prompt_records
from flowrl.types import PromptBatch, select_cond

PROMPTS = ["two red circles", "one blue square", "three green triangles"]
W = 0.5
SIZE = (32, 32, None)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def models():
    return load_toy_model(), load_toy_model(source_weight=W)


def _meta(prompts):
    return [{"image": sources.source_path(p)} for p in prompts]


def test_zero_weight_is_the_text_only_model_bit_for_bit(models):
    plain, _ = models
    zero = load_toy_model(source_weight=0.0)
    assert conditioning_kind(zero) is None and not hasattr(zero, "conditioning")
    latents = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    for guidance in (1.0, 3.0):
        cond, cond0 = plain.encode(PROMPTS, "", guidance), encode_prompts(zero, PROMPTS, None, "", guidance, SIZE)
        assert cond.keys() == cond0.keys() and all(torch.equal(cond[k], cond0[k]) for k in cond)
        assert torch.equal(plain.velocity(latents, 0.7, cond, guidance), zero.velocity(latents, 0.7, cond0, guidance))
    with torch.no_grad():  # the UNet on packed pixels, as the adapter always computed it
        by_hand = unpack(
            zero.transformer(
                pack(latents), torch.full((3,), 700.0), encoder_hidden_states=cond0["prompt_embeds"]
            ).sample
        )
    assert torch.equal(zero.velocity(latents, 0.7, encode_prompts(zero, PROMPTS, None, "", 1.0, SIZE)), by_hand)
    with pytest.raises(ValueError, match="text-only toy model"):
        encode_prompts(zero, PROMPTS, _meta(PROMPTS), "", 1.0, SIZE)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_velocity_is_the_text_velocity_pulled_toward_the_source(models, guidance):
    plain, i2v = models
    assert conditioning_kind(i2v) == "image"
    cond = encode_prompts(i2v, PROMPTS, _meta(PROMPTS), "", guidance, SIZE)
    source = torch.stack([load_image(sources.source_path(p)) * 2 - 1 for p in PROMPTS])  # [3, 3, 32, 32]
    torch.testing.assert_close(cond["source_latents"], source, rtol=0, atol=1e-6)
    assert torch.equal(select_cond(cond, [2])["source_latents"], cond["source_latents"][2:3])
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([1.0, 0.6, 0.2])  # a sigma per row
    v = plain.velocity(x, sigma, plain.encode(PROMPTS, "", guidance), guidance)
    x0_hat = x - sigma[:, None, None, None] * v
    expected = v - W * (source - x0_hat)
    torch.testing.assert_close(i2v.velocity(x, sigma, cond, guidance), expected, rtol=0, atol=1e-5)
    # the denoised estimate moves toward the source by W * sigma of the way
    x0_c = x - sigma[:, None, None, None] * i2v.velocity(x, sigma, cond, guidance)
    torch.testing.assert_close(x0_c, x0_hat + W * sigma[:, None, None, None] * (source - x0_hat), rtol=0, atol=1e-5)


def test_gradients_flow_through_the_text_velocity(models):
    _, i2v = models
    cond = encode_prompts(i2v, PROMPTS[:1], _meta(PROMPTS[:1]), "", 1.0, SIZE)
    weight = i2v.transformer.conv_in.weight
    weight.requires_grad_(True)
    try:
        i2v.velocity(
            torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2)), 0.5, cond
        ).square().sum().backward()
        assert weight.grad is not None and weight.grad.abs().sum() > 0
    finally:
        weight.grad = None
        weight.requires_grad_(False)


def test_sources_pull_the_ode_output_toward_the_source(models):
    plain, i2v = models
    prompts = [p for p in PROMPTS for _ in range(2)]
    meta = _meta(prompts)
    source = torch.stack([load_image(m["image"]) for m in meta])  # [6, 3, 32, 32] in [0, 1]
    sampler = ODESampler(num_steps=6, height=32, width=32, guidance_scale=1.0)
    distance = {}
    for name, model in (("plain", plain), ("i2v", i2v)):
        batch = PromptBatch(prompts, torch.arange(6), meta if model is i2v else [], seeds=torch.arange(100, 106))
        images = sampler(model, batch).images
        distance[name] = ((images - source) ** 2).mean(dim=(1, 2, 3)).sqrt()  # [6] RMS
    assert distance["i2v"].mean() < 0.75 * distance["plain"].mean(), distance
    assert (distance["i2v"] < distance["plain"]).float().mean() >= 5 / 6, distance


def test_the_source_png_is_the_worlds_render_written_once(cache, monkeypatch):
    path = sources.source_path("two red circles")
    assert os.path.dirname(path) == str(cache / "toy_sources") and os.listdir(cache / "toy_sources") == [
        os.path.basename(path)
    ]
    expected = render(parse_prompt("two red circles"), sources.source_seed("two red circles"))
    torch.testing.assert_close(load_image(path), expected, rtol=0, atol=0.5 / 255 + 1e-6)
    assert sources.source_seed("two red circles") != sources.source_seed("two red squares")
    prompts, metadata = load_prompt_records(None, None, "heldout", "eval", toy_sources=True)
    assert metadata[prompts.index("two red circles")] == {"image": path}
    assert all(os.path.isfile(m["image"]) for m in metadata) and len(os.listdir(cache / "toy_sources")) == len(prompts)

    def refuse(*args, **kwargs):
        raise AssertionError("rendered again")

    monkeypatch.setattr(sources, "render", refuse)  # from here on every source comes from the cache
    mtime = os.stat(path).st_mtime_ns
    assert sources.source_path("two red circles") == path and os.stat(path).st_mtime_ns == mtime
    assert load_prompt_records(None, None, "heldout", "eval", toy_sources=True) == (prompts, metadata)
    assert load_prompt_records(None, None, "heldout", "eval")[1] == [{} for _ in prompts]  # off: as before


def test_a_prompt_without_a_source_image_is_a_one_line_error(models):
    _, i2v = models
    with pytest.raises(
        ValueError, match=r"prompt 'one blue square' has no source image, which the toy model needs"
    ) as err:
        encode_prompts(i2v, PROMPTS[:2], [_meta(PROMPTS[:1])[0], {}], "", 1.0, SIZE)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="source_weight=0.5 needs one source image per prompt"):
        i2v.encode(PROMPTS)


def test_toy_sources_without_toy_split_is_a_config_error_naming_the_field():
    from flowrl.trainers import load_config

    with pytest.raises(ConfigError, match=r"data\.toy_sources=true needs data\.toy_split"):
        load_config("configs/toy/grpo_i2v.yaml", ["data.toy_split=null", "data.prompts=[two red circles]"])
    with pytest.raises(ConfigError, match=r"eval\.toy_sources=true needs eval\.toy_split"):
        load_config("configs/toy/grpo_i2v.yaml", ["eval.toy_split=null"])
    with pytest.raises(ValueError, match="model.train_expert='high' does not apply to the toy model"):
        load_toy_model_kwargs(train_expert="high")


def load_toy_model_kwargs(**kwargs):
    from flowrl.models import load_flow_model

    return load_flow_model("toy", **kwargs)


def test_one_grpo_step_on_the_i2v_config_carries_the_sources(tmp_path):
    from flowrl.trainers import build_trainer, load_config

    data = yaml.safe_load(open("configs/toy/grpo.yaml"))
    cfg = load_config(
        "configs/toy/grpo_i2v.yaml",
        [
            f"output_dir={tmp_path / 'runs'}",
            "num_steps=1",
            "model.lora_rank=4",
            "data.num_prompts_per_step=2",
            "data.group_size=2",
            "sampler.num_steps=3",
            "sampler.sde_window_size=1",
            "sampler.sde_window_range=[0, 2]",
            "logging.trackers=[]",
            "logging.progress_bar=false",
        ],
    )
    assert cfg.model.family_kwargs == {"source_weight": W} and cfg.data.toy_sources and cfg.eval.toy_sources
    assert cfg.sampler.kwargs["same_latent"] is True
    # only the sources differ
    assert data["sampler"] == {**yaml.safe_load(open("configs/toy/grpo_i2v.yaml"))["sampler"]}
    trainer = build_trainer(cfg)
    assert trainer.parts.model.source_weight == W and conditioning_kind(trainer.parts.model) == "image"
    original, seen = trainer.parts.sampler, []

    class Recording:
        def __getattr__(self, name):
            return getattr(original, name)

        def __call__(self, *args, **kwargs):
            seen.append(original(*args, **kwargs))
            return seen[-1]

    trainer.parts.sampler = Recording()
    metrics = trainer.train_step()
    assert metrics["train/optimizer_steps"] == 1 and "reward/toy_attributes/mean" in metrics
    rollout = seen[0]
    source = rollout.cond["source_latents"]  # [4, 3, 32, 32]
    assert source.shape == (4, 3, 32, 32)
    for row, meta in enumerate(rollout.metadata):
        torch.testing.assert_close(source[row], load_image(meta["image"]) * 2 - 1, rtol=0, atol=1e-6)
    # a group shares both
    assert torch.equal(source[0], source[1]) and torch.equal(rollout.latents[0, 0], rollout.latents[1, 0])
