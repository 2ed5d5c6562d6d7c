"""The five stages and the run loop: gather -> convert -> pack -> send -> release, the credit window and
the watchdog.

Each stage is a short coroutine that takes a chunk from its inbox and hands it on; stages are joined by
bounded anyio memory streams and run in one task group. A credit window bounds the chunks alive anywhere:
gather takes a credit before it touches a chunk, release gives it back after every receiver acknowledged
and the buffer is freed. So the sender's extra memory is at most `max_inflight` packed chunks.

Any failure cancels the task group; the push raises one PushError naming stage, chunk and receiver, and
every buffer still alive is freed.

Timeouts: one watchdog task per push, not a cancel scope per stage and chunk. Each stage notes when it
took up a chunk; the watchdog fails the push when any stage has worked on one chunk longer than `timeout`.
(Entering and leaving a cancel scope costs tens of microseconds; five per chunk are a measurable share of a
GPU push's host time.) Waiting for a queue slot or a credit is not timed: it ends when a later stage moves
on, and that stage is timed.

The sender's event loop is a resource: everything a push does on the host runs on it, so a stage's Python time
delays the others. Three hand-offs keep the first chunk from waiting behind the second: on a GPU, a source whose
gathers are the sender's own tensors is gathered, converted and packed by one task, a chunk only once the requests
of the one before it left for the engines (`_gather_to_pack`, `engines.base.DISPATCHED`: an engine call made from
a thread needs the GIL until then); elsewhere an idle send stage takes a packed chunk before the pack stage starts
the next (`_pack_loop`); and the send stage waits for the engines' `start_update` only while it has not finished
(`_send_loop`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import torch
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..engines.base import DISPATCHED, Engine
from ..errors import EngineError, PushError, ValidationError
from ..log import bound
from ..message import UpdateMessage
from ..pack import castable, dtype_name, fits
from ..plan.chunk import ChunkPlan
from ..trace import Trace
from .job import Push, Work
from .profiler import ProfilerRange


async def run(push: Push) -> None:
    """Run the pipeline to completion, or raise PushError having freed every buffer."""
    if not push.job.source.is_sender:
        await _gather_only(push)
        return
    n = push.job.max_inflight
    credits = anyio.Semaphore(n)
    p_tx, p_rx = anyio.create_memory_object_stream[Work](n)
    s_tx, s_rx = anyio.create_memory_object_stream[Work](n)
    transport = push.job.transport
    assert transport is not None and push.job.messages is not None
    # On a GPU the sender's own tensors are gathered, converted and packed by launches from the loop's thread:
    # one chunk's three stages cannot overlap another's there (only the engines' work can), so one task runs
    # them in turn instead of three tasks handing each chunk on through queues.
    here = push.job.source.gathers_here and push.job.source.device.type == "cuda"
    # A delta sync packs every piece: its receivers read a chunk's pieces in layout order.
    transport.begin_push(push.job.plans, push.job.source, push.job.engines, by_reference=push.job.delta is None)
    done = anyio.Event()
    ok = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_watchdog, push, done)
            if here:
                tg.start_soon(_gather_to_pack, push, credits, p_tx)
            else:
                g_tx, g_rx = anyio.create_memory_object_stream[Work](n)
                c_tx, c_rx = anyio.create_memory_object_stream[Work](n)
                tg.start_soon(_gather, push, credits, g_tx)
                tg.start_soon(_convert_loop, push, g_rx, c_tx)
                tg.start_soon(_pack_loop, push, c_rx, p_tx)
            tg.start_soon(_send_loop, push, p_rx, s_tx)
            tg.start_soon(_release, push, credits, s_rx, done)
        ok = True
    except BaseExceptionGroup as eg:
        raise first_push_error(eg) from None
    finally:
        if not ok:  # a receiver that gave up may still read these: the transport drops them, never reuses
            push.bytes_alive -= sum(b.nbytes for b in push.live.values())
            push.live.clear()
        transport.end_push(ok)
        for name, value in transport.push_counts().items():
            push.job.trace.count(name, value)


def first_push_error(eg: BaseException) -> BaseException:
    """The PushError among a task group's failures (else its first leaf): the one a push raises."""
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
        msg = f"timed out after {push.job.timeout:.1f}s"
    err = PushError(msg, stage=stage, chunk=chunk, receiver=receiver, push_id=push.job.push_id)
    err.__cause__ = e
    if isinstance(e, EngineError) and e.unresponsive:
        err.unresponsive = frozenset(e.engine.split(","))
    return err


