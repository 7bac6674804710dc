"""remote: a real `flowrl serve-reward` subprocess on localhost, an in-thread server whose reward records what it
received (the wire format: safetensors uint8, zlib, the PNG fallback), malformed bodies, and small misbehaving
servers for the failure paths (down, slow, malformed, 503 then OK, wrong token, server errors)."""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors.torch import save as save_safetensors
from tiny_checkpoints import tiny_open_clip

from flowrl.media import to_uint8
from flowrl.registry import REWARDS
from flowrl.rewards.remote import RemoteRewardError, encode_batch
from flowrl.serving.server import make_server
from flowrl.types import RewardOutput

PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def _images(n=3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 32, 32), generator=generator).float() / 255  # k/255: exact through PNG


@pytest.fixture(scope="module")
def served_clipscore(tmp_path_factory):
    folder, _ = tiny_open_clip(tmp_path_factory.mktemp("remote") / "clip")
    command = [
        sys.executable,
        "-m",
        "flowrl.cli",
        "serve-reward",
        "clipscore",
        "--engine",
        "local",
        "--set",
        f"model_name={folder}",
        "--set",
        "pretrained=null",
        "--port",
        "0",
        "--token",
        "s3cret",
    ]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1")
    )
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
    server = make_server(REWARDS.build("jpeg_compressibility"), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        remote = REWARDS.build("remote", url=f"http://127.0.0.1:{server.server_address[1]}", max_retries=0)
        videos = torch.rand(2, 3, 3, 16, 16)  # an image reward served, videos sent
        with pytest.raises(
            ValueError, match=r"server rejected the batch \(HTTP 400\): jpeg_compressibility: images shape"
        ):
            remote(videos, PROMPTS[:2], [{}] * 2)
    finally:
        server.shutdown()
        server.server_close()


class _Recorder:
    """A real reward that keeps what it was given and scores each sample by its mean pixel value."""

    modalities = ("image", "video")
    differentiable = False

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, metadata):
        self.calls.append((images.clone(), list(prompts), list(metadata)))
        return RewardOutput(scores=images.flatten(1).mean(1), parts={"max": images.flatten(1).amax(1)})


@pytest.fixture()
def recorder_url():
    recorder = _Recorder()
    server = make_server(recorder, port=0, token="t0k")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield recorder, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("shape", [(3, 3, 17, 32), (2, 4, 3, 8, 16)], ids=["images", "videos"])
def test_wire_formats_deliver_the_same_uint8_values(recorder_url, shape):
    recorder, url = recorder_url
    images = torch.rand(shape, generator=torch.Generator().manual_seed(1))  # arbitrary floats, not k/255
    images[0, ..., 0, 0] = torch.tensor([0.0, 1.0, 0.5 / 255])  # the ends and a rounding tie
    prompts, metadata = (
        ["ünïcode «prompt»", "two", "three"][: shape[0]],
        [{"tag": [1, None]}, {}, {"k": "v"}][: shape[0]],
    )
    want = to_uint8(images).float() / 255  # round(x * 255) / 255: what the PNG transport always delivered
    for kwargs in ({}, {"compression": "zlib"}, {"encoding": "png"}):
        out = REWARDS.build("remote", url=url, token="t0k", max_retries=0, **kwargs)(images, prompts, metadata)
        got, got_prompts, got_metadata = recorder.calls[-1]
        assert got.dtype == torch.float32 and torch.equal(got, want), kwargs
        assert (got_prompts, got_metadata) == (prompts, metadata)
        torch.testing.assert_close(out.scores, want.flatten(1).mean(1), atol=1e-6, rtol=0)
        assert torch.equal(out.parts["max"], want.flatten(1).amax(1))
    assert len(recorder.calls) == 3


def test_safetensors_payload_is_uint8_and_zlib_is_deflate():
    images = torch.full((2, 3, 64, 64), 0.25)  # flat images: compressible
    body, headers = encode_batch(images, ["a", "b"], [{}, {}])
    packed, packed_headers = encode_batch(images, ["a", "b"], [{}, {}], compression="zlib")
    assert headers == {"Content-Type": "application/x-safetensors"}
    assert packed_headers == {"Content-Type": "application/x-safetensors", "Content-Encoding": "deflate"}

    def parts(payload):  # (header, tensor bytes); the header's key order is not fixed by safetensors
        size = int.from_bytes(payload[:8], "little")
        return json.loads(payload[8 : 8 + size]), payload[8 + size :]

    assert parts(zlib.decompress(packed)) == parts(body) and len(packed) < len(body) // 20
    assert len(body) == 2 * 3 * 64 * 64 + 8 + int.from_bytes(body[:8], "little")  # one uint8 byte per value
    header = json.loads(body[8 : 8 + int.from_bytes(body[:8], "little")])
    assert header["images"]["dtype"] == "U8" and header["images"]["shape"] == [2, 3, 64, 64]
    assert json.loads(header["__metadata__"]["prompts"]) == ["a", "b"]
    with pytest.raises(ValueError, match="compression=zlib needs encoding=safetensors"):
        REWARDS.build("remote", url="http://127.0.0.1:1", encoding="png", compression="zlib")
    with pytest.raises(ValueError, match="encoding='jpeg'"):
        REWARDS.build("remote", url="http://127.0.0.1:1", encoding="jpeg")


