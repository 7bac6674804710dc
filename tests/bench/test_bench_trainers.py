"""`flowrl bench trainers` (flowrl/bench/trainers.py): the race's JSON shape and consistency, its plot, its medians
rule, its CLI and its one-line errors, on the shipped toy model at tiny sizes (2 train steps, 1 held-out seed, 2 ODE
steps)."""

import json

import pytest

from flowrl import cli
from flowrl.bench import report as report_bench
from flowrl.bench import trainers as race
from flowrl.bench.trainers import first_reaching, race_result
from flowrl.plan.projection import median_if_most

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

TINY = [
    "num_steps=2",
    "data.num_prompts_per_step=2",
    "data.group_size=2",
    "sampler.num_steps=3",
]  # grpo's SDE window: 3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ENTRY_KEYS = {
    "config",
    "seeds",
    "final_accuracy",
    "final_judge_accuracy",
    "final_artifact",
    "base_artifact",
    "steps_to_target",
    "seconds_to_target",
    "train_seconds",
    "curves",
    "artifact_at_target",
    "impossible_at_target",
    "diversity_at_target",
    "final_diversity",
    "time_shares",
    "work_curves",
}


def test_race_of_grpo_alone_writes_consistent_json_and_a_png(tmp_path):
    out = tmp_path / "deep" / "race.json"
    result = race.bench_trainers(
        recipes=["grpo"], seeds=[0], eval_every_n_steps=1, overrides=TINY, out_json=out, num_seeds=1, eval_num_steps=2
    )
    assert json.loads(out.read_text()) == result
    assert {
        "target_accuracy",
        "recipes",
        "steps_to_grpo_final",
        "seconds_to_grpo_final",
        "seconds_ratio_to_grpo",
    } <= set(result)
    assert result["overrides"] == TINY and {"cpu_count", "torch_threads", "torch_version"} <= set(result["host"])
    entry = result["recipes"]["grpo"]
    assert set(entry) == ENTRY_KEYS and entry["config"] == "configs/toy/grpo.yaml" and entry["seeds"] == [0]
    (curve,) = entry["curves"]
    assert [p[0] for p in curve] == [0, 1, 2]  # base, every step, the final step (not repeated)
    assert curve[0][1] == 0.0 and all(a[1] < b[1] for a, b in zip(curve, curve[1:]))
    assert entry["train_seconds"] == [curve[-1][1]]
    assert entry["final_accuracy"] == [curve[-1][2]] and entry["final_judge_accuracy"] == [curve[-1][3]]
    assert entry["final_artifact"] == [curve[-1][4]]
    assert entry["artifact_at_target"] == [next(p[4] for p in curve if p[0] == entry["steps_to_target"][0])]
    assert entry["impossible_at_target"] == [next(p[5] for p in curve if p[0] == entry["steps_to_target"][0])]
    assert all(0 <= p[5] <= 1 for p in curve)
    assert all(p[6] is None for p in curve) and entry["final_diversity"] == [None]  # one held-out seed: no pair
    (shares,) = entry["time_shares"]  # the trainer's perf/ timings: rollout + reward + optimise + other = 1
    assert set(shares) == {"rollout", "reward", "optimise", "other"} and all(0 <= v <= 1 for v in shares.values())
    assert sum(shares.values()) == pytest.approx(1.0, abs=2e-3) and shares["rollout"] > 0 and shares["optimise"] > 0
    assert all(0 <= p[2] <= 1 and 0 <= p[3] <= 1 for p in curve)
    assert result["target_accuracy"] == curve[-1][2]  # the median of one seed's final accuracy
    # the work meter's counts at each point (cumulative), priced at SD3.5-M 512 px (flowrl.plan.projection)
    (work,) = entry["work_curves"]
    assert len(work) == len(curve) and work[0] == {} and work[1]["work/rollout/forward/policy"] > 0
    assert work[2]["work/rollout/forward/policy"] == 2 * work[1]["work/rollout/forward/policy"]
    from flowrl.plan import projection

    projected = result["projection"]["recipes"]["grpo"]["curves"]["h100"][0]
    assert projected[0] == 0.0 and projected[2] == round(projection.projected_seconds(work[2], "h100"), 3)
    reached = next(i for i, p in enumerate(curve) if p[2] >= result["target_accuracy"])
    assert result["projected_seconds_to_target"]["grpo"]["h100"]["grpo"] == [projected[reached]]
    same = 1.0 if projected[reached] > 0 else None  # a base model already at the target has no speed-up to give
    assert result["projected_speedup"] == {"h100": {"grpo": {"grpo": same}}, "b200": {"grpo": {"grpo": same}}}
    first = next(p for p in curve if p[2] >= result["target_accuracy"])
    assert entry["steps_to_target"] == [first[0]] and entry["seconds_to_target"] == [first[1]]
    assert result["steps_to_grpo_final"] == {"grpo": first[0]} and result["seconds_to_grpo_final"] == {"grpo": first[1]}
    assert result["seconds_ratio_to_grpo"] == {"grpo": 1.0 if first[1] > 0 else None}
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC


