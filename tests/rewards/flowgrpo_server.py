"""A reward server of flow_grpo's protocol, written here for the tests of `remote_flowgrpo`: POST / with a pickled
{"images": [JPEG bytes], "meta_datas": [...], ...}; the answer is a pickled {"scores": numpy array, ...} (what the
GenEval and DeQA servers return), or a traceback with status 500. Each image scores the mean of its decoded pixels
in [0, 1], plus 1 where its metadata has "bonus"."""

from __future__ import annotations

import io
import pickle
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from PIL import Image


def score_jpegs(jpegs: list[bytes], meta_datas: list[dict]) -> np.ndarray:
    means = [
        np.asarray(Image.open(io.BytesIO(j), formats=["jpeg"]).convert("RGB"), dtype=np.float64).mean() / 255
        for j in jpegs
    ]
    return np.array([m + (1.0 if meta.get("bonus") else 0.0) for m, meta in zip(means, meta_datas)])


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet test output
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            data = pickle.loads(body)  # the test's own client: trusted here
            self.server.requests.append(data)
            if self.server.answer is not None:
                answer = self.server.answer
            else:
                answer = {
                    "scores": score_jpegs(data["images"], data["meta_datas"]),
                    "rewards": [0.0] * len(data["images"]),
                }
            out, code = pickle.dumps(answer), 200
        except Exception:
            out, code = traceback.format_exc().encode(), 500
        self.send_response(code)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def start_server(answer=None) -> ThreadingHTTPServer:
    """A running server on a free loopback port; `answer` replaces the computed answer (a malformed one, say)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.requests, server.answer = [], answer
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
