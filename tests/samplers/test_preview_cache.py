"""The candidates sampler's one preview copy (flowrl.quant.PreviewCache): built once, refreshed in place from the
live weights when they change, bit for bit the preview a fresh copy would be, and never a new copy of the model per
rollout."""

import pytest
import torch
from test_candidates_sampler import lora_toy  # the toy model with a trained-looking adapter

from flowrl import quant
from flowrl.quant import PreviewSpec, build_preview
from flowrl.registry import SAMPLERS
from flowrl.samplers.candidates import previewing
from flowrl.types import PromptBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def velocity(model, preview):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    cond = model.encode(["two red circles", "one blue square"])
    with previewing(model, preview), torch.no_grad():
        return model.velocity(x, torch.tensor(0.6), cond)


def optimizer_step(model) -> None:
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    model.velocity(x, torch.tensor(0.5), model.encode(["two red circles"] * 2)).square().mean().backward()
    torch.optim.AdamW(params, lr=0.05).step()


def assert_same_preview(kept, fresh, model):
    """Every float tensor and the output of the kept preview equal a fresh build's, bit for bit."""
    fresh_state = fresh.state_dict()
    for name, tensor in kept.state_dict().items():
        if torch.is_tensor(tensor) and not tensor.is_quantized:
            assert torch.equal(tensor, fresh_state[name]), name
    assert torch.equal(velocity(model, kept), velocity(model, fresh))


@pytest.mark.parametrize("backend", ["fake_nvfp4", "fake_mxfp4", "fake_fp8", "int8"])
def test_a_refreshed_preview_equals_a_fresh_copy_bit_for_bit(backend):
    model = lora_toy()
    spec = PreviewSpec([backend])
    cache = quant.PreviewCache(spec)
    preview = cache(model.transformer, "toy", step=0)
    assert_same_preview(preview, build_preview(model.transformer, spec), model)
    before = velocity(model, preview)
    optimizer_step(model)
    assert cache(model.transformer, "toy", step=1) is preview  # the same copy, written over in place
    assert not torch.equal(velocity(model, preview), before)  # it follows the new weights ...
    assert_same_preview(preview, build_preview(model.transformer, spec), model)  # ... exactly as a new copy would
    with model.adapter_disabled():  # the adapter switched off (the reference): another set of weights
        assert_same_preview(cache(model.transformer, "toy", step=1), build_preview(model.transformer, spec), model)
    assert cache.counts == {"builds": 1, "refreshes": 2, "reuses": 0}


def test_one_step_quantizes_once_and_a_weight_change_is_seen_without_a_new_step():
    model = lora_toy()
    cache = quant.PreviewCache(PreviewSpec(["fake_nvfp4"]))
    first = cache(model.transformer, "toy", step=3)
    assert cache(model.transformer, "toy", step=3) is first and cache.counts["reuses"] == 1  # the step's next chunk
    with torch.no_grad():  # weights written in place within the step (a resumed checkpoint, an EMA swap)
        next(p for n, p in model.transformer.named_parameters() if "lora_B" in n).add_(0.1)
    cache(model.transformer, "toy", step=3)
    assert cache.counts == {"builds": 1, "refreshes": 1, "reuses": 1}
    assert_same_preview(first, build_preview(model.transformer, PreviewSpec(["fake_nvfp4"])), model)


def test_the_sampler_copies_the_model_once_over_chunks_and_steps(monkeypatch):
    """Three rollout calls (two chunks of step 0, then step 1 after an optimizer step) make one copy of the model, and
    give the rollouts of a sampler that copies afresh (a new sampler for each call)."""
    copies = []
    merged_copy = quant.merged_copy
    monkeypatch.setattr(quant, "merged_copy", lambda transformer: copies.append(1) or merged_copy(transformer))
    model = lora_toy()
    kwargs = {"pool_size": 4, "num_steps": 3, "preview_num_steps": 2, "guidance_scale": 1.0}
    sampler = SAMPLERS.get("candidates")(preview_backend="fake_nvfp4+few_step", **kwargs)
    batch = PromptBatch(["two red circles"] * 2, torch.tensor([0, 0]), seeds=torch.tensor([5, 6]))

    def brightness(images, prompts, metadata):
        return images.float().flatten(1).mean(dim=1)

    kept = []
    for step in (0, 0, 1):
        if step == 1:
            optimizer_step(model)
        kept.append(sampler(model, batch, score_fn=brightness, step=step).extras["pool_preview_scores"])
    assert len(copies) == 1
    fresh = SAMPLERS.get("candidates")(preview_backend="fake_nvfp4+few_step", **kwargs)
    assert torch.equal(kept[-1], fresh(model, batch, score_fn=brightness, step=1).extras["pool_preview_scores"])
