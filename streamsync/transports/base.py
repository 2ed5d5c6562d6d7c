"""Transports move packed chunks. Each has a sending half (in the trainer) and a receiving half (in every
engine worker). Both halves agree on plain-data messages only:

* `init_info` (once, at connect): what a receiver needs to set itself up (e.g. a rendezvous address);
* `update_info["handle"]` (per chunk): how to find the chunk's bytes (a segment name, an IPC handle).

Ownership: the sender allocates a chunk's buffer; a receiver may read it from `Receiver.open` until the
context exits, and acknowledges by returning from its update call; the sender frees the buffer only after
every receiver acknowledged (the release stage), or when the push fails.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import torch

from ..errors import ValidationError
from ..pack import Layout, TensorMeta, pack_into, unpack

if TYPE_CHECKING:
    from ..engines.base import Engine
    from ..plan.chunk import ChunkPlan


@dataclass
class SendBuffer:
    """A chunk's sender-side buffer: `tensor` is the flat uint8 view pack writes into."""

    chunk: int
    nbytes: int
    tensor: torch.Tensor
    handle: dict[str, Any]
    state: dict[str, Any] = field(default_factory=dict)


class Transport(ABC):
    """Sending half. One instance serves one `WeightSync` (all its engines)."""

    name: ClassVar[str]

    def init_info(self, index: int, engine: Engine) -> dict[str, Any]:
        """Plain data for engine `index`'s `init_transfer`. Must include `transport`."""
        return {"transport": self.name}

    async def connect(self, engines: Sequence[Engine], timeout: float) -> None:
        """Set up the receiving halves of every engine (concurrently)."""
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                for i, e in enumerate(engines):
                    tg.start_soon(e.init_transfer, self.init_info(i, e))

    def begin_push(self, plans: Sequence[ChunkPlan], push_id: str) -> None:  # noqa: B027 - optional hook
        """Called before a push's first allocate (e.g. to size a buffer pool)."""

    def end_push(self) -> None:  # noqa: B027 - optional hook
        """Called when a push ended, successfully or not, after every buffer was freed."""

    @abstractmethod
    def allocate(self, chunk: ChunkPlan, push_id: str) -> SendBuffer:
        """A buffer of at least `chunk.nbytes` on the transport's device."""

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Copy tensors into the buffer without blocking the event loop.

        CPU: the copy runs in a worker thread. CUDA: it is queued on a side stream (after the producer's
        stream) and awaited through an event, so the loop and other chunks' device work keep going.
        """
        if buf.tensor.device.type == "cuda":
            stream = self._side_stream(buf.tensor.device)
            stream.wait_stream(torch.cuda.current_stream(buf.tensor.device))
            with torch.cuda.stream(stream):
                pack_into(buf.tensor, layout, tensors)
                done = torch.cuda.Event()
                done.record(stream)
            await anyio.to_thread.run_sync(done.synchronize)
        else:
            await anyio.to_thread.run_sync(pack_into, buf.tensor, layout, tensors)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        streams = self.__dict__.setdefault("_streams", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]

    async def send(self, buf: SendBuffer, update_info: dict[str, Any], engines: Sequence[Engine]) -> None:
        """Deliver the packed chunk to every engine; return when all acknowledged (closed their handle).

        The default hands the handle to every engine concurrently; collective transports also move the
        bytes here. Errors raised out of an engine call keep their EngineError type (it names the engine).
        """
        async with anyio.create_task_group() as tg:
            for e in engines:
                tg.start_soon(e.update, update_info)

    @abstractmethod
    def free(self, buf: SendBuffer) -> None:
        """Give the buffer back. Idempotent; safe on a failed push."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Tear down process groups or pools."""


class Receiver(ABC):
    """Receiving half, inside an engine worker (or a plain receiver process)."""

    name: ClassVar[str]

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cpu") -> None:
        self.init_info = init_info
        self.device = torch.device(device)

    @abstractmethod
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> AbstractContextManager[torch.Tensor]:
        """Map the chunk named by `update_info` and yield its flat uint8 bytes; unmap on exit.

        `nbytes`: the chunk's size from its already validated layout. A transport that allocates for a
        chunk refuses a handle of another size before it allocates anything."""

    def views(self, buf: torch.Tensor, layout: Layout) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, view) of every tensor of the chunk in `buf` (the tensor `open` yielded)."""
        return unpack(buf, layout)

    def ref_views(self, update_info: dict[str, Any]) -> list[tuple[TensorMeta, torch.Tensor]]:
        """Tensors of the chunk sent by reference instead of packed (CUDA IPC one copy): (metadata, view).
        Called while the chunk is open. Transports without references refuse an update that has some."""
        h = update_info.get("handle")
        if isinstance(h, dict) and h.get("refs"):
            raise ValidationError(f"the {self.name} transport takes no tensors by reference")
        return []

    def end_round(self) -> None:  # noqa: B027 - optional hook
        """A round (start..finish, or a failed one) ended: drop per-round mappings."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (process groups)."""


# Lazy registry: name -> (module, sender class, receiver class). Adding a transport is one entry here.
_REGISTRY: dict[str, tuple[str, str, str]] = {
    "shm": ("streamsync.transports.shm", "ShmTransport", "ShmReceiver"),
    "cuda_ipc": ("streamsync.transports.cuda_ipc", "CudaIpcTransport", "CudaIpcReceiver"),
    "collective": ("streamsync.transports.collective", "CollectiveTransport", "CollectiveReceiver"),
}


def register_transport(name: str, module: str, sender: str, receiver: str) -> None:
    _REGISTRY[name] = (module, sender, receiver)


def _load(name: str, which: int) -> type:
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValidationError(f"unknown transport {name!r}; known: {sorted(_REGISTRY)}") from None
    return getattr(importlib.import_module(entry[0]), entry[which])


def transport_class(name: str) -> type[Transport]:
    return _load(name, 1)


def make_receiver(init_info: dict[str, Any], device: torch.device | str = "cpu") -> Receiver:
    if not isinstance(init_info, dict) or not isinstance(init_info.get("transport"), str):
        raise ValidationError(f"init_info must be a dict with a 'transport' name, got {init_info!r:.200}")
    return _load(init_info["transport"], 2)(init_info, device)


