"""Client for a reward served by `flowrl serve-reward` on another process or machine.

The batch travels as one safetensors payload: a uint8 tensor "images" [N, 3, H, W] or "videos" [N, F, 3, H, W]
holding round(x * 255), with the prompts and metadata as JSON in the safetensors header (flowrl/serving/server.py
has the protocol). The served reward therefore sees values rounded to k/255, exactly what the former 8-bit PNG
transport gave it. `compression=zlib` deflates the payload (Content-Encoding: deflate) for slow links; the default,
none, suits loopback and fast networks. `encoding=png` sends base64 PNGs in JSON, for servers older than this protocol.

Each batch carries a fresh `X-Request-Id`, the same on every retry of it, so a server still scoring a batch when the
client timed out answers the retry from that computation instead of scoring it twice. `reward` names one reward of
a service that serves several (POST /score/NAME).

Each request has a timeout; connection failures, timeouts and 502/503/504 answers are retried `max_retries` times
with exponential backoff, then raise RemoteRewardError naming the URL, the attempts and the last failure. A wrong
token (401), a rejected batch (400, ValueError), a failing reward (500), a body over the server's limit (413) and a
malformed answer raise at once, in one line naming the URL and the HTTP status: retrying would not help.
"""

from __future__ import annotations

import base64
import json
import uuid
import zlib
from typing import Any

import torch
from safetensors.torch import save as save_safetensors

from flowrl.media import encode_pngs
from flowrl.registry import REWARDS
from flowrl.reward_contract import check_inputs
from flowrl.types import RewardOutput

from ._http import HTTPStatusError, NoAnswer, exchange

RETRY_STATUS = (502, 503, 504)  # retried: a proxy or an overloaded server
ENCODINGS, COMPRESSIONS = ("safetensors", "png"), ("none", "zlib")


class RemoteRewardError(ConnectionError):
    """The remote reward could not be reached or answered wrongly (raised as is by score_checked: no per-sample
    retry)."""


def encode_batch(
    images: torch.Tensor,
    prompts: list[str],
    metadata: list[dict[str, Any]],
    encoding: str = "safetensors",
    compression: str = "none",
) -> tuple[bytes, dict[str, str]]:
    """Images [N, 3, H, W] (videos [N, F, 3, H, W]) in [0, 1] + texts -> (/score request body, its content headers)."""
    key = "videos" if images.dim() == 5 else "images"
    if encoding == "png":
        b64 = lambda batch: [base64.b64encode(png).decode() for png in encode_pngs(batch)]  # noqa: E731
        pngs = b64(images) if key == "images" else [b64(video) for video in images]
        body = {key: pngs, "prompts": list(prompts), "metadata": list(metadata)}
        return json.dumps(body).encode(), {"Content-Type": "application/json"}
    # [N, 3, H, W] or [N, F, 3, H, W] uint8, round(x * 255): flowrl.media.to_uint8 (the PNGs' conversion), in place
    pixels = (images.detach() * 255).round_().clamp_(0, 255).to(torch.uint8).cpu().contiguous()
    texts = {"prompts": json.dumps(list(prompts)), "metadata": json.dumps(list(metadata))}
    data, headers = save_safetensors({key: pixels}, metadata=texts), {"Content-Type": "application/x-safetensors"}
    if compression == "zlib":
        data, headers["Content-Encoding"] = zlib.compress(data, 1), "deflate"
    return data, headers


