"""The RNG record of a checkpoint on a CUDA machine, with a fake CUDA on the CPU: a process saves and restores its own
device's state, so a run saved on 8 visible devices resumes on 2 (the old record of every device, restored by index,
reached for devices the resuming machine does not have)."""

import json

import pytest
import torch
import torch.cuda.random

from flowrl.training.checkpoint import rng_state, set_rng_state


class FakeCUDA:
    """`num_devices` visible CUDA devices, this process on `current`, each with its own RNG state (distinct bytes).
    torch's own get_rng_state_all / set_rng_state_all run over it, as they would over real devices; indexing a device
    that does not exist raises IndexError, as `torch.cuda.default_generators[index]` does."""

    def __init__(self, monkeypatch, num_devices: int, current: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.states = [torch.randint(0, 256, (16,), dtype=torch.uint8, generator=g) for _ in range(num_devices)]
        self.current = current
        for module in (torch.cuda, torch.cuda.random):
            monkeypatch.setattr(module, "device_count", lambda: num_devices)
            monkeypatch.setattr(module, "current_device", lambda: current)
            monkeypatch.setattr(module, "get_rng_state", self.get_rng_state)
            monkeypatch.setattr(module, "set_rng_state", self.set_rng_state)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def _index(self, device) -> int:
        index = device if isinstance(device, int) else torch.device(device).index
        index = self.current if index is None else index
        if index >= len(self.states):
            raise IndexError(f"CUDA device {index} does not exist ({len(self.states)} devices)")
        return index

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set_rng_state(self, new_state: torch.Tensor, device="cuda") -> None:
        self.states[self._index(device)] = new_state.clone()


def test_a_run_saved_on_eight_devices_resumes_on_two(monkeypatch):
    saving = FakeCUDA(monkeypatch, num_devices=8, current=1, seed=0)  # rank 1 of a run on 8 GPUs writes rng_1.json
    saved = json.loads(json.dumps(rng_state()))  # as written to and read from rng_1.json
    resuming = FakeCUDA(monkeypatch, num_devices=2, current=1, seed=1)  # rank 1 of the resume on 2 GPUs reads it
    other = resuming.states[0].clone()
    set_rng_state(saved)
    assert saved["cuda"] == saving.states[1].tolist()  # its own device's state, one list
    assert torch.equal(resuming.states[1], saving.states[1])
    assert torch.equal(resuming.states[0], other)  # another device's generator is left alone


def test_an_old_checkpoint_restores_the_state_of_this_process_device(monkeypatch):
    saving = FakeCUDA(monkeypatch, num_devices=8, current=1, seed=0)
    old = json.loads(json.dumps(rng_state()))
    old["cuda"] = [s.tolist() for s in saving.states]  # the old record: every visible device's state, by index
    resuming = FakeCUDA(monkeypatch, num_devices=2, current=1, seed=1)
    set_rng_state(old)
    assert torch.equal(resuming.states[1], saving.states[1])
    beyond = FakeCUDA(monkeypatch, num_devices=16, current=9, seed=2)  # a device the old record does not cover
    before = [s.clone() for s in beyond.states]
    with pytest.warns(UserWarning, match="CUDA RNG states cover devices 0-7, not this process's device 9"):
        set_rng_state(old)
    assert all(torch.equal(a, b) for a, b in zip(before, beyond.states))
