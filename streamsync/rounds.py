"""`EngineGroup`: one call on every engine at once, each under its timeout, failures named by engine; and the
rounds a push opens, finishes or aborts on them.

Every call an engine does not answer within `timeout` fails as a PushError naming it; its effect is then
unknown (`maybe`). Ending failed rounds is shielded from cancellation and bounded by `abort_timeout` per
engine, so a failed push raises within its timeout plus that, never hangs on a dead engine.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from .engines.abilities import CachesPrefixes, Finished, FoldsRound, Pausable, ReportsRounds, RoundPlan, lacks
from .engines.base import Engine
from .errors import EngineError, PushError, StreamSyncError
from .log import get_logger
from .pipeline.stages import first_push_error
from .report import EngineRound
from .trace import Trace


@dataclass
class Rounds:
    """Which engines a push opened a round on (or may have: a start cut short), and finished, with what each
    finish did besides (`Finished`); the engines that open the round with the push's first update instead
    (`FoldsRound`)."""

    opened: set[str] = field(default_factory=set)
    finished: dict[str, Finished] = field(default_factory=dict)
    deferred: set[str] = field(default_factory=set)


class EngineGroup:
    def __init__(self, engines: Sequence[Engine], timeout: float, abort_timeout: float) -> None:
        self.engines = list(engines)
        self.timeout = timeout
        self.abort_timeout = abort_timeout

    async def each(self, what: str, call: Callable[[Engine], Awaitable[object]], *, stage: str,
                   engines: Sequence[Engine] | None = None, done: set[str] | None = None,
                   maybe: set[str] | None = None) -> None:
        """`call(engine)` on every engine concurrently. `done` collects the engines whose call returned; `maybe`
        those whose call timed out or was cut short (its effect is unknown)."""
        async def one(e: Engine) -> None:
            try:
                with anyio.fail_after(self.timeout):
                    await call(e)
            except TimeoutError:
                if maybe is not None:
                    maybe.add(e.name)
                raise PushError(f"{what}: no reply in {self.timeout:.1f} s", stage=stage, receiver=e.name) from None
            except Exception as err:
                leaf = str(first_push_error(err) if isinstance(err, ExceptionGroup) else err)
                named = leaf if f"{e.name!r}" in leaf else f"engine {e.name!r}: {leaf}"
                raise PushError(f"{what}: {named}", stage=stage, receiver=e.name) from err
            except BaseException:
                if maybe is not None:
                    maybe.add(e.name)
                raise
            if done is not None:
                done.add(e.name)

        try:
            await _each(self.engines if engines is None else engines, one)
        except BaseExceptionGroup as eg:
            raise first_push_error(eg) from None

    async def start(self, rounds: Rounds) -> None:
        """Open a round on every engine. Shielded: a pipeline failure or a cancellation must not cut an
        engine's start in half (the abort that follows would meet a half-opened round)."""
        async def start(e: Engine) -> None:
            if e.name not in rounds.deferred:
                await e.start_update()

        with anyio.CancelScope(shield=True):
            await self.each("start_update", start, stage="start", done=rounds.opened, maybe=rounds.opened)

    def fold(self, last_chunk: int | None, reset_cache: bool, rounds: Rounds) -> None:
        """Before a push: engines that fold the round into the push's other calls (`FoldsRound`) are told how it
        goes (they may end it in the call that brings the last chunk where the push goes to them alone, and reset
        their caches in the call that ends it); those that open it with the first update are not started."""
        for e in self.engines:
            plan = RoundPlan(last_chunk if len(self.engines) == 1 else None, reset_cache)
            if isinstance(e, FoldsRound) and e.fold_round(plan):
                rounds.deferred.add(e.name)

    async def finish(self, version: int, rounds: Rounds) -> None:
        async def finish(e: Engine) -> None:
            rounds.finished[e.name] = await e.finish_update(version) or Finished()

        await self.each("finish_update", finish, stage="finish")

    async def abort(self, engines: Sequence[Engine], version: int) -> set[str]:
        """End a failed round on `engines` (shielded, `abort_timeout` each); the names whose round ended."""
        ended: set[str] = set()
        log = get_logger()

        async def one(e: Engine) -> None:
            try:
                with anyio.fail_after(self.abort_timeout):
                    await e.abort_update(version)
                ended.add(e.name)
            except TimeoutError:
                log.warning("abort failed", engine=e.name, error=f"no reply in {self.abort_timeout:.1f} s")
            except Exception as err:  # the push already failed; report, don't mask its error
                log.warning("abort failed", engine=e.name, error=str(err))

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for e in engines:
                    tg.start_soon(one, e)
        return ended

    async def reset_caches(self, trace: Trace | None = None, finished: Rounds | None = None) -> dict[str, bool]:
        """Reset every engine's prefix cache after a finished round. The new version is already in place, so a
        failure here does not fail the push: it is reported (the result, a warning). Each engine's reset is an
        `engine.cache_reset` span of `trace` (timed here where the sender calls it; an engine whose finish did
        the reset, `Finished.cache_reset` in `finished`, is not called again and its round stats time the reset
        where it ran). Engines that cache nothing (no `CachesPrefixes`) count as reset."""
        done: dict[str, bool] = {}
        log = get_logger()

        async def one(e: Engine) -> None:
            fused = finished.finished[e.name].cache_reset if finished and e.name in finished.finished else None
            start = trace.now() if trace is not None else 0.0
            try:
                if fused is not None:
                    done[e.name] = fused
                else:
                    if isinstance(e, CachesPrefixes):
                        with anyio.fail_after(self.timeout):
                            done[e.name] = await e.reset_cache()
                    else:
                        done[e.name] = True
                    if trace is not None:  # also where nothing was cached: every engine's lane shows the push's end
                        trace.add_span("engine.cache_reset", -1, start, trace.now(), 0, e.name)
            except Exception as err:
                log.warning("prefix cache reset failed", engine=e.name, error=str(err))
                done[e.name] = False
            if not done[e.name]:
                log.warning("prefix cache not reset: requests kept across the push still hold cache blocks; "
                            "cached prefixes may be served from KV of the old weights until the next reset "
                            "(use paused(clear_cache=True) or sync.reset_caches())", engine=e.name)

        await _each(self.engines, one)
        return done

    async def round_stats(self, trace: Trace | None = None, finished: Rounds | None = None) -> list[EngineRound]:
        """What every engine's workers did in the round that just finished (`Finished.stats` where the finish
        answered it, else `ReportsRounds.round_stats`), their phases added to `trace` as engine spans.
        Observability only: an engine that cannot answer is logged, not failed (the weights already moved)."""
        out: list[EngineRound] = []
        log = get_logger()

        async def one(e: Engine) -> None:
            answered = finished.finished[e.name].stats if finished and e.name in finished.finished else None
            if answered is None and not isinstance(e, ReportsRounds):
                return
            try:
                if answered is not None:
                    got: Sequence[dict[str, Any]] | None = answered
                else:
                    assert isinstance(e, ReportsRounds)
                    with anyio.fail_after(self.timeout):
                        got = await e.round_stats()
                rounds = [EngineRound.from_wire(e.name, d) for d in got or ()]
            except Exception as err:
                log.warning("engine round stats unavailable", engine=e.name, error=str(err))
                return
            out.extend(rounds)
            if trace is not None:
                for r in rounds:
                    trace.engine_phases(r.engine if len(rounds) == 1 else f"{r.engine} w{r.worker}", r.phases)

        await _each(self.engines, one)
        return sorted(out, key=lambda r: (self._order(r.engine), r.worker))

    def _order(self, name: str) -> int:
        return next((i for i, e in enumerate(self.engines) if e.name == name), len(self.engines))

    async def pause(self, mode: str, clear_cache: bool) -> None:
        await self.each("pause", lambda e: _pausable(e).pause(mode, clear_cache), stage="pause")

    async def resume(self, engines: Sequence[Engine] | None = None) -> None:
        await self.each("resume", lambda e: _pausable(e).resume(), stage="resume", engines=engines)


