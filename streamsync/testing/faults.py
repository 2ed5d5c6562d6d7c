"""Failures on demand for tests of the error paths, and the collective transport's fault scenarios.

`inject(sync, {stage: chunk})` makes `sync`'s pushes fail in that stage of that chunk: it wraps the source each
push uses (gather, convert) and the sync's transport (pack: its `allocate`, before the chunk's buffer exists;
send; release: its `free`), so the library itself carries nothing for tests.

The scenarios run real receiver processes and a real process group (shared by the gloo tests on CPU and the NCCL
tests on two GPUs), do one thing to them (close while they live, close while they shut down, SIGKILL or SIGSTOP
one in the middle of a push), then connect again and push once more. Each returns what it measured; the tests
state what must hold.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..checksum import device_digests, digests
from ..errors import PushError
from ..models.synthetic import perturb_
from ..pipeline import STAGES
from ..sync import WeightSync
from ..transports.collective.sender import CollectiveTransport
from .receiver import ReceiverProcess


class InjectedFault(RuntimeError):
    """Raised where `inject` was told to fail: a failure on demand, for tests of the error paths."""


class Faults(dict[str, int]):
    """stage -> chunk where `sync`'s pushes fail (`inject`); edit it between pushes (`clear()` to stop)."""

    def __init__(self, sync: WeightSync, at: Mapping[str, int]) -> None:
        super().__init__(at)
        self.pushing = False
        self.wrapped: set[int] = set()  # ids of the sources and transports wrapped
        plan, push = sync.plan, sync.push

        def planned(model: object) -> Any:  # a push plans first thing: its source and transport are known
            source, plans = plan(model)
            if self.pushing:
                self._source(source)
                if sync.transport is not None:
                    self._transport(sync.transport)
            return source, plans

        async def pushed(*args: Any, **kwargs: Any) -> Any:
            self.pushing = True
            try:
                return await push(*args, **kwargs)
            finally:
                self.pushing = False

        sync.plan, sync.push = planned, pushed  # type: ignore[method-assign]

    def __setitem__(self, stage: str, chunk: int) -> None:
        if stage not in STAGES:
            raise ValueError(f"no stage {stage!r}; stages: {STAGES}")
        super().__setitem__(stage, chunk)

    def hit(self, stage: str, chunk: int) -> None:
        if self.pushing and self.get(stage) == chunk:
            raise InjectedFault(f"fault injected in {stage} of chunk {chunk}")

    def _source(self, source: Any) -> None:
        if id(source) in self.wrapped:
            return
        self.wrapped.add(id(source))
        gather, convert = source.gather, source.convert

        async def gathered(plan: Any) -> Any:
            self.hit("gather", plan.index)
            return await gather(plan)

        async def converted(plan: Any, *args: Any, **kwargs: Any) -> Any:
            self.hit("convert", plan.index)
            return await convert(plan, *args, **kwargs)

        source.gather, source.convert = gathered, converted

    def _transport(self, transport: Any) -> None:
        if id(transport) in self.wrapped:
            return
        self.wrapped.add(id(transport))
        allocate, send, free = transport.allocate, transport.send, transport.free

        def allocated(plan: Any, tensors: Any) -> Any:
            self.hit("pack", plan.index)
            return allocate(plan, tensors)

        async def sent(buf: Any, *args: Any, **kwargs: Any) -> Any:
            self.hit("send", buf.chunk)
            return await send(buf, *args, **kwargs)

        def freed(buf: Any) -> Any:
            self.hit("release", buf.chunk)
            return free(buf)

        transport.allocate, transport.send, transport.free = allocated, sent, freed


def inject(sync: WeightSync, at: Mapping[str, int] | None = None) -> Faults:
    """Make `sync`'s pushes raise InjectedFault in stage `s` of chunk `c` for each `s: c` of `at` (stages:
    `pipeline.STAGES`); the push then fails as a real failure there would (`PushError` naming the stage and
    chunk). Returns the mapping, to change or `clear()` between pushes."""
    faults = Faults(sync, {})
    for stage, chunk in (at or {}).items():
        faults[stage] = chunk
    return faults


@dataclass
class Rig:
    """A trainer model, the receivers' specs file, and how the group is made."""

    backend: str                  # "gloo" or "nccl"
    model: torch.nn.Module        # on the sender's device
    specs_path: str
    rx_device: str = "cpu"        # the receivers' device ("cuda:1" for NCCL on two GPUs)
    group_timeout: float = 3.0
    chunk_bytes: int = 1 << 20
    delay: float = 0.3            # a slow receiver's sleep per update: the push is mid-broadcast for seconds
    fused: bool = False

    def receiver(self, name: str, delay: float = 0.0) -> ReceiverProcess:
        return ReceiverProcess(self.specs_path, name=name, delay=delay, threads=1, device=self.rx_device,
                               fused=self.fused)

    def transport(self) -> CollectiveTransport:
        dev = next(self.model.parameters()).device
        return CollectiveTransport(self.backend, group_timeout=self.group_timeout, device=dev)

    def sync(self, rx: ReceiverProcess, transport: CollectiveTransport | None = None) -> WeightSync:
        # Engine calls and stages get a longer timeout than the group: the group timeout must be what fires.
        return WeightSync([rx.engine(timeout=30)], transport=transport or self.transport(),
                          chunk_bytes=self.chunk_bytes, timeout=30)

    async def exact(self, sync: WeightSync) -> bool:
        engine = sync.engines[0]
        if self.rx_device.startswith("cuda"):
            return await engine.checksums(device=True) == device_digests(self.model.state_dict().items())
        return await engine.checksums() == digests(self.model.state_dict().items())

    def step(self, n: int) -> None:
        """A training step: every weight changes, so a stale receiver shows."""
        perturb_(self.model, n) if next(self.model.parameters()).device.type == "cpu" else _perturb_cuda(self.model, n)


