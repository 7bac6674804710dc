"""Weights named by a hub id that cannot load: one line with the id, the reason and the fix (flowrl/hub.py).

Offline cases run in this process (HF_HUB_OFFLINE=1, an empty cache). The gated (401/403), missing (404) and
unreachable cases run `flowrl` in a subprocess against a local HTTP server that answers like the Hugging Face Hub
(HF_ENDPOINT pointed at it, HF_HUB_OFFLINE=0 in that subprocess only), so nothing leaves the machine.
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PIL import Image
from test_cli_errors import one_line_error  # exit code 2 and one `flowrl <cmd>: error:` line

from flowrl.hub import HubUnavailableError, hub_errors
from flowrl.registry import REWARDS

# repo id -> (HTTP status, X-Error-Code, X-Error-Message), as the hub answers an anonymous client
ANSWERS = {
    "org/gated-anonymous": (401, "GatedRepo", "Access to model org/gated-anonymous is restricted. Please log in."),
    "org/gated-unaccepted": (
        403,
        "GatedRepo",
        "Access to model org/gated-unaccepted is restricted; you are not in the authorized list.",
    ),
    "org/missing": (404, "RepoNotFound", "Repository not found"),
}


class FakeHub(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        repo = next((r for r in ANSWERS if f"/{r}/" in self.path + "/"), "org/missing")
        status, code, message = ANSWERS[repo]
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        for key, value in (("X-Error-Code", code), ("X-Error-Message", message), ("Content-Type", "application/json")):
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def fake_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_flowrl(args: list[str], endpoint: str, tmp_path: Path) -> tuple[int, list[str]]:
    """`flowrl ARGS` online against `endpoint` with an empty cache and no token: (exit code, stderr lines)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_ENDPOINT=endpoint, HF_HUB_OFFLINE="0", HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_TELEMETRY="1")
    env.update(
        OMP_NUM_THREADS="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
    )
    proc = subprocess.run(
        [sys.executable, "-m", "flowrl.cli", *args], env=env, capture_output=True, text=True, timeout=300
    )
    return proc.returncode, [line for line in proc.stderr.splitlines() if line.strip()]


def sample_args(model: str, tmp_path: Path) -> list[str]:
    return [
        "sample",
        "--model",
        model,
        "--prompt",
        "a cat",
        "--num-steps",
        "1",
        "--device",
        "cpu",
        "--out",
        str(tmp_path / "out"),
    ]


# ---- offline: not in the cache ----------------------------------------------------------------------------------


def test_sample_of_an_uncached_model_offline_is_one_line(tmp_path, capsys):
    err = one_line_error(sample_args("flowrl-test/not-cached", tmp_path), capsys)
    assert "model 'flowrl-test/not-cached' is not in the local Hugging Face cache" in err
    assert "HF_HUB_OFFLINE=1" in err and "`hf download flowrl-test/not-cached`" in err and "unset HF_HUB_OFFLINE" in err


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty_cache"))
    monkeypatch.setenv("HOME", str(tmp_path))  # imagereward also looks in ~/.cache/ImageReward


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        (
            "pickscore",
            {"model_name": "flowrl-test/none", "processor_name": "flowrl-test/none"},
            "pickscore: processor 'flowrl-test/none'",
        ),
        ("hpsv2", {}, "hpsv2: checkpoint HPS_v2.1_compressed.pt of 'xswu/HPSv2'"),
        (
            "clipscore",
            {"model_name": "ViT-B-32", "pretrained": "openai"},
            "open_clip weights ViT-B-32/openai: open_clip_model",
        ),
        ("imagereward", {}, "imagereward: checkpoint ImageReward.pt of 'THUDM/ImageReward'"),
        ("artifact", {"backend": "vlm", "model_name": "flowrl-test/none"}, "artifact: VLM 'flowrl-test/none'"),
    ],
)
def test_reward_weights_not_cached_offline_name_the_download(empty_cache, name, kwargs, expected):
    with pytest.raises(HubUnavailableError) as info:
        REWARDS.build(name, **kwargs)
    message = str(info.value)
    assert info.value.reason == "offline" and "\n" not in message
    assert message.startswith(expected) and "`hf download " in message and "unset HF_HUB_OFFLINE" in message
    assert "huggingface-cli" not in message  # removed from huggingface_hub 1.0


