"""A generation request to a paused engine waits a bounded time, and one to an engine left mixed is refused.

vLLM queues a request that reaches a paused engine until it is resumed. A push pauses for a moment and the
request is answered after it; but an engine that a failed push left mixed stays paused (on purpose: it must
not serve half-updated weights) until a push makes it whole, and its requests hang until their clients give
up, with no word why. `BoundPausedRequests` (an ASGI middleware for vLLM's `--middleware`; `streamsync serve`
adds it) answers a generation request (`/v1/...`, `/inference/...`) that arrives while the engine is paused:

* weights mixed (a worker's version is "mixed:N"): 503 at once, saying which push failed and what ends it;
* otherwise it waits for the resume, at most `STREAMSYNC_PAUSED_REQUEST_TIMEOUT` seconds (default 300, the
  default round timeout), or less where the request's `X-Streamsync-Paused-Timeout` header asks, then 503.

A request that arrives while the engine serves is not delayed: whether it is paused is asked of the engine
core only after a `/pause` went through this server, until the engine answers that it is not.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Awaitable
from typing import Any

import anyio
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

TIMEOUT_ENV = "STREAMSYNC_PAUSED_REQUEST_TIMEOUT"
HEADER = "x-streamsync-paused-timeout"
#: paths of requests that generate (vLLM's OpenAI-compatible and inference routes)
GENERATING = ("/v1/", "/v2/", "/inference/", "/generate")
POLL = 0.01  # seconds between asking the engine core whether it still is paused
MIXED_EVERY = 1.0  # seconds between asking the workers whether their weights went mixed meanwhile


def _timeout(headers: Headers) -> float:
    try:
        limit = float(os.environ.get(TIMEOUT_ENV, "300"))
    except ValueError:
        limit = 300.0
    asked = headers.get(HEADER)
    if asked is not None:
        try:
            limit = min(limit, max(0.0, float(asked)))
        except ValueError:
            pass
    return limit if math.isfinite(limit) else 300.0


async def mixed_version(engine: Any) -> str | None:
    """A worker's "mixed:N" version where a failed push left its weights mixed, else None (also where the
    workers have no streamsync extension to ask)."""
    try:
        held = await engine.collective_rpc("streamsync_weight_version", timeout=10)
    except Exception:  # no streamsync worker extension, or the engine is going down: nothing to tell
        return None
    return next((str(v) for v in held or () if str(v).startswith("mixed:")), None)


def _refuse(message: str) -> JSONResponse:
    return JSONResponse(status_code=503, content={"error": {"message": message, "type": "ServiceUnavailableError",
                                                            "code": 503}})


class BoundPausedRequests:
    """The ASGI middleware (module doc). vLLM's `--middleware` adds a class with no arguments."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.pauses = 0  # /pause requests seen: the engine may be paused since the last one
        self.cleared = 0  # the `pauses` count when the engine last answered that it is not paused

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[Any]:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path == "/pause":
            self.pauses += 1
            return self.app(scope, receive, send)
        if self.pauses == self.cleared or not path.startswith(GENERATING):
            return self.app(scope, receive, send)
        return self._bounded(scope, receive, send)

    async def _bounded(self, scope: Scope, receive: Receive, send: Send) -> None:
        engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
        if engine is None:
            await self.app(scope, receive, send)
            return
        why = await self._paused_reason(engine, _timeout(Headers(scope=scope)))
        if why is not None:
            await _refuse(why)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _paused_reason(self, engine: Any, timeout: float) -> str | None:
        """None once the engine serves; why the request is refused otherwise."""
        seen = self.pauses
        if not await engine.is_paused():
            if self.pauses == seen:  # no /pause came in while asking
                self.cleared = seen
            return None
        start = time.monotonic()
        asked_mixed = -math.inf
        while True:
            now = time.monotonic()
            if now - asked_mixed >= MIXED_EVERY:
                asked_mixed = now
                mixed = await mixed_version(engine)
                if mixed is not None:
                    failed = mixed.removeprefix("mixed:") or "?"
                    return (f"the engine is paused with mixed weights: push v{failed} failed part-way, and the "
                            "engine serves again once a push makes it whole")
            if now - start >= timeout:
                return (f"the engine has been paused for a weight update for {now - start:.1f} s, longer than "
                        f"this request waits ({TIMEOUT_ENV} or the {HEADER} header)")
            await anyio.sleep(POLL)
            if not await engine.is_paused():
                return None
