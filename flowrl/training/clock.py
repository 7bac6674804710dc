"""The stage clock: wall seconds of a stage, synchronised with the device on CUDA."""

from __future__ import annotations

import time

import torch


class Clock:
    """Wall seconds since it started, for the `perf/...` timings. On CUDA it synchronises the device when it starts and
    when read: kernels run asynchronously, so without it a stage's queued work is billed to whichever later stage first
    waits on the device (docs/models.md#timings)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)
        self._synchronize()
        self.started = time.perf_counter()

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def seconds(self) -> float:
        self._synchronize()
        return time.perf_counter() - self.started


def timed(device: str | torch.device) -> Clock:
    """A started `Clock` on `device`: `tic = timed(acc.device)` ... `rollout_s = tic.seconds()`."""
    return Clock(device)
