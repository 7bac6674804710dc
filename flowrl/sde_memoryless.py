"""The time arithmetic of adjoint matching: the memoryless noise schedule and the lean adjoint (docs/math.md#adjoint-matching).

Part of the SDE layer (DESIGN.md principle 3: flowrl/sde.py owns time; this module continues it for adjoint matching,
because sde.py is at its length budget). σ-time as everywhere in flowrl: `x_σ = (1 − σ)·x0 + σ·ε`, τ = 1 − σ.

    memoryless_diffusion   σ_d(σ) = sqrt(2σ / (1 − σ)), the memoryless schedule's diffusion coefficient
    lean_adjoint           ã along a stored trajectory, one vector-Jacobian product of the base velocity per step
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

    `terminal` [N, ...] is ã_T = −λ·∇r(x_T). Step k (T − 1 down to 0), with h = σ_k − σ_{k+1}, τ_k = 1 − σ_k and the
    base drift in data time b(x, τ) = −2·v_base(x, σ) − x/τ:

        ã_k = ã_{k+1} + h·∇_x b(x_k, τ_k)ᵀ ã_{k+1} = ã_{k+1} − h·(2·J_vᵀ ã_{k+1} + ã_{k+1}/τ_k),

    the exact discrete adjoint of the Euler–Maruyama step (the Jacobian at the step's start, as the step's drift).
    `base_velocity(x [n, ...], sigma [n]) -> v` is differentiated once per step (one VJP). Returns, for the grid
    indices in `keep`, ã_k and the base velocity v_base(x_k, σ_k) (both detached, float32).
    """
    num_steps = len(sigmas) - 1
    if latents.shape[1] != num_steps + 1:
        raise ValueError(f"latents have {latents.shape[1]} states for a {num_steps}-step grid: need T + 1 = {num_steps + 1}")
    wanted = set(keep)
    adjoints, velocities = {}, {}
    a = terminal.detach().float()
    sigmas = sigmas.float()
    for k in range(num_steps - 1, -1, -1):
        sigma, h = sigmas[k], sigmas[k] - sigmas[k + 1]
        x = latents[:, k].detach().float().requires_grad_(True)
        with torch.enable_grad():
            v = base_velocity(x, sigma.expand(x.shape[0])).float()
            (vjp,) = torch.autograd.grad(v, x, grad_outputs=a)
        a = a - h * (2 * vjp + a / (1 - sigma))
        if k in wanted:
            adjoints[k], velocities[k] = a.detach(), v.detach()
    return adjoints, velocities


def adjoint_residual(v_theta: torch.Tensor, v_base: torch.Tensor, adjoint: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """(2/σ_d)·(v_θ − v_base) − σ_d·ã per element [n, ...] (σ [n], float32): zero at the optimal control.

    In data time with u = −v this is AM's `(2/σ_d)(u_θ − u_base) + σ_d ã` up to the sign, so its square is the same.
    """
    s = memoryless_diffusion(sigma).view(-1, *([1] * (v_theta.ndim - 1)))
    if bool((s == 0).any()):
        raise ValueError("adjoint_residual at σ = 0: the memoryless schedule's loss weight 2/σ_d is infinite there")
    return (2 / s) * (v_theta.float() - v_base.detach().float()) - s * adjoint.detach().float()
