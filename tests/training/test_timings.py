"""`perf/...` timings synchronise the device on CUDA (flowrl.training.clock.timed), never on the CPU."""

import pytest
import torch

from flowrl.training.clock import timed


@pytest.mark.parametrize(("device", "expected"), [("cuda", 2), ("cuda:1", 2), ("cpu", 0), (torch.device("meta"), 0)])
def test_timed_synchronises_only_on_cuda(monkeypatch, device, expected):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    clock = timed(device)  # once when it starts ...
    seconds = clock.seconds()  # ... and once when read
    assert seconds >= 0 and len(calls) == expected
    assert all(c == torch.device(device) for c in calls)


def test_recipes_time_their_stages_with_timed():
    """No recipe stage is timed with a bare perf_counter (it would bill queued CUDA kernels to the next stage)."""
    from pathlib import Path

    import flowrl

    root = Path(flowrl.__file__).parent
    for path in [*root.glob("trainers/*.py"), root / "training" / "reward_gradients.py"]:
        assert "perf_counter" not in path.read_text(), path
    # the rollout chunks too; a reward's own time is not synchronised (it runs in a worker thread beside the next
    # chunk's sampling, and its scores come back to the CPU, which waits for them)
    assert "tic = timed(model.device)" in (root / "training" / "scoring.py").read_text()
