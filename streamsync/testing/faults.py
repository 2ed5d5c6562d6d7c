"""Fault scenarios of the collective transport, shared by the gloo tests (CPU, CI) and the NCCL tests (two GPUs).

Each scenario runs real receiver processes and a real process group, does one thing to them (close while they
live, close while they shut down, SIGKILL or SIGSTOP one in the middle of a push), then connects again and
pushes once more. It returns what it measured; the tests state what must hold.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..checksum import device_digests, digests
from ..errors import PushError
from ..models.synthetic import perturb_
from ..sync import WeightSync
from ..transports.collective.sender import CollectiveTransport
from .receiver import ReceiverProcess


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
    sync.faults = {"send": 2}
    try:
        await sync.push(model)
    except PushError:
        pass
    else:
        raise AssertionError("the push with an injected fault in send of chunk 2 did not fail")
    assert not list(transport.refs.exports()), "exports kept after a failed push"
    sync.faults = {}
    perturb(model, 70)
    counts = (await sync.push(model)).trace.counts
    assert counts["refs.exports"] == exports, counts  # every storage exported again
    assert await weights_match(), "engine weights differ from the trainer's after the failed push"
