"""`flowrl bench balancers` (flowrl/bench_balancers.py): the JSON's shape and its consistency with the runs, the CLI and
its one-line errors, on the shipped toy model at tiny sizes (2 train steps, 1 held-out seed, 2 ODE steps)."""

import json

import pytest

from flowrl import cli
from flowrl.bench_balancers import REWARDS, balancer_order, bench_balancers

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

TINY = ["num_steps=2", "data.num_prompts_per_step=2", "data.group_size=2", "sampler.num_steps=3"]


def test_bench_of_two_balancers_writes_consistent_json(tmp_path):
    out = tmp_path / "deep" / "balancers.json"
    result = bench_balancers(
        balancers=["weighted_sum", "marble"],
        seeds=[0],
        overrides=TINY,
        out_json=out,
        num_seeds=1,
        eval_num_steps=2,
        timing_steps=1,
    )
    assert json.loads(out.read_text()) == result
    assert set(result["per_reward_delta"]) == {"weighted_sum", "marble"}
    for name, deltas in result["per_reward_delta"].items():
        assert set(deltas) == set(REWARDS) and all(len(v) == 1 for v in deltas.values())
        run = result["runs"][name]["0"]
        for reward in REWARDS:  # the change is final minus base, on the held-out split
            assert deltas[reward] == [pytest.approx(run["final"][reward] - run["base"][reward], abs=1e-5)]
        assert 0 <= result["opposed_fraction"][name] <= 1  # every optimizer step had per-reward gradients
        assert result["step_s"][name] > 0
        assert result["improves_every_reward_every_seed"][name] == all(v[0] > 0 for v in deltas.values())
    assert 0 <= result["runs"]["marble"]["0"]["base"]["toy_attributes"] <= 1
    assert sum(result["alpha"]["marble"][0].values()) == pytest.approx(1.0, abs=1e-6)
    timing = result["side_by_side_step_s"]
    assert result["marble_step_ratio"] == round(timing["marble"] / timing["nft"], 4)
    assert result["marble_weighted_sum_step_ratio"] == round(timing["marble"] / timing["weighted_sum"], 4)
    assert len(result["single_reward_delta"]["toy_attributes"]) == 1 and result["overrides"] == TINY


def test_bad_input_is_one_line_naming_the_flag(tmp_path, capsys):
    for extra, expected in [
        (["--balancers", "weighted_sum,nope"], "'nope' is not one of"),
        (["--balancers", "gdpo,gdpo"], "twice"),
        (["--seeds", "0,x"], "--seeds '0,x'"),
        (["--heldout-seeds", "0"], "--heldout-seeds '0'"),
        (["no_such_key=1"], "no_such_key"),
    ]:
        capsys.readouterr()
        assert cli.main(["bench", "balancers", "--json", str(tmp_path / "bad.json"), *extra]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("flowrl bench: error: ") and expected in lines[0], lines
    assert not (tmp_path / "bad.json").exists()
    assert balancer_order(None)[0] == "weighted_sum" and "marble_full" in balancer_order(None)