def test_imagereward_tokenizer_not_cached_offline_is_refused_not_left_empty(empty_cache, tmp_path):
    from flowrl.rewards._tiny import make_imagereward_files

    files = make_imagereward_files(tmp_path / "ir")
    files.pop("tokenizer")  # the default, bert-base-uncased: transformers 5 would build a 7-token tokenizer offline
    with pytest.raises(
        HubUnavailableError, match="^imagereward: tokenizer vocab.txt of 'bert-base-uncased' is not in the local"
    ):
        REWARDS.build("imagereward", **files)


def test_hub_errors_passes_other_errors_and_keeps_the_cache_fallback_warning_of_a_load_that_succeeds(caplog):
    with pytest.raises(KeyError), hub_errors("org/x"):
        raise KeyError("not a hub failure")
    logger = logging.getLogger("diffusers.pipelines.pipeline_utils")
    with caplog.at_level(logging.WARNING, logger="diffusers"):
        with hub_errors("org/x"):  # loaded from the cache after the hub failed: the warning is shown
            logger.warning("Couldn't connect to the Hub: boom.\nWill try to load from local cache.")
        assert [r.getMessage().split(":")[0] for r in caplog.records] == ["Couldn't connect to the Hub"]
        caplog.clear()
        with pytest.raises(HubUnavailableError), hub_errors("org/x"):  # failed: the one-line error says it all
            logger.warning("Couldn't connect to the Hub: boom.\nWill try to load from local cache.")
            raise ConnectionRefusedError(111, "Connection refused")
        assert caplog.records == []


# ---- online: gated, missing, unreachable (a subprocess against a local fake hub) ---------------------------------


@pytest.mark.parametrize(
    "model, expected",
    [
        (
            "org/gated-anonymous",
            ["is a gated repository and this machine is not logged in", "(HTTP 401)", "`hf auth login`"],
        ),
        (
            "org/gated-unaccepted",
            ["is a gated repository whose license", "(HTTP 403)", "accept it on {endpoint}/org/gated-unaccepted"],
        ),
        ("org/missing", ["does not exist on the Hugging Face Hub", "(HTTP 404)", "check the id"]),
        (
            "org/unreachable",
            ["cannot be reached (ConnectionRefusedError", "check the network", "`hf download org/unreachable`"],
        ),
    ],
)
def test_sample_of_a_model_the_hub_refuses_is_one_line(fake_hub, tmp_path, model, expected):
    endpoint = f"http://127.0.0.1:{closed_port()}" if model == "org/unreachable" else fake_hub
    code, lines = run_flowrl(sample_args(model, tmp_path), endpoint, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"flowrl sample: error: model '{model}' "), lines[0]
    for part in expected:
        assert part.format(endpoint=endpoint) in lines[0], lines[0]


def test_score_with_a_gated_reward_model_is_one_line(fake_hub, tmp_path):
    image = tmp_path / "a.png"
    Image.new("RGB", (32, 32), "red").save(image)
    args = ["score", "--reward", "pickscore", "--set", "model_name=org/gated-anonymous"]
    args += ["--set", "processor_name=org/gated-anonymous", "--prompt", "a cat", "--device", "cpu", str(image)]
    code, lines = run_flowrl(args, fake_hub, tmp_path)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(
        "flowrl score: error: pickscore: processor 'org/gated-anonymous' is a gated repository"
    ), lines[0]
    assert f"accept its license on {fake_hub}/org/gated-anonymous, then run `hf auth login`" in lines[0]
