"""The rollout drift monitor (flowrl.trainers.drift.RolloutDrift, docs/math.md#rollout-drift) and the lossless/lossy
declarations of the samplers (Sampler.lossy(), the matrix's `rollouts` mark, kit.lossy_rollout_error).

The drift is measured at the first optimizer step after each rollout: GRPO's first pass hands its log-probs over (0
exactly on-policy; > 0 on a preview pool), the velocity-based recipes (NFT here) run two rows at one step again
(against a hand computation of ||v_rollout − v|| / ||v||; 0 exactly where those rows are the rollout's whole batch).
The monitor changes no weight and draws no random number; a ratio-based recipe refuses lossy trained transitions
before any model loads, with one line naming the option and the fix."""

import pytest
import torch
from dotted import set_dotted

import flowrl.trainers.kit as kit
from flowrl.config import ComponentConfig
from flowrl.registry import SAMPLERS
from flowrl.schedules import trainable_steps
from flowrl.trainers import build_config, build_trainer, compose, trainer_class
from flowrl.trainers.transitions import transition_inputs
from flowrl.types import LOSSES

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two red circles", "one blue square"]


def toy_config(tmp_path, trainer="grpo", **overrides):
    """One toy step of `trainer`: 2 prompts x group 2, 4 steps, learning rate 0 (the drift is a property of the
    rollout, not of the update)."""
    data = {
        "name": "drift",
        "trainer": trainer,
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 2,
        "seed": 2,
        "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": PROMPTS, "num_prompts_per_step": 2, "group_size": 2},
        "sampler": {"name": "sde", "num_steps": 4, "guidance_scale": 1.0, "noise_level": 0.8},
        "rewards": [{"name": "toy_attributes"}],
        "balancer": {"name": "weighted_sum", "std": "group"},
        "train": {"learning_rate": 0.0, "use_async_rewards": False, "use_ema": False},
        "eval": {"num_steps": 1, "seeds": [0], "num_prompts": 1},
        "checkpoint": {"every_n_steps": 0, "keep_last": 1},
        "logging": {"trackers": [], "progress_bar": False},
    }
    if trainer == "grpo":
        data["train"] |= {"clip_range": 1e-2, "max_grad_norm": 1e9}
    if trainer == "nft":
        data["sampler"] = {"name": "ode", "num_steps": 4, "guidance_scale": 1.0}
    set_dotted(data, overrides)
    return build_config(data)


def preview_sampler(backend="fake_fp8", train_on="previews", full="sde", **kwargs):
    """A candidates pool of 3 per group of 2 whose selection is trained on (or regenerated, train_on=full)."""
    spec = {"name": full, "noise_level": 0.8} if full == "sde" else {"name": full}
    sampler = {"name": "candidates", "pool_size": 3, "num_steps": 4, "guidance_scale": 1.0}
    return {"sampler": sampler | {"preview_backend": backend, "train_on": train_on, "full": spec} | kwargs}


def randomize(trainer, adapter="default", seed=0, std=0.05):
    """LoRA B of `adapter` drawn at random (0 at the start: every adapter equals the base)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.parts.model.transformer.named_parameters():
            if "lora_B" in name and f".{adapter}." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


# ------------------------------------------------------------------------------------------ the drift


def test_on_policy_log_prob_drift_is_exactly_zero(tmp_path):
    """GRPO's first pass rescores its transitions with the weights that rolled them out: |Δ log p| = 0 exactly."""
    trainer = build_trainer(toy_config(tmp_path, **{"train.kl_coef": 0.1}))
    randomize(trainer)
    metrics = trainer.train_step()
    assert metrics["train/ratio_min"] == 1.0 and metrics["train/ratio_max"] == 1.0
    assert metrics["drift/logprob_abs_mean"] == 0.0 and metrics["drift/logprob_abs_max"] == 0.0
    assert metrics["drift/logprob_beyond"] == 0.0 and "drift/velocity_rel" not in metrics


def test_a_regenerated_candidate_pool_is_on_policy(tmp_path):
    """Sol-RL's previews rank seeds only; the trained rollout is the SDE's at full precision: drift 0 exactly."""
    trainer = build_trainer(toy_config(tmp_path, **preview_sampler(train_on="full")))
    randomize(trainer)
    metrics = trainer.train_step()
    assert metrics["drift/logprob_abs_max"] == 0.0