def test_cli_runs_the_race_with_overrides_and_keeps_the_other_benches(tmp_path, capsys, monkeypatch):
    out = tmp_path / "cli.json"
    argv = ["bench", "trainers", "--json", str(out), "--recipes", "grpo", "--seeds", "0", "--heldout-seeds", "1"]
    assert cli.main([*argv, *TINY, "num_steps=1", "eval.num_steps=2"]) == 0
    result = json.loads(out.read_text())
    assert result["recipes"]["grpo"]["seeds"] == [0] and [p[0] for p in result["recipes"]["grpo"]["curves"][0]] == [
        0,
        1,
    ]
    assert result["overrides"][-2:] == ["num_steps=1", "eval.num_steps=2"] and result["settings"]["heldout_seeds"] == 1
    assert out.with_suffix(".png").read_bytes()[:8] == PNG_MAGIC
    assert "grpo" in capsys.readouterr().out

    calls = []
    monkeypatch.setattr(report_bench, "bench_report", lambda repeats: calls.append(repeats) or {"ok": True})
    assert cli.main(["bench", "report", "--json", str(tmp_path / "report.json"), "--repeats", "2"]) == 0
    assert calls == [2] and json.loads((tmp_path / "report.json").read_text()) == {"ok": True}


def one_line_error(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flowrl bench: error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--recipes", "grpo,no_such_recipe"], ["'no_such_recipe'", "configs/toy/no_such_recipe.yaml", "grpo"]),
        (["--recipes", "grpo,grpo"], ["twice"]),
        (["--seeds", "0,x"], ["--seeds '0,x'", "--seeds 0,1,2"]),
        (["--seeds", "0,0"], ["--seeds 0,0", "each once"]),
        (["--eval-every", "0"], ["--eval-every '0'", ">= 1"]),
        (["--heldout-seeds", "many"], ["--heldout-seeds 'many'"]),
        (["no_such_key=1"], ["no_such_key"]),
    ],
)
def test_bad_input_is_one_line_naming_the_flag(tmp_path, capsys, extra, expected):
    out = tmp_path / "bad.json"
    err = one_line_error(["bench", "trainers", "--json", str(out), "--recipes", "grpo", *extra], capsys)
    assert all(text in err for text in expected), err
    assert not out.exists()


