"""`WeightSync`: the public entry point. Connect engines once, then `await sync.push(model)` every step."""

from __future__ import annotations

import asyncio
import inspect
import math
import operator
import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from . import pipeline
from .engines.base import Engine
from .errors import EngineError, PushError, PushTimeout, StreamSyncError, ValidationError
from .log import get_logger
from .metrics import DEFAULT as DEFAULT_METRICS
from .metrics import Metrics
from .pack import dtype_name, fusions_from_json
from .pipeline.stages import first_push_error
from .plan.check import nonfinite, vocab_hint
from .plan.chunk import ChunkPlan
from .plan.chunking import split_layers
from .report import ChunkDone, GiB, MiB, PushReport
from .sources import Source, as_source
from .trace import Trace, watching_gc
from .transports.base import Transport, transport_class

if TYPE_CHECKING:
    from .trace.viewer import LiveViewer


class WeightSync:
    """Streams a model's weights into inference engines.

    engines:      where weights go (in-process vLLM, `vllm serve` over HTTP, receiver processes). Empty on
                  trainer ranks that only take part in gathers (Megatron TP/PP/EP ranks other than the sender).
    transport:    "auto" (shared memory for CPU engines, CUDA IPC for colocated GPU engines, the collective
                  transport for engines on other hosts, such as Ray actors on other nodes; per engine), "shm",
                  "cuda_ipc", "collective", or a Transport instance.
    chunk_bytes:  byte budget per chunk (default 1 GiB on GPU, 64 MiB on CPU): bounds the bytes a chunk packs.
                  Tensors a transport sends by reference (CUDA IPC one copy) fill its own budget instead.
    max_inflight: credit window: chunks alive anywhere in the pipeline at once.
    timeout:      seconds any one wait may take (a stage on one chunk, an engine call).
    abort_timeout: seconds ending a failed round may take per engine (default min(10, timeout)): a failed
                  push raises within `timeout` plus this, not twice the timeout.
    trace_dir:    where each push writes its Chrome-trace JSON (default: none written).
    trace_live:   serve the trace viewer from this process and stream every push's spans to it while the
                  push runs: True (127.0.0.1:8765) or "HOST:PORT" (port 0 picks one); see `viewer_url`.
    faults:       {stage: chunk} raises an InjectedFault there; for testing error paths only.
    reuse_plan:   keep the source and chunk plan for the next push of the same model (see `plan`).
    on_chunk:     called with a `ChunkDone` after each chunk was acknowledged and freed (sender only).
    on_push:      called with the `PushReport` after each successful push (every rank).
                  A hook that raises is logged as a warning; it does not fail the push.
    metrics:      where Prometheus metrics go (default `streamsync.metrics.DEFAULT`); None records none.

    One event loop for the sync's life: engines keep connections bound to the loop `connect` ran in. From
    synchronous code use `BlockingWeightSync`, not `anyio.run(sync.push, ...)` per step.
    check_finite: refuse a push whose weights hold NaN or inf, naming the tensors, before any byte moves
                  (default). One reduction per tensor on this rank (a few ms for an 8B model on an H200,
                  ~0.1 s per GB on CPU); False skips it. A Megatron rank that finds one raises at once; the
                  sender then fails at its gather timeout.
    engine_layout: engines that say which of their tensors are fused (`fused_layout()`: vLLM-style
                  `qkv_proj`, `gate_up_proj`, stacked MoE experts `w13_weight`/`w2_weight`) get each run of
                  packed HF tensors that makes up one of them as that one tensor: an MoE layer arrives as a
                  few large tensors instead of hundreds. The bytes are the same; other engines keep HF names.
    reset_prefix_cache: after every engine finished the round, reset its prefix cache, so no later request
                  reuses KV computed under the old weights (default). With False, a request whose prompt
                  shares a cached prefix (one cache block or more) with an earlier one is answered from KV
                  of the old weights: its logprobs are those of neither model. See README, "What a push
                  guarantees".
    """

    def __init__(
        self,
        engines: Sequence[Engine] = (),
        transport: str | Transport = "auto",
        *,
        chunk_bytes: int | None = None,
        max_inflight: int = 4,
        timeout: float = 120.0,
        abort_timeout: float | None = None,
        trace_dir: str | os.PathLike | None = None,
        faults: dict[str, int] | None = None,
        source_options: dict[str, Any] | None = None,
        reuse_plan: bool = True,
        on_chunk: Callable[[ChunkDone], object] | None = None,
        on_push: Callable[[PushReport], object] | None = None,
        metrics: Metrics | None = DEFAULT_METRICS,
        reset_prefix_cache: bool = True,
        check_finite: bool = True,
        trace_live: bool | str = False,
        engine_layout: bool = True,
    ) -> None:
        if max_inflight < 1:
            raise ValidationError(f"max_inflight must be >= 1, got {max_inflight}")
        if not timeout > 0:
            raise ValidationError(f"timeout must be a positive number of seconds, got {timeout}")
        if abort_timeout is not None and not abort_timeout > 0:
            raise ValidationError(f"abort_timeout must be a positive number of seconds, got {abort_timeout}")
        if chunk_bytes is not None and chunk_bytes <= 0:
            raise ValidationError(f"chunk_bytes must be positive, got {chunk_bytes}")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValidationError(f"engine names must be unique, got {names}")
        self.engines = list(engines)
        self._transport_arg = transport
        self.transport: Transport | None = transport if isinstance(transport, Transport) else None
        self.chunk_bytes = chunk_bytes
        self.max_inflight = max_inflight
        self.timeout = timeout
        self.abort_timeout = min(10.0, timeout) if abort_timeout is None else abort_timeout
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.live: LiveViewer | None = None
        if trace_live:
            from .trace.viewer import LiveViewer

            self.live = LiveViewer(trace_live if isinstance(trace_live, str) else "127.0.0.1:8765",
                                   trace_dir=self.trace_dir)
        self.faults = dict(faults or {})
        self.source_options = dict(source_options or {})
        self.reuse_plan = reuse_plan
        self.reset_prefix_cache = reset_prefix_cache
        self.engine_layout = engine_layout
        self.check_finite = check_finite
        self._plan_cache: tuple[tuple[int | None, ...], object, Source, list[ChunkPlan]] | None = None
        self._checked: dict[int, tuple[ChunkPlan, Sequence[Any]]] = {}  # see pipeline.stages._convert
        self._hold_cache: tuple[list[ChunkPlan], dict[int, list[str]]] | None = None
        #: the last version pushed (or found on the engines at connect); versions only move forward
        self.version = 0
        self._claimed = False  # `version` was pushed or found on an engine (else a first push may use 0)
        self._retry_version: int | None = None  # a failed push's version, which a retry may use again
        #: engine name -> version of the failed push that left part of its weights there. Such an engine
        #: reports itself mixed (`Engine.state()`), not its old version; the next successful push clears it.
        self.mixed: dict[str, int] = {}
        #: engines whose failed round could not be confirmed ended (their abort failed or timed out)
        self.open_rounds: set[str] = set()
        #: this sync's id: receivers refuse a round from another WeightSync while one of ours is open
        self.owner = uuid.uuid4().hex
        self.connected = False
        self._expected: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
        self._lock = anyio.Lock()
        self.log = get_logger()
        self.on_chunk = on_chunk
        self.on_push = on_push
        self.metrics = metrics
        self._loop: object | None = None  # the event loop `connect` ran in

    # -- lifecycle -------------------------------------------------------------------------------------

    async def connect(self) -> None:
        """Pick the transport, set up every engine's receiving half, learn what the engines expect.

        Raises a StreamSyncError (EngineError naming the engine for an unreachable or failing one), having
        closed every engine's connection."""
        if self.connected:
            return
        if self.live is not None:
            await self.live.start()
        if self.engines:
            try:  # where each engine runs decides its transport (Ray actors: same node or not)
                with anyio.fail_after(self.timeout):
                    async with anyio.create_task_group() as tg:
                        for e in self.engines:
                            tg.start_soon(e.locate)
            except BaseException as exc:
                with anyio.CancelScope(shield=True):
                    await self._close_quietly()
                raise self._connect_error(exc) from None
        if self.transport is None:
            self.transport = self._make_transport()
        if self.engines:
            self.log.info("connecting", transport=self.transport.name, engines=[e.name for e in self.engines])
            for e in self.engines:
                e.owner = self.owner
            try:
                await self.transport.connect(self.engines, self.timeout)
                for e in self.engines:
                    with anyio.fail_after(self.timeout):
                        exp = await e.expected_weights()
                    if exp is not None:
                        self._expected[e.name] = exp
                    fused = getattr(e, "fused_layout", None)
                    if fused is not None:  # the engine's own layout, which pushes may convert into
                        with anyio.fail_after(self.timeout):
                            layout = await fused()
                        e.fusions = fusions_from_json(layout) if layout else None
                        e.__dict__.pop("_fused_layouts", None)  # converted layouts of the previous connection
                    with anyio.fail_after(self.timeout):
                        v = await e.get_version()
                    if v is not None:
                        self.version = max(self.version, int(v)) if self._claimed else int(v)
                        self._claimed = True
                        if self.metrics is not None:
                            self.metrics.engine_version.labels(engine=e.name).set(int(v))
            except BaseException as exc:
                with anyio.CancelScope(shield=True):
                    await self._close_quietly()
                raise self._connect_error(exc) from None
        self._loop = _event_loop()
        self.connected = True

    def _check_loop(self) -> None:
        """Engine connections, locks and sessions belong to the loop `connect` ran in: refuse another one
        with a message saying what to do, rather than fail every other push with 'Event loop is closed'."""
        if self.connected and self.engines and self._loop is not None and _event_loop() is not self._loop:
            raise StreamSyncError(
                "this WeightSync was connected in another event loop (its engine connections belong to it); "
                "keep one loop for its life (one anyio.run/asyncio.run around the training loop), or use "
                "streamsync.BlockingWeightSync from synchronous code")

    def _connect_error(self, exc: BaseException) -> BaseException:
        leaf = first_push_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if isinstance(leaf, StreamSyncError) or not isinstance(leaf, Exception):
            return leaf  # EngineError names the engine; cancellation stays cancellation
        names = ",".join(e.name for e in self.engines)
        if isinstance(leaf, TimeoutError):
            return EngineError(names, f"connect: no reply in {self.timeout:.1f} s")
        return EngineError(names, f"connect failed: {type(leaf).__name__}: {leaf}")

    async def _close_quietly(self) -> None:
        for closing in ([self.transport] if self.transport is not None else []) + self.engines:
            try:
                with anyio.fail_after(self.abort_timeout):
                    await closing.close()
            except Exception as err:
                self.log.warning("close failed", error=str(err))

    def _make_transport(self) -> Transport:
        """The transport `transport=` names; for "auto", by placement: engines on this host get shared memory
        (CPU) or CUDA IPC (GPU), engines elsewhere (`Engine.remote`) the collective transport, rendezvous on
        the address they give (`Engine.rendezvous_addr`); both kinds at once get a `MixedTransport`."""
        from .transports.collective.sender import CollectiveTransport
        from .transports.mixed import MixedTransport

        addr = next((e.rendezvous_addr for e in self.engines if e.rendezvous_addr), None)

        def collective() -> CollectiveTransport:
            return CollectiveTransport(master_addr=addr) if addr else CollectiveTransport()

        if isinstance(self._transport_arg, str) and self._transport_arg != "auto":
            return collective() if self._transport_arg == "collective" else transport_class(self._transport_arg)()
        near = [e for e in self.engines if not e.remote]
        far = [e for e in self.engines if e.remote]
        if not far:
            return transport_class(self._local_kind(near))()
        lost = [e.name for e in far if not e.rendezvous_addr]
        if lost:
            raise ValidationError(f"engines {lost} run on another host but give no address of this one to meet at: "
                                  "pass transport=CollectiveTransport(master_addr=<this host's address>)")
        if not near:
            return collective()
        return MixedTransport(transport_class(self._local_kind(near))(), collective())

    @staticmethod
    def _local_kind(engines: Sequence[Engine]) -> str:
        kinds = {e.device.split(":")[0] for e in engines}
        if kinds <= {"cpu"}:
            return "shm"
        if kinds <= {"cuda"}:
            return "cuda_ipc"
        raise ValidationError(f"cannot choose a transport for engines on {sorted(kinds)}: pass transport=")

    @property
    def viewer_url(self) -> str | None:
        """The live trace viewer's page (with `trace_live`, once connected)."""
        return self.live.url if self.live is not None else None

    async def close(self) -> None:
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

    # -- push ------------------------------------------------------------------------------------------

    def plan(self, model: object) -> tuple[Source, list[ChunkPlan]]:
        """The source and chunk plan a push of `model` would use (no bytes move).

        Both are kept for the next push of the same model object (the same module, or a list of the same
        chunks): building them walks every parameter (and, for a sharded Megatron model, exchanges metadata),
        which costs milliseconds per push. Pass `reuse_plan=False`, or call `forget()`, after replacing
        modules or changing parameter shapes; in-place updates and `param.data = ...` need neither.
        """
        # The budgets are part of the key: `chunk_bytes` (and the transport's) may change between pushes.
        ref_bytes = getattr(self.transport, "ref_chunk_bytes", None)  # set where tensors may go by reference
        key = (tuple(map(id, model)) if isinstance(model, list | tuple) else (id(model),)) + (self.chunk_bytes,
                                                                                               ref_bytes)
        if self.reuse_plan and self._plan_cache is not None and self._plan_cache[0] == key:
            _, _, source, plans = self._plan_cache
            return source, plans
        source = as_source(model, **self.source_options)
        budget = self.chunk_bytes or (GiB if source.device.type == "cuda" else 64 * MiB)
        if ref_bytes and "ref_bytes" in inspect.signature(source.plan).parameters:
            plans = source.plan(budget, ref_bytes=max(int(ref_bytes), budget))
        else:
            plans = source.plan(budget)
        self._validate(plans)
        if self.reuse_plan:  # the model itself is kept too, so its id cannot be reused by another object
            self._plan_cache = (key, model, source, plans)
        return source, plans

    def _hold(self, plans: list[ChunkPlan]) -> dict[int, list[str]]:
        if self._hold_cache is None or self._hold_cache[0] is not plans:
            self._hold_cache = (plans, split_layers([p.names for p in plans]))
        return self._hold_cache[1]

    def forget(self) -> None:
        """Drop the cached source and plan: the next push plans again."""
        self._plan_cache = None

    def _validate(self, plans: Sequence[ChunkPlan]) -> None:
        if not plans:
            raise ValidationError("nothing to push: the source planned no chunks")
        seen: dict[str, int] = {}
        parts: set[tuple[str, int]] = set()
        for p in plans:
            for s in p.specs:
                if s.part is not None and s.part[0] > 0 and (s.name, s.part[0]) not in parts:
                    parts.add((s.name, s.part[0]))  # a later part of a tensor split by rows
                    continue
                if s.name in seen:
                    raise ValidationError(f"tensor {s.name!r} appears in chunks {seen[s.name]} and {p.index}")
                seen[s.name] = p.index
        for engine, expected in self._expected.items():
            problems = []
            for p in plans:
                for s in p.specs:
                    exp = expected.get(s.name)
                    if exp is None:
                        problems.append(f"unknown parameter {s.name!r} (chunk {p.index})")
                    elif exp != (dtype_name(s.dtype), s.full_shape):
                        problems.append(f"parameter {s.name!r} (chunk {p.index}) is {dtype_name(s.dtype)}"
                                        f"{s.full_shape}, engine holds {exp[0]}{exp[1]}")
            missing = sorted(set(expected) - set(seen))
            if missing:
                problems.append(f"{len(missing)} parameter(s) missing from the push, e.g. {missing[:3]}")
            if problems:
                more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
                raise ValidationError(f"model does not match engine {engine!r}: " + "; ".join(problems[:5]) + more
                                      + vocab_hint(plans, expected))

    def _next_version(self, version: object) -> int:
        """The version a push will claim: given, or the previous + 1. Versions are non-negative integers
        that move forward; a failed push's version may be used again (a retry), a pushed one may not (two
        different weights would share one version)."""
        if version is None:
            return self._retry_version if self._retry_version is not None else self.version + 1
        if isinstance(version, bool):
            raise ValidationError(f"version must be an integer, got {version!r}")
        try:
            v = operator.index(version)  # ints (and numpy ints), not "7" or 7.5
        except TypeError:
            raise ValidationError(f"version must be an integer, got {type(version).__name__} {version!r}") from None
        if v < 0:
            raise ValidationError(f"version must be >= 0, got {v}")
        if self._claimed and v <= self.version and v != self._retry_version:
            raise ValidationError(f"version {v} does not move forward: version {self.version} was already pushed "
                                  "(or found on the engines); pass a larger one, or assign sync.version (the last "
                                  "version: the next must be larger) to restart the numbering")
        return v

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
        async with self._lock:  # one push at a time: rounds on an engine must not interleave
            if not self.connected:
                await self.connect()
            for e in self.engines:  # an engine client shared by two syncs carries the pushing one's id
                e.owner = self.owner
            version = self._next_version(version)
            push_id = uuid.uuid4().hex[:8]
            source, plans = self.plan(model)
            if self.engines and not source.is_sender:
                raise ValidationError(
                    f"rank {_rank()} was given engines {[e.name for e in self.engines]} but does not send: only "
                    "global rank 0 sends a Megatron model; pass engines=[] on the other ranks")
            if self.check_finite:
                bad = await anyio.to_thread.run_sync(nonfinite, list(source.local_tensors()))
                if bad:
                    more = f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""
                    raise ValidationError(f"refusing to push non-finite weights (NaN or inf) in {bad[:5]}{more}; "
                                          "no engine was touched (check_finite=False skips this check)")
            source.begin_push()
            trace = Trace(push_id)
            trace.meta.update(version=version, chunks=len(plans), max_inflight=window,
                              transport=getattr(self.transport, "name", None))
            total = sum(p.nbytes for p in plans)
            trace.meta.update(bytes=total, engines=[e.name for e in self.engines])
            log = (self.log if source.is_sender else _quiet(self.log)).bind(push=push_id, version=version)
            log.info("push start", chunks=len(plans), mib=round(total / MiB, 1), window=window)
            trace.begin()  # the report's seconds and the trace's wall time are one measurement
            if self.live is not None:
                self.live.add(trace)
            job = pipeline.Push(
                push_id=push_id, version=version, source=source, transport=self.transport,
                engines=self.engines, plans=plans, trace=trace, max_inflight=window,
                timeout=self.timeout, faults=self.faults, hold=self._hold(plans), owner=self.owner,
                on_chunk=self._chunk_hook(push_id, version, plans, log), engine_layout=self.engine_layout,
                checked=self._checked,
            )
            sending = source.is_sender and bool(self.engines)
            push_range = pipeline.ProfilerRange(f"streamsync.push v{version}").__enter__()
            rounds = _Rounds()
            cache_reset: dict[str, bool] = {}
            limit = anyio.CancelScope(deadline=math.inf if time_limit is None else anyio.current_time() + time_limit)
            gc_watch = watching_gc(trace)
            gc_watch.__enter__()
            try:
                with limit:
                    if sending:  # gathers and packs need no engine: they start while the engines open the round
                        job.started = anyio.Event()
                        await self._run_started(job, rounds)
                        await self._each_engine("finish_update", version, stage="finish", done=rounds.finished)
                        if self.reset_prefix_cache:
                            cache_reset = await self._reset_caches(log)
                    else:
                        await pipeline.run(job)
            except BaseException as e:  # a PushError, or a cancellation: the rounds end either way
                if self.metrics is not None and isinstance(e, PushError):
                    self.metrics.observe_failure(e.stage)
                await self._failed(e, job, rounds, log, trace)
                raise
            finally:
                push_range.__exit__()
                gc_watch.__exit__(None, None, None)
            if limit.cancelled_caught:
                err = PushTimeout(f"push did not finish within {time_limit:.1f} s ({_running(job)})",
                                  stage=_running_stage(job), chunk=_running_chunk(job), push_id=push_id)
                if self.metrics is not None:
                    self.metrics.observe_failure(err.stage)
                await self._failed(err, job, rounds, log, trace)
                raise err
            seconds = trace.end()
            self.version, self._claimed = version, True
            self._retry_version = None
            for e in self.engines:  # every tensor was overwritten and every round finished
                self.mixed.pop(e.name, None)
                self.open_rounds.discard(e.name)
            report = PushReport(
                push_id=push_id, version=version, seconds=seconds, bytes=total, chunks=len(plans),
                stage_seconds=trace.busy_seconds(), peak_bytes_inflight=job.peak_bytes,
                max_chunks_alive=trace.max_alive(), collectives=source.collectives,
                engines=[e.name for e in self.engines], cache_reset=cache_reset, trace=trace,
                gc_ms=trace.counts.get("gc_us", 0) / 1e3,
            )
            if report.gc_ms >= 20 and report.gc_ms > 0.2 * seconds * 1e3:
                log.warning("garbage collection paused this push", gc_ms=round(report.gc_ms, 1),
                            push_ms=round(seconds * 1e3, 1),
                            fix="call gc.freeze() once the model is built: objects alive then are not scanned again")
            trace.count("collectives", source.collectives)
            report.trace_path = self._write_trace(trace)
            log.info("push done", ms=round(seconds * 1e3, 1), mib=round(total / MiB, 1), gbps=round(report.gbps, 2),
                     chunks=len(plans), stage_ms={k: round(v * 1e3, 1) for k, v in report.stage_seconds.items()})
            if self.metrics is not None and source.is_sender:
                self.metrics.observe_push(report)
            if self.on_push is not None:
                _call_hook(self.on_push, report, log, "on_push")
            return report

    def _chunk_hook(self, push_id: str, version: int, plans: Sequence[ChunkPlan],
                    log: Any) -> Callable[[int, int], None]:
        hook = self.on_chunk

        def done(i: int, n: int) -> None:
            log.debug("chunk released", chunk=i, of=n)
            if hook is not None:
                p = plans[i]
                _call_hook(hook, ChunkDone(push_id, version, i, n, p.nbytes, len(p.specs)), log, "on_chunk")

        return done

    async def _failed(self, err: BaseException, job: pipeline.Push, rounds: _Rounds, log: Any,
                      trace: Trace) -> None:
        """A push failed or was cancelled: end every round it opened and record what the engines hold."""
        with anyio.CancelScope(shield=True):
            if isinstance(err, PushError):
                log.error("push failed", stage=err.stage, chunk=err.chunk, receiver=err.receiver, error=str(err))
            else:
                log.warning("push cancelled", running=_running(job), error=type(err).__name__)
            version = job.version
            # Engines that owe the failed chunk's acknowledgement did not answer within the timeout: asking them
            # to abort would hold the error back by another one. They keep the round open (open_rounds).
            unresponsive = err.unresponsive if isinstance(err, PushError) else frozenset()
            to_abort = [e for e in self.engines if e.name in rounds.opened and e.name not in rounds.finished]
            ended = (await self._abort([e for e in to_abort if e.name not in unresponsive], version, log)
                     if to_abort else set())
            for e in to_abort:
                if e.name in ended:
                    self.open_rounds.discard(e.name)
                else:
                    self.open_rounds.add(e.name)
                if job.sent_any:
                    self.mixed[e.name] = version
            for name in rounds.finished:  # these report `version` now, whole
                self.mixed.pop(name, None)
            if rounds.finished:  # some engines report `version` now: never reuse the number
                self.version, self._claimed = max(self.version, version), True
                self._retry_version = None
            else:
                self._retry_version = version
            if self.mixed:
                log.warning("engines hold mixed weights until the next successful push", mixed=sorted(self.mixed))
            if isinstance(err, PushError):  # drawn by the viewer: the failing stage, chunk, engine and message
                trace.fail(err.stage, err.chunk, err.receiver, err.message)
            else:
                trace.fail(_running_stage(job), _running_chunk(job), None, f"cancelled ({_running(job)})")
            self._write_trace(trace)

    async def _run_started(self, job: pipeline.Push, rounds: _Rounds) -> None:
        """start_update on every engine, concurrently with the pipeline; the first send waits for it."""
        assert job.started is not None
        started = job.started

        async def start() -> None:
            # Shielded: a pipeline failure or a cancellation must not cut an engine's start_update in half
            # (the abort that follows would meet a half-opened round). Each engine call has its own timeout.
            with anyio.CancelScope(shield=True):
                await self._each_engine("start_update", stage="start", done=rounds.opened, maybe=rounds.opened)
            started.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(start)
                await pipeline.run(job)
        except BaseExceptionGroup as eg:
            raise first_push_error(eg) from None

    async def _reset_caches(self, log: Any) -> dict[str, bool]:
        """Reset every engine's prefix cache after a finished round. The new version is already in place, so
        a failure here does not fail the push: it is reported (report.cache_reset, a warning)."""
        done: dict[str, bool] = {}

        async def one(e: Engine) -> None:
            try:
                with anyio.fail_after(self.timeout):
                    done[e.name] = await e.reset_cache()
            except Exception as err:
                log.warning("prefix cache reset failed", engine=e.name, error=str(err))
                done[e.name] = False
            if not done[e.name]:
                log.warning("prefix cache not reset: requests kept across the push still hold cache blocks; "
                            "cached prefixes may be served from KV of the old weights until the next reset "
                            "(use paused(clear_cache=True) or sync.reset_caches())", engine=e.name)

        async with anyio.create_task_group() as tg:
            for e in self.engines:
                tg.start_soon(one, e)
        return done

    async def reset_caches(self) -> dict[str, bool]:
        """Reset every engine's prefix cache now (e.g. once requests kept across a push have finished)."""
        return await self._reset_caches(self.log)

    async def _abort(self, engines: Sequence[Engine], version: int, log: Any) -> set[str]:
        """End a failed round on `engines` (shielded, `abort_timeout` each); the names whose round ended."""
        ended: set[str] = set()

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

    async def _each_engine(self, method: str, *args: Any, stage: str, engines: Sequence[Engine] | None = None,
                           done: set[str] | None = None, maybe: set[str] | None = None) -> None:
        """`method` on every engine concurrently. `done` collects the engines whose call returned; `maybe`
        those whose call timed out or was cut short (its effect is unknown)."""
        async def one(e: Engine) -> None:
            try:
                with anyio.fail_after(self.timeout):
                    await getattr(e, method)(*args)
            except TimeoutError:
                if maybe is not None:
                    maybe.add(e.name)
                raise PushError(f"{method}: no reply in {self.timeout:.1f} s", stage=stage, receiver=e.name) from None
            except Exception as err:
                raise PushError(f"{method}: {err}", stage=stage, receiver=e.name) from err
            except BaseException:
                if maybe is not None:
                    maybe.add(e.name)
                raise
            if done is not None:
                done.add(e.name)

        try:
            async with anyio.create_task_group() as tg:
                for e in self.engines if engines is None else engines:
                    tg.start_soon(one, e)
        except BaseExceptionGroup as eg:
            raise first_push_error(eg) from None

    def _write_trace(self, trace: Trace) -> str | None:
        if self.trace_dir is None:
            return None
        return str(trace.write(self.trace_dir / f"push-{trace.push_id}-v{trace.meta.get('version')}.trace.json"))

    # -- partial rollout -------------------------------------------------------------------------------

    @asynccontextmanager
    async def paused(self, mode: str = "keep", clear_cache: bool = False, *,
                     resume_on_failure: bool = False) -> AsyncIterator[None]:
        """Pause generation on every engine for the body (e.g. a push), then resume.

        mode "keep" freezes in-flight requests (with clear_cache=False they keep their KV cache and continue
        on the new weights), "wait" drains them, "abort" ends them.

        When the body raised (or was cancelled), engines a failed push left holding mixed weights (`mixed`)
        or with a round that could not be ended (`open_rounds`) stay paused, so they serve nothing from
        half-new weights; the others resume. `resume_on_failure=True` resumes every engine anyway.
        """
        if mode not in ("keep", "wait", "abort"):
            raise ValidationError(f"pause mode must be keep, wait or abort, got {mode!r}")
        try:
            await self._each_engine("pause", mode, clear_cache, stage="pause")
        except BaseException:  # engines that did pause must not stay paused
            with anyio.CancelScope(shield=True):
                try:
                    await self._each_engine("resume", stage="resume")
                except PushError as err:
                    self.log.warning("resume after a failed pause failed", error=str(err))
            raise
        failed = True
        try:
            yield
            failed = False
        finally:
            with anyio.CancelScope(shield=True):
                keep = set() if not failed or resume_on_failure else set(self.mixed) | self.open_rounds
                if keep:
                    self.log.warning("engines left paused after a failed push (mixed weights or an open round); "
                                     "a successful push and resume(), or resume_on_failure=True, serves again",
                                     engines=sorted(keep))
                await self._each_engine("resume", stage="resume",
                                        engines=[e for e in self.engines if e.name not in keep])


