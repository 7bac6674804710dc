"""DGPO (docs/recipes/dgpo.md) against numbers computed independently: the loss and its gradient by hand in float64 on a
tiny case of two groups (and the gradient against (G/(β·n))·∇Σ_g −log σ(−S_g) by autograd), the clip's truth table, a
group split over two processes scoring as on one; then the recipe: a toy step at θ = reference (every w_g = 1/2,
ratio exactly 1) and a later on-policy step (ratio exactly 1), a resume bit for bit, 2 gloo processes = 1 with one group
spread over both, a short run of configs/toy/dgpo.yaml, and one-line errors."""

import math

import pytest
import torch
from launching import assert_same_checkpoints, one_and_two_processes, straight_and_resumed, toy_config_run
from safetensors.torch import load_file
from test_grpo_processes import write_config
from test_trainer_contract import assert_same, toy_config

from flowrl.losses import dgpo_loss, dsm_loss, group_scores
from flowrl.trainers import build_trainer
from flowrl.trainers.dgpo import group_order

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

BETA, G = 10.0, 2


def tiny_case():
    """4 samples in groups [0, 0, 1, 1] of 2x3 latents, reference losses, advantages of each sign."""
    g = torch.Generator().manual_seed(0)
    v, x0, eps = (torch.randn(4, 2, 3, generator=g, dtype=torch.float64) for _ in range(3))
    ref = torch.tensor([1.9, 2.4, 3.1, 1.2], dtype=torch.float64)
    return v, x0, eps, ref, torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64), torch.tensor([0, 0, 1, 1])


def by_hand(v, x0, eps, ref, adv, clipped=(False,) * 4):
    """Per sample in Python floats: ℓ, the loss w·A·ℓ and ∂(mean loss)/∂v (D partials), element by element."""
    rows = []
    for i in range(4):
        vi, ti = v[i].flatten().tolist(), [e - x for e, x in zip(eps[i].flatten().tolist(), x0[i].flatten().tolist())]
        d = len(vi)
        rows.append((sum((a - b) ** 2 for a, b in zip(vi, ti)) / d, [2 * (a - b) / d for a, b in zip(vi, ti)]))
    scores = []
    for members in ((0, 1), (2, 3)):
        s = sum(float(adv[i]) * BETA * (rows[i][0] - float(ref[i])) / G for i in members)
        scores += [s, s]
    weights = [1 / (1 + math.exp(-s)) for s in scores]
    losses = [w * float(a) * ell for w, a, (ell, _) in zip(weights, adv, rows)]
    grads = [
        [0.0 if c else w * float(a) / 4 * p for p in grad] for w, a, (_, grad), c in zip(weights, adv, rows, clipped)
    ]
    return [ell for ell, _ in rows], scores, weights, losses, grads


def test_loss_and_gradient_by_hand():
    v, x0, eps, ref, adv, ids = tiny_case()
    v.requires_grad_(True)
    ell = dsm_loss(v, x0, eps)
    loss, s = dgpo_loss(ell, ref, None, adv, ids, BETA, G, 0.05)
    loss.mean().backward()
    ells, scores, weights, losses, grads = by_hand(v.detach(), x0, eps, ref, adv)
    assert ell.tolist() == pytest.approx(ells, rel=1e-13)
    assert s["group_score"].tolist() == pytest.approx(scores, rel=1e-12)
    assert s["group_weight"].tolist() == pytest.approx(weights, rel=1e-12)
    assert loss.tolist() == pytest.approx(losses, rel=1e-12)
    assert v.grad.flatten(1).tolist() == [pytest.approx(row, rel=1e-10) for row in grads]
    assert torch.equal(s["ratio"], torch.ones(4, dtype=torch.float64)) and not s["clipped"].any()
    # the same gradient from the DPO form: (G / (β·n))·∇ Σ_g −log σ(−S_g), S_g = Σ_{i∈g} A_i·β·(ℓ_i − ℓ_ref,i) / G
    w = v.detach().clone().requires_grad_(True)
    delta = dsm_loss(w, x0, eps) - ref
    per_group = torch.stack([(adv * BETA * delta / G)[ids == k].sum() for k in (0, 1)])
    (G / (BETA * 4) * torch.nn.functional.softplus(per_group).sum()).backward()  # −log σ(−S) = log(1 + e^S)
    assert torch.allclose(w.grad, v.grad, rtol=1e-12, atol=0)


