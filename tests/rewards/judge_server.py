"""An OpenAI-compatible chat endpoint written here for the tests of `openai_judge`: POST /v1/chat/completions with an
image as a PNG data URL and a text part; the reply scores the image by a deterministic rule (its mean pixel value,
x 5, as "Final Score: X", or x 10 as a bare number with reply="number"), so the test can compute the score apart.
A tiny real VLM would answer arbitrary text, which no parser test can predict; the protocol is what is under test.
It records the largest number of requests it served at once, and can fail the first `fail_first` requests (503)."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def rule(png: bytes) -> float:
    """The image's mean pixel value in [0, 1]."""
    return float(np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.float64).mean() / 255)


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _send(self, code: int, payload: dict) -> None:
        out = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def do_POST(self):
        server = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with server.lock:
            server.active += 1
            server.peak = max(server.peak, server.active)
            server.requests.append({"body": body, "auth": self.headers.get("Authorization")})
            fail = server.fail_first > 0
            server.fail_first -= 1 if fail else 0
        try:
            time.sleep(server.delay_s)
            code, payload = self._answer(server, body, fail)
        finally:  # the request stops counting before its answer leaves: a client that got the answer may send the next
            with server.lock:
                server.active -= 1
        self._send(code, payload)

    def _answer(self, server, body: dict, fail: bool) -> tuple[int, dict]:
        if self.path != "/v1/chat/completions":
            return 404, {"error": {"message": f"no route {self.path}"}}
        if fail:
            return 503, {"error": {"message": "overloaded"}}
        parts = body["messages"][0]["content"]
        url = next(p["image_url"]["url"] for p in parts if p["type"] == "image_url")
        value = rule(base64.b64decode(url.split(",", 1)[1]))
        text = f"The image is fine. Final Score: {value * 5:.6f}"
        if server.reply == "number":
            text = f"{value * 10:.6f}"
        elif server.reply == "nonsense":
            text = "I cannot rate this image."
        return 200, {"choices": [{"message": {"role": "assistant", "content": text}}]}


def start_judge(reply: str = "unifiedreward", delay_s: float = 0.0, fail_first: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.reply, server.delay_s, server.fail_first = reply, delay_s, fail_first
    server.lock, server.active, server.peak, server.requests = threading.Lock(), 0, 0, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
