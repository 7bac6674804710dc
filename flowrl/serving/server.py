"""The HTTP front of `flowrl serve-reward`: serves registered rewards to `remote` clients, scoring them in this
process (`LocalBackend`) or on Ray Serve replicas (flowrl/serving/ray_serve.py).

Protocol (HTTP/1.1; every request carries `Authorization: Bearer TOKEN` when the server has a token):
  GET  /health -> 200 {"status": "ok", "rewards": {NAME: {"modalities": [...], "differentiable": false}},
                      "stats": {...}}
               (one reward served: also "reward", "modalities", "differentiable" at the top level)
  POST /score/NAME (or /score when one reward is served)
               Content-Type: application/x-safetensors, optional Content-Encoding: deflate (a zlib stream).
               The body is one safetensors file holding one uint8 tensor, "images" [N, 3, H, W] or
               "videos" [N, F, 3, H, W] (values round(x * 255)); its header metadata holds "prompts" (a JSON list of
               N strings) and "metadata" (a JSON list of N objects, optional).
               The reward sees pixels / 255: the same float32 values the former PNG transport produced.
               Content-Type: application/json (older clients, `encoding=png`):
               {"prompts": [N], "metadata": [N], "images": [N base64 PNG]} or {..., "videos": [N lists of base64 PNG]}
               Optional `X-Request-Id`: a retry with the same id is answered from the first computation (waiting for it
               while it runs, at most the request timeout), never scored twice; the same id with a different body is a
               409.
            -> 200 {"scores": [N float or null (= NaN, not applicable)], "parts": {name: [N]}}
               (Ray Serve: also "batch_images", the most images one forward held with this request's samples)
  Errors, each {"error": one line naming the reward and the cause}:
    answered before the body is read, the connection then closed: 401 wrong or missing token, 404 unknown path or
      reward, 411 no Content-Length, 400 a Content-Length that is not ASCII digits, 413 a body over the limit;
    answered instead of scoring, the connection then closed: 408 the body did not arrive within the request timeout,
      400 the body ended early (the client closed its side); neither is decoded;
    400 a malformed batch, 409 a reused request id, 500 the reward failed, 504 no answer from a replica (Ray Serve);
    503, retried by `remote`: a replica died, the connection limit is reached, or a retried request id's first
      computation still runs after the request timeout (retry with the same id: it is answered from that computation).
Limits (`flowrl serve-reward --request-timeout S --max-connections C`): a request's header and then its body must each
  arrive within S seconds, trickled or not; a connection that sends no request within S seconds (idle, or between
  keep-alive requests) is closed unanswered. At most C connections are served at once, a thread each; one more is
  answered 503 at once, without a thread, and closed when the client closes it (or after S seconds).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import io
import json
import socket
import sys
import threading
import time
import zlib
from collections import Counter, OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import torch
from safetensors.torch import load as load_safetensors

from flowrl.media import decode_png
from flowrl.reward_contract import nan_to_none, score_checked

SAFETENSORS = "application/x-safetensors"
MAX_BODY_BYTES = 256 * 2**20  # a body (as sent) over this is answered 413 unread
MAX_DECODED_BYTES = 1024 * 2**20  # a deflate body that inflates past this is answered 413
REQUEST_TIMEOUT_S = 30.0  # the longest a request's header, and then its body, may take to arrive
MAX_CONNECTIONS = 128  # connections served at once (a thread each); one more is answered 503
LOOPBACK = ("127.0.0.1", "localhost", "::1")


class TooLarge(ValueError):
    """The request is over a size limit (answered 413)."""


Batch = tuple[torch.Tensor, list[str], list[dict[str, Any]]]


def decode_request(
    raw: bytes, content_type: str = SAFETENSORS, content_encoding: str = "", max_bytes: int = MAX_DECODED_BYTES
) -> Batch:
    """A /score request body -> (images [N, 3, H, W] or videos [N, F, 3, H, W] float32 in [0, 1], prompts, metadata).
    A deflate body is inflated to at most `max_bytes` (over it: TooLarge)."""
    content_type = content_type.split(";")[0].strip().lower()
    content_encoding = content_encoding.strip().lower()
    if content_encoding == "deflate":
        raw = _inflate(raw, max_bytes)
    elif content_encoding not in ("", "identity"):
        raise ValueError(f"Content-Encoding {content_encoding!r} is not supported; send identity or deflate")
    if content_type == SAFETENSORS:
        return _decode_safetensors(raw)
    if content_type == "application/json":
        return _decode_json(raw)
    raise ValueError(
        f"Content-Type {content_type!r} is not supported; send {SAFETENSORS} (or application/json with base64 PNGs)"
    )


def _inflate(raw: bytes, max_bytes: int) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(raw, max_bytes + 1)  # never more than the cap + 1 byte in memory
    except zlib.error as err:
        raise ValueError(
            f"the body is not a deflate (zlib) stream ({err}); compress it with zlib.compress or drop Content-Encoding"
        ) from None
    if len(out) > max_bytes:
        raise TooLarge(f"the deflate body inflates past {max_bytes} bytes; send smaller batches")
    if not inflater.eof:
        raise ValueError("the body is not a deflate (zlib) stream (truncated); send the whole zlib.compress output")
    return out


def _decode_safetensors(raw: bytes) -> Batch:
    header_len = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else -1
    if not 0 < header_len <= len(raw) - 8:
        raise ValueError(f"the body ({len(raw)} bytes) is not a safetensors file: no valid header length")
    try:
        info = json.loads(raw[8 : 8 + header_len]).get("__metadata__") or {}
        tensors = load_safetensors(raw)
    except Exception as err:  # the library's own error type is not importable across versions
        raise ValueError(f"the body is not a valid safetensors file: {type(err).__name__}: {err}") from None
    names = sorted(set(tensors) & {"images", "videos"})
    if len(names) != 1 or len(tensors) != 1:
        raise ValueError(
            f"the safetensors body holds tensors {sorted(tensors)}; send exactly one, 'images' or 'videos'"
        )
    pixels = tensors[names[0]]
    want = 4 if names[0] == "images" else 5
    if pixels.dtype != torch.uint8 or pixels.dim() != want:
        raise ValueError(
            f"tensor {names[0]!r} is {pixels.dtype} of shape {tuple(pixels.shape)}; send uint8 of {want} dims"
        )
    try:
        prompts = json.loads(info["prompts"])
        metadata = json.loads(info.get("metadata") or "null")
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            "the safetensors metadata needs 'prompts' as a JSON list of strings (and 'metadata' as a JSON list)"
        ) from None
    return pixels.float().div_(255.0), *_check_texts(prompts, metadata, len(pixels))  # the PNG path's float32 values


def _decode_json(raw: bytes) -> Batch:
    body = json.loads(raw)
    if not isinstance(body, dict):
        raise ValueError("the JSON body must be an object with 'prompts' and 'images' or 'videos'")
    if "images" in body:
        images = torch.stack([decode_png(base64.b64decode(item)) for item in body["images"]])  # [N, 3, H, W]
    elif "videos" in body:
        videos = [torch.stack([decode_png(base64.b64decode(f)) for f in video]) for video in body["videos"]]
        images = torch.stack(videos)  # [N, F, 3, H, W]
    else:
        raise ValueError("the JSON body has neither 'images' nor 'videos'; send base64 PNGs in one of them")
    return images, *_check_texts(body.get("prompts"), body.get("metadata"), len(images))


def _check_texts(prompts: Any, metadata: Any, num: int) -> tuple[list[str], list[dict[str, Any]]]:
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("'prompts' must be a non-empty list of strings")
    metadata = metadata or [{} for _ in prompts]
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise ValueError("'metadata' must be a list of objects, one per sample")
    if not len(prompts) == len(metadata) == num:
        raise ValueError(
            f"{len(prompts)} prompts and {len(metadata)} metadata entries for {num} samples; "
            "send one of each per sample"
        )
    return prompts, metadata


Answer = tuple[int, dict[str, Any]]  # (HTTP status, JSON payload)


def score_answer(
    name: str, reward: Any, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]
) -> Answer:
    """Score one decoded batch in this process: (200, {"scores", "parts"}) or (400 / 500, {"error": one line})."""
    try:
        with torch.no_grad():
            out = score_checked(reward, images, prompts, metadata)
    except ValueError as err:
        return 400, {"error": _named(name, str(err))}
    except Exception as err:
        return 500, {"error": _named(name, str(err), f"failed: {type(err).__name__}: ")}
    parts = {k: nan_to_none(v.float().cpu().tolist()) for k, v in out.parts.items()}
    return 200, {"scores": nan_to_none(out.scores.float().cpu().tolist()), "parts": parts}


def decode_answer(name: str, raw: bytes, content_type: str, content_encoding: str, max_bytes: int) -> Answer | Batch:
    """decode_request, its failures as answers (413 over the size limit, 400 malformed)."""
    try:
        return decode_request(raw, content_type, content_encoding, max_bytes)
    except TooLarge as err:
        return 413, {"error": _line(f"reward {name}: {err}")}
    except (ValueError, KeyError, TypeError, OSError, RuntimeError) as err:
        return 400, {"error": _line(f"reward {name}: bad request: {err}")}


def _line(text: str) -> str:
    return " ".join(str(text).split())[:500]


def _named(name: str, text: str, prefix: str = ": ") -> str:
    """One line that names the reward (once: the contract's messages name it already)."""
    return _line(text if name in text else f"reward {name}{' ' if prefix[0] != ':' else ''}{prefix}{text}")


class Backend(Protocol):
    """Where the front's requests are scored: `names`, `info(name)` -> {"modalities", "differentiable"},
    `score(name, raw, content_type, content_encoding)` -> (status, payload), `close()`."""

    names: list[str]

    def info(self, name: str) -> dict[str, Any]: ...

    def score(self, name: str, raw: bytes, content_type: str, content_encoding: str) -> Answer: ...

    def close(self) -> None: ...


class LocalBackend:
    """Rewards scored in this process, one forward at a time per reward (models are not re-entrant)."""

    def __init__(self, rewards: dict[str, Any], max_decoded_bytes: int = MAX_DECODED_BYTES):
        self.rewards, self.names, self.max_decoded_bytes = dict(rewards), list(rewards), max_decoded_bytes
        self.locks = {name: threading.Lock() for name in rewards}

    def info(self, name: str) -> dict[str, Any]:
        return {"modalities": list(self.rewards[name].modalities), "differentiable": False}

    def score(self, name: str, raw: bytes, content_type: str, content_encoding: str) -> Answer:
        decoded = decode_answer(name, raw, content_type, content_encoding, self.max_decoded_bytes)
        if isinstance(decoded[0], int):
            return decoded
        with self.locks[name]:
            return score_answer(name, self.rewards[name], *decoded)

    def close(self) -> None:
        pass


class _Entry:
    def __init__(self, digest: str):
        self.digest, self.done, self.answer = digest, threading.Event(), None


class Results:
    """Answers by request id: the first request with an id computes, a retry with it waits for that computation (at
    most `wait_s`: then a 503 the client retries) and gets its answer. Answers of 5xx are not kept (a retry after a
    failure computes again); the oldest finished entries beyond `size` are forgotten."""

    def __init__(self, size: int = 4096, wait_s: float = REQUEST_TIMEOUT_S):
        self.size, self.wait_s, self.lock, self.entries = size, wait_s, threading.Lock(), OrderedDict()

    def run(self, key: tuple[str, str], digest: str, compute) -> tuple[Answer, bool]:
        """(answer, reused): compute() once per key (reward, request id)."""
        with self.lock:
            entry = self.entries.get(key)
            owner = entry is None
            if owner:
                entry = self.entries[key] = _Entry(digest)
                while len(self.entries) > self.size and next(iter(self.entries.values())).done.is_set():
                    self.entries.popitem(last=False)
        if not owner:
            named = f"reward {key[0]}: request id {key[1]!r}"
            if entry.digest != digest:
                return (409, {"error": f"{named} was used for a different body; send a fresh id per batch"}), False
            if not entry.done.wait(self.wait_s):
                return (
                    503,
                    {"error": f"{named} is still being scored after {self.wait_s:g}s; retry with the same id"},
                ), False
            return entry.answer, True
        try:
            entry.answer = compute()
        except Exception as err:  # a backend bug: answered, not kept
            entry.answer = 500, {"error": _line(f"the service failed: {type(err).__name__}: {err}")}
        finally:
            if entry.answer is None or entry.answer[0] >= 500:
                with self.lock:
                    self.entries.pop(key, None)
            entry.done.set()
        return entry.answer, False


class Stats(Counter):
    """Counters several request threads add to: count(key, by) under a lock, snapshot() a plain dict."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def count(self, key: str, by: int = 1) -> None:
        with self.lock:
            self[key] += by

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self)


class _DeadlineReader(io.RawIOBase):
    """A socket's reads bounded by a deadline (time.monotonic()): each recv waits at most until then, so a header or a
    body trickled a byte at a time still ends on time, in TimeoutError. Between reads the socket keeps `timeout`."""

    def __init__(self, sock: socket.socket, timeout: float):
        self.sock, self.timeout, self.deadline = sock, timeout, time.monotonic() + timeout

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing more arrived within {self.timeout:g}s")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.timeout)


class RewardServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer with the backend it fronts, serving at most `max_connections` connections at once, a
    thread each. One more is answered 503 from the accepting thread, which then keeps it open, without a thread, until
    the client closes it or `linger_s` passes: closing a socket before the client's request arrived would reset the
    connection, and the client could lose the answer. server_close() closes the backend too."""

    daemon_threads = True
    request_queue_size = socket.SOMAXCONN  # connections not yet accepted (socketserver's 5 drops a burst's SYNs)

    def __init__(
        self,
        address,
        handler,
        backend: Backend,
        max_connections: int = MAX_CONNECTIONS,
        linger_s: float = REQUEST_TIMEOUT_S,
    ):
        self.backend, self.stats, self.max_connections, self.linger_s = backend, Stats(), max_connections, linger_s
        self.slots = threading.BoundedSemaphore(max_connections)
        self.lingering: list[tuple[socket.socket, float]] = []  # refused connections, each with its closing time
        super().__init__(address, handler)

    def process_request(self, request: socket.socket, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.stats.count("refused")
            return self._refuse(request)
        try:
            super().process_request(request, client_address)  # a thread for this connection
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def _refuse(self, request: socket.socket) -> None:
        error = f"the server is serving {self.max_connections} connections, its limit (--max-connections); retry later"
        data = json.dumps({"error": error}).encode()
        head = f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        try:
            request.setblocking(False)  # the accepting thread never waits on a client
            request.sendall(head.encode() + b"Connection: close\r\n\r\n" + data)
            request.shutdown(socket.SHUT_WR)
        except OSError:  # the client left already
            return self.shutdown_request(request)
        if len(self.lingering) >= self.max_connections:  # a flood: the oldest refused connection goes first
            self.shutdown_request(self.lingering.pop(0)[0])
        self.lingering.append((request, time.monotonic() + self.linger_s))

    def service_actions(self) -> None:
        """Run by serve_forever after each accepted connection and every poll interval: each refused connection's
        unread bytes are read (64 KiB at a time), and it is closed once the client closed it or its time is up."""
        now, keep = time.monotonic(), []
        for sock, until in self.lingering:
            try:
                open_ = bool(sock.recv(65536))  # b"": the client closed its side
            except BlockingIOError:
                open_ = True
            except OSError:
                open_ = False
            if open_ and now < until:
                keep.append((sock, until))
            else:
                self.shutdown_request(sock)
        self.lingering = keep

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], OSError):  # a client that went away or timed out: nothing to report
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        for sock, _ in self.lingering:
            self.shutdown_request(sock)
        self.backend.close()


