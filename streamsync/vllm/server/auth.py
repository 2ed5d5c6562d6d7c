"""`vllm serve --api-key` for every route, not only the OpenAI ones.

vLLM's own AuthenticationMiddleware checks the key only under /v1, /v2, /inference and /cohere. The routes
streamsync drives (VLLM_SERVER_DEV_MODE=1: /init_weight_transfer_engine, /start_weight_update,
/update_weights, /finish_weight_update, /pause, /resume, /is_paused, /weight_info, /collective_rpc,
/reset_prefix_cache, ...) answer without it: anyone who can reach the port could load weights, pause the
engine or run worker methods. `RequireApiKey` asks for the same key on every path except the health and
metrics probes (deny by default, so a route vLLM adds later is covered too). Install it with

    vllm serve ... --api-key KEY --middleware streamsync.vllm.server.auth.RequireApiKey

(`VllmServer` always adds it). Without a key configured it lets everything through, as vLLM does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Awaitable
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

#: Paths answered without the key: liveness/readiness probes and Prometheus scraping (vLLM leaves these open).
OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class RequireApiKey(AuthenticationMiddleware):
    """vLLM's bearer-token check (sha256 of each key, `secrets.compare_digest`), on every path but OPEN_PATHS.

    vLLM's `--middleware` adds a class with no arguments, so the keys are read at the first request from
    the app's parsed arguments (`--api-key`, or VLLM_API_KEY), the same source vLLM's own check uses."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.api_tokens: list[bytes] | None = None  # type: ignore[assignment]  # read at the first request

    def _tokens(self, scope: Scope) -> list[bytes]:
        from vllm import envs

        args = getattr(getattr(scope.get("app"), "state", None), "args", None)
        keys = [k for k in (getattr(args, "api_key", None) or [envs.VLLM_API_KEY]) if k]
        return [hashlib.sha256(k.encode()).digest() for k in keys]

    def __call__(self, scope: Scope, receive: Receive, send: Send) -> Awaitable[Any]:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return self.app(scope, receive, send)
        if self.api_tokens is None:
            self.api_tokens = self._tokens(scope)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self.api_tokens and path not in OPEN_PATHS and not self.verify_token(Headers(scope=scope)):
            return JSONResponse(content={"error": "Unauthorized"}, status_code=401)(scope, receive, send)
        return self.app(scope, receive, send)
