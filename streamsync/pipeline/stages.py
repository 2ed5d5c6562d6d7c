"""The five stages and the run loop: gather -> convert -> pack -> send -> release, the credit window and
the watchdog."""

from __future__ import annotations

import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from ..engines.base import Engine
from ..errors import EngineError, PushError, ValidationError
from ..pack import Layout, castable, dtype_name, fits, fuse_layout
from ..plan.chunk import ChunkPlan, layout_key
from ..sources.base import Source
from ..trace import Trace
from ..transports.base import SendBuffer
from .job import InjectedFault, Push, Work
from .profiler import ProfilerRange


async def run(push: Push) -> None:
    """Run the pipeline to completion, or raise PushError having freed every buffer."""
    if not push.source.is_sender:
        await _gather_only(push)
        return
    n = push.max_inflight
    credits = anyio.Semaphore(n)
    g_tx, g_rx = anyio.create_memory_object_stream[Work](n)
    c_tx, c_rx = anyio.create_memory_object_stream[Work](n)
    p_tx, p_rx = anyio.create_memory_object_stream[Work](n)
    s_tx, s_rx = anyio.create_memory_object_stream[Work](n)
    assert push.transport is not None
    push.convert_kwargs = _convert_kwargs(push.source)
    note = getattr(push.transport, "note_source", None)
    if note is not None:  # transports that may send the source's own tensors by reference (CUDA IPC)
        note(push.source, push.engines)
    push.transport.begin_push(push.plans, push.push_id)
    ok = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watchdog, push)
            tg.start_soon(_gather, push, credits, g_tx)
            tg.start_soon(_stage, push, "convert", _convert, g_rx, c_tx)
            tg.start_soon(_stage, push, "pack", _pack, c_rx, p_tx)
            tg.start_soon(_stage, push, "send", _send, p_rx, s_tx)
            tg.start_soon(_release, push, credits, s_rx, tg.cancel_scope)
        ok = True
        succeeded = getattr(push.transport, "push_succeeded", None)
        if succeeded is not None:
            succeeded()
    except BaseExceptionGroup as eg:
        raise first_push_error(eg) from None
    finally:
        if not ok:  # a receiver that gave up may still read these: the transport drops them, never reuses
            push.bytes_alive -= sum(b.nbytes for b in push.live.values())
            push.live.clear()
        push.transport.end_push()


def first_push_error(eg: BaseExceptionGroup) -> BaseException:
    leaves: list[BaseException] = []

    def walk(e: BaseException) -> None:
        if isinstance(e, BaseExceptionGroup):
            for x in e.exceptions:
                walk(x)
        else:
            leaves.append(e)

    walk(eg)
    for e in leaves:
        if isinstance(e, PushError):
            return e
    return leaves[0] if leaves else eg


def _wrap(push: Push, stage: str, chunk: int | None, e: Exception) -> PushError:
    if isinstance(e, BaseExceptionGroup):  # fan-out task groups: report the first real failure
        leaf = first_push_error(e)
        e = leaf if isinstance(leaf, Exception) else e
    if isinstance(e, PushError):
        return e
    receiver = e.engine if isinstance(e, EngineError) else None
    msg = f"{type(e).__name__}: {e}" if not isinstance(e, EngineError) else str(e)
    if isinstance(e, TimeoutError):
        msg = f"timed out after {push.timeout:.1f}s"
    err = PushError(msg, stage=stage, chunk=chunk, receiver=receiver, push_id=push.push_id)
    err.__cause__ = e
    if isinstance(e, EngineError) and e.unresponsive:
        err.unresponsive = frozenset(e.engine.split(","))
    return err


async def _watchdog(push: Push) -> None:
    """Fail the push when a stage has worked on one chunk for longer than `push.timeout`."""
    tick = min(1.0, push.timeout / 8)
    while True:
        await anyio.sleep(tick)
        now = time.perf_counter()
        for stage, (chunk, since) in list(push.busy.items()):
            if now - since > push.timeout:
                raise PushError(f"timed out after {push.timeout:.1f}s", stage=stage, chunk=chunk,
                                push_id=push.push_id)


class _Busy:
    """Marks `stage` as working on `chunk` (for the watchdog), records the trace span and a profiler range."""

    __slots__ = ("chunk", "nbytes", "push", "range", "stage", "start")

    def __init__(self, push: Push, stage: str, chunk: int, nbytes: int) -> None:
        self.push, self.stage, self.chunk, self.nbytes = push, stage, chunk, nbytes
        self.range = ProfilerRange(f"streamsync.{stage} #{chunk}")

    def __enter__(self) -> None:
        self.range.__enter__()
        self.start = time.perf_counter()
        self.push.busy[self.stage] = (self.chunk, self.start)

    def __exit__(self, *exc: object) -> None:
        self.push.busy.pop(self.stage, None)
        self.range.__exit__()
        if exc[0] is not None:
            self.push.cut[self.stage] = self.chunk
        t0 = self.push.trace.t0
        self.push.trace.add_span(self.stage, self.chunk, self.start - t0, time.perf_counter() - t0, self.nbytes)


