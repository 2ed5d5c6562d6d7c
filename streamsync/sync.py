"""`WeightSync`: the public entry point. Connect engines once, then `await sync.push(model)` every step."""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import anyio

from . import pipeline
from .chunking import split_layers
from .engines.base import Engine
from .errors import EngineError, PushError, StreamSyncError, ValidationError
from .log import get_logger
from .metrics import DEFAULT as DEFAULT_METRICS
from .metrics import Metrics
from .pack import dtype_name
from .sources import Source, as_source
from .sources.base import ChunkPlan
from .trace import Trace
from .transports.base import Transport, transport_class

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ChunkDone:
    """What `on_chunk` receives once a chunk was acknowledged by every engine and its buffer freed."""

    push_id: str
    version: int
    chunk: int
    chunks: int
    bytes: int
    tensors: int


@dataclass
class PushReport:
    """What one push did. `stage_seconds` is each stage's busy time (sum of its spans)."""

    push_id: str
    version: int
    seconds: float
    bytes: int
    chunks: int
    stage_seconds: dict[str, float]
    peak_bytes_inflight: int
    max_chunks_alive: int
    collectives: int
    engines: list[str]
    #: engine -> whether its prefix cache was reset after the round (absent when `reset_prefix_cache=False`)
    cache_reset: dict[str, bool] = field(default_factory=dict)
    trace_path: str | None = None
    trace: Trace | None = field(default=None, repr=False)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}

    def summary(self) -> str:
        busy = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.stage_seconds.items())
        return (f"push {self.push_id} v{self.version}: {self.bytes / MiB:.1f} MiB in {self.chunks} chunks, "
                f"{self.seconds * 1e3:.0f} ms ({self.gbps:.2f} GB/s) to {len(self.engines)} engine(s); "
                f"busy: {busy}; peak in flight {self.peak_bytes_inflight / MiB:.1f} MiB"
                + (f"; trace {self.trace_path}" if self.trace_path else ""))


def nonfinite(tensors: Sequence[tuple[str, Any]]) -> list[str]:
    """Names of the floating tensors holding NaN or inf. One float32 sum per tensor (NaN and inf propagate
    through it; a sum of finite weights overflowing float32 would need weights near 1e29) and one host sync:
    no tensor-sized temporaries, unlike `isfinite(t).all()`."""
    import torch

    named = [(n, t) for n, t in tensors if t.is_floating_point() and t.numel()]
    if not named:
        return []
    sums = [t.sum(dtype=torch.float32) if t.element_size() >= 2 else t.float().sum() for _, t in named]
    flags = torch.stack([x.to(sums[0].device) for x in sums]).isfinite().tolist()
    return [n for (n, _), ok in zip(named, flags, strict=True) if not ok]


