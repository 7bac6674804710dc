"""Training on previews (sampler candidates, train_on: previews) and GRPO's adaptive importance sampling (train.ais):
the mixture's coefficients against a hand computation, the preview rollout against the SDE sampler run with the
preview model, and AIS on the toy model: the plain gradient where preview and policy agree, a first-pass ratio of
exactly 1 where they do not."""

import math

import pytest
import torch
from test_grpo_precision_and_batching import captured_gradients, randomize_adapter, toy_config

from flowrl.losses import ais_mixture
from flowrl.models import load_flow_model
from flowrl.quant import build_preview
from flowrl.registry import SAMPLERS
from flowrl.samplers.candidates import previewing
from flowrl.samplers.sde import SDESampler
from flowrl.trainers.grpo import GRPOTrainer
from flowrl.types import PromptBatch

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


def test_mixture_coefficients_by_hand():
    log_w = [0.0, math.log(2.0), math.log(0.5), math.log(8.0)]
    w = [math.exp(x) for x in log_w]  # 1, 2, 0.5, 8
    n = len(w)
    mean = sum(w) / n  # 2.875
    ess = sum(w) ** 2 / (n * sum(x * x for x in w))
    kl = sum(x - 1 - math.log(x) for x in w) / n
    tilde = [min(x / mean, 2.0) for x in w]  # 8 / 2.875 = 2.78 truncated at 2
    m1 = sum(tilde) / n
    var = sum(t * t for t in tilde) / n - m1 * m1
    lam = ess * math.exp(-kl) / (1 + var)
    coef, stats = ais_mixture(torch.tensor(log_w, dtype=torch.float64), max_weight=2.0)
    assert coef.tolist() == pytest.approx([(1 - lam) + lam * t for t in tilde], rel=1e-6)
    assert stats["ais/lambda"] == pytest.approx(lam, rel=1e-9) and 0 < lam < 1
    assert stats["ais/ess"] == pytest.approx(ess) and stats["ais/kl"] == pytest.approx(kl)
    assert stats["ais/weight_var"] == pytest.approx(var) and stats["ais/weight_max"] == pytest.approx(8.0)
    # equal weights: λ = 1 and every coefficient 1 (the plain gradient), whatever their common value
    coef, stats = ais_mixture(torch.zeros(5), max_weight=5.0)
    assert torch.equal(coef, torch.ones(5)) and stats["ais/lambda"] == 1.0
    coef, _ = ais_mixture(torch.full((3,), 0.3), max_weight=5.0)  # self-normalised: w / mean(w) = 1
    torch.testing.assert_close(coef, torch.ones(3), rtol=0, atol=1e-6)


def test_previews_rollout_is_the_sde_run_of_the_preview_model():
    toy = load_flow_model("toy")
    prompts = ["two red circles"] * 2 + ["one blue square"] * 2
    batch = PromptBatch(prompts, torch.tensor([0, 0, 1, 1]), seeds=torch.arange(100, 104))
    full = {"name": "sde", "noise_level": 0.7}
    sampler = SAMPLERS.get("candidates")(
        pool_size=4, num_steps=3, guidance_scale=1.0, preview_backend="fake_fp8", train_on="previews", full=full
    )

    def brightness(images, prompts, metadata):
        return images.float().flatten(1).mean(dim=1)

    rollout = sampler(toy, batch, score_fn=brightness)
    preview = build_preview(toy.transformer, sampler.spec, toy.family)
    sde = SDESampler(num_steps=3, guidance_scale=1.0, noise_level=0.7)
    extras = rollout.extras
    for rows in ([0, 1], [2, 3]):  # each group's pool run whole (activation scales are per call), then its selection
        pool = extras["pool_seeds"][rows[0]]
        pool_batch = PromptBatch([prompts[rows[0]]] * 4, torch.zeros(4, dtype=torch.int64), seeds=pool)
        with previewing(toy, preview):
            direct = sde(toy, pool_batch)
        plain = sde(toy, pool_batch)
        picked = extras["pool_index"][rows]
        assert torch.equal(extras["seeds"][rows], pool[picked])
        torch.testing.assert_close(rollout.latents[rows], direct.latents[picked], rtol=0, atol=1e-6)
        torch.testing.assert_close(rollout.log_probs[rows], direct.log_probs[picked], rtol=0, atol=1e-5)
        assert (
            rollout.latents[rows] - plain.latents[picked]
        ).abs().max() > 1e-3  # the preview drew them, not the policy
    for backend in ("full", "few_step+cached"):
        with pytest.raises(ValueError, match="training on previews needs a preview model"):
            SAMPLERS.get("candidates")(preview_backend=backend, train_on="previews", full=full)
    with pytest.raises(ValueError, match="sampler.train_on='both' must be"):
        SAMPLERS.get("candidates")(train_on="both", full=full)


def preview_config(tmp_path, backend, ais):
    return toy_config(
        tmp_path,
        **{
            "sampler": {
                "name": "candidates",
                "pool_size": 3,
                "selection": "best_worst",
                "num_steps": 4,
                "preview_num_steps": 3,
                "guidance_scale": 1.0,
                "preview_backend": backend,
                "train_on": "previews",
                "full": {"name": "sde", "noise_level": 0.8},
            },
            "train.ais.enabled": ais,
            "train.learning_rate": 1e-3,
        },
    )


def test_ais_is_the_plain_gradient_where_preview_and_policy_agree(tmp_path):
    """few_step previews run the policy itself: every importance weight is 1, so AIS changes nothing."""
    grads = {}
    for ais in (False, True):
        trainer = GRPOTrainer(preview_config(tmp_path / str(ais), "few_step", ais))
        randomize_adapter(trainer)
        grads[ais], metrics = captured_gradients(trainer)
    assert metrics["ais/lambda"] == pytest.approx(1.0, abs=1e-6) and metrics["ais/weight_max"] == pytest.approx(
        1.0, abs=1e-5
    )
    assert metrics["train/ratio_min"] == 1.0 and metrics["train/ratio_max"] == 1.0
    for name in grads[False]:
        torch.testing.assert_close(grads[True][name], grads[False][name], rtol=1e-5, atol=1e-9)
    assert any(g.abs().max() > 0 for g in grads[True].values())


def test_ais_on_quantized_previews_takes_the_ratio_against_the_policy(tmp_path):
    """fake FP8 previews: the behaviour log-probs are the preview's, the weights differ from 1, λ < 1; with AIS the
    first-pass ratio is exactly 1 (the policy at rollout time); without it the ratio would be the raw importance
    weight, and the config is refused (flowrl.trainers.kit.lossy_rollout_error, tests/trainers/test_drift.py)."""
    trainer = GRPOTrainer(preview_config(tmp_path / "ais", "fake_fp8", True))
    randomize_adapter(trainer)
    _, with_ais = captured_gradients(trainer)
    assert with_ais["train/ratio_min"] == 1.0 and with_ais["train/ratio_max"] == 1.0
    assert 0 < with_ais["ais/lambda"] < 1 and with_ais["ais/kl"] > 0 and with_ais["ais/weight_max"] != 1.0
    with pytest.raises(ValueError, match="fake_fp8 with sampler.train_on=previews draws with a lossy copy"):
        GRPOTrainer(preview_config(tmp_path / "plain", "fake_fp8", False))
    with pytest.raises(ValueError, match="train.ais.max_weight=0.5 must be >= 1"):
        toy_config(tmp_path, **{"train.ais.max_weight": 0.5})
