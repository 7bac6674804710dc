"""`flowrl bench balancers` (flowrl/bench/balancers.py): the JSON's shape and its consistency with the runs, the bed's
validity and MARBLE's half-gain test worked out on made-up runs, the CLI and its one-line errors, on the shipped toy
model at tiny sizes (2 train steps, 1 held-out seed, 2 ODE steps)."""

import json

import pytest

from flowrl import cli
from flowrl.bench.balancers import (
    BALANCER_RUNS,
    REWARDS,
    TUNED_WEIGHTS,
    balancer_order,
    balancers_result,
    bench_balancers,
    merge_balancers,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

TINY = ["num_steps=2", "data.num_prompts_per_step=2", "data.group_size=2", "sampler.num_steps=3"]


def test_bench_of_two_balancers_writes_consistent_json(tmp_path):
    out = tmp_path / "deep" / "balancers.json"
    result = bench_balancers(
        balancers=["marble", "single_toy_size", "weighted_sum"],
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
        assert result["step_s"][name] > 0 and result["keeps_half"][name] == [None]  # no single run of every reward
    for name in ("weighted_sum", "marble"):  # the weighted sum probed; MARBLE's refresh steps take the gradients anyway
        assert 0 <= result["opposed_fraction"][name] <= 1
    assert list(result["runs"]) == ["single_toy_size", "weighted_sum", "marble"]  # single-reward runs first
    single = result["runs"]["single_toy_size"]["0"]
    assert single["rewards"] == ["toy_size"] and result["runs"]["weighted_sum"]["0"]["rewards"] == list(REWARDS)
    assert result["single_reward_gain"] == {"toy_size": [single["delta"]["toy_size"]]}
    assert 0 <= result["runs"]["marble"]["0"]["base"]["toy_attributes"] <= 1
    assert 0 <= result["runs"]["marble"]["0"]["base"]["toy_midline"] <= 1 and result["base"]["toy_size"] > 10
    assert sum(result["alpha"]["marble"][0].values()) == pytest.approx(1.0, abs=1e-6)
    timing = result["side_by_side_step_s"]
    assert result["marble_step_ratio"] == round(timing["marble"] / timing["weighted_sum"], 4)
    assert result["overrides"] == TINY and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def made_up_run(delta: dict) -> dict:
    return {
        "delta": delta,
        "base": {},
        "final": {},
        "opposed_fraction": None,
        "step_s": 1.0,
        "offline_s": None,
        "alpha": {},
        "fallbacks": None,
    }


def test_validity_and_half_gain_worked_out_on_made_up_runs():
    a, b, c, d = REWARDS
    singles = {  # per seed: the trained reward's gain and the others' changes
        a: [{a: 0.2, b: -1.0, c: 5.0, d: 0.0}, {a: 0.1, b: -0.5, c: -1.0, d: 0.1}, {a: 0.3, b: 0.5, c: 2.0, d: 0.0}],
        b: [{a: 0.0, b: 1.0, c: 0.0, d: 0.0}] * 3,
        c: [
            {a: -0.1, b: 0.0, c: 10.0, d: -0.1},
            {a: -0.1, b: 0.0, c: 10.0, d: 0.1},
            {a: 0.1, b: 0.0, c: -2.0, d: -0.1},
        ],
        d: [{a: 0.0, b: 0.0, c: 0.0, d: 0.1}] * 3,
    }
    runs = {f"single_{r}": {seed: made_up_run(x) for seed, x in enumerate(per_seed)} for r, per_seed in singles.items()}
    halves = {a: 0.1, b: 0.5, c: 5.0, d: 0.05}  # exactly half of seed 0's gains (0.2, 1.0, 10.0, 0.1)
    runs["marble"] = {
        0: made_up_run(halves),  # keeps half of every gain: True
        1: made_up_run({**halves, b: 0.49}),  # b below half of its 1.0: False
        2: made_up_run({a: 0.2, b: 0.5, c: -1.0, d: 0.05}),  # c's single gain was -2: half of it is -1, kept: True
    }
    result = balancers_result(runs, None, [], {"seeds": [0, 1, 2]}, {})
    assert result["single_reward_gain"] == {a: [0.2, 0.1, 0.3], b: [1.0] * 3, c: [10.0, 10.0, -2.0], d: [0.1] * 3}
    assert result["single_reward_rises_every_seed"] == {a: True, b: True, c: False, d: True}
    assert result["single_reward_cross"][a][b] == [-1.0, -0.5, 0.5]
    lowered = {(x["trained"], x["lowered"]): x["seeds_lowered"] for x in result["conflicts"]}
    assert lowered == {(a, b): 2, (c, a): 2, (c, d): 2}  # lowered on 2 of 3 seeds; (a, c) only on 1
    assert result["keeps_half"] == {"marble": [True, False, True]} and result["keeps_half_seeds"] == {"marble": 2}


def test_tuned_weights_reach_the_weighted_sum_config():
    from flowrl.bench.balancers import TOY_CONFIGS, _fixed
    from flowrl.trainers import load_config

    stem, extra = BALANCER_RUNS["weighted_sum_tuned"]
    cfg = load_config(TOY_CONFIGS / f"{stem}.yaml", [*_fixed("/tmp/unused", "x", 0), *extra])
    assert {r.name: r.weight for r in cfg.rewards} == TUNED_WEIGHTS
    assert cfg.rewards[1].kwargs == {"output": "log_odds"}


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
    assert balancer_order(None)[0] == "single_toy_attributes" and "marble_full" in balancer_order(None)
    assert balancer_order(["smopd", "weighted_sum"]) == ["weighted_sum", "smopd"]


def test_parts_run_apart_merge_into_one_bench(tmp_path):
    common = dict(overrides=TINY, num_seeds=1, eval_num_steps=2)
    a = bench_balancers(balancers=["weighted_sum"], seeds=[0], out_json=tmp_path / "a.json", timing_steps=0, **common)
    b = bench_balancers(balancers=["weighted_sum"], seeds=[1], out_json=tmp_path / "b.json", timing_steps=0, **common)
    assert a["side_by_side_step_s"] is None and a["marble_step_ratio"] is None
    t = tmp_path / "t.json"  # the timing alone, as `--timing-only` writes it
    assert (
        cli.main(
            [
                "bench",
                "balancers",
                "--json",
                str(t),
                "--timing-only",
                "--timing-steps",
                "1",
                "--heldout-seeds",
                "1",
                *TINY,
            ]
        )
        == 0
    )
    timing = json.loads(t.read_text())
    assert timing["runs"] == {} and set(timing["side_by_side_step_s"]) == {"weighted_sum", "marble"}
    out = tmp_path / "merged.json"
    parts = [str(tmp_path / "a.json"), str(tmp_path / "b.json"), str(t)]
    assert cli.main(["bench", "balancers", "--json", str(out), "--merge", *parts]) == 0
    merged = json.loads(out.read_text())
    pooled = {"weighted_sum": {0: a["runs"]["weighted_sum"]["0"], 1: b["runs"]["weighted_sum"]["1"]}}
    settings = {**a["settings"], "seeds": [0, 1]}
    expected = balancers_result(pooled, timing["side_by_side_step_s"], TINY, settings, a["host"])
    assert merged == json.loads(json.dumps(expected))  # the runs pooled, the timing from the part that has it
    for reward in REWARDS:
        pair = [a["per_reward_delta"]["weighted_sum"][reward][0], b["per_reward_delta"]["weighted_sum"][reward][0]]
        assert merged["per_reward_delta"]["weighted_sum"][reward] == pair
    assert merged["marble_step_ratio"] == timing["marble_step_ratio"] is not None
    for paths, expected_error in [
        ([tmp_path / "a.json", tmp_path / "a.json"], "seed 0 is in two of the files"),
        ([t, t], "both carry a side-by-side timing"),
        ([tmp_path / "a.json"], "name at least two"),
    ]:
        with pytest.raises(ValueError, match=expected_error):
            merge_balancers(paths)
    (tmp_path / "c.json").write_text(json.dumps({**a, "overrides": ["num_steps=3"]}))
    with pytest.raises(ValueError, match="differ from"):
        merge_balancers([tmp_path / "b.json", tmp_path / "c.json"])
    (tmp_path / "u.json").write_text(json.dumps({**timing, "overrides": ["num_steps=3"]}))
    with pytest.raises(ValueError, match="u.json: its overrides"):
        merge_balancers([tmp_path / "a.json", tmp_path / "u.json"])
    with pytest.raises(ValueError, match="measures nothing"):
        bench_balancers(seeds=[], timing_steps=0, **common)


def test_world_by_count_reads_the_world_renders():
    from flowrl.bench.balancers import world_by_count
    from flowrl.toy.exact import find_blobs
    from flowrl.toy.world import ALL_SPECS, render

    table = world_by_count.__wrapped__(2)
    specs = [s for s in ALL_SPECS for _ in range(2)]
    for n in (1, 2, 3):  # the mean of each render's mean shape area, from the exact checker's blobs here
        areas = [
            sum(b.area for b in blobs) / len(blobs)
            for i, spec in enumerate(specs)
            if spec.count == n
            for blobs in find_blobs(render(spec, i)[None])
        ]
        assert table[str(n)]["toy_size"] == pytest.approx(sum(areas) / len(areas), abs=1e-3)
    assert table["1"]["toy_midline"] > table["2"]["toy_midline"] >= table["3"]["toy_midline"]  # rarer with more shapes
