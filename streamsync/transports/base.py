"""Transports move packed chunks. Each has a sending half (in the trainer) and a receiving half (in every
engine worker). Both halves agree on plain-data messages only:

* `init_info` (once, at connect): what a receiver needs to set itself up (e.g. a rendezvous address);
* a chunk's handle (`ChunkHandle.data`, the `handle` of its `UpdateMessage`): how to find its bytes (a segment
  name, an IPC handle), and, for tensors sent by reference, where each lies.

Per push the sending half sees, in order: `begin_push` (the plans, the source, the engines), then per chunk
`allocate` -> `pack` -> `handles` -> `send` -> `free`, then `end_push(ok)`. The send stage calls `handles` and
`send` back to back, one chunk at a time, in plan order. Those notifications and `close` have empty defaults, so
a transport is its abstract methods at least; what only some transports do is a type of its own, asked for with
isinstance: `Primes` (references handed to the engines at connect) and `RanksAgree` (every trainer rank sends).

Ownership: the sender allocates a chunk's buffer; a receiver may read it from `Receiver.open` until the
context exits, and acknowledges by returning from its update call; the sender frees the buffer only after
every receiver acknowledged (the release stage), or when the push fails (then it is dropped, never reused:
a receiver that gave up may still read it).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
import torch

from ..errors import ValidationError
from ..message import ChunkHandle, Recipient, UpdateMessage
from ..pack import Layout, TensorMeta, pack_into, unpack

if TYPE_CHECKING:
    from ..engines.base import Engine
    from ..plan.chunk import ChunkPlan
    from ..sources.base import Source
    from .pool import PoolBuffer
    from .refs import ChunkRefs


@dataclass
class SendBuffer:
    """A chunk's sender-side buffer, and what its transport keeps for the chunk until `free`."""

    chunk: int
    #: bytes this chunk keeps alive on the sender (counted in the push's peak)
    nbytes: int
    #: the flat uint8 view `pack` writes into (empty when nothing of the chunk is packed)
    tensor: torch.Tensor
    #: the transport's plain-data handle for the chunk, before any per-engine fields
    handle: dict[str, Any]
    #: the pool buffer behind `tensor`, for transports that pool them
    pooled: PoolBuffer | None = None
    #: one copy: the chunk's tensors sent by reference and the packed rest
    refs: ChunkRefs | None = None
    #: recorded on the device once the pack's copies ran; None when `pack` returned after they ran
    ready: torch.cuda.Event | None = None


