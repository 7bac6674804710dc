"""The rollout drift in a trained run's report: toy runs through kit.train (a GRPO run, the log-prob path, and an NFT
run, the velocity path) log `drift/...` every step, and `flowrl report` shows each metric's last and largest value,
read back from metrics.jsonl, and their curves."""

import json

import pytest
from test_drift import toy_config

import flowrl.trainers.kit as kit
from flowrl.cli import main
from flowrl.trainers import build_trainer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py


@pytest.mark.parametrize(
    "trainer, keys",
    [
        ("grpo", ["drift/logprob_abs_max", "drift/logprob_abs_mean", "drift/logprob_beyond"]),
        ("nft", ["drift/velocity_rel", "drift/velocity_rel_max"]),
    ],
)
def test_a_trained_runs_report_shows_its_drift(tmp_path, capsys, trainer, keys):
    overrides = {"train.learning_rate": 1e-2, "eval.every_n_steps": 0}
    kit.train(build_trainer(toy_config(tmp_path, trainer, **overrides)))
    run = tmp_path / "runs" / "drift"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if any(key.startswith("drift/") for key in row)]
    assert len(logged) == 2 and all(sorted(k for k in row if k.startswith("drift/")) == keys for row in logged)
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    page = (run / "report" / "index.html").read_text()
    assert '<h3 id="drift">Rollout drift</h3>' in page
    assert f'alt="rollout drift: {", ".join(keys)}"' in page  # the curves
    for key in keys:
        values = [row[key] for row in logged]
        last = f'data-run="drift" data-metric="{key}" data-kind="last">{values[-1]:.3g}<'
        top = f'data-run="drift" data-metric="{key}" data-kind="max">{max(values):.3g}<'
        assert last in page and top in page, key
