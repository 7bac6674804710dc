"""`flowrl sample` writes one PNG per image (video: a clip file and a PNG strip), equal to the ODE sampler's output."""

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.cli import main
from flowrl.registry import SAMPLERS
from flowrl.types import PromptBatch


def test_sample_writes_pngs_equal_to_the_sampler(tiny_pipeline, tiny_model, tmp_path):
    out = tmp_path / "out"
    rc = main(
        [
            "sample",
            "--model",
            tiny_pipeline("sd3"),
            "--prompt",
            "a red cat",
            "--prompt",
            "a dog",
            "--seed",
            "4",
            "--num-steps",
            "3",
            "--guidance-scale",
            "2.0",
            "--height",
            "32",
            "--width",
            "32",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    files = sorted(out.glob("*.png"))
    assert [f.name for f in files] == ["000_seed4_a_red_cat.png", "001_seed4_a_dog.png"]
    rollout = SAMPLERS.get("ode")(num_steps=3, height=32, width=32, guidance_scale=2.0)(
        tiny_model("sd3"), PromptBatch(["a red cat"], torch.tensor([0]), seeds=torch.tensor([4]))
    )
    expected = (rollout.images[0] * 255).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
    assert np.array_equal(np.asarray(Image.open(files[0])), expected)


def test_sample_video_writes_a_clip_and_a_strip(tiny_pipeline, tmp_path):
    rc = main(
        [
            "sample",
            "--model",
            tiny_pipeline("wan"),
            "--prompt",
            "waves",
            "--num-steps",
            "2",
            "--height",
            "16",
            "--width",
            "16",
            "--num-frames",
            "5",
            "--sampler",
            "sde",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    clips = [p for p in tmp_path.iterdir() if p.suffix in (".mp4", ".gif")]
    strip = Image.open(next(tmp_path.glob("*_strip.png")))
    assert len(clips) == 1 and strip.size == (16 * 5, 16)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/no/such/dir"], "neither an existing folder nor a hub id"),
        (["--height", "31"], "height=31 is not a positive multiple of 2"),
    ],
)
def test_sample_bad_input_is_one_line(tiny_pipeline, tmp_path, capsys, args, message):
    base = {"--model": tiny_pipeline("sd3"), "--height": "32"}
    base.update(dict(zip(args[::2], args[1::2])))
    argv = ["sample", "--prompt", "x", "--num-steps", "1", "--out", str(tmp_path)] + [
        x for kv in base.items() for x in kv
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (loading progress bars come before it)
    assert err.startswith("flowrl sample: error: ") and message in err


def test_num_images_per_prompt_equals_single_seed_calls_and_the_per_seed_draw(tmp_path):
    """N images per prompt carry seeds S..S+N-1: bit-equal to N calls with --seed S+i, and to the ODE sampler
    given those seeds, whose initial noise is diffusers' draw with one `Generator().manual_seed(S+i)` per image."""
    from flowrl import media
    from flowrl.models import load_flow_model

    prompts, seed, num = ["two red circles", "one blue square"], 5, 3
    common = ["sample", "--model", "toy", "--prompt", prompts[0], "--prompt", prompts[1], "--num-steps", "2"]
    assert (
        main(common + ["--seed", str(seed), "--num-images-per-prompt", str(num), "--out", str(tmp_path / "many")]) == 0
    )
    names = sorted(p.name for p in (tmp_path / "many").glob("*.png"))
    assert names == sorted(
        f"{i:03d}_seed{seed + k}_{slug}.png"
        for i, slug in enumerate(["two_red_circles", "one_blue_square"])
        for k in range(num)
    )
    model = load_flow_model("toy")
    sampler = SAMPLERS.get("ode")(num_steps=2, height=32, width=32)
    for k in range(num):
        single = tmp_path / f"single{k}"
        assert main(common + ["--seed", str(seed + k), "--out", str(single)]) == 0
        rollout = sampler(model, PromptBatch(prompts, torch.arange(2), seeds=torch.full((2,), seed + k)))
        drawn = torch.randn(model.latent_shape(32, 32), generator=torch.Generator().manual_seed(seed + k))
        for i, image in enumerate(rollout.images):
            torch.testing.assert_close(rollout.latents[i, 0], drawn, rtol=0, atol=0)
            many = sorted((tmp_path / "many").glob(f"{i:03d}_seed{seed + k}_*.png"))
            assert len(many) == 1 and many[0].read_bytes() == (single / many[0].name).read_bytes()
            expected = media.to_uint8(image).permute(1, 2, 0).numpy()
            assert np.array_equal(np.asarray(Image.open(many[0])), expected)


def test_sample_with_a_trained_checkpoints_lora_equals_the_trained_model_in_process(tmp_path):
    """`flowrl sample --model toy --lora <checkpoint>/lora` loads the exported adapter: its PNGs are bit-equal to the
    trained model sampled in process with the ODE sampler (same seed and steps), and differ from the base model's."""
    import json

    import flowrl.trainers.kit as kit
    from flowrl import media
    from flowrl.models import load_flow_model
    from flowrl.trainers import build_config, build_trainer

    prompts, seed, steps = ["two red circles", "one blue square"], 3, 2
    cfg = build_config(
        {
            "name": "lora",
            "output_dir": str(tmp_path / "runs"),
            "device": "cpu",
            "num_steps": 1,
            "seed": 1,
            "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 8},
            "data": {"prompts": prompts, "num_prompts_per_step": 2, "group_size": 2},
            "sampler": {"name": "sde", "num_steps": 2, "noise_level": 0.8},
            "rewards": [{"name": "toy_attributes"}],
            "train": {"learning_rate": 5e-2, "clip_range": 1e-2, "use_ema": False, "use_async_rewards": False},
            "eval": {"num_steps": 1, "seeds": [0], "prompts": prompts[:1]},
            "logging": {"trackers": [], "progress_bar": False},
        }
    )
    trainer = build_trainer(cfg)
    kit.train(trainer)
    checkpoint = cfg.run_dir / "checkpoints" / "step_000001"
    assert json.loads((checkpoint / "trainer_state.json").read_text())["lora_weights"] == "raw"

    out = tmp_path / "out"
    argv = [
        "sample",
        "--model",
        "toy",
        "--lora",
        str(checkpoint / "lora"),
        "--seed",
        str(seed),
        "--num-steps",
        str(steps),
        "--out",
        str(out),
    ]
    assert main(argv + [x for p in prompts for x in ("--prompt", p)]) == 0
    files = sorted(out.glob("*.png"))
    assert [f.name for f in files] == [f"000_seed{seed}_two_red_circles.png", f"001_seed{seed}_one_blue_square.png"]
    written = [np.asarray(Image.open(f)) for f in files]

    batch = PromptBatch(prompts, torch.arange(2), seeds=torch.full((2,), seed))
    sampler = SAMPLERS.get("ode")(num_steps=steps)
    trainer.parts.model.transformer.eval()
    trained = media.to_uint8(sampler(trainer.parts.model, batch).images).permute(0, 2, 3, 1).numpy()
    base = media.to_uint8(sampler(load_flow_model("toy"), batch).images).permute(0, 2, 3, 1).numpy()
    for i in range(len(prompts)):
        assert np.array_equal(written[i], trained[i]), i
    assert all(not np.array_equal(written[i], base[i]) for i in range(len(prompts)))  # the adapter moved the images