@REWARDS.register("remote")
class RemoteReward:
    modalities = ("image", "video")
    differentiable = False
    extra_requires: tuple[str, ...] = ()

    def __init__(
        self,
        device: Any = "cpu",
        dtype: torch.dtype = torch.float32,
        url: str | None = None,
        token: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        encoding: str = "safetensors",
        compression: str = "none",
        reward: str | None = None,
    ):
        if not url or not url.startswith(("http://", "https://")):
            raise ValueError(
                f"remote: url={url!r} is not an http(s) URL; pass the server's address, e.g. url=http://127.0.0.1:8765"
            )
        if int(max_retries) < 0 or float(timeout_s) <= 0:
            raise ValueError(
                f"remote: max_retries={max_retries}, timeout_s={timeout_s}; use max_retries >= 0 and timeout_s > 0"
            )
        if encoding not in ENCODINGS or compression not in COMPRESSIONS:
            raise ValueError(
                f"remote: encoding={encoding!r}, compression={compression!r}; "
                f"use encoding in {ENCODINGS} and compression in {COMPRESSIONS}"
            )
        if encoding == "png" and compression != "none":
            raise ValueError("remote: compression=zlib needs encoding=safetensors; PNGs are compressed already")
        self.device, self.url, self.token = torch.device(device), url.rstrip("/"), token
        self.timeout_s, self.max_retries, self.backoff_s = float(timeout_s), int(max_retries), float(backoff_s)
        self.encoding, self.compression = encoding, compression
        self.score_path = f"/score/{reward}" if reward else "/score"

    def _request(self, path: str, data: bytes | None = None, content: dict[str, str] | None = None) -> dict[str, Any]:
        headers = dict(content or {}, **({"X-Request-Id": uuid.uuid4().hex} if data is not None else {}))
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            raw = exchange(
                self.url + path, data, headers, self.timeout_s, self.max_retries, self.backoff_s, RETRY_STATUS, _retried
            )
        except HTTPStatusError as err:
            message = _error_text(err.body, err.reason)
            if err.code == 401:
                raise RemoteRewardError(
                    f"remote {self.url}: unauthorized (HTTP 401); pass token= equal to the server's --token"
                ) from None
            if err.code == 400:
                raise ValueError(f"remote {self.url}: server rejected the batch (HTTP 400): {message}") from None
            if err.code == 413:
                raise ValueError(f"remote {self.url}: batch too large for the server (HTTP 413): {message}") from None
            raise RemoteRewardError(f"remote {self.url}: HTTP {err.code}: {message}") from None
        except NoAnswer as err:
            raise RemoteRewardError(
                f"remote {self.url}{path}: gave up after {err.attempts} attempts; last error: {err.last}; "
                "is `flowrl serve-reward` running there?"
            ) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise RemoteRewardError(f"remote {self.url}: malformed response (not JSON): {raw[:80]!r}") from None

    def health(self) -> dict[str, Any]:
        return self._request("/health")

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        check_inputs("remote", images, prompts, metadata, modality="video" if images.dim() == 5 else "image")
        answer = self._request(
            self.score_path, *encode_batch(images, prompts, metadata, self.encoding, self.compression)
        )
        scores = answer.get("scores") if isinstance(answer, dict) else None
        numbers = isinstance(scores, list) and all(s is None or isinstance(s, (int, float)) for s in scores)
        if not numbers or len(scores) != len(prompts):
            raise RemoteRewardError(
                f"remote {self.url}: malformed response, expected 'scores' with {len(prompts)} numbers, "
                f"got {str(answer)[:80]}"
            )

        def as_tensor(values: list) -> torch.Tensor:
            numbers = [float("nan") if v is None else float(v) for v in values]
            return torch.tensor(numbers, dtype=torch.float32, device=self.device)

        parts = {
            k: as_tensor(v)
            for k, v in (answer.get("parts") or {}).items()
            if isinstance(v, list) and len(v) == len(prompts)
        }
        return RewardOutput(scores=as_tensor(scores), parts=parts)  # [N]


def _error_text(body: bytes, reason: str) -> str:
    try:
        text = str(json.loads(body).get("error", ""))
    except Exception:
        text = reason
    return " ".join(text.split())[:300]  # one line, whatever the server wrote


def _retried(code: int, body: bytes, reason: str) -> str:
    return f"HTTP {code} {_error_text(body, reason)}"
