"""HTTP server behind `flowrl serve-reward`: serves one registered reward to `remote` clients.

Protocol (JSON over HTTP/1.1):
  GET  /health -> 200 {"status": "ok", "reward": NAME, "modalities": [...], "differentiable": false}
  POST /score  {"prompts": [N], "metadata": [N], "images": [N base64 PNG]}            (image rewards)
               {"prompts": [N], "metadata": [N], "videos": [N lists of base64 PNG frames]} (video rewards)
            -> 200 {"scores": [N float or null (= NaN, not applicable)], "parts": {name: [N]}}
  Errors: 401 {"error"} wrong/missing bearer token, 400 {"error"} bad request, 500 {"error"} the reward failed.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from flowrl.media import decode_png

from .contract import nan_to_none, score_checked


def decode_batch(body: dict[str, Any]) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """A /score request body -> (images [N, 3, H, W] or videos [N, F, 3, H, W], prompts, metadata)."""
    prompts = body.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("request field 'prompts' must be a non-empty list of strings")
    metadata = body.get("metadata") or [{} for _ in prompts]
    if "images" in body:
        images = torch.stack([decode_png(base64.b64decode(item)) for item in body["images"]])  # [N, 3, H, W]
    elif "videos" in body:
        images = torch.stack([torch.stack([decode_png(base64.b64decode(f)) for f in video]) for video in body["videos"]])  # [N, F, 3, H, W]
    else:
        raise ValueError("request has neither 'images' nor 'videos'; send base64 PNGs in one of them")
    return images, prompts, metadata


def make_server(reward: Any, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> ThreadingHTTPServer:
    """A server (not yet serving) for `reward`; port 0 picks a free port (see server.server_address)."""
    lock = threading.Lock()  # one forward at a time: models are not re-entrant
    name = getattr(reward, "registry_name", type(reward).__name__)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

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
            length = int(self.headers.get("Content-Length", 0))
            raw = self.rfile.read(length)
            if not self._authorized():
                return
            if self.path != "/score":
                return self._send(404, {"error": f"unknown path {self.path}; POST to /score"})
            try:
                images, prompts, metadata = decode_batch(json.loads(raw))
            except (ValueError, KeyError, TypeError, OSError) as err:
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
