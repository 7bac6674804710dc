"""`flowrl bench balancers` (flowrl/bench/balancers.py): the JSON's shape and its consistency with the runs, the CLI and
its one-line errors, on the shipped toy model at tiny sizes (2 train steps, 1 held-out seed, 2 ODE steps)."""

import json

import pytest

from flowrl import cli
from flowrl.bench.balancers import REWARDS, balancer_order, balancers_result, bench_balancers, merge_balancers

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


def test_parts_run_apart_merge_into_one_bench(tmp_path):
    common = dict(overrides=TINY, num_seeds=1, eval_num_steps=2)
    a = bench_balancers(balancers=["weighted_sum"], seeds=[0], out_json=tmp_path / "a.json", timing_steps=0, **common)
    b = bench_balancers(balancers=["weighted_sum"], seeds=[1], out_json=tmp_path / "b.json", timing_steps=0, **common)
    assert a["side_by_side_step_s"] is None and a["marble_step_ratio"] is None
    t = tmp_path / "t.json"  # the timing alone, as `--timing-only` writes it
    assert (
        cli.main(["bench", "balancers", "--json", str(t), "--timing-only", "--timing-steps", "1", "--heldout-seeds", "1", *TINY])
        == 0
    )
    timing = json.loads(t.read_text())
    assert timing["runs"] == {} and set(timing["side_by_side_step_s"]) == {"nft", "weighted_sum", "marble"}
    out = tmp_path / "merged.json"
    parts = [str(tmp_path / "a.json"), str(tmp_path / "b.json"), str(t)]
    assert cli.main(["bench", "balancers", "--json", str(out), "--merge", *parts]) == 0
    merged = json.loads(out.read_text())
    pooled = {name: {0: a["runs"][name]["0"], 1: b["runs"][name]["1"]} for name in ("nft", "weighted_sum")}
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


def test_jpeg_by_count_reads_the_world_renders_and_prefers_fewer_shapes():
    import io

    import numpy as np
    from PIL import Image

    from flowrl.bench.balancers import jpeg_by_count
    from flowrl.toy.world import ALL_SPECS, render

    table = jpeg_by_count.__wrapped__(2)
    for n in (1, 2, 3):  # minus the kB of a quality-95 JPEG, encoded here straight through PIL
        sizes = []
        for i, spec in enumerate(s for s in ALL_SPECS for _ in range(2)):
            if spec.count == n:
                pixels = (render(spec, i) * 255).round().clamp(0, 255).byte().permute(1, 2, 0).numpy()
                buffer = io.BytesIO()
                Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format="JPEG", quality=95)
                sizes.append(-buffer.tell() / 1000)
        assert table[str(n)]["mean"] == pytest.approx(float(np.mean(sizes)), abs=1e-4)
    assert table["1"]["mean"] > table["2"]["mean"] > table["3"]["mean"]  # every shape costs JPEG reward
