"""The candidates sampler (Sol-RL / CachedSearch pools) and its preview models: exact regeneration, selection by
the preview's scores, previews that differ from the policy yet follow it, cache hooks that skip work."""

from pathlib import Path

import pytest
import torch

from flowrl.models import load_flow_model
from flowrl.quant import PreviewSpec, build_preview, fake_quant_nvfp4, merged_copy
from flowrl.ranking import select_indices
from flowrl.registry import SAMPLERS
from flowrl.samplers.candidates import candidate_metrics, previewing
from flowrl.samplers.ode import ODESampler
from flowrl.samplers.sde import SDESampler
from flowrl.trainers import load_config
from flowrl.training.prompts import step_batches
from flowrl.types import PromptBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def brightness(images, prompts, metadata):
    return images.float().flatten(1).mean(dim=1)


@pytest.fixture(scope="module")
def toy():
    return load_flow_model("toy")


def groups_batch(group_size=2):
    prompts = ["two red circles"] * group_size + ["one blue square"] * group_size
    ids = torch.tensor([0] * group_size + [1] * group_size)
    return PromptBatch(prompts, ids, seeds=torch.arange(100, 100 + 2 * group_size))


def candidates(**kwargs):
    base = {"pool_size": 4, "num_steps": 3, "preview_num_steps": 2, "guidance_scale": 1.0}
    return SAMPLERS.get("candidates")(**{**base, **kwargs})


@pytest.mark.parametrize("full", [{"name": "ode"}, {"name": "sde", "noise_level": 0.7}])
def test_regenerated_samples_equal_a_full_precision_rollout_of_the_same_seeds(toy, full):
    batch = groups_batch()
    rollout = candidates(full=full)(toy, batch, score_fn=brightness)
    seeds = rollout.extras["seeds"]
    cls = ODESampler if full["name"] == "ode" else SDESampler
    kwargs = {k: v for k, v in full.items() if k != "name"}
    direct = cls(num_steps=3, guidance_scale=1.0, **kwargs)(
        toy, PromptBatch(batch.prompts, batch.group_ids, seeds=seeds)
    )
    assert torch.equal(rollout.latents, direct.latents)
    assert torch.equal(rollout.images, direct.images)
    assert torch.equal(rollout.log_probs, direct.log_probs) and torch.equal(rollout.transitions, direct.transitions)
    # the full scores are the score_fn of those images
    assert torch.equal(rollout.extras["full_scores"], brightness(direct.images, None, None))


def test_the_rows_are_the_pools_selection_by_preview_score(toy):
    batch = groups_batch(group_size=2)
    rollout = candidates(pool_size=5, selection="best_worst")(toy, batch, score_fn=brightness)
    ex = rollout.extras
    for rows in ([0, 1], [2, 3]):
        pool_scores, pool_seeds = ex["pool_preview_scores"][rows[0]], ex["pool_seeds"][rows[0]]
        chosen = select_indices(pool_scores, 2, "best_worst")
        assert ex["pool_index"][rows].tolist() == chosen
        assert chosen == sorted([int(pool_scores.argmax()), int(pool_scores.argmin())])
        assert ex["seeds"][rows].tolist() == pool_seeds[chosen].tolist()
        assert torch.equal(ex["preview_scores"][rows], pool_scores[chosen])
    assert len(set(ex["pool_seeds"][0].tolist()) & set(ex["pool_seeds"][2].tolist())) == 0  # one pool per group


def test_previews_batched_across_pools_change_no_sample(toy):
    """preview_batch_size only changes how many rows a preview forward takes: one row, a chunk that splits a pool
    and every pool at once give the pools' ODE previews (each checked against an ODE run of its own seeds) and
    the same selection and regenerated rollout."""
    batch = groups_batch(group_size=2)
    runs = {
        size: candidates(preview_backend="few_step", preview_batch_size=size)(toy, batch, score_fn=brightness)
        for size in (None, 1, 3, 8)
    }
    reference = runs[None]
    pool_seeds = reference.extras["pool_seeds"][[0, 2]].flatten()  # [2 * P] pool 0's seeds, then pool 1's
    prompts = ["two red circles"] * 4 + ["one blue square"] * 4
    direct = ODESampler(num_steps=2, guidance_scale=1.0)(toy, PromptBatch(prompts, torch.arange(8), seeds=pool_seeds))
    expected = brightness(direct.images, None, None)
    for size, rollout in runs.items():
        scores = rollout.extras["pool_preview_scores"][[0, 2]].flatten()
        torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6, msg=f"preview_batch_size={size}")
        assert torch.equal(rollout.extras["pool_index"], reference.extras["pool_index"])
        assert torch.equal(rollout.images, reference.images) and torch.equal(rollout.latents, reference.latents)
    with pytest.raises(ValueError, match="preview_batch_size=0 must be >= 1"):
        candidates(preview_batch_size=0)