def _perturb_cuda(model: torch.nn.Module, step: int) -> None:
    torch.manual_seed(step)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn_like(t) * 0.01)
    torch.cuda.synchronize()


@dataclass
class Outcome:
    close_s: float = 0.0                          # how long close() took
    error: PushError | None = None                # the failed push's error
    fail_s: float = 0.0                           # from the fault to the PushError
    exact_before: bool | None = None
    exact_after: bool | None = None               # the push after connecting again
    notes: dict[str, Any] = field(default_factory=dict)


async def _timed_close(sync: WeightSync) -> float:
    t0 = time.monotonic()
    await sync.close()
    return time.monotonic() - t0


async def close_with_live_receivers(rig: Rig) -> Outcome:
    """Push, close while the receiver lives (and keeps its end of the group), push again (a new group)."""
    out = Outcome()
    with rig.receiver("live") as rx:
        sync = rig.sync(rx)
        await sync.push(rig.model)
        out.exact_before = await rig.exact(sync)
        out.close_s = await _timed_close(sync)
        rig.step(1)
        await sync.push(rig.model)  # connects again
        out.exact_after = await rig.exact(sync)
        await sync.close()
    return out


async def close_while_receivers_shut_down(rig: Rig) -> Outcome:
    """Close the sender while the receiver process shuts down (and aborts its end) at the same time."""
    out = Outcome()
    with rig.receiver("closing") as rx:
        sync = rig.sync(rx)
        await sync.push(rig.model)
        out.exact_before = await rig.exact(sync)
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, rx.stop)

            async def close() -> None:
                out.close_s = await _timed_close(sync)

            tg.start_soon(close)
    return out


async def _failing_push(rig: Rig, sync: WeightSync, fault: Any, after: float, out: Outcome) -> None:
    await sync.connect()
    fired = threading.Event()
    when: list[float] = []

    def fire() -> None:
        when.append(time.monotonic())
        fired.set()  # before the fault: the push may fail (and this be read) before a SIGKILL's wait returns
        fault()

    timer = threading.Timer(after, fire)
    timer.start()
    try:
        await sync.push(rig.model)
    except PushError as e:
        out.error = e
        out.fail_s = time.monotonic() - (when[0] if when else time.monotonic())
    finally:
        timer.cancel()
    out.notes["fault_fired"] = fired.is_set()


async def killed_receiver(rig: Rig) -> Outcome:
    """SIGKILL the receiver mid-push; then the same transport connects to a new receiver and pushes exactly."""
    out = Outcome()
    transport = rig.transport()
    with rig.receiver("doomed", delay=rig.delay) as rx:
        sync = rig.sync(rx, transport)
        await _failing_push(rig, sync, rx.kill, 0.6, out)
        out.close_s = await _timed_close(sync)
    rig.step(2)
    with rig.receiver("fresh") as rx2:
        sync2 = rig.sync(rx2, transport)
        await sync2.push(rig.model)
        out.exact_after = await rig.exact(sync2)
        await sync2.close()
    return out


async def frozen_receiver(rig: Rig) -> Outcome:
    """SIGSTOP the receiver mid-push; close while it is frozen; SIGCONT; connect again and push exactly."""
    out = Outcome()
    with rig.receiver("frozen", delay=rig.delay) as rx:
        sync = rig.sync(rx)
        try:
            await _failing_push(rig, sync, lambda: os.kill(rx.pid, signal.SIGSTOP), 0.6, out)
            out.close_s = await _timed_close(sync)
        finally:
            os.kill(rx.pid, signal.SIGCONT)
        rig.step(3)
        sync.chunk_bytes = 8 * rig.chunk_bytes  # fewer chunks: the receiver still sleeps per update
        await sync.push(rig.model)  # connects again (the receiver joins a new group)
        out.exact_after = await rig.exact(sync)
        await sync.close()
    return out


SCENARIOS = {"close_live": close_with_live_receivers, "close_shutdown": close_while_receivers_shut_down,
             "sigkill": killed_receiver, "sigstop": frozen_receiver}


async def one_copy_failed_push(sync: WeightSync, transport: Any, model: torch.nn.Module,
                               perturb: Callable[[torch.nn.Module, int], None],
                               weights_match: Callable[[], Awaitable[bool]]) -> None:
    """A one-copy transport (CUDA IPC, shm) after a push failed mid-way: it drops every export (it cannot know
    what the receiver kept), the next push exports everything again, and the engine is exact. Asserts."""
    exports = (await sync.push(model)).trace.counts["refs.exports"]
    faults = inject(sync, {"send": 2})
    try:
        await sync.push(model)
    except PushError:
        pass
    else:
        raise AssertionError("the push with an injected fault in send of chunk 2 did not fail")
    assert not list(transport.refs.exports()), "exports kept after a failed push"
    faults.clear()
    perturb(model, 70)
    counts = (await sync.push(model)).trace.counts
    assert counts["refs.exports"] == exports, counts  # every storage exported again
    assert await weights_match(), "engine weights differ from the trainer's after the failed push"
