"""The round on a vLLM engine, whichever way the client reaches it: start, updates, finish or abort, the version
vLLM or the workers keep, each call raced against a liveness check (`VllmClient`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import anyio

from ...errors import EngineError, EngineUnreachable
from ...log import get_logger
from ...message import UpdateMessage, wire
from ...owners import describe, superseded
from ...vllm import BACKEND, WORKER_EXTENSION, compat
from ...vllm.compat import VllmInfo
from ...vllm.core import rpc as core_rpc
from ..abilities import (
    CachesPrefixes,
    Checkpointed,
    Family,
    Finished,
    FoldsRound,
    Fused,
    Generates,
    KeepsDeltaBase,
    Locatable,
    Pausable,
    Primable,
    ReadsBack,
    ReportsRounds,
    RoundPlan,
    Sharded,
)
from ..base import MIXED, Engine, EngineState, parse_version
from .queries import WorkerQueries

#: seconds a call runs before its engine's liveness is checked, then the interval between checks
_LIVENESS_S = 1.0


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
    return {"weight_transfer_config": {"backend": BACKEND}, "worker_extension_cls": WORKER_EXTENSION, **extra}


def shutdown(engine: Any, timeout: float | None = None) -> None:
    """Shut an `AsyncLLM` down now (its engine core and worker processes), for good.

    Call it before the program ends. vLLM's `AsyncLLM.__del__` shuts down again; an AsyncLLM still referenced
    when the interpreter exits (a stored exception's traceback frames keep one alive easily) has that run
    while the interpreter tears down, which raises `TypeError: 'NoneType' object is not callable`. After this
    call that later shutdown does nothing."""
    engine.shutdown(timeout=timeout)
    # __del__ calls self.shutdown(): an instance attribute takes precedence over the method
    engine.shutdown = lambda *args, **kwargs: None


@dataclass
class _Round:
    """The round as the client knows it between a push's calls."""

    touched: bool = False  # an update reached the engine since the round began: an abort then marks it mixed
    open_pending: bool = False  # fold_round() deferred the start and no update has opened the round yet
    end_at: int | None = None  # the chunk whose update ends the round
    ended: Finished | None = None  # ... and it did: what that end did
    reset_asked: bool = False  # the finish carries the prefix-cache reset (`core_rpc`)


class VllmClient(WorkerQueries, Engine, Locatable, Checkpointed, Family, Fused, Sharded, KeepsDeltaBase, Primable,
               FoldsRound, ReportsRounds, Pausable, CachesPrefixes, ReadsBack, Generates):
    """A vLLM engine's round and every ability a vLLM engine has (`engines.abilities`); the clients differ only
    in how a call reaches the engine."""

    timeout: float
    #: the workers copy received tensors straight into the engine's tensors where they can
    #: (`streamsync.vllm.worker.fastpath`); False: every tensor goes through vLLM's layerwise reload
    fast_path: bool = True
    #: the engine's vLLM is this process's (an in-process LLM / AsyncLLM): its version is read here
    in_process: bool = False
    _info: VllmInfo | None = None
    #: a push opens the round with its first update, in the same call (the worker extension's
    #: `streamsync_update`): engines whose updates reach the workers through a Python `collective_rpc`
    open_with_first_update: bool = False
    #: a push to this engine alone ends the round with its last chunk, in the same call (`fold_round`)
    end_with_last_update: bool = False

    @cached_property
    def _round(self) -> _Round:
        return _Round()

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

    async def _finish(self, version: str | None) -> Finished:
        """End the open round; the engine then reports `version` (None: what it reported before)."""
        native = (await self.vllm_info()).native_versions
        push_version = version is not None and version.isdigit()
        if native and not push_version and self.workers == 1:  # a mark or nothing: vLLM's own finish sets it
            # (several workers: the extension's finish below, which every worker answers; `answers`)
            self._round.reset_asked = False
            await self._vllm_finish(version)
            return Finished()
        # Where the workers keep it, a mark (a failed round's "mixed:N") is set before the round ends, so the
        # finish commits nothing of that round; a push's version is committed by the finish itself (every chunk
        # carried it), and set after it where no chunk reached the engine.
        if not native and version is not None and not push_version:
            await self._set_version(version)
        # vLLM's finish, called in the workers by streamsync's extension, which answers with what the round did
        # there (`Finished.stats`), and in the same call (`streamsync.vllm.core.rpc`) vLLM's own version where it
        # keeps one and, asked, the prefix-cache reset the push ends with
        reset = self._round.reset_asked and push_version
        done = await self._answered(await self.rpc("streamsync_finish_update", *self._asks(version, native, reset)),
                                      reset, version if native else None)
        if not native and push_version and not self._round.touched:
            await self._set_version(str(version))
        return done

    @staticmethod
    def _asks(version: str | None, native: bool | None, reset: bool) -> list[str]:
        """What the engine core is asked to do once the workers ended the round (`core_rpc`)."""
        return ([core_rpc.VERSION + str(version)] if native and version is not None else []) + (
            [core_rpc.RESET] if reset else [])

    async def _answered(self, got: list[Any], reset: bool, native_version: str | None) -> Finished:
        """The workers' answers to a round's end: their round stats, the engine core's cache reset (asked) and
        vLLM's version (`native_version`), set here where the engine core did not (no `core_rpc` there)."""
        self._round.reset_asked = False
        stats = tuple(x for x in got if isinstance(x, dict)) or None
        answers = [x.get("cache_reset") for x in stats or ()]
        done = all(answers) if reset and answers and all(isinstance(a, bool) for a in answers) else None
        if native_version is not None and not (
                stats and all(x.get("weight_version") == native_version for x in stats)):
            await self._vllm_set_version(native_version)
        return Finished(cache_reset=done, stats=stats)

    def fold_round(self, plan: RoundPlan) -> bool:
        """The round opens with the first update where the updates reach the workers through a Python
        `collective_rpc` (`open_with_first_update`), ends with the last chunk's update where this engine is the
        push's only one and can (`end_with_last_update`), and the finish carries the cache reset."""
        self._round.reset_asked = plan.reset_cache
        self._round.ended = None
        ends = plan.last_chunk is not None and self.end_with_last_update and self._info is not None
        self._round.end_at = plan.last_chunk if ends else None
        self._round.open_pending = self.open_with_first_update
        return self._round.open_pending

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

    async def _opened(self) -> None:
        """A deferred start that no update made: open the round now (a finish needs one to end)."""
        if self._round.open_pending:
            self._round.open_pending = False
            await self.start_update()

    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None:
        self._round.touched = True
        info = wire(message)
        opening, self._round.open_pending = self._round.open_pending, False
        ending = self._round.end_at is not None and info.get("chunk") == self._round.end_at
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
        reset = ending and self._round.reset_asked
        native = self._info is not None and self._info.native_versions
        version = str(info.get("version")) if ending and native else None
        got = await self.rpc("streamsync_update", {"streamsync": info}, "open" if opening else "",
                             "end" if ending else "", *self._asks(version, native, reset))
        if ending:
            self._round.end_at = None
            self._round.ended = await self._answered(got, reset, version)

    async def _update(self, update_info: dict[str, Any]) -> None:
        raise NotImplementedError

    async def prime(self, message: Mapping[str, Any]) -> bool:
        """Every worker maps the chunk's references and, on a GPU, captures the fast path's copies of them as the
        graph a push replays (`StreamSyncWeightTransferEngine.prime`), so that a first push runs like a later one."""
        got = await self.rpc("streamsync_prime", {"streamsync": dict(message)})
        return bool(got) and all(bool(g) for g in got)

    async def finish_update(self, version: int) -> Finished:
        if self._round.ended is not None:  # the last chunk's update ended the round (`fold_round`): version committed
            done, self._round.ended, self._round.touched = self._round.ended, None, False
            return done
        await self._opened()
        done = await self._finish(str(version))
        self._round.touched = False
        return done

    async def abort_update(self, version: int | None = None) -> None:
        """End the round (vLLM finalizes the layerwise reload: layers nothing reached keep their old weights).
        If any chunk reached the engine, its version becomes "mixed:<version>": it holds neither version."""
        mark = f"{MIXED}{version if version is not None else ''}" if self._round.touched else None
        if self._round.open_pending:  # deferred and never opened: there is no round to end
            self._round.open_pending = False
            return
        self._round.end_at = None
        if self._round.ended is not None:  # the round ended with the last chunk; the push failed after it: mark it
            self._round.ended, self._round.touched = None, False
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
        self._round.touched = False

    async def get_version(self) -> int | None:
        return (await self.state()).version

    async def state(self) -> EngineState:
        return parse_version(await self._raw_version())

    def _init_info(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return {**init_info, "fast_path": self.fast_path}

    async def round_stats(self) -> list[dict[str, Any]] | None:
        """What the last round did in each worker (`streamsync.vllm.worker.stats`), or None before any."""
        got = [x for x in await self.rpc("streamsync_round_stats") if isinstance(x, dict)]
        return got or None
