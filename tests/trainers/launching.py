"""Real multi-process runs for the process tests: `accelerate launch` with a shipped preset, written once.

Every launch takes its own free port (`free_port`), so launches from different test modules, or from two pytest-xdist
workers at once, never share a rendezvous port."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import flowrl.trainers.kit as kit

ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = ROOT / "scripts" / "train.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that the OS just gave out (bound to port 0, then released) for the launch to take."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    """The environment of a launched run: offline hub, the repository importable (scripts/train.py, tests' helpers)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}


def launch_command(preset: str, script: Path, *args, num_processes: int = 2) -> list[str]:
    """`python -m accelerate.commands.launch` of `script args...` with configs/accelerate/<preset>.yaml, `num_processes`
    processes and a fresh free port."""
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "configs" / "accelerate" / f"{preset}.yaml"),
        "--num_processes",
        str(num_processes),
        "--main_process_port",
        str(free_port()),
        str(script),
        *map(str, args),
    ]


def launch(preset: str, config, *, num_processes: int = 2, timeout: float = 600, tail: int = 4000) -> None:
    """Train `config` (scripts/train.py --config) under the preset and wait: it must exit 0 (else the last `tail`
    characters of its stderr are the failure)."""
    cmd = launch_command(preset, TRAIN_SCRIPT, "--config", config, num_processes=num_processes)
    done = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-tail:]


def launch_in_background(preset: str, script: Path, *args, log: Path, num_processes: int = 2) -> subprocess.Popen:
    """Start `script args...` under the preset without waiting; stdout and stderr go to the file `log`."""
    cmd = launch_command(preset, script, *args, num_processes=num_processes)
    with open(log, "w") as stream:
        return subprocess.Popen(cmd, env=env(), stdout=stream, stderr=subprocess.STDOUT)


def one_and_two_processes(tmp_path: Path, one: Path) -> tuple[Path, list[list[dict]]]:
    """Config `one` trained in this process, then the same config (named "two") launched on 2 gloo processes:
    (the runs folder, each run's metrics.jsonl lines)."""
    import json

    import yaml

    from flowrl.trainers import build_trainer, load_config

    kit.train(build_trainer(load_config(one)))
    two = tmp_path / "two.yaml"
    two.write_text(yaml.safe_dump({**yaml.safe_load(one.read_text()), "name": "two"}))
    launch("cpu_2proc", two)
    runs = tmp_path / "runs"
    assert json.loads((runs / "two" / "launch.json").read_text())["num_processes"] == 2
    return runs, [
        [json.loads(x) for x in (runs / r / "metrics.jsonl").read_text().splitlines()] for r in ("one", "two")
    ]


def assert_same_checkpoints(
    runs: Path, files: tuple[str, ...], step: str = "step_000002", tolerance: float = 1e-5
) -> None:
    """The one- and two-process runs' checkpoint `files` hold the same keys and values within `tolerance`."""
    from safetensors.torch import load_file

    for file in files:
        a, b = (load_file(str(runs / r / "checkpoints" / step / file)) for r in ("one", "two"))
        assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) < tolerance, file


def toy_config_run(tmp_path: Path, name: str) -> list[dict]:
    """configs/toy/<name>.yaml shrunk to 2 steps of 2 prompts x 4 (4 sampler steps, 2 training times): its metrics."""
    import json

    from flowrl.trainers import build_trainer, load_config

    small = ["data.num_prompts_per_step=2", "data.group_size=4", "sampler.num_steps=4", "train.num_train_timesteps=2"]
    cfg = load_config(
        ROOT / "configs" / "toy" / f"{name}.yaml",
        [f"output_dir={tmp_path}", "num_steps=2", "logging.trackers=[]", "logging.progress_bar=false", *small]
        + ["eval.every_n_steps=0", "eval.seeds=[0]", "eval.num_steps=2", "checkpoint.every_n_steps=0"],
    )
    kit.train(build_trainer(cfg))
    return [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]


def straight_and_resumed(
    make_config,
    tmp_path: Path,
    extra: dict,
    steps: int = 2,
    keys=("trainable", "ema", "optimizer", "lr_scheduler", "trainer_state"),
) -> tuple:
    """`steps` steps straight, and one step then the rest resumed from its checkpoint (configs from
    `make_config(folder, num_steps=..., **overrides)`, `extra` holding checkpoint.every_n_steps = 1); asserts the last
    checkpoints' `keys` and the resumed trainer's live weights equal bit for bit. Returns (the straight config, its
    metrics lines, the resumed trainer)."""
    import json

    from test_trainer_contract import assert_same, trainable

    from flowrl.trainers import build_trainer
    from flowrl.training.checkpoint import load_checkpoint

    straight = make_config(tmp_path / "a", num_steps=steps, **extra)
    kit.train(build_trainer(straight))
    lines = [json.loads(line) for line in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    kit.train(build_trainer(make_config(tmp_path / "b", num_steps=1, **extra)))
    resumed_cfg = make_config(tmp_path / "b", num_steps=steps, **{"checkpoint.resume": "latest"}, **extra)
    resumed = build_trainer(resumed_cfg)
    kit.train(resumed)
    a, b = (load_checkpoint(c.run_dir / "checkpoints" / f"step_{steps:06d}") for c in (straight, resumed_cfg))
    for key in keys:
        assert_same(a[key], b[key], key)
    assert_same(a["trainable"], trainable(resumed), "live weights")
    return straight, lines, resumed
