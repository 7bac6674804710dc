"""The layout shows the architecture: the import graph of the package has no cycle, and its arrows point one way, down
the layers (a module imports from its own layer or a lower one); every package folder is packaged; recipes stay
within their length budgets.

The graph holds every import of every module (function-level and TYPE_CHECKING ones too), read with `ast` from
flowrl/ and the plugin folders that pyproject.toml maps into it (rewards/ -> flowrl.rewards, samplers/ ->
flowrl.samplers). `from flowrl.x import y` is an arrow to flowrl.x.y where that is a module, else to flowrl.x; importing
a submodule is not counted as importing its parent package.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "flowrl"

# Lowest first. A module's layer is that of the longest name listed here that is the module or a package above it (the
# bare `flowrl` names only its own __init__). The dependency direction: scripts and cli -> trainers -> components ->
# samplers, rewards, balancers -> sde, types, registry.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundations",  # pure components and data contracts: time, seeds, advantages, losses, formats, files, registry
        (
            "flowrl",
            "flowrl.registry",
            "flowrl.types",
            "flowrl.sde",
            "flowrl.sde_memoryless",
            "flowrl.schedules",
            "flowrl.seeds",
            "flowrl.advantages",
            "flowrl.losses",
            "flowrl.quant",
            "flowrl.ranking",
            "flowrl.media",
            "flowrl.hub",
            "flowrl.environment",
            "flowrl.work",
            "flowrl.prompt_sets",
        ),
    ),
    ("toy world", ("flowrl.toy",)),  # the Shapes world: renderer, prompts, exact gold, judges, shipped weights
    ("models", ("flowrl.models",)),  # adapters over diffusers classes (the toy model reads the world's renders)
    ("plugins", ("flowrl.samplers", "flowrl.rewards", "flowrl.balancers", "flowrl.reward_contract")),
    ("serving", ("flowrl.serving",)),  # a registered reward served over HTTP (in process or on Ray Serve)
    ("config", ("flowrl.config",)),  # the run config: imports no recipe
    ("training", ("flowrl.training",)),  # the components every recipe calls
    ("recipes", ("flowrl.trainers", "flowrl.experimental")),
    ("cost model", ("flowrl.plan",)),  # `flowrl plan`: a recipe's step priced and sized at real size
    ("reports", ("flowrl.report",)),  # grids, curves, the hacking panel
    # the toy world's held-out numbers (the panel's read names from reports); the published benchmarks (flowrl eval)
    ("held-out grading", ("flowrl.heldout", "flowrl.benchmarks")),
    ("demo", ("flowrl.demo",)),  # `flowrl demo`: grades with flowrl.heldout and never imports a benchmark
    ("benchmarks", ("flowrl.bench",)),  # `flowrl bench ...`: may run the demo's config
    ("commands", ("flowrl.cli", "flowrl.cli_rewards", "flowrl.cli_prompts")),
]
LAYER = {name: (rank, title) for rank, (title, names) in enumerate(LAYERS) for name in names}

RECIPE_BUDGET = 260  # lines of a recipe file: only what is particular to its algorithm, the rest from the kit
BUDGETS = {  # flowrl/trainers/kit.py carries the plumbing; GRPO's recipe, the reference one, has more of its own
    "flowrl/trainers/grpo.py": 350,
    **{
        f"flowrl/trainers/{name}.py": RECIPE_BUDGET
        for name in ("nft", "ram", "awm", "dgpo", "gdro", "adjoint", "adv_grpo", "smopd", "elbo")
    },
    "flowrl/experimental/tagrpo.py": 400,  # experimental: its alignment math inline until it earns a recipe's budget
}


def package_folders() -> dict[str, Path]:
    """{package: folder}: flowrl/ and the folders pyproject.toml's [tool.setuptools.package-dir] maps into it."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    mapped = pyproject["tool"]["setuptools"].get("package-dir", {})
    return {PACKAGE: REPO / PACKAGE, **{name: REPO / folder for name, folder in mapped.items()}}


def modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the package."""
    out = {}
    for prefix, folder in package_folders().items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            name = ".".join([prefix, *parts])
            if name in out:
                raise AssertionError(f"module {name} is both {out[name]} and {path}")
            out[name] = path
    return out


def _resolve(target: str, known: dict[str, Path]) -> str | None:
    """The longest module `target` or a package above it names (None outside the package)."""
    parts = target.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in known:
            return name
    return None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules that module `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            targets.update(_resolve(alias.name, known) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                above = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(above + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else _resolve(base, known))
    return {t for t in targets if t is not None and t != name}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one cycle through them."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(component, graph) for component in found]


def _cycle_through(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """One cycle a -> ... -> a inside a strongly connected component (a shortest way back to its first module)."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {sorted(component)}")


def layer_of(module: str) -> tuple[int, str] | None:
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        name = ".".join(parts[:n])
        if name in LAYER:
            return LAYER[name]
    return LAYER.get(module)  # the bare package


# ------------------------------------------------------------------------------------------------------------ tests


def test_the_graph_reads_every_kind_of_import(tmp_path):
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("__init__", "a", "b", "c", "sub/__init__", "sub/d"):
        (tmp_path / "pkg" / f"{name}.py").touch()
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("from . import d\nfrom ..a import x\n")
    (tmp_path / "pkg" / "b.py").write_text(
        "import os\n\ndef f():\n    from pkg.sub import d, name\n    import pkg.c as c\n    from . import a\n"
    )
    known = {
        "pkg": tmp_path / "pkg/__init__.py",
        **{f"pkg.{n}": tmp_path / f"pkg/{n}.py" for n in "abc"},
        "pkg.sub": tmp_path / "pkg/sub/__init__.py",
        "pkg.sub.d": tmp_path / "pkg/sub/d.py",
    }
    assert imports_of("pkg.b", known["pkg.b"], known) == {"pkg.sub.d", "pkg.sub", "pkg.c", "pkg.a"}
    assert imports_of("pkg.sub", known["pkg.sub"], known) == {"pkg.sub.d", "pkg.a"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_every_module_is_read():
    found = modules()
    assert {"flowrl.types", "flowrl.rewards.clipscore", "flowrl.samplers.sde", "flowrl.balancers.marble"} <= set(found)
    assert not [name for name in found if name.startswith(("flowrl.flowrl", "flowrl.tests"))]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (break each by moving the shared piece down a layer):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found
    )


def test_every_module_has_a_layer():
    missing = sorted(name for name in modules() if layer_of(name) is None)
    assert not missing, f"modules without a layer (add each to tests/test_layout.py LAYERS): {', '.join(missing)}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import in `graph` from a module up to a higher layer, as "module (layer) imports target (layer)"."""
    upward = []
    for module, targets in sorted(graph.items()):
        here = layer_of(module)
        for target in sorted(targets):
            there = layer_of(target)
            if here is not None and there is not None and there[0] > here[0]:
                upward.append(f"{module} ({here[1]}) imports {target} ({there[1]})")
    return upward


def test_imports_point_down_the_layers():
    upward = upward_imports(import_graph())
    assert not upward, "imports from a lower layer up to a higher one:\n" + "\n".join(upward)


def test_the_demo_and_the_benchmarks_cannot_import_each_other_both_ways():
    # bench/train.py runs the demo's config; the demo grading with a benchmark's module would close a loop
    assert layer_of("flowrl.demo")[0] < layer_of("flowrl.bench")[0]
    assert layer_of("flowrl.heldout")[0] < layer_of("flowrl.demo")[0]
    graph = import_graph()
    assert not any(target.startswith("flowrl.bench") for target in graph["flowrl.demo"])
    graph["flowrl.demo"] = graph["flowrl.demo"] | {"flowrl.bench.trainers"}
    assert "flowrl.demo (demo) imports flowrl.bench.trainers (benchmarks)" in upward_imports(graph)


def test_every_package_folder_is_packaged():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    folders = {name for name, path in modules().items() if path.name == "__init__.py"}
    assert not folders - listed, f"package folders missing from pyproject.toml's packages: {sorted(folders - listed)}"


def test_recipes_stay_within_their_budgets():
    over = []
    for file, budget in BUDGETS.items():
        lines = len((REPO / file).read_text(encoding="utf-8").splitlines())
        if lines > budget:
            over.append(f"{file}: {lines} lines > {budget}")
    assert not over, (
        "recipes over their length budget (move shared plumbing into flowrl/trainers/kit.py):\n" + "\n".join(over)
    )