def test_unknown_recipe_fails_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="'nope' has no configs/toy/nope.yaml; the recipes are grpo"):
        race.bench_trainers(recipes=["grpo", "nope"], out_json=tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_recipes_default_to_every_toy_config_grpo_first_and_need_grpo(tmp_path, monkeypatch):
    for stem in ("adjoint", "zeta", "grpo", "nft", "multireward_marble"):  # the multi-reward configs are not raced
        (tmp_path / f"{stem}.yaml").write_text("")
    (tmp_path / "notes.txt").write_text("")
    monkeypatch.setattr(race, "TOY_CONFIGS", tmp_path)
    assert race.recipe_order(None) == ["grpo", "adjoint", "nft", "zeta"]
    assert race.recipe_order(["zeta", "grpo"]) == ["grpo", "zeta"]  # grpo runs first: it sets the target
    with pytest.raises(ValueError, match="--recipes nft lacks grpo: .* --recipes grpo,nft"):
        race.recipe_order(["nft"])
    assert race.recipe_order(["nft", "zeta"], part=True) == ["nft", "zeta"]  # a part of a race, merged later
    assert race.recipe_order(["nft", "grpo"], part=True) == ["grpo", "nft"]
    with pytest.raises(ValueError, match="--recipes is empty"):
        race.recipe_order([])


def test_the_image_to_video_recipes_race_apart_against_their_own_baseline(tmp_path, monkeypatch):
    for stem in ("grpo", "nft", "grpo_i2v", "tagrpo_i2v"):
        (tmp_path / f"{stem}.yaml").write_text("")
    monkeypatch.setattr(race, "TOY_CONFIGS", tmp_path)
    assert race.recipe_order(None) == ["grpo", "nft"]  # the default race stays in the text-to-image world
    assert race.recipe_order(None, baseline="grpo_i2v") == ["grpo_i2v", "tagrpo_i2v"]
    with pytest.raises(ValueError, match="'tagrpo_i2v' trains in the toy i2v world but --baseline 'grpo'"):
        race.recipe_order(["grpo", "tagrpo_i2v"])
    with pytest.raises(ValueError, match="--recipes tagrpo_i2v lacks grpo_i2v"):
        race.recipe_order(["tagrpo_i2v"], baseline="grpo_i2v")
    with pytest.raises(ValueError, match="--baseline 'nope' has no configs/toy/nope.yaml"):
        race.recipe_order(None, baseline="nope")
    runs = {
        "grpo_i2v": {
            0: {
                "curve": [[0, 0.0, 0.4, 0.4, 1.0], [2, 5.0, 0.6, 0.6, 1.0]],
                "final_judge_accuracy": 0.6,
                "final_artifact": 1.0,
                "base_artifact": 1.0,
                "train_seconds": 5.0,
            }
        }
    }
    result = race_result(runs, [], {"seeds": [0], "baseline": "grpo_i2v"}, {})
    assert result["baseline"] == "grpo_i2v" and result["target_accuracy"] == 0.6
    assert result["seconds_ratio_to_grpo"] == {"grpo_i2v": 1.0}


def test_medians_are_over_the_seeds_that_reached_and_null_below_half():
    assert median_if_most([4, None, 2]) == 3 and median_if_most([4, None]) == 4
    assert median_if_most([4, None, None]) is None and median_if_most([None]) is None
    curve = [[0, 0.0, 0.1, 0.2], [5, 1.5, 0.3, 0.4], [10, 3.0, 0.25, 0.5]]
    assert first_reaching(curve, 0.3) == (5, 1.5) and first_reaching(curve, 0.1) == (0, 0.0)
    assert first_reaching(curve, 0.9) == (None, None) and first_reaching(curve, None) == (None, None)


def test_race_result_target_medians_and_ratio_from_fabricated_runs():
    def run(*points):  # points: (step, seconds, exact)
        curve = [[s, t, a, a, 0.9 - s / 100] for s, t, a in points]
        return {
            "curve": curve,
            "final_judge_accuracy": 0.0,
            "final_artifact": 0.5,
            "base_artifact": 0.4,
            "train_seconds": 9,
        }

    grpo = {
        0: run((0, 0.0, 0.1), (10, 2.0, 0.5)),
        1: run((0, 0.0, 0.1), (10, 4.0, 0.3)),
        2: run((0, 0.0, 0.1), (10, 6.0, 0.6)),
    }
    nft = {
        0: run((0, 0.0, 0.1), (5, 1.0, 0.5)),
        1: run((0, 0.0, 0.1), (5, 1.0, 0.2)),
        2: run((0, 0.0, 0.1), (5, 0.5, 0.4)),
    }
    settings = {"seeds": [0, 1, 2]}
    partial = race_result({"grpo": dict(list(grpo.items())[:2])}, [], settings, {})
    assert partial["target_accuracy"] is None and partial["recipes"]["grpo"]["steps_to_target"] == [None, None]
    result = race_result({"grpo": grpo, "nft": nft}, ["num_steps=10"], settings, {})
    assert result["target_accuracy"] == 0.5
    assert result["recipes"]["grpo"]["steps_to_target"] == [10, None, 10]
    assert result["recipes"]["nft"]["seconds_to_target"] == [1.0, None, None]
    assert result["steps_to_grpo_final"] == {"grpo": 10, "nft": None}  # nft: 1 of 3 seeds reached it
    assert result["seconds_to_grpo_final"] == {"grpo": 4.0, "nft": None}
    assert result["seconds_ratio_to_grpo"] == {"grpo": 1.0, "nft": None}
    assert result["recipes"]["nft"]["base_artifact"] == 0.4 and result["overrides"] == ["num_steps=10"]
    assert result["recipes"]["nft"]["artifact_at_target"] == [0.85, None, None]
    assert result["recipes"]["nft"]["impossible_at_target"] == [None, None, None]  # 5-point curves: none recorded
    assert result["recipes"]["nft"]["diversity_at_target"] == [None] * 3 == result["recipes"]["nft"]["final_diversity"]
    assert race.time_shares({"step": 4.0, "rollout": 2.0, "reward": 1.0, "optimise": 0.5}) == {
        "rollout": 0.5,
        "reward": 0.25,
        "optimise": 0.125,
        "other": 0.125,
    }
    assert race.time_shares({"step": 0.0, "rollout": 0.0, "reward": 0.0, "optimise": 0.0}) is None


def test_merged_per_seed_races_equal_the_race_of_all_seeds(tmp_path):
    def run(*points):  # points: (step, seconds, exact)
        curve = [[s, t, a, a, 0.9] for s, t, a in points]
        return {
            "curve": curve,
            "final_judge_accuracy": 0.1,
            "final_artifact": 0.8,
            "base_artifact": 0.9,
            "train_seconds": curve[-1][1],
        }

    runs = {
        "grpo": {
            0: run((0, 0.0, 0.1), (10, 2.0, 0.5)),
            1: run((0, 0.0, 0.1), (10, 4.0, 0.3)),
            2: run((0, 0.0, 0.1), (10, 6.0, 0.6)),
        },
        "ram": {
            0: run((0, 0.0, 0.1), (2, 1.0, 0.5)),
            1: run((0, 0.0, 0.1), (2, 1.0, 0.6)),
            2: run((0, 0.0, 0.1), (2, 0.5, 0.2)),
        },
    }
    settings = {"heldout_seeds": 16, "eval_num_steps": None, "eval_every_n_steps": 2, "clock": "cpu"}
    paths = []
    for seed in (2, 0, 1):  # any order of files
        part = race_result(
            {n: {seed: by_seed[seed]} for n, by_seed in runs.items()}, ["x=1"], {**settings, "seeds": [seed]}, {}
        )
        paths.append(tmp_path / f"s{seed}.json")
        paths[-1].write_text(json.dumps(part))
    merged = race.merge_results(paths, tmp_path / "race.json")
    expected = race_result(runs, ["x=1"], {**settings, "seeds": [0, 1, 2]}, {})
    assert merged == expected == json.loads((tmp_path / "race.json").read_text())
    assert merged["target_accuracy"] == 0.5 and merged["steps_to_grpo_final"] == {"grpo": 10, "ram": 2}
    assert (tmp_path / "race.png").read_bytes()[:8] == PNG_MAGIC
    against_ram = race.merge_results(paths, baseline="ram")  # another recipe's median final as the target
    assert against_ram["baseline"] == "ram" and against_ram["target_accuracy"] == 0.5
    assert against_ram["steps_to_grpo_final"] == {"ram": 2, "grpo": 10}
    with pytest.raises(ValueError, match="grpo seed 0 is in two"):
        race.merge_results([paths[1], paths[1]])
    other = json.loads(paths[0].read_text())
    other["settings"]["clock"] = "wall"
    (tmp_path / "wall.json").write_text(json.dumps(other))
    with pytest.raises(ValueError, match="merge like races only"):
        race.merge_results([paths[1], tmp_path / "wall.json"])


def test_cpu_clock_is_recorded_and_a_bad_clock_is_one_line(tmp_path):
    result = race.bench_trainers(
        recipes=["grpo"],
        seeds=[0],
        eval_every_n_steps=1,
        overrides=[*TINY, "num_steps=1"],
        num_seeds=1,
        eval_num_steps=2,
        clock="cpu",
        progress=False,
    )
    assert result["settings"]["clock"] == "cpu" and result["recipes"]["grpo"]["train_seconds"][0] > 0
    with pytest.raises(ValueError, match="--clock 'gpu' must be one of wall, cpu"):
        race.bench_trainers(recipes=["grpo"], seeds=[0], clock="gpu")
