"""One push to engines in different places: a colocated transport for the engines on the sender's host, the
collective transport for the others (`Engine.remote`), from one packed buffer per chunk.

The chunk is packed once, into the colocated transport's buffer (a shared-memory segment, or a CUDA buffer
for CUDA IPC); the collective broadcasts that same buffer. Each engine gets the `init_info` and handles of
its own transport, so receivers never know the push is mixed. The buffer is released only when every engine
of both halves acknowledged.

With CUDA buffers the broadcast waits for the pack on the host (the colocated transport's pack only queues
its copies) and the collective runs its host-ordered protocol, so a buffer is never re-packed while its
broadcast may still read it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

import anyio
import torch

from ..message import ChunkHandle, Recipient, UpdateMessage
from ..pack import Layout
from ..plan.chunk import ChunkPlan
from .base import SendBuffer, Transport
from .collective import CollectiveTransport

if TYPE_CHECKING:
    from ..engines.base import Engine
    from ..sources.base import Source


class MixedTransport(Transport):
    """local: shared memory or CUDA IPC, for engines with `remote=False`; remote: the collective transport."""

    name: ClassVar[str] = "mixed"
    reaches: ClassVar[Literal["cpu", "cuda", "remote"]] = "remote"
    delta_pays: ClassVar[bool] = True  # one payload serves both halves: the remote link is the bound

    def __init__(self, local: Transport, remote: CollectiveTransport) -> None:
        super().__init__()
        self.local = local
        self.remote = remote
        remote.order_on_host()  # see the module doc: the pack was not queued by the collective itself
        self._near: list[int] = []  # engine indices of this push, by half
        self._far: list[int] = []

    @property
    def broken(self) -> str | None:
        return self.remote.broken

    @property
    def ref_chunk_bytes(self) -> int | None:
        return None  # one packed buffer serves both halves: nothing goes by reference

    @staticmethod
    def split(engines: Sequence[Engine]) -> tuple[list[Engine], list[Engine]]:
        """(engines the colocated transport reaches, engines the collective reaches)."""
        return [e for e in engines if not e.remote], [e for e in engines if e.remote]

    async def connect(self, engines: Sequence[Engine], timeout: float) -> None:
        near, far = self.split(engines)
        async with anyio.create_task_group() as tg:
            if near:
                tg.start_soon(self.local.connect, near, timeout)
            if far:
                tg.start_soon(self.remote.connect, far, timeout)

    def begin_push(self, plans: Sequence[ChunkPlan], source: Source, engines: Sequence[Engine], *,
                   by_reference: bool = True) -> None:
        self._near = [i for i, e in enumerate(engines) if not e.remote]
        self._far = [i for i, e in enumerate(engines) if e.remote]
        near, far = self.split(engines)
        self.local.begin_push(plans, source, near, by_reference=False)  # the collective broadcasts its buffer
        self.remote.begin_push(plans, source, far)  # its chunk bookkeeping; its own pool stays empty

    def allocate(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor]) -> SendBuffer:
        return self.local.allocate(chunk, tensors)

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        await self.local.pack(buf, layout, tensors)

    def handles(self, buf: SendBuffer, engines: int) -> Sequence[ChunkHandle]:
        out: list[ChunkHandle | None] = [None] * engines
        for indices, half in ((self._near, self.local), (self._far, self.remote)):
            if indices:
                for i, h in zip(indices, half.handles(buf, len(indices)), strict=True):
                    out[i] = h
        assert all(h is not None for h in out)
        return out  # type: ignore[return-value]

    async def send(self, buf: SendBuffer, messages: Sequence[UpdateMessage], recipients: Sequence[Recipient]) -> None:
        async def broadcast() -> None:
            if buf.ready is not None:  # the colocated pack was queued on a side stream: it must have run
                await anyio.to_thread.run_sync(buf.ready.synchronize)
            await self.remote.send(buf, [messages[i] for i in self._far], [recipients[i] for i in self._far])

        async with anyio.create_task_group() as tg:
            if self._near:
                tg.start_soon(self.local.send, buf, [messages[i] for i in self._near],
                              [recipients[i] for i in self._near])
            if self._far:
                tg.start_soon(broadcast)

    def free(self, buf: SendBuffer) -> None:
        self.local.free(buf)

    def push_counts(self) -> Mapping[str, float]:
        return {**self.local.push_counts(), **self.remote.push_counts()}

    def end_push(self, ok: bool) -> None:
        self.local.end_push(ok)
        self.remote.end_push(ok)

    async def close(self) -> None:
        try:
            await self.local.close()
        finally:
            await self.remote.close()