def test_preview_scores_come_from_a_preview_that_is_not_the_full_rollout(toy):
    """With a preview identical to the full rollout (no backend, same steps) the preview scores are the full ones;
    with NVFP4 and fewer steps they differ."""
    batch = groups_batch()
    same = candidates(preview_backend=[], preview_num_steps=3)(toy, batch, score_fn=brightness)
    torch.testing.assert_close(same.extras["preview_scores"], same.extras["full_scores"], rtol=0, atol=1e-5)
    cheap = candidates(preview_backend="fake_nvfp4+few_step")(toy, batch, score_fn=brightness)
    assert not torch.allclose(cheap.extras["preview_scores"], cheap.extras["full_scores"], atol=1e-5)
    metrics = candidate_metrics(cheap)
    assert set(metrics) >= {"candidates/spearman", "candidates/kendall", "candidates/preview_share"}
    assert 0 < metrics["candidates/preview_share"] < 1


def lora_toy():
    torch.manual_seed(0)
    model = load_flow_model("toy")
    model.add_lora(rank=4, alpha=4)
    with torch.no_grad():  # a trained-looking adapter (peft starts B at 0)
        for name, p in model.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def velocity_of(model, preview=None):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    cond = model.encode(["two red circles", "one blue square"])
    with torch.no_grad(), previewing(model, preview) if preview is not None else torch.no_grad():
        return model.velocity(x, torch.tensor(0.6), cond)


def test_merged_copy_computes_the_policy_and_the_preview_differs_from_it():
    model = lora_toy()
    policy = velocity_of(model)
    torch.testing.assert_close(velocity_of(model, merged_copy(model.transformer)), policy, rtol=0, atol=1e-5)
    quantized = velocity_of(model, build_preview(model.transformer, PreviewSpec(["fake_nvfp4"])))
    assert not torch.allclose(quantized, policy, atol=1e-4)
    assert (quantized - policy).abs().mean() < 0.1 * policy.abs().mean()  # close, not equal


def test_the_preview_follows_the_policy_after_an_optimizer_step():
    model = lora_toy()
    spec = PreviewSpec(["fake_nvfp4"])
    before = velocity_of(model, build_preview(model.transformer, spec))
    params = [p for p in model.transformer.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.5)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    loss = model.velocity(x, torch.tensor(0.5), model.encode(["two red circles"] * 2)).square().mean()
    loss.backward()
    opt.step()
    preview = build_preview(model.transformer, spec)
    assert not torch.allclose(velocity_of(model, preview), before, atol=1e-4)
    # a quantized layer holds NVFP4(W + s·B·A) of the new weights, the merge written out by hand
    name = "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"
    layer = model.transformer.get_submodule(name)
    merged = (
        layer.base_layer.weight
        + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    )
    assert torch.equal(preview.get_submodule(name).weight, fake_quant_nvfp4(merged.detach()))


def test_layer_selection_skips_by_name_and_size():
    model = lora_toy()
    everything = build_preview(model.transformer, PreviewSpec(["fake_fp8"], skip=()))
    fewer = build_preview(model.transformer, PreviewSpec(["fake_fp8"], skip=("attn2",), min_features=64))
    count = lambda m: sum(type(x).__name__ == "FakeQuantLinear" for x in m.modules())  # noqa: E731
    assert count(everything) > count(fewer) > 0
    assert all("attn2" not in n for n, x in fewer.named_modules() if type(x).__name__ == "FakeQuantLinear")


def test_int8_backend_runs_and_hardware_backends_name_what_they_need():
    model = lora_toy()
    int8 = build_preview(model.transformer, PreviewSpec(["int8"]))
    assert any("quantized" in type(m).__module__ for m in int8.modules())
    torch.testing.assert_close(velocity_of(model, int8), velocity_of(model), rtol=0, atol=0.1)
    with pytest.raises(
        ValueError, match=r"'nvfp4' needs torchao kernels on an sm_100\+ GPU; this run has the CPU: use auto"
    ):
        build_preview(model.transformer, PreviewSpec(["nvfp4"]))
    with pytest.raises(ValueError, match=r"'fp8' needs torchao kernels on an sm_89\+ GPU"):
        build_preview(model.transformer, PreviewSpec(["fp8"]))
    with pytest.raises(ValueError, match="combines fake_fp8 and int8"):
        PreviewSpec(["fake_fp8", "int8"])