def _call_hook(hook: Callable[[Any], object], arg: object, log: Any, name: str) -> None:
    try:
        hook(arg)
    except Exception as err:  # the weights moved: a hook's own bug must not fail the push
        log.warning(f"{name} hook failed", error=f"{type(err).__name__}: {err}")


def _event_loop() -> object | None:
    """The running event loop (asyncio) or trio run, as an identity."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        pass
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            return trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
    return None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _quiet(log: Any) -> Any:
    """Ranks that only take part in gathers log warnings and errors only, unless STREAMSYNC_LOG_ALL_RANKS=1:
    N ranks repeating the sender's progress lines bury it."""
    if os.environ.get("STREAMSYNC_LOG_ALL_RANKS") == "1":
        return log
    from .log import quiet_logger

    return quiet_logger()


@dataclass
class _Rounds:
    """Which engines a push opened a round on (or may have: a start cut short), and finished."""

    opened: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)


def _where(job: pipeline.Push) -> dict[str, int]:
    """stage -> chunk of the stages at work when the push was stopped."""
    return {stage: chunk for stage, (chunk, _) in job.busy.items()} or dict(job.cut)


def _running_stage(job: pipeline.Push) -> str:
    return next(iter(_where(job)), "start" if job.started is not None and not job.started.is_set() else "finish")


def _running_chunk(job: pipeline.Push) -> int | None:
    return next(iter(_where(job).values()), None)


def _running(job: pipeline.Push) -> str:
    """What a push was doing, for a timeout or cancellation message."""
    where = _where(job)
    if where:
        return ", ".join(f"{stage} of chunk {chunk} was running" for stage, chunk in where.items())
    return f"{_running_stage(job)} was running"