def test_the_clip_truth_table_and_clipped_samples_carry_no_gradient():
    v, x0, eps, ref, _, ids = tiny_case()
    adv = torch.tensor([1.0, 1.0, -1.0, 0.0], dtype=torch.float64)  # A > 0, A > 0, A < 0, A = 0 (counts as A ≤ 0)
    v.requires_grad_(True)
    ell = dsm_loss(v, x0, eps)
    shifts = torch.tensor(
        [0.2, 0.001, -0.2, -0.2], dtype=torch.float64
    )  # ρ = exp(ℓ_old − ℓ): e^0.2, e^0.001, e^-0.2, e^-0.2
    loss, s = dgpo_loss(ell, ref, ell.detach() + shifts, adv, ids, BETA, G, 0.05)
    assert s["ratio"].tolist() == pytest.approx([math.exp(float(x)) for x in shifts], rel=1e-12)
    assert s["clipped"].tolist() == [True, False, True, True]  # ρ > 1 + c with A > 0; ρ < 1 − c with A ≤ 0
    loss.mean().backward()
    *_, losses, grads = by_hand(v.detach(), x0, eps, ref, adv, clipped=(True, False, True, True))
    assert loss.tolist() == pytest.approx(losses, rel=1e-12)  # a clipped sample keeps its value, sg(ℓ)
    assert v.grad.flatten(1).tolist() == [pytest.approx(row, rel=1e-10, abs=0) for row in grads]
    _, s = dgpo_loss(ell, ref, ell.detach() - shifts, adv, ids, BETA, G, 0.05)  # the mirrored ratios
    assert s["clipped"].tolist() == [False, False, False, False]


def test_a_group_split_over_processes_scores_as_on_one():
    terms = torch.tensor([0.3, -1.2, 0.7, 2.0, -0.4, 0.9], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1, 1, 2])  # group 1 spans the two halves below
    one = group_scores(terms, ids)
    halves = [slice(0, 3), slice(3, 6)]

    def gather(rows):  # what accelerator.gather returns: every process's rows in process order
        return torch.cat([torch.stack([ids[h].double(), terms[h]], 1) for h in halves])

    split = torch.cat([group_scores(terms[h], ids[h], gather) for h in halves])
    assert torch.equal(one, split)
    assert one.tolist() == pytest.approx([-0.9, -0.9, 2.3, 2.3, 2.3, 0.9], rel=1e-15)


def test_minibatches_hold_whole_groups():
    ids = torch.tensor([0, 0, 1, 1, 2, 2])
    order = group_order(ids, 3, torch.Generator().manual_seed(0))
    assert sorted(order.tolist()) == list(range(6))
    assert all(len(set(ids[order[m * 2 : m * 2 + 2]].tolist())) == 1 for m in range(3))


def dgpo_config(tmp_path, **overrides):
    """The contract test's toy config for trainer dgpo: SDE rollouts of 2 steps, redness reward."""
    return toy_config(tmp_path, "dgpo", **{"train.num_train_timesteps": 1, "train.kl_coef": 0.01, **overrides})


def test_toy_steps_are_on_policy(tmp_path):
    trainer = build_trainer(dgpo_config(tmp_path, num_steps=2, **{"train.ema_ref_decay": 0.0}))
    first = trainer.train_step()  # θ = ema_ref = the reference: ℓ_θ = ℓ_ref, so S_g = 0 and w_g = 1/2
    assert first["train/ratio"] == 1.0 and first["train/group_score"] == 0.0 and first["train/group_weight"] == 0.5
    assert first["train/clip_fraction"] == 0.0 and first["train/ema_ref_decay"] == 0.0
    theta = trainer.parts.model.adapter_parameters("default")
    assert any(float(p.detach().abs().max()) > 0 for n, p in theta.items() if "lora_B" in n)
    second = trainer.train_step()  # ema_ref copied θ after the first step: on policy again, away from the reference
    assert second["train/ratio"] == 1.0 and second["train/group_score"] != 0.0


