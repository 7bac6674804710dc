"""The shape of the recipes (docs/design: recipes compose, never inherit; declarations, not names).

A recipe class (every entry of flowrl.trainers.TRAINERS, and every recipe class of flowrl/experimental/) never
subclasses another recipe class: a recipe that builds on another calls its functions (`grpo_optimise`,
`nft_optimise`, `nft_step`, ...). And no module compares a trainer's or a balancer's registry name outside that
recipe's or balancer's own file: what other modules need to know, a recipe or a balancer declares (`trains_on`,
`adapter_copies`, `combines_rewards_linearly`, ...). The check reads every comparison (==, !=, in, not in) of
flowrl/, samplers/ and rewards/ with `ast`, so a name in a docstring, a message or a registry key is no comparison.
"""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import flowrl.experimental
from flowrl.registry import BALANCERS
from flowrl.trainers import TRAINERS

REPO = Path(__file__).resolve().parents[2]

# (file, the name compared): why the comparison is not a test of a recipe's or a balancer's identity
ALLOWED = {
    ("flowrl/balancers/_common.py", "tail"): "the value 'tail' of the option per_reward_estimator, not the balancer",
}


def recipe_classes() -> dict[str, type]:
    """{qualified name: class} of every recipe: the registry's and every class of flowrl/experimental/ that has a
    config class and a training step."""
    found = {f"{cls.__module__}.{cls.__qualname__}": cls for cls in TRAINERS.values()}
    for info in pkgutil.iter_modules(flowrl.experimental.__path__):
        module = importlib.import_module(f"flowrl.experimental.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and hasattr(cls, "config_class") and hasattr(cls, "train_step"):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return found


def test_no_recipe_class_subclasses_another():
    recipes = recipe_classes()
    assert "flowrl.experimental.tagrpo.TAGRPOTrainer" in recipes and len(recipes) >= len(TRAINERS)
    inherited = [
        f"{name} subclasses {base.__module__}.{base.__qualname__}"
        for name, cls in recipes.items()
        for base in cls.__mro__[1:]
        if base in recipes.values()
    ]
    assert not inherited, "a recipe composes another recipe's functions instead:\n" + "\n".join(inherited)


def own_files(name: str) -> set[str]:
    """The files that may compare `name`: its recipe's file and its balancer's file."""
    files = set()
    if name in TRAINERS:
        files.add(str(Path(inspect.getfile(TRAINERS[name])).resolve().relative_to(REPO)))
    if name in BALANCERS.names():
        files.add(str(Path(inspect.getfile(BALANCERS.get(name))).resolve().relative_to(REPO)))
    return files


def compared_names(path: Path, names: set[str]) -> list[tuple[int, str, str]]:
    """(line, name, source) of every comparison in `path` with a string constant, or a tuple / list / set of them,
    that is one of `names` on either side."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            items = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            for item in items:
                if isinstance(item, ast.Constant) and item.value in names:
                    out.append((node.lineno, item.value, ast.unparse(node)))
    return out


def test_no_trainer_or_balancer_name_is_compared_outside_its_own_file():
    names = set(TRAINERS) | set(BALANCERS.names())
    found = []
    for folder in ("flowrl", "samplers", "rewards"):
        for path in sorted((REPO / folder).rglob("*.py")):
            file = str(path.relative_to(REPO))
            for line, name, source in compared_names(path, names):
                if file not in own_files(name) and (file, name) not in ALLOWED:
                    found.append(f"{file}:{line}: {source}")
    assert not found, "read the recipe's or the balancer's declaration instead of its name:\n" + "\n".join(found)


def test_the_name_check_sees_the_comparisons_it_forbids(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text(
        'if cfg.trainer == "grpo" or trainer in ("nft", "awm") or balancer.name != "weighted_sum":\n'
        '    message = "trainer grpo"\n'
    )
    found = compared_names(source, set(TRAINERS) | set(BALANCERS.names()))
    assert sorted(name for _, name, _ in found) == ["awm", "grpo", "nft", "weighted_sum"]