def check_limits(request_timeout: float, max_connections: int) -> None:
    """ValueError naming the flag when a limit is unusable."""
    if not request_timeout > 0:
        raise ValueError(f"--request-timeout {request_timeout}: use a number of seconds > 0, e.g. 30")
    if int(max_connections) < 1:
        raise ValueError(f"--max-connections {max_connections}: use 1 or more, e.g. 128")


def make_server(
    target: Any,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    cache_size: int = 4096,
    request_timeout: float = REQUEST_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> RewardServer:
    """A server (not yet serving) for `target`: a Backend, or one reward object (scored in this process). Port 0 picks
    a free port (see server.server_address). A host other than loopback needs a token. A request's header and its body
    must each arrive within `request_timeout` seconds; at most `max_connections` connections are served at once."""
    if host not in LOOPBACK and not token:
        raise ValueError(f"host {host!r} is reachable from other machines; pass a token (--token) or bind to 127.0.0.1")
    check_limits(request_timeout, max_connections)
    backend = target if hasattr(target, "score") and hasattr(target, "names") else None
    if backend is None:
        backend = LocalBackend({getattr(target, "registry_name", type(target).__name__): target})
    expected = f"Bearer {token}".encode() if token else None
    results = Results(cache_size, request_timeout)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # TCP_NODELAY: headers and body leave at once, no delayed-ACK stall
        timeout = request_timeout  # each write, and each read between deadlines

        def setup(self) -> None:
            super().setup()
            self.rfile.close()  # the reads go through the deadline instead
            self.reader = _DeadlineReader(self.connection, request_timeout)
            self.rfile = io.BufferedReader(self.reader)

        def handle_one_request(self) -> None:
            self.reader.deadline = time.monotonic() + request_timeout  # for the request line and the headers
            super().handle_one_request()  # a TimeoutError there closes the connection unanswered

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise here
            pass

        def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
            """http.server's own errors (a malformed request line, an unsupported method) in the protocol's JSON."""
            self._send(code, {"error": _line(message or self.responses.get(code, ("error",))[0])}, True)

        def _send(self, status: int, payload: dict[str, Any], unread: bool = False) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if unread:  # the body was not read: the connection cannot carry another request
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            given = self.headers.get("Authorization", "").encode()
            if expected is None or hmac.compare_digest(given, expected):
                return True
            self.server.stats.count("unauthorized")
            self._send(401, {"error": "missing or wrong bearer token; pass the server's --token to the client"}, True)
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path != "/health":
                return self._send(404, {"error": f"unknown path {self.path}; use /health or /score"})
            rewards = {name: backend.info(name) for name in backend.names}
            backend_stats = getattr(backend, "stats", None)
            stats = {**self.server.stats.snapshot(), **(backend_stats.snapshot() if backend_stats is not None else {})}
            payload = {"status": "ok", "rewards": rewards, "stats": stats}
            if len(rewards) == 1:
                ((name, info),) = rewards.items()
                payload.update(reward=name, **info)
            self._send(200, payload)

        def _reward(self) -> str | None:
            path = self.path.split("?", 1)[0]
            if path == "/score" and len(backend.names) == 1:
                return backend.names[0]
            if path.startswith("/score/") and path[len("/score/") :] in backend.names:
                return path[len("/score/") :]
            served = ", ".join(backend.names)
            if path == "/score":
                error = f"several rewards are served ({served}); POST to /score/NAME"
            elif path.startswith("/score/"):
                error = f"unknown reward {path[len('/score/') :]!r}; this service serves {served}"
            else:
                error = f"unknown path {path}; POST to /score/NAME ({served})"
            self._send(404, {"error": error}, True)
            return None

        def _body(self, name: str, length: int) -> bytes | None:
            """The body, read within the request timeout; None when it was answered instead (408 late, 400 cut short:
            never decoded) and the connection closed."""
            self.reader.deadline = time.monotonic() + request_timeout
            try:
                raw = self.rfile.read(length)
            except TimeoutError:
                self.server.stats.count("timed_out")
                error = f"reward {name}: the body did not arrive within {request_timeout:g}s (--request-timeout)"
                return self._send(408, {"error": f"{error}; send all {length} bytes the Content-Length declares"}, True)
            if len(raw) < length:
                self.server.stats.count("truncated")
                error = (
                    f"reward {name}: the body ended after {len(raw)} of its {length} bytes (Content-Length); "
                    "send it whole"
                )
                return self._send(400, {"error": error}, True)
            return raw

        def do_POST(self) -> None:
            if not self._authorized():
                return
            name = self._reward()
            if name is None:
                return
            length = self.headers.get("Content-Length")
            if length is None:
                return self._send(411, {"error": f"reward {name}: send the body with a Content-Length header"}, True)
            if not (length.strip().isascii() and length.strip().isdigit()):  # '²'.isdigit(), yet int('²') fails
                error = f"reward {name}: header Content-Length {length!r} is not a byte count; send ASCII digits"
                return self._send(400, {"error": _line(error)}, True)
            if int(length) > max_body_bytes:
                self.server.stats.count("too_large")
                error = (
                    f"reward {name}: the body ({length} bytes) is over the limit of {max_body_bytes}; "
                    "send smaller batches"
                )
                return self._send(413, {"error": error}, True)
            raw = self._body(name, int(length))
            if raw is None:
                return
            kind, encoding = self.headers.get("Content-Type", SAFETENSORS), self.headers.get("Content-Encoding", "")
            request_id = self.headers.get("X-Request-Id", "")

            def compute() -> Answer:
                self.server.stats.count("computed")
                self.server.stats.count("in_flight")
                try:
                    return backend.score(name, raw, kind, encoding)
                finally:
                    self.server.stats.count("in_flight", -1)

            if request_id:
                digest = hashlib.sha256(b"%s\0%s\0%s\0" % (kind.encode(), encoding.encode(), raw)).hexdigest()
                (status, payload), reused = results.run((name, request_id), digest, compute)
                if reused:
                    self.server.stats.count("deduplicated")
            else:
                status, payload = compute()
            self.server.stats.count(f"status_{status}")
            self._send(status, payload)

    return RewardServer((host, port), Handler, backend, int(max_connections), request_timeout)