def count_block_calls(module):
    """Attention forwards inside the transformer blocks (a skipped block's hook returns its cache, its layers stay
    idle)."""
    calls = []
    for name, block in module.named_modules():
        if name.startswith(("transformer_blocks.", "single_transformer_blocks.")) and name.endswith(".attn"):
            block.register_forward_pre_hook(lambda *_, n=name: calls.append(n))
    return calls


def test_the_cache_backend_skips_transformer_blocks(tiny_model):
    model = tiny_model("flux")
    sampler = candidates(
        pool_size=2, num_steps=4, preview_backend="cached", preview_cache={"type": "first_block", "threshold": 1e9}
    )
    batch = PromptBatch(["a cat", "a cat"], torch.tensor([0, 0]), seeds=torch.tensor([1, 2]))
    counts = {}
    for name, spec in (("full", PreviewSpec([])), ("cached", sampler.spec)):
        preview = build_preview(model.transformer, spec, model.family)
        calls = count_block_calls(preview)
        size = (32, 32, None)
        latents = model.prepare_latents(2, 32, 32, torch.Generator().manual_seed(0))
        cond = model.encode(batch.prompts, "", 1.0)
        with previewing(model, preview):
            sampler._preview(model, latents, cond, 1.0, size)
        counts[name] = len(calls)
    blocks = counts["full"] // 4  # every block once per step without the cache
    assert counts["full"] == 4 * blocks and blocks >= 2
    assert counts["cached"] == blocks + 3  # step 0 runs every block; later steps only the first block
    rollout = sampler(model, batch, score_fn=brightness)  # the whole sampler runs with the cache
    assert rollout.latents.shape[1] == 5


@pytest.mark.parametrize("family", ["toy", "sd3"])
def test_the_cache_backend_refuses_a_family_without_hooks(family, tiny_model):
    model = load_flow_model("toy") if family == "toy" else tiny_model(family)
    with pytest.raises(ValueError, match=f"'cached' needs diffusers cache hooks; the {family} transformer"):
        build_preview(model.transformer, PreviewSpec(["cached"]), model.family)


def test_bad_settings_are_one_line_errors(toy):
    with pytest.raises(ValueError, match="score_fn"):
        candidates()(toy, groups_batch())
    with pytest.raises(ValueError, match="set sampler.pool_size >= data.group_size"):
        candidates(pool_size=1)(toy, groups_batch(), score_fn=brightness)
    with pytest.raises(ValueError, match="sampler.full.name='tree'"):
        candidates(full={"name": "tree"})
    with pytest.raises(ValueError, match="sampler.full.num_steps: set num_steps on the candidates sampler"):
        candidates(full={"name": "ode", "num_steps": 4})
    with pytest.raises(ValueError, match="preview_backend='fp4' is not one of"):
        candidates(preview_backend="fp4")


def test_naive_scaling_keeps_the_full_precision_pool_samples(toy):
    batch = groups_batch()
    rollout = candidates(preview_backend="full", full={"name": "sde", "noise_level": 0.7})(
        toy, batch, score_fn=brightness
    )
    seeds = rollout.extras["seeds"]
    direct = SDESampler(num_steps=3, guidance_scale=1.0, noise_level=0.7)(
        toy, PromptBatch(batch.prompts, batch.group_ids, seeds=seeds)
    )
    torch.testing.assert_close(rollout.latents, direct.latents, rtol=0, atol=1e-5)  # the pool ran at another batch size
    torch.testing.assert_close(rollout.log_probs, direct.log_probs, rtol=0, atol=1e-4)
    assert torch.equal(rollout.transitions, direct.transitions) and rollout.prompts == batch.prompts
    # its ranking scores are the full-precision scores of the kept samples
    torch.testing.assert_close(rollout.extras["preview_scores"], rollout.extras["full_scores"], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="'full' \\(naive scaling\\) combines with nothing"):
        candidates(preview_backend="full+int8")


def test_rollout_chunks_that_split_a_group_are_refused():
    overrides = ["train.num_rollout_batches=16"]  # 64 samples: chunks of 4 split groups of 8
    cfg = load_config(Path(__file__).parents[2] / "configs" / "toy" / "solrl.yaml", overrides)
    with pytest.raises(
        ValueError, match="chunks of 4 samples, which splits a prompt group of 8 .*divisor of the 8 groups"
    ):
        step_batches(cfg, SAMPLERS.get("candidates")(**cfg.sampler.kwargs), num_processes=1)