def test_resumes_bit_for_bit(tmp_path):
    """Two groups, two minibatches of one group each: two optimizer steps a step, the second off the ema_ref."""
    extra = {"train.num_minibatches": 2, "data.num_prompts_per_step": 2, "checkpoint.every_n_steps": 1}
    straight, lines, resumed = straight_and_resumed(dgpo_config, tmp_path, extra)
    assert all(line["train/optimizer_steps"] == 2 * line["step"] for line in lines)
    refs = [
        load_file(str(c.run_dir / "checkpoints" / "step_000002" / "adapter_ema_ref.safetensors"))
        for c in (straight, resumed.parts.cfg)
    ]
    assert_same(*refs, "adapter_ema_ref")


def test_two_gloo_processes_match_one_process(tmp_path, tiny_pipeline):
    """One prompt group of 4 spans both processes: its group score (summed over both) equals one process's."""
    extra = {
        "trainer": "dgpo",
        "num_steps": 2,
        "sampler": {"name": "ode", "num_steps": 3, "height": 32, "width": 32, "guidance_scale": 1.0},
        "data": {"prompts": ["a red cat", "a blue dog", "a green tree"], "num_prompts_per_step": 1, "group_size": 4},
        "train": {"learning_rate": 3e-3, "kl_coef": 0.01, "num_train_timesteps": 2, "ema_every_n_steps": 1},
        "checkpoint": {"every_n_steps": 0, "keep_last": 1},
    }
    extra["train"] |= {"use_async_rewards": False, "ema_ref_decay_ramp": 0.1}
    runs, lines = one_and_two_processes(tmp_path, write_config(tmp_path, tiny_pipeline("sd3"), "one", **extra))
    scores = [[x["train/group_score"] for x in run] for run in lines]  # one group: every sample's S_g is the same
    assert scores[0][0] == scores[1][0] == 0.0 and scores[0][1] != 0.0  # θ = reference at the first step
    assert scores[0] == pytest.approx(scores[1], rel=1e-4), scores
    norms = [[x["train/grad_norm"] for x in run] for run in lines]
    assert min(norms[0]) > 0 and norms[0] == pytest.approx(norms[1], rel=1e-4), norms
    assert_same_checkpoints(runs, ("trainable.safetensors", "ema.safetensors", "adapter_ema_ref.safetensors"))


def test_the_toy_config_runs(tmp_path):
    lines = toy_config_run(tmp_path, "dgpo")
    assert [line["step"] for line in lines] == [1, 2]
    assert all(
        math.isfinite(line["train/loss"]) and line["train/ratio"] == pytest.approx(1.0, abs=1e-3) for line in lines
    )


def test_bad_settings_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match=r"train.beta_dpo=0.0, .* must all be > 0"):
        build_trainer(dgpo_config(tmp_path, **{"train.beta_dpo": 0.0}))
    with pytest.raises(ValueError, match=r"ema_ref_decay=1.5 in \[0, 1\]"):
        build_trainer(dgpo_config(tmp_path, **{"train.ema_ref_decay": 1.5}))
    with pytest.raises(ValueError, match="needs model.use_lora=true"):
        build_trainer(dgpo_config(tmp_path, **{"model.use_lora": False}))
    with pytest.raises(
        ValueError, match=r"train.num_minibatches=2 splits prompt groups \(2 samples a process, group_size=2\)"
    ):
        build_trainer(dgpo_config(tmp_path, **{"train.num_minibatches": 2}))
    with pytest.raises(ValueError, match="balancer marble balances per-reward gradients, which dgpo does not take"):
        build_trainer(dgpo_config(tmp_path, **{"balancer": {"name": "marble"}}))
    with pytest.raises(ValueError, match=r"max_timestep_index=-1, .* must all be >= 0"):
        build_trainer(dgpo_config(tmp_path, **{"train.max_timestep_index": -1}))


# ---------------------------------------------------------------------------------------------------------------------
# the recipe's own step: each loss term's gradient against a float64 formula written here


