"""The time arithmetic of adjoint matching: the memoryless noise schedule and the lean adjoint
(docs/math.md#adjoint-matching).

Part of the SDE layer (flowrl/sde.py owns time; this module continues it for adjoint matching,
because sde.py is at its length budget). σ-time as everywhere in flowrl: `x_σ = (1 − σ)·x0 + σ·ε`, τ = 1 − σ.

    memoryless_diffusion   σ_d(σ) = sqrt(2σ / (1 − σ)), the memoryless schedule's diffusion coefficient
    lean_adjoint           ã along a stored trajectory: 1/τ integrated exactly, a Heun step for the Jacobian term
    adjoint_residual       (2/σ_d)·(v_θ − v_base) − σ_d·ã, the adjoint-matching regression residual

The memoryless SDE of a velocity field v is `dX = (−2v − X/τ) dτ + σ_d dB` in data time τ; one Euler–Maruyama
step from σ to σ' (h = σ − σ') is exactly sde_step's "flow_grpo" kind with a = √2 (`MEMORYLESS_NOISE_LEVEL`):
mean x − h·(2v + x/(1 − σ)), std sqrt(2σh/(1 − σ)).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

MEMORYLESS_NOISE_LEVEL = math.sqrt(2.0)  # a of the flow_grpo step kind that is the memoryless schedule


def memoryless_diffusion(sigma: float | torch.Tensor) -> torch.Tensor:
    """σ_d = sqrt(2σ / (1 − σ)) (float32): in data time τ = 1 − σ, sqrt(2(1 − τ)/τ). Undefined at σ = 1."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    if bool((sigma >= 1).any()) or bool((sigma < 0).any()):
        raise ValueError(f"sigma={sigma.tolist()} must lie in [0, 1): the memoryless schedule is singular at σ = 1")
    return torch.sqrt(2 * sigma / (1 - sigma))


def lean_adjoint(
    base_velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    terminal: torch.Tensor,
    keep: list[int],
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """Integrate the lean adjoint backward along a stored trajectory (latents [N, T+1, ...] at sigmas [T+1]).

    `terminal` [N, ...] is ã_T = −λ·∇r(x_T). The continuous lean adjoint in data time τ = 1 − σ solves
    dã/dτ = (2·J_vᵀ + 1/τ)·ã (J_v the base velocity's Jacobian along the trajectory). Its 1/τ term is singular at the
    noise end and is integrated exactly: w = ã/τ solves dw/dτ = 2·J_vᵀ w, which a Heun step carries from τ_{k+1} back
    to τ_k (h = σ_k − σ_{k+1}, J at the stored states x_{k+1} and x_k):

        w = ã_{k+1}/τ_{k+1},   ŵ = w − 2h·J_{k+1}ᵀ w,   ã_k = τ_k·(w − h·(J_{k+1}ᵀ w + J_kᵀ ŵ)).

    The rollout's last transition (σ_{T−1} → 0) is a plain Euler step x_T = x_{T−1} − h·v(x_{T−1}), whose adjoint is
    its exact derivative: ã_{T−1} = ã_T − h·J_{T−1}ᵀ ã_T. One base forward per stored state x_0 … x_{T−1} and two
    vector-Jacobian products per state (docs/math.md#adjoint-matching). `base_velocity(x [n, ...], sigma [n]) -> v`.
    Returns, for the grid indices in `keep`, ã_k and the base velocity v_base(x_k, σ_k) (both detached, float32).
    """
    num_steps = len(sigmas) - 1
    if latents.shape[1] != num_steps + 1:
        raise ValueError(
            f"latents have {latents.shape[1]} states for a {num_steps}-step grid: need T + 1 = {num_steps + 1}"
        )
    sigmas = sigmas.float()
    if float(sigmas[0]) >= 1:
        raise ValueError(
            f"sigmas start at {float(sigmas[0])}: the lean adjoint is singular at σ = 1; start the grid below 1"
        )
    wanted = set(keep)
    adjoints, velocities = {}, {}

    def linearise(k: int) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """v_base(x_k, σ_k) and the map u -> J(x_k)ᵀ u (the graph kept for two products)."""
        x = latents[:, k].detach().float().requires_grad_(True)
        with torch.enable_grad():
            v = base_velocity(x, sigmas[k].expand(x.shape[0])).float()
        return v.detach(), lambda u: torch.autograd.grad(v, x, grad_outputs=u, retain_graph=True)[0]

    def record(k: int, a: torch.Tensor, v: torch.Tensor) -> None:
        if k in wanted:
            adjoints[k], velocities[k] = a.detach(), v

    k = num_steps - 1  # the last transition: plain Euler
    v_next, vjp_next = linearise(k)
    a = terminal.detach().float()
    a = a - (sigmas[k] - sigmas[k + 1]) * vjp_next(a)
    record(k, a, v_next)
    for k in range(num_steps - 2, -1, -1):
        h, tau, tau_next = sigmas[k] - sigmas[k + 1], 1 - sigmas[k], 1 - sigmas[k + 1]
        w = a / tau_next
        slope_next = vjp_next(w)
        predicted = w - 2 * h * slope_next
        v_k, vjp_k = linearise(k)
        a = tau * (w - h * (slope_next + vjp_k(predicted)))
        record(k, a, v_k)
        vjp_next = vjp_k
    return adjoints, velocities


def adjoint_residual(
    v_theta: torch.Tensor, v_base: torch.Tensor, adjoint: torch.Tensor, sigma: torch.Tensor
) -> torch.Tensor:
    """(2/σ_d)·(v_θ − v_base) − σ_d·ã per element [n, ...] (σ [n], float32): zero at the optimal control.

    In data time with u = −v this is AM's `(2/σ_d)(u_θ − u_base) + σ_d ã` up to the sign, so its square is the same.
    """
    s = memoryless_diffusion(sigma).view(-1, *([1] * (v_theta.ndim - 1)))
    if bool((s == 0).any()):
        raise ValueError("adjoint_residual at σ = 0: the memoryless schedule's loss weight 2/σ_d is infinite there")
    return (2 / s) * (v_theta.float() - v_base.detach().float()) - s * adjoint.detach().float()