def _safetensors(tensors, **metadata):
    return save_safetensors(tensors, metadata={k: json.dumps(v) for k, v in metadata.items()})


PIXELS = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
MALFORMED = {
    "garbage": ({}, b"not a safetensors file", "is not a safetensors file"),
    "truncated": ({}, _safetensors({"images": PIXELS}, prompts=["a"])[:-5], "not a valid safetensors file"),
    "float pixels": ({}, _safetensors({"images": PIXELS.float()}, prompts=["a"]), "send uint8 of 4 dims"),
    "no prompts": ({}, _safetensors({"images": PIXELS}), "needs 'prompts'"),
    "two tensors": ({}, _safetensors({"images": PIXELS, "videos": PIXELS[None].clone()}, prompts=["a"]), "exactly one"),
    "prompt not text": (
        {},
        _safetensors({"images": PIXELS}, prompts=[3]),
        "'prompts' must be a non-empty list of strings",
    ),
    "bad deflate": ({"Content-Encoding": "deflate"}, b"\x00\x01 not zlib", "not a deflate"),
    "gzip": ({"Content-Encoding": "gzip"}, _safetensors({"images": PIXELS}, prompts=["a"]), "'gzip' is not supported"),
    "text/plain": ({"Content-Type": "text/plain"}, b"hello", "'text/plain' is not supported"),
    "wrong count": (
        {},
        _safetensors({"images": PIXELS}, prompts=["a", "b"]),
        "2 prompts and 2 metadata entries for 1 samples",
    ),
    "json without pixels": (
        {"Content-Type": "application/json"},
        b'{"prompts": ["a"]}',
        "neither 'images' nor 'videos'",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_body_is_a_400_with_a_message(recorder_url, case):
    recorder, url = recorder_url
    extra, body, message = MALFORMED[case]
    headers = {"Content-Type": "application/x-safetensors", "Authorization": "Bearer t0k", **extra}
    connection = http.client.HTTPConnection(*url[len("http://") :].split(":"), timeout=10)
    try:
        connection.request("POST", "/score", body=body, headers=headers)
        response = connection.getresponse()
        status, answer = response.status, json.loads(response.read())
    finally:
        connection.close()
    assert status == 400 and message in answer["error"] and "\n" not in answer["error"], answer
    assert recorder.calls == []


@pytest.mark.parametrize(("status", "error"), [(400, ValueError), (500, RemoteRewardError), (404, RemoteRewardError)])
def test_server_errors_surface_in_one_line(status, error):
    server = _Scripted([(0, status, json.dumps({"error": "first line\n  second line\tend"}).encode())])
    try:
        remote = REWARDS.build("remote", url=server.url, max_retries=3, backoff_s=0.01)
        with pytest.raises(error) as caught:
            remote(_images(1), PROMPTS[:1], [{}])
        text = str(caught.value)
        assert (
            "\n" not in text
            and server.url in text
            and f"HTTP {status}" in text
            and "first line second line end" in text
        )
        assert server.calls == 1  # not retried
    finally:
        server.close()


class _Slow(_Recorder):
    def __call__(self, images, prompts, metadata):
        time.sleep(1.5)
        return super().__call__(images, prompts, metadata)


def test_a_retry_after_a_timeout_is_answered_from_the_first_computation():
    slow = _Slow()
    server = make_server(slow, port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        remote = REWARDS.build("remote", url=url, timeout_s=0.4, max_retries=8, backoff_s=0.1)
        images = _images(2)
        out = remote(images, PROMPTS[:2], [{}, {}])  # the first attempts time out while the server scores
        assert len(slow.calls) == 1  # scored once, whatever the retries
        torch.testing.assert_close(out.scores, images.flatten(1).mean(1), atol=1e-6, rtol=0)
        assert server.stats["computed"] == 1 and server.stats["deduplicated"] >= 1
        remote(images, PROMPTS[:2], [{}, {}])  # a new batch: a new request id, scored again
        assert len(slow.calls) == 2
    finally:
        server.shutdown()
        server.server_close()


def test_a_deflate_body_is_inflated_up_to_the_limit_only():
    from flowrl.serving.server import LocalBackend

    recorder = _Recorder()
    server = make_server(
        LocalBackend({"recorder": recorder}, max_decoded_bytes=64 * 1024), port=0, max_body_bytes=10**6
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        small = REWARDS.build("remote", url=url, compression="zlib", max_retries=0)
        small(_images(1), PROMPTS[:1], [{}])  # 3 KB inflated: under the limit
        bomb = torch.zeros(8, 3, 64, 64)  # 98 KB of zeros, deflated to ~100 bytes
        with pytest.raises(
            ValueError, match=r"HTTP 413\): reward recorder: the deflate body inflates past 65536 bytes"
        ):
            small(bomb, ["a"] * 8, [{}] * 8)
        assert len(recorder.calls) == 1
    finally:
        server.shutdown()
        server.server_close()


def test_a_public_host_needs_a_token():
    with pytest.raises(ValueError, match="pass a token"):
        make_server(_Recorder(), host="0.0.0.0", port=0)
