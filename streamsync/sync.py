"""`WeightSync`: the public entry point. Connect engines once, then `await sync.push(model)` every step."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

import anyio

from .attempt import Attempt, FiniteCheck, run_attempt
from .delta import AutoDelta, Shadow, refused
from .delta.policy import DeltaPolicy
from .delta.push import DeltaPush
from .delta.shadow import PieceShadow
from .engines.abilities import Locatable
from .engines.base import Engine
from .errors import PushError, StreamSyncError, ValidationError
from .interrupts import Terminated, sigterm_cancels
from .log import bound, get_logger, quiet
from .loops import current_loop
from .metrics import Metrics
from .options import Checks, Deltas, Observers, PushOptions, SyncKwargs, split_options
from .outcome import Outcome
from .owners import new_owner
from .pack import Fusion, fusions_from_json
from .pipeline.messages import Messages
from .plan.chunk import ChunkPlan
from .plan.finite import warm_finite_check
from .plan.planner import Planner
from .report import ChunkDone, PushReport
from .rounds import EngineGroup, close_quietly, connect_error
from .sources import Source, is_fsdp1
from .transports.base import RanksAgree, Transport
from .transports.placement import choose_transport
from .upkeep import Upkeep
from .versions import VersionBook, one_version

if TYPE_CHECKING:
    from .trace.viewer import LiveViewer


class WeightSync:
    """Streams a model's weights into inference engines.

    engines:   where weights go (in-process vLLM, `vllm serve` over HTTP, receiver processes). Empty on trainer
               ranks that only take part in gathers (Megatron TP/PP/EP ranks other than the sender).
    transport: "auto" (by where each engine runs: shared memory for CPU engines on this host, CUDA IPC for GPU
               engines on this host, the collective transport for engines elsewhere, such as Ray actors on other
               nodes), a registered transport's name ("shm", "cuda_ipc", "collective", "p2p"), or a Transport instance.
    options:   keywords grouped by what they govern: how a push runs (`PushOptions`: chunk_bytes, max_inflight,
               timeout, abort_timeout, reuse_plan, source_options, engine_layout), what it checks (`Checks`:
               check_finite, reset_prefix_cache), what it sends (`Deltas`: delta, full_every, verify_delta;
               docs/delta.md), and who sees it (`Observers`: trace_dir, trace_live, on_chunk, on_push, metrics).
               Tests make a push fail on demand with `streamsync.testing.faults.inject`.

    One event loop for the sync's life: engines keep connections bound to the loop `connect` ran in. From
    synchronous code use `BlockingWeightSync`, not `anyio.run(sync.push, ...)` per step.
    """

    def __init__(self, engines: Sequence[Engine] = (), transport: str | Transport = "auto",
                 **options: Unpack[SyncKwargs]) -> None:
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValidationError(f"engine names must be unique, got {names}")
        self.options, self.checks, self.deltas, self.observers = split_options(options)
        self.engines = list(engines)
        self._transport_arg = transport
        self.transport: Transport | None = transport if isinstance(transport, Transport) else None
        self.live: LiveViewer | None = None
        if self.observers.trace_live:
            from .trace.viewer import LiveViewer

            live = self.observers.trace_live
            self.live = LiveViewer(live if isinstance(live, str) else "127.0.0.1:8765",
                                   trace_dir=self.observers.trace_dir)
        self.versions = VersionBook()
        #: what delta pushes are computed against (empty unless this sync pushes deltas; a sharded push's
        #: PieceShadow on every trainer rank)
        self.shadow: Shadow | PieceShadow = Shadow(device_bytes=self.deltas.shadow_device_bytes)
        self._delta_on = False  # decided at connect, by `delta` and the transport
        self.auto = AutoDelta()  # what delta="auto" measured of this sync's pushes
        #: this sync's id: receivers refuse a round from another WeightSync while one of ours is open
        self.owner = new_owner()
        self.connected = False
        self.log = get_logger()
        self._checked: dict[int, tuple[ChunkPlan, Sequence[Any]]] = {}  # see pipeline.stages._convert
        #: the push's source and plan, kept per model, and what the engines expect of it (learned at connect)
        self.planner = Planner()
        self._messages = Messages([None] * len(self.engines))
        self._lock = anyio.Lock()
        #: the engines' state that is not their weights: paused (found so at connect, or kept so by `paused()` after
        #: a failed push, until a push makes them whole), KV left by unchecked weights
        self.upkeep = Upkeep(self)
        #: how a push ends: the report of one that succeeded; the rounds ended and the marks of one that failed
        self.outcome = Outcome(self)
        self._call_started: float | None = None  # perf_counter at the current push call's start
        self._loop: object | None = None  # the event loop `connect` ran in

    # -- options, as attributes (each assignment re-checks its group) ----------------------------------

    def _set(self, **change: Any) -> None:
        self.options = replace(self.options, **change)

    chunk_bytes = property(lambda self: self.options.chunk_bytes, lambda self, v: self._set(chunk_bytes=v))
    max_inflight = property(lambda self: self.options.max_inflight, lambda self, v: self._set(max_inflight=v))
    timeout = property(lambda self: self.options.timeout, lambda self, v: self._set(timeout=v))
    engine_layout = property(lambda self: self.options.engine_layout, lambda self, v: self._set(engine_layout=v))
    abort_timeout = property(lambda self: self.options.abort_seconds)

    @property
    def trace_dir(self) -> Path | None:
        return self.observers.trace_dir

    @trace_dir.setter
    def trace_dir(self, value: str | os.PathLike[str] | None) -> None:
        self.observers = replace(self.observers, trace_dir=Path(value) if value is not None else None)

    @property
    def metrics(self) -> Metrics | None:
        return self.observers.metrics

    # -- versions --------------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The last version pushed (or found on the engines at connect); versions only move forward. Assign
        it to restart the numbering: the next push must claim a larger one."""
        return self.versions.version

    @version.setter
    def version(self, value: int) -> None:
        self.versions.version, self.versions.claimed, self.versions.retry = int(value), True, None

    @property
    def mixed(self) -> dict[str, int]:
        """Engine name -> the failed push's version that left part of its weights there (`VersionBook`)."""
        return self.versions.mixed

    @property
    def open_rounds(self) -> set[str]:
        """Engines whose failed round could not be confirmed ended."""
        return self.versions.open_rounds

    # -- lifecycle -------------------------------------------------------------------------------------

    async def connect(self, model: object | None = None) -> None:
        """Pick the transport, set up every engine's receiving half, learn what the engines hold and expect.

        `model`: also plan its push now (`plan`: every parameter walked, checked against what the engines expect,
        chunks laid out) and, where the sender's own tensors are sent, make its per-chunk views, so the first push
        does neither (a third of a first 8B megatron push on the H200); a model unfit for the engines is refused.

        Raises a StreamSyncError (EngineError naming an unreachable or failing engine), all connections closed."""
        if self.connected:
            if model is not None:
                await self._prepare(model)
            return
        if self.live is not None:
            await self.live.start()
        try:
            locating = [e for e in self.engines if isinstance(e, Locatable)]
            if locating:  # where each engine runs decides its transport (Ray actors: same node or not)
                with anyio.fail_after(self.timeout):
                    async with anyio.create_task_group() as tg:
                        for loc in locating:
                            tg.start_soon(loc.locate)
            if self.transport is None:
                self.transport = choose_transport(self._transport_arg, self.engines)
            self._delta_on = self.deltas.delta is True or (self.deltas.delta == "auto" and self.transport.delta_pays)
            if self._delta_on and self.transport.every_rank and not isinstance(self.shadow, PieceShadow):
                self.shadow = PieceShadow()  # each rank keeps the pieces it sends, per destination
            self.shadow.held = None  # what engines hold is learned afresh: the first push is full
            if self.engines or self.transport.every_rank:  # every_rank: ranks without engines join too
                if self.engines:
                    self.log.info("connecting", transport=self.transport.name,
                                  engines=[e.name for e in self.engines])
                for e in self.engines:
                    e.owner = self.owner
                await self.transport.connect(self.engines, self.timeout)
                fusions = [await self._learn(e) for e in self.engines]
                self._messages = Messages(fusions)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await close_quietly([self.transport] if self.transport is not None else [], self.engines,
                                    self.abort_timeout)
            raise connect_error(exc, self.engines, self.timeout) from None
        self._loop = current_loop()
        self.connected = True
        if model is not None:
            await self._prepare(model)

    async def _prepare(self, model: object) -> None:
        """`connect(model)`: plan the model's push and, where a gather is the sender's own tensors (no collective),
        gather and convert every chunk once, so that the first push finds the views the source keeps between
        pushes (an MoE's thousands) made and checked against the plan, and send each chunk's references ahead to
        the engines that take them (`Transport.prime`; not with deltas, whose pushes reference nothing). No byte
        moves; a push checks again that every tensor is still where it was. Holds the push lock: the source's and
        the transport's per-push state are a push's own."""
        async with self._lock:
            source, plans = self.plan(model)
            if self.checks.check_finite:  # the finite check's kernel and tile table made now, not in the first push
                await anyio.to_thread.run_sync(warm_finite_check, source.local_tensors())
            if self.engines and source.is_sender and source.gathers_here:
                assert self.transport is not None
                await self.planner.prepare(source, plans, self.transport, self.engines, self.timeout, self._checked,
                                           prime=not self._delta_on)

    async def _learn(self, e: Engine) -> dict[str, Fusion] | None:
        """What engine `e` expects a push to carry (`Planner.learn`), its own fused layout, and the version it
        holds."""
        layout = await self.planner.learn(e, self.timeout)
        with anyio.fail_after(self.timeout):
            state = await e.state()
        self.versions.seen(e.name, state)
        if state.paused:
            self.upkeep.stale_paused.add(e.name)
            self.log.warning("engine is paused, and not by this sync (a trainer that paused it is gone?): it is "
                             "resumed after the next successful push", engine=e.name, version=state.version,
                             mixed=state.mixed)
        else:
            self.upkeep.stale_paused.discard(e.name)
        if self.metrics is not None and state.version is not None:
            self.metrics.engine_version.labels(engine=e.name).set(state.version)
        return fusions_from_json(layout) if layout else None

    def _check_loop(self) -> None:
        """Engine connections, locks and sessions belong to the loop `connect` ran in: refuse another one
        with a message saying what to do, rather than fail every other push with 'Event loop is closed'."""
        if self.connected and self.engines and self._loop is not None and current_loop() is not self._loop:
            raise StreamSyncError(
                "this WeightSync was connected in another event loop (its engine connections belong to it); "
                "keep one loop for its life (one anyio.run/asyncio.run around the training loop), or use "
                "streamsync.BlockingWeightSync from synchronous code")

    @property
    def delta_on(self) -> bool:
        """Whether this sync pushes deltas (`delta=True`, or "auto" where they pay), once connected."""
        return self._delta_on

    @property
    def viewer_url(self) -> str | None:
        """The live trace viewer's page (with `trace_live`, once connected)."""
        return self.live.url if self.live is not None else None

    async def close(self) -> None:
        self.shadow = Shadow(device_bytes=self.deltas.shadow_device_bytes)  # no base once closed: memory freed
        if self.live is not None:
            await self.live.stop()
        if self.transport is not None:
            await self.transport.close()
        for e in self.engines:
            await e.close()
        self.connected = False

    async def __aenter__(self) -> WeightSync:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- plan ------------------------------------------------------------------------------------------

    def plan(self, model: object) -> tuple[Source, list[ChunkPlan]]:
        """The source and chunk plan a push of `model` would use (no bytes move).

        Both are kept for the next push of the same model object (the same module, or a list of the same
        chunks): building them walks every parameter (and, for a sharded Megatron model, exchanges metadata),
        which costs milliseconds per push. Pass `reuse_plan=False`, or call `forget()`, after replacing
        modules or changing parameter shapes; in-place updates and `param.data = ...` need neither.
        """
        return self.planner.plan(model, self.transport, self.options, self.checks, by_reference=not self._delta_on)

    def forget(self) -> None:
        """Drop the cached source and plan: the next push plans again."""
        self.planner.forget()

    # -- push ------------------------------------------------------------------------------------------

    async def push(self, model: object, *, version: int | None = None, max_inflight: int | None = None,
                   time_limit: float | None = None) -> PushReport:
        """Stream `model`'s weights into every engine; return when all acknowledged the last chunk.

        On success every engine reports `version` (default: previous + 1) and holds it whole. On failure
        raises PushError (PushTimeout after `time_limit` seconds), and no engine reports the new version.

        A failed or cancelled push (task.cancel(), an enclosing anyio scope's deadline) ends the round on
        every engine that opened it, shielded and bounded by `abort_timeout`, before the error or the
        cancellation propagates; so `paused()` never resumes an engine mid-update and the next push can
        start. Engines that received part of the push are then listed in `mixed` and report themselves
        mixed, not their old version. An enclosing `anyio.fail_after` raises anyio's TimeoutError (give
        it `reason=`); `time_limit` raises a PushTimeout that says which stage and chunk were running.
        """
        window = self.max_inflight if max_inflight is None else int(max_inflight)
        if window < 1:
            raise ValidationError(f"max_inflight must be >= 1, got {window}")
        self._check_loop()
        if time_limit is not None and not time_limit > 0:
            raise ValidationError(f"time_limit must be a positive number of seconds, got {time_limit}")
        with anyio.CancelScope() as scope, sigterm_cancels(scope.cancel) as term:
            report = await self._push_locked(model, version, window, time_limit)
        if term:  # SIGTERM cancelled the push, whose round ended: now the process stops
            get_logger().error("push interrupted by SIGTERM; its round was ended", engines_mixed=sorted(self.mixed))
            raise Terminated()
        return report

    async def _push_locked(self, model: object, version: int | None, window: int,
                           time_limit: float | None) -> PushReport:
        # the report's seconds are the whole call's: planning, the finite check and the ranks' agreement too
        self._call_started = time.perf_counter()
        async with self._lock:  # one push at a time: rounds on an engine must not interleave
            if not self.connected:
                await self.connect()
            for e in self.engines:  # an engine client shared by two syncs carries the pushing one's id
                e.owner = self.owner
            v = self.versions.next(version)
            push_id = uuid.uuid4().hex[:8]
            assert self.transport is not None
            every_rank = self.transport.every_rank
            bad_input: Exception | None = None
            check: FiniteCheck | None = None
            try:
                source, plans = self.plan(model)
                if self.engines and not source.is_sender:
                    raise ValidationError(
                        f"rank {_rank()} was given engines {[e.name for e in self.engines]} but does not send: "
                        "only global rank 0 sends a Megatron model; pass engines=[] on the other ranks")
                if self.checks.check_finite:
                    # answered as the engines' round opens where this rank alone pushes and no delta's shadow moves
                    check = await FiniteCheck.start(source, every_rank or self._delta_on or not (
                        self.engines and source.gathers_here))
            except Exception as e:
                if not every_rank:
                    raise
                bad_input = e
            if isinstance(self.transport, RanksAgree):  # every rank goes ahead, or every rank raises
                await self.transport.before_push(self.timeout, bad_input)
            if every_rank or is_fsdp1(model) or not source.gathers_here:  # every trainer rank is in this push
                v = await one_version(v, self.timeout)
            policy = DeltaPolicy(self)
            first = Attempt(source, plans, push_id, v, window, time_limit, await policy.mode(source, plans), check)
            delta = first.delta

            async def attempt(d: DeltaPush) -> PushReport:  # the same version again, in full
                return await run_attempt(self, first.again(d))

            # Ranks without engines log warnings and errors only (STREAMSYNC_LOG_ALL_RANKS=1: all): N ranks bury one
            loud = source.is_sender and (bool(self.engines) or not every_rank)
            with bound(push=push_id, version=v), quiet(not loud and os.environ.get("STREAMSYNC_LOG_ALL_RANKS") != "1"):
                failed: Exception | None = None
                report: PushReport | None = None
                try:
                    report = await run_attempt(self, first)
                except Exception as err:
                    if delta is None or delta.mode != "delta":
                        raise
                    if not every_rank:
                        if not isinstance(err, PushError) or not refused(err):
                            raise
                        return await policy.full_after_refusal(attempt, plans, err)
                    failed = err  # every rank learns it in settle_sharded, which raises it here
                if every_rank and delta is not None and delta.mode == "delta":
                    return await policy.settle_sharded(attempt, plans, failed, report)
                assert report is not None
                return report

    async def reset_caches(self) -> dict[str, bool]:
        """Reset every engine's prefix cache now (e.g. once requests kept across a push have finished)."""
        return await EngineGroup(self.engines, self.timeout, self.abort_timeout).reset_caches()

    # -- partial rollout -------------------------------------------------------------------------------

    def paused(self, mode: str = "keep", clear_cache: bool = False, *,
               resume_on_failure: bool = False) -> AbstractAsyncContextManager[None]:
        """Pause generation on every engine for the body (e.g. a push), then resume.

        mode "keep" freezes in-flight requests (with clear_cache=False they keep their KV cache and continue
        on the new weights), "wait" drains them, "abort" ends them.

        When the body raised (or was cancelled), engines a failed push left holding mixed weights (`mixed`)
        or with a round that could not be ended (`open_rounds`) stay paused, so they serve nothing from
        half-new weights; the others resume. `resume_on_failure=True` resumes every engine anyway. The next
        push that makes them whole resumes them, inside `paused()` or not.
        """
        return self.upkeep.paused(mode, clear_cache, resume_on_failure=resume_on_failure)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


__all__ = ["Checks", "ChunkDone", "Deltas", "Observers", "PushOptions", "PushReport", "WeightSync"]
