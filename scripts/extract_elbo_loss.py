"""Extract the ELBO likelihood and the policy objectives of "Rethinking the design space of RL for diffusion models"
(jaemoo-choi/rethinking-diffusion-rl) verbatim into tests/fixtures/elbo_upstream/.

The authors' loss lives in two files that import the whole training stack (peft, DDP, the reward package), so they
cannot be imported here. This script copies the functions out of them unchanged:

- `compute_elbo` and `return_decay` (the old policy's soft-update schedule) from `src/utils/__init__.py`;
- `BaseTrainingUtils.compute_policy_loss` and `compute_kl_loss` from `src/utils/base.py`, as methods of a class
  `Upstream` whose `config` the test sets (they read `self.config.train.method`, `.kl_method`, `.elbo`, ...).

tests/trainers/test_elbo_upstream.py then feeds identical tensors to these functions and to flowrl's
flowrl/trainers/elbo.py and asserts the results equal. The output is test data: rerun this script to refresh it.

usage: python scripts/extract_elbo_loss.py SOURCE [--commit SHA] [--out tests/fixtures/elbo_upstream]

SOURCE is a checkout (working tree) or a git directory (bare clone) of the repository; files are read from the
working tree where it has them, else from the commit HEAD names.
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import textwrap
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "elbo_upstream"
REPO = "jaemoo-choi/rethinking-diffusion-rl"
FUNCTIONS = ("src/utils/__init__.py", ("compute_elbo", "return_decay"))
METHODS = ("src/utils/base.py", "BaseTrainingUtils", ("compute_policy_loss", "compute_kl_loss"))

HEADER = '''# ruff: noqa
# fmt: off
"""The ELBO loss of {repo} (written by scripts/extract_elbo_loss.py: rerun it, do not edit).

Commit {commit}:

{sources}
Test data for tests/trainers/test_elbo_upstream.py, under the repository's Apache-2.0 license; flowrl's own code is
flowrl/trainers/elbo.py, not this copy.
"""

import torch


'''

CLASS = '''

class Upstream:
    """The methods of BaseTrainingUtils that hold the loss, unchanged; the test sets `config` (train.method, adv,
    kl_method, elbo, ref_guidance_scale)."""

    def __init__(self, config):
        self.config = config

'''


def read_source(source: Path, path: str) -> str:
    """`path` from the working tree of `source`, else from its HEAD commit (a bare clone)."""
    if (source / path).is_file():
        return (source / path).read_text(encoding="utf-8")
    return subprocess.run(
        ["git", "--git-dir", str(source), "show", f"HEAD:{path}"], check=True, capture_output=True, text=True
    ).stdout


def head_commit(source: Path) -> str | None:
    git_dir = source / ".git" if (source / ".git").exists() else source
    out = subprocess.run(["git", "--git-dir", str(git_dir), "rev-parse", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() if out.returncode == 0 else None


def definitions(text: str, names: tuple[str, ...], owner: str | None = None) -> dict[str, tuple[str, int, int]]:
    """{name: (source, first line, last line)} of the functions `names` (methods of class `owner`) in `text`."""
    tree, lines = ast.parse(text), text.splitlines()
    body = tree.body
    if owner is not None:
        body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == owner).body
    found = {}
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found[node.name] = ("\n".join(lines[node.lineno - 1 : node.end_lineno]), node.lineno, node.end_lineno)
    missing = sorted(set(names) - set(found))
    if missing:
        raise SystemExit(f"{missing} not found{f' in class {owner}' if owner else ''}: is SOURCE {REPO}?")
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help=f"a checkout or git directory of {REPO}")
    parser.add_argument("--commit", help="the commit the files were read at (default: the source's HEAD)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    commit = args.commit or head_commit(args.source) or "unknown"

    functions = definitions(read_source(args.source, FUNCTIONS[0]), FUNCTIONS[1])
    methods = definitions(read_source(args.source, METHODS[0]), METHODS[2], METHODS[1])
    sources = [
        {"file": FUNCTIONS[0], "name": name, "lines": [first, last]} for name, (_, first, last) in functions.items()
    ]
    sources += [
        {"file": METHODS[0], "name": f"{METHODS[1]}.{name}", "lines": [first, last]}
        for name, (_, first, last) in methods.items()
    ]
    listing = "".join(f"- `{s['file']}` `{s['name']}`, lines {s['lines'][0]}-{s['lines'][1]}\n" for s in sources)

    text = HEADER.format(repo=REPO, commit=commit, sources=listing)
    text += "\n\n\n".join(body for body, _, _ in functions.values()) + "\n"
    text += CLASS + "\n\n".join(textwrap.indent(textwrap.dedent(body), "    ") for body, _, _ in methods.values())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rethinking_elbo_loss.py").write_text(text + "\n", encoding="utf-8")
    manifest = {"repository": REPO, "commit": commit, "extracted": sources}
    (args.out / "sources.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out / 'rethinking_elbo_loss.py'} and sources.json ({len(sources)} functions, {commit})")


if __name__ == "__main__":
    main()
