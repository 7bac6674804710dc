"""What a run's components declare, read by the recipes' composition checks and by `kit.build_parts`
(docs/recipes/compose.md): what a sampler's rollouts carry, what a balancer needs, a sampler's lossy options, and the
refusal of lossy trained transitions for a recipe that takes its ratio to the rollout's log-probs."""

from __future__ import annotations

from flowrl.config import ComponentConfig
from flowrl.registry import BALANCERS, SAMPLERS
from flowrl.types import CARRIES, LOSSES, NEEDS, Lossy


def _declared(kind: str, spec: ComponentConfig, component, method: str, vocabulary: dict) -> frozenset[str]:
    if not callable(getattr(component, method, None)):
        raise ValueError(
            f"{kind} {spec.name!r} declares no {method}(): add one returning a subset of {', '.join(vocabulary)} "
            "(docs/recipes/compose.md)"
        )
    out = frozenset(getattr(component, method)())
    unknown = sorted(out - set(vocabulary))
    if unknown:
        raise ValueError(
            f"{kind} {spec.name!r}: {method}() names {unknown}; the known ones are {', '.join(vocabulary)}"
        )
    return out


def rollout_carries(spec: ComponentConfig) -> frozenset[str]:
    """What the rollouts of sampler `spec` (name + kwargs) carry; the sampler's own argument errors raise here."""
    return _declared("sampler", spec, SAMPLERS.get(spec.name)(**spec.kwargs), "carries", CARRIES)


def balancer_needs(spec: ComponentConfig) -> frozenset[str]:
    """What balancer `spec` (name + kwargs) asks of the trainer; the balancer's own argument errors raise here."""
    return _declared("balancer", spec, BALANCERS.get(spec.name)(**spec.kwargs), "needs", NEEDS)


def rollout_lossy(spec: ComponentConfig) -> tuple[Lossy, ...]:
    """The lossy options of sampler `spec` (name + kwargs): what its `lossy()` declares (flowrl.types.Lossy)."""
    sampler = SAMPLERS.get(spec.name)(**spec.kwargs)
    if not callable(getattr(sampler, "lossy", None)):
        raise ValueError(
            f"sampler {spec.name!r} declares no lossy(): add one returning its lossy options (flowrl.types.Lossy; () "
            "where every transition is the full-precision policy's; docs/recipes/compose.md)"
        )
    out = tuple(sampler.lossy())
    unknown = sorted({option.loss for option in out} - set(LOSSES))
    if unknown:
        raise ValueError(f"sampler {spec.name!r}: lossy() names {unknown}; the known ones are {', '.join(LOSSES)}")
    return out


def lossy_rollout_error(recipe: type, sampler: ComponentConfig, train=None) -> str | None:
    """None unless recipe `recipe` takes its ratio to the rollout's behaviour log-probs (`uses_behaviour_log_probs`)
    and an option of sampler `sampler` draws the transitions it trains with another velocity than the policy's (a
    low precision, a cache; a coarser grid keeps the policy's own log-probs): then the one-line reason and fix.
    Adaptive importance sampling (`train.ais.enabled`) takes the ratio to the policy's own log-probs and is let through
    (docs/recipes/compose.md#lossless-and-lossy-rollouts)."""
    if not getattr(recipe, "uses_behaviour_log_probs", False):
        return None
    ais = getattr(train, "ais", None)
    if ais is not None and ais.enabled:
        return None
    lossy = [option for option in rollout_lossy(sampler) if option.trained and option.loss != "steps"]
    if not lossy:
        return None
    return (
        f"trainer: {recipe.name} takes its ratio to the behaviour log-probs of the transitions it trains, which "
        f"{'; '.join(option.option for option in lossy)} draws with a lossy copy of the policy (not the policy's "
        f"log-probs): {lossy[0].fix}, or set train.ais.enabled=true (the ratio to the policy's own log-probs)"
    )
