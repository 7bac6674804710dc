"""`flowrl bench candidates`' fidelity numbers, computed by hand on made-up pools (the bench itself is not run here)."""

import pytest
import torch

from flowrl.bench.candidates import fidelity


def test_a_perfect_preview_keeps_everything():
    full = [torch.tensor([0.1, 0.9, 0.4, 0.6]), torch.tensor([3.0, 1.0, 2.0, 0.0])]
    out = fidelity(full, full, kept=2, selection="best_worst")
    assert out == {
        "spearman_median": 1.0,
        "kendall_median": 1.0,
        "topk_overlap": 1.0,
        "bottom_intrusion": 0.0,
        "capture": 1.0,
    }


def test_capture_by_hand():
    full = [torch.tensor([0.0, 1.0, 2.0, 5.0])]  # pool mean 2, best 5: the best-of-pool gain is 3
    preview = [torch.tensor([0.0, 1.0, 3.0, 2.0])]  # ranks 2 above 3: best_worst K = 2 keeps {0, 2}
    out = fidelity(preview, full, kept=2, selection="best_worst")
    assert out["capture"] == pytest.approx((2.0 - 2.0) / 3.0)
    assert out["topk_overlap"] == 0.0  # k = 1: preview's best (2) is not the full best (3)
    assert out["spearman_median"] == pytest.approx(0.8)  # ranks (1, 2, 4, 3) vs (1, 2, 3, 4): 1 - 6·2 / (4·15)
