"""rewards/README.md's cost column against flowrl.plan.cost: a number is reward_tflops(name) x 1000 rounded as written,
"~0" is a reward with no GPU work, "the server's" a remote one, and any other text a reward the cost table does not
price on its own (so a reward that gains a price must show it)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from flowrl.plan import cost
from flowrl.registry import REWARDS

README = Path(__file__).resolve().parents[2] / "rewards" / "README.md"
COLUMN = "cost (GFLOP / image)"
NUMBER = re.compile(r"^(\d[\d,]*(?:\.\d+)?)\b")


def _rows() -> dict[str, str]:
    """{reward name: cost cell} of the README's reward table."""
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| name |"))
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    column = header.index(COLUMN)
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        assert len(cells) == len(header), f"row {cells[0]} has {len(cells)} cells, the header {len(header)}"
        rows[cells[0].strip("`")] = cells[column]
    return rows


ROWS = _rows()


def test_the_table_lists_registered_rewards_with_a_cost_each():
    assert "hpsv3" in ROWS and len(ROWS) >= 15
    for name, cell in ROWS.items():
        assert name in REWARDS, f"README row {name!r} is not a registered reward"
        assert cell, f"README row {name!r} has an empty cost cell"


@pytest.mark.parametrize("name", sorted(ROWS))
def test_the_cost_cell_agrees_with_reward_tflops(name):
    cell, priced = ROWS[name], cost.REWARDS.get(name)
    match = NUMBER.match(cell)
    if match:
        written = match.group(1).replace(",", "")
        decimals = len(written.partition(".")[2])
        assert priced is not None and priced.backbone is not None, (
            f"{name}: a number for a reward cost.py does not price"
        )
        assert float(written) == round(cost.reward_tflops(name) * 1000, decimals), (
            f"{name}: README says {written} GFLOP, reward_tflops gives {cost.reward_tflops(name) * 1000:.3f}"
        )
    elif cell.startswith("~0"):
        assert priced is not None and priced.backbone is None and cost.reward_tflops(name) == 0.0
        assert not _remote(name), f"{name}: a remote reward's cost is the server's, not ~0"
    elif cell == "the server's":
        assert priced is not None and priced.backbone is None and cost.reward_tflops(name) == 0.0
        assert _remote(name), f"{name}: 'the server's' for a reward that is not configured by a server address"
    else:  # a cost that depends on the configuration (a wrapped reward, a backend)
        assert priced is None, (
            f"{name}: cost.py prices it ({cost.reward_tflops(name) * 1000:.1f} GFLOP); write the number"
        )


def _remote(name: str) -> bool:
    """A remote reward is configured by its server's address."""
    parameters = inspect.signature(REWARDS.get(name).__init__).parameters
    return "url" in parameters or "base_url" in parameters