class Transport(ABC):
    """Sending half. One instance serves one `WeightSync` (all its engines).

    Subclasses call `super().__init__()`. Capabilities are declared here, never probed: `reaches` (which
    engines `transport="auto"` gives it), `ref_chunk_bytes` (whether tensors may go by reference), `delta_pays`
    (whether `delta="auto"` pushes deltas through it) and `broken` (whether it must connect again)."""

    name: ClassVar[str]
    #: the engines this transport reaches: "cpu" / "cuda" engines on the sender's own host (shared memory,
    #: CUDA IPC), or "remote" (engines anywhere: a collective group)
    reaches: ClassVar[Literal["cpu", "cuda", "remote"]]
    #: every trainer rank runs this transport: `WeightSync.connect` and `push` call it on ranks without engines
    #: too (sharded sending, where each rank sends its own shards); False: only ranks with engines do. True
    #: exactly where the transport is `RanksAgree`
    every_rank: ClassVar[bool] = False
    #: an engine's fused layout (`Fused.fused_layout`) may rename the chunk's tensors in its messages; False
    #: where the transport's own per-engine layouts are what receivers assemble (sharded sending)
    fusable: ClassVar[bool] = True
    #: sending only the changed elements saves time here: the bytes cross a link slower than the host's memory
    #: (a collective to other hosts). False where a receiver reads the sender's memory (shared memory, CUDA
    #: IPC): finding the changes reads as many bytes as the copy they save (docs/delta.md)
    delta_pays: ClassVar[bool] = False
    #: the transport meets its receivers at an address (a process group's rendezvous): constructed with
    #: `master_addr=` where an engine names one (`Engine.rendezvous_addr`)
    rendezvous: ClassVar[bool] = False
    #: a remote transport that can serve the engines elsewhere beside a local one serving the engines here
    #: (`MixedTransport`: its receivers take a chunk from it while the local ones map theirs)
    pairs_with_local: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.every_rank != issubclass(cls, RanksAgree):
            raise TypeError(f"{cls.__name__}: every_rank={cls.every_rank} but the transport is "
                            f"{'' if issubclass(cls, RanksAgree) else 'not '}RanksAgree (every rank's sends need "
                            "the ranks' agreement, and only they do)")

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def init_info(self, index: int, engine: Engine) -> dict[str, Any]:
        """Plain data for engine `index`'s `init_transfer`. Must include `transport`."""
        return {"transport": self.name}

    async def connect(self, engines: Sequence[Engine], timeout: float) -> None:
        """Set up the receiving halves of every engine (concurrently)."""
        with anyio.fail_after(timeout):
            async with anyio.create_task_group() as tg:
                for i, e in enumerate(engines):
                    tg.start_soon(e.init_transfer, self.init_info(i, e))

    def source_for(self, source: Source, chunk_bytes: int) -> Source:
        """The source a push through this transport reads: `source` itself, or (sharded sending) a source
        that plans what this rank sends of it. May be collective on `every_rank` transports."""
        return source

    @property
    def ref_chunk_bytes(self) -> int | None:
        """Referenced bytes per chunk where tensors may go by reference (one copy: a referenced tensor costs the
        sender no memory, so chunks of them are planned by their own, larger budget); None otherwise."""
        return None

    def begin_push(self, plans: Sequence[ChunkPlan], source: Source, engines: Sequence[Engine], *,  # noqa: B027
                   by_reference: bool = True) -> None:
        """A push of `plans` from `source` to `engines` starts: size pools, note which storages may go by
        reference (none with `by_reference=False`: every tensor packed, for a buffer another transport reads
        too). Called before the first `allocate`."""

    @abstractmethod
    def allocate(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor]) -> SendBuffer:
        """The chunk's buffer, once its converted tensors are known: at least the bytes it will pack."""

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Copy tensors into the buffer without blocking the event loop.

        CPU: the copy runs in a worker thread. CUDA: it is queued on a side stream (after the producer's
        stream) and awaited through an event, so the loop and other chunks' device work keep going.
        """
        if buf.tensor.device.type == "cuda":
            stream = self.side_stream(buf.tensor.device)
            stream.wait_stream(torch.cuda.current_stream(buf.tensor.device))
            with torch.cuda.stream(stream):
                pack_into(buf.tensor, layout, tensors)
                done = torch.cuda.Event()
                done.record(stream)
            await anyio.to_thread.run_sync(done.synchronize)
        else:
            await anyio.to_thread.run_sync(pack_into, buf.tensor, layout, tensors)

    def side_stream(self, device: torch.device) -> torch.cuda.Stream:
        """This transport's copy stream on `device`."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def handles(self, buf: SendBuffer, engines: int) -> Sequence[ChunkHandle]:
        """Each engine's handle for the chunk in `buf`, in engine order (the default: one for all)."""
        return [ChunkHandle(buf.handle)] * engines

    async def send(self, buf: SendBuffer, messages: Sequence[UpdateMessage], recipients: Sequence[Recipient]) -> None:
        """Deliver the chunk: `recipients[i].update(messages[i])` for every engine; return when all acknowledged
        (closed their handle). The default calls them concurrently; collective transports also move the bytes
        here. Errors raised by a recipient keep their EngineError type (it names the engine)."""
        if len(recipients) == 1:  # the common colocated case: no task group per chunk
            await recipients[0].update(messages[0])
            return
        async with anyio.create_task_group() as tg:
            for r, m in zip(recipients, messages, strict=True):
                tg.start_soon(r.update, m)

    @abstractmethod
    def free(self, buf: SendBuffer) -> None:
        """Give the buffer back. Idempotent; safe on a failed push."""

    def end_push(self, ok: bool) -> None:  # noqa: B027 - a notification
        """The push ended, every buffer freed; `ok`: every engine acknowledged every chunk."""

    @property
    def broken(self) -> str | None:
        """Why this transport cannot carry another push until it is connected again (a collective group whose
        sequence a failed push lost), or None."""
        return None

    def push_counts(self) -> Mapping[str, float]:
        """What this transport counted during the last push (tensors referenced and packed, exports, captured
        packs), recorded in the push's trace (`Trace.counts`)."""
        return {}

    async def close(self) -> None:  # noqa: B027 - a notification
        """Tear down process groups or pools."""


