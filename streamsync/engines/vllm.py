"""vLLM engine clients: in-process `vllm.LLM` / `vllm.AsyncLLM`, and `vllm serve` over HTTP.

All three speak the four phases with streamsync's plain-dict payloads wrapped as {"streamsync": ...},
which the `streamsync` backend (streamsync.vllm.backend) unwraps in every worker. Versions are vLLM's
strings; streamsync's integer versions travel as their decimal string, and an engine a failed push left
holding part of version N's weights reports "mixed:N" (`state().mixed`; `get_version()` is then None).

One client serves vLLM 0.25.x and 0.32+. At connect (`locate`) each asks the engine's worker once what its
vLLM is (`vllm_info`): a version outside `streamsync.vllm.compat.SUPPORTED` is refused there, naming it; where
vLLM keeps the weight version (0.32+) the client commits and reads it through vLLM (`finish_weight_update(v)`,
`get_weight_version`), and where it keeps none (0.25.x) through the version the streamsync workers keep
(`streamsync_weight_version`, committed by the round's finish, marks set with `streamsync_set_weight_version`).

Every call is raced against a liveness check from its first second on: a killed engine core leaves vLLM's
pending call waiting forever, so without it a dead engine would be reported only at the timeout.
"""

from __future__ import annotations

import asyncio
import functools
import json
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import EngineError, EngineUnreachable
from ..log import get_logger
from ..message import UpdateMessage, wire
from ..owners import describe, superseded
from ..plan.shards import Box, EngineLayout, Need
from ..vllm import compat, core_rpc
from ..vllm.answers import WORKER_ERROR
from ..vllm.compat import VllmInfo
from .base import DISPATCHED, MIXED, Declined, Engine, EngineState, parse_version

if TYPE_CHECKING:
    import torch

#: seconds a call runs before its engine's liveness is checked, then the interval between checks
_LIVENESS_S = 1.0
#: seconds an engine's call thread waits for the next call before it ends
_IDLE_S = 60.0


def _device() -> str:
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:  # pragma: no cover
        return "cpu"


def _tokens_and_logprobs(completion: Any) -> tuple[list[int], list[float]]:
    tokens = list(completion.token_ids)
    return tokens, [lp[t].logprob for t, lp in zip(tokens, completion.logprobs, strict=True)]


def engine_kwargs(**extra: Any) -> dict[str, Any]:
    """Keyword arguments that make a vLLM engine receive through streamsync."""
    return {"weight_transfer_config": {"backend": "streamsync"},
            "worker_extension_cls": "streamsync.vllm.extension.StreamSyncWorkerExtension", **extra}


def shutdown(engine: Any, timeout: float | None = None) -> None:
    """Shut an `AsyncLLM` down now (its engine core and worker processes), for good.

    Call it before the program ends. vLLM's `AsyncLLM.__del__` shuts down again; an AsyncLLM still referenced
    when the interpreter exits (a stored exception's traceback frames keep one alive easily) has that run
    while the interpreter tears down, which raises `TypeError: 'NoneType' object is not callable`. After this
    call that later shutdown does nothing."""
    engine.shutdown(timeout=timeout)
    # __del__ calls self.shutdown(): an instance attribute takes precedence over the method
    engine.shutdown = lambda *args, **kwargs: None


