"""The serve-reward front never hangs: real sockets on 127.0.0.1 against a real server (make_server in a thread,
LocalBackend scoring jpeg_compressibility). Idle and half-sent connections are closed or answered 408 within the
request timeout and give their threads back while a normal client is served; a header trickled a byte at a time
still ends; past the connection limit a client gets 503 without a new thread; a non-ASCII Content-Length is a 400;
a body cut short is never scored; a retried request id waits for its first computation at most the timeout (503)."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

from flowrl.registry import REWARDS
from flowrl.rewards.remote import encode_batch
from flowrl.serving.server import LocalBackend, make_server
from flowrl.types import RewardOutput

TIMEOUT = 0.5  # the servers' request timeout here, in seconds
PROMPTS = ["a red circle", "two blue squares", "a green triangle"]


def _images(n: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (n, 3, 32, 32), generator=generator).float() / 255  # k/255: exact on the wire


@contextmanager
def _serving(target=None, **limits):
    server = make_server(
        target or REWARDS.build("jpeg_compressibility"), port=0, **{"request_timeout": TIMEOUT, **limits}
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _connect(server) -> socket.socket:
    return socket.create_connection(server.server_address[:2], timeout=30)  # 30 s: a safety net, not a timing


def _head(path: str = "/score", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def _answer(sock: socket.socket) -> tuple[int, dict, bytes]:
    """(status, JSON payload, raw head) of the one answer on `sock`, read until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(payload), head


