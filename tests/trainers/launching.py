"""Real multi-process runs for the process tests: `accelerate launch` with a shipped preset, written once.

Every launch takes its own free port (`free_port`), so launches from different test modules, or from two pytest-xdist
workers at once, never share a rendezvous port."""

import os
import socket
import subprocess
import sys
from pathlib import Path

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
