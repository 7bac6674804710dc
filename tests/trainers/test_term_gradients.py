"""Every recipe's own `train_step` against its loss written by hand in float64, term by term.

Each test runs one step of a recipe on the shipped toy model (tests/trainers/test_trainer_contract.py's config, shrunk)
with its adapters set apart (the trained one, and each anchor it pulls toward, drawn at random, so that no two of
policy, reference, old policy, EMA anchor and teachers agree). It captures the trained parameters' gradients at the
optimizer step (a wrapper around `parts.opt.step` that records and then steps as before) together with every weight of
the transformer at that moment, and the step's inputs (rollout, advantages, training times and noises) where the recipe
hands them on. It then puts the weights back, rebuilds each loss term from docs/math.md and docs/recipes/<name>.md with
the model's velocities cast to float64 and every formula written here (none of flowrl.losses, flowrl.sde or
flowrl.sde_memoryless), takes each term's gradient with autograd, and checks that the recipe's gradient is the sum of
the terms' gradients, each scaled by its coefficient.

Each term is isolated by size: the test asserts that every term's scaled gradient reaches at least SHARE = 0.05 of
the largest gradient entry, so flipping the term's sign moves some entry by at least 2·SHARE of that scale, dropping a
factor c from it by |1 − 1/c|·SHARE, and a swapped reference by the gap between the two anchors' terms (the anchors
are set apart for that): for a factor such as a coefficient or 1/G = 1/2, thousands of times the tolerance.

Tolerance. The recipe and the check run the same float32 network on the same float32 inputs (x_t is formed in float32
here too: see `noised`); they differ in the arithmetic of the loss (float32 in the recipe, float64 here) and in the
order of float32 sums in the backward pass. A float32 loss formula rounds each intermediate value at 2^-24 ≈ 6e-8
relative; the largest amplification is a difference of two nearly equal values (μ − μ_ref, v_θ − v_ref of anchors a
few percent apart: ~1e2), so the upstream gradient dL/dv differs by ~1e-5 relative at worst; the backward pass then
sums ~10^4 float32 products per weight (3072 latent elements x items), whose rounding grows like √n·2^-24 ≈ 1e-5
relative to the entry's scale. Hence rtol = 1e-4 and atol = 1e-5 times the largest entry, and the largest difference
must stay below that atol: the measured ones are below 2e-6 of the largest entry in every recipe.
"""

import math
import sys

import pytest
import torch
from test_trainer_contract import toy_config

from flowrl.trainers import build_trainer
from flowrl.types import select_cond

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

RTOL, ATOL, SHARE = 1e-4, 1e-5, 0.05  # see the module docstring
PROMPTS = ["two red circles", "one blue square"]


# ------------------------------------------------------------------------------------------ capture and comparison


def set_adapter_apart(model, adapter: str, seed: int, scale: float) -> None:
    """Give adapter `adapter`'s LoRA B matrices (zero at the start) random values: scale · N(0, 1), from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.adapter_parameters(adapter).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


class OptimizerSteps:
    """Wraps `trainer.parts.opt.step`: at every optimizer step it records the trained parameters' gradients and every
    transformer weight (adapters included), then steps as before. `restore(i)` puts step i's weights back."""

    def __init__(self, trainer):
        self.opt, self.transformer = trainer.parts.opt, trainer.parts.model.transformer
        self.grads: list[dict[str, torch.Tensor]] = []
        self.weights: list[dict[str, torch.Tensor]] = []
        original = self.opt.step

        def step(losses):
            self.grads.append({n: p.grad.detach().clone() for n, p in zip(self.opt.names, self.opt.params)})
            self.weights.append({n: p.detach().clone() for n, p in self.transformer.named_parameters()})
            return original(losses)

        self.opt.step = step

    def restore(self, i: int = 0) -> None:
        with torch.no_grad():
            for name, p in self.transformer.named_parameters():
                p.copy_(self.weights[i][name])


def wrap(obj, name: str, seen: dict):
    """Replace method `name` of `obj` by one that records its positional arguments in `seen[name]`, then calls it."""
    original = getattr(obj, name)

    def recorded(*args, **kwargs):
        seen[name] = args
        return original(*args, **kwargs)

    setattr(obj, name, recorded)


