"""Extract GenEval's rule code, and flow_grpo's reward built on it, verbatim into tests/fixtures/geneval_upstream/.

The rules that turn detections into verdicts live in GenEval's `evaluation/evaluate_images.py` (djghosh13/geneval)
and, for the strict and partial scores flow_grpo trains on, in `reward_server/gen_eval.py` (yifan123/reward-server).
Both files import mmdet, open_clip and clip_benchmark at the top, so they cannot be imported without mmcv. This script
copies the rule functions out of them unchanged and writes, in place of the model calls, stubs the test controls:

- `inference_detector(model, inputs)` returns `DETECT(inputs)`: the test's detections in mmdet 2.x's format;
- `zsc.run_classification` returns `CLIP_LOGITS(box, mask)` for each object handed to it: the test's colour logits;
- `args.options` is empty, so the thresholds take GenEval's defaults.

tests/rewards/test_geneval_rules.py then feeds identical synthetic detections to these files and to flowrl's
rewards/_geneval_rules.py and asserts every verdict equal. The output is test data: rerun this script to refresh it.

usage: python scripts/extract_geneval_rules.py GENEVAL REWARD_SERVER [--out tests/fixtures/geneval_upstream]

GENEVAL and REWARD_SERVER are checkouts (working trees) or git directories (bare clones) of the two repositories;
files are read from the working tree where it has them, else from the commit HEAD names.
"""

from __future__ import annotations

import argparse
import ast
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "geneval_upstream"
STUBBED_MODULES = ("mmdet", "open_clip", "clip_benchmark", "pandas")  # model code and main()'s table writer
RULES = ("COLORS", "COLOR_CLASSIFIERS", "ImageCrops", "color_classification", "compute_iou", "relative_position")
THRESHOLDS = ("THRESHOLD", "COUNTING_THRESHOLD", "MAX_OBJECTS", "NMS_THRESHOLD", "POSITION_THRESHOLD")
GENEVAL = ("evaluation/evaluate_images.py", (*RULES, "evaluate", "evaluate_image", *THRESHOLDS))
REWARD_SERVER = (
    "reward_server/gen_eval.py",
    (*RULES, "evaluate", "evaluate_reward", "evaluate_image", *THRESHOLDS, "compute_geneval"),
)

STUBS = """
# ---- stubs in place of the model calls, written by scripts/extract_geneval_rules.py --------------------------------
import os as _os
import types as _types

args = _types.SimpleNamespace(options={})  # no --options given: GenEval's default thresholds
DEVICE = "cpu"
object_detector = clip_model = transform = tokenizer = None
with open(_os.path.join(_os.path.dirname(__file__), "object_names.txt")) as _names:
    classnames = [line.strip() for line in _names]

DETECT = None  # set by the test: inputs -> what mmdet 2.x's inference_detector returns for them
CLIP_LOGITS = None  # set by the test: (box, mask) -> one logit per colour of COLORS


def inference_detector(model, inputs):
    return DETECT(inputs)


class zsc:  # clip_benchmark.metrics.zeroshot_classification
    @staticmethod
    def zero_shot_classifier(model, tokenizer, classnames, templates, device):
        return templates

    @staticmethod
    def run_classification(model, classifier, dataloader, device):
        objects = dataloader.dataset._objects
        return torch.tensor([list(CLIP_LOGITS(box, mask)) for box, mask in objects], dtype=torch.float32), None


# ---- upstream text, verbatim ------------------------------------------------------------------------------------
"""


class Checkout:
    """A repository on disk: a working tree or a git directory."""

    def __init__(self, location: str):
        self.path = Path(location)
        if not self.path.is_dir():
            sys.exit(f"extract_geneval_rules: {location} is not a folder; pass a checkout or a git directory")
        self.commit = self._git("rev-parse", "HEAD").strip()

    def _git(self, *command: str) -> str:
        done = subprocess.run(["git", "-C", str(self.path), *command], capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"extract_geneval_rules: git {' '.join(command)} in {self.path}: {done.stderr.strip()}")
        return done.stdout

    def read(self, name: str) -> str:
        on_disk = self.path / name
        if on_disk.is_file():
            if self._git("status", "--porcelain", "--", name).strip():
                sys.exit(f"extract_geneval_rules: {on_disk} is modified (HEAD is {self.commit}); pass a clean checkout")
            return on_disk.read_text(encoding="utf-8")
        return self._git("show", f"HEAD:{name}")