async def _watchdog(push: Push, done: anyio.Event) -> None:
    """Fail the push when a stage has worked on one chunk for longer than `push.job.timeout`; end when `done` is set
    (every chunk released: ending by an event costs the push's last moments less than a cancellation)."""
    tick = min(1.0, push.job.timeout / 8)
    while True:
        with anyio.move_on_after(tick):
            await done.wait()
        if done.is_set():
            return
        now = time.perf_counter()
        for stage, (chunk, since) in list(push.busy.items()):
            if now - since > push.job.timeout:
                raise PushError(f"timed out after {push.job.timeout:.1f}s", stage=stage, chunk=chunk,
                                push_id=push.job.push_id)


class _Busy:
    """Marks `stage` as working on `chunk` (for the watchdog), records the trace span and a profiler range,
    and binds the stage and chunk to the log context."""

    __slots__ = ("chunk", "log", "nbytes", "push", "range", "stage", "start")

    def __init__(self, push: Push, stage: str, chunk: int, nbytes: int) -> None:
        self.push, self.stage, self.chunk, self.nbytes = push, stage, chunk, nbytes
        self.range = ProfilerRange(f"streamsync.{stage} #{chunk}")
        self.log = bound(stage=stage, chunk=chunk)

    def __enter__(self) -> None:
        self.log.__enter__()
        self.range.__enter__()
        self.start = time.perf_counter()
        self.push.busy[self.stage] = (self.chunk, self.start)
        self.push.last[self.stage] = self.chunk

    def __exit__(self, *exc: Any) -> None:
        self.push.busy.pop(self.stage, None)
        self.range.__exit__()
        if exc[0] is not None:
            self.push.cut[self.stage] = self.chunk
        t0 = self.push.job.trace.t0
        self.push.job.trace.add_span(self.stage, self.chunk, self.start - t0, time.perf_counter() - t0, self.nbytes)
        self.log.__exit__(*exc)


async def _work(push: Push, stage: str, w: Work, fn: Callable[[Push, Work], Awaitable[None]]) -> None:
    """One stage's work on one chunk: timed, traced, failures named by stage and chunk."""
    try:
        with _Busy(push, stage, w.plan.index, w.plan.nbytes):
            await fn(push, w)
    except Exception as e:
        raise _wrap(push, stage, w.plan.index, e) from None


async def _gather_only(push: Push) -> None:
    """A rank that sends nothing takes part in the gathers only (their collectives line up with the sender's)."""
    for plan in push.job.plans:
        try:
            with (anyio.fail_after(push.job.timeout), push.job.trace.span("gather", plan.index, plan.nbytes),
                  ProfilerRange(f"streamsync.gather #{plan.index}")):
                await push.job.source.gather(plan)
        except Exception as e:
            raise _wrap(push, "gather", plan.index, e) from None


async def _gather(push: Push, credits: anyio.Semaphore, out: MemoryObjectSendStream[Work]) -> None:
    async with out:
        for plan in push.job.plans:
            # No timeout here: a credit comes back when the oldest chunk is released, and every stage in between
            # has its own timeout.
            await credits.acquire()
            push.chunks_alive += 1
            push.job.trace.sample("chunks_alive", push.chunks_alive)
            w = Work(plan)
            await _work(push, "gather", w, _gather_one)
            await out.send(w)
            push.job.trace.sample("queue gather→convert", out.statistics().current_buffer_used)