def term_gradients(params: list[torch.Tensor], terms: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Each scalar term's gradient in `params` (zeros where a parameter does not enter it)."""
    out = {}
    for name, loss in terms.items():
        grads = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        out[name] = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
    return out


def assert_terms(captured: dict[str, torch.Tensor], names: list[str], terms: dict[str, list[torch.Tensor]]) -> None:
    """The recipe's gradient `captured` equals the sum of the hand-built `terms` (each already scaled by its
    coefficient) within RTOL / ATOL·max|captured|, and every term reaches SHARE of that largest entry."""
    scale = max(float(g.abs().max()) for g in captured.values())
    assert scale > 0, "the step trained nothing"
    for term, grads in terms.items():
        share = max(float(g.abs().max()) for g in grads) / scale
        assert share > SHARE, f"term {term!r} reaches only {share:.3g} of the largest entry: set the case apart"
    worst = 0.0
    for j, name in enumerate(names):
        hand = sum(grads[j] for grads in terms.values()).float()
        worst = max(worst, float((captured[name] - hand).abs().max()) / scale)

        def message(m, n=name):
            return f"{n}: {m}"

        torch.testing.assert_close(captured[name], hand, rtol=RTOL, atol=ATOL * scale, msg=message)
    assert worst < ATOL  # the largest difference, relative to the largest entry


def trained(trainer) -> tuple[list[str], list[torch.Tensor]]:
    opt = trainer.parts.opt
    return opt.names, opt.params


def f64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().double()


def flat_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over every non-batch element: [n, ...] -> [n]."""
    return x.flatten(1).mean(1)


def noised(x0: torch.Tensor, eps: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_σ = (1 − σ)·x0 + σ·ε per row (σ [n]), evaluated in float32: the network's input, rounded as the recipe rounds
    it (a one-ulp change of the input moves GDRO's β-scaled implicit reward by ~1e-5 of its gradient)."""
    s = sigma.float().view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0.float() + s * eps.float()


# ------------------------------------------------------------------------------------------ GRPO and Adv-GRPO

BETA_KL, CLIP = 2.0, 1e-2


def grpo_config(tmp_path, trainer="grpo", **overrides):
    """2 prompts x 2 samples, flow_grpo SDE rollouts of 3 steps (two stochastic transitions, the last an Euler step)."""
    extra = {
        "data.prompts": PROMPTS,
        "data.num_prompts_per_step": 2,
        "sampler.num_steps": 3,
        "train.kl_coef": BETA_KL,
        "train.clip_range": CLIP,
        "train.max_grad_norm": 1e9,
        "train.use_ema": False,
    }
    return toy_config(tmp_path, trainer, **{**extra, **overrides})


def grpo_step(trainer) -> tuple[OptimizerSteps, dict]:
    """One train_step with adapter `default` set apart from the reference and the stored log-probs of samples 0 and 1
    moved by ±2ε, so that their ratios leave the clip band on both sides (GRPO's stage 6, `grpo_optimise`, wrapped
    in the recipe's module)."""
    set_adapter_apart(trainer.parts.model, "default", seed=0, scale=0.05)
    steps, seen = OptimizerSteps(trainer), {}
    module = sys.modules[type(trainer).__module__]
    original = module.grpo_optimise

    def optimise(parts, rollout, advantages, keep, *rest, **options):
        rollout.log_probs[0] += 2 * CLIP
        rollout.log_probs[1] -= 2 * CLIP
        seen["inputs"] = rollout, advantages.clone(), keep.clone()
        return original(parts, rollout, advantages, keep, *rest, **options)

    module.grpo_optimise = optimise
    try:
        trainer.train_step()
    finally:
        module.grpo_optimise = original
    assert len(steps.grads) == 1
    steps.restore(0)
    return steps, seen


def grpo_terms(trainer, rollout, advantages, keep) -> dict[str, torch.Tensor]:
    """docs/math.md#clipped-surrogate and #kl-to-the-reference (code form), by hand: per kept sample the mean over its
    stochastic transitions k of max(−A·ρ, −A·clip(ρ, 1 ± ε)) and β·mean((μ − μ_ref)²)/(2g²), then the mean over the
    kept samples; ρ = exp(ℓ − ℓ_old), ℓ the per-element mean Gaussian log-density of x_{k+1} around
    μ = x − h·v − (a²h / (2(1 − σ̃)))·(x + (1 − σ)·v) with std s = g·√h, g² = a²·σ/(1 − σ̃) (σ̃ = σ' at σ = 1)."""
    model, t = trainer.parts.model, trainer.parts.cfg.train
    sigmas, levels = f64(rollout.sigmas), f64(rollout.noise_levels)
    kept = [i for i in range(len(rollout.prompts)) if bool(keep[i])]
    counts = {i: int((levels[i] > 0).sum()) for i in kept}
    policy = kl = torch.zeros((), dtype=torch.float64)
    for k in range(rollout.num_steps):
        rows = [i for i in kept if float(levels[i, k]) > 0]
        if not rows:
            continue
        s, s_next = float(sigmas[k]), float(sigmas[k + 1])
        h, s_tilde = s - s_next, (s_next if s >= 1 else s)
        a = levels[rows, k].view(-1, 1, 1, 1)
        g2 = a**2 * s / (1 - s_tilde)
        x, x_next = rollout.latents[rows, k], f64(rollout.latents[rows, k + 1])
        cond = select_cond(rollout.cond, torch.tensor(rows))
        sigma = torch.full((len(rows),), s, dtype=torch.float32)
        v = model.velocity(x, sigma, cond, rollout.guidance_scale).double()
        with torch.no_grad(), model.adapter_disabled():
            v_ref = f64(model.velocity(x, sigma, cond, rollout.guidance_scale))

        def mean_of(v, x=f64(x), a=a, s=s, h=h, s_tilde=s_tilde):
            return x - h * v - (a**2 * h / (2 * (1 - s_tilde))) * (x + (1 - s) * v)

        mean, std = mean_of(v), torch.sqrt(g2 * h)
        log_density = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
        ratio = torch.exp(flat_mean(log_density) - f64(rollout.log_probs[rows, k]))
        adv = f64(advantages[rows])
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - t.clip_range, 1 + t.clip_range))
        divergence = flat_mean((mean - mean_of(v_ref)) ** 2) / (2 * g2.flatten())
        weight = torch.tensor([1.0 / (counts[i] * len(kept)) for i in rows], dtype=torch.float64)
        policy = policy + (weight * surrogate).sum()
        kl = kl + (weight * divergence).sum()
    return {"policy": policy, "kl": t.kl_coef * kl}


