"""A real headless Chromium tab driven over the DevTools protocol (CDP) with websocket-client."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any


class ChromiumPage:
    """One headless Chromium tab over CDP: load a file, collect console errors, evaluate JS, take a screenshot."""

    def __init__(self, binary: str, profile: Path):
        import websocket

        self.process = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                "--disable-extensions",
                "--disable-dev-shm-usage",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "--remote-allow-origins=*",
                "--window-size=1400,1000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
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
        for method in ("Page.enable", "Runtime.enable", "Log.enable", "Network.enable"):
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

    def requested_urls(self) -> list[str]:
        """Every URL the page asked the network stack for since it was opened (data: URIs included)."""
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

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


# JS run inside the page: every <img> with its natural size, every number cell with its data attributes.
PAGE_FACTS = """(() => ({
  images: Array.from(document.images).map(i => ({
    w: i.naturalWidth, h: i.naturalHeight, complete: i.complete, alt: i.alt,
  })),
  cells: Array.from(document.querySelectorAll('td.num[data-reward]'))
    .map(td => ({...td.dataset, text: td.textContent})),
  gaps: Array.from(document.querySelectorAll('li.gap')).map(li => li.textContent),
  flags: Array.from(document.querySelectorAll('td[data-flag="1"]')).map(td => ({...td.dataset})),
  text: document.body.innerText,
}))()"""
