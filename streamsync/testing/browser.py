"""Headless Chromium driven over the DevTools protocol, for tests of the trace viewer.

Only aiohttp (already a dependency) speaks the protocol: no playwright, no downloaded browser. The browser
is Debian's `chromium`; `ensure_chromium` installs it with apt-get where it is missing and we may (root).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

# Without the background-networking flags Chromium stalls on refused connections in sandboxes with no network.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--remote-debugging-port=0"]


def ensure_chromium() -> tuple[str | None, str]:
    """The chromium executable, installing Debian's package when missing (as root); else None and why."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path, ""
    if not shutil.which("apt-get"):
        return None, "chromium is not installed and there is no apt-get to install it"
    if os.geteuid() != 0:
        return None, "chromium is not installed; installing it needs root (apt-get install chromium)"
    r = subprocess.run("apt-get update -qq && apt-get install -y -qq chromium", shell=True, capture_output=True,
                       text=True, timeout=900, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    path = shutil.which("chromium")
    return (path, "") if path else (None, f"apt-get install chromium failed: {r.stderr.strip()[-300:]}")


class Page:
    """One tab: evaluate JavaScript, wait for a condition, take a screenshot."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self._ids = itertools.count(1)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        while True:  # events arrive in between; this client needs none of them
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def eval(self, expression: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression!r} raised: {r['exceptionDetails']}")
        return r["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 30.0) -> Any:
        """Poll `expression` until it is truthy; its value."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            value = await self.eval(expression)
            if value:
                return value
            if loop.time() > deadline:
                raise TimeoutError(f"page never satisfied {expression!r}")
            await asyncio.sleep(0.05)

    async def goto(self, url: str, ready: str = "document.body && document.body.dataset.state") -> None:
        await self.call("Page.navigate", url=url)
        await self.wait_for(f"location.href === {json.dumps(url)} && ({ready})")

    async def screenshot(self, path: str | os.PathLike) -> Path:
        """A PNG of the whole page (as tall as its content)."""
        height = int(await self.eval("document.documentElement.scrollHeight"))
        width = int(await self.eval("window.innerWidth"))
        r = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                            clip={"x": 0, "y": 0, "width": width, "height": height, "scale": 1})
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(base64.b64decode(r["data"]))
        return p


class Browser:
    """A headless Chromium process; `async with Browser(path) as b: page = await b.page()`."""

    def __init__(self, executable: str, width: int = 1280, height: int = 800) -> None:
        self.executable, self.width, self.height = executable, width, height
        self._proc: subprocess.Popen | None = None
        self._session: aiohttp.ClientSession | None = None
        self._profile: tempfile.TemporaryDirectory | None = None
        self._pages: list[Page] = []

    async def __aenter__(self) -> Browser:
        # Chromium's helper processes may still write to the profile as the browser exits
        self._profile = tempfile.TemporaryDirectory(prefix="streamsync-chromium-", ignore_cleanup_errors=True)
        self._proc = subprocess.Popen([self.executable, *FLAGS, f"--user-data-dir={self._profile.name}",
                                       f"--window-size={self.width},{self.height}", "about:blank"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self._profile.name) / "DevToolsActivePort"
        for _ in range(600):  # the browser writes its port once it listens
            if port_file.exists() and len(port_file.read_text().splitlines()) >= 2:
                break
            if self._proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self._proc.returncode} before it listened")
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError("chromium did not open its DevTools port in 30 s")
        self.port = int(port_file.read_text().splitlines()[0])
        self._session = aiohttp.ClientSession()
        return self

    async def page(self) -> Page:
        """A new tab of the browser's window size."""
        assert self._session is not None
        async with self._session.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = await r.json()
        ws = await self._session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        page = Page(ws)
        await page.call("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                        deviceScaleFactor=1, mobile=False)
        self._pages.append(page)
        return page

    async def __aexit__(self, *exc: object) -> None:
        for p in self._pages:
            await p.ws.close()
        if self._session is not None:
            await self._session.close()
        if self._proc is not None:  # the browser and its helper processes: its own session's group
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self._proc.pid, sig)
                    self._proc.wait(timeout=10)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self._profile is not None:
            self._profile.cleanup()