def test_grpo_step_gradient_is_the_clipped_surrogate_plus_beta_kl_by_hand(tmp_path):
    trainer = build_trainer(grpo_config(tmp_path))
    steps, seen = grpo_step(trainer)
    rollout, advantages, keep = seen["inputs"]
    assert advantages.abs().min() > 0.5 and bool(keep.all())
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, grpo_terms(trainer, rollout, advantages, keep)))


def rm_terms(rm, head, references, generated, index, total) -> dict[str, torch.Tensor]:
    """docs/recipes/adv_grpo.md's RM loss by hand: the GAN hinge ½[mean relu(1 − h(ref)) + mean relu(1 + h(gen))] on
    the normalised CLS tokens, plus patch_loss_coef times the same on each image's drawn patch tokens,
    x̂ = x/(‖x‖ + 1e-6)."""
    from flowrl.training.adversarial import patch_draw

    a, pairs, out = rm.cfg, len(index), {}
    for purpose, images, sign, side in ((1, references, 1.0, "reference"), (2, generated, -1.0, "generated")):
        tokens = f64(rm.backbone(images))  # [n, 1 + P, D]
        tokens = tokens / (tokens.norm(dim=-1, keepdim=True) + 1e-6)
        draw = patch_draw(rm.seed, 0, purpose, total, tokens.shape[1] - 1, a.num_patches)[index]  # [n, S]
        cls = head(tokens[:, 0])[:, 0]
        patches = head(tokens[:, 1:][torch.arange(pairs)[:, None], draw])[..., 0]
        out[f"{side}_cls"] = 0.5 * torch.relu(1 - sign * cls).sum() / pairs
        hinge = 0.5 * torch.relu(1 - sign * patches).sum() / (pairs * a.num_patches)
        out[f"{side}_patches"] = a.patch_loss_coef * hinge
    return out


