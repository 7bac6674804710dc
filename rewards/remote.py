"""Client for a reward served by `flowrl serve-reward` on another process or machine.

Images travel as 8-bit PNGs (values are rounded to k/255). Each request has a timeout; connection failures,
timeouts and 502/503/504 answers are retried `max_retries` times with exponential backoff, then raise
RemoteRewardError naming the URL, the attempts and the last failure. A wrong token (401), a rejected batch
(400), a failing reward (500) and a malformed answer raise at once: retrying would not help.
"""

from __future__ import annotations

import base64
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import torch

from flowrl.media import encode_pngs
from flowrl.registry import REWARDS
from flowrl.types import RewardOutput

from .contract import check_inputs

RETRY_STATUS = (502, 503, 504)


class RemoteRewardError(ConnectionError):
    """The remote reward could not be reached or answered wrongly (raised as is by score_checked: no per-sample retry)."""


@REWARDS.register("remote")
class RemoteReward:
    modalities = ("image", "video")
    differentiable = False
    extra_requires: tuple[str, ...] = ()

    def __init__(self, device: Any = "cpu", dtype: torch.dtype = torch.float32, url: str | None = None,
                 token: str | None = None, timeout_s: float = 120.0, max_retries: int = 3, backoff_s: float = 0.5):
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(f"remote: url={url!r} is not an http(s) URL; pass the server's address, e.g. url=http://127.0.0.1:8765")
        if int(max_retries) < 0 or float(timeout_s) <= 0:
            raise ValueError(f"remote: max_retries={max_retries}, timeout_s={timeout_s}; use max_retries >= 0 and timeout_s > 0")
        self.device, self.url, self.token = torch.device(device), url.rstrip("/"), token
        self.timeout_s, self.max_retries, self.backoff_s = float(timeout_s), int(max_retries), float(backoff_s)

    def _request(self, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            request = urllib.request.Request(self.url + path, data=data, headers=headers, method="GET" if body is None else "POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                message = _error_text(err)
                if err.code in RETRY_STATUS:
                    last = f"HTTP {err.code} {message}"
                    continue
                if err.code == 401:
                    raise RemoteRewardError(f"remote {self.url}: unauthorized (401); pass token= equal to the server's --token") from None
                if err.code == 400:
                    raise ValueError(f"remote {self.url}: server rejected the batch: {message}") from None
                raise RemoteRewardError(f"remote {self.url}: HTTP {err.code}: {message}") from None
            except (urllib.error.URLError, TimeoutError, socket.timeout, ConnectionError) as err:
                reason = getattr(err, "reason", err)
                last = f"timed out after {self.timeout_s:g}s" if isinstance(reason, (TimeoutError, socket.timeout)) else f"{reason}"
                continue
            try:
                return json.loads(raw)
            except ValueError:
                raise RemoteRewardError(f"remote {self.url}: malformed response (not JSON): {raw[:80]!r}") from None
        raise RemoteRewardError(f"remote {self.url}{path}: gave up after {self.max_retries + 1} attempts; last error: {last}; is `flowrl serve-reward` running there?")

    def health(self) -> dict[str, Any]:
        return self._request("/health", None)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        modality = "video" if images.dim() == 5 else "image"
        check_inputs("remote", images, prompts, metadata, modality=modality)
        b64 = lambda batch: [base64.b64encode(png).decode() for png in encode_pngs(batch)]  # noqa: E731
        body = {"images": b64(images)} if modality == "image" else {"videos": [b64(video) for video in images]}
        body.update(prompts=list(prompts), metadata=list(metadata))
        answer = self._request("/score", body)
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != len(prompts) or not all(s is None or isinstance(s, (int, float)) for s in scores):
            raise RemoteRewardError(f"remote {self.url}: malformed response, expected 'scores' with {len(prompts)} numbers, got {str(answer)[:80]}")
        as_tensor = lambda values: torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float32, device=self.device)  # noqa: E731
        parts = {k: as_tensor(v) for k, v in (answer.get("parts") or {}).items() if isinstance(v, list) and len(v) == len(prompts)}
        return RewardOutput(scores=as_tensor(scores), parts=parts)  # [N]


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(err.read()).get("error", ""))[:200]
    except Exception:
        return err.reason if isinstance(err.reason, str) else ""
