"""HTTP server behind `flowrl serve-reward`: serves one registered reward to `remote` clients.

Protocol (HTTP/1.1):
  GET  /health -> 200 {"status": "ok", "reward": NAME, "modalities": [...], "differentiable": false}
  POST /score  Content-Type: application/x-safetensors, optional Content-Encoding: deflate (a zlib stream).
               The body is one safetensors file holding one uint8 tensor, "images" [N, 3, H, W] or
               "videos" [N, F, 3, H, W] (values round(x * 255)); its header metadata holds "prompts" (a JSON list of
               N strings) and "metadata" (a JSON list of N objects, optional).
               The reward sees pixels / 255: the same float32 values the former PNG transport produced.
  POST /score  Content-Type: application/json (older clients, `encoding=png`):
               {"prompts": [N], "metadata": [N], "images": [N base64 PNG]} or {..., "videos": [N lists of base64 PNG]}
            -> 200 {"scores": [N float or null (= NaN, not applicable)], "parts": {name: [N]}}
  Errors: 401 {"error"} wrong/missing bearer token, 400 {"error"} bad request, 500 {"error"} the reward failed.
"""

from __future__ import annotations

import base64
import json
import threading
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from flowrl.media import decode_png
from flowrl.reward_contract import nan_to_none, score_checked

SAFETENSORS = "application/x-safetensors"


Batch = tuple[torch.Tensor, list[str], list[dict[str, Any]]]


def decode_request(raw: bytes, content_type: str = SAFETENSORS, content_encoding: str = "") -> Batch:
    """A /score request body -> (images [N, 3, H, W] or videos [N, F, 3, H, W] float32 in [0, 1], prompts, metadata)."""
    content_type = content_type.split(";")[0].strip().lower()
    content_encoding = content_encoding.strip().lower()
    if content_encoding == "deflate":
        try:
            raw = zlib.decompress(raw)
        except zlib.error as err:
            raise ValueError(
                f"the body is not a deflate (zlib) stream ({err}); compress it with zlib.compress or drop Content-Encoding"
            ) from None
    elif content_encoding not in ("", "identity"):
        raise ValueError(f"Content-Encoding {content_encoding!r} is not supported; send identity or deflate")
    if content_type == SAFETENSORS:
        return _decode_safetensors(raw)
    if content_type == "application/json":
        return _decode_json(raw)
    raise ValueError(f"Content-Type {content_type!r} is not supported; send {SAFETENSORS} (or application/json with base64 PNGs)")


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
        raise ValueError(f"the safetensors body holds tensors {sorted(tensors)}; send exactly one, 'images' or 'videos'")
    pixels = tensors[names[0]]
    want = 4 if names[0] == "images" else 5
    if pixels.dtype != torch.uint8 or pixels.dim() != want:
        raise ValueError(f"tensor {names[0]!r} is {pixels.dtype} of shape {tuple(pixels.shape)}; send uint8 of {want} dims")
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
            f"{len(prompts)} prompts and {len(metadata)} metadata entries for {num} samples; send one of each per sample"
        )
    return prompts, metadata


def make_server(reward: Any, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> ThreadingHTTPServer:
    """A server (not yet serving) for `reward`; port 0 picks a free port (see server.server_address)."""
    lock = threading.Lock()  # one forward at a time: models are not re-entrant
    name = getattr(reward, "registry_name", type(reward).__name__)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # TCP_NODELAY: headers and body leave at once, no delayed-ACK stall

        def log_message(self, format: str, *args: Any) -> None:  # quiet: one line per request is noise here
            pass

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            if token is None or self.headers.get("Authorization") == f"Bearer {token}":
                return True
            self._send(401, {"error": "missing or wrong bearer token; pass the server's --token to the client"})
            return False

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path != "/health":
                return self._send(404, {"error": f"unknown path {self.path}; use /health or /score"})
            self._send(200, {"status": "ok", "reward": name, "modalities": list(reward.modalities), "differentiable": False})

        def do_POST(self) -> None:
            length = self.headers.get("Content-Length", "0")
            raw = self.rfile.read(int(length)) if length.isdigit() else b""
            self.close_connection = self.close_connection or not length.isdigit()  # unread body: drop the connection
            if not self._authorized():
                return
            if self.path != "/score":
                return self._send(404, {"error": f"unknown path {self.path}; POST to /score"})
            try:
                images, prompts, metadata = decode_request(
                    raw, self.headers.get("Content-Type", SAFETENSORS), self.headers.get("Content-Encoding", "")
                )
            except (ValueError, KeyError, TypeError, OSError, RuntimeError) as err:
                return self._send(400, {"error": f"bad request: {err}"})
            try:
                with lock, torch.no_grad():
                    out = score_checked(reward, images, prompts, metadata)
            except ValueError as err:
                return self._send(400, {"error": str(err)})
            except Exception as err:
                return self._send(500, {"error": f"{type(err).__name__}: {err}"})
            parts = {k: nan_to_none(v.float().cpu().tolist()) for k, v in out.parts.items()}
            self._send(200, {"scores": nan_to_none(out.scores.cpu().tolist()), "parts": parts})

    return ThreadingHTTPServer((host, port), Handler)