def test_adv_grpo_step_gradients_are_grpo_s_terms_and_the_rm_hinge_by_hand(tmp_path):
    import copy

    cfg = grpo_config(tmp_path, "adv_grpo", **{"train.adversarial.learning_rate": 1e-3})
    trainer = build_trainer(cfg)
    rm, seen, rm_grads = trainer.rm, {}, {}
    wrap(rm, "update", seen)
    head_before = copy.deepcopy(rm.head)
    original = rm.optimizer.step

    def rm_step(*args, **kwargs):
        rm_grads.update({n: p.grad.detach().clone() for n, p in rm.head.named_parameters()})
        return original(*args, **kwargs)

    rm.optimizer.step = rm_step
    steps, generator = grpo_step(trainer)
    rollout, advantages, keep = generator["inputs"]
    assert advantages.abs().min() > 0.1 and bool(keep.all())
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, grpo_terms(trainer, rollout, advantages, keep)))
    # the RM step: its head's gradient against the hinge by hand, the head in float64 at its weights before the step
    references, generated, index, total = seen["update"]
    assert len(index) == 4 and rm.version == 1
    head = head_before.double()
    head_names = [n for n, _ in head.named_parameters()]
    hand = term_gradients(list(head.parameters()), rm_terms(rm, head, references, generated, index, total))
    assert_terms(rm_grads, head_names, hand)


# ------------------------------------------------------------------------------------------ DiffusionNFT and SMOPD


def record_noising(monkeypatch, trainer) -> dict:
    """Records every sde.forward_noise(x0, ε, σ) call of the trainer's stage 6 (flowrl.trainers.nft.nft_optimise) in
    seen["noising"] and its tensor arguments (x0, sigmas, cond, advantages, per_reward, keep, draws) in
    seen["_optimise"]."""
    import flowrl.sde
    import flowrl.trainers.nft

    seen, original, noise = {"noising": []}, flowrl.trainers.nft.nft_optimise, flowrl.sde.forward_noise
    inside = [False]

    def forward_noise(x0, eps, sigma):
        if inside[0]:
            seen["noising"].append((x0.detach().clone(), eps.detach().clone(), torch.as_tensor(sigma).clone()))
        return noise(x0, eps, sigma)

    def optimise(parts, *args):
        seen["_optimise"], inside[0] = args[:7], True
        try:
            return original(parts, *args)
        finally:
            inside[0] = False

    monkeypatch.setattr(flowrl.sde, "forward_noise", forward_noise)
    monkeypatch.setattr(flowrl.trainers.nft, "nft_optimise", optimise)
    return seen


def rows_of(x0: torch.Tensor, x0_b: torch.Tensor) -> list[int]:
    """The sample index of each row of x0_b (rows of x0, found by equality)."""
    out = [next(i for i in range(len(x0)) if torch.equal(x0[i], row)) for row in x0_b]
    assert len(set(out)) == len(out)
    return out


def nft_terms(trainer, seen, teachers: dict[str, float] | None = None) -> dict[str, torch.Tensor]:
    """docs/math.md#diffusionnft by hand at each recorded (x0, ε, σ): x_t = (1 − σ)·x0 + σ·ε, v± = β·v_θ + (1 − β)·v_old
    and (1 + β)·v_old − β·v_θ (v_old from adapter "old", no gradient), L± = mean((x_t − σ·v± − x0)²) / sg(max(mean|·|,
    1e-5)), policy (A_max/β)·(r·L⁺ + (1 − r)·L⁻) with r = clip(A, ±A_max)/(2·A_max) + ½; KL kl_coef·mean((v_θ − v_ref)²)
    (adapters off); SMOPD (`teachers`: adapter -> λ) distill_coef·mean(d²)/sg(mean|d| + 1e-8), d = v_θ − Σ λ_k·v_k.
    Each summed over the kept samples and divided by their count and the number of training times."""
    model, t = trainer.parts.model, trainer.parts.cfg.train
    x0, _, cond, advantages, _, keep, _ = seen["_optimise"]
    calls, kept = seen["noising"], float(keep.sum())
    out = {"policy": 0.0, "kl": 0.0, "distill": 0.0}
    for x0_b, eps, sigma in calls:
        rows = rows_of(x0, x0_b)
        s, keep_b = f64(sigma).view(-1, 1, 1, 1), f64(keep[rows])
        x_t = noised(x0_b, eps, sigma)
        c = select_cond(cond, torch.tensor(rows))
        v = model.velocity(x_t, sigma, c, trainer.guidance).double()
        with torch.no_grad():
            with model.using_adapter("old"):
                v_old = f64(model.velocity(x_t, sigma, c, trainer.guidance))
            with model.adapter_disabled():
                v_ref = f64(model.velocity(x_t, sigma, c, trainer.guidance))

        def x0_loss(v_implicit, x_t=f64(x_t), s=s, x0_b=f64(x0_b)):
            error = x_t - s * v_implicit - x0_b
            return flat_mean(error**2) / flat_mean(error.abs()).clamp(min=1e-5).detach()

        a = f64(advantages[rows]).clamp(-t.adv_clip_max, t.adv_clip_max)
        r = (a / (2 * t.adv_clip_max) + 0.5).clamp(0, 1)
        beta = t.nft_beta
        positive, negative = x0_loss(beta * v + (1 - beta) * v_old), x0_loss((1 + beta) * v_old - beta * v)
        terms = {"policy": t.adv_clip_max / beta * (r * positive + (1 - r) * negative)}
        terms["kl"] = t.kl_coef * flat_mean((v - v_ref) ** 2)
        if teachers:
            with torch.no_grad():
                target = 0.0
                for name, mix in teachers.items():
                    with model.using_adapter(name):
                        target = target + mix * f64(model.velocity(x_t, sigma, c, trainer.guidance))
            d = v - target
            terms["distill"] = t.distill_coef * flat_mean(d**2) / (flat_mean(d.abs()).detach() + 1e-8)
        for name, per_sample in terms.items():
            out[name] = out[name] + (keep_b * per_sample).sum() / kept / len(calls)
    return out if teachers else {k: v for k, v in out.items() if k != "distill"}