def step_gradients(tmp_path, monkeypatch, state, **overrides):
    """Run one train_step from adapter state `state` (θ, ema_ref: three different models with the base) and return
    the trained tensors' gradients at the optimizer step (no clipping), with what the formula needs: the rollout's
    endpoints x0 [N, ...] and advantages [N], and the policy's forward inputs (x_t, σ, cond, guidance) per time."""
    import flowrl.trainers.dgpo as dgpo_module
    import flowrl.trainers.kit as kit

    cfg = dgpo_config(
        tmp_path, **{"data.num_prompts_per_step": 2, "data.group_size": 2, "train.use_clip": False}, **overrides
    )
    cfg.train.max_grad_norm = 0.0  # measure the gradient, do not clip it
    trainer = build_trainer(cfg)
    model, seen = trainer.parts.model, {"calls": []}
    for name in ("default", "ema_ref"):
        with torch.no_grad():
            for key, p in model.adapter_parameters(name).items():
                p.copy_(state[name][key.replace(f".{name}.", ".")])
    collect, velocity, optimizer = kit.collect, model.velocity, trainer.parts.opt.optimizer

    def recording_collect(parts, **kwargs):
        exp = collect(parts, **kwargs)
        seen["x0"], seen["adv"] = exp.rollout.final_latents().clone(), exp.advantages.clone()
        return exp

    def recording_velocity(x_t, sigma, cond, guidance_scale):
        if torch.is_grad_enabled():  # the policy's forward (the references run without gradient)
            seen["calls"].append((x_t.detach().clone(), sigma.clone(), cond, guidance_scale))
        return velocity(x_t, sigma, cond, guidance_scale)

    def recording_step(*args, **kwargs):
        seen["grads"] = [p.grad.detach().clone() for p in trainer.parts.opt.params]
        return type(optimizer).step(optimizer, *args, **kwargs)

    monkeypatch.setattr(kit, "collect", recording_collect)
    monkeypatch.setattr(dgpo_module, "group_order", lambda ids, b, gen: torch.arange(len(ids)))  # rows as rolled out
    monkeypatch.setattr(model, "velocity", recording_velocity)
    monkeypatch.setattr(optimizer, "step", recording_step)
    trainer.train_step()
    monkeypatch.undo()
    for name in ("default", "ema_ref"):  # back to the state the step started from, for the formula
        with torch.no_grad():
            for key, p in model.adapter_parameters(name).items():
                p.copy_(state[name][key.replace(f".{name}.", ".")])
    return trainer, seen


def formula_gradients(trainer, seen, term: str) -> list[torch.Tensor]:
    """∇ of DGPO's term `term` ("policy": mean_i σ(S_g)·A_i·ℓ_θ,i with S_g = Σ_{j∈g} A_j·β·sg(ℓ_θ − ℓ_ref)_j / G; "kl":
    mean_i mean((v_θ − v_base)²)), in float64 from the model's velocities: ℓ_ref of the frozen base (adapters off), or
    of ema_ref with use_ema_ref; the KL always to the base. Averaged over the step's training times."""
    t, model, params = trainer.parts.cfg.train, trainer.parts.model, trainer.parts.opt.params
    x0, adv = seen["x0"].double(), seen["adv"].double().clamp(-t.adv_clip_max, t.adv_clip_max)  # [N, ...], [N]
    groups, g = [[0, 1], [2, 3]], trainer.parts.cfg.data.group_size  # the rows of each prompt group, as rolled out
    total = 0.0
    for x_t, sigma, cond, guidance in seen["calls"]:
        s = sigma.double().view(-1, *[1] * (x0.ndim - 1))
        eps = (x_t.double() - (1 - s) * x0) / s  # the forward process x_t = (1 − σ)·x0 + σ·ε, inverted
        for rows in groups:  # DGPO shares one ε in a group
            assert torch.allclose(eps[rows[0]], eps[rows[1]], atol=1e-4)
        v = model.velocity(x_t, sigma, cond, guidance).double()
        with torch.no_grad(), model.adapter_disabled():
            v_base = model.velocity(x_t, sigma, cond, guidance).double()
        with torch.no_grad(), model.using_adapter("ema_ref"):
            v_ema = model.velocity(x_t, sigma, cond, guidance).double()
        v_ref = v_ema if t.use_ema_ref else v_base
        dims = tuple(range(1, x0.ndim))
        ell, ell_ref = ((v - (eps - x0)) ** 2).mean(dims), ((v_ref - (eps - x0)) ** 2).mean(dims)
        if term == "policy":
            delta = (ell - ell_ref).detach()
            score = torch.zeros_like(delta)
            for rows in groups:
                score[rows] = sum(adv[j] * t.beta_dpo * delta[j] / g for j in rows)
            total = total + (torch.sigmoid(score) * adv * ell).mean()
        else:
            total = total + ((v - v_base) ** 2).mean(dims).mean()
    grads = torch.autograd.grad(total / len(seen["calls"]), params, allow_unused=True)
    return [torch.zeros_like(p) if d is None else d.float() for p, d in zip(params, grads)]