class Primes(ABC):
    """A transport that can hand a model's chunks' references to the engines at `connect(model)`, ahead of the
    first push (one copy: the engines map the trainer's storages once)."""

    @abstractmethod
    def begin_prime(self, source: Source, engines: Sequence[Engine]) -> bool:
        """`connect(model)` is about to hand over the model's chunks (`prime`): True where this transport sends
        some chunks' references ahead of the first push (one copy, and an engine that takes them:
        `Primable`); `end_prime` follows either way."""

    @abstractmethod
    async def prime(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor], engines: Sequence[Engine],
                    timeout: float) -> int:
        """Send chunk `plan`'s references (its converted `tensors` are the source's own views) ahead of its first
        push, to the engines that take them; returns how many did. Nothing is loaded."""

    @abstractmethod
    def end_prime(self, ok: bool) -> None:
        """The chunks were handed over (`ok`), or priming stopped half-way."""


class RanksAgree(ABC):
    """A transport every trainer rank runs (`Transport.every_rank`: sharded sending): the ranks agree before each
    push and exchange what each decided."""

    @abstractmethod
    async def before_push(self, timeout: float, error: BaseException | None = None) -> None:
        """On every rank, before a push's pipeline: agree across ranks that the push goes ahead (`error`: this
        rank cannot push; every rank then raises) and that the transport is intact (rebuilding it together where
        not)."""

    @abstractmethod
    async def exchange(self, obj: object, timeout: float) -> list[object]:
        """On every rank at the same point: `obj` of every trainer rank, in rank order (a sharded delta push's
        decisions)."""


class Receiver(ABC):
    """Receiving half, inside an engine worker (or a plain receiver process)."""

    name: ClassVar[str]
    #: the receiver's copies are ordered on the device by the transport itself (the chunk's ready and release
    #: events): an update may return before they ran. False: the chunk's bytes are reused once the update
    #: returns, so a worker on an accelerator waits for its copies first
    orders_on_device: ClassVar[bool] = False

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cpu") -> None:
        self.init_info = init_info
        self.device = torch.device(device)

    @abstractmethod
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> AbstractContextManager[torch.Tensor]:
        """Map the chunk named by `update_info` and yield its flat uint8 bytes; unmap on exit.

        `nbytes`: the chunk's size from its already validated layout (`WeightReceiver` always passes it). A
        transport that allocates for a chunk refuses a handle of another size before it allocates anything."""

    def views(self, buf: torch.Tensor, layout: Layout) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, view) of every tensor of the chunk in `buf` (the tensor `open` yielded)."""
        return unpack(buf, layout)

    def delta_views(self, buf: torch.Tensor, layout: Layout, base: Any,
                    delta: dict[str, Any]) -> Iterable[tuple[str, torch.Tensor]]:
        """`views` of a sharded push's chunk from a sender that pushes deltas (`receiver.base_copy`): only a
        transport that takes slices from every trainer rank ("p2p") has them."""
        raise ValidationError(f"the {self.name} transport takes no sharded deltas")

    def ref_views(self, update_info: dict[str, Any], in_round: bool = True) -> list[tuple[TensorMeta, torch.Tensor]]:
        """Tensors of the chunk sent by reference instead of packed (one copy): (metadata, view). Called while
        the chunk is open, or with `in_round=False` for references sent ahead of a push (`WeightReceiver.prime`).
        Transports without references refuse an update that has some."""
        h = update_info.get("handle")
        if isinstance(h, dict) and h.get("refs"):
            raise ValidationError(f"the {self.name} transport takes no tensors by reference")
        return []

    def end_round(self) -> None:  # noqa: B027 - a notification
        """A round (start..finish, or a failed one) ended: drop per-round mappings."""

    def stats(self) -> dict[str, float]:
        """What this receiving half measured since it started (host seconds mapping trainer storages, ...),
        reported with the receiver's status."""
        return {}

    def close(self) -> None:  # noqa: B027 - a notification
        """Release transport resources (process groups)."""