class _Guarded(Engine):
    timeout: float
    #: the workers copy received tensors straight into the engine's tensors where they can
    #: (`streamsync.vllm.fastpath`); False: every tensor goes through vLLM's layerwise reload
    fast_path: bool = True
    #: an update reached the engine since the round began: an abort must then mark it mixed
    _touched: bool = False
    #: the engine's vLLM is this process's (an in-process LLM / AsyncLLM): its version is read here
    in_process: bool = False
    _info: VllmInfo | None = None
    _stats: list[dict[str, Any]] | None = None  # what the workers said the round did, from its finish
    #: a push opens the round with its first update, in the same call (the worker extension's
    #: `streamsync_update`): engines whose updates reach the workers through a Python `collective_rpc`
    open_with_first_update: bool = False
    #: a push to this engine alone ends the round with its last chunk, in the same call (`end_with_chunk`)
    end_with_last_update: bool = False
    _end_at: int | None = None  # the chunk whose update ends the round
    _ended = False  # ... and it did
    _open_pending = False  # defer_start() was asked and no update has opened the round yet
    _reset_asked = False  # the next finish carries the prefix-cache reset (`core_rpc`)
    _reset_done: bool | None = None  # what the engine core answered of that reset (None: not done there)

    async def locate(self) -> None:
        """At connect: learn the engine's vLLM (`vllm_info`), refusing one outside the supported range."""
        await self.vllm_info()

    async def vllm_info(self) -> VllmInfo:
        """The engine's vLLM version and whether vLLM keeps the weight version (else its workers do), as its
        first worker reports them; asked once. A vLLM outside `compat.SUPPORTED` is refused with an
        EngineError naming the version found and the supported range, and so is a quantization that no push of
        unquantized weights fits (`compat.quantization_refusal`: the method, the checkpoint's and a tensor)."""
        if self._info is None:
            try:
                caps = await self.rpc("streamsync_capabilities")
            except EngineError as e:
                if isinstance(e, EngineUnreachable):  # a wrong URL, a server that died: no hint about what it runs
                    raise
                raise EngineError(self.name, f"{e.message} (an engine made with streamsync.engines.vllm."
                                  "engine_kwargs() has streamsync's worker extension)",
                                  unresponsive=e.unresponsive) from e
            info = VllmInfo.from_worker(caps[0])
            self.workers = len(caps)  # each a receiving process (a collective or p2p group's rank of its own)
            why = (compat.unsupported(compat.installed_version() if self.in_process else info.version)
                   or compat.quantization_refusal(info.quantization))
            if why is not None:
                raise EngineError(self.name, why)
            self._info = info
        return self._info

    @property
    def native_versions(self) -> bool | None:
        """vLLM keeps the weight version (and labels output tokens with it: `weight_versions`); False: the
        streamsync workers keep it; None: not asked yet (`vllm_info`)."""
        return None if self._info is None else self._info.native_versions

    async def _run(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        try:
            with anyio.fail_after(self.timeout):
                return await self._watched(what, fn, *args, **kw)
        except TimeoutError:
            raise EngineError(self.name, f"{what}: no reply in {self.timeout:.1f} s") from None
        except EngineError:
            raise
        except Exception as e:
            raise EngineError(self.name, f"{what} failed: {type(e).__name__}: {e}") from e

    async def _watched(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """`fn(...)`, failed early with "engine process exited" when the engine dies while it runs."""
        result: list[Any] = []

        async def call() -> None:
            result.append(await fn(*args, **kw))
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while True:
                await anyio.sleep(_LIVENESS_S)
                why = await self._dead()
                if why:
                    raise EngineError(self.name, f"{what} failed: engine process exited ({why})")

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await call()
        except BaseExceptionGroup as eg:  # one leaf: the call's own error or the watcher's
            raise eg.exceptions[0] from None
        return result[0]

    async def _dead(self) -> str | None:
        """Why the engine is known to be dead, or None (alive, or it cannot tell)."""
        return None

    async def _finish(self, version: str | None) -> None:
        """End the open round; the engine then reports `version` (None: what it reported before)."""
        native = (await self.vllm_info()).native_versions
        push_version = version is not None and version.isdigit()
        if native and not push_version and self.workers == 1:  # a mark or nothing: vLLM's own finish sets it
            # (several workers: the extension's finish below, which every worker answers; `answers`)
            self._reset_asked, self._reset_done = False, None
            await self._vllm_finish(version)
            return
        # Where the workers keep it, a mark (a failed round's "mixed:N") is set before the round ends, so the
        # finish commits nothing of that round; a push's version is committed by the finish itself (every chunk
        # carried it), and set after it where no chunk reached the engine.
        if not native and version is not None and not push_version:
            await self._set_version(version)
        # vLLM's finish, called in the workers by streamsync's extension, which answers with what the round did
        # there (`round_stats` then asks nothing), and in the same call (`streamsync.vllm.core_rpc`) vLLM's own
        # version where it keeps one and, asked, the prefix-cache reset the push ends with
        reset = self._reset_asked and push_version
        await self._ended_with(await self.rpc("streamsync_finish_update", *self._asks(version, native, reset)),
                               reset, version if native else None)
        if not native and push_version and not self._touched:
            await self._set_version(str(version))

    @staticmethod
    def _asks(version: str | None, native: bool | None, reset: bool) -> list[str]:
        """What the engine core is asked to do once the workers ended the round (`core_rpc`)."""
        return ([core_rpc.VERSION + str(version)] if native and version is not None else []) + (
            [core_rpc.RESET] if reset else [])

    async def _ended_with(self, got: list[Any], reset: bool, native_version: str | None) -> None:
        """The workers' answers to a round's end: their round stats, the engine core's cache reset (asked) and
        vLLM's version (`native_version`), set here where the engine core did not (no `core_rpc` there)."""
        self._reset_asked, self._reset_done = False, None
        self._stats = [x for x in got if isinstance(x, dict)] or None
        answers = [x.get("cache_reset") for x in self._stats or ()]
        if reset and answers and all(isinstance(a, bool) for a in answers):
            self._reset_done = all(answers)
        if native_version is not None and not (
                self._stats and all(x.get("weight_version") == native_version for x in self._stats)):
            await self._vllm_set_version(native_version)

    def reset_with_finish(self, reset: bool) -> None:
        self._reset_asked = reset

    def end_with_chunk(self, chunk: int | None) -> bool:
        self._ended = False
        ok = chunk is not None and self.end_with_last_update and self._info is not None
        self._end_at = chunk if ok else None
        return ok

    def finished_reset(self) -> bool | None:
        done, self._reset_done = self._reset_done, None
        return done

    def round_answered(self) -> bool:
        return self._stats is not None

    async def _set_version(self, version: str) -> None:
        if (await self.vllm_info()).native_versions:
            await self._vllm_set_version(version)
        else:
            await self.rpc("streamsync_set_weight_version", version)

    async def _raw_version(self) -> str:
        if (await self.vllm_info()).native_versions:
            return await self._vllm_version()
        held = {str(v) for v in await self.rpc("streamsync_weight_version")}
        return held.pop() if len(held) == 1 else MIXED  # workers that disagree: no version is held whole

    async def _vllm_finish(self, version: str | None) -> None:
        """vLLM's finish_weight_update, with the version where one is given (0.32+ only)."""
        raise NotImplementedError

    async def _vllm_set_version(self, version: str) -> None:
        raise NotImplementedError

    async def _vllm_version(self) -> str:
        raise NotImplementedError

    async def start_update(self) -> None:
        """Open a round. vLLM refuses while one is active; a round that is ours (an abort that failed) or
        that nobody touched for longer than our timeout (its owner crashed: its push has failed by now) is
        ended and the start retried; a live round of another WeightSync is refused, naming it."""
        try:
            await self._start_workers()
            return
        except EngineError as e:
            if "already active" not in str(e):
                raise
            refused = e
        round_ = (await self.rpc("streamsync_round"))[0]
        owner, idle = round_.get("owner"), float(round_.get("idle_s") or 0.0)
        if round_.get("open") and owner != self.owner and idle <= self.timeout:
            why = superseded(owner, self.owner or "")
            if why is None:
                raise EngineError(self.name, f"start refused: the open round belongs to another WeightSync (owner "
                                  f"{describe(owner)}, active {idle:.1f} s ago)") from refused
            get_logger().warning("taking over an open round", engine=self.name, owner=describe(owner), why=why)
        await self._finish(MIXED if owner is not None else None)  # a chunk claimed it: weights are mixed
        await self._start_workers()

    async def _start_workers(self) -> None:
        """vLLM's start; in an engine of several workers through the extension, whose calls every worker
        answers (`vllm.answers`)."""
        if self.workers > 1:
            await self.rpc("streamsync_start_update")
        else:
            await self._start()

    async def _start(self) -> None:
        raise NotImplementedError

    def defer_start(self) -> bool:
        self._open_pending = self.open_with_first_update
        return self._open_pending

    async def _opened(self) -> None:
        """A deferred start that no update made: open the round now (a finish needs one to end)."""
        if self._open_pending:
            self._open_pending = False
            await self.start_update()

    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None:
        self._touched = True
        info = wire(message)
        opening, self._open_pending = self._open_pending, False
        ending = self._end_at is not None and info.get("chunk") == self._end_at
        if opening:
            try:
                await self._fused(info, True, ending)
                return
            except EngineError as e:  # vLLM refused to open it (nothing was applied): start_update's recovery
                if "already active" not in str(e):
                    raise
            await self.start_update()
        if ending or self.workers > 1:
            # Several workers: through the extension, whose workers answer an error instead of raising (vLLM's
            # executor stops reading answers at the first worker that raised and the next call reads the rest).
            await self._fused(info, False, ending)
        else:
            await self._update(info)

    async def _fused(self, info: dict[str, Any], opening: bool, ending: bool) -> None:
        """One chunk through the extension's `streamsync_update`: the round opened before it and/or ended after
        it (with the cache reset, asked) in the same call into the engine."""
        reset = ending and self._reset_asked
        native = self._info is not None and self._info.native_versions
        version = str(info.get("version")) if ending and native else None
        got = await self.rpc("streamsync_update", {"streamsync": info}, "open" if opening else "",
                             "end" if ending else "", *self._asks(version, native, reset))
        if ending:
            self._ended, self._end_at = True, None
            await self._ended_with(got, reset, version)

    async def _update(self, update_info: dict[str, Any]) -> None:
        raise NotImplementedError

    takes_prime = True

    async def prime(self, message: Mapping[str, Any]) -> bool:
        """Every worker maps the chunk's references and, on a GPU, captures the fast path's copies of them as the
        graph a push replays (`StreamSyncWeightTransferEngine.prime`), so that a first push runs like a later one."""
        got = await self.rpc("streamsync_prime", {"streamsync": dict(message)})
        return bool(got) and all(bool(g) for g in got)

    async def finish_update(self, version: int) -> None:
        if self._ended:  # the last chunk's update ended the round (`end_with_chunk`): its version is committed
            self._ended = self._touched = False
            return
        await self._opened()
        await self._finish(str(version))
        self._touched = False

    async def abort_update(self, version: int | None = None) -> None:
        """End the round (vLLM finalizes the layerwise reload: layers nothing reached keep their old weights).
        If any chunk reached the engine, its version becomes "mixed:<version>": it holds neither version."""
        mark = f"{MIXED}{version if version is not None else ''}" if self._touched else None
        if self._open_pending:  # deferred and never opened: there is no round to end
            self._open_pending = False
            return
        self._end_at = None
        if self._ended:  # the round ended with the last chunk; the push failed after it: mark it all the same
            self._ended = self._touched = False
            if mark is not None:
                await self._set_version(mark)
            return
        try:
            await self._finish(mark)
        except EngineError:
            # vLLM already ended the round (an update raised there): that is the state an abort wants,
            # but the engine still reports the old version, so mark it.
            if mark is not None:
                await self._set_version(mark)
        self._touched = False

    async def get_version(self) -> int | None:
        return (await self.state()).version

    async def state(self) -> EngineState:
        return parse_version(await self._raw_version())

    async def weight_digests(self, device: bool = False) -> dict[str, str]:
        """What the engine computes with, per vLLM parameter (first worker). `device`: digests computed where
        each tensor lives (`checksum.device_digest`; compare with `expected_digests(..., digest=device_digest)`)."""
        return (await self.rpc("streamsync_weight_digests", *(["1"] if device else [])))[0]

    async def holds(self, hf: Mapping[str, torch.Tensor], tied: bool = False) -> bool | None:
        """Compares the worker's parameters (vLLM's fused names) with `hf` fused the same way."""
        from ..vllm.extension import expected_digests

        return await self.weight_digests() == expected_digests(hf, await self.packed_modules(), tied=tied)

    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """HF name -> (dtype, shape) of the checkpoint the engine loaded (first worker), or None when the
        engine was started from something other than a local safetensors folder."""
        got = (await self.rpc("streamsync_expected_weights"))[0]
        return None if got is None else {n: (d, tuple(s)) for n, (d, s) in got.items()}

    async def architectures(self) -> tuple[str, ...]:
        return (await self.vllm_info()).architectures

    async def declined_layers(self) -> Declined | None:
        """The checkpoint's MTP layers, which the workers' main model does not load (`checkpoint.mtp_layers`)."""
        got = (await self.rpc("streamsync_declined_layers"))[0]
        start, stop = got["layers"]
        return Declined(int(start), int(stop), str(got["reason"])) if stop > start else None

    async def delta_base(self) -> tuple[int, str] | None:
        """The push every worker keeps as its delta base (None unless all keep the same one)."""
        held = {None if h is None else (int(h[0]), str(h[1])) for h in await self.rpc("streamsync_delta_base")}
        return held.pop() if len(held) == 1 else None

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

    def _init_info(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return {**init_info, "fast_path": self.fast_path}

    async def fused_layout(self) -> dict[str, Any] | None:
        """The tensors every worker takes as one (the fast path's fusions: `qkv_proj`, `gate_up_proj`, stacked
        experts), or None where they differ or there are none."""
        layouts = await self.rpc("streamsync_fused_layout")
        first = layouts[0] if layouts else None
        return first if first and all(x == first for x in layouts) else None

    async def layout(self) -> EngineLayout | None:
        """The part of each checkpoint tensor each worker reads, as its fast path traced vLLM's own loaders (TP
        slices: q/k/v and gate/up rows, o/down columns, its share of the padded vocabulary; replicated tensors
        whole on every worker); None where a worker has no trace (`fast_path=False`, or no local checkpoint)."""
        got = await self.rpc("streamsync_layout")
        if not got or any(g is None for g in got):
            return None
        self.workers = len(got)
        return EngineLayout(self.name, len(got), tuple(Need(self.name, w, str(n), Box.from_json(b))
                                                       for w, items in enumerate(got) for n, b in items))

    async def round_stats(self) -> list[dict[str, Any]] | None:
        """What the last round did in each worker (`streamsync.vllm.stats`), or None before any: as the round's
        finish answered it, where it did."""
        if self._stats is not None:
            got, self._stats = self._stats, None
            return got
        got = [x for x in await self.rpc("streamsync_round_stats") if isinstance(x, dict)]
        return got or None

    async def received_digests(self) -> dict[str, str]:
        return (await self.rpc("streamsync_received_digests"))[0]

    async def rpc(self, method: str, *args: Any, **kwargs: str) -> list[Any]:
        """`collective_rpc(method, args, kwargs)` on every worker of the engine: one result per worker (keyword
        arguments as strings: what vLLM's HTTP route passes). A worker that answered with an error in place of
        raising (`vllm.extension.answering`) fails the call here, naming it."""
        got = await self._rpc(method, *args, **kwargs)
        for i, x in enumerate(got if isinstance(got, list) else ()):
            if isinstance(x, dict) and WORKER_ERROR in x:
                raise EngineError(self.name, f"{method} failed in worker {i}: {x[WORKER_ERROR]}")
        return got

    async def _rpc(self, method: str, *args: Any, **kwargs: str) -> list[Any]:
        raise NotImplementedError


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
    cls: Any = type(client)
    send = getattr(cls, "_send_input", None)
    if client is None or not callable(send):
        return False
    if getattr(send, "__streamsync__", False):
        return True

    @functools.wraps(send)
    def send_input(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = send(self, *args, **kwargs)
        fire = getattr(_sending, "fire", None)
        if fire is not None:
            _sending.fire = None
            fire()
        return out

    send_input.__streamsync__ = True  # type: ignore[attr-defined]
    try:
        cls._send_input = send_input
    except (AttributeError, TypeError):  # a class that takes no attributes
        return False
    return True


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

    async def call(self, engine: _Guarded, what: str, fn: Any) -> Any:
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


class VllmEngine(_Guarded):
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


class AsyncVllmEngine(_Guarded):
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


class VllmHttpEngine(_Guarded):
    """`vllm serve` started with VLLM_SERVER_DEV_MODE=1 and `--weight-transfer-config '{"backend":"streamsync"}'`.

    `api_key`: sent as `Authorization: Bearer <key>` on every request (a server started with `--api-key` and
    `--middleware streamsync.vllm.auth.RequireApiKey` refuses the weight-transfer routes without it)."""

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
