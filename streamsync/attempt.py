"""One try at a push: its values, frozen (`Attempt`), and its run through the pipeline while the engines' round
opens, takes the chunks and finishes (`run_attempt`). `WeightSync.push` makes the first attempt; the delta policy
may make a second (the same version in full, after an engine refused a delta)."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import anyio

from . import pipeline
from .delta.push import DeltaPush
from .errors import PushError, PushTimeout, ValidationError
from .log import get_logger
from .pipeline.stages import first_push_error
from .pipeline.threads import responsive_threads
from .plan import finite
from .plan.chunk import ChunkPlan
from .report import EngineRound, MiB, PushReport
from .rounds import EngineGroup, Rounds
from .sources import Source
from .trace import Trace, watching_gc

if TYPE_CHECKING:
    from .sync import WeightSync


@dataclass(frozen=True)
class Attempt:
    """What one try at a push sends and under which limits: the source and its plan, the push id, the version,
    the chunk window, the time limit, and the delta mode (None: a sync without deltas)."""

    source: Source
    plans: list[ChunkPlan]
    push_id: str
    version: int
    window: int
    time_limit: float | None
    delta: DeltaPush | None = None
    finite: FiniteCheck | None = None  # the finite check still running, answered before the engines' round opens

    def again(self, delta: DeltaPush) -> Attempt:
        """The same version again under a new push id (a full push after a refused delta)."""
        return replace(self, push_id=uuid.uuid4().hex[:8], delta=delta, finite=None)


class FiniteCheck:
    """The non-finite check of a push's weights (`Checks.check_finite`), queued on the device (`plan.finite`):
    `start` returns once its kernels are queued, `verdict` waits for the answer and refuses weights holding NaN
    or inf. A push asks for the verdict before the first engine call (the round's start or the first chunk's
    update), so the device reads the weights while the host plans, gathers and packs, and no engine byte changes
    before the answer."""

    def __init__(self, pending: finite.Pending, started: float, queueing: str) -> None:
        self.pending = pending
        #: perf_counter times: asked for, queued, verdict asked for, verdict answered (`record`)
        self.times = [started, time.perf_counter(), math.nan, math.nan]
        self.queueing = queueing  # what queueing it took on the host (`finite.queueing`)

    @classmethod
    async def start(cls, source: Source, answer_now: bool = False) -> FiniteCheck | None:
        """The check of `source`'s weights, queued; with `answer_now`, answered (None, or a refusal raised)."""
        # a set seen before only queues its kernels; a new one is worked out in a thread (an MoE's thousands)
        t0 = time.perf_counter()
        tensors = source.local_tensors()
        how = finite.queueing(tensors)
        check = cls(finite.launch(tensors) if how == "kernels" else
                    await anyio.to_thread.run_sync(finite.launch, tensors), t0, how)
        if not answer_now:
            return check
        await check.verdict()
        return None

    async def verdict(self) -> None:
        self.times[2] = time.perf_counter()
        if not self.pending.done():
            await anyio.to_thread.run_sync(self.pending.wait)
        self.times[3] = time.perf_counter()
        bad = self.pending.names()
        if bad:
            more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise ValidationError(f"refusing to push non-finite weights (NaN or inf) in {bad[:5]}{more}; "
                                  "no engine was touched (check_finite=False skips this check)")

    def record(self, trace: Trace) -> None:
        """Where the check's host time went, in the trace's meta (ms from the push's start): `check` holds when
        it was asked for and queued, when a verdict was asked for and answered (null where none was), and what
        queueing it took (`finite.queueing`: "kernels" alone, else it was queued from a thread)."""
        ms = [None if math.isnan(t) else round((t - trace.t0) * 1e3, 3) for t in self.times]
        trace.meta["check"] = {"asked": ms[0], "queued": ms[1], "verdict_asked": ms[2], "answered": ms[3],
                               "queueing": self.queueing}


