"""Conditioning images as data: JSONL prompts files, the image in every sample's metadata (adapter and rewards),
`flowrl sample --image`, and the source image beside its samples in the eval folder and the report."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from flowrl.cli import main
from flowrl.models.tiny import TINY_SIZES
from flowrl.registry import SAMPLERS
from flowrl.training.evaluation import evaluate
from flowrl.training.prompts import GroupedPromptSampler, load_prompt_records, load_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H, W, _ = TINY_SIZES["qwen_image_edit"]


def write_source(path, colour):
    Image.fromarray(np.full((H, W, 3), colour, dtype=np.uint8)).save(path)
    return path


@pytest.fixture
def jsonl(tmp_path):
    (tmp_path / "src").mkdir()
    write_source(tmp_path / "src" / "a.png", (200, 30, 30))
    write_source(tmp_path / "src" / "b.png", (30, 30, 200))
    lines = [
        {"prompt": "make it blue", "image": "src/a.png", "tag": "colour"},
        {"prompt": "make it red", "image": "src/b.png"},
        {"prompt": " no image here "},
    ]
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    return path


def test_jsonl_prompts_keep_every_extra_key_with_the_image_resolved(jsonl, tmp_path):
    prompts, metadata = load_prompt_records(None, str(jsonl), None, "data")
    assert prompts == ["make it blue", "make it red", "no image here"]
    assert metadata == [
        {"image": str(tmp_path / "src" / "a.png"), "tag": "colour"},
        {"image": str(tmp_path / "src" / "b.png")},
        {},
    ]
    assert load_prompts(None, str(jsonl), None, "data") == prompts  # the plain list, as before
    # text files and inline lists: no metadata
    assert load_prompt_records(["a", "b"], None, None, "data")[1] == [{}, {}]


def test_every_sample_of_a_group_carries_its_prompts_record(jsonl):
    prompts, metadata = load_prompt_records(None, str(jsonl), None, "data")
    batch = GroupedPromptSampler(prompts, num_prompts_per_step=2, group_size=3, seed=0, metadata=metadata).global_batch(
        4
    )
    for prompt, meta in zip(batch.prompts, batch.metadata):
        assert meta == metadata[prompts.index(prompt)]
    batch.metadata[0]["tag"] = "changed"  # each sample owns its dict
    assert all(m.get("tag") != "changed" for m in metadata)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", r"line 1 is not JSON .*write one object a line"),
        ('{"image": "src/a.png"}', r'line 1 has no "prompt" string'),
        ('{"prompt": "x", "image": "src/missing.png"}', r"\"image\"='src/missing.png' does not exist \(looked at"),
        ('{"prompt": "x", "image": 3}', r"\"image\"=3 must be a path to a PNG or JPEG"),
    ],
)
def test_bad_jsonl_lines_are_one_line_errors(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises((ValueError, FileNotFoundError), match=message) as err:
        load_prompt_records(None, str(path), None, "data")
    assert "\n" not in str(err.value) and "data.prompts_file=" in str(err.value)


def test_the_source_reaches_every_reward_and_sits_beside_its_samples_in_the_report(tiny_pipeline, jsonl, tmp_path):
    from flowrl.models import load_flow_model
    from flowrl.report import load_run, render_grid

    model = load_flow_model(tiny_pipeline("qwen_image_edit"), max_sequence_length=512)
    prompts, metadata = load_prompt_records(None, str(jsonl), None, "data")
    seen = []

    def reward(images, prompts, metadata):
        seen.extend(m["image"] for m in metadata)
        from flowrl.types import RewardOutput

        return RewardOutput(scores=torch.zeros(len(prompts)))

    out = tmp_path / "run" / "eval" / "base"
    sampler = SAMPLERS.get("ode")(num_steps=2, height=H, width=W)
    result = evaluate(
        model, {"r": reward}, out, prompts=prompts[:2], metadata=metadata[:2], seeds=[0], sampler=sampler,
        train_reward_names=["r"], step=0, label="base",
    )  # fmt: skip
    assert seen == [metadata[0]["image"], metadata[1]["image"]]
    assert result["sources"] == ["p000_source.png", "p001_source.png"]
    assert np.array_equal(np.asarray(Image.open(out / "p001_source.png")), np.asarray(Image.open(metadata[1]["image"])))
    grid, geometry = render_grid(load_run(tmp_path / "run").evals, prompts[:2], [0], ["r"])
    # the source column sits left of the first sample, at the sample's row: the second prompt's source is blue
    x0, y0, _, _ = geometry["cells"][0, 1, 0]
    label_w, pad = 180, geometry["pad"]
    assert x0 > label_w + geometry["cell_size"][0]
    assert grid.getpixel((label_w + pad + 2, y0 + 2)) == (30, 30, 200)


def test_flowrl_sample_with_an_image_equals_the_sampler(tiny_pipeline, jsonl, tmp_path):
    from flowrl.models import load_flow_model
    from flowrl.types import PromptBatch

    source = str(tmp_path / "src" / "a.png")
    argv = ["sample", "--model", tiny_pipeline("qwen_image_edit"), "--prompt", "make it blue", "--image", source]
    argv += ["--num-steps", "2", "--height", str(H), "--width", str(W), "--max-sequence-length", "512"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    (png,) = (tmp_path / "out").glob("*.png")
    model = load_flow_model(tiny_pipeline("qwen_image_edit"), max_sequence_length=512)
    batch = PromptBatch(["make it blue"], torch.arange(1), [{"image": source}], seeds=torch.tensor([0]))
    images = SAMPLERS.get("ode")(num_steps=2, height=H, width=W)(model, batch).images
    expected = (images[0].permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.uint8)
    assert np.abs(np.asarray(Image.open(png)).astype(int) - expected.astype(int)).max() <= 1


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--model", "toy", "--image", "SRC"], "--image given to the text-only toy model 'toy'; drop --image"),
        (["--model", "EDIT"], "edits or animates a source image; pass --image PATH"),
        (["--model", "toy", "--image", "SRC", "--image", "SRC", "--image", "SRC"], "3 --image for 2 --prompt"),
    ],
)
def test_sample_image_errors_are_one_line(tiny_pipeline, tmp_path, capsys, extra, message):
    source = str(write_source(tmp_path / "s.png", (1, 2, 3)))
    extra = [source if a == "SRC" else tiny_pipeline("qwen_image_edit") if a == "EDIT" else a for a in extra]
    assert main(["sample", "--prompt", "a", "--prompt", "b", "--out", str(tmp_path / "o"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # (loading progress bars come before it)
    assert err.startswith("flowrl sample: error: ") and message in err