class WeightSync:
    """Streams a model's weights into inference engines.

    engines:      where weights go (in-process vLLM, `vllm serve` over HTTP, receiver processes). Empty on
                  trainer ranks that only take part in gathers (Megatron TP/PP/EP ranks other than the sender).
    transport:    "auto" (shared memory for CPU engines, CUDA IPC for colocated GPU engines), "shm",
                  "cuda_ipc", "collective", or a Transport instance.
    chunk_bytes:  byte budget per chunk (default 1 GiB on GPU, 64 MiB on CPU).
    max_inflight: credit window: chunks alive anywhere in the pipeline at once.
    timeout:      seconds any one wait may take (a stage on one chunk, an engine call).
    trace_dir:    where each push writes its Chrome-trace JSON (default: none written).
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
        trace_dir: str | os.PathLike | None = None,
        faults: dict[str, int] | None = None,
        source_options: dict[str, Any] | None = None,
        reuse_plan: bool = True,
        on_chunk: Callable[[ChunkDone], object] | None = None,
        on_push: Callable[[PushReport], object] | None = None,
        metrics: Metrics | None = DEFAULT_METRICS,
        reset_prefix_cache: bool = True,
        check_finite: bool = True,
    ) -> None:
        if max_inflight < 1:
            raise ValidationError(f"max_inflight must be >= 1, got {max_inflight}")
        if not timeout > 0:
            raise ValidationError(f"timeout must be a positive number of seconds, got {timeout}")
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
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.faults = dict(faults or {})
        self.source_options = dict(source_options or {})
        self.reuse_plan = reuse_plan
        self.reset_prefix_cache = reset_prefix_cache
        self.check_finite = check_finite
        self._plan_cache: tuple[tuple[int | None, ...], object, Source, list[ChunkPlan]] | None = None
        self._hold_cache: tuple[list[ChunkPlan], dict[int, list[str]]] | None = None
        self.version = 0
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
        """Pick the transport, set up every engine's receiving half, learn what the engines expect."""
        if self.connected:
            return
        if self.transport is None:
            self.transport = transport_class(self._resolve_transport())()
        if self.engines:
            self.log.info("connecting", transport=self.transport.name, engines=[e.name for e in self.engines])
            try:
                await self.transport.connect(self.engines, self.timeout)
                for e in self.engines:
                    with anyio.fail_after(self.timeout):
                        exp = await e.expected_weights()
                    if exp is not None:
                        self._expected[e.name] = exp
                    with anyio.fail_after(self.timeout):
                        v = await e.get_version()
                    if v is not None:
                        self.version = max(self.version, int(v))
                        if self.metrics is not None:
                            self.metrics.engine_version.labels(engine=e.name).set(int(v))
            except BaseException as exc:
                # One error naming the engine, not an ExceptionGroup from the transport's task group, and no
                # session left open (HTTP clients, sockets, a half-built process group).
                with anyio.CancelScope(shield=True):
                    await self._close_quietly()
                if isinstance(exc, TimeoutError):
                    raise EngineError(",".join(e.name for e in self.engines),
                                      f"connect timed out after {self.timeout}s") from None
                if isinstance(exc, BaseExceptionGroup):
                    err = _connect_error(exc, self.engines)
                    raise err from err.__cause__
                raise
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

    def _resolve_transport(self) -> str:
        if isinstance(self._transport_arg, str) and self._transport_arg != "auto":
            return self._transport_arg
        kinds = {e.device.split(":")[0] for e in self.engines}
        if kinds <= {"cpu"}:
            return "shm"
        if kinds <= {"cuda"}:
            return "cuda_ipc"
        raise ValidationError(f"cannot choose a transport for engines on {sorted(kinds)}: pass transport=")

    async def close(self) -> None:
        if self.transport is not None:
            await self.transport.close()
        for e in self.engines:
            await e.close()
        self.connected = False

    async def _close_quietly(self) -> None:
        try:
            await self.close()
        except Exception as err:  # closing after a failure: report, don't mask the failure
            self.log.warning("close after a failed connect failed", error=f"{type(err).__name__}: {err}")

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
        # The chunk budget is part of the key: `chunk_bytes` may be changed between pushes.
        key = (tuple(map(id, model)) if isinstance(model, list | tuple) else (id(model),)) + (self.chunk_bytes,)
        if self.reuse_plan and self._plan_cache is not None and self._plan_cache[0] == key:
            _, _, source, plans = self._plan_cache
            return source, plans
        source = as_source(model, **self.source_options)
        budget = self.chunk_bytes or (GiB if source.device.type == "cuda" else 64 * MiB)
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
                                      + _vocab_hint(plans, expected))

    async def push(self, model: object, *, version: int | None = None,
                   max_inflight: int | None = None) -> PushReport:
        """Stream `model`'s weights into every engine; return when all acknowledged the last chunk.

        On success every engine reports `version` (default: previous + 1). On failure raises PushError and
        no engine reports the new version. `max_inflight` overrides the window for this push.
        """
        window = self.max_inflight if max_inflight is None else int(max_inflight)
        if window < 1:
            raise ValidationError(f"max_inflight must be >= 1, got {window}")
        self._check_loop()
        async with self._lock:  # one push at a time: rounds on an engine must not interleave
            if not self.connected:
                await self.connect()
            version = self.version + 1 if version is None else int(version)
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
            log = (self.log if source.is_sender else _quiet(self.log)).bind(push=push_id, version=version)
            log.info("push start", chunks=len(plans), mib=round(total / MiB, 1), window=window)
            t0 = time.perf_counter()
            job = pipeline.Push(
                push_id=push_id, version=version, source=source, transport=self.transport,
                engines=self.engines, plans=plans, trace=trace, max_inflight=window,
                timeout=self.timeout, faults=self.faults, hold=self._hold(plans),
                on_chunk=self._chunk_hook(push_id, version, plans, log),
            )
            sending = source.is_sender and bool(self.engines)
            push_range = pipeline.ProfilerRange(f"streamsync.push v{version}").__enter__()
            cache_reset: dict[str, bool] = {}
            try:
                if sending:  # gathers and packs need no engine: they start while the engines open the round
                    job.started = anyio.Event()
                    await self._run_started(job)
                    await self._each_engine("finish_update", version, stage="finish")
                    if self.reset_prefix_cache:
                        cache_reset = await self._reset_caches(log)
                else:
                    await pipeline.run(job)
            except PushError as e:
                log.error("push failed", stage=e.stage, chunk=e.chunk, receiver=e.receiver, error=str(e))
                if self.metrics is not None:
                    self.metrics.observe_failure(e.stage)
                if sending:
                    await self._abort_all(log, skip=e.unresponsive)
                if e.stage == "finish":  # some engines may report `version` now: never reuse the number
                    self.version = max(self.version, version)
                self._write_trace(trace)
                raise
            finally:
                push_range.__exit__()
            seconds = time.perf_counter() - t0
            self.version = version
            report = PushReport(
                push_id=push_id, version=version, seconds=seconds, bytes=total, chunks=len(plans),
                stage_seconds=trace.busy_seconds(), peak_bytes_inflight=job.peak_bytes,
                max_chunks_alive=trace.max_alive(), collectives=source.collectives,
                engines=[e.name for e in self.engines], cache_reset=cache_reset, trace=trace,
            )
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

    async def _run_started(self, job: pipeline.Push) -> None:
        """start_update on every engine, concurrently with the pipeline; the first send waits for it."""
        assert job.started is not None
        started = job.started

        async def start() -> None:
            # Shielded: a pipeline failure must not cut an engine's start_update in half (the abort that
            # follows would meet a half-opened round). Each engine call has its own timeout.
            with anyio.CancelScope(shield=True):
                await self._each_engine("start_update", stage="start")
            started.set()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(start)
                await pipeline.run(job)
        except BaseExceptionGroup as eg:
            raise pipeline._first_push_error(eg) from None

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

    async def _abort_all(self, log: Any, skip: frozenset[str] = frozenset()) -> None:
        """End the failed round on every engine (shielded: runs even when the push was cancelled), except
        those in `skip`: they did not answer in time, and waiting for them again would hold the error back
        by another timeout. They never finished the round, so they keep reporting the old version."""
        async def one(e: Engine) -> None:
            try:
                with anyio.fail_after(self.timeout):
                    await e.abort_update()
            except Exception as err:  # the push already failed; report, don't mask its error
                log.warning("abort failed", engine=e.name, error=str(err))

        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for e in self.engines:
                    if e.name not in skip:
                        tg.start_soon(one, e)

    async def _each_engine(self, method: str, *args: Any, stage: str) -> None:
        async def one(e: Engine) -> None:
            try:
                with anyio.fail_after(self.timeout):
                    await getattr(e, method)(*args)
            except TimeoutError:
                raise PushError(f"{method} timed out after {self.timeout}s", stage=stage, receiver=e.name) from None
            except Exception as err:
                raise PushError(f"{method}: {err}", stage=stage, receiver=e.name) from err

        try:
            async with anyio.create_task_group() as tg:
                for e in self.engines:
                    tg.start_soon(one, e)
        except BaseExceptionGroup as eg:
            raise pipeline._first_push_error(eg) from None

    def _write_trace(self, trace: Trace) -> str | None:
        if self.trace_dir is None:
            return None
        return str(trace.write(self.trace_dir / f"push-{trace.push_id}-v{trace.meta.get('version')}.trace.json"))

    # -- partial rollout -------------------------------------------------------------------------------

    @asynccontextmanager
    async def paused(self, mode: str = "keep", clear_cache: bool = False) -> AsyncIterator[None]:
        """Pause generation on every engine for the body (e.g. a push), resume even if the body raised.

        mode "keep" freezes in-flight requests (with clear_cache=False they keep their KV cache and continue
        on the new weights), "wait" drains them, "abort" ends them.
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
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await self._each_engine("resume", stage="resume")




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


_VOCAB_NAMES = ("embed_tokens.weight", "lm_head.weight")


def _vocab_hint(plans: Sequence[ChunkPlan], expected: dict[str, tuple[str, tuple[int, ...]]]) -> str:
    """Megatron pads its vocabulary (to a multiple of `make_vocab_size_divisible_by` x TP): when only
    the row count of an embedding or lm_head differs, say which option drops the padding rows."""
    for p in plans:
        for s in p.specs:
            exp = expected.get(s.name)
            shape = s.full_shape
            if (s.name.endswith(_VOCAB_NAMES) and exp is not None and len(exp[1]) == 2 and len(shape) == 2
                    and exp[1][1] == shape[1] and exp[1][0] != shape[0]):
                return (f". {s.name} has {shape[0]} rows, the engine {exp[1][0]}: a Megatron model pads its "
                        "vocabulary; pass WeightSync(..., source_options={'hf_config': <the served model's config>})"
                        f" (or {{'vocab_size': {exp[1][0]}}}) so the padding rows are dropped")
    return ""


def _connect_error(eg: BaseExceptionGroup, engines: Sequence[Engine]) -> BaseException:
    """The first failure of a group raised while connecting: a StreamSyncError as is (an EngineError names its
    engine), anything else as an EngineError of all engines; cancellation and interrupts pass through."""
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(eg)
    for e in leaves:
        if isinstance(e, StreamSyncError):
            return e
    for e in leaves:
        if not isinstance(e, Exception):
            return e
    first = leaves[0] if leaves else eg
    msg = f"connect failed: {type(first).__name__}: {first}"
    err = EngineError(",".join(e.name for e in engines), msg)
    err.__cause__ = first
    return err