def _segment(lines: list[str], node: ast.stmt) -> str:
    """The statement's own text, decorators included, dedented (a nested definition becomes a top-level one)."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return textwrap.dedent("\n".join(lines[first - 1 : node.end_lineno]))


def _names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        return [t.id for t in node.targets if isinstance(t, ast.Name)]
    return []


def _definitions(body: list[ast.stmt]) -> list[ast.stmt]:
    """Statements of a body and of the blocks that hold definitions: `if __name__ == "__main__":` and the one
    function that closes over all the rest (reward-server's `load_geneval`)."""
    out = []
    for node in body:
        out.append(node)
        if isinstance(node, ast.If) or isinstance(node, ast.FunctionDef) and node.name.startswith("load_"):
            out += _definitions(node.body)
    return out


def extract(source: str, wanted: tuple[str, ...], where: str) -> str:
    """Kept imports, the stubs, then the wanted definitions in the order the source has them."""
    tree = ast.parse(source)
    lines = source.splitlines()
    imports = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if not any(m.split(".")[0] in STUBBED_MODULES for m in modules):
                imports.append(_segment(lines, node))
    found: dict[str, str] = {}
    for node in _definitions(tree.body):
        for name in _names(node):
            if name in wanted and name not in found:
                found[name] = _segment(lines, node)
    missing = [name for name in wanted if name not in found]
    if missing:
        sys.exit(f"extract_geneval_rules: {where} no longer defines {missing}; update RULES in this script")
    definitions = list(dict.fromkeys(found.values()))  # source order: dicts keep the order of first sight
    return "\n".join(imports) + "\n" + STUBS + "\n\n".join(definitions) + "\n"


def header(repo: str, commit: str, path: str) -> str:
    return (
        "# ruff: noqa\n# fmt: off\n"
        f'"""Test data written by scripts/extract_geneval_rules.py: the rule code of {repo} {path} at commit\n'
        f"{commit}, verbatim below the stubs; the repository's MIT license is in LICENSE.{repo.split('/')[1]}.\n"
        'Do not edit: rerun the script."""\n'
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("geneval", help="djghosh13/geneval: a checkout or git directory")
    parser.add_argument("reward_server", help="yifan123/reward-server: a checkout or git directory")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    record = {}
    for repo, location, (path, wanted), target in (
        ("djghosh13/geneval", args.geneval, GENEVAL, "geneval_evaluate_images.py"),
        ("yifan123/reward-server", args.reward_server, REWARD_SERVER, "reward_server_gen_eval.py"),
    ):
        checkout = Checkout(location)
        text = header(repo, checkout.commit, path) + extract(checkout.read(path), wanted, f"{repo} {path}")
        (args.out / target).write_text(text, encoding="utf-8")
        (args.out / f"LICENSE.{repo.split('/')[1]}").write_text(checkout.read("LICENSE"), encoding="utf-8")
        record[repo] = {"commit": checkout.commit, "file": path, "extracted": list(wanted), "written": target}
        if repo == "djghosh13/geneval":
            for name, source in (("object_names.txt", "evaluation"), ("evaluation_metadata.jsonl", "prompts")):
                (args.out / name).write_text(checkout.read(f"{source}/{name}"), encoding="utf-8")
    (args.out / "sources.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    readme = args.out / "README.md"
    readme.write_text(README.format(**{k.split("/")[1].replace("-", "_"): v["commit"] for k, v in record.items()}))
    shutil.rmtree(args.out / "__pycache__", ignore_errors=True)
    print(f"wrote {sorted(p.name for p in args.out.iterdir())} to {args.out}")


README = """# GenEval's own rule code (test data)

Generated by `python scripts/extract_geneval_rules.py GENEVAL REWARD_SERVER`; do not edit, rerun the script.

| file | from | commit |
|---|---|---|
| `geneval_evaluate_images.py` | djghosh13/geneval `evaluation/evaluate_images.py` | {geneval} |
| `reward_server_gen_eval.py` | yifan123/reward-server `reward_server/gen_eval.py` (flow_grpo) | {reward_server} |
| `object_names.txt` | djghosh13/geneval `evaluation/object_names.txt` | {geneval} |
| `evaluation_metadata.jsonl` | djghosh13/geneval `prompts/evaluation_metadata.jsonl` (553 records) | {geneval} |
| `LICENSE.geneval`, `LICENSE.reward-server` | each repository's `LICENSE` (MIT) | as above |

Each `.py` file holds the upstream functions that turn detections into verdicts (object filtering, IoU, relative
position, the colour decision from CLIP logits, the per-prompt evaluation; for reward-server also the strict and
partial scores), copied unchanged, after stubs that replace the model calls (mmdet's detector, open_clip and
clip_benchmark's zero-shot classifier) with hooks the test sets. `sources.json` records what was taken from where.
`tests/rewards/test_geneval_rules.py` runs them beside flowrl's `rewards/_geneval_rules.py` on the same synthetic
detections; flowrl's code is its own, not this copy. The benchmark's 553 records let `tests/rewards/test_geneval.py`
check that flowrl reads every one of them.
"""


if __name__ == "__main__":
    main()