async def _gather_to_pack(push: Push, credits: anyio.Semaphore, out: MemoryObjectSendStream[Work]) -> None:
    """Gather, convert and pack each chunk in turn (a source gathering its own tensors on a GPU: `run`), depth
    first: a chunk is gathered once the requests of the one before it left for the engines, so it is packed
    while the engines load that one and never delays its going out. Waits are untimed, as the credit's is."""
    async with out:
        for plan in push.job.plans:
            await credits.acquire()
            if plan.index > 0:
                await _dispatched(push, plan.index - 1).wait()
            push.chunks_alive += 1
            push.job.trace.sample("chunks_alive", push.chunks_alive)
            w = Work(plan)
            await _work(push, "gather", w, _gather_one)
            await _work(push, "convert", w, _convert)
            await _work(push, "pack", w, _pack)
            await out.send(w)
            push.job.trace.sample("queue pack→next", out.statistics().current_buffer_used)


def _dispatched(push: Push, chunk: int) -> anyio.Event:
    ev = push.dispatched.get(chunk)
    if ev is None:
        ev = push.dispatched[chunk] = anyio.Event()
    return ev


async def _gather_one(push: Push, w: Work) -> None:
    w.gathered = await push.job.source.gather(w.plan)


async def _convert_loop(push: Push, inbox: MemoryObjectReceiveStream[Work], out: MemoryObjectSendStream[Work]) -> None:
    async with inbox, out:
        async for w in inbox:
            await _work(push, "convert", w, _convert)
            await out.send(w)
            push.job.trace.sample("queue convert→next", out.statistics().current_buffer_used)


async def _convert(push: Push, w: Work) -> None:
    # cast=False: the pack stage casts floating tensors while it copies (one kernel instead of two).
    tensors = await push.job.source.convert(w.plan, w.gathered, cast=False)
    w.gathered = None
    check_converted(push.job.checked, w.plan, tensors)
    w.tensors = tensors


def check_converted(checked: dict[int, tuple[ChunkPlan, Sequence[torch.Tensor]]], plan: ChunkPlan,
                    tensors: Sequence[torch.Tensor]) -> None:
    """The converter's tensors fit the plan (count, dtype a pack may cast from, shape); a list checked before for
    the same plan (a source's cached views: `checked`) is not checked again."""
    last = checked.get(plan.index)
    if last is not None and last[0] is plan and last[1] is tensors:
        return
    if len(tensors) != len(plan.specs):
        raise ValidationError(f"converter returned {len(tensors)} tensors for {len(plan.specs)} specs")
    for t, s in zip(tensors, plan.specs, strict=True):
        if not castable(t.dtype, s.dtype) or (t.shape != s.shape and not fits(t, s.shape)):
            raise ValidationError(f"tensor {s.name!r}: converted to {dtype_name(t.dtype)}{tuple(t.shape)}, "
                                  f"plan says {dtype_name(s.dtype)}{s.shape}")
    checked[plan.index] = (plan, tensors)


async def _pack_loop(push: Push, inbox: MemoryObjectReceiveStream[Work], out: MemoryObjectSendStream[Work]) -> None:
    async with inbox, out:
        async for w in inbox:
            await _work(push, "pack", w, _pack)
            await out.send(w)
            push.job.trace.sample("queue pack→next", out.statistics().current_buffer_used)
            if push.send_idle:
                # An idle send stage goes first: its chunk leaves, and while the engines work on it this stage
                # packs the next. Otherwise the loop would run the next (synchronous) pack first, and the
                # first chunk would go out only after the second's pack.
                push.send_took = took = anyio.Event()
                try:
                    with anyio.fail_after(push.job.timeout):
                        await took.wait()
                except TimeoutError as e:
                    raise _wrap(push, "send", w.plan.index, e) from None


async def _pack(push: Push, w: Work) -> None:
    assert push.job.transport is not None and w.tensors is not None
    plan = w.plan
    if push.job.delta is not None:  # a delta sync: the chunk's pieces against the shadow, or the chunk kept in it
        plan, w.tensors, w.delta = await push.job.delta.prepare(w.plan, w.tensors)
        w.wire = plan if plan is not w.plan else None
    buf = push.job.transport.allocate(plan, w.tensors)  # sized once the tensors are known (one copy)
    push.live[w.plan.index] = buf
    push.bytes_alive += buf.nbytes
    push.peak_bytes = max(push.peak_bytes, push.bytes_alive)
    push.job.trace.sample("bytes_alive", push.bytes_alive)
    w.buf = buf
    await push.job.transport.pack(buf, plan.layout, w.tensors)
    w.tensors = None