async def _each(engines: Sequence[Engine], one: Callable[[Engine], Coroutine[Any, Any, None]]) -> None:
    """`one(engine)` on every engine concurrently; one engine is awaited directly (no task group: a push makes
    several such calls), so its error comes as it is, not in a group."""
    if len(engines) == 1:
        await one(engines[0])
        return
    async with anyio.create_task_group() as tg:
        for e in engines:
            tg.start_soon(one, e)


def _pausable(e: Engine) -> Pausable:
    if not isinstance(e, Pausable):
        raise lacks(e, "pause generation")
    return e


def connect_error(exc: BaseException, engines: Sequence[Engine], timeout: float) -> BaseException:
    """What a failed `connect` raises: a StreamSyncError or a cancellation as it is, anything else as an
    EngineError naming the engines (a timeout: "connect: no reply in N s")."""
    leaf = first_push_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
    if isinstance(leaf, StreamSyncError) or not isinstance(leaf, Exception):
        return leaf  # EngineError names the engine; cancellation stays cancellation
    names = ",".join(e.name for e in engines)
    if isinstance(leaf, TimeoutError):
        return EngineError(names, f"connect: no reply in {timeout:.1f} s")
    return EngineError(names, f"connect failed: {type(leaf).__name__}: {leaf}")


async def close_quietly(closing: Sequence[Any], engines: Sequence[Engine], abort_timeout: float) -> None:
    """Close `closing` (a transport) and every engine, each bounded by `abort_timeout`; a failure is logged."""
    for c in [*closing, *engines]:
        try:
            with anyio.fail_after(abort_timeout):
                await c.close()
        except Exception as err:
            get_logger().warning("close failed", error=str(err))
