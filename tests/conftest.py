"""Shared test setup: offline hub (no test may download), CPU determinism, and system programs a test needs."""

import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

REQUIRE_SYSTEM_PROGRAMS = "FLOWRL_REQUIRE_SYSTEM_PROGRAMS"


def require_program(names: str | tuple[str, ...], install_hint: str) -> str:
    """The path of the first of `names` on PATH. When none is there the test skips with a reason naming the
    program and its install command, or fails where FLOWRL_REQUIRE_SYSTEM_PROGRAMS=1 (.ci/run sets it, so CI
    never passes by skipping the tesseract and Chromium tests)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for name in names:
        if path := shutil.which(name):
            return path
    missing = f"{' or '.join(names)} is not on PATH (install: {install_hint})"
    if os.environ.get(REQUIRE_SYSTEM_PROGRAMS) == "1":
        pytest.fail(f"{missing}; {REQUIRE_SYSTEM_PROGRAMS}=1 makes a missing system program a failure", pytrace=False)
    pytest.skip(f"{missing}; .ci/run installs it and sets {REQUIRE_SYSTEM_PROGRAMS}=1")


@pytest.fixture(scope="session", name="require_program")
def require_program_fixture():
    """require_program(names, install_hint) -> path, for tests and fixtures (see the function above)."""
    return require_program


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """family -> folder of a tiny random diffusers pipeline saved with save_pretrained (built once per test run)."""
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