NFT_SETTINGS = {
    "data.prompts": PROMPTS,
    "data.num_prompts_per_step": 2,
    "sampler.num_steps": 3,
    "train.timestep_fraction": 0.67,  # 2 of the 3 grid times per sample
    "train.nft_beta": 0.5,  # v_old enters both implicit policies
    "train.kl_coef": 4.0,
    "train.max_grad_norm": 1e9,
    "train.use_ema": False,
}


def nft_step(monkeypatch, trainer, anchors: tuple[str, ...]) -> tuple[OptimizerSteps, dict]:
    """One train_step with the trained adapter and each of `anchors` set apart (from the reference and each other)."""
    for seed, adapter in enumerate(("default", *anchors)):
        set_adapter_apart(trainer.parts.model, adapter, seed=seed, scale=0.05)
    seen, steps = record_noising(monkeypatch, trainer), OptimizerSteps(trainer)
    trainer.train_step()
    assert len(steps.grads) == 1 and len(seen["noising"]) == 2
    steps.restore(0)  # the weights of the optimizer step (θ_old moves after it)
    return steps, seen


def test_nft_step_gradient_is_the_policy_term_plus_the_kl_by_hand(tmp_path, monkeypatch):
    trainer = build_trainer(toy_config(tmp_path, "nft", **NFT_SETTINGS))
    steps, seen = nft_step(monkeypatch, trainer, ("old",))
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, nft_terms(trainer, seen)))


def test_smopd_step_gradient_is_nft_s_terms_plus_distilling_the_blended_teachers_by_hand(tmp_path, monkeypatch):
    mix = {"teacher_0": 0.25, "teacher_1": 0.75}
    teachers = [{"priority": ["redness.RednessReward"], "mix": 0.25}, {"priority": ["toy_size"], "mix": 0.75}]
    rewards = [{"name": "redness.RednessReward"}, {"name": "toy_size", "weight": 0.0}]
    settings = {**NFT_SETTINGS, "train.teachers": teachers, "train.distill_coef": 0.5, "rewards": rewards}
    trainer = build_trainer(toy_config(tmp_path, "smopd", **settings))
    steps, seen = nft_step(monkeypatch, trainer, ("old", *mix))
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, nft_terms(trainer, seen, mix)))


# ------------------------------------------------------------------------------------------ AWM


