"""A headless Chromium driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: JSON messages
ending in NUL on fds 3 and 4), so the tests need no websocket library, no driver download and no port."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return os.environ.get("CKPT_ENGINE_CHROMIUM") or next(filter(None, map(shutil.which, CANDIDATES)), None)


class BrowserError(RuntimeError):
    pass


class Browser:
    """One browser; :meth:`tab` opens a page in it. Every wait is bounded."""

    def __init__(self, binary: str, timeout_s: float = 30) -> None:
        self.timeout_s = timeout_s
        self._profile = tempfile.TemporaryDirectory(prefix="ckpt-chromium-")
        to_browser, self._write = os.pipe()
        self._read, from_browser = os.pipe()
        args = [binary, "--headless=new", "--remote-debugging-pipe", f"--user-data-dir={self._profile.name}",
                "--no-first-run", "--no-default-browser-check", "--disable-gpu", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--hide-scrollbars", "--mute-audio", "about:blank"]
        if os.geteuid() == 0:  # Chromium refuses to run as root with its sandbox
            args.insert(1, "--no-sandbox")

        def pipes_as_3_and_4() -> None:
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        self.proc = subprocess.Popen(args, pass_fds=(3, 4), preexec_fn=pipes_as_3_and_4,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser)
        os.close(from_browser)
        self._next = 0
        self._replies: dict[int, dict] = {}
        self._arrived = threading.Condition()
        threading.Thread(target=self._reader, daemon=True).start()
        self.send("Browser.getVersion")

    def _reader(self) -> None:
        pending = b""
        while chunk := os.read(self._read, 1 << 16):
            pending += chunk
            *messages, pending = pending.split(b"\0")
            for raw in messages:
                message = json.loads(raw)
                if "id" in message:
                    with self._arrived:
                        self._replies[message["id"]] = message
                        self._arrived.notify_all()

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self._next += 1
        ident = self._next
        message = {"id": ident, "method": method, "params": params or {}, **({"sessionId": session} if session else {})}
        os.write(self._write, json.dumps(message).encode() + b"\0")
        with self._arrived:
            if not self._arrived.wait_for(lambda: ident in self._replies, self.timeout_s):
                raise BrowserError(f"no reply to {method} within {self.timeout_s}s")
            reply = self._replies.pop(ident)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error']}")
        return reply["result"]

    def tab(self, width: int = 1400, height: int = 900) -> Tab:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        tab = Tab(self, session)
        tab.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1,
                                                        "mobile": False})
        return tab

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (BrowserError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._profile.cleanup()


class Tab:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def call(self, method: str, params: dict | None = None) -> dict:
        return self.browser.send(method, params, self.session)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        reply = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in reply:
            raise BrowserError(f"{expression[:80]}: {reply['exceptionDetails'].get('text')}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 20, what: str | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                value = self.evaluate(f"Boolean({expression})")  # a DOM node comes back as {}: falsy
            except BrowserError:  # the page is still loading
                value = None
            if value:
                return
            time.sleep(0.1)
        shown = self.evaluate("document.body ? document.body.innerText.slice(0, 600) : ''")
        raise BrowserError(f"{what or expression} not true within {timeout_s}s; the page shows: {shown!r}")

    def screenshot(self) -> bytes:
        """The whole page, not only the viewport."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        shot = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": {
            "x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}})
        return base64.b64decode(shot["data"])