def _maybe_fault(push: Push, stage: str, chunk: int) -> None:
    if push.faults.get(stage) == chunk:
        raise InjectedFault(f"fault injected in {stage} of chunk {chunk}")


async def _gather_only(push: Push) -> None:
    for plan in push.plans:
        try:
            with (anyio.fail_after(push.timeout), push.trace.span("gather", plan.index, plan.nbytes),
                  ProfilerRange(f"streamsync.gather #{plan.index}")):
                _maybe_fault(push, "gather", plan.index)
                await push.source.gather(plan)
        except Exception as e:
            raise _wrap(push, "gather", plan.index, e) from None


async def _gather(push: Push, credits: anyio.Semaphore, out: ObjectSendStream[Work]) -> None:
    async with out:
        for plan in push.plans:
            try:
                # No timeout here: a credit comes back when the oldest chunk is released, and every stage
                # in between has its own timeout.
                await credits.acquire()
                push.chunks_alive += 1
                push.trace.sample("chunks_alive", push.chunks_alive)
                with _Busy(push, "gather", plan.index, plan.nbytes):
                    _maybe_fault(push, "gather", plan.index)
                    gathered = await push.source.gather(plan)
            except Exception as e:
                raise _wrap(push, "gather", plan.index, e) from None
            await out.send(Work(plan, gathered))
            push.trace.sample("queue gather→convert", out.statistics().current_buffer_used)


async def _stage(push: Push, name: str, fn: Callable[[Push, Work], Awaitable[None]],
                 inbox: ObjectReceiveStream[Work], out: ObjectSendStream[Work]) -> None:
    async with inbox, out:
        while True:
            if name == "send":
                push.send_idle = True
            try:
                w = await inbox.receive()
            except anyio.EndOfStream:
                break
            if name == "send":
                push.send_idle = False
                if push.send_took is not None:
                    push.send_took.set()
            if name == "send" and push.started is not None and not push.started.is_set():
                # The engines' start_update runs alongside the first gathers and packs. Not the send stage's
                # time: start has its own timeout per engine. (Once set, no wait: waiting on a set event still
                # yields, and the next chunk's pack would then run before this chunk goes out.)
                await push.started.wait()
            try:
                with _Busy(push, name, w.plan.index, w.plan.nbytes):
                    _maybe_fault(push, name, w.plan.index)
                    await fn(push, w)
            except Exception as e:
                raise _wrap(push, name, w.plan.index, e) from None
            await out.send(w)
            push.trace.sample(f"queue {name}→next", out.statistics().current_buffer_used)
            if name == "pack" and push.send_idle:
                # An idle send stage goes first: its chunk leaves, and while the engines work on it this
                # stage packs the next. Otherwise the loop would run the next (synchronous) pack first, as
                # it did at the start of every push: the first chunk went out only after the second's pack.
                push.send_took = took = anyio.Event()
                try:
                    with anyio.fail_after(push.timeout):
                        await took.wait()
                except TimeoutError as e:
                    raise _wrap(push, "send", w.plan.index, e) from None


def _convert_kwargs(source: Source) -> dict[str, Any]:
    """`cast=False` (pack casts floating tensors) for sources that take it; a Source written against the
    older signature still works."""
    try:
        params = inspect.signature(source.convert).parameters
    except (TypeError, ValueError):
        return {}
    return {"cast": False} if "cast" in params else {}


async def _convert(push: Push, w: Work) -> None:
    tensors = await push.source.convert(w.plan, w.gathered, **push.convert_kwargs)
    w.gathered = None
    last = push.checked.get(w.plan.index)
    if last is None or last[0] is not w.plan or last[1] is not tensors:
        if len(tensors) != len(w.plan.specs):
            raise ValidationError(f"converter returned {len(tensors)} tensors for {len(w.plan.specs)} specs")
        for t, s in zip(tensors, w.plan.specs, strict=True):
            if not castable(t.dtype, s.dtype) or (t.shape != s.shape and not fits(t, s.shape)):
                raise ValidationError(f"tensor {s.name!r}: converted to {dtype_name(t.dtype)}{tuple(t.shape)}, "
                                      f"plan says {dtype_name(s.dtype)}{s.shape}")
        push.checked[w.plan.index] = (w.plan, tensors)
    w.tensors = tensors


