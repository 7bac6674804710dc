"""The composition matrix: every registered sampler x trainer x balancer, and whether it runs (docs/recipes/compose.md).

    flowrl recipes            # the table: which combination works, and why not where not
    flowrl recipes --json     # [{"sampler", "rollout", "trainer", "balancer", "works", "why", "shapes_world"}, ...]

Nothing here decides. A sampler states what its rollouts carry (`carries()`) and which of its options are lossy
(`lossy()`, the matrix's `rollouts` mark), a balancer what it asks of the trainer (`needs()`), and each trainer class
judges a (sampler, balancer) pair in its `composition_error` classmethod, the very check its constructor and
`build_trainer` raise, before any model is built; the kit refuses lossy trained transitions for a recipe that takes
its ratio to their log-probs (`uses_behaviour_log_probs`, kit.lossy_rollout_error). This module only enumerates
the registries, with the sub-variants a component lists in its `recipe_variants` (a new sampler, trainer or balancer
joins the matrix by being registered; a trainer's variants are options of its train config, e.g. `grpo(guard)`), and
asks each trainer.
"""

from __future__ import annotations

import json

from flowrl.config import ComponentConfig
from flowrl.registry import BALANCERS, SAMPLERS, Registry


def variants(registry: Registry) -> list[tuple[str, ComponentConfig]]:
    """(label, config) of every registered entry: one per `recipe_variants` item ("" = the defaults), labelled
    `name(variant)`; an entry without `recipe_variants` gives one row with its defaults."""
    out = []
    for name in registry.names():
        for key, kwargs in getattr(registry.get(name), "recipe_variants", {"": {}}).items():
            out.append((f"{name}({key})" if key else name, ComponentConfig(name, dict(kwargs))))
    return out


def trainer_variants() -> list[tuple[str, str, dict]]:
    """(label, trainer, train keys) of every entry of TRAINERS: one per item of its class's `recipe_variants` ("" = the
    defaults), labelled `name(variant)`; a class without `recipe_variants` gives one row with its defaults."""
    from flowrl.trainers import TRAINERS

    out = []
    for name, cls in TRAINERS.items():
        for key, train in getattr(cls, "recipe_variants", {"": {}}).items():
            out.append((f"{name}({key})" if key else name, name, dict(train)))
    return out


def composition_error(
    trainer: str, sampler: ComponentConfig, balancer: ComponentConfig, train=None, rewards=()
) -> str | None:
    """None where the triple runs, else the one-line reason and fix: the trainer's own check, then the kit's refusal
    of lossy trained transitions for a ratio to the behaviour log-probs (kit.lossy_rollout_error), or the error a
    sampler or balancer raises for its own arguments (what `build_trainer` raises for the same config)."""
    from flowrl.trainers import kit, trainer_class

    recipe = trainer_class(trainer)
    try:
        return recipe.composition_error(sampler, balancer, train, rewards) or kit.lossy_rollout_error(
            recipe, sampler, train
        )
    except ValueError as err:
        return str(err)


def rollout_mark(sampler: ComponentConfig) -> str:
    """The matrix's mark of a sampler variant: `lossless` where every transition is the full-precision policy's;
    `lossless (previews: <losses>)` where lossy options only make previews that rank seeds; `lossy (<losses>)` where
    they make the trained transitions (flowrl.types.LOSSES: precision, cache, steps); "" where the sampler refuses
    its own arguments."""
    from flowrl.trainers import kit

    try:
        lossy = kit.rollout_lossy(sampler)
    except ValueError:
        return ""
    trained = list(dict.fromkeys(option.loss for option in lossy if option.trained))
    previews = list(dict.fromkeys(option.loss for option in lossy if not option.trained))
    if trained:
        return f"lossy ({', '.join(trained)})"
    return f"lossless (previews: {', '.join(previews)})" if previews else "lossless"


def shapes_world(trainer: str) -> str:
    """What the trainer's class states about learning on the Shapes world (`shapes_world`, a class attribute): "" where
    its toy config learns the gold, else one line with the page that reports what was tried."""
    from flowrl.trainers import trainer_class

    return getattr(trainer_class(trainer), "shapes_world", "")


def matrix() -> list[dict]:
    """One row per (sampler variant, trainer variant, balancer variant): {"sampler", "rollout", "trainer", "balancer",
    "works", "why", "shapes_world"}; `rollout` is the sampler's mark (`rollout_mark`); a trainer variant is judged with
    its train keys on the recipe's defaults; `shapes_world` is "" or the line that says the recipe does not learn the
    toy world (`shapes_world` above)."""
    from flowrl.trainers import trainer_class

    rows = []
    for sampler_label, sampler in variants(SAMPLERS):
        mark = rollout_mark(sampler)
        for trainer_label, trainer, keys in trainer_variants():
            train = trainer_class(trainer).config_class(**keys) if keys else None
            note = shapes_world(trainer)
            for balancer_label, balancer in variants(BALANCERS):
                why = composition_error(trainer, sampler, balancer, train)
                rows.append(
                    {
                        "sampler": sampler_label,
                        "rollout": mark,
                        "trainer": trainer_label,
                        "balancer": balancer_label,
                        "works": why is None,
                        "why": why or "",
                        "shapes_world": note,
                    }
                )
    return rows


def format_table(rows: list[dict]) -> str:
    """A markdown table, one line per (sampler, trainer), its rollouts' mark (`rollout_mark`), one column per
    balancer: `yes`, or the number of the reason listed under the table; a trainer that does not learn the Shapes
    world is marked † and its line listed."""
    balancers = list(dict.fromkeys(r["balancer"] for r in rows))
    reasons: dict[str, int] = {}
    cells: dict[tuple[str, str], dict[str, str]] = {}
    marks = {r["sampler"]: r["rollout"] for r in rows}
    for r in rows:
        if r["works"]:
            cell = "yes"
        else:
            cell = f"no ({reasons.setdefault(r['why'], len(reasons) + 1)})"
        cells.setdefault((r["sampler"], r["trainer"]), {})[r["balancer"]] = cell
    head = "| sampler | rollouts | trainer | " + " | ".join(balancers) + " |"
    lines = [head, "|---|---|---|" + "---|" * len(balancers)]
    notes = {r["trainer"]: r["shapes_world"] for r in rows if r.get("shapes_world")}
    for (sampler, trainer), row in cells.items():
        label = f"{trainer} †" if trainer in notes else trainer
        cells_text = " | ".join(row.get(b, "") for b in balancers)
        lines.append(f"| {sampler} | {marks[sampler]} | {label} | {cells_text} |")
    works = sum(r["works"] for r in rows)
    lines += ["", f"{works} of {len(rows)} combinations run; why not, where not:", ""]
    lines += [f"{n}. {why}" for why, n in reasons.items()]
    if notes:
        lines += ["", "† does not learn the Shapes world (its config runs; what was tried is on its page):", ""]
        lines += [f"- {trainer}: {note}" for trainer, note in notes.items()]
    return "\n".join(lines)


def print_matrix(as_json: bool = False) -> int:
    """`flowrl recipes [--json]`: the matrix as the table, or as a JSON list of its rows."""
    rows = matrix()
    print(json.dumps(rows, indent=1, ensure_ascii=False) if as_json else format_table(rows))
    return 0
