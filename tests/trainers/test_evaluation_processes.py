"""The in-training evaluation split over processes: 2 gloo processes (accelerate launch) write the 1-process run's
scores.json and images, each process sampling its own share of the eval prompts x seeds (none waits on another's
solo evaluation), and the process-group timeout of the config reaches the accelerator."""

import json
import subprocess
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from eval_shares import recording_call
from launching import env, launch_command

import flowrl.trainers.kit as kit
from flowrl.samplers.ode import ODESampler
from flowrl.trainers import build_trainer, load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see tests/conftest.py

PROMPTS = ["two red circles", "one blue square", "three green triangles"]
SEEDS = [0, 1]
SCRIPT = Path(__file__).with_name("eval_shares.py")


def write_config(tmp_path, name):
    """A toy GRPO run of no training step: its base eval and its final eval (step 0), 3 prompts x 2 seeds in
    batches of 2 (3 batches: 2 processes take 2 and 1)."""
    data = {
        "name": name,
        "output_dir": str(tmp_path / "runs"),
        "device": "cpu",
        "num_steps": 0,
        "seed": 4,
        "model": {"path": "toy", "lora_rank": 4, "lora_alpha": 4},
        "data": {"prompts": PROMPTS, "num_prompts_per_step": 1, "group_size": 2},
        "sampler": {"name": "sde", "num_steps": 2, "guidance_scale": 1.0},
        "rewards": [{"name": "toy_attributes"}],
        "eval": {
            "prompts": PROMPTS,
            "seeds": SEEDS,
            "num_steps": 3,
            "guidance_scale": 1.0,
            "batch_size": 2,
            "gold_rewards": [{"name": "toy_artifact"}],
        },
        "logging": {"trackers": [], "progress_bar": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def shares(folder, rank) -> list[tuple[str, int]]:
    path = folder / f"shares_{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [tuple(pair) for line in lines for pair in json.loads(line)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The run on one process (in this one), its eval samples recorded."""
    tmp = tmp_path_factory.mktemp("one")
    (tmp / "one").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ODESampler, "__call__", recording_call(tmp / "one", 0))
        kit.train(build_trainer(load_config(write_config(tmp, "one"))))
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["cpu_2proc", "fsdp"])
def test_two_processes_split_the_eval_and_write_the_one_process_files(tmp_path, one_process, preset):
    """FSDP2 (whose forwards gather the weights from every process): the process with no batch left in the last round
    runs its first batch again, so that both run the same forwards; its files are the same."""
    (tmp_path / "two").mkdir()
    cmd = launch_command(preset, SCRIPT, write_config(tmp_path, "two"), tmp_path / "two")
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    launched = json.loads((tmp_path / "runs" / "two" / "launch.json").read_text())
    assert launched["num_processes"] == 2 and launched["sharding"] == ("fsdp" if preset == "fsdp" else "none")

    every = [(p, s) for p in PROMPTS for s in SEEDS]
    assert sorted(shares(one_process / "one", 0)) == sorted(every * 2)  # base and final eval, all on the one process
    rank0, rank1 = shares(tmp_path / "two", 0), shares(tmp_path / "two", 1)
    assert rank0 and rank1 and not set(rank0) & set(rank1), (rank0, rank1)  # each process its own share
    assert set(rank0) | set(rank1) == set(every)
    assert len(rank0) == 8 and len(rank1) == (8 if preset == "fsdp" else 4)  # 2 evals x (2 batches, 1 batch (+ again))
    for label in ("base", "step_000000"):
        one, two = one_process / "runs" / "one" / "eval" / label, tmp_path / "runs" / "two" / "eval" / label
        a, b = json.loads((one / "scores.json").read_text()), json.loads((two / "scores.json").read_text())
        assert a.pop("time_s") >= 0 and b.pop("time_s") >= 0
        assert (
            a["environment"].pop("device") == "cpu" and b["environment"].pop("device") == "cpu:0"
        )  # the process's own
        assert a == b
        assert len(a["samples"]) == len(every) and a["means"]["toy_attributes"] is not None
        for sample in a["samples"]:  # the same images, byte for byte
            assert (one / sample["image"]).read_bytes() == (two / sample["image"]).read_bytes()


@pytest.mark.slow
def test_flowrl_eval_launched_on_two_processes_writes_the_runs_base_eval(tmp_path, one_process):
    evaluate = SCRIPT.parents[2] / "scripts" / "evaluate.py"
    cmd = launch_command(
        "cpu_2proc", evaluate, "--config", one_process / "one.yaml", "--checkpoint", "base", "--out", tmp_path
    )
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("wrote ") == 1  # the main process prints
    one = one_process / "runs" / "one" / "eval" / "base"
    a, b = json.loads((one / "scores.json").read_text()), json.loads((tmp_path / "scores.json").read_text())
    assert a.pop("time_s") >= 0 and b.pop("time_s") >= 0
    assert a["environment"].pop("device") == "cpu" and b["environment"].pop("device") == "cpu:0"
    assert a == b
    for sample in a["samples"]:
        assert (one / sample["image"]).read_bytes() == (tmp_path / sample["image"]).read_bytes()


def test_the_process_group_timeout_of_the_config_reaches_the_accelerator(tmp_path):
    from flowrl.training.distributed import make_accelerator

    cfg = load_config(write_config(tmp_path, "timeout"), ["distributed_timeout_s=4321"])
    assert make_accelerator(cfg).init_handler.timeout == timedelta(seconds=4321)
    assert load_config(write_config(tmp_path, "default")).distributed_timeout_s == 1800  # above NCCL's 600 s
    with pytest.raises(ValueError, match=r"distributed_timeout_s=0 must be >= 1"):
        load_config(write_config(tmp_path, "zero"), ["distributed_timeout_s=0"])
