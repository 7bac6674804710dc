"""Fixtures for the reward tests; the tiny checkpoint builders live in tiny_checkpoints.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from tiny_checkpoints import _SERVERS, REWARD_FACTORIES


@pytest.fixture(scope="session", autouse=True)
def _stop_servers():
    yield
    for server in _SERVERS:
        server.shutdown()
        server.server_close()


@pytest.fixture
def tiny_reward_kwargs(tmp_path: Path) -> Callable[[str], dict[str, Any]]:
    """kwargs for REWARDS.build(name, ...) that load tiny random weights from tmp_path."""

    def make(name: str) -> dict[str, Any]:
        folder = tmp_path / name
        folder.mkdir(parents=True, exist_ok=True)
        return REWARD_FACTORIES[name](folder)

    return make
