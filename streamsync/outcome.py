"""How a push ends, as its sync records it: the report of a push that succeeded (versions, the delta base,
the tensors an engine does not load, the trace, metrics and the observers' hooks), and for one that failed or
was cancelled, every round it opened ended and what each engine holds marked."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from . import pipeline
from .errors import PushError
from .log import get_logger
from .plan.chunk import ChunkPlan
from .report import ChunkDone, DeltaReport, EngineRound, MiB, PushReport
from .rounds import EngineGroup, Rounds
from .sources import Source
from .sources.sharded import ShardedSource
from .trace import Trace

if TYPE_CHECKING:
    from .sync import WeightSync


def call_hook(hook: Callable[[Any], object], arg: object, name: str, *, warn: bool = True, **where: object) -> bool:
    """Call an observer's hook; False (and a warning, if `warn`) where it raised."""
    try:
        hook(arg)
    except Exception as err:  # the weights moved: a hook's own bug must not fail the push
        if warn:
            get_logger().warning(f"{name} hook failed", error=f"{type(err).__name__}: {err}", **where)
        return False
    return True


class Outcome:
    """One sync's records of how its pushes end (module doc); `WeightSync.outcome`."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync
        self.warned_declined: set[str] = set()  # engines already warned that they do not load some tensors

    def succeeded(self, push: pipeline.Push, source: Source, cache_reset: dict[str, bool],
                   engine_rounds: list[EngineRound]) -> PushReport:
        log = get_logger()
        trace = push.job.trace
        seconds = trace.end()
        self.sync.versions.pushed(push.job.version, [e.name for e in self.sync.engines])
        total = sum(p.nbytes for p in push.job.plans)
        delta = self.delta_done(push, total, seconds)
        sharded = isinstance(source, ShardedSource)
        path, senders = ("sharded", source.senders) if isinstance(source, ShardedSource) else ("single-sender", 1)
        report = PushReport(
            push_id=push.job.push_id, version=push.job.version, seconds=seconds,
            bytes=delta.wire_bytes if delta is not None else total, model_bytes=total, chunks=len(push.job.plans),
            stage_seconds=trace.busy_seconds(), peak_bytes_inflight=push.peak_bytes,
            max_chunks_alive=trace.max_alive(), collectives=source.collectives,
            engines=[e.name for e in self.sync.engines], cache_reset=cache_reset, trace=trace,
            gc_ms=trace.counts.get("gc_us", 0) / 1e3, delta=delta, engine_rounds=engine_rounds,
            not_loaded=self.not_loaded(push.job.plans), casts=dict(self.sync.planner.casts),
            path=path, senders=senders,
        )
        if sharded:
            trace.meta.update(path=path, senders=senders)
        if engine_rounds:
            trace.meta["engine_rounds"] = [r.to_dict() for r in engine_rounds]
        if report.gc_ms >= 20 and report.gc_ms > 0.2 * seconds * 1e3:
            log.warning("garbage collection paused this push", gc_ms=round(report.gc_ms, 1),
                        push_ms=round(seconds * 1e3, 1),
                        fix="call gc.freeze() once the model is built: objects alive then are not scanned again")
        trace.count("collectives", source.collectives)
        report.trace_path = self.write_trace(trace)
        log.info("push done", ms=round(seconds * 1e3, 1), mib=round(total / MiB, 1), gbps=round(report.gbps, 2),
                 chunks=len(push.job.plans), stage_ms={k: round(v * 1e3, 1) for k, v in report.stage_seconds.items()},
                 **({"delta": delta.mode, "sent_mib": round(delta.wire_bytes / MiB, 2)} if delta else {}))
        if self.sync.metrics is not None and source.is_sender:
            self.sync.metrics.observe_push(report)
        if self.sync.observers.on_push is not None:
            call_hook(self.sync.observers.on_push, report, "on_push")
        return report

    def not_loaded(self, plans: Sequence[ChunkPlan]) -> dict[str, list[str]]:
        """Engine -> the tensors of this push it does not load (`Family.declined_layers`), said once per engine."""
        out: dict[str, list[str]] = {}
        if not self.sync.planner.declined:  # every engine loads every layer (no set of an MoE's thousands of names)
            return out
        pushed = {s.name for p in plans for s in p.specs}
        for engine, declined in self.sync.planner.declined.items():
            names = sorted(n for n in pushed if declined.declines(n))
            if names:
                out[engine] = names
            if engine in self.warned_declined:
                continue
            if names:
                self.warned_declined.add(engine)
                layers = [n for n in names if n not in declined.names]
                get_logger().warning("engine does not load some tensors of the push", engine=engine,
                                     tensors=len(names),
                                     **({"layers": f"{declined.start}..{declined.stop - 1}",
                                         "reason": declined.reason} if layers else {}),
                                     **({"names": sorted(set(names) - set(layers)), "why": declined.names_reason}
                                        if len(layers) < len(names) else {}))
            elif declined.optional[1] > declined.optional[0] and not any(map(declined.may_omit, pushed)):
                self.warned_declined.add(engine)
                get_logger().warning("the push carries no MTP layer: the engine's MTP draft model keeps the weights it "
                                     "started with", engine=engine,
                                     layers=f"{declined.optional[0]}..{declined.optional[1] - 1}")
        return out

    def delta_done(self, push: pipeline.Push, total: int, seconds: float) -> DeltaReport | None:
        """A delta sync's push succeeded: every engine holds it whole, so the shadow is the next push's base."""
        d = push.job.delta
        if d is None:
            return None
        self.sync.shadow.held = (push.job.version, push.job.push_id)
        self.sync.shadow.since_full = 0 if d.mode == "full" else self.sync.shadow.since_full + 1
        for k, v in (("wire_bytes", d.wire_bytes), ("changed", d.changed), ("elements", d.elements)):
            push.job.trace.count(f"delta.{k}", v)
        changed = d.changed / d.elements if d.elements else 0.0
        self.sync.auto.note(d.mode, seconds, d.wire_bytes, total, changed)
        return DeltaReport(d.mode, d.wire_bytes, self.sync.shadow.nbytes, d.why_full, d.base, d.changed, d.elements,
                           dict(d.encodings), shadow_where=self.sync.shadow.where, auto=d.auto)

    def chunk_hook(self, push_id: str, version: int, plans: Sequence[ChunkPlan]) -> Callable[[int, int], None]:
        hook = self.sync.observers.on_chunk
        log = get_logger()
        failed = [0]  # a hook that fails for one chunk fails for every one: warn once per push, with the count

        def done(i: int, n: int) -> None:
            log.debug("chunk released", chunk=i, of=n)
            if hook is not None:
                p = plans[i]
                if not call_hook(hook, ChunkDone(push_id, version, i, n, p.nbytes, len(p.specs)), "on_chunk",
                                  warn=not failed[0], push=push_id):
                    failed[0] += 1
                if i == n - 1 and failed[0] > 1:
                    log.warning("on_chunk hook failed for several chunks of this push", push=push_id,
                                chunks=failed[0], of=n)

        return done

    async def failed(self, err: BaseException, push: pipeline.Push, group: EngineGroup, rounds: Rounds,
                      trace: Trace) -> None:
        """A push failed or was cancelled: end every round it opened and record what the engines hold."""
        log = get_logger()
        with anyio.CancelScope(shield=True):
            cancelled = not isinstance(err, Exception)  # else a PushError, or the finite check's refusal
            if isinstance(err, PushError):
                log.error("push failed", stage=err.stage, chunk=err.chunk, receiver=err.receiver, error=str(err))
            elif not cancelled:
                log.error("push refused", error=str(err))
            else:
                log.warning("push cancelled", running=push.running(), error=type(err).__name__)
            # Engines that owe the failed chunk's acknowledgement did not answer within the timeout: asking them
            # to abort would hold the error back by another one. They keep the round open (open_rounds).
            unresponsive = err.unresponsive if isinstance(err, PushError) else frozenset()
            to_abort = [e for e in self.sync.engines if e.name in rounds.opened and e.name not in rounds.finished]
            ended = (await group.abort([e for e in to_abort if e.name not in unresponsive], push.job.version)
                     if to_abort else set())
            self.sync.versions.failed(push.job.version, finished=set(rounds.finished),
                                      aborted=[e.name for e in to_abort], ended=ended, sent=push.sent_any)
            if self.sync.mixed:
                log.warning("engines hold mixed weights until the next successful push", mixed=sorted(self.sync.mixed))
            if cancelled:
                log.warning("push cancelled; its round was ended on every engine that answered",
                            open_rounds=sorted(self.sync.open_rounds))
            if isinstance(err, PushError):  # drawn by the viewer: the failing stage, chunk, engine and message
                trace.fail(err.stage, err.chunk, err.receiver, err.message)
            elif not cancelled:
                trace.fail("check", None, None, str(err))
            else:
                trace.fail(push.running_stage(), push.running_chunk(), None, f"cancelled ({push.running()})")
            self.write_trace(trace)

    def write_trace(self, trace: Trace) -> str | None:
        if self.sync.trace_dir is None:
            return None
        return str(trace.write(self.sync.trace_dir / f"push-{trace.push_id}-v{trace.meta.get('version')}.trace.json"))
