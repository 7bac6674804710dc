"""The HTTP exchange the remote rewards share (remote, remote_flowgrpo, openai_judge): one request with a timeout,
retried with exponential backoff on a connection failure, a timeout or a status in `retry_status`."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable


class HTTPStatusError(Exception):
    """The server answered with a status that is not retried; `body` is what it wrote."""

    def __init__(self, code: int, body: bytes, reason: str):
        super().__init__(f"HTTP {code}")
        self.code, self.body, self.reason = code, body, reason


class NoAnswer(ConnectionError):
    """Every attempt failed; `last` says how the last one did."""

    def __init__(self, attempts: int, last: str):
        super().__init__(f"no answer after {attempts} attempts: {last}")
        self.attempts, self.last = attempts, last


def status_line(code: int, body: bytes, reason: str) -> str:
    """'HTTP 503: <the body on one line>' (at most 200 characters of it), for a retried status's record."""
    return f"HTTP {code}: {' '.join(body.decode('utf-8', 'replace').split())[:200] or reason}"


def exchange(
    url: str,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout_s: float = 60.0,
    max_retries: int = 0,
    backoff_s: float = 0.5,
    retry_status: tuple[int, ...] = (),
    describe: Callable[[int, bytes, str], str] = status_line,
) -> bytes:
    """The answer's body to a GET (`data` None) or POST of `data`. A status in `retry_status`, a connection failure
    or a timeout is retried `max_retries` times (sleeping backoff_s · 2^(attempt − 1) before each), then raises NoAnswer
    (a retried status recorded by `describe`); any other error status raises HTTPStatusError at once."""
    last = ""
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        method = "GET" if data is None else "POST"
        request = urllib.request.Request(url, data=data, headers=dict(headers or {}), method=method)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as err:
            body, reason = err.read(), err.reason if isinstance(err.reason, str) else ""
            if err.code not in retry_status:
                raise HTTPStatusError(err.code, body, reason) from None
            last = describe(err.code, body, reason)
        except (urllib.error.URLError, TimeoutError, ConnectionError) as err:  # socket.timeout is TimeoutError
            reason = getattr(err, "reason", err)
            last = f"timed out after {timeout_s:g}s" if isinstance(reason, TimeoutError) else f"{reason}"
    raise NoAnswer(max_retries + 1, last)
