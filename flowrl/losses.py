"""Losses of the trainers, each a few lines over per-sample tensors (docs/math.md#clipped-surrogate,
#kl-to-the-reference, #diffusionnft; AWM: docs/recipes/awm.md; DGPO: docs/recipes/dgpo.md; GDRO:
docs/recipes/gdro.md)."""

from __future__ import annotations

import torch

from flowrl import sde

ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")


def clipped_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO surrogate per sample: max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)), ρ = exp(ℓ_θ − ℓ_old). All [n].

    Returns (loss [n], stats) with stats: ratio [n], clipped [n] bool (|ρ − 1| > ε), approx_kl [n] = ½(ℓ_θ − ℓ_old)².
    """
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped)
    stats = {
        "ratio": ratio.detach(),
        "clipped": ((ratio.detach() - 1.0).abs() > clip_range),
        "approx_kl": 0.5 * log_ratio.detach() ** 2,
    }
    return loss, stats


def ais_mixture(log_weights: torch.Tensor, max_weight: float, reduce=None) -> tuple[torch.Tensor, dict[str, float]]:
    """Adaptive importance sampling of transitions drawn by a behaviour policy q (a preview) for a policy p
    (docs/math.md#adaptive-importance-sampling). log_weights [n] = log p − log q of the batch's trained transitions.

    w = exp(log_weights); w̃ = min(w / mean(w), max_weight) (self-normalised, truncated); diagnostics: reliability
    ESS = (Σw)² / (n·Σw²), divergence KL̂ = mean(w − 1 − log w) (an estimate of KL(q‖p) ≥ 0 per term), variance
    V = var(w̃); λ = ESS · exp(−KL̂) / (1 + V) in (0, 1]. Returns the per-transition coefficient c = (1 − λ) + λ·w̃
    [n] (float32) that multiplies the advantage: λ = 1 is the importance-weighted gradient, λ = 0 the uncorrected one,
    and w ≡ 1 gives c ≡ 1 (the plain gradient). `reduce` sums a tensor over processes (None: one process)."""
    total = reduce or (lambda t: t)
    lw = log_weights.detach().double()
    w = lw.exp()
    n = total(torch.tensor(float(w.numel()), dtype=torch.float64, device=w.device))
    s1, s2 = total(w.sum()), total((w * w).sum())
    kl = total((w - 1.0 - lw).sum()) / n
    ess = s1 * s1 / (n * s2)
    tilde = (w / (s1 / n)).clamp(max=max_weight)
    m1, m2 = total(tilde.sum()) / n, total((tilde * tilde).sum()) / n
    var = (m2 - m1 * m1).clamp(min=0.0)
    lam = ess * torch.exp(-kl) / (1.0 + var)
    coef = (1.0 - lam) + lam * tilde
    stats = {"ais/lambda": float(lam), "ais/ess": float(ess), "ais/kl": float(kl), "ais/weight_var": float(var)}
    stats["ais/weight_max"] = float(w.max()) if w.numel() else 1.0
    return coef.float(), stats


def nft_reward(advantages: torch.Tensor, adv_clip_max: float, adv_mode: str = "all") -> torch.Tensor:
    """DiffusionNFT's optimality probability r = clamp(A / (2·A_max) + 1/2, 0, 1) of A = clip(Â, ±A_max) [n].

    `adv_mode` first maps A: 'positive_only' max(A, 0), 'negative_only' min(A, 0), 'one_only' 1[A > 0], 'binary'
    sign(A).
    """
    if adv_mode not in ADV_MODES:
        raise ValueError(f"train.adv_mode={adv_mode!r} must be one of {', '.join(ADV_MODES)}")
    a = advantages.float().clamp(-adv_clip_max, adv_clip_max)
    if adv_mode == "positive_only":
        a = a.clamp(min=0)
    elif adv_mode == "negative_only":
        a = a.clamp(max=0)
    elif adv_mode == "one_only":
        a = (a > 0).float()
    elif adv_mode == "binary":
        a = torch.sign(a)
    return (a / (2 * adv_clip_max) + 0.5).clamp(0.0, 1.0)


def _self_normalised_x0_loss(x_t: torch.Tensor, v: torch.Tensor, x0: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """mean((x̂0 − x0)²) / sg(max(mean|x̂0 − x0|, 1e-5)) per sample, x̂0 = x_t − σ·v; the weight in float64."""
    x0_hat = sde.x0_from_velocity(x_t, v, sigma)
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x0_hat.double() - x0.double()).abs().mean(dims).clamp(min=1e-5)  # [n] float64
    return ((x0_hat - x0) ** 2).mean(dims).double().div(weight).float()


def velocity_kl(v_theta: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """DiffusionNFT's KL to the reference per sample: mean over elements of (v_θ − sg(v_ref))². [n]"""
    return ((v_theta.float() - v_ref.detach().float()) ** 2).mean(tuple(range(1, v_theta.ndim)))


def blended_velocity(velocities: torch.Tensor, mix: torch.Tensor) -> torch.Tensor:
    """SMOPD's multi-teacher target v̄ = Σ_k λ_k·v_k (docs/recipes/smopd.md): teachers' velocities [K, n, ...], mix λ
    [K] (or [K, n], a mix per sample), each column summing to 1 -> [n, ...]. Since Σ_k λ_k·||v − v_k||² =
    ||v − v̄||² + Σ_k λ_k·||v_k − v̄||², distilling v̄ has the λ-weighted multi-teacher loss's gradient."""
    lam = mix.to(velocities).reshape(*mix.shape, *([1] * (velocities.ndim - mix.ndim)))  # [K, (n,) 1, ...]
    return (lam * velocities).sum(0)


def velocity_distill_loss(v_student: torch.Tensor, target: torch.Tensor, self_normalised: bool = True) -> torch.Tensor:
    """On-policy distillation per sample [n] (docs/recipes/smopd.md): mean over elements of d² with d = v_S − sg(v_T),
    self-normalised (DiffusionOPD's option) by sg(mean|d| + 1e-8), so its gradient has the scale of NFT's
    self-normalised x0 loss however close the teachers are; plain mean(d²) without."""
    squared = velocity_kl(v_student, target)  # [n]
    if not self_normalised:
        return squared
    d = (v_student.detach().float() - target.detach().float()).abs()
    return squared / (d.mean(tuple(range(1, d.ndim))) + 1e-8)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_ref: torch.Tensor | None,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    sigma: torch.Tensor,
    advantages: torch.Tensor,
    adv_clip_max: float,
    nft_beta: float,
    kl_coef: float,
    adv_mode: str = "all",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DiffusionNFT's forward-process loss per sample [n] (docs/math.md#diffusionnft).

    Implicit policies v⁺ = β·v_θ + (1 − β)·sg(v_old), v⁻ = (1 + β)·sg(v_old) − β·v_θ, each scored by the
    self-normalised x0 regression; policy term (A_max/β)·(r·L⁺ + (1 − r)·L⁻); plus kl_coef·mean((v_θ − v_ref)²)
    (v_ref None = no KL term). `sigma` [n] is the training time of each sample, x_t = (1 − σ)·x0 + σ·ε.
    """
    v_theta, x0 = v_theta.float(), x0.float()
    v_old = v_old.detach().float()
    r = nft_reward(advantages, adv_clip_max, adv_mode)  # [n]
    positive = _self_normalised_x0_loss(x_t, nft_beta * v_theta + (1 - nft_beta) * v_old, x0, sigma)  # [n]
    negative = _self_normalised_x0_loss(x_t, (1 + nft_beta) * v_old - nft_beta * v_theta, x0, sigma)  # [n]
    policy = (adv_clip_max / nft_beta) * (r * positive + (1 - r) * negative)  # [n]
    kl = velocity_kl(v_theta, v_ref) if v_ref is not None else torch.zeros_like(policy)
    stats = {
        "policy_loss": policy.detach(),
        "kl": kl.detach(),
        "r": r,
        "positive_loss": positive.detach(),
        "negative_loss": negative.detach(),
    }
    return policy + kl_coef * kl, stats


def ram_target(
    v_ref: torch.Tensor,
    v_old: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    advantages: torch.Tensor,
    multiplier: float,
) -> torch.Tensor:
    """RAM's regression target sg[v_ref + m·A·((ε − x0) − v_old)] (docs/math.md#reinforce-adjoint-matching), float32.

    `advantages` [n] (one per endpoint), the rest [n, ...]: with m·A = 1 and v_old = v_ref it is the flow-matching
    target ε − x0; with A = 0 it is v_ref.
    """
    scale = (multiplier * advantages.float()).view(-1, *([1] * (x0.ndim - 1)))  # [n, 1, ...]
    residual = noise.float() - x0.float() - v_old.detach().float()
    return (v_ref.detach().float() + scale * residual).detach()


def ram_loss(v_theta: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean((v_θ − target)²) per sample [n]; only v_θ carries a gradient."""
    return ((v_theta.float() - target.detach()) ** 2).mean(tuple(range(1, target.ndim)))


def adjoint_matching_loss(residual: torch.Tensor, clip: float | None) -> torch.Tensor:
    """Adjoint matching's per-sample term [n]: min(clip, Σ residual²) / D, the squared norm clipped per term (AM: clip
    1.6·λ²; None = no clipping) and divided by the element count D (flowrl's mean reduction, Decision 8)."""
    squared = residual.float().pow(2).flatten(1).sum(1)  # [n]
    if clip is not None:
        squared = squared.clamp(max=clip)
    return squared / residual[0].numel()


AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")


def awm_weighting(
    error: torch.Tensor, sigma: torch.Tensor, weighting: str = "ghuber", power: float = 0.25
) -> torch.Tensor:
    """AWM's weighted flow-matching error W(ℓ, t) per sample [n], float64 (docs/recipes/awm.md#the-loss); `error` ℓ ≥ 0
    and `sigma` t, both [n]. 'uniform' ℓ, 't' t·ℓ, 't2' t²·ℓ, 'huber' t·(√(ℓ + 1e-10) − 1e-5), 'ghuber' (generalized
    Huber) (t/p)·((ℓ + 1e-10)^p − (1e-10)^p), whose derivative in ℓ is t·(ℓ + 1e-10)^(p − 1)."""
    ell, t = error.double(), sigma.double()
    if weighting == "uniform":
        return ell
    if weighting == "t":
        return t * ell
    if weighting == "t2":
        return t * t * ell
    if weighting == "huber":
        return t * (torch.sqrt(ell + 1e-10) - 1e-5)
    if weighting == "ghuber":
        return t / power * ((ell + 1e-10) ** power - 1e-10**power)
    raise ValueError(f"train.weighting={weighting!r} must be one of {', '.join(AWM_WEIGHTINGS)}")


def awm_log_prob(
    v_theta: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    weighting: str = "ghuber",
    power: float = 0.25,
) -> torch.Tensor:
    """AWM's "log-likelihood" −W(ℓ, t) per sample [n], float64, of ℓ = mean over elements of (v_θ − (ε − x0))², the
    flow-matching error of v_θ at x_t = (1 − t)·x0 + t·ε (`sigma` t [n])."""
    target = noise.double() - x0.double()
    error = ((v_theta.double() - target) ** 2).mean(tuple(range(1, v_theta.ndim)))
    return -awm_weighting(error, sigma, weighting, power)


def awm_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    advantages: torch.Tensor,
    adv_clip_max: float,
    advantage_max: float,
    clip_range: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AWM's policy term per sample [n]: the clipped surrogate max(−Â·ρ, −Â·clip(ρ, 1 − c, 1 + c)) of
    ρ = exp(log p − sg(log p_old)) and Â = clip(A, ±A_max) / A_max · advantage_max. `old_log_probs` None: on policy,
    log p_old = sg(log p), so ρ ≡ 1 exactly and the gradient is ∇ Â·W(ℓ, t). All float64."""
    scaled = advantages.double().clamp(-adv_clip_max, adv_clip_max) / adv_clip_max * advantage_max
    old = log_probs.detach() if old_log_probs is None else old_log_probs.detach().double()
    return clipped_policy_loss(log_probs, old, scaled, clip_range)


def dsm_loss(v_theta: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """DGPO's denoising loss ℓ per sample [n], float64: the mean over elements of (v − (ε − x0))²
    (docs/recipes/dgpo.md)."""
    return ((v_theta.double() - (noise.double() - x0.double())) ** 2).mean(tuple(range(1, v_theta.ndim)))


def group_scores(terms: torch.Tensor, group_ids: torch.Tensor, gather=None) -> torch.Tensor:
    """S_g of each local sample [n]: the sum of `terms` [n] over every sample of its group on every process (`gather`:
    concatenates a tensor's rows over the processes in process order; None on one process). float64."""
    rows = torch.stack([group_ids.to(terms).double(), terms.double()], 1)  # [n, 2]; ids exact below 2^53
    every = rows if gather is None else gather(rows)  # [M, 2]
    ids = every[:, 0].long()
    sums = torch.zeros(int(ids.max()) + 1, dtype=torch.float64, device=terms.device).index_add_(0, ids, every[:, 1])
    return sums[group_ids.to(terms.device).long()]


def dgpo_loss(
    loss_theta: torch.Tensor,
    loss_ref: torch.Tensor,
    loss_old: torch.Tensor | None,
    advantages: torch.Tensor,
    group_ids: torch.Tensor,
    beta_dpo: float,
    group_size: int,
    clip_range: float,
    gather=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DGPO's per-sample loss [n] (float64), the gradient-equivalent form of −log σ(−S_g) summed over groups:
    w_g·A·ℓ̃ with δ = sg(ℓ_θ − ℓ_ref), S_g = Σ_{i∈g} A_i·β·δ_i / G over every process, w_g = sg(σ(S_g)); ℓ̃ = sg(ℓ_θ)
    where the PPO-style clip binds, ρ = exp(ℓ_old − ℓ_θ) (`loss_old` None: no clip): A > 0 and ρ > 1 + c, or A ≤ 0 and
    ρ < 1 − c. Its gradient is (G/β)·Σ_g ∇[−log σ(−S_g)] per sample of the mean (docs/recipes/dgpo.md#the-loss)."""
    a = advantages.double()
    delta = loss_theta.detach().double() - loss_ref.detach().double()
    scores = group_scores(a * beta_dpo * delta / group_size, group_ids, gather)  # [n]
    weight = torch.sigmoid(scores)
    ratio = (
        torch.ones_like(a) if loss_old is None else torch.exp(loss_old.detach().double() - loss_theta.detach().double())
    )
    clipped = ((a > 0) & (ratio > 1 + clip_range)) | ((a <= 0) & (ratio < 1 - clip_range))
    if loss_old is None:
        clipped = torch.zeros_like(clipped)
    ell = torch.where(clipped, loss_theta.detach().double(), loss_theta.double())
    stats = {"group_score": scores, "group_weight": weight, "ratio": ratio, "clipped": clipped, "delta": delta}
    return weight * a * ell, stats


GDRO_MODES = ("pl", "top1", "rank")


def gdro_implicit_reward(loss_theta: torch.Tensor, loss_ref: torch.Tensor, beta: float) -> torch.Tensor:
    """GDRO's implicit reward s = −β·(ℓ_θ − ℓ_ref) per item, ℓ the dsm_loss of θ and of the reference (adapters off)
    at one (t, ε) (docs/recipes/gdro.md#the-loss). float64, the gradient through ℓ_θ only."""
    return -beta * (loss_theta.double() - loss_ref.detach().double())


def gdro_loss(
    s: torch.Tensor, r: torch.Tensor, tau: float, mode: str = "pl", generator: torch.Generator | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GDRO's group loss per group [G] (float64) of implicit rewards `s` [G, k] and explicit rewards `r` [G, k]:
    with items sorted by r descending, q_i(j) = softmax_{j≥i}(r_j/τ) and the Plackett–Luce cross-entropy
    'pl' Σ_{i<k} [log Σ_{m≥i} e^{s_m} − Σ_{j≥i} q_i(j)·s_j], 'top1' its i = 1 term, 'rank' the τ → 0 limit
    Σ_{i<k} [log Σ_{m≥i} e^{s_m} − s_i] (τ = 0 in 'pl' is the same). Ties keep their input order (a stable sort), or a
    random one drawn from `generator`. A group whose rewards are all equal has no signal: loss 0, `signal` False.
    Stats: `top` [G] the input position of the first-ranked item, `signal` [G] bool, `order` [G, k] the ranking."""
    if mode not in GDRO_MODES or tau < 0:
        raise ValueError(f"train.mode={mode!r} must be one of {', '.join(GDRO_MODES)} and train.tau={tau} >= 0")
    s, r = s.double(), r.double()
    g, k = s.shape
    shuffle = None if generator is None else torch.stack([torch.randperm(k, generator=generator) for _ in range(g)])
    if shuffle is not None:
        shuffle = shuffle.to(s.device)
        s, r = s.gather(1, shuffle), r.gather(1, shuffle)
    order = torch.sort(r, dim=1, descending=True, stable=True).indices  # [G, k]
    s_sorted, r_sorted = s.gather(1, order), r.gather(1, order)
    later = torch.ones(k, k, dtype=torch.bool, device=s.device).triu()  # [i, j]: j ≥ i
    logits = s_sorted[:, None, :].masked_fill(~later, float("-inf"))  # [G, k, k]
    if mode == "rank" or tau == 0:
        q = torch.eye(k, dtype=s.dtype, device=s.device).expand(g, k, k)
    else:
        q = torch.softmax((r_sorted[:, None, :] / tau).masked_fill(~later, float("-inf")), dim=2)
    terms = torch.logsumexp(logits, dim=2) - (q * s_sorted[:, None, :]).sum(2)  # [G, k]
    terms = terms[:, :1] if mode == "top1" else terms[:, : k - 1]
    signal = r_sorted[:, 0] > r_sorted[:, -1]
    loss = torch.where(signal, terms.sum(1), torch.zeros_like(terms[:, 0]))
    if shuffle is not None:
        order = shuffle.gather(1, order)
    return loss, {"top": order[:, 0], "signal": signal, "order": order}
