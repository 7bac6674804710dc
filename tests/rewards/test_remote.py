"""remote: a real `flowrl serve-reward` subprocess on localhost, and small misbehaving servers for the
failure paths (down, slow, malformed, 503 then OK, wrong token)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from tiny_checkpoints import tiny_open_clip

from flowrl.registry import REWARDS
from flowrl.rewards.remote import RemoteRewardError

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def _images(n=3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 32, 32), generator=generator).float() / 255  # k/255: exact through PNG


@pytest.fixture(scope="module")
def served_clipscore(tmp_path_factory):
    folder, _ = tiny_open_clip(tmp_path_factory.mktemp("remote") / "clip")
    command = [sys.executable, "-m", "flowrl.cli", "serve-reward", "clipscore", "--set", f"model_name={folder}",
               "--set", "pretrained=null", "--port", "0", "--token", "s3cret"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, HF_HUB_OFFLINE="1"))
    line = process.stdout.readline()
    if "serving" not in line:
        process.kill()
        pytest.fail(f"serve-reward did not start: {line!r} {process.stderr.read()[-500:]}")
    url = line.strip().rsplit(" ", 1)[-1]
    yield process, url, folder
    if process.poll() is None:
        process.terminate()
        process.wait(timeout=10)


def test_served_scores_equal_in_process(served_clipscore):
    _, url, folder = served_clipscore
    remote = REWARDS.build("remote", url=url, token="s3cret", timeout_s=30)
    assert remote.health()["reward"] == "clipscore"
    local = REWARDS.build("clipscore", model_name=folder, pretrained=None)
    images = _images()
    got = remote(images, PROMPTS, [{}] * 3)
    want = local(images, PROMPTS, [{}] * 3)
    torch.testing.assert_close(got.scores, want.scores, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.parts["cosine"], want.parts["cosine"], atol=1e-6, rtol=0)


def test_wrong_token_fails_at_once(served_clipscore):
    _, url, _ = served_clipscore
    remote = REWARDS.build("remote", url=url, token="wrong", max_retries=3, backoff_s=5.0)
    start = time.monotonic()
    with pytest.raises(RemoteRewardError, match="unauthorized"):
        remote(_images(), PROMPTS, [{}] * 3)
    assert time.monotonic() - start < 4.0  # no retry on 401


def test_server_down_retries_then_clear_error(served_clipscore):
    process, url, _ = served_clipscore
    process.terminate()
    process.wait(timeout=10)
    remote = REWARDS.build("remote", url=url, token="s3cret", max_retries=2, backoff_s=0.01, timeout_s=2)
    with pytest.raises(RemoteRewardError, match="gave up after 3 attempts.*serve-reward"):
        remote(_images(1), PROMPTS[:1], [{}])


class _Scripted:
    """A localhost server answering /score from a script: each entry is (delay_s, status, body bytes)."""

    def __init__(self, script):
        self.script, self.calls = list(script), 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                delay, status, body = owner.script[min(owner.calls, len(owner.script) - 1)]
                owner.calls += 1
                time.sleep(delay)
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _ok(n):
    return json.dumps({"scores": [0.5] * n, "parts": {}}).encode()


def test_slow_server_times_out_after_retries():
    server = _Scripted([(1.0, 200, _ok(1))])
    try:
        remote = REWARDS.build("remote", url=server.url, timeout_s=0.2, max_retries=1, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match="gave up after 2 attempts; last error: timed out after 0.2s"):
            remote(_images(1), PROMPTS[:1], [{}])
        assert server.calls == 2
    finally:
        server.close()


def test_unavailable_then_ok_is_retried():
    server = _Scripted([(0, 503, b'{"error": "busy"}'), (0, 503, b"{}"), (0, 200, _ok(2))])
    try:
        remote = REWARDS.build("remote", url=server.url, max_retries=2, backoff_s=0.01)
        assert remote(_images(2), PROMPTS[:2], [{}] * 2).scores.tolist() == [0.5, 0.5]
        assert server.calls == 3
    finally:
        server.close()


@pytest.mark.parametrize("body", [b"<html>oops</html>", b'{"scores": [1.0]}', b'{"scores": ["a", "b"]}', b"[1, 2]"])
def test_malformed_response_is_reported(body):
    server = _Scripted([(0, 200, body)])
    try:
        remote = REWARDS.build("remote", url=server.url, max_retries=3, backoff_s=0.01)
        with pytest.raises(RemoteRewardError, match="malformed response"):
            remote(_images(2), PROMPTS[:2], [{}] * 2)
        assert server.calls == 1  # not retried
    finally:
        server.close()


def test_null_scores_are_nan_and_bad_url_rejected():
    server = _Scripted([(0, 200, b'{"scores": [null, 2.0]}')])
    try:
        scores = REWARDS.build("remote", url=server.url)(_images(2), PROMPTS[:2], [{}] * 2).scores
        assert torch.isnan(scores[0]) and scores[1] == 2.0
    finally:
        server.close()
    with pytest.raises(ValueError, match="url='localhost:1' is not an http"):
        REWARDS.build("remote", url="localhost:1")


def test_server_rejects_bad_batch_as_value_error():
    from flowrl.rewards.reward_server import make_server

    server = make_server(REWARDS.build("jpeg_compressibility"), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = REWARDS.build("remote", url=f"http://127.0.0.1:{server.server_address[1]}", max_retries=0)
        videos = torch.rand(2, 3, 3, 16, 16)  # an image reward served, videos sent
        with pytest.raises(ValueError, match="server rejected the batch: jpeg_compressibility: images shape"):
            remote(videos, PROMPTS[:2], [{}] * 2)
    finally:
        server.shutdown()
        server.server_close()
