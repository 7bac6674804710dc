"""Shapes-world tests run torch on one thread: on a shared 2-core machine two threads spin-wait and run 3-6x slower.
`countblind_checkpoint` is the first, hackable attribute judge."""

from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


COUNTBLIND_JUDGE = Path(__file__).resolve().parent / "fixtures" / "toy_attributes_countblind.safetensors"


@pytest.fixture(scope="session")
def countblind_checkpoint() -> Path:
    """The first shipped attribute judge (seed 0, 1500 steps, no "other" classes): it never saw four shapes or two
    colours in one scene and reads them as a prompt of the world (a hackable reward for reward-hacking tests):
    `REWARDS.build("toy_attributes", checkpoint=countblind_checkpoint)`."""
    return COUNTBLIND_JUDGE
