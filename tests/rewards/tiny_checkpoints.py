"""Tiny checkpoint factories for the reward tests: flowrl.rewards._tiny plus `remote` and `remote_flowgrpo` (in-thread
servers)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowrl.rewards._tiny import (  # noqa: F401  (re-exported for the test modules)
    MED,
    TINY_REWARDS,
    VISION,
    WORDS,
    make_imagereward_files,
    tiny_aesthetic_head,
    tiny_open_clip,
    tiny_pickscore,
)

_SERVERS: list = []


def _remote(folder: Path) -> dict[str, Any]:
    from flowrl.registry import REWARDS
    from flowrl.serving.server import make_server

    server = make_server(REWARDS.build("jpeg_compressibility"), port=0, token="secret")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _SERVERS.append(server)
    return {"url": f"http://127.0.0.1:{server.server_address[1]}", "token": "secret", "timeout_s": 10, "max_retries": 0}


def _remote_flowgrpo(folder: Path) -> dict[str, Any]:
    from flowgrpo_server import start_server

    server = start_server()
    _SERVERS.append(server)
    return {"url": f"http://127.0.0.1:{server.server_address[1]}", "unsafe_unpickle": True, "timeout_s": 10}


def _openai_judge(folder: Path) -> dict[str, Any]:
    from judge_server import start_judge

    server = start_judge()
    _SERVERS.append(server)
    return {"base_url": f"http://127.0.0.1:{server.server_address[1]}/v1", "model": "judge", "timeout_s": 10}


REWARD_FACTORIES: dict[str, Callable[[Path], dict[str, Any]]] = {
    **TINY_REWARDS,
    "remote": _remote,
    "remote_flowgrpo": _remote_flowgrpo,
    "openai_judge": _openai_judge,
}

# Rewards that only accept prompts of their own world get valid ones in the contract tests.
CONTRACT_PROMPTS: dict[str, list[str]] = {
    "toy_attributes": ["two red circles", "one blue square", "three green triangles"],
    "toy_artifact": ["two red circles", "one blue square", "three green triangles"],
    "toy_exact": ["two red circles", "one blue square", "three green triangles"],
    **dict.fromkeys(
        ("toy_geneval", "toy_geneval_exact"),
        [
            "a red circle and a blue square",
            "a green triangle left of a red square",
            "a yellow square above a blue circle",
        ],
    ),
}


def contract_metadata(name: str, num: int, folder: Path) -> list[dict[str, Any]]:
    """The metadata of the contract tests' samples: `{}`, or for rewards that read a sample's source image
    (image_consistency) a source image written to `folder`."""
    if name == "geneval":  # GenEval records (a sample without one scores NaN)
        records = [
            {"tag": "single_object", "include": [{"class": "dog", "count": 1}]},
            {"tag": "counting", "include": [{"class": "cup", "count": 2}], "exclude": [{"class": "cup", "count": 3}]},
            {"tag": "colors", "include": [{"class": "cat", "count": 1, "color": "red"}]},
        ]
        return [records[i % len(records)] for i in range(num)]
    if name != "image_consistency":
        return [{} for _ in range(num)]
    import torch

    from flowrl import media

    path = media.save_image(torch.linspace(0, 1, 3 * 24 * 20).view(3, 24, 20), str(folder / "source.png"))
    return [{"image": path} for _ in range(num)]
