"""flowrl.toy.manifest: the shipped weights' records live in the toy world's package, which never imports the
adapters."""

import ast
import json
from pathlib import Path

from flowrl.toy import manifest

TOY = Path(manifest.__file__).resolve().parent


def test_toy_package_imports_no_model_adapter():
    """The dependency arrow runs models -> toy, never back (the exact grade of a model, which loads one, is
    flowrl/heldout.py)."""
    found = set()
    for path in sorted(TOY.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(n == "flowrl.models" or n.startswith("flowrl.models.") for n in names):
                owner = next(
                    (f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and node in ast.walk(f)), None
                )
                found.add((path.name, owner))
    assert found == set(), found


def test_write_manifest_entry_replaces_one_entry_and_keeps_the_rest(tmp_path):
    manifest.write_manifest_entry(tmp_path, "a.safetensors", {"seed": 0})
    manifest.write_manifest_entry(tmp_path, "b.safetensors", {"seed": 1})
    manifest.write_manifest_entry(tmp_path, "a.safetensors", {"seed": 2})
    assert json.loads((tmp_path / "manifest.json").read_text()) == {
        "a.safetensors": {"seed": 2},
        "b.safetensors": {"seed": 1},
    }
    assert manifest.WEIGHTS_DIR == TOY / "weights"
    path = manifest.verified_weights("toy_attributes.safetensors")
    entry = json.loads((manifest.WEIGHTS_DIR / "manifest.json").read_text())["toy_attributes.safetensors"]
    assert manifest.file_digest(path) == entry["sha256"] and f"--seed {entry['seed']} " in entry["command"]
