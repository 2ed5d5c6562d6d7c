"""`vllm serve` over HTTP (`VllmHttpEngine`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ...errors import EngineError, EngineUnreachable
from ..base import EngineState, parse_version
from .round import VllmClient


class VllmHttpEngine(VllmClient):
    """`vllm serve` started with VLLM_SERVER_DEV_MODE=1 and `--weight-transfer-config '{"backend":"streamsync"}'`.

    `api_key`: sent as `Authorization: Bearer <key>` on every request (a server started with `--api-key` and
    `--middleware streamsync.vllm.server.auth.RequireApiKey` refuses the weight-transfer routes without it)."""

    open_with_first_update = end_with_last_update = True

    def __init__(self, url: str, *, name: str | None = None, timeout: float = 300.0, device: str = "cpu",
                 api_key: str | None = None, fast_path: bool = True) -> None:
        self.url = url.rstrip("/")
        self.fast_path = fast_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = name or self.url
        self.timeout = timeout
        self.device = device
        self._session: Any = None

    def session(self) -> Any:
        """The aiohttp session of every request to the server (the api key in its headers, `timeout` per
        request unless a request sets its own), made on first use."""
        import aiohttp

        if self._session is None:
            # A connection per request: vLLM's server (uvicorn) closes idle connections and the one that served
            # an error, and a pooled connection it closed fails the next request ("Server disconnected",
            # "Connection reset by peer") with no way to tell whether that request ran
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                  headers=self.headers,
                                                  connector=aiohttp.TCPConnector(force_close=True))
        return self._session

    async def served_model(self) -> str:
        """The model id the server serves (/v1/models), the `model` of completion requests."""
        return (await self._http("GET", "/v1/models"))["data"][0]["id"]

    async def _http(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        import aiohttp

        session = self.session()

        async def go() -> Any:
            try:
                async with session.request(method, self.url + path, json=json, params=params) as r:
                    body = await r.text()
                    if r.status >= 400:
                        raise EngineError(self.name, f"{method} {path} -> HTTP {r.status}: {body[:500]}")
                    return (await r.json(content_type=None)) if body else None
            except aiohttp.ClientConnectionError as e:
                raise EngineUnreachable(self.name, f"{method} {path}: cannot reach server ({e})") from e

        return await self._run(f"{method} {path}", go)

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self._http("POST", "/init_weight_transfer_engine",
                         json={"init_info": {"streamsync": self._init_info(init_info)}})

    async def _start(self) -> None:
        await self._http("POST", "/start_weight_update")

    async def _update(self, update_info: dict[str, Any]) -> None:
        await self._http("POST", "/update_weights", json={"update_info": {"streamsync": update_info}})

    async def _vllm_finish(self, version: str | None) -> None:
        # vLLM 0.25's route reads no body (a version sent would be dropped): send one only with a version
        await self._http("POST", "/finish_weight_update", json=None if version is None else {"weight_version": version})

    async def _vllm_set_version(self, version: str) -> None:
        await self._http("POST", "/update_weight_version", json={"new_version": version})

    async def _vllm_version(self) -> str:
        return (await self._http("GET", "/weight_info"))["weight_version"]

    async def _dead(self) -> str | None:
        """/health answers 503 once the engine core died; a refused connection means the server is gone.
        A slow answer is not death (a busy server): only a definite answer counts."""
        import aiohttp

        try:
            async with self._session.get(self.url + "/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                return None if r.status == 200 else f"/health answered HTTP {r.status}"
        except aiohttp.ClientConnectionError as e:
            return f"server unreachable: {e}"
        except TimeoutError:
            return None

    async def reset_cache(self) -> bool:
        # vLLM 0.32 answers {"success": bool}. 0.25 answers an empty 200 whatever happened (its route does not
        # check): unconfirmed, so False, and clear_kv_cache refuses rather than wipe blocks a request may hold.
        got = await self._http("POST", "/reset_prefix_cache")
        return bool(got.get("success", False)) if isinstance(got, dict) else False

    async def greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        model = (await self._http("GET", "/v1/models"))["data"][0]["id"]
        body = {"model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0,
                "logprobs": 1, "return_tokens_as_token_ids": True}
        lp = (await self._http("POST", "/v1/completions", json=body))["choices"][0]["logprobs"]
        # With return_tokens_as_token_ids each token reads "token_id:<id>".
        return [int(t.rsplit(":", 1)[1]) for t in lp["tokens"]], [float(x) for x in lp["token_logprobs"]]

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self._http("POST", "/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    async def resume(self) -> None:
        await self._http("POST", "/resume")

    async def is_paused(self) -> bool:
        return bool((await self._http("GET", "/is_paused"))["is_paused"])

    async def state(self) -> EngineState:
        held = parse_version(await self._raw_version())
        return EngineState(held.version, held.mixed, held.failed_version, held.updating, await self.is_paused())

    async def _rpc(self, method: str, *args: Any, **kwargs: str) -> list[Any]:
        body: dict[str, Any] = {"method": method}
        if args:
            # the route passes string arguments only: a dict (a fused update's chunk) goes as JSON
            body["args"] = [json.dumps(a) if isinstance(a, dict) else str(a) for a in args]
        if kwargs:
            body["kwargs"] = {k: str(v) for k, v in kwargs.items()}
        return (await self._http("POST", "/collective_rpc", json=body))["results"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