async def _pack(push: Push, w: Work) -> None:
    assert push.transport is not None and w.tensors is not None
    allocate_for = getattr(push.transport, "allocate_for", None)  # sized once the tensors are known
    buf = (allocate_for(w.plan, w.tensors, push.push_id) if allocate_for is not None
           else push.transport.allocate(w.plan, push.push_id))
    push.live[w.plan.index] = buf
    push.bytes_alive += buf.nbytes
    push.peak_bytes = max(push.peak_bytes, push.bytes_alive)
    push.trace.sample("bytes_alive", push.bytes_alive)
    w.buf = buf
    await push.transport.pack(buf, w.plan.layout, w.tensors)
    w.tensors = None


async def _send(push: Push, w: Work) -> None:
    assert push.transport is not None and w.buf is not None
    info: dict[str, Any] = {
        "push_id": push.push_id,
        "version": push.version,
        "chunk": w.plan.index,
        "layout": w.plan.layout_json,
        "layout_key": w.plan.layout_key,
        "handle": w.buf.handle,
    }
    if push.owner is not None:
        info["owner"] = push.owner
    if w.plan.index in push.hold:  # layers that continue in a later chunk: receivers must not keep views
        info["hold"] = push.hold[w.plan.index]
    push.sent_any = True
    # A transport whose wire operations follow the layout tensor by tensor (NCCL direct: one broadcast per
    # tensor on both sides) must give the receiver the layout it sends: no fused engine layout there.
    fuse = push.engine_layout and not getattr(push.transport, "ops_per_tensor", False)
    await push.transport.send(w.buf, info, [_TracedEngine(e, push.trace, w.plan, fuse) for e in push.engines])


def engine_layout(engine: Engine, update_info: dict[str, Any]) -> dict[str, Any]:
    """`update_info` with its layout converted to the engine's fused tensors (`pack.fuse_layout`), where the
    engine has fusions and some run of the chunk's packed tensors makes one up. Cached per layout key."""
    fusions = getattr(engine, "fusions", None)
    key = update_info.get("layout_key")
    if not fusions or not isinstance(key, str):
        return update_info
    cache: dict[str, tuple[dict, str] | None] = engine.__dict__.setdefault("_fused_layouts", {})
    hit = cache.get(key, False)
    if hit is False:
        raw = update_info.get("layout")
        fused = fuse_layout(Layout.from_json(raw), fusions) if isinstance(raw, dict) else None
        if len(cache) > 4096:
            cache.clear()
        hit = cache[key] = None
        if fused is not None:
            js = fused.to_json()
            hit = cache[key] = (js, layout_key(js))
    if hit is None:
        return update_info
    return {**update_info, "layout": hit[0], "layout_key": hit[1]}


class _TracedEngine:
    """An engine whose `update` records a send span of its own: one lane per engine in the trace, so a slow
    engine shows; and that gets the chunk in its own fused layout where it has one (`engine_layout`).
    Everything else is the engine's (transports read `name`, `device`, ...)."""

    __slots__ = ("_engine", "_fuse", "_plan", "_trace")

    def __init__(self, engine: Engine, trace: Trace, plan: ChunkPlan, fuse: bool = True) -> None:
        self._engine, self._trace, self._plan, self._fuse = engine, trace, plan, fuse

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def update(self, update_info: dict[str, Any]) -> None:
        start = self._trace.now()
        if self._fuse:
            update_info = engine_layout(self._engine, update_info)
        try:
            await self._engine.update(update_info)
        finally:
            self._trace.add_span("send", self._plan.index, start, self._trace.now(), self._plan.nbytes,
                                 self._engine.name)


def _free(push: Push, buf: SendBuffer) -> None:
    if push.live.pop(buf.chunk, None) is None:
        return
    assert push.transport is not None
    push.transport.free(buf)
    push.bytes_alive -= buf.nbytes
    push.trace.sample("bytes_alive", push.bytes_alive)


async def _release(push: Push, credits: anyio.Semaphore, inbox: ObjectReceiveStream[Work],
                   done: anyio.CancelScope) -> None:
    async with inbox:
        async for w in inbox:
            try:
                with _Busy(push, "release", w.plan.index, w.plan.nbytes):
                    _maybe_fault(push, "release", w.plan.index)
                    if w.buf is not None:  # back to the transport's pool: cheap, no thread hop
                        _free(push, w.buf)
                        w.buf = None
            except Exception as e:
                raise _wrap(push, "release", w.plan.index, e) from None
            push.chunks_alive -= 1
            push.trace.sample("chunks_alive", push.chunks_alive)
            credits.release()
            if push.on_chunk is not None:
                push.on_chunk(w.plan.index, len(push.plans))
    done.cancel()  # every chunk is through: stop the watchdog
