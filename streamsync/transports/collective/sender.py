"""The collective sending half (in the trainer): the group's rank 0, per-chunk broadcasts."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
import torch

from ...errors import EngineError, TransportError, ValidationError
from ...log import get_logger
from ...message import ChunkHandle, Recipient, UpdateMessage
from ...pack import Layout, pack_into
from ...plan.chunk import ChunkPlan
from ..base import SendBuffer, Transport
from ..pool import BufferPool, PoolBuffer, captured
from .group import (
    BACKENDS,
    CLOSE_TIMEOUT,
    BroadcastHandle,
    GroupInit,
    Stalled,
    broadcast,
    dispose,
    host_store,
    in_thread,
    join_thread,
    launch_broadcast,
    make_group,
    wait_event,
)

if TYPE_CHECKING:
    from ...engines.base import Engine
    from ...sources.base import Source


# ------------------------------------------------------------------------------------------------ sender


class CollectiveTransport(Transport):
    """backend: "nccl", "gloo" or "auto" (NCCL when every engine is on CUDA and this torch has CUDA).
    master_addr/master_port: where the sender's rendezvous store listens (port 0: any free port); engines
    must reach it; nothing else can. device: where send buffers live (default: CUDA for NCCL, CPU for gloo).
    group_timeout: the rendezvous, every collective and every acknowledgement (default: the sync's timeout).
    close_timeout: `close()` returns within this many seconds whatever the receivers do.
    graphs: replay a chunk's pack as a captured CUDA graph once it was packed the same way before.
    An engine with several workers says so (`Engine.workers`): each joins the group as a rank of its own."""

    name: ClassVar[str] = "collective"
    rendezvous: ClassVar[bool] = True
    pairs_with_local: ClassVar[bool] = True
    reaches: ClassVar[Literal["cpu", "cuda", "remote"]] = "remote"
    delta_pays: ClassVar[bool] = True

    def __init__(self, backend: str = "auto", *, master_addr: str = "127.0.0.1", master_port: int = 0,
                 device: torch.device | str | None = None, keep_pool: bool = True,
                 group_timeout: float | None = None, close_timeout: float = CLOSE_TIMEOUT,
                 graphs: bool = True) -> None:
        super().__init__()
        if backend not in (*BACKENDS, "auto"):
            raise ValidationError(f"collective backend must be one of {(*BACKENDS, 'auto')}, got {backend!r}")
        self.graphs = graphs
        #: this push's counts: packs replayed from a captured graph, graphs captured
        self.counts: defaultdict[str, float] = defaultdict(float)
        self.backend = backend
        self.master_addr = master_addr
        self.master_port = master_port
        self._device = torch.device(device) if device is not None else None
        self.keep_pool = keep_pool
        self.group_timeout = group_timeout
        self.close_timeout = close_timeout
        self._host_ordered = False
        self._pool: BufferPool | None = None
        self._pg: Any = None
        self._store: Any = None
        self._infos: list[dict[str, Any]] = []
        self._seq = 0
        self._broken: str | None = None
        self._stream: torch.cuda.Stream | None = None
        self._timeout = 60.0
        self._last_chunk = -1
        self._prev_sent: torch.cuda.Event | None = None
        self._group: str | None = None
        self._backend: str | None = None

    def order_on_host(self) -> None:
        """Wait for every broadcast on the host, never on the device: for buffers another transport packs
        (`MixedTransport`), whose pack this transport's streams know nothing of."""
        self._host_ordered = True

    # -- setup -----------------------------------------------------------------------------------------

    def _resolve_backend(self, engines: Sequence[Engine]) -> str:
        if self.backend != "auto":
            return self.backend
        cuda = all(e.device.startswith("cuda") for e in engines) and torch.cuda.is_available()
        return "nccl" if cuda else "gloo"

    def init_info(self, index: int, engine: Engine) -> dict[str, Any]:
        return self._infos[index]

    async def connect(self, engines: Sequence[Engine], timeout: float) -> None:
        """Rendezvous with every engine worker: the engines' init calls and the sender's own group
        construction run together and must all finish within `timeout`. Also after a failed push: the old
        group is aborted and a new one made."""
        import torch.distributed as dist

        await self.close()
        backend = self._resolve_backend(engines)
        workers = [e.workers for e in engines]
        if any(w < 1 for w in workers):
            raise ValidationError(f"every engine needs at least one worker, got {workers}")
        world = 1 + sum(workers)
        gtimeout = timedelta(seconds=self.group_timeout or timeout)
        self._timeout = gtimeout.total_seconds()
        self._store = host_store(self.master_addr, self.master_port, world, gtimeout)
        group = f"streamsync-{uuid.uuid4().hex[:12]}"
        self._infos, offset = [], 1
        for w in workers:
            self._infos.append(GroupInit(self.name, backend, group, self.master_addr, int(self._store.port), world,
                                         offset, w, gtimeout.total_seconds()).to_wire())
            offset += w
        self._group, self._backend, self._seq, self._broken = group, backend, 0, None
        prefixed = dist.PrefixStore(group, self._store)
        device = self.device  # here: a worker thread's current CUDA device is its own (0)

        def join() -> Any:
            pg = make_group(backend, prefixed, 0, world, gtimeout, self.master_addr)
            # First collective: NCCL builds its communicator here, not in the middle of the first push.
            broadcast(pg, torch.zeros(1, dtype=torch.uint8, device=device if backend == "nccl" else "cpu"))
            return pg

        async def own_side() -> None:
            self._pg = await in_thread(join)

        try:
            with anyio.fail_after(timeout):
                async with anyio.create_task_group() as tg:
                    for i, e in enumerate(engines):
                        tg.start_soon(e.init_transfer, self._infos[i])
                    tg.start_soon(own_side)
        except TimeoutError:
            await self.close()
            raise TransportError(f"collective rendezvous ({backend}, world {world}) timed out after "
                                 f"{timeout:.1f}s: did every engine worker join?") from None
        except BaseException:
            await self.close()
            raise

    @property
    def device(self) -> torch.device:
        if self._device is not None:
            dev = self._device
        elif (self._backend or self.backend) == "nccl":
            dev = torch.device("cuda")
        else:
            dev = torch.device("cpu")
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:
            self._pool = BufferPool(self.device, keep=self.keep_pool)
        return self._pool

    def _streamed(self, t: torch.Tensor) -> bool:
        """Device-ordered protocol (package doc): NCCL with CUDA buffers."""
        return t.is_cuda and (self._backend or self.backend) == "nccl" and not self._host_ordered

    # -- per push --------------------------------------------------------------------------------------

    def begin_push(self, plans: Sequence[ChunkPlan], source: Source, engines: Sequence[Engine], *,
                   by_reference: bool = True) -> None:
        self.counts = defaultdict(float)
        self.pool.begin(max(p.nbytes for p in plans))
        self._last_chunk = max(p.index for p in plans)
        self._prev_sent = None

    def allocate(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor]) -> SendBuffer:
        pb = self.pool.take(chunk.nbytes)
        return SendBuffer(chunk.index, pb.size, pb.tensor[: chunk.nbytes], {"nbytes": chunk.nbytes}, pooled=pb)

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        if self._streamed(buf.tensor):
            self._pack_streamed(buf, layout, tensors)
            return
        await super().pack(buf, layout, tensors)
        if buf.tensor.device.type == "cpu":  # device-to-host copies may still be in flight: wait for them
            for dev in {t.device for t in tensors if t.is_cuda}:
                await anyio.to_thread.run_sync(torch.cuda.current_stream(dev).synchronize)

    def _graph(self, pb: PoolBuffer, dst: torch.Tensor, layout: Layout, tensors: Sequence[torch.Tensor],
               stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph | None:
        """The pack of this chunk into `pb` captured as a CUDA graph, from the second time the same tensors
        (addresses, dtypes, shapes, strides) are packed into it the same way: launching a dense chunk's copies
        costs the event loop about a millisecond, which the replies of the engines' updates wait behind."""
        fast = pb.cache.get(("fast", layout))
        if fast is not None and fast[0] is tensors:  # a source's cached views: the same key
            key = fast[1]
        else:
            key = ("graph", layout, dst.data_ptr(),
                   tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors))
            pb.cache[("fast", layout)] = (tensors, key)
        try:
            graph, fresh = captured(pb, key, stream, lambda: pack_into(dst, layout, tensors))
        except RuntimeError as e:  # a copy this build cannot capture: plain copies from now on
            get_logger().warning("collective: pack capture failed; packing with plain copies", error=str(e))
            self.graphs = False
            return None
        self.counts["pack_graphs_captured"] += fresh
        return graph

    def _pack_streamed(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Queue the copies on the pack stream behind the producer's writes and behind the last broadcast out
        of this buffer; return at once (the broadcast waits for `ready` on the device). A chunk packed before
        from the same addresses into the same buffer replays its captured pack (`_graph`)."""
        pb = buf.pooled
        assert pb is not None
        dev = buf.tensor.device
        stream = self.side_stream(dev)
        with torch.cuda.device(dev):
            graph = self._graph(pb, buf.tensor, layout, tensors, stream) if self.graphs else None
            stream.wait_stream(torch.cuda.current_stream(dev))
            if pb.sent is not None:
                stream.wait_event(pb.sent)
            with torch.cuda.stream(stream):
                if graph is not None:
                    graph.replay()
                    self.counts["pack_graphs_replayed"] += 1
                else:
                    pack_into(buf.tensor, layout, tensors)
                for t in tensors:  # conversion temporaries may be freed before these copies ran
                    if t.is_cuda:
                        t.record_stream(stream)
                buf.tensor.record_stream(stream)  # a failed push drops the buffer while copies may be queued
                if pb.ready is None:
                    pb.ready = torch.cuda.Event()
                pb.ready.record(stream)
        buf.ready = pb.ready

    def handles(self, buf: SendBuffer, engines: int) -> Sequence[ChunkHandle]:
        """The chunk's broadcast: the group, its sequence number (a receiver out of step refuses before it
        enters a collective), its size and whether both sides order it on the device."""
        if self._pg is None or self._group is None:
            raise TransportError("collective transport is not connected")
        if self._broken is not None:
            raise TransportError(f"collective group is unusable ({self._broken}); "
                                 "close the WeightSync (or transport) and connect again")
        seq = self._seq
        self._seq += 1
        handle = BroadcastHandle(self._group, seq, buf.tensor.numel(), self._streamed(buf.tensor))
        return [ChunkHandle(handle.to_wire())] * engines

    async def send(self, buf: SendBuffer, messages: Sequence[UpdateMessage], recipients: Sequence[Recipient]) -> None:
        """Every engine's update and the broadcast, together: an engine's update enters the broadcast, loads
        and returns (package doc)."""
        handle = messages[0].handle
        seq, streamed, chunk = handle["seq"], handle["device_ordered"], buf.chunk
        pending = {r.name for r in recipients}
        ok = False

        async def bcast() -> None:
            try:
                if streamed:
                    pb = buf.pooled
                    assert pb is not None
                    comm = self._comm_stream(buf.tensor)
                    assert comm is not None
                    pb.sent = sent = await in_thread(launch_broadcast, self._pg, buf.tensor, comm, pb.ready)
                    # Bounded host work: the previous broadcast has finished (the last chunk: this one too).
                    for ev in (self._prev_sent, sent if chunk == self._last_chunk else None):
                        if ev is not None:
                            await in_thread(wait_event, ev, self._timeout, f"broadcast before chunk {chunk}")
                    self._prev_sent = sent
                else:
                    await in_thread(broadcast, self._pg, buf.tensor, self._comm_stream(buf.tensor))
            except RuntimeError as e:  # c10d's errors name no chunk or peer: say which broadcast, and who owes it
                # Engines that had not acknowledged are dead, frozen, or inside the broken collective until
                # its timeout: the failed push does not wait for them again (unresponsive).
                who = ",".join(sorted(pending)) or ",".join(r.name for r in recipients)
                raise EngineError(who, f"broadcast of chunk {chunk} (seq {seq}) failed: {e}",
                                  unresponsive=bool(pending) or isinstance(e, Stalled)) from e

        async def update(r: Recipient, m: UpdateMessage) -> None:
            await r.update(m)
            pending.discard(r.name)

        try:
            with anyio.fail_after(self._timeout):
                async with anyio.create_task_group() as tg:
                    for r, m in zip(recipients, messages, strict=True):
                        tg.start_soon(update, r, m)
                    tg.start_soon(bcast)
            ok = True
        except TimeoutError:
            who = ",".join(sorted(pending)) or ",".join(r.name for r in recipients)
            raise EngineError(who, f"chunk {chunk}: no acknowledgement of its broadcast within the group timeout "
                                   f"({self._timeout:.1f}s): receiver frozen or dead?", unresponsive=True) from None
        finally:
            if not ok:  # some rank may still sit in this broadcast: the group's sequence is lost
                self._broken = f"chunk {chunk} failed during its broadcast"

    def _comm_stream(self, t: torch.Tensor) -> torch.cuda.Stream | None:
        if not t.is_cuda:
            return None
        if self._stream is None or self._stream.device != t.device:
            self._stream = torch.cuda.Stream(t.device)
        return self._stream

    def free(self, buf: SendBuffer) -> None:
        pb, buf.pooled = buf.pooled, None
        buf.ready = None
        if pb is not None:
            buf.tensor = torch.empty(0, dtype=torch.uint8)
            self.pool.give(pb)

    def push_counts(self) -> Mapping[str, float]:
        return dict(self.counts)

    def end_push(self, ok: bool) -> None:
        self.pool.end()

    @property
    def broken(self) -> str | None:
        """Why the group cannot be used any more (a push failed during a broadcast), or None."""
        return self._broken

    async def close(self) -> None:
        """Abort the group and drop the store; returns within `close_timeout` whatever the receivers do
        (alive, closing at the same time, killed or frozen)."""
        pg, store = self._pg, self._store
        self._pg = self._store = None
        if pg is not None or store is not None:
            t = dispose(pg, store)
            del pg, store
            if not await join_thread(t, self.close_timeout):
                get_logger().warning("collective: group abort did not finish; abandoned", group=self._group,
                                     timeout_s=self.close_timeout)
        if self._pool is not None:
            self._pool.release()
        # Fresh streams for the next group: an aborted broadcast must not stand in front of new work.
        self._prev_sent = self._stream = None
        self._streams = {}