def test_awm_step_gradient_is_the_weighted_matching_term_plus_both_kl_terms_by_hand(tmp_path):
    """docs/recipes/awm.md#the-loss by hand: on policy (one optimizer step) ρ ≡ 1 and the policy term's gradient is
    ∇ Â·W(ℓ, t), W = (t/p)·((ℓ + 1e-10)^p − 1e-10^p) of ℓ = mean((v_θ − (ε − x0))²), Â = clip(A, ±A_max)/A_max·adv_max;
    β·mean((v_θ − v_ref)²) to the reference (adapters off) and γ·mean((v_θ − v_kl_ema)²) to the EMA anchor; the mean
    over the kept (sample, time) items."""
    settings = {"data.prompts": PROMPTS, "data.num_prompts_per_step": 2, "sampler.num_steps": 3, "train.use_ema": False}
    settings |= {"train.num_train_timesteps": 2, "train.timestep_fraction": 1.0, "train.max_grad_norm": 1e9}
    settings |= {"train.kl_coef": 3.0, "train.ema_kl_coef": 1.5, "train.advantage_max": 0.5}
    trainer = build_trainer(toy_config(tmp_path, "awm", **settings))
    model, t = trainer.parts.model, trainer.parts.cfg.train
    for seed, adapter in enumerate(("default", "kl_ema")):
        set_adapter_apart(model, adapter, seed=seed, scale=0.05)
    steps, seen = OptimizerSteps(trainer), {}
    wrap(trainer, "_optimise", seen)
    trainer.train_step()
    assert len(steps.grads) == 1
    steps.restore(0)  # the anchor moves after the step
    x0, sigmas, cond, advantages, _, keep, times, noises = seen["_optimise"]
    n, k = times.shape
    kept = float(keep.sum())
    terms = {"policy": 0.0, "kl": 0.0, "ema_kl": 0.0}
    for j in range(k):
        s = f64(sigmas[times[:, j]])
        x_t = noised(x0, noises[:, j], sigmas[times[:, j]])
        v = model.velocity(x_t, sigmas[times[:, j]], cond, trainer.guidance).double()
        with torch.no_grad():
            with model.adapter_disabled():
                v_ref = f64(model.velocity(x_t, sigmas[times[:, j]], cond, trainer.guidance))
            with model.using_adapter("kl_ema"):
                v_ema = f64(model.velocity(x_t, sigmas[times[:, j]], cond, trainer.guidance))
        ell = flat_mean((v - (f64(noises[:, j]) - f64(x0))) ** 2)
        p = t.ghuber_power
        weighted = s / p * ((ell + 1e-10) ** p - 1e-10**p)
        a_hat = f64(advantages).clamp(-t.adv_clip_max, t.adv_clip_max) / t.adv_clip_max * t.advantage_max
        per_item = {"policy": a_hat * weighted, "kl": t.kl_coef * flat_mean((v - v_ref) ** 2)}
        per_item["ema_kl"] = t.ema_kl_coef * flat_mean((v - v_ema) ** 2)
        for name, value in per_item.items():
            terms[name] = terms[name] + (f64(keep) * value).sum() / (kept * k)
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, terms))


# ------------------------------------------------------------------------------------------ RAM


def test_ram_step_gradient_is_the_regression_onto_the_reward_corrected_reference_by_hand(tmp_path):
    """docs/math.md#reinforce-adjoint-matching by hand: mean over the kept (endpoint, σ) items of
    mean((v_θ − sg[v_ref + m·A·((ε − x0) − v_old)])²), v_ref with the adapters off and v_old the adapter "old". Its
    gradient splits into the pull to the reference, ∇ mean((v_θ − v_ref)²), and the reward term
    ∇ −2·m·A·mean(v_θ·((ε − x0) − v_old)), each checked."""
    settings = {"data.prompts": PROMPTS, "data.num_prompts_per_step": 2, "train.use_ema": False}
    settings |= {"train.num_loss_targets_per_sample": 2, "train.reward_multiplier": 0.3}
    trainer = build_trainer(toy_config(tmp_path, "ram", **settings))
    model, t = trainer.parts.model, trainer.parts.cfg.train
    for seed, adapter in enumerate(("default", "old")):
        set_adapter_apart(model, adapter, seed=seed, scale=0.05)
    steps, seen = OptimizerSteps(trainer), {}
    wrap(trainer, "_optimise", seen)
    trainer.train_step()
    assert len(steps.grads) == 1
    steps.restore(0)  # θ_old moves after the step
    x0, cond, advantages, keep, times, noises = seen["_optimise"]
    n, k = times.shape
    kept = float(keep.sum()) * k
    terms = {"reference": 0.0, "reward": 0.0}
    for j in range(k):
        x_t = noised(x0, noises[:, j], times[:, j])
        v = model.velocity(x_t, times[:, j], cond, trainer.guidance).double()
        with torch.no_grad():
            with model.adapter_disabled():
                v_ref = f64(model.velocity(x_t, times[:, j], cond, trainer.guidance))
            with model.using_adapter("old"):
                v_old = f64(model.velocity(x_t, times[:, j], cond, trainer.guidance))
        correction = t.reward_multiplier * f64(advantages).view(-1, 1, 1, 1) * (f64(noises[:, j]) - f64(x0) - v_old)
        per_item = {"reference": flat_mean((v - v_ref) ** 2), "reward": -2 * flat_mean(v * correction)}
        for name, value in per_item.items():
            terms[name] = terms[name] + (f64(keep) * value).sum() / kept
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, terms))


