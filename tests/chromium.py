"""A small headless-Chromium driver over the DevTools protocol, for the report's
browser tests, ``benchmarks/report_load.py`` and docs/report.png
(``python -m tests.chromium RUN/report.html -o docs/report.png --scale 0.75``).

Chromium is started with ``--remote-debugging-pipe``: it reads commands on file
descriptor 3 and writes replies and events on 4, each a JSON message ended by a NUL
byte. No websocket, no third-party client, no port to find: the pipe belongs to
this process alone. One page (a target attached in flat mode), at a fixed window
size; console messages and uncaught exceptions are collected in :attr:`errors`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

BINARY = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


class ChromiumError(RuntimeError):
    pass


class Chromium:
    """One headless Chromium with one page; use as a context manager."""

    def __init__(
        self, profile: Path, width: int = 1400, height: int = 900, timeout: float = 60.0
    ) -> None:
        if BINARY is None:
            raise ChromiumError("chromium is not installed")
        self.timeout = timeout
        self.width, self.height = width, height
        to_child, self._out = os.pipe()
        self._in, from_child = os.pipe()

        def wire() -> None:  # in the child, before exec: the pipe on fds 3 and 4
            os.dup2(to_child, 3)
            os.dup2(from_child, 4)

        args = [
            BINARY, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--remote-debugging-pipe", "--no-first-run", "--no-default-browser-check",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args,
            preexec_fn=wire,
            # kept open past the child's close_fds, which runs after preexec_fn
            pass_fds=(3, 4, to_child, from_child),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_child)
        os.close(from_child)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []
        self.errors: list[str] = []
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        self.session = attached["sessionId"]
        for method in ("Page.enable", "Runtime.enable"):
            self.send(method, session=self.session)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=self.session,
        )

    # ------------------------------------------------------------------ protocol

    def _read_message(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise ChromiumError("chromium did not answer in time")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise ChromiumError("chromium closed the pipe")
            self._buffer += chunk
        raw, _, self._buffer = self._buffer.partition(b"\0")
        message: dict[str, Any] = json.loads(raw)
        if "method" in message:
            self._note(message)
        return message

    def _note(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        params = event.get("params") or {}
        if event["method"] == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails") or {}
            text = (details.get("exception") or {}).get("description") or details.get("text")
            self.errors.append(f"exception: {text}")
        elif event["method"] == "Runtime.consoleAPICalled":
            args = " ".join(str(a.get("value", a.get("description"))) for a in params["args"])
            self.errors.append(f"console.{params.get('type')}: {args}")

    def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        """Send one command and wait for its reply (events meanwhile are kept)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise ChromiumError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply.get("result", {})
                return result

    def wait_for(self, method: str) -> dict[str, Any]:
        """The next event ``method`` of the page (already received ones first)."""
        deadline = time.monotonic() + self.timeout
        while True:
            for index, event in enumerate(self.events):
                if event["method"] == method and event.get("sessionId") == self.session:
                    del self.events[index]
                    return event
            self._read_message(deadline)

    # ------------------------------------------------------------------ the page

    def open(self, url: str) -> float:
        """Load ``url``; returns the wall seconds from the navigation to its load event."""
        self.events = [e for e in self.events if e["method"] != "Page.loadEventFired"]
        start = time.perf_counter()
        self.send("Page.navigate", {"url": url}, session=self.session)
        self.wait_for("Page.loadEventFired")
        return time.perf_counter() - start

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        reply = self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
            session=self.session,
        )
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            raise ChromiumError(
                f"{expression[:60]}: {(details.get('exception') or {}).get('description')}"
            )
        return reply["result"].get("value")

    def screenshot(self, path: Path, full_page: bool = False, scale: float = 1.0) -> Path:
        """A PNG of the viewport (or the whole page, at the window's width), scaled."""
        params: dict[str, Any] = {"format": "png"}
        height = self.height
        if full_page:
            height = int(self.evaluate("document.documentElement.scrollHeight"))
            params["captureBeyondViewport"] = True
        if full_page or scale != 1.0:
            params["clip"] = {"x": 0, "y": 0, "width": self.width, "height": height, "scale": scale}
        data = self.send("Page.captureScreenshot", params, session=self.session)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        with contextlib.suppress(ChromiumError, OSError):
            self.send("Browser.close")
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._out)
        os.close(self._in)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> None:
    """``python -m tests.chromium PAGE -o PNG``: a full-page screenshot at 1400 px."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("page", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--width", type=int, default=1400)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--viewport", action="store_true", help="only the first screen")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as profile, Chromium(Path(profile), args.width) as page:
        page.open(args.page.resolve().as_uri())
        page.screenshot(args.output, full_page=not args.viewport, scale=args.scale)
        if page.errors:
            raise SystemExit(f"the page logged errors: {page.errors}")


if __name__ == "__main__":
    main()
