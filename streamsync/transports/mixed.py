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

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..pack import Layout
from ..plan.chunk import ChunkPlan
from .base import SendBuffer, Transport
from .collective.sender import CollectiveTransport

if TYPE_CHECKING:
    from ..engines.base import Engine


class MixedTransport(Transport):
    """local: shared memory or CUDA IPC, for engines with `remote=False`; remote: the collective transport."""

    name = "mixed"

    def __init__(self, local: Transport, remote: CollectiveTransport) -> None:
        self.local = local
        self.remote = remote
        remote.ordering = "host"  # see the module doc: the pack was not queued by the collective itself

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

    def begin_push(self, plans: Sequence[ChunkPlan], push_id: str) -> None:
        self.local.begin_push(plans, push_id)
        self.remote.begin_push(plans, push_id)  # its chunk bookkeeping; its own pool stays empty

    def allocate(self, chunk: ChunkPlan, push_id: str) -> SendBuffer:
        return self.local.allocate(chunk, push_id)

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        await self.local.pack(buf, layout, tensors)

    async def send(self, buf: SendBuffer, update_info: dict[str, Any], engines: Sequence[Engine]) -> None:
        near, far = self.split(engines)
        ready = buf.state.get("pb").extra.get("ready") if buf.tensor.is_cuda and "pb" in buf.state else None

        async def broadcast() -> None:
            if ready is not None:  # the colocated pack was queued on a side stream: it must have run
                await anyio.to_thread.run_sync(ready.synchronize)
            await self.remote.send(buf, update_info, far)

        async with anyio.create_task_group() as tg:
            if near:
                tg.start_soon(self.local.send, buf, update_info, near)
            if far:
                tg.start_soon(broadcast)

    def free(self, buf: SendBuffer) -> None:
        self.local.free(buf)

    def end_push(self) -> None:
        self.local.end_push()
        self.remote.end_push()

    async def close(self) -> None:
        try:
            await self.local.close()
        finally:
            await self.remote.close()
