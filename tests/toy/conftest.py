"""Shapes-world tests run torch on one thread: on a shared 2-core machine two threads spin-wait and run 3-6x slower."""

import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