def _poll(predicate, what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {limit_s:g}s")
        time.sleep(0.02)


def _batch_post(images: torch.Tensor, prompts: list[str], request_id: str | None = None) -> tuple[bytes, bytes]:
    body, headers = encode_batch(images, prompts, [{} for _ in prompts])
    if request_id:
        headers["X-Request-Id"] = request_id
    return _head(**{k.replace("-", "_"): v for k, v in headers.items()}, Content_Length=str(len(body))), body


def test_idle_and_half_sent_connections_give_their_threads_back_while_a_client_is_served():
    local = REWARDS.build("jpeg_compressibility")
    with _serving(local, max_connections=100, request_timeout=1.0) as server:
        baseline = threading.active_count()
        idle = [_connect(server) for _ in range(50)]  # never send a header
        partial = [_connect(server) for _ in range(10)]
        for sock in partial:  # Content-Length 1000, 10 bytes sent
            sock.sendall(_head(Content_Type="application/x-safetensors", Content_Length="1000") + b"0123456789")
        _poll(lambda: threading.active_count() >= baseline + 60, "a handler thread for each of the 60 connections")

        remote = REWARDS.build("remote", url=f"http://127.0.0.1:{server.server_address[1]}", max_retries=0)
        images = _images()
        got = remote(images, PROMPTS, [{}] * 3)  # served while the 60 connections hold their threads
        torch.testing.assert_close(got.scores, local(images, PROMPTS, [{}] * 3).scores, atol=1e-6, rtol=0)

        _poll(lambda: threading.active_count() <= baseline, "every handler thread back")
        for sock in idle:  # closed unanswered
            assert sock.recv(1024) == b""
            sock.close()
        for sock in partial:
            status, payload, head = _answer(sock)
            assert status == 408 and b"Connection: close" in head, payload
            assert "did not arrive within 1s" in payload["error"] and "\n" not in payload["error"]
            sock.close()
        assert server.stats["timed_out"] == 10 and server.stats["computed"] == 1


def test_a_header_trickled_a_byte_at_a_time_still_ends():
    """Each byte comes well within the timeout; the header as a whole does not, and the server closes the connection."""
    with _serving() as server, _connect(server) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nX-Pad: ")
        sock.settimeout(TIMEOUT / 10)
        closed = False
        deadline = time.monotonic() + 20
        while not closed and time.monotonic() < deadline:
            try:
                sock.sendall(b"a")
                closed = sock.recv(1024) == b""
            except TimeoutError:
                continue  # nothing from the server yet: the next byte
            except OSError:  # the server's close reset the connection
                closed = True
        assert closed


def test_a_body_trickled_past_the_timeout_is_a_408():
    with _serving() as server, _connect(server) as sock:
        sock.sendall(_head(Content_Length="1000"))
        sock.settimeout(TIMEOUT / 10)
        answered, deadline = b"", time.monotonic() + 20
        while not answered and time.monotonic() < deadline:
            try:
                sock.sendall(b"a")
            except OSError:  # the server answered and closed: its answer is still there to read
                pass
            try:
                answered = sock.recv(65536)
            except TimeoutError:
                continue
        assert answered.startswith(b"HTTP/1.1 408 ")
        assert server.stats["timed_out"] == 1 and server.stats["computed"] == 0


def test_past_the_connection_limit_a_client_gets_503_without_a_thread():
    with _serving(max_connections=2, request_timeout=30) as server:
        baseline = threading.active_count()
        held = [_connect(server), _connect(server)]
        _poll(lambda: threading.active_count() == baseline + 2, "a thread for each held connection")
        with _connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, payload, head = _answer(sock)
        assert status == 503 and b"Connection: close" in head
        assert "serving 2 connections, its limit (--max-connections)" in payload["error"]
        # a client that sends its request and a body after the refusal, then reads: still answered (closing the
        # refused socket before its bytes arrived would reset the connection and lose the answer)
        client = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
        client.connect()
        _poll(lambda: server.stats["refused"] == 2, "the second refusal")
        client.request("POST", "/score", body=b"x" * 100_000, headers={"Content-Type": "application/x-safetensors"})
        response = client.getresponse()
        assert response.status == 503 and "retry later" in json.loads(response.read())["error"]
        client.close()
        assert threading.active_count() == baseline + 2 and server.stats["refused"] == 2

        for sock in held:  # their threads end, and the server serves again
            sock.close()
        _poll(lambda: threading.active_count() == baseline, "the held connections' threads back")
        with _connect(server) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert _answer(sock)[0] == 200


@pytest.mark.parametrize("length", ["²", "1²", "-5", "1e3", "0x10", "+10"])
def test_a_content_length_that_is_not_ascii_digits_is_a_400_naming_it(length):
    with _serving() as server, _connect(server) as sock:
        sock.sendall(_head(Content_Length=length) + b"0123456789")
        status, payload, head = _answer(sock)
        assert status == 400 and b"Connection: close" in head
        assert f"header Content-Length {length!r} is not a byte count; send ASCII digits" in payload["error"]
        assert server.stats["computed"] == 0


def test_a_body_cut_short_by_the_client_is_never_scored():
    with _serving() as server, _connect(server) as sock:
        head, body = _batch_post(_images(2), PROMPTS[:2])
        sock.sendall(head + body[:-5])  # declares the whole body, sends all but 5 bytes, then closes its side
        sock.shutdown(socket.SHUT_WR)
        status, payload, _ = _answer(sock)
        assert status == 400, payload
        assert f"the body ended after {len(body) - 5} of its {len(body)} bytes" in payload["error"]
        assert server.stats["truncated"] == 1 and server.stats["computed"] == 0


class _Gated:
    """A real reward (the mean pixel) that scores only once `gate` is set."""

    modalities = ("image",)
    differentiable = False

    def __init__(self):
        self.gate, self.calls = threading.Event(), 0

    def __call__(self, images, prompts, metadata):
        self.calls += 1
        assert self.gate.wait(60), "the test never opened the gate"
        return RewardOutput(scores=images.flatten(1).mean(1), parts={})


def test_a_retried_request_id_waits_at_most_the_timeout_then_gets_the_first_answer():
    gated = _Gated()
    with _serving(LocalBackend({"gated": gated})) as server:
        images = _images(2)
        head, body = _batch_post(images, PROMPTS[:2], request_id="batch-7")
        first: list = []
        with _connect(server) as owner:
            owner.sendall(head + body)
            reader = threading.Thread(target=lambda: first.append(_answer(owner)))
            reader.start()
            _poll(lambda: server.stats["in_flight"] == 1, "the first computation running")
            with _connect(server) as retry:  # the same id and body while the first still runs
                retry.sendall(head + body)
                status, payload, _ = _answer(retry)
            assert status == 503, payload
            want = (
                f"reward gated: request id 'batch-7' is still being scored after {TIMEOUT:g}s; retry with the same id"
            )
            assert payload["error"] == want
            gated.gate.set()
            reader.join(30)
        status, payload, _ = first[0]
        assert status == 200 and payload["scores"] == pytest.approx(images.flatten(1).mean(1).tolist(), abs=1e-6)
        with _connect(server) as again:  # after it finished: its answer, not a second computation
            again.sendall(head + body)
            assert _answer(again)[:2] == (200, payload)
        assert gated.calls == 1 and server.stats["computed"] == 1 and server.stats["deduplicated"] == 1


@pytest.mark.parametrize(
    ("flag", "value", "error"),
    [("--request-timeout", "0", "use a number of seconds > 0"), ("--max-connections", "0", "use 1 or more")],
)
def test_serve_reward_refuses_unusable_limits_before_building_anything(capsys, flag, value, error):
    from flowrl.cli import main

    assert main(["serve-reward", "jpeg_compressibility", "--engine", "local", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}" in err and error in err, err


def test_serve_reward_flags_set_the_limits():
    command = ["serve-reward", "jpeg_compressibility", "--engine", "local", "--port", "0", "--max-connections", "1"]
    process = subprocess.Popen(
        [sys.executable, "-m", "flowrl.cli", *command, "--request-timeout", "3"], stdout=subprocess.PIPE, text=True
    )
    try:
        line = process.stdout.readline()
        assert " on http://" in line, line
        port = int(line.strip().rsplit(":", 1)[-1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as held:  # accepted first: the one slot
            with socket.create_connection(("127.0.0.1", port), timeout=30) as refused:
                refused.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert _answer(refused)[0] == 503
            held.settimeout(20)
            assert held.recv(1024) == b""  # closed after its idle 3 s (the default would wait 30 s)
    finally:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.parametrize(
    ("request_line", "status", "error"),
    [
        (b"PUT /score HTTP/1.1", 501, "Unsupported method ('PUT')"),
        (b"GET /a b HTTP/1.1", 400, "Bad request syntax ('GET /a b HTTP/1.1')"),
    ],
)
def test_http_servers_own_errors_are_json_lines_too(request_line, status, error):
    with _serving() as server, _connect(server) as sock:
        sock.sendall(request_line + b"\r\nHost: 127.0.0.1\r\n\r\n")
        got, payload, head = _answer(sock)
        assert (got, payload) == (status, {"error": error}) and b"application/json" in head
