"""Shared test setup: offline hub (no test may download) and CPU determinism."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """family -> folder of a tiny random diffusers pipeline saved with save_pretrained (built once per session)."""
    from flowrl.models.tiny import build_tiny_pipeline

    root = tmp_path_factory.mktemp("tiny-pipelines")
    cache: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = str(build_tiny_pipeline(family, root / family))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def tiny_model(tiny_pipeline):
    """family -> a FlowModel loaded from the tiny pipeline folder (fresh each call: tests may add LoRA)."""
    from flowrl.models import load_flow_model

    return lambda family: load_flow_model(tiny_pipeline(family))


@pytest.fixture
def one_torch_thread():
    """Toy-model tests run torch on one thread: on a shared 2-core machine two threads spin-wait (3-6x slower)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
