"""`flowrl bench tree` (flowrl/bench/tree.py) at tiny settings: its JSON shape, the forward counts against the tree's
node counts by hand, and its one-line errors. Speed is measured, never asserted."""

import json
import re

import pytest

from flowrl import cli
from flowrl.bench import tree
from flowrl.bench.tree import CountingModel, interleaved_times

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

FAMILY_KEYS = {"forwards_per_leaf", "forward_calls", "wall_per_leaf_s", "nfe_ratio", "wall_ratio", "wall_over_nfe"}


def test_cli_writes_both_families_with_forward_counts_by_hand(tmp_path, capsys):
    out = tmp_path / "tree.json"
    argv = ["bench", "tree", "--json", str(out), "--repeats", "1", "--num-steps", "3", "--split-steps", "0,1"]
    assert cli.main(argv) == 0
    result = json.loads(out.read_text())
    assert capsys.readouterr().out.endswith(json.dumps(result, indent=2) + "\n")  # printed too (after library warnings)
    assert result["settings"]["leaves"] == 4 and result["settings"]["split_steps"] == [0, 1]
    for family in ("toy", "sd3"):
        entry = result[family]
        assert FAMILY_KEYS | {"target_met", "cpu_ratio", "cpu_over_nfe", "rounds_s", "rounds_cpu_s"} == set(entry)
        # tree: nodes 1, 2, 4 at steps 0, 1, 2 = 7 forwards for 4 leaves in 3 calls; independent: 4 x 3 in 3 calls
        assert entry["forwards_per_leaf"] == {"tree": 1.75, "independent": 3.0}
        assert entry["forward_calls"] == {"tree": 3, "independent": 3}
        assert entry["nfe_ratio"] == round(12 / 7, 4)
        assert all(len(v) == 1 and v[0] > 0 for v in entry["rounds_s"].values())
        tree_s, independent_s = entry["rounds_s"]["tree"][0], entry["rounds_s"]["independent"][0]
        assert entry["wall_ratio"] == pytest.approx(independent_s / tree_s, rel=1e-2)
        assert entry["wall_per_leaf_s"]["tree"] == pytest.approx(tree_s / 4, rel=1e-2)
        assert entry["target_met"] == (entry["wall_ratio"] >= 0.85 * entry["nfe_ratio"])


def test_chunked_frontier_counts_the_same_forwards_in_more_calls():
    result = tree.bench_tree(repeats=1, num_steps=2, split_steps=(0,), families=("toy",), max_forward_batch=1)
    assert result["toy"]["forwards_per_leaf"] == {"tree": 1.5, "independent": 2.0}  # 1 + 2 nodes for 2 leaves
    assert result["toy"]["forward_calls"] == {"tree": 3, "independent": 2}


def test_interleaved_rounds_alternate_their_order_after_one_warm_up_each():
    calls = []
    wall, cpu = interleaved_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert all(len(v) == 3 and min(v) >= 0 for times in (wall, cpu) for v in times.values())


def test_counting_model_counts_rows_and_calls_and_forwards_the_rest():
    class Model:
        family = "x"

        def velocity(self, latents, sigma, cond, guidance_scale=1.0):
            return latents

    import torch

    model = CountingModel(Model())
    model.velocity(torch.zeros(3, 2), 0.5, {})
    model.velocity(torch.zeros(2, 2), 0.5, {})
    assert (model.rows, model.calls, model.family) == (5, 2, "x")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--families", "toy,flux"], r"families=\['toy', 'flux'\]: \['flux'\] not benchmarked"),
        (["--split-steps", "0,x"], "--split-steps '0,x' must be comma-separated integers"),
        (["--num-steps", "0"], "--num-steps '0' must be a whole number >= 1"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, argv, message):
    assert cli.main(["bench", "tree", "--json", str(tmp_path / "x.json"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err) and not (tmp_path / "x.json").exists()
