"""serve-reward on Ray Serve: a real `flowrl serve-reward` process with a real local Ray (two CPU replicas of the
Shapes judge `toy_attributes` beside `jpeg_compressibility`), real HTTP clients. Concurrent clients get exactly the
in-process scores, batched across requests; a replica killed mid-batch through Ray's API costs no request; wrong
tokens, oversized and malformed bodies, unknown rewards each get one line while the service keeps serving; a retry
with the same request id is answered from the first computation; SIGTERM stops Ray and leaves no process behind."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("ray.serve", reason="the `serve` extra (pip install 'flowrl[serve]') is not installed")
psutil = pytest.importorskip("psutil")

from flowrl.registry import REWARDS  # noqa: E402
from flowrl.rewards.remote import encode_batch  # noqa: E402
from flowrl.toy.world import render_batch, split_prompts  # noqa: E402

TOKEN = "s3rve-t0ken"
PROMPTS = split_prompts("train")


def _batch(client: int, n: int = 3) -> tuple[torch.Tensor, list[str]]:
    prompts = [PROMPTS[(7 * client + i) % len(PROMPTS)] for i in range(n)]
    from flowrl.toy.world import parse_prompt

    images = render_batch([parse_prompt(p) for p in prompts], [100 * client + i for i in range(n)])
    return (images * 255).round() / 255, prompts  # k/255: the wire's uint8 values exactly


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    command = [
        sys.executable,
        "-m",
        "flowrl.cli",
        "serve-reward",
        "toy_attributes",
        "--reward",
        "jpeg_compressibility",
        "--replicas",
        "2",
        "--cpus-per-replica",
        "0.5",  # fractional: both replicas of both rewards share the 2-core machine
        "--max-batch-size",
        "12",
        "--batch-wait-ms",
        "150",
        "--max-body-mb",
        "1",
        "--port",
        "0",
        "--token",
        TOKEN,
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_DEDUP_LOGS="0")
    stderr = tmp_path_factory.mktemp("serve") / "stderr.txt"
    with open(stderr, "w") as err:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    line = process.stdout.readline()
    if " on http://" not in line:
        process.kill()
        pytest.fail(f"serve-reward did not start: {line!r} {stderr.read_text()[-1500:]}")
    url, address = line.strip().rsplit(" ", 1)[-1], process.stdout.readline().strip().rsplit(" ", 1)[-1]
    yield {"url": url, "ray": address, "process": process, "stderr": stderr}
    if process.poll() is None:  # a test failed before the SIGTERM test: stop it the same way, then make sure
        family = psutil.Process(process.pid).children(recursive=True)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        for child in family:
            if child.is_running():
                child.kill()


def _remote(service, reward="toy_attributes", **kwargs):
    settings = {
        "url": service["url"],
        "token": TOKEN,
        "reward": reward,
        "timeout_s": 120,
        "max_retries": 4,
        "backoff_s": 0.5,
    }
    return REWARDS.build("remote", **{**settings, **kwargs})


def _raw(service, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict, bytes]:
    """One request on a raw socket: the body is sent only if given (a server that reads it first would hang)."""
    host, port = service["url"][len("http://") :].split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    head, payload = data.split(b"\r\n\r\n", 1)
    return status, json.loads(payload), head


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def _health(service) -> dict:
    status, payload, _ = _raw(service, "GET", "/health", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    return payload


def test_concurrent_clients_get_the_in_process_scores(service):
    local = {name: REWARDS.build(name) for name in ("toy_attributes", "jpeg_compressibility")}
    batches = [_batch(client) for client in range(6)]
    results: dict[tuple[int, str], object] = {}

    def client(i: int, name: str) -> None:
        images, prompts = batches[i]
        results[i, name] = _remote(service, name)(images, prompts, [{} for _ in prompts])

    threads = [threading.Thread(target=client, args=(i, n)) for i in range(6) for n in local]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for (i, name), out in results.items():
        images, prompts = batches[i]
        want = local[name](images, prompts, [{} for _ in prompts])
        assert torch.equal(out.scores, want.scores.float()), (i, name, out.scores, want.scores)
        for key, part in want.parts.items():
            assert torch.equal(out.parts[key], part.float()), (i, name, key)
    assert len(results) == 12
    health = _health(service)
    assert set(health["rewards"]) == {"toy_attributes", "jpeg_compressibility"}
    assert health["rewards"]["toy_attributes"]["modalities"] == ["image"]


def test_requests_are_batched_across_clients(service):
    images, prompts = _batch(0, 2)
    body, headers = encode_batch(images, prompts, [{}, {}])
    headers = {**headers, "Authorization": f"Bearer {TOKEN}", "Content-Length": str(len(body))}
    answers = []

    def send() -> None:
        answers.append(_raw(service, "POST", "/score/toy_attributes", headers, body))

    threads = [threading.Thread(target=send) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [a[0] for a in answers] == [200] * 6
    assert max(a[1]["batch_images"] for a in answers) > 2  # one forward held samples of several requests


def test_bad_requests_get_one_line_and_the_service_keeps_serving(service):
    images, prompts = _batch(1)
    body, content = encode_batch(images, prompts, [{} for _ in prompts])
    auth = {"Authorization": f"Bearer {TOKEN}"}
    # a wrong token and an oversized body are answered before the body is read: none is sent here, the answer comes
    cases = {
        "wrong token": (
            "/score/toy_attributes",
            {"Authorization": "Bearer nope", "Content-Length": "99999999"},
            b"",
            401,
            "token",
        ),
        "oversized": ("/score/toy_attributes", {**auth, "Content-Length": str(2 * 2**20)}, b"", 413, "over the limit"),
        "unknown reward": (
            "/score/pickscorez",
            {**auth, "Content-Length": "5"},
            b"",
            404,
            "unknown reward 'pickscorez'",
        ),
        "which reward": ("/score", {**auth, "Content-Length": "5"}, b"", 404, "several rewards are served"),
        "malformed": (
            "/score/toy_attributes",
            {**auth, **content, "Content-Length": "9"},
            b"not a st!",
            400,
            "reward toy_attributes: bad request",
        ),
        "no length": ("/score/toy_attributes", auth, b"", 411, "Content-Length"),
    }
    for case, (path, headers, payload, want_status, message) in cases.items():
        status, answer, head = _raw(service, "POST", path, headers, payload)
        assert status == want_status and message in answer["error"] and "\n" not in answer["error"], (case, answer)
        if want_status in (401, 404, 411, 413):
            assert b"connection: close" in head.lower(), case
    bad_prompt = _raw(
        service,
        "POST",
        "/score/toy_attributes",
        {**auth, **content, "Content-Length": str(len(encode_batch(images, ["no such scene"] * 3, [{}] * 3)[0]))},
        encode_batch(images, ["no such scene"] * 3, [{}] * 3)[0],
    )
    assert bad_prompt[0] == 400 and "toy_attributes" in bad_prompt[1]["error"] and "\n" not in bad_prompt[1]["error"]
    out = _remote(service)(images, prompts, [{} for _ in prompts])
    assert torch.equal(out.scores, REWARDS.build("toy_attributes")(images, prompts, [{}] * 3).scores)
    stats = _health(service)["stats"]
    assert stats["unauthorized"] >= 1 and stats["too_large"] >= 1


def test_a_retry_with_the_same_request_id_is_not_scored_twice(service):
    images, prompts = _batch(2)
    body, content = encode_batch(images, prompts, [{} for _ in prompts])
    request_id = hashlib.sha256(b"retry-test").hexdigest()
    headers = {
        **content,
        "Authorization": f"Bearer {TOKEN}",
        "Content-Length": str(len(body)),
        "X-Request-Id": request_id,
    }
    before = _health(service)["stats"]
    answers = []
    threads = [
        threading.Thread(target=lambda: answers.append(_raw(service, "POST", "/score/toy_attributes", headers, body)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    answers.append(_raw(service, "POST", "/score/toy_attributes", headers, body))  # after the first finished
    after = _health(service)["stats"]
    assert [a[0] for a in answers] == [200] * 4 and len({json.dumps(a[1]["scores"]) for a in answers}) == 1
    assert after["computed"] - before.get("computed", 0) == 1
    assert after["deduplicated"] - before.get("deduplicated", 0) == 3
    other = encode_batch(images.flip(0), prompts, [{} for _ in prompts])[0]
    status, answer, _ = _raw(
        service, "POST", "/score/toy_attributes", {**headers, "Content-Length": str(len(other))}, other
    )
    assert status == 409 and "different body" in answer["error"]


def test_a_replica_killed_mid_batch_costs_no_request(service):
    batches = [_batch(10 + client) for client in range(6)]
    want = [REWARDS.build("toy_attributes")(images, prompts, [{}] * 3).scores for images, prompts in batches]
    got: dict[tuple[int, int], torch.Tensor] = {}
    errors: list[BaseException] = []
    started, killed = threading.Event(), threading.Event()

    def client(i: int) -> None:  # sends until the kill is done, then two more batches
        remote, round_, after = _remote(service), 0, 0
        while after < 2 and round_ < 400:
            after += killed.is_set()
            try:
                got[i, round_] = remote(*batches[i], [{}] * 3).scores
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)
            started.set()
            round_ += 1

    before = _health(service)["stats"]
    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]  # 6 x 3 images: batches wait their 150 ms
    for thread in threads:
        thread.start()
    assert started.wait(120)
    time.sleep(1.0)
    in_flight = _health(service)["stats"]["in_flight"]  # requests the replicas hold right now (batch wait 150 ms)
    kill = (  # through Ray's API, from a driver of the service's cluster, while the clients keep sending
        "import ray; ray.init(address={!r}, logging_level='ERROR', log_to_driver=False); "
        "names = sorted(a['name'] for a in ray.util.list_named_actors(all_namespaces=True) "
        "if '#toy_attributes#' in a['name']); "
        "assert len(names) == 2, names; ray.kill(ray.get_actor(names[0], namespace='serve')); print(names[0])"
    ).format(service["ray"])
    env = dict(os.environ, RAY_AUTH_MODE="token")  # the service's Ray wrote its token to ~/.ray/auth_token
    done = subprocess.run([sys.executable, "-c", kill], capture_output=True, text=True, env=env, timeout=120)
    killed.set()
    assert done.returncode == 0 and "SERVE_REPLICA::" in done.stdout, done.stderr[-1500:]
    for thread in threads:
        thread.join()
    assert errors == [] and len(got) >= 6 * 3
    for (i, _), scores in got.items():
        assert torch.equal(scores, want[i])
    assert in_flight >= 2  # the kill came while requests were queued in the replicas' batches
    after = _health(service)["stats"]
    assert after["status_200"] - before["status_200"] == len(got)  # none lost: Serve's router (or this backend's retry)
    # sent the killed replica's requests to the live one


def test_non_loopback_host_without_token_is_refused():
    command = [
        sys.executable,
        "-m",
        "flowrl.cli",
        "serve-reward",
        "jpeg_compressibility",
        "--host",
        "0.0.0.0",
        "--port",
        "0",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--token" in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_sigterm_stops_ray_and_leaves_nothing_running(service):
    process = service["process"]
    children = psutil.Process(process.pid).children(recursive=True)
    assert any("raylet" in " ".join(c.cmdline()) for c in children if c.is_running())  # Ray was running under it
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=120) == 0, service["stderr"].read_text()[-1500:]
    deadline = time.monotonic() + 30
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert left == [], left