# ------------------------------------------------------------------------------------------ GDRO


def plackett_luce(s: torch.Tensor, r: list[float], tau: float) -> torch.Tensor:
    """docs/recipes/gdro.md's L_GDRO of one group: items sorted by r descending (stable), q_i(j) = softmax_{j≥i}(r/τ),
    Σ_{i<k−1} [log Σ_{m≥i} e^{s_m} − Σ_{j≥i} q_i(j)·s_j] (the last position's term is 0)."""
    order = sorted(range(len(r)), key=lambda j: -r[j])
    total = torch.zeros((), dtype=torch.float64)
    for i in range(len(r) - 1):
        rest = order[i:]
        q = torch.softmax(torch.tensor([r[m] / tau for m in rest], dtype=torch.float64), 0)
        total = total + torch.logsumexp(s[rest], 0) - (q * s[rest]).sum()
    return total


def test_gdro_step_gradient_is_the_ranking_loss_plus_gamma_times_the_top_sample_s_matching_loss_by_hand(tmp_path):
    from flowrl.schedules import gdro_times
    from flowrl.seeds import gdro_draw_generator

    settings = {"data.prompts": PROMPTS, "data.num_prompts_per_step": 2, "data.group_size": 3, "train.use_ema": False}
    settings |= {"train.pool_size": 4, "train.pool_shard_prompts": 2, "train.num_train_timesteps": 2}
    settings |= {"train.beta": 40.0, "train.tau": 0.05, "train.gamma": 2.0, "train.max_grad_norm": 1e9}
    trainer = build_trainer(toy_config(tmp_path, "gdro", **settings))
    model, t = trainer.parts.model, trainer.parts.cfg.train
    set_adapter_apart(model, "default", seed=0, scale=0.05)
    steps, seen = OptimizerSteps(trainer), {}
    wrap(trainer, "_optimise", seen)
    trainer.train_step()
    assert len(steps.grads) == 1
    steps.restore(0)
    x0, cond, rewards, group_ids, _ = seen["_optimise"]
    b, k, shape = x0.shape[0], x0.shape[1], tuple(x0.shape[2:])
    assert all(len(set(row)) == k for row in rewards.tolist())  # distinct rewards: one ranking, a signal in every group
    terms, cond = {"ranking": 0.0, "regulariser": 0.0}, select_cond(cond, torch.arange(b).repeat_interleave(k))
    for j in range(t.num_train_timesteps):  # one (t, ε) per group and draw: the recipe's draws
        generators = [gdro_draw_generator(trainer.parts.cfg.seed, 0, j, int(g)) for g in group_ids]
        draws = [gdro_times(draw, 1, shape, t.t_distribution, t.time_shift, (0.0, 1.0)) for draw in generators]
        sigma = torch.cat([s for s, _ in draws]).repeat_interleave(k)  # [b·k]
        eps = f64(torch.cat([e for _, e in draws]).repeat_interleave(k, 0))
        x_t = noised(x0.flatten(0, 1), eps, sigma)
        v = model.velocity(x_t, sigma, cond, trainer.guidance).double()
        with torch.no_grad(), model.adapter_disabled():
            v_ref = f64(model.velocity(x_t, sigma, cond, trainer.guidance))
        target = eps - f64(x0.flatten(0, 1))
        ell, ell_ref = flat_mean((v - target) ** 2).view(b, k), flat_mean((v_ref - target) ** 2).view(b, k)
        implicit = -t.beta * (ell - ell_ref)
        norm = b * t.num_train_timesteps
        for g in range(b):
            r = rewards[g].tolist()
            terms["ranking"] = terms["ranking"] + plackett_luce(implicit[g], r, t.tau) / norm
            terms["regulariser"] = terms["regulariser"] + t.gamma * ell[g, max(range(k), key=lambda m: r[m])] / norm
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, terms))


# ------------------------------------------------------------------------------------------ adjoint matching