def test_a_preview_pool_drifts_and_ais_still_takes_a_first_ratio_of_one(tmp_path):
    """Fake-FP8 previews trained on (with AIS, so GRPO accepts them): their log-probs are not the policy's."""
    trainer = build_trainer(toy_config(tmp_path, **preview_sampler(), **{"train.ais.enabled": True}))
    randomize(trainer)
    metrics = trainer.train_step()
    assert metrics["train/ratio_min"] == 1.0 and metrics["train/ratio_max"] == 1.0  # AIS: against the policy
    assert metrics["drift/logprob_abs_mean"] > 1e-5 and metrics["drift/logprob_beyond"] > 0  # on-policy: 0
    assert metrics["drift/logprob_abs_max"] >= metrics["drift/logprob_abs_mean"]


def test_velocity_drift_equals_a_hand_computation(tmp_path):
    """NFT rolls out with θ_old: made different from θ here, the step's drift is ||v_old − v_θ|| / ||v_θ|| of the
    first two rows at the middle trained step, computed here from the two adapters' velocities."""
    trainer = build_trainer(toy_config(tmp_path, "nft"))
    randomize(trainer, "old", seed=1)
    parts = trainer.parts
    exp = kit.collect(parts, adapter="old")
    got = parts.drift.metrics()
    model, rollout = parts.model, exp.rollout
    steps = trainable_steps(model, rollout.sigmas).nonzero().flatten().tolist()
    k = steps[len(steps) // 2]
    index, ks = torch.arange(2), torch.full((2,), k)
    cond, x, *_ = transition_inputs(rollout, rollout.sigmas, index, ks)
    with torch.no_grad():
        with model.using_adapter("old"):
            v_old = model.velocity(x, rollout.sigmas[k], cond, 1.0)
        v = model.velocity(x, rollout.sigmas[k], cond, 1.0)
    expected = ((v_old - v).flatten(1).norm(dim=1) / v.flatten(1).norm(dim=1)).double()
    assert expected.min() > 1e-3  # the adapters differ
    assert got["drift/velocity_rel"] == pytest.approx(float(expected.mean()), rel=1e-4)
    assert got["drift/velocity_rel_max"] == pytest.approx(float(expected.max()), rel=1e-4)
    assert "drift/logprob_abs_mean" not in got  # ODE rollouts: deterministic transitions only


def test_on_policy_velocity_drift_is_exactly_zero_where_the_rows_are_the_rollout_batch(tmp_path):
    """One prompt x group 2: the two drift rows are the rollout's whole batch, the same forward again."""
    cfg = toy_config(tmp_path, "nft", **{"data.prompts": PROMPTS[:1], "data.num_prompts_per_step": 1})
    metrics = build_trainer(cfg).train_step()
    assert metrics["drift/velocity_rel"] == 0.0 and metrics["drift/velocity_rel_max"] == 0.0


def test_an_nft_preview_pool_drifts(tmp_path):
    """NFT trains on the ODE previews of a fake-FP8 copy (no ratio, so accepted): the velocities differ."""
    metrics = build_trainer(toy_config(tmp_path, "nft", **preview_sampler(full="ode"))).train_step()
    assert metrics["drift/velocity_rel"] > 1e-3


def test_stochastic_rollouts_give_a_velocity_recipe_log_prob_drift(tmp_path):
    """NFT on SDE rollouts: the measured transitions are stochastic, so the drift is |Δ log p| (0 on-policy up to the
    float rounding of a 2-row batch; a different θ_old moves it)."""
    sde = {"sampler": {"name": "sde", "num_steps": 4, "guidance_scale": 1.0, "noise_level": 0.8}}
    trainer = build_trainer(toy_config(tmp_path, "nft", **sde))
    kit.collect(trainer.parts, adapter="old")
    same = trainer.parts.drift.metrics()
    randomize(trainer, "old", seed=1)
    kit.collect(trainer.parts, adapter="old")
    moved = trainer.parts.drift.metrics()
    assert same["drift/logprob_abs_max"] < 1e-6 and moved["drift/logprob_abs_mean"] > 1e-4
    assert moved["drift/logprob_beyond"] == 1.0  # every moved transition beyond DRIFT_LOG_PROB_LIMIT = 1e-4
    assert "drift/velocity_rel" not in moved


def test_asynchronous_nft_rollouts_are_measured_on_the_live_model(tmp_path):
    """train.async_rollout: the batch comes from a worker thread's transformer copy; its drift is measured when the
    step takes it, on the live model. Forced to staleness 0 it is the synchronous run's drift; one step stale (decay
    type 0: θ_old is θ after each step) the batch of θ one step back drifts from the θ it trains."""
    base = {"train.learning_rate": 1e-2, "train.decay_type": 0}
    sync = build_trainer(toy_config(tmp_path / "sync", "nft", **base))
    forced_base = base | {"train.async_rollout": True, "train.async_staleness": 0}
    forced = build_trainer(toy_config(tmp_path / "forced", "nft", **forced_base))
    stale = build_trainer(toy_config(tmp_path / "stale", "nft", **base, **{"train.async_rollout": True}))
    try:
        for step in range(2):
            m_sync, m_forced, m_stale = sync.train_step(), forced.train_step(), stale.train_step()
            drift = {k: v for k, v in m_sync.items() if k.startswith("drift/")}
            assert drift and drift == {k: v for k, v in m_forced.items() if k.startswith("drift/")}, step
            assert m_stale["train/staleness"] == step
        assert m_stale["drift/velocity_rel"] > 1e3 * m_sync["drift/velocity_rel"]
    finally:
        for trainer in (forced, stale):
            trainer.ahead.close()


def test_adjoint_matching_logs_the_drift_of_its_own_rollout(tmp_path):
    """Adjoint matching rolls out itself (the memoryless SDE of the current weights, every transition stochastic):
    its step logs |Δ log p| of two rows, 0 up to the float rounding of a 2-row batch."""
    from test_adjoint import am_config

    metrics = build_trainer(am_config(tmp_path, **{"train.learning_rate": 0.0})).train_step()
    assert 0 <= metrics["drift/logprob_abs_max"] < 1e-5 and "drift/velocity_rel" not in metrics


def test_the_monitor_changes_no_weight_and_draws_no_random_number(tmp_path, monkeypatch):
    """Two NFT steps (the velocity path's extra forward) and two GRPO steps with the monitor and without it give the
    same weights bit for bit; the extra forward leaves torch's random state as it was."""
    for trainer_name in ("nft", "grpo"):
        weights = {}
        for on in (True, False):
            with monkeypatch.context() as patch:
                if not on:
                    patch.setattr(kit, "start_drift", lambda parts, rollout: None)
                    patch.setattr(kit, "rollout_drift", lambda *args: None)
                cfg = toy_config(tmp_path / f"{trainer_name}{on}", trainer_name, **{"train.learning_rate": 1e-2})
                trainer = build_trainer(cfg)
                for _ in range(2):
                    metrics = trainer.train_step()
                assert any(key.startswith("drift/") for key in metrics) == on, trainer_name
                weights[on] = {n: p.detach().clone() for n, p in trainer.parts.model.transformer.named_parameters()}
        assert all(torch.equal(weights[True][n], weights[False][n]) for n in weights[True]), trainer_name
    trainer = build_trainer(toy_config(tmp_path / "rng", "nft"))
    exp = kit.collect(trainer.parts, adapter="old")
    state = torch.get_rng_state()
    kit.start_drift(trainer.parts, exp.rollout)
    assert torch.equal(state, torch.get_rng_state()) and trainer.parts.drift.velocity


# ------------------------------------------------------------------------------------------ lossless and lossy


def lossy(**kwargs):
    return SAMPLERS.get(kwargs.pop("name"))(**kwargs).lossy()


def test_every_sampler_declares_its_lossy_options():
    assert lossy(name="ode") == lossy(name="sde") == lossy(name="tree", split_steps=[0], branching=2) == ()
    full = {"name": "sde"}
    default = lossy(name="candidates", full=full)  # fake_nvfp4 + 6 of 10 steps: previews that only rank seeds
    assert [(o.loss, o.trained) for o in default] == [("precision", False), ("steps", False)]
    assert default[0].option == "sampler.preview_backend=fake_nvfp4"
    assert default[1].option == "sampler.preview_backend=few_step (preview_num_steps=6 of num_steps=10)"
    trained = lossy(name="candidates", full=full, train_on="previews", preview_backend="fake_fp8")
    assert [(o.option, o.loss, o.trained) for o in trained] == [
        ("sampler.preview_backend=fake_fp8 with sampler.train_on=previews", "precision", True)
    ]
    assert lossy(name="candidates", full=full, preview_backend="full") == ()  # naive scaling: the pool itself
    assert [o.loss for o in lossy(name="candidates", full=full, preview_backend="cached")] == ["cache"]
    as_many = lossy(name="candidates", full=full, preview_backend="few_step", preview_num_steps=10)
    assert as_many == ()  # as many preview steps as num_steps: the full sampler's own grid
    for option in default + trained:
        assert option.loss in LOSSES and option.fix.startswith("set sampler.train_on=full")


def test_a_ratio_based_recipe_refuses_lossy_trained_transitions_before_any_model(tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a refused config got as far as building the model")

    monkeypatch.setattr(kit, "build_policy", no_model)
    for trainer in ("grpo", "adv_grpo"):
        with pytest.raises(ValueError) as err:
            build_trainer(toy_config(tmp_path, trainer, **preview_sampler()))
        why = str(err.value)
        assert "\n" not in why and why.startswith(f"trainer: {trainer} takes its ratio to the behaviour log-probs")
        assert "sampler.preview_backend=fake_fp8 with sampler.train_on=previews" in why
        assert "set sampler.train_on=full" in why and "train.ais.enabled=true" in why
    # what it accepts: AIS's ratio to the policy, few-step previews (the policy's own transitions), a regenerated
    # selection, and any lossy rollout for a recipe without a ratio (it gets as far as the model)
    for trainer, overrides in (
        ("grpo", preview_sampler() | {"train.ais.enabled": True}),
        ("grpo", preview_sampler("few_step", preview_num_steps=3)),
        ("grpo", preview_sampler(train_on="full")),
        ("nft", preview_sampler(full="ode")),
    ):
        with pytest.raises(AssertionError, match="got as far as building the model"):
            build_trainer(toy_config(tmp_path, trainer, **overrides))


def test_the_matrix_marks_each_sampler_and_refuses_with_the_kits_line():
    rows = compose.matrix()
    marks = {r["sampler"]: r["rollout"] for r in rows}
    assert marks["sde"] == marks["ode"] == marks["tree"] == marks["sde(memoryless)"] == "lossless"
    assert marks["candidates(full=sde)"] == "lossless (previews: precision, steps)"
    assert marks["candidates(train_on=previews)"] == "lossy (precision)"
    assert marks["candidates(full=tree)"] == ""  # the sampler refuses its own arguments

    def row(sampler, trainer, balancer="weighted_sum"):
        return next(r for r in rows if (r["sampler"], r["trainer"], r["balancer"]) == (sampler, trainer, balancer))

    spec = dict(compose.variants(SAMPLERS))["candidates(train_on=previews)"]
    for trainer in ("grpo", "grpo(guard)", "adv_grpo"):
        refused = row("candidates(train_on=previews)", trainer)
        assert not refused["works"] and "draws with a lossy copy of the policy" in refused["why"]
    assert row("candidates(train_on=previews)", "grpo")["why"] == kit.lossy_rollout_error(trainer_class("grpo"), spec)
    assert row("candidates(train_on=previews)", "nft")["works"] and row("candidates(full=sde)", "grpo")["works"]
    table = compose.format_table(rows)
    assert table.splitlines()[0].startswith("| sampler | rollouts | trainer |")
    assert "| candidates(train_on=previews) | lossy (precision) | nft |" in table


def test_a_sampler_without_the_declaration_is_named():
    class Bare:  # a sampler from outside the tree that declares its carries but not its lossy options
        def __init__(self, **kwargs):
            pass

        def carries(self):
            return frozenset({"clean_endpoints", "log_probs"})

    SAMPLERS._entries["bare_for_test"] = Bare
    try:
        why = compose.composition_error("grpo", ComponentConfig("bare_for_test"), ComponentConfig("gdpo"))
        mark = compose.rollout_mark(ComponentConfig("bare_for_test"))
    finally:
        del SAMPLERS._entries["bare_for_test"]
    assert why.startswith("sampler 'bare_for_test' declares no lossy(): add one") and mark == ""
