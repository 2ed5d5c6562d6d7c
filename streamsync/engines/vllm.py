"""vLLM engine clients: in-process `vllm.LLM` / `vllm.AsyncLLM`, and `vllm serve` over HTTP.

All three speak the four phases with streamsync's plain-dict payloads wrapped as {"streamsync": ...},
which the `streamsync` backend (streamsync.vllm.backend) unwraps in every worker. Versions are vLLM's
strings; streamsync's integer versions travel as their decimal string.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import anyio

from ..errors import EngineError
from .base import Engine


def _version(v: object) -> int | None:
    return int(v) if isinstance(v, str) and v.isdigit() else (v if isinstance(v, int) else None)


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


def _tokens_and_logprobs(completion: Any) -> tuple[list[int], list[float]]:
    tokens = list(completion.token_ids)
    return tokens, [lp[t].logprob for t, lp in zip(tokens, completion.logprobs, strict=True)]


async def _quietly(call: Any) -> None:
    """Run an abort: an engine whose round already ended (vLLM ends it when an update raised) refuses
    `finish_weight_update`; that is the state an abort wants, so the refusal is not an error."""
    try:
        await call
    except EngineError:
        pass


def engine_kwargs(**extra: Any) -> dict[str, Any]:
    """Keyword arguments that make a vLLM engine receive through streamsync."""
    return {"weight_transfer_config": {"backend": "streamsync"},
            "worker_extension_cls": "streamsync.vllm.extension.StreamSyncWorkerExtension", **extra}


class _Guarded(Engine):
    timeout: float

    async def _run(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            with anyio.fail_after(self.timeout):
                return await fn(*args, **kw)
        except TimeoutError:
            raise EngineError(self.name, f"{what} timed out after {self.timeout:.1f}s") from None
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(self.name, f"{what} failed: {type(e).__name__}: {e}") from e

    async def weight_digests(self) -> dict[str, str]:
        """What the engine computes with, per vLLM parameter (first worker)."""
        return (await self.rpc("streamsync_weight_digests"))[0]

    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """HF name -> (dtype, shape) of the checkpoint the engine loaded (first worker), or None when the
        engine was started from something other than a local safetensors folder."""
        got = (await self.rpc("streamsync_expected_weights"))[0]
        return None if got is None else {n: (d, tuple(s)) for n, (d, s) in got.items()}

    async def clear_kv_cache(self) -> int:
        """Reset the prefix cache and zero the KV-cache memory of every worker; returns how many non-finite
        values it held. The recovery after weights holding NaN or inf were served (`check_finite=False`):
        requests served with them leave NaN in freed cache blocks, a block reused by a later request is read
        beyond its filled slots by the attention kernel (masked weight 0 x NaN = NaN), and the engine keeps
        answering NaN after good weights are back. Pause first (`sync.paused(mode="abort")` or "wait"): the
        memory of requests holding blocks would be wiped."""
        if not await self.reset_cache():
            raise EngineError(self.name, "cannot clear the KV cache while requests hold cache blocks: pause "
                              "with mode='abort' or 'wait' first")
        return sum(int(n) for n in await self.rpc("streamsync_zero_kv_cache"))

    async def packed_modules(self) -> dict[str, list[str]]:
        return (await self.rpc("streamsync_packed_modules"))[0]

    async def received_digests(self) -> dict[str, str]:
        return (await self.rpc("streamsync_received_digests"))[0]

    async def rpc(self, method: str) -> list[Any]:
        raise NotImplementedError


class VllmEngine(_Guarded):
    """An in-process `vllm.LLM`. Its calls block, so each runs in a worker thread (the loop stays free).

    Pause/resume map to `sleep(level=0, mode=...)` / `wake_up(tags=["scheduling"])` (LLM has no
    pause_generation); a level-0 sleep keeps the prefix cache, so clear_cache resets it explicitly.
    """

    def __init__(self, llm: Any, *, name: str = "vllm", timeout: float = 300.0) -> None:
        self.llm = llm
        self.name = name
        self.timeout = timeout
        self.device = _device()
        # vLLM's LLM is not thread-safe: one call at a time. The lock is held by the worker thread, so a call
        # abandoned on timeout keeps it until it really returns and the next call waits for that.
        self._lock = threading.Lock()

    async def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        def locked() -> Any:
            with self._lock:
                return fn(*args, **kw)

        async def go() -> Any:
            return await anyio.to_thread.run_sync(locked, abandon_on_cancel=True)

        return await self._run(what, go)

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self._call("init", self.llm.init_weight_transfer_engine, {"init_info": {"streamsync": init_info}})

    async def start_update(self) -> None:
        await self._call("start_weight_update", self.llm.start_weight_update)

    async def update(self, update_info: dict[str, Any]) -> None:
        await self._call("update_weights", self.llm.update_weights, {"update_info": {"streamsync": update_info}})

    async def finish_update(self, version: int) -> None:
        await self._call("finish_weight_update", self.llm.finish_weight_update, str(version))

    async def get_version(self) -> int | None:
        return _version(await self._call("get_weight_version", self.llm.get_weight_version))

    async def abort_update(self) -> None:
        await _quietly(self._call("finish_weight_update", self.llm.finish_weight_update))

    async def reset_cache(self) -> bool:
        return bool(await self._call("reset_prefix_cache", self.llm.reset_prefix_cache))

    async def greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        import vllm

        params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)
        outs = await self._call("generate", self.llm.generate, [{"prompt_token_ids": list(prompt_ids)}], params,
                                use_tqdm=False)
        return _tokens_and_logprobs(outs[0].outputs[0])

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self._call("pause", self.llm.sleep, level=0, mode=mode)
        if clear_cache:
            await self._call("reset_prefix_cache", self.llm.reset_prefix_cache)

    async def resume(self) -> None:
        await self._call("resume", self.llm.wake_up, tags=["scheduling"])

    async def rpc(self, method: str) -> list[Any]:
        return await self._call(method, self.llm.collective_rpc, method)


class AsyncVllmEngine(_Guarded):
    """An in-process `vllm.AsyncLLM` (natively async)."""

    def __init__(self, engine: Any, *, name: str = "async-vllm", timeout: float = 300.0) -> None:
        self.engine = engine
        self.name = name
        self.timeout = timeout
        self.device = _device()

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        req = WeightTransferInitRequest(init_info={"streamsync": init_info})
        await self._run("init", self.engine.init_weight_transfer_engine, req)

    async def start_update(self) -> None:
        await self._run("start_weight_update", self.engine.start_weight_update)

    async def update(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        req = WeightTransferUpdateRequest(update_info={"streamsync": update_info})
        await self._run("update_weights", self.engine.update_weights, req)

    async def finish_update(self, version: int) -> None:
        await self._run("finish_weight_update", self.engine.finish_weight_update, str(version))

    async def get_version(self) -> int | None:
        return _version(await self._run("get_weight_version", self.engine.get_weight_version))

    async def abort_update(self) -> None:
        await _quietly(self._run("finish_weight_update", self.engine.finish_weight_update))

    async def reset_cache(self) -> bool:
        return bool(await self._run("reset_prefix_cache", self.engine.reset_prefix_cache))

    async def greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        import uuid

        import vllm

        params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=1)

        async def go() -> Any:
            last = None
            async for out in self.engine.generate({"prompt_token_ids": list(prompt_ids)}, params,
                                                  request_id=f"streamsync-verify-{uuid.uuid4().hex[:8]}"):
                last = out
            return last

        out = await self._run("generate", go)
        return _tokens_and_logprobs(out.outputs[0])

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self._run("pause", self.engine.pause_generation, mode=mode, clear_cache=clear_cache)

    async def resume(self) -> None:
        await self._run("resume", self.engine.resume_generation)

    async def rpc(self, method: str) -> list[Any]:
        return await self._run(method, self.engine.collective_rpc, method)


class VllmHttpEngine(_Guarded):
    """`vllm serve` started with VLLM_SERVER_DEV_MODE=1 and `--weight-transfer-config '{"backend":"streamsync"}'`.

    `api_key`: sent as `Authorization: Bearer <key>` on every request (a server started with `--api-key` and
    `--middleware streamsync.vllm.auth.RequireApiKey` refuses the weight-transfer routes without it)."""

    def __init__(self, url: str, *, name: str | None = None, timeout: float = 300.0, device: str = "cpu",
                 api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.name = name or self.url
        self.timeout = timeout
        self.device = device
        self._session: Any = None

    async def _http(self, method: str, path: str, *, json: Any = None, params: dict | None = None) -> Any:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout),
                                                  headers=self._headers)

        async def go() -> Any:
            try:
                async with self._session.request(method, self.url + path, json=json, params=params) as r:
                    body = await r.text()
                    if r.status >= 400:
                        raise EngineError(self.name, f"{method} {path} -> HTTP {r.status}: {body[:500]}")
                    return (await r.json(content_type=None)) if body else None
            except aiohttp.ClientConnectionError as e:
                raise EngineError(self.name, f"{method} {path}: cannot reach server ({e})") from e

        return await self._run(f"{method} {path}", go)

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self._http("POST", "/init_weight_transfer_engine", json={"init_info": {"streamsync": init_info}})

    async def start_update(self) -> None:
        await self._http("POST", "/start_weight_update")

    async def update(self, update_info: dict[str, Any]) -> None:
        await self._http("POST", "/update_weights", json={"update_info": {"streamsync": update_info}})

    async def finish_update(self, version: int) -> None:
        await self._http("POST", "/finish_weight_update", json={"weight_version": str(version)})

    async def get_version(self) -> int | None:
        return _version((await self._http("GET", "/weight_info"))["weight_version"])

    async def abort_update(self) -> None:
        await _quietly(self._http("POST", "/finish_weight_update"))

    async def reset_cache(self) -> bool:
        return bool((await self._http("POST", "/reset_prefix_cache") or {}).get("success", False))

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

    async def rpc(self, method: str) -> list[Any]:
        return (await self._http("POST", "/collective_rpc", json={"method": method}))["results"]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