def lean_adjoint_by_hand(model, guidance, latents, sigmas, cond, terminal) -> dict[int, torch.Tensor]:
    """docs/math.md#adjoint-matching's lean adjoint in float64 along the stored trajectory, with the base model's
    vector-Jacobian products (adapters off): the last (Euler) transition ã_{T−1} = ã_T − h·J_{T−1}ᵀ ã_T, then per step
    w = ã_{k+1}/τ_{k+1}, ŵ = w − 2h·J_{k+1}ᵀ w, ã_k = τ_k·(w − h·(J_{k+1}ᵀ w + J_kᵀ ŵ)), τ = 1 − σ."""
    n, s = latents.shape[0], [float(x) for x in sigmas.double()]

    def vjp_at(k):
        x = latents[:, k].detach().clone().requires_grad_(True)
        with torch.enable_grad(), model.adapter_disabled():
            v = model.velocity(x, sigmas[k].expand(n), cond, guidance)
        return lambda u: f64(torch.autograd.grad(v, x, grad_outputs=u.float(), retain_graph=True)[0])

    last = len(s) - 2
    vjp_next = vjp_at(last)
    a = terminal - (s[last] - s[last + 1]) * vjp_next(terminal)
    out = {last: a}
    for k in range(last - 1, -1, -1):
        h, w = s[k] - s[k + 1], a / (1 - s[k + 1])
        slope = vjp_next(w)
        vjp_next = vjp_at(k)
        a = (1 - s[k]) * (w - h * (slope + vjp_next(w - 2 * h * slope)))
        out[k] = a
    return out


def test_adjoint_matching_step_gradient_is_the_control_term_plus_the_adjoint_term_by_hand(tmp_path):
    """docs/math.md#adjoint-matching by hand: at every grid time k with σ_k > 0 (all are loss times here) the residual
    (2/σ_d)·(v_θ − v_base) − σ_d·ã_k, σ_d = sqrt(2σ/(1 − σ)), ã_T = −λ·∇r(x_T) of the redness reward written here on the
    decoded image (x/2 + ½ clamped to [0, 1]), ã_k the lean adjoint by hand; the loss the mean over samples and times of
    ‖residual‖²/D (no clipping). Its gradient splits into the control term ∇‖(2/σ_d)(v_θ − v_base)‖²/D and the adjoint
    term ∇ −2·⟨(2/σ_d)·v_θ, σ_d·ã⟩/D, each checked."""
    settings = {"data.prompts": PROMPTS, "data.num_prompts_per_step": 2, "sampler.num_steps": 3}
    settings |= {"train.all_loss_times_below_sigma": 0.99, "train.num_random_loss_times": 0, "train.use_ema": False}
    settings |= {"train.loss_clip_factor": 0.0, "train.reward_multiplier": 40.0, "train.max_grad_norm": 1e9}
    trainer = build_trainer(toy_config(tmp_path, "adjoint_matching", **settings))
    model, t = trainer.parts.model, trainer.parts.cfg.train
    set_adapter_apart(model, "default", seed=0, scale=0.05)
    steps, seen = OptimizerSteps(trainer), {}
    wrap(trainer, "_adjoint", seen)
    trainer.train_step()
    assert len(steps.grads) == 1
    steps.restore(0)
    latents, sigmas, cond, _, keep = seen["_adjoint"]
    times = [k for k in range(len(sigmas) - 1) if float(sigmas[k]) > 0]
    assert keep == times and len(times) == 3
    x_end = f64(latents[:, -1]).requires_grad_(True)
    images = (x_end / 2 + 0.5).clamp(0, 1)
    (grad,) = torch.autograd.grad((images[:, 0] - images[:, 1:].mean(1)).mean((1, 2)).sum(), x_end)
    adjoints = lean_adjoint_by_hand(model, trainer.guidance, latents, sigmas, cond, -t.reward_multiplier * grad)
    terms, n = {"control": 0.0, "adjoint": 0.0}, latents.shape[0]
    for k in times:
        s = float(sigmas[k])
        s_d = math.sqrt(2 * s / (1 - s))
        v = model.velocity(latents[:, k], sigmas[k].expand(n), cond, trainer.guidance).double()
        with torch.no_grad(), model.adapter_disabled():
            v_base = f64(model.velocity(latents[:, k], sigmas[k].expand(n), cond, trainer.guidance))
        control = (2 / s_d) * (v - v_base)
        terms["control"] = terms["control"] + flat_mean(control**2).mean() / len(times)
        terms["adjoint"] = terms["adjoint"] + flat_mean(2 * control * (-s_d * adjoints[k])).mean() / len(times)
    names, params = trained(trainer)
    assert_terms(steps.grads[0], names, term_gradients(params, terms))
