"""Named LoRA adapters beside the trained one (DiffusionNFT's sampling policy "old"), on every family and the toy:
switch, copy, soft-update in place, the trained / frozen split untouched, and the trained adapter still exporting
in the diffusers format that `pipe.load_lora_weights` reads."""

import pytest
import torch
from diffusers import DiffusionPipeline
from test_adapters import PROMPTS, SEEDS, batch, ode, pipeline_call

from flowrl.models import load_flow_model
from flowrl.models.tiny import FAMILIES, TINY_SIZES

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # as in test_adapters.py


def latents_and_velocity(model, family):
    """A fixed input's velocity (guidance 1) with whatever adapter is active."""
    shape = (
        model.latent_shape(*TINY_SIZES[family][:2], TINY_SIZES[family][2])
        if family != "toy"
        else model.latent_shape(32, 32)
    )
    x = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
    cond = model.encode(["two red circles"] if family == "toy" else PROMPTS[:1])
    # above Wan 2.2 A14B's boundary (0.7): the trained expert
    return model.velocity(x, torch.tensor([0.8]), cond, 1.0).detach()


def flags(model):
    return {n: p.requires_grad for n, p in model.transformer.named_parameters()}


@pytest.mark.parametrize("family", [*FAMILIES, "toy"])
def test_copy_switch_and_soft_update_in_place(tiny_model, family):
    model = load_flow_model("toy") if family == "toy" else tiny_model(family)
    torch.manual_seed(0)
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    trained = flags(model)
    before = latents_and_velocity(model, family)
    model.copy_adapter("default", "old")
    assert model.adapter_names == ["default", "old"]
    now = flags(model)
    # the old adapter is frozen, every other flag as the recipe set it
    assert {n: f for n, f in now.items() if ".old." not in n} == trained
    assert not any(f for n, f in now.items() if ".old." in n)
    torch.testing.assert_close(latents_and_velocity(model, family), before, rtol=0, atol=0)  # still the default

    default, old = model.adapter_parameters("default"), model.adapter_parameters("old")
    assert len(default) == len(old) > 0
    with torch.no_grad():
        for p in default.values():
            p.add_(0.05 * torch.randn_like(p))
    moved = latents_and_velocity(model, family)
    assert (moved - before).abs().max() > 1e-4
    with model.using_adapter("old"):
        torch.testing.assert_close(latents_and_velocity(model, family), before, rtol=0, atol=0)
        with model.adapter_disabled():
            base = latents_and_velocity(model, family)
    assert (base - before).abs().max() > 1e-4  # the reference is neither adapter
    torch.testing.assert_close(latents_and_velocity(model, family), moved, rtol=0, atol=0)  # back to default
    assert flags(model) == now  # switching and the reference moved no requires_grad flag

    # soft update by hand: old <- 0.3·old + 0.7·default, element by element
    expected = {
        n.replace(".default.", ".old."): 0.3 * old[n.replace(".default.", ".old.")].detach() + 0.7 * p.detach()
        for n, p in default.items()
    }
    model.soft_update_adapter("old", "default", 0.3)
    for n, p in model.adapter_parameters("old").items():
        torch.testing.assert_close(p.detach(), expected[n], rtol=1e-6, atol=1e-7)
    model.soft_update_adapter("old", "default", 0.0)  # the hard copy
    with model.using_adapter("old"):
        torch.testing.assert_close(latents_and_velocity(model, family), moved, rtol=0, atol=0)
    with pytest.raises(KeyError, match="adapter 'new' does not exist"):
        with model.using_adapter("new"):
            pass
    with pytest.raises(ValueError, match="decay=1.5"):
        model.soft_update_adapter("old", "default", 1.5)


@pytest.mark.parametrize("family", FAMILIES)
def test_trained_adapter_beside_an_old_one_exports_for_load_lora_weights(tiny_model, tiny_pipeline, family, tmp_path):
    model = tiny_model(family)
    model.add_lora(rank=4, alpha=8, init_lora_weights=False)
    model.copy_adapter("default", "old")
    with torch.no_grad():
        for p in model.adapter_parameters("old").values():
            p.mul_(-3.0)  # the old adapter differs: an export that read it would not match
    sampler = ode(family, 3, 2.0, decode=False)
    expected = sampler(model, batch(PROMPTS[:1], SEEDS[:1])).latents[:, -1]
    named = {n: p.detach() for n, p in model.transformer.named_parameters() if p.requires_grad}
    assert named and not any(".old." in n for n in named)
    model.save_lora(tmp_path / "lora", named)
    pipe = DiffusionPipeline.from_pretrained(tiny_pipeline(family))
    pipe.load_lora_weights(str(tmp_path / "lora"))
    after = pipeline_call(pipe, family, PROMPTS[:1], SEEDS[:1], 3, 2.0, "latent")
    torch.testing.assert_close(after, expected, rtol=0, atol=1e-4)
