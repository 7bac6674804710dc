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
    rc = main(["sample", "--model", tiny_pipeline("sd3"), "--prompt", "a red cat", "--prompt", "a dog", "--seed", "4",
               "--num-steps", "3", "--guidance-scale", "2.0", "--height", "32", "--width", "32", "--out", str(out)])
    assert rc == 0
    files = sorted(out.glob("*.png"))
    assert [f.name for f in files] == ["000_seed4_a_red_cat.png", "001_seed4_a_dog.png"]
    rollout = SAMPLERS.get("ode")(num_steps=3, height=32, width=32, guidance_scale=2.0)(
        tiny_model("sd3"), PromptBatch(["a red cat"], torch.tensor([0]), seeds=torch.tensor([4])))
    expected = (rollout.images[0] * 255).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
    assert np.array_equal(np.asarray(Image.open(files[0])), expected)


def test_sample_video_writes_a_clip_and_a_strip(tiny_pipeline, tmp_path):
    rc = main(["sample", "--model", tiny_pipeline("wan"), "--prompt", "waves", "--num-steps", "2", "--height", "16",
               "--width", "16", "--num-frames", "5", "--sampler", "sde", "--out", str(tmp_path)])
    assert rc == 0
    clips = [p for p in tmp_path.iterdir() if p.suffix in (".mp4", ".gif")]
    strip = Image.open(next(tmp_path.glob("*_strip.png")))
    assert len(clips) == 1 and strip.size == (16 * 5, 16)


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/dir"], "neither an existing folder nor a hub id"),
    (["--height", "31"], "height=31 is not a positive multiple of 2"),
])
def test_sample_bad_input_is_one_line(tiny_pipeline, tmp_path, capsys, args, message):
    base = {"--model": tiny_pipeline("sd3"), "--height": "32"}
    base.update(dict(zip(args[::2], args[1::2])))
    argv = ["sample", "--prompt", "x", "--num-steps", "1", "--out", str(tmp_path)] + [x for kv in base.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (loading progress bars come before it)
    assert err.startswith("flowrl sample: error: ") and message in err
