"""In-process engines: `vllm.LLM` (its blocking calls in the engine's own thread, `_Caller`) and `vllm.AsyncLLM`."""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio

from ...errors import EngineError
from ...vllm.patches import wrap_method
from ..base import DISPATCHED
from .round import _LIVENESS_S, VllmClient, _device, _tokens_and_logprobs

#: seconds an engine's call thread waits for the next call before it ends
_IDLE_S = 60.0


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # another anyio backend (trio)
        return False
    return True


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody waits for this
        pass


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if not fut.done():  # a caller that gave up (timeout, cancellation) cancelled it
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


_sending = threading.local()  # `fire`: what a call thread runs once its request went out (`_watch_sends`)


def _watch_sends(llm: Any) -> bool:
    """Make the `LLM`'s engine-core client say when a request has left (`engines.base.DISPATCHED`): its class's
    `_send_input` (vLLM's multiprocess client; the request is on its socket when it returns) runs the calling
    thread's `_sending.fire` after it, which only an engine's call thread sets. The class, not the instance: a
    wrapper held by the client would keep it alive past `del llm` (vLLM shuts its engine core down when the
    client is freed). False where the client has none (the engine core in this process: a call is then
    dispatched once its thread starts it)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if client is None:
        return False

    def make(send: Callable[..., Any]) -> Callable[..., Any]:
        def send_input(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = send(self, *args, **kwargs)
            fire = getattr(_sending, "fire", None)
            if fire is not None:
                _sending.fire = None
                fire()
            return out
        return send_input

    return wrap_method(type(client), "_send_input", make)


class _Caller:
    """The thread that makes an in-process `LLM`'s blocking calls, one at a time, each answered on its caller's
    event loop (asyncio).

    A push makes one or two calls into the engine, and each came back later than a bare call by most of a
    millisecond when it went through a worker-thread pool, a task group and a watcher task per call (on the H200
    host: 1.1-1.6 ms against 0.45-0.76 ms straight from a thread). Here a call is a queue put, a future and a
    timed wait: the wait wakes every `_LIVENESS_S` to ask whether the engine died (a killed engine core leaves
    vLLM's pending call waiting forever), and ends at the engine's timeout. A call given up on keeps running in
    the thread (vLLM calls cannot be interrupted); the calls after it wait their turn, as they did for the lock.
    The thread ends after `_IDLE_S` without a call, so engine clients a program is done with leave none behind.
    A call made under `DISPATCHED` reports on its loop when its request left: from the client's send where it is
    watched (`_watch_sends`), else as the thread starts it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.watched = False  # the engine's client says when a request left (`_watch_sends`)
        self._queue: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], Any, Any]] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def _serve(self) -> None:
        while True:
            try:
                loop, fut, fn, gone = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:  # idle: the thread ends (a later call starts another)
                with self._start_lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            if gone is not None:
                fire = functools.partial(_threadsafe, loop, gone)
                if self.watched:
                    _sending.fire = fire
                else:
                    fire()
            try:
                result, error = fn(), None
            except BaseException as e:  # handed to the caller, whatever it is
                result, error = None, e
            _sending.fire = None
            _threadsafe(loop, _settle, fut, result, error)
            del loop, fut, fn, gone, result, error  # keep nothing of a served call while idle

    async def call(self, engine: VllmClient, what: str, fn: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._start_lock:  # a thread ending idle checks the queue under this lock: the call is served
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._thread.start()
            self._queue.put((loop, fut, fn, DISPATCHED.get()))
        deadline = loop.time() + engine.timeout
        try:
            while not fut.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise EngineError(engine.name, f"{what}: no reply in {engine.timeout:.1f} s")
                await asyncio.wait((fut,), timeout=min(_LIVENESS_S, left))
                if not fut.done():
                    why = await engine._dead()
                    if why:
                        raise EngineError(engine.name, f"{what} failed: engine process exited ({why})")
        except BaseException:
            fut.cancel()
            raise
        try:
            return fut.result()
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(engine.name, f"{what} failed: {type(e).__name__}: {e}") from e


class VllmEngine(VllmClient):
    """An in-process `vllm.LLM`. Its calls block, so each runs in the engine's own thread (`_Caller`; the loop
    stays free).

    Pause/resume map to `sleep(level=0, mode=...)` / `wake_up(tags=["scheduling"])` (LLM has no
    pause_generation); a level-0 sleep keeps the prefix cache, so clear_cache resets it explicitly.
    """

    in_process = True
    open_with_first_update = end_with_last_update = True
    signals_dispatch = True

    def __init__(self, llm: Any, *, name: str = "vllm", timeout: float = 300.0, fast_path: bool = True) -> None:
        self.llm = llm
        self.fast_path = fast_path
        self.name = name
        self.timeout = timeout
        self.device = _device()
        # vLLM's LLM is not thread-safe: one call at a time. The lock is held by the thread making the call, so a
        # call abandoned on timeout keeps it until it really returns and the next call waits for that.
        self._lock = threading.Lock()
        self._caller = _Caller(f"streamsync-{name}")
        self._caller.watched = _watch_sends(llm)

    async def _call(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        def locked() -> Any:
            with self._lock:
                return fn(*args, **kw)

        if _on_asyncio():
            return await self._caller.call(self, what, locked)
        gone = DISPATCHED.get()
        if gone is not None:  # the thread below starts it at once
            gone()

        async def go() -> Any:
            return await anyio.to_thread.run_sync(locked, abandon_on_cancel=True)

        return await self._run(what, go)

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self._call("init", self.llm.init_weight_transfer_engine,
                         {"init_info": {"streamsync": self._init_info(init_info)}})

    async def _start(self) -> None:
        await self._call("start_weight_update", self.llm.start_weight_update)

    async def _update(self, update_info: dict[str, Any]) -> None:
        await self._call("update_weights", self.llm.update_weights, {"update_info": {"streamsync": update_info}})

    async def _vllm_finish(self, version: str | None) -> None:
        args = () if version is None else (version,)  # vLLM 0.25's finish takes none
        await self._call("finish_weight_update", self.llm.finish_weight_update, *args)

    async def _vllm_set_version(self, version: str) -> None:
        await self._call("update_weight_version", self.llm.update_weight_version, version)

    async def _vllm_version(self) -> str:
        return await self._call("get_weight_version", self.llm.get_weight_version)

    async def _dead(self) -> str | None:
        resources = getattr(getattr(self.llm.llm_engine, "engine_core", None), "resources", None)
        return "vLLM engine core is dead" if getattr(resources, "engine_dead", False) else None

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

    async def _rpc(self, method: str, *args: Any, **kwargs: str) -> list[Any]:
        return await self._call(method, self.llm.collective_rpc, method, args=args, kwargs=kwargs or None)


class AsyncVllmEngine(VllmClient):
    """An in-process `vllm.AsyncLLM` (natively async)."""

    in_process = True
    open_with_first_update = end_with_last_update = True

    def __init__(self, engine: Any, *, name: str = "async-vllm", timeout: float = 300.0,
                 fast_path: bool = True) -> None:
        self.engine = engine
        self.fast_path = fast_path
        self.name = name
        self.timeout = timeout
        self.device = _device()

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        req = WeightTransferInitRequest(init_info={"streamsync": self._init_info(init_info)})
        await self._run("init", self.engine.init_weight_transfer_engine, req)

    async def _start(self) -> None:
        await self._run("start_weight_update", self.engine.start_weight_update)

    async def _update(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        req = WeightTransferUpdateRequest(update_info={"streamsync": update_info})
        await self._run("update_weights", self.engine.update_weights, req)

    async def _vllm_finish(self, version: str | None) -> None:
        args = () if version is None else (version,)  # vLLM 0.25's finish takes none
        await self._run("finish_weight_update", self.engine.finish_weight_update, *args)

    async def _vllm_set_version(self, version: str) -> None:
        await self._run("update_weight_version", self.engine.update_weight_version, version)

    async def _vllm_version(self) -> str:
        return await self._run("get_weight_version", self.engine.get_weight_version)

    async def _dead(self) -> str | None:
        return "vLLM engine core is dead" if self.engine.errored else None

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

    async def _rpc(self, method: str, *args: Any, **kwargs: str) -> list[Any]:
        return await self._run(method, self.engine.collective_rpc, method, args=args, kwargs=kwargs or None)
