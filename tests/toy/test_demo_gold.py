"""The demo is graded by the gold (`toy_exact`), and its hacking panel proves itself on a short real GRPO run.

Setting (measured, seed 1, one thread): the demo config (flowrl/toy/grpo.yaml) trained for 8 steps on four "three ..."
prompts, 4 x 4 samples per step, learning rate 1e-2 and no KL so the policy drifts, evaluated on four other "three ..."
prompts x 8 seeds (32 samples). Against the count-blind judge (the first shipped judge, which reads four shapes as three
and two colours as the prompt's one) its eval mean gains 0.41 while toy_exact gains 0.28 on the same samples: the policy
learns scenes the judge misreads (four shapes, mixed colours), a gap of 0.124, six times the margin, and the panel's
paired bootstrap puts its one-sided 95% lower bound at 0.031, above the margin 0.02: flagged. The same run against the
shipped judge (seed 2, faint fraction 0.25) gains 0.073 on the judge and 0.125 on toy_exact: the judge, which now also
knows faint shapes, is the stricter of the two, the gap is -0.052 (bound -0.117): no flag, nor a near one. (The seed-1
judge it replaced: 0.155 and 0.156, gap -0.0017, bound -0.0041.)
"""

from __future__ import annotations

import re

import pytest

import flowrl.trainers.kit as kit
from flowrl.cli import main
from flowrl.demo import CONFIG, HACKING_PAIRS, hacking_pairs
from flowrl.heldout import judge_checkpoint
from flowrl.trainers import build_trainer, load_config

PAIRS = {"toy_exact": "toy_attributes"}
THREES = "['three red circles', 'three blue squares', 'three green triangles', 'three yellow circles']"
HELD_OUT_THREES = "['three green squares', 'three blue circles', 'three yellow triangles', 'three red squares']"
STEPS = 8


def short_run(tmp_path, name: str, reward: str) -> tuple:
    """Train the short drifting run described in the module docstring against `reward`; (config, run folder)."""
    overrides = [
        f"name={name}",
        f"output_dir={tmp_path}",
        "seed=1",
        f"num_steps={STEPS}",
        f"rewards=[{reward}]",
        "data.toy_split=null",
        f"data.prompts={THREES}",
        "data.num_prompts_per_step=4",
        "data.group_size=4",
        "train.learning_rate=1.0e-2",
        "train.kl_coef=0",
        "train.num_minibatches=1",
        "train.gradient_accumulation_steps=1",
        "train.num_rollout_batches=1",
        "eval.toy_split=null",
        f"eval.prompts={HELD_OUT_THREES}",
        "eval.seeds=[0, 1, 2, 3, 4, 5, 6, 7]",
        "checkpoint.every_n_steps=0",
        "logging.trackers=[]",
        "logging.progress_bar=false",
    ]
    cfg = load_config(CONFIG, overrides)
    assert [r.name for r in cfg.eval.gold_rewards] == ["toy_exact", "toy_artifact"]  # the demo config's gold
    kit.train(build_trainer(cfg))
    return cfg, cfg.run_dir


def paired(run_dir) -> dict:
    from flowrl.report import hacking_rows, load_run

    (row,) = hacking_rows(load_run(run_dir), 0.02, PAIRS)  # base -> the final eval
    return row["pairs"]["toy_exact"]


def test_panel_flags_a_run_trained_on_the_count_blind_judge(tmp_path, countblind_checkpoint, capsys):
    from flowrl.report import build_report

    _, run = short_run(tmp_path, "countblind", f"{{name: toy_attributes, checkpoint: {countblind_checkpoint}}}")
    pair = paired(run)
    assert pair["samples"] == 32 and pair["train_gain"] > 0.2, pair  # the hackable judge's eval mean rose a lot ...
    # ... toy_exact on the same samples far less (0.41 vs 0.28)
    assert pair["train_gain"] - pair["gold_gain"] > 0.1, pair
    assert pair["gap"] > 0.1 and pair["bound"] > 0.02 and pair["flagged"], pair  # the 95% lower bound, 0.031, > margin
    result = build_report(run, hacking_pairs=PAIRS)
    assert result["flags"] == {"countblind": [(f"step_{STEPS:06d}", "toy_exact")]}
    (reason,) = [r for _, _, r in result["flag_reasons"]["countblind"]]
    assert re.fullmatch(
        r"gained 0\.\d+ less than toy_attributes on the same 32 samples \(95% lower bound 0\.\d+\)", reason
    )
    page = (run / "report" / "index.html").read_text()
    cell = (
        f'data-flag="1" data-run="countblind" data-reward="toy_exact" data-step="step_{STEPS:06d}" '
        'data-kind="hacking-gap"'
    )
    assert cell in page
    without = build_report(run, out_dir=tmp_path / "unpaired")  # the fall rule alone misses it: toy_exact did not fall
    assert without["flags"] == {"countblind": []}

    assert main(["report", str(run), "--out", str(tmp_path / "cli"), "--hacking-pair", "toy_exact=toy_attributes"]) == 0
    err = capsys.readouterr().err
    assert f"reward hacking? countblind: toy_exact {reason} at step_{STEPS:06d} while a training reward rose" in err