def flat(tensors) -> torch.Tensor:
    return torch.cat([x.flatten() for x in tensors])


@pytest.mark.parametrize("use_ema_ref", [False, True])
def test_each_term_of_a_step_has_the_formulas_gradient(tmp_path, monkeypatch, use_ema_ref):
    """θ, ema_ref and the base all differ. Without KL the step's gradient is the DGPO term's, with ℓ_ref of the
    base or of ema_ref; the difference a KL coefficient makes is that coefficient times ∇ of the KL to the base —
    never to ema_ref (DGPO's code: `kl_loss = (model_v - ref_old_v)²`, ref_old_v the adapters-off model)."""
    probe = build_trainer(dgpo_config(tmp_path / "probe"))
    gen, state = torch.Generator().manual_seed(11), {}
    for name in ("default", "ema_ref"):
        params = probe.parts.model.adapter_parameters(name)
        state[name] = {
            k.replace(f".{name}.", "."): 0.3 * torch.randn(p.shape, generator=gen) for k, p in params.items()
        }
    kl_coef, ema = 0.5, {"train.use_ema_ref": use_ema_ref}
    plain, seen = step_gradients(tmp_path / "plain", monkeypatch, state, **ema, **{"train.kl_coef": 0.0})
    with_kl, seen_kl = step_gradients(tmp_path / "kl", monkeypatch, state, **ema, **{"train.kl_coef": kl_coef})
    assert torch.equal(seen["x0"], seen_kl["x0"]) and len(seen["calls"]) == 1  # the same rollout, one training time

    policy, kl = flat(formula_gradients(plain, seen, "policy")), flat(formula_gradients(plain, seen, "kl"))
    measured_policy, measured_kl = flat(seen["grads"]), (flat(seen_kl["grads"]) - flat(seen["grads"])) / kl_coef
    # float32 velocities and a float32 KL against the float64 formula: agreement to ~1e-6 of the norm; 1e-4 leaves room
    # for the summation order, while a flipped sign, a lost factor or another reference moves it by O(1)
    assert (measured_policy - policy).norm() <= 1e-4 * policy.norm(), (measured_policy - policy).norm() / policy.norm()
    assert (measured_kl - kl).norm() <= 1e-3 * kl.norm(), (measured_kl - kl).norm() / kl.norm()
    assert policy.norm() > 0 and kl.norm() > 0.1 * policy.norm()  # each term moves the step measurably
    v_ema_kl = step_kl_to_ema(plain, seen)  # the KL to ema_ref instead, which the step must not take
    assert (measured_kl - v_ema_kl).norm() > 0.1 * kl.norm()


def step_kl_to_ema(trainer, seen) -> torch.Tensor:
    """∇ mean((v_θ − v_ema_ref)²): the anchor DGPO's KL must not have (the test's check that the two differ here)."""
    model, params, total = trainer.parts.model, trainer.parts.opt.params, 0.0
    for x_t, sigma, cond, guidance in seen["calls"]:
        v = model.velocity(x_t, sigma, cond, guidance).double()
        with torch.no_grad(), model.using_adapter("ema_ref"):
            v_ema = model.velocity(x_t, sigma, cond, guidance).double()
        total = total + ((v - v_ema) ** 2).mean(tuple(range(1, v.ndim))).mean()
    grads = torch.autograd.grad(total / len(seen["calls"]), params, allow_unused=True)
    return flat([torch.zeros_like(p) if d is None else d.float() for p, d in zip(params, grads)])
