"""The one middleware `streamsync serve` gives vLLM (its `--middleware` takes one import path per flag, and a
repeated flag warns): the API key on every route (`auth.RequireApiKey`, outermost: nothing answers before it)
around bounded waits for a paused engine (`paused.BoundPausedRequests`). Plain `vllm serve` takes it as

    vllm serve ... --middleware streamsync.vllm.middleware.Serve
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from .auth import RequireApiKey
from .paused import BoundPausedRequests


class Serve:
    def __init__(self, app: ASGIApp) -> None:
        self.app = RequireApiKey(BoundPausedRequests(app))

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[Any]:
        return self.app(scope, receive, send)