def test_panel_does_not_flag_the_same_run_trained_on_the_retrained_judge(tmp_path):
    from flowrl.report import build_report

    _, run = short_run(tmp_path, "retrained", "{name: toy_attributes}")
    pair = paired(run)
    # both rose (0.073, 0.125)
    assert pair["samples"] == 32 and pair["train_gain"] > 0.05 and pair["gold_gain"] > 0.05, pair
    assert pair["gap"] < 0.01 and pair["bound"] <= 0, pair  # the judge never outran the gold: gap -0.052, bound -0.117
    assert not pair["flagged"] and not pair["near"], pair
    result = build_report(run, hacking_pairs=PAIRS)
    assert result["flags"] == {"retrained": []} and result["flag_reasons"] == {"retrained": []}
    assert (
        "no paired gold reward gained more than the margin less than its training reward with 95% confidence"
        in (run / "report" / "index.html").read_text()
    )


def test_demo_pairs_gold_with_the_training_judge_and_reads_its_checkpoint(countblind_checkpoint):
    cfg = load_config(CONFIG)
    assert hacking_pairs(cfg) == HACKING_PAIRS == PAIRS and judge_checkpoint(cfg) is None  # the shipped judge
    swapped = load_config(CONFIG, [f"rewards=[{{name: toy_attributes, checkpoint: {countblind_checkpoint}}}]"])
    assert judge_checkpoint(swapped) == str(countblind_checkpoint)
    assert hacking_pairs(load_config(CONFIG, ["rewards=[{name: toy_artifact}]"])) == {}  # nothing to pair with


def test_heldout_scores_grade_by_the_exact_checker_beside_the_judge():
    from flowrl.heldout import heldout_scores, sample_images
    from flowrl.models.toy import load_toy_model
    from flowrl.registry import REWARDS
    from flowrl.toy.judges import load_judge
    from flowrl.toy.world import parse_prompt, split_prompts

    model = load_toy_model()
    scores = heldout_scores(model, num_seeds=1, num_steps=4, guidance_scale=1.0)
    assert scores["num_samples"] == 8
    keys = {"exact_accuracy", "judge_accuracy", "impossible_count_rate", "mixed_colour_rate", "artifact"}
    assert keys <= set(scores) and all(0.0 <= scores[k] <= 1.0 for k in keys), scores
    prompts = split_prompts("heldout")
    images = sample_images(model, prompts, [10_000 + i * 100 for i in range(8)], 4, 1.0)
    exact = REWARDS.build("toy_exact")(images, prompts)
    assert scores["exact_accuracy"] == pytest.approx(exact.scores.mean().item(), abs=1e-4)
    assert scores["impossible_count_rate"] == pytest.approx(exact.parts["impossible_count"].mean().item(), abs=1e-4)
    assert scores["diversity"] is None  # one seed per prompt: no pair
    # per sample, what the hacking panel's held-out tests read: the checker's parts and the judge's argmax per head
    for part in ("count", "colour", "shape", "impossible_count"):
        assert scores["reads"]["gold"][part] == "".join(str(int(v)) for v in exact.parts[part].tolist())
    logits = load_judge("attributes")(images)
    for i, head in enumerate(("count", "colour", "shape")):
        labels = [parse_prompt(p).labels[i] for p in prompts]
        assert scores["reads"]["judge"][head] == "".join(
            str(int(v == y)) for v, y in zip(logits[head].argmax(1).tolist(), labels)
        )


def test_heldout_diversity_is_the_mean_rms_pixel_distance_of_each_prompts_seeds():
    from flowrl.heldout import heldout_scores, sample_images
    from flowrl.models.toy import load_toy_model
    from flowrl.toy.world import split_prompts

    model = load_toy_model()
    scores = heldout_scores(model, num_seeds=2, num_steps=3, guidance_scale=1.0)
    prompts = split_prompts("heldout")
    rms = []
    for i, prompt in enumerate(prompts):  # two seeds each: one pair, its RMS pixel difference
        a, b = sample_images(model, [prompt, prompt], [10_000 + i * 100, 10_000 + i * 100 + 1], 3, 1.0).double()
        rms.append(((a - b) ** 2).mean().sqrt().item())
    assert scores["diversity"] == pytest.approx(sum(rms) / len(rms), abs=1e-4) and scores["diversity"] > 0


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "toy_exact",
            r"--hacking-pair 'toy_exact' must be GOLD=TRAIN \(two reward names\), e.g. toy_exact=toy_attributes",
        ),
        ("=toy_attributes", r"--hacking-pair '=toy_attributes' must be GOLD=TRAIN"),
    ],
)
def test_report_rejects_a_malformed_hacking_pair(tmp_path, capsys, value, message):
    import re

    assert main(["report", str(tmp_path), "--hacking-pair", value]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err


def test_report_rejects_a_gold_reward_paired_twice(tmp_path, capsys):
    args = ["report", str(tmp_path), "--hacking-pair", "toy_exact=toy_attributes", "--hacking-pair", "toy_exact=other"]
    assert main(args) == 2
    assert "--hacking-pair pairs 'toy_exact' twice" in capsys.readouterr().err
