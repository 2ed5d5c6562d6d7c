"""Whether a push of a delta sync goes as a delta or in full, and what follows a delta that failed.

`DeltaPolicy(sync).mode(...)` decides before any byte moves: a delta only against the shadow every engine holds
whole (the sync's bookkeeping says so and each engine's `delta_base` agrees); a sharded push decides on every
trainer rank together. After a delta that an engine refused (another base, a digest that did not match), the
same version goes again in full (`full_after_refusal`); a sharded delta's ranks first learn how it ended on
each other (`settle_sharded`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..engines.abilities import KeepsDeltaBase
from ..engines.base import Engine
from ..errors import PushError, ValidationError
from ..log import get_logger
from ..rounds import EngineGroup
from ..transports.base import RanksAgree
from .codec import refused
from .push import DeltaPush

if TYPE_CHECKING:
    from ..plan.chunk import ChunkPlan
    from ..report import PushReport
    from ..sources import Source
    from ..sync import WeightSync

#: the push again with another delta mode, the same version and chunks (`WeightSync._push`)
Attempt = Callable[[DeltaPush], Awaitable["PushReport"]]


class DeltaPolicy:
    """The delta decisions of one push of `sync`."""

    def __init__(self, sync: WeightSync) -> None:
        self.sync = sync
        #: delta="auto": why this push may go as a delta or went full on cost (`AutoDelta.choose`)
        self.auto: str | None = None

    async def mode(self, source: Source, plans: list[ChunkPlan]) -> DeltaPush | None:
        """This push's delta mode: None (deltas off, or a rank that sends nothing), "full" (every byte; the shadow
        made anew) or "delta" (against the shadow, which every engine holds whole: the sync's bookkeeping says
        so and each engine's `delta_base` agrees). From here on the shadow is no base until this push succeeds.
        A sharded push decides on every trainer rank together: full where any rank's shadow says so."""
        assert self.sync.transport is not None
        agree = self.sync.transport if isinstance(self.sync.transport, RanksAgree) else None
        every = agree is not None
        if not self.sync.delta_on or (not every and (not source.is_sender or not self.sync.engines)):
            return None
        sh = self.sync.shadow
        why: str | None = None
        bad: Exception | None = None
        try:
            why = await self._why_full(sh.prepare(plans, source.device))
        except Exception as e:  # on every rank too: a rank that skipped the exchange would leave the others in it
            if not every:
                raise
            bad = e
        if agree is not None:  # one decision for every rank: a rank that pushes in full makes every rank's push
            # full (rank 0 may first spend up to the timeout asking the engines for their base)
            views: list[Any] = await agree.exchange((why, None if bad is None else str(bad)), self.exchange_timeout())
            if bad is not None:
                raise bad
            for r, (w, no) in enumerate(views):
                if no:
                    raise ValidationError(f"trainer rank {r} cannot push deltas: {no}")
                if why is None and w:
                    why = f"trainer rank {r}: {w}"
        base, sh.held = sh.held, None
        if why is not None:
            get_logger().info("full push of a delta sync", why=why)
            return self.full(len(plans), why, sum(p.nbytes for p in plans))
        return DeltaPush(sh, "delta", len(plans), base=base, verify=self.sync.deltas.verify_delta, auto=self.auto)

    def full(self, chunks: int, why: str, model_bytes: int) -> DeltaPush:
        # An engine beside the trainer (shared memory, CUDA IPC) keeps its copy on the host: the GPU's memory is
        # the trainer's too. So does a worker of a sharded push: no one message says how much of it it keeps.
        t = self.sync.transport
        assert t is not None
        base = self.sync.deltas.engine_base if t.delta_pays and not t.every_rank else "host"
        return DeltaPush(self.sync.shadow, "full", chunks, why_full=why, model_bytes=model_bytes, engine_base=base,
                         auto=self.auto if why == self.auto else None)

    async def _why_full(self, fresh: bool) -> str | None:
        """Why this push of a delta sync must be full (None: it may be a delta)."""
        sh = self.sync.shadow
        if fresh:
            return "first push"
        if self.sync.mixed or self.sync.open_rounds:
            return f"engines {sorted(set(self.sync.mixed) | self.sync.open_rounds)} hold mixed weights"
        if sh.held is None:
            return "no base: the last push failed, or none was pushed since connect"
        if sh.held[0] != self.sync.versions.version:
            return f"the sync's version is {self.sync.versions.version}, the shadow's {sh.held[0]}"
        if self.sync.deltas.full_every and sh.since_full + 1 >= self.sync.deltas.full_every:
            return f"every {self.sync.deltas.full_every} pushes"
        if self.sync.deltas.delta == "auto":
            go, self.auto = self.sync.auto.choose()
            if not go:
                return self.auto
        held = sh.held
        off: list[str] = []

        async def check(e: Engine) -> None:
            if not isinstance(e, KeepsDeltaBase) or await e.delta_base() != held:
                off.append(e.name)

        sync = self.sync
        await EngineGroup(sync.engines, sync.timeout, sync.abort_timeout).each("delta_base", check, stage="start")
        if off:
            return f"engines {sorted(off)} do not hold version {held[0]} (push {held[1]}) as their base"
        return None

    def exchange_timeout(self) -> float:
        """How long a rank waits for the others at a sharded delta push's exchanges: another may first spend a
        whole timeout of its own (the engines' base, a send the group timeout ends)."""
        group = getattr(self.sync.transport, "group_timeout", None) or 0.0
        return 2 * max(self.sync.timeout, float(group)) + 30.0

    async def settle_sharded(self, attempt: Attempt, plans: list[ChunkPlan], failed: Exception | None,
                             report: PushReport | None) -> PushReport:
        """A sharded delta push ended on this rank: every rank learns how it ended on the others. Where an
        engine refused the delta, every rank pushes the same version in full. Where trainer rank 0 (which holds
        the engines) failed otherwise, every rank fails; where only another rank did, the engines hold the
        version and rank 0 returns its report. (Waits for the slowest rank: one whose sends a failed round left
        unreceived ends after the group timeout.)"""
        agree = self.sync.transport
        assert isinstance(agree, RanksAgree)  # a sharded push's transport
        refusal = isinstance(failed, PushError) and refused(failed)
        mine = None if failed is None else (refusal, f"{type(failed).__name__}: {failed}")
        ends: list[Any] = await agree.exchange(mine, self.exchange_timeout())
        if any(e is not None and e[0] for e in ends):
            why = next(e[1] for e in ends if e is not None and e[0])
            err = failed if isinstance(failed, PushError) and refusal else PushError(why, stage="send")
            await agree.before_push(self.sync.timeout)  # every rank rebuilds a group the failure broke
            return await self.full_after_refusal(attempt, plans, err)
        if failed is not None:
            raise failed
        if ends[0] is not None:
            raise PushError(f"the push failed on trainer rank 0, which holds the engines: {ends[0][1]}", stage="send")
        bad = next(((r, e[1]) for r, e in enumerate(ends) if e is not None), None)
        if bad is not None:  # the engines hold the version; that rank's shadow is no base, so the next push is full
            get_logger().warning("a trainer rank's push failed after the engines took it", rank=bad[0], error=bad[1])
        assert report is not None
        return report

    async def full_after_refusal(self, attempt: Attempt, plans: list[ChunkPlan], err: PushError) -> PushReport:
        """An engine refused a delta (another base than the shadow's, or a tensor that did not match its
        digest): the failed push ended every round as any failed push does; push the same version in full.
        A collective group whose sequence the failure lost is made anew first."""
        log = get_logger()
        log.warning("an engine refused a delta: pushing in full", engine=err.receiver, error=err.message)
        assert self.sync.transport is not None
        if self.sync.transport.broken is not None and not self.sync.transport.every_rank:
            await self.sync.transport.connect(self.sync.engines, self.sync.timeout)
        full = self.full(len(plans), f"refused: {err.message}", sum(p.nbytes for p in plans))
        report = await attempt(full)
        if report.delta is not None:
            report.delta = replace(report.delta, fallback=True)
        return report
