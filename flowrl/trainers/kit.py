"""The recipe kit: what every recipe calls, so that a recipe file holds only its config, its `composition_error`,
its loss stage and its own saved state (DESIGN.md principle 1).

What a component offers a recipe is declared, not looked up by name: a sampler states what its rollouts carry
(`carries()`), a balancer what it asks of the trainer (`needs()`), in the vocabularies below.
"""

from __future__ import annotations

from flowrl.config import ComponentConfig
from flowrl.registry import BALANCERS, SAMPLERS

CARRIES = {  # what a sampler's rollouts may hold (Sampler.carries())
    "clean_endpoints": "the clean endpoint x0 of every sample",
    "log_probs": "behaviour log-probs of stochastic transitions (a policy-gradient ratio can be taken)",
    "per_edge": "transitions shared by several samples (a tree's edges): credit is per edge, not per sample",
    "memoryless": "the memoryless SDE of the current model on a grid short of σ = 1 (adjoint matching's law)",
}
NEEDS = {  # what a balancer may ask of the trainer (Balancer.needs()), beyond one advantage per sample
    "sample_mask": "the samples the balancer's `keep` masks take no part in the loss",
    "reward_gradients": "each reward's loss is backpropagated on its own (MARBLE balances the K gradients)",
    "per_sample_advantages": "a sample's advantage trains its whole rollout (not fused up a tree's edges)",
    "affine_loss": "the loss's gradient is affine in the advantage, so one backward on Σ α_k A_k = Σ α_k ∇ℓ(A_k)",
}


def _declared(kind: str, spec: ComponentConfig, component, method: str, vocabulary: dict) -> frozenset[str]:
    if not callable(getattr(component, method, None)):
        raise ValueError(
            f"{kind} {spec.name!r} declares no {method}(): add one returning a subset of {', '.join(vocabulary)} "
            "(docs/recipes/compose.md)"
        )
    out = frozenset(getattr(component, method)())
    unknown = sorted(out - set(vocabulary))
    if unknown:
        raise ValueError(f"{kind} {spec.name!r}: {method}() names {unknown}; the known ones are {', '.join(vocabulary)}")
    return out


def rollout_carries(spec: ComponentConfig) -> frozenset[str]:
    """What the rollouts of sampler `spec` (name + kwargs) carry; the sampler's own argument errors raise here."""
    return _declared("sampler", spec, SAMPLERS.get(spec.name)(**spec.kwargs), "carries", CARRIES)


def balancer_needs(spec: ComponentConfig) -> frozenset[str]:
    """What balancer `spec` (name + kwargs) asks of the trainer; the balancer's own argument errors raise here."""
    return _declared("balancer", spec, BALANCERS.get(spec.name)(**spec.kwargs), "needs", NEEDS)