async def run_attempt(sync: WeightSync, a: Attempt) -> PushReport:
    """Run attempt `a`: the pipeline while the engines' round opens, takes the chunks and finishes, then the
    prefix caches reset; a failure or cancellation ends every round it opened before it propagates
    (`Outcome.failed`)."""
    source, plans, push_id, version, window, time_limit, delta = (a.source, a.plans, a.push_id, a.version,
                                                                   a.window, a.time_limit, a.delta)
    log = get_logger()
    source.begin_push()
    if not sync.checks.check_finite:  # weights no check vouched for: served, they may leave NaN in KV caches
        sync.upkeep.unchecked |= {e.name for e in sync.engines}
    trace = Trace(push_id)
    total = sum(p.nbytes for p in plans)
    trace.meta.update(version=version, chunks=len(plans), max_inflight=window,
                      transport=sync.transport.name if sync.transport is not None else None, bytes=total,
                      engines=[e.name for e in sync.engines])
    log.info("push start", chunks=len(plans), mib=round(total / MiB, 1), window=window)
    # the report's seconds and the trace's wall time are one measurement, from the call's start
    started = trace.begin(at=sync._call_started)
    trace.meta["prepare_ms"] = round((time.perf_counter() - started) * 1e3, 3)
    if sync.live is not None:
        sync.live.add(trace)
    push = pipeline.Push(pipeline.PushJob(
        push_id=push_id, version=version, source=source, transport=sync.transport, engines=sync.engines,
        plans=plans, trace=trace, messages=sync._messages, max_inflight=window, timeout=sync.timeout,
        hold=sync.planner.hold(source, plans), owner=sync.owner,
        on_chunk=sync.outcome.chunk_hook(push_id, version, plans), checked=sync._checked,
        engine_layout=sync.engine_layout, delta=delta,
    ))
    group = EngineGroup(sync.engines, sync.timeout, sync.abort_timeout)
    rounds = Rounds()
    cache_reset: dict[str, bool] = {}
    engine_rounds: list[EngineRound] = []
    limit = anyio.CancelScope(deadline=math.inf if time_limit is None else anyio.current_time() + time_limit)
    push_range = pipeline.ProfilerRange(f"streamsync.push v{version}").__enter__()
    try:
        with watching_gc(trace), responsive_threads(), limit:
            if source.is_sender and sync.engines:
                # Gathers and packs need no engine: they start while the engines open the round.
                push.started = anyio.Event()
                group.fold(plans[-1].index if plans else None, sync.checks.reset_prefix_cache, rounds)
                await _run_started(push, group, rounds, a.finite)
                await group.finish(version, rounds)
                cache_reset, engine_rounds = await _after_round(sync, group, rounds, trace)
            else:
                await pipeline.run(push)
    except BaseException as e:  # a PushError, or a cancellation: the rounds end either way
        if sync.metrics is not None and isinstance(e, PushError):
            sync.metrics.observe_failure(e.stage)
        await sync.outcome.failed(e, push, group, rounds, trace)
        raise
    finally:
        push_range.__exit__()
        if a.finite is not None:
            a.finite.record(trace)
    if limit.cancelled_caught:
        err = PushTimeout(f"push did not finish within {time_limit:.1f} s ({push.running()})",
                          stage=push.running_stage(), chunk=push.running_chunk(), push_id=push_id)
        if sync.metrics is not None:
            sync.metrics.observe_failure(err.stage)
        await sync.outcome.failed(err, push, group, rounds, trace)
        raise err
    report = sync.outcome.succeeded(push, source, cache_reset, engine_rounds)
    await sync.upkeep.after_whole()
    return report


async def _after_round(sync: WeightSync, group: EngineGroup, rounds: Rounds,
                       trace: Trace) -> tuple[dict[str, bool], list[EngineRound]]:
    """Once every engine finished: reset their prefix caches and ask what their workers did, both at once."""
    cache_reset: dict[str, bool] = {}
    engine_rounds: list[EngineRound] = []

    async def reset() -> None:
        cache_reset.update(await group.reset_caches(trace, rounds))

    async def stats() -> None:
        engine_rounds.extend(await group.round_stats(trace, rounds))

    if all(f.stats is not None for f in rounds.finished.values()):  # the finishes answered: no task group
        if sync.checks.reset_prefix_cache:
            await reset()
        if sync.observers.engine_stats:
            await stats()
        return cache_reset, engine_rounds
    async with anyio.create_task_group() as tg:
        if sync.checks.reset_prefix_cache:
            tg.start_soon(reset)
        if sync.observers.engine_stats:
            tg.start_soon(stats)
    return cache_reset, engine_rounds


async def _run_started(push: pipeline.Push, group: EngineGroup, rounds: Rounds, check: FiniteCheck | None) -> None:
    """start_update on every engine, concurrently with the pipeline, once the finite check answered; the first
    send waits for it."""
    assert push.started is not None
    started = push.started

    async def start() -> None:
        if check is not None:
            await check.verdict()
        await group.start(rounds)
        started.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(start)
            await pipeline.run(push)
    except BaseExceptionGroup as eg:
        raise first_push_error(eg) from None