class Abandons(ABC):
    """A receiving half that other senders may still be sending to when its round fails (p2p: every trainer
    rank)."""

    @abstractmethod
    def abandon(self) -> None:
        """A round failed (`WeightReceiver.abort`): close, so that those sends fail at once instead of at their
        timeout; the senders make it anew before the next push."""


@dataclass(frozen=True)
class _Entry:
    module: str
    sender: str
    receiver: str
    reaches: str


# Lazy registry: name -> where the two halves are, and what the transport reaches (`transport="auto"`).
_REGISTRY: dict[str, _Entry] = {}


def register_transport(name: str, module: str, sender: str, receiver: str, *,
                       reaches: Literal["cpu", "cuda", "remote"]) -> None:
    """Register a transport by the module and class names of its halves (imported when first used). A name
    registered already is refused: two transports under one name would make receivers guess."""
    if name in _REGISTRY:
        raise ValidationError(f"transport {name!r} is registered already ({_REGISTRY[name].module})")
    if reaches not in ("cpu", "cuda", "remote"):
        raise ValidationError(f"transport {name!r}: reaches must be 'cpu', 'cuda' or 'remote', got {reaches!r}")
    _REGISTRY[name] = _Entry(module, sender, receiver, reaches)


register_transport("shm", "streamsync.transports.shm", "ShmTransport", "ShmReceiver", reaches="cpu")
register_transport("cuda_ipc", "streamsync.transports.cuda_ipc", "CudaIpcTransport", "CudaIpcReceiver",
                   reaches="cuda")
register_transport("collective", "streamsync.transports.collective", "CollectiveTransport", "CollectiveReceiver",
                   reaches="remote")
register_transport("p2p", "streamsync.transports.p2p", "P2pTransport", "P2pReceiver", reaches="remote")


def _entry(name: str) -> _Entry:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValidationError(f"unknown transport {name!r}; known: {sorted(_REGISTRY)}") from None


def transport_class(name: str) -> type[Transport]:
    entry = _entry(name)
    cls: type[Transport] = getattr(importlib.import_module(entry.module), entry.sender)
    return cls


def transport_names() -> list[str]:
    """The registered transports' names, in registration order (`transport=` and the CLI's choices)."""
    return list(_REGISTRY)


def transport_for(reaches: str) -> str:
    """The registered transport that reaches engines of this kind ("cpu", "cuda" or "remote")."""
    names = [n for n, e in _REGISTRY.items() if e.reaches == reaches]
    if not names:
        raise ValidationError(f"no transport registered reaches {reaches!r} engines; pass transport=")
    return names[0]


def make_receiver(init_info: dict[str, Any], device: torch.device | str = "cpu") -> Receiver:
    if not isinstance(init_info, dict) or not isinstance(init_info.get("transport"), str):
        raise ValidationError(f"init_info must be a dict with a 'transport' name, got {init_info!r:.200}")
    entry = _entry(init_info["transport"])
    cls: type[Receiver] = getattr(importlib.import_module(entry.module), entry.receiver)
    return cls(init_info, device)
