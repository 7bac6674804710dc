"""Fixtures for evaluation and report tests: fabricated run folders with known pixels and scores, and a real
headless Chromium driven over the DevTools protocol (CDP) with websocket-client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TRAIN, GOLD = "toy_attributes", "toy_artifact"


def colour(step_index: int, p: int, s: int, frame: int = 0) -> tuple[int, int, int]:
    """The solid colour of fabricated sample (eval, prompt, seed, frame): distinct for every cell."""
    return (30 + 50 * p) % 256, (20 + 70 * s + 25 * frame) % 256, (10 + 90 * step_index) % 256


def fabricate_run(root: Path, name: str, *, prompts: list[str], seeds: list[int], steps: list[int],
                  video: bool = False, num_frames: int = 3, size: int = 16, scores_fn=None,
                  checkpoints: bool = True) -> Path:
    """runs/<name> in the trainer's layout: config.yaml, metrics.jsonl, checkpoints/, eval/base + eval/step_*.

    `scores_fn(step_index, p, s) -> {reward: value}`; per-prompt means, overall means and diversity are
    computed here with numpy (the report must show these numbers).
    """
    scores_fn = scores_fn or (lambda k, p, s: {TRAIN: 0.5 + 0.1 * k + 0.01 * p + 0.001 * s, GOLD: 0.9 - 0.05 * k - 0.02 * p})
    run = root / name
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"model:\n  path: toy\nrewards:\n  - name: {TRAIN}\neval:\n  gold_rewards: [{GOLD}]\n")
    with open(run / "metrics.jsonl", "w") as f:
        for step in range(1, max(steps) + 1):
            f.write(json.dumps({"step": step, "time": float(step), "train/loss": 1.0 / step, "train/kl": 0.01 * step,
                                f"reward/{TRAIN}/mean": 0.5 + 0.01 * step, f"reward/{TRAIN}/std": 0.05}) + "\n")
    for k, step in enumerate(steps):
        folder = run / "eval" / ("base" if step == 0 else f"step_{step:06d}")
        folder.mkdir(parents=True)
        if step and checkpoints:
            (run / "checkpoints" / folder.name).mkdir(parents=True)
        samples = []
        for p in range(len(prompts)):
            for j, seed in enumerate(seeds):
                stem = f"p{p:03d}_s{j:03d}"
                sample = {"prompt_index": p, "seed_index": j, "seed": seed, "scores": scores_fn(k, p, j)}
                if video:
                    frames = [Image.new("RGB", (size, size), colour(k, p, j, f)) for f in range(num_frames)]
                    strip = Image.new("RGB", (size * num_frames, size))
                    for f, frame in enumerate(frames):
                        strip.paste(frame, (f * size, 0))
                    strip.save(folder / f"{stem}_strip.png")
                    frames[0].save(folder / f"{stem}.gif", save_all=True, append_images=frames[1:], duration=125, loop=0)
                    sample.update(image=f"{stem}_strip.png", animation=f"{stem}.gif")
                else:
                    Image.new("RGB", (size, size), colour(k, p, j)).save(folder / f"{stem}.png")
                    sample["image"] = f"{stem}.png"
                samples.append(sample)
        names = list(samples[0]["scores"])
        per_prompt = {n: [float(np.mean([x["scores"][n] for x in samples if x["prompt_index"] == p])) for p in range(len(prompts))]
                      for n in names}
        diversity = [0.3 - 0.1 * k + 0.01 * p for p in range(len(prompts))]
        (folder / "scores.json").write_text(json.dumps({
            "format": "flowrl.eval/1", "step": step, "label": folder.name, "is_video": video, "prompts": prompts,
            "seeds": seeds, "metadata": [{} for _ in prompts],
            "rewards": {"train": [n for n in names if n == TRAIN], "gold": [n for n in names if n != TRAIN]},
            "samples": samples, "per_prompt": per_prompt,
            "means": {n: float(np.mean([x["scores"][n] for x in samples])) for n in names},
            "diversity": {"space": "pixel", "per_prompt": diversity, "mean": float(np.mean(diversity))},
        }))
    return run


class ChromiumPage:
    """One headless Chromium tab over CDP: load a file, collect console errors, evaluate JS, take a screenshot."""

    def __init__(self, binary: str, profile: Path):
        import websocket

        self.process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
             f"--user-data-dir={profile}", "--remote-debugging-port=0", "--remote-allow-origins=*",
             "--window-size=1400,1000", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.time() + 30
        while not (port_file.is_file() and port_file.read_text().strip()):
            if time.time() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port within 30 s")
            time.sleep(0.05)
        port = int(port_file.read_text().split()[0])
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10))
        page = next(t for t in targets if t["type"] == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=30, suppress_origin=True)
        self.next_id = 0
        self.events: list[dict[str, Any]] = []
        for method in ("Page.enable", "Runtime.enable", "Log.enable"):
            self.call(method)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(f"CDP {method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def open(self, path: Path, timeout: float = 60) -> None:
        self.events.clear()
        self.call("Page.navigate", url=path.resolve().as_uri())
        deadline = time.time() + timeout
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            if time.time() > deadline:
                raise RuntimeError(f"{path} did not finish loading in {timeout} s")
            self.events.append(json.loads(self.ws.recv()))

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"JS error: {result['exceptionDetails']}")
        return result["result"].get("value")

    def console_errors(self) -> list[str]:
        errors = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                errors.append(str(params.get("args")))
            elif method == "Runtime.exceptionThrown":
                errors.append(str(params.get("exceptionDetails")))
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                errors.append(params["entry"].get("text", ""))
        return errors

    def screenshot(self, path: Path) -> Path:
        import base64

        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=False)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()


@pytest.fixture(scope="session")
def chromium(tmp_path_factory):
    """A real headless Chromium (Debian's `chromium`, installed by .ci/run); one browser for the session."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip("Debian's chromium is not installed (apt-get install -y chromium; .ci/run does this)")
    pytest.importorskip("websocket", reason="websocket-client is in the test extra")
    page = ChromiumPage(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield page
    page.close()


# JS run inside the page: every <img> with its natural size, every number cell with its data attributes.
PAGE_FACTS = """(() => ({
  images: Array.from(document.images).map(i => ({w: i.naturalWidth, h: i.naturalHeight, complete: i.complete, alt: i.alt})),
  cells: Array.from(document.querySelectorAll('td.num[data-reward]')).map(td => ({...td.dataset, text: td.textContent})),
  gaps: Array.from(document.querySelectorAll('li.gap')).map(li => li.textContent),
  flags: Array.from(document.querySelectorAll('td[data-flag="1"]')).map(td => ({...td.dataset})),
  text: document.body.innerText,
}))()"""
