"""The shipped toy weights and their manifest: where they live, how each file is checked, which script rebuilds it.

`flowrl/toy/weights/manifest.json` maps each weight file to its sha256, size, the command and seed that made it and
what it measured. Loaders call `weights_or_checkpoint(name, checkpoint)` (`verified_weights(name)` for the shipped
file) so a missing or altered file fails with the rebuild command; the training scripts call `write_manifest_entry`
after saving.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
MANIFEST_FILE = "manifest.json"
REBUILD_SCRIPT = {
    "toy_model.safetensors": "scripts/pretrain_toy.py",
    "toy_geneval_model.safetensors": "scripts/pretrain_toy.py --grammar geneval",
    "toy_attributes.safetensors": "scripts/train_toy_judges.py --judge attributes",
    "toy_artifact.safetensors": "scripts/train_toy_judges.py --judge artifact",
}


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def verified_weights(name: str, weights_dir: Path | None = None) -> Path:
    """Path of a shipped weight file after checking it against the manifest's size and sha256."""
    weights_dir = Path(weights_dir) if weights_dir is not None else WEIGHTS_DIR
    path = weights_dir / name
    script = REBUILD_SCRIPT.get(name, "the script named in manifest.json")
    if not path.is_file():
        raise FileNotFoundError(f"toy weights {path} are missing; rebuild them with `python {script}`")
    manifest_path = weights_dir / MANIFEST_FILE
    if not manifest_path.is_file():
        raise FileNotFoundError(f"toy weights manifest {manifest_path} is missing; rebuild it with `python {script}`")
    entry = json.loads(manifest_path.read_text()).get(name)
    if entry is None:
        raise ValueError(f"toy weights {path} have no entry in {manifest_path}; rebuild them with `python {script}`")
    size = path.stat().st_size
    if size != entry["size"] or file_digest(path) != entry["sha256"]:
        raise ValueError(
            f"toy weights {path} are corrupted (size {size} vs {entry['size']} or sha256 mismatch in manifest.json); "
            f"rebuild them with `python {script}`"
        )
    return path


def weights_or_checkpoint(name: str, checkpoint: str | Path | None = None) -> Path:
    """The shipped weight file `name` (checked, `verified_weights`), or the file `checkpoint` names, which must exist
    (one written by the script that rebuilds `name`)."""
    if checkpoint is None:
        return verified_weights(name)
    path = Path(checkpoint)
    if not path.is_file():
        script = REBUILD_SCRIPT.get(name, "the script named in manifest.json")
        raise FileNotFoundError(f"toy checkpoint={str(path)!r} does not exist; pass a file written by {script}")
    return path


def file_entry(path: Path, command: str, seed: int, steps: int) -> dict:
    """The fields every manifest entry starts with: the file's sha256 and size, and the command, seed and steps that
    made it (the script adds what it measured)."""
    path = Path(path)
    return {"sha256": file_digest(path), "size": path.stat().st_size, "command": command, "seed": seed, "steps": steps}


def write_manifest_entry(out: Path, name: str, entry: dict) -> None:
    """Record (or replace) one file's entry in `out`/manifest.json, keys sorted so diffs stay small."""
    path = Path(out) / MANIFEST_FILE
    manifest = json.loads(path.read_text()) if path.is_file() else {}
    manifest[name] = entry
    path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