async def _send_loop(push: Push, inbox: MemoryObjectReceiveStream[Work], out: MemoryObjectSendStream[Work]) -> None:
    async with inbox, out:
        while True:
            push.send_idle = True
            try:
                w = await inbox.receive()
            except anyio.EndOfStream:
                break
            push.send_idle = False
            if push.send_took is not None:
                push.send_took.set()
            if push.started is not None and not push.started.is_set():
                # The engines' start_update runs alongside the first gathers and packs; its wait is not the send
                # stage's time (start has its own timeout per engine). Once set, no wait: waiting on a set event
                # still yields, and the next chunk's pack would then run before this chunk goes out. Meanwhile
                # the next chunk may be gathered: nothing of this one is on its way yet.
                _dispatched(push, w.plan.index).set()
                await push.started.wait()
            await _work(push, "send", w, _send)
            await out.send(w)
            push.job.trace.sample("queue send→next", out.statistics().current_buffer_used)


async def _send(push: Push, w: Work) -> None:
    transport, buf, messages = push.job.transport, w.buf, push.job.messages
    assert transport is not None and buf is not None and messages is not None
    handles = transport.handles(buf, len(push.job.engines))
    # A delta sync's engines keep HF-named tensors as their base: its chunks are never fused.
    job = push.job
    built = messages.build(job.push_id, job.version, job.owner, w.wire or w.plan, job.hold.get(w.plan.index, ()),
                           handles, fuse=job.engine_layout and transport.fusable and job.delta is None, delta=w.delta)
    push.sent_any = True
    gone = _Dispatch(len(push.job.engines), _dispatched(push, w.plan.index))
    try:
        await transport.send(buf, built, [SendLane(e, push.job.trace, w.plan, gone) for e in push.job.engines])
    finally:
        gone.event.set()


class _Dispatch:
    """Counts a chunk's engines whose requests left (`engines.base.DISPATCHED`); sets `event` at the last."""

    __slots__ = ("event", "left")

    def __init__(self, engines: int, event: anyio.Event) -> None:
        self.left, self.event = engines, event
        if engines <= 0:
            event.set()

    def one(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.event.set()


class SendLane:
    """An engine's lane in the trace: delivers one chunk's message to the engine and records a send span of
    its own, so that a slow engine shows."""

    __slots__ = ("engine", "gone", "plan", "said", "trace")

    def __init__(self, engine: Engine, trace: Trace, plan: ChunkPlan, gone: _Dispatch | None = None) -> None:
        self.engine, self.trace, self.plan, self.gone, self.said = engine, trace, plan, gone, False

    @property
    def name(self) -> str:
        return self.engine.name

    def dispatched(self) -> None:
        """The request left for the engine (once per lane, whoever says it first)."""
        if not self.said:
            self.said = True
            if self.gone is not None:
                self.gone.one()

    async def update(self, message: UpdateMessage) -> None:
        start = self.trace.now()
        token = DISPATCHED.set(self.dispatched)
        if not self.engine.signals_dispatch:
            self.dispatched()
        try:
            await self.engine.update(message)
        finally:
            DISPATCHED.reset(token)
            self.dispatched()
            self.trace.add_span("send", self.plan.index, start, self.trace.now(), self.plan.nbytes, self.engine.name)


async def _release(push: Push, credits: anyio.Semaphore, inbox: MemoryObjectReceiveStream[Work],
                   done: anyio.Event) -> None:
    async with inbox:
        async for w in inbox:
            await _work(push, "release", w, _free)
            push.chunks_alive -= 1
            push.job.trace.sample("chunks_alive", push.chunks_alive)
            credits.release()
            if push.job.on_chunk is not None:
                push.job.on_chunk(w.plan.index, len(push.job.plans))
    done.set()  # every chunk is through: stop the watchdog


async def _free(push: Push, w: Work) -> None:
    """Back to the transport's pool: cheap, no thread hop."""
    buf, w.buf = w.buf, None
    if buf is None or push.live.pop(buf.chunk, None) is None:
        return
    assert push.job.transport is not None
    push.job.transport.free(buf)
    push.bytes_alive -= buf.nbytes
    push.job.trace.sample("bytes_alive", push.bytes_alive)
