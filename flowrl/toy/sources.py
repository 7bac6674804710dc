"""Source images of the toy image-to-video world: each prompt's "first frame", a fixed render of the scene it names.

The source of a prompt is `render(parse_prompt(prompt), seed)` with `seed = zlib.crc32(prompt)`: another render of the
scene the prompt describes (its own layout), the same on every machine and run. It is written once as a PNG into
`$FLOWRL_CACHE/toy_sources/` (default `~/.cache/flowrl/toy_sources/`), atomically (a temporary file, then
`os.replace`), and reused when present, so prompt records can carry it as `{"image": path}` like any JSONL source.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from pathlib import Path

from flowrl.toy.world import parse_prompt, render

CACHE_ENV = "FLOWRL_CACHE"


def cache_dir() -> Path:
    """flowrl's cache folder: $FLOWRL_CACHE, else ~/.cache/flowrl."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "flowrl"


def source_seed(prompt: str) -> int:
    """The render seed of a prompt's source image: a fixed function of its text."""
    return zlib.crc32(prompt.encode("utf-8"))


def source_path(prompt: str) -> str:
    """The PNG of a toy prompt's source image, rendered and written on first use (a ValueError if the prompt is not
    in the Shapes grammar)."""
    spec = parse_prompt(prompt)
    seed = source_seed(prompt)
    folder = cache_dir() / "toy_sources"
    path = folder / f"{spec.prompt.replace(' ', '_')}_{seed:08x}.png"
    if path.is_file():
        return str(path)
    from flowrl.media import save_image

    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=folder)
    os.close(fd)
    try:
        save_image(render(spec, seed), tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return str(path)


def source_records(prompts: list[str]) -> list[dict[str, str]]:
    """Prompt records [{"image": source path}] of toy prompts, for metadata."""
    return [{"image": source_path(p)} for p in prompts]
