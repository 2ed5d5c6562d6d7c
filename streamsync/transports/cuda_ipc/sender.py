"""The CUDA IPC sending half (in the trainer): pooled buffers, one-copy references, events."""

from __future__ import annotations

import base64
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from ...engines.abilities import Primable
from ...errors import TransportError, ValidationError
from ...log import get_logger
from ...message import ChunkHandle, Recipient, UpdateMessage
from ...pack import ALIGN, Layout, batched, castable, coalesce, dtype_from_name, fits
from ...plan.chunk import ChunkPlan
from ..base import Primes, SendBuffer, Transport
from ..pool import BufferPool, PoolBuffer, captured
from ..refs import Export, References, RefSet, deliver, handles_with_refs, prime_chunk, storage_address
from . import driver as cuda_driver
from .handle import PROCESS_ID, export_handle, gpu_uuid

if TYPE_CHECKING:
    from ...engines.base import Engine
    from ...sources.base import Source


def _segments_freed(device: torch.device) -> int:
    """How many segments the caching allocator has given back to the driver on `device` (cumulative)."""
    try:  # the raw nested stats: `torch.cuda.memory_stats` flattens ~100 keys in Python first
        return int(torch._C._cuda_memoryStats(device.index)["segment"]["all"]["freed"])
    except Exception:
        return int(torch.cuda.memory_stats(device).get("segment.all.freed", 0))


def _copy_all(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """dst[i] <- src[i] on the current stream: large tensors one copy each (cudaMemcpy speed), small ones in
    one batched `_foreach_copy_` (one launch loop in C++ instead of one Python call per tensor)."""
    small_d, small_s = [], []
    for d, t in zip(dsts, srcs, strict=True):
        if d.dtype == t.dtype and batched(t):
            small_d.append(d)
            small_s.append(t)
        else:
            d.copy_(t, non_blocking=True)
    if small_d:
        torch._foreach_copy_(small_d, small_s, non_blocking=True)


# ------------------------------------------------------------------------------------------------ sender


def _flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole of `t`'s storage (what an export maps)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


class CudaIpcTransport(Transport, Primes):
    """device: where send buffers live (default: the current CUDA device when the first push starts; it
    should be the model's device). keep_pool: keep up to `max_inflight` buffers between pushes.
    graphs: replay a chunk's pack copies as one captured CUDA graph once the same chunk has been packed
    from the same source addresses into the same buffer before (see `pack`).
    one_copy: send tensors that are plain views of the source's own storages by reference (package doc).
    ref_bytes: referenced bytes per chunk (the chunk budget, `chunk_bytes`, bounds only the packed bytes): each
    chunk costs an update call and its per-chunk work on both sides, so chunks of references are few and large.
    ipc: "driver" shares storages through the CUDA driver (`driver.py`), "torch" through PyTorch's IPC (also
    the fallback where the driver refuses an allocation)."""

    name: ClassVar[str] = "cuda_ipc"
    reaches: ClassVar[Literal["cpu", "cuda", "remote"]] = "cuda"

    def __init__(self, device: torch.device | str | None = None, keep_pool: bool = True, graphs: bool = True,
                 one_copy: bool = True, ref_bytes: int = 8 << 30, ipc: str = "driver") -> None:
        super().__init__()
        if ipc not in ("driver", "torch"):
            raise ValidationError(f"ipc must be 'driver' or 'torch', got {ipc!r}")
        self.ipc = ipc
        self._device = torch.device(device) if device is not None else None
        self.keep_pool = keep_pool
        self.graphs = graphs
        self.refs = References(self, one_copy=one_copy, ref_bytes=ref_bytes)
        self._engines = 0
        #: this push's counts: packs replayed from a captured graph, graphs captured
        self.counts: defaultdict[str, float] = defaultdict(float)
        self._pool: BufferPool | None = None
        # Exported release events stay alive until close: a receiver may hold one open after its buffer
        # left the pool, and an exported event must outlive its importers' use.
        self._events: list[torch.cuda.Event] = []
        self._driver_warned = False
        self._freed_seen = -1  # the allocator's count of segments freed, at the last push start
        self._segments_freed = True

    @property
    def one_copy(self) -> bool:
        return self.refs.one_copy

    @property
    def ref_chunk_bytes(self) -> int | None:
        return self.refs.chunk_bytes

    @property
    def pool(self) -> BufferPool:
        if self._pool is None:
            if not torch.cuda.is_available():
                raise TransportError("the cuda_ipc transport needs a CUDA device in the trainer")
            dev = self._device or torch.device("cuda", torch.cuda.current_device())
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
            self._pool = BufferPool(dev, keep=self.keep_pool, on_drop=torch.cuda.ipc_collect)
        return self._pool

    def init_info(self, index: int, engine: Engine) -> dict[str, Any]:
        self.refs.forget_engine(index)  # a (re)connected engine maps nothing yet: every storage is exported afresh
        return {**super().init_info(index, engine), "process": PROCESS_ID}

    def begin_push(self, plans: Sequence[ChunkPlan], source: Source, engines: Sequence[Engine], *,
                   by_reference: bool = True) -> None:
        """Note which storages may go by reference (the source's own tensors on this device; none where an
        engine has several workers: the exact IPC reference count assumes one receiver per export), and size
        the pool."""
        torch.cuda.ipc_collect()  # free buffers dropped earlier whose receivers have let go since
        self._engines = len(engines)
        self.counts = defaultdict(float)
        self._begin_refs(source, engines, by_reference)
        # With references a chunk's buffer holds only its packed part: buffers grow to what chunks need
        # (pool.take) instead of every buffer taking the largest chunk's size.
        self.pool.begin(self.pool.size if self.refs.persistent else max(p.nbytes for p in plans))

    def _begin_refs(self, source: Source, engines: Sequence[Engine], by_reference: bool = True) -> None:
        referenced = self.one_copy and by_reference and all(e.workers == 1 for e in engines)
        self.refs.begin_push(source.local_addresses(self.pool.device) if referenced else set())
        # Segments the caching allocator gave back to the driver since the last push: only then can an address a
        # driver export names hold a new allocation (`alive` then compares allocation ids).
        freed = _segments_freed(self.pool.device)
        self._segments_freed = freed != self._freed_seen
        self._freed_seen = freed

    def begin_prime(self, source: Source, engines: Sequence[Engine]) -> bool:
        if not (self.one_copy and any(isinstance(e, Primable) for e in engines)) or not torch.cuda.is_available():
            return False
        seen = self._freed_seen
        self._begin_refs(source, engines)
        # Every export the prime reuses is checked against its allocation; the next push still compares with the
        # last push's count (exports the prime did not touch were last checked then).
        self._segments_freed, self._freed_seen = True, seen
        return bool(self.refs.persistent)

    async def prime(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor], engines: Sequence[Engine],
                    timeout: float) -> int:
        return await prime_chunk(self.refs, plan, tensors, self.pool.device, engines, timeout)

    def end_prime(self, ok: bool) -> None:
        if not ok:  # engines may hold part of it: export afresh (a success keeps every export: no round ended)
            self.refs.drop_all()

    # StorageExporter (refs.References)
    def export(self, t: torch.Tensor) -> tuple[dict[str, Any], Any]:
        """Through the driver (`driver.py`: no per-share event or counter file; the storage is held while the
        export lives), else PyTorch's sharing (its caching allocator keeps an exported block from reuse)."""
        if self.ipc == "driver" and cuda_driver.available():
            try:
                return cuda_driver.export_storage(t, gpu_uuid(t.device.index))
            except TransportError as e:  # e.g. memory from an allocator without IPC support
                if not self._driver_warned:
                    self._driver_warned = True
                    get_logger().warning("cuda_ipc: exporting through the CUDA driver failed; using PyTorch's "
                                         "sharing", error=str(e))
        return export_handle(_flat_storage(t)), None

    def alive(self, export: Export, addr: int) -> bool:
        """A driver export holds its storage: it is stale once that storage no longer lies at `addr` (resized or
        freed in place, FSDP-style), since another storage may since have been allocated there; or, after the
        allocator gave segments back to the driver since the last push, once the allocation at `addr` is another
        (resized to nothing, the cache emptied, resized back: same storage, same address, new memory). PyTorch's
        sharing kept such blocks in limbo instead."""
        held = export.keep
        if not isinstance(held, cuda_driver.Held):
            return True
        if held.storage.data_ptr() != addr:
            return False
        return not self._segments_freed or cuda_driver.buffer_id(addr) == held.buffer

    def all_alive(self, rs: RefSet) -> bool:
        """`alive` of every export of `rs`: where no segment went back to the driver since the last push, one pass
        comparing each held storage's data pointer with its address (kept in `rs.memo`), instead of a call per
        export (an MoE chunk's set names thousands)."""
        if self._segments_freed:
            return all(self.alive(ex, a) for a, ex in rs.exports)
        if rs.memo is None:
            held = [(ex.keep.storage, a) for a, ex in rs.exports if isinstance(ex.keep, cuda_driver.Held)]
            rs.memo = ([st for st, _ in held], [a for _, a in held])
        storages, addrs = rs.memo
        return list(map(torch.UntypedStorage.data_ptr, storages)) == addrs

    def allocate(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor]) -> SendBuffer:
        """The chunk's buffer: sized for the tensors that are packed; those that are plain views of the source's
        own storages go by reference (package doc)."""
        cr = self.refs.chunk(chunk, tensors, self.pool.device)
        need = chunk.nbytes if cr is None else max(cr.compact.layout.nbytes if cr.compact.packed else 0, ALIGN)
        pb = self.pool.take(need)
        return SendBuffer(chunk.index, pb.size, pb.tensor[:need], {"token": pb.token}, pooled=pb, refs=cr)

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Queue the chunk's copies (`_pack_copies`), then make its references per engine: a first push's
        exports (hundreds of storages) run here, while the engines load the chunk before, not in `send`, and
        in slices, so that the engines' replies to that chunk are taken as they come (`export_ahead`)."""
        self._pack_copies(buf, layout, tensors)
        if buf.refs is not None:
            await self.refs.export_ahead(buf.refs, self._engines)
            self.refs.prepare(buf.refs, self._engines)

    def _pack_copies(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Queue the chunk's copies into its buffer on a side stream, and return: receivers wait for the
        buffer's ready event on the device, and the next pack into it for their release events.

        The copies are launched from the event loop's own thread. A worker thread looks cheaper but is not:
        every torch op releases and retakes the GIL, and while the loop thread holds it (convert, send) the
        worker waits for its turn after each of a chunk's tens of launches; that wait was most of a push.
        Launching a dense chunk's copies still costs the loop a Python call per tensor, so a chunk packed a second
        time from the same source addresses (shape, strides, dtype) into the same buffer is captured as a
        CUDA graph, and every later pack of it is one graph launch. The graph copies from addresses, so
        it stays right whatever those addresses hold then; sources at new addresses (a gathered temporary
        the allocator placed elsewhere) are packed by plain copies. Destination views are made once per
        (buffer, layout); small tensors go in one batched copy.
        """
        pb = buf.pooled
        assert pb is not None
        if buf.refs is not None:  # only the chunk's packed part goes into the buffer
            layout = buf.refs.compact.layout
            tensors = buf.refs.packed
        # The same tensor list as this buffer's last pack of this layout (a source that caches its views):
        # its destination views, graph key and temporaries are the same too, without a pass over its tensors.
        fast = pb.cache.get(("fast", layout))
        if fast is not None and fast[0] is tensors:
            dsts, key, temporaries = fast[1], fast[2], fast[3]
        else:
            dsts = self._dst_views(pb, layout, tensors)
            key = ("graph", layout, tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors))
            # the source's own storages live through the push; anything else (a conversion's output) may be
            # freed before the side stream copied it
            persistent = self.refs.persistent
            temporaries = [t for t in tensors if t.is_cuda and storage_address(t) not in persistent]
            pb.cache[("fast", layout)] = (tensors, dsts, key, temporaries)
        device = pb.tensor.device
        stream = self.side_stream(device)
        ready = self._ready_event(pb)
        producer = torch.cuda.current_stream(device)
        with torch.cuda.device(device):
            graph = self._graph(pb, key, dsts, tensors, stream) if self.graphs and tensors else None
            stream.wait_stream(producer)  # the producer's writes (convert) first
            for ev in pb.release_events:  # every receiver's copies out of the previous chunk
                stream.wait_event(ev)
            with torch.cuda.stream(stream):
                if graph is not None:
                    graph.replay()
                    self.counts["pack_graphs_replayed"] += 1
                else:
                    _copy_all(dsts, tensors)
                ready.record(stream)  # receivers wait for this on the device
                for t in temporaries:  # they may be freed before these copies ran
                    t.record_stream(stream)
        buf.ready = ready

    def _graph(self, pb: PoolBuffer, key: tuple, dsts: list[torch.Tensor], tensors: Sequence[torch.Tensor],
               stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph | None:
        """The captured pack of this chunk into `pb`, capturing it on the second sighting of its sources
        (`key`: the layout and every source's address, dtype, shape and strides)."""
        try:  # replayed every push: fewer, larger copies
            graph, fresh = captured(pb, key, stream, lambda: _copy_all(*coalesce(dsts, tensors)))
        except RuntimeError as e:  # a copy this CUDA build cannot capture: plain copies from now on
            get_logger().warning("cuda_ipc: pack capture failed; packing with plain copies", error=str(e))
            self.graphs = False
            return None
        self.counts["pack_graphs_captured"] += fresh
        return graph

    def _dst_views(self, pb: PoolBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The chunk's destination views in `pb`, shaped like `tensors` (a blocked source, e.g. q as a view
        of a fused QKV, is written in its row-major order). Cached per (buffer, layout, source shapes)."""
        key = ("views", layout, tuple((t.dtype, t.shape) for t in tensors))
        dsts = pb.cache.get(key)
        if dsts is not None:
            return dsts
        if len(tensors) != len(layout.metas):
            raise ValidationError(f"{len(tensors)} tensors for a layout of {len(layout.metas)}")
        dsts = []
        for m, t in zip(layout.metas, tensors, strict=True):
            d = pb.tensor[m.offset:m.offset + m.nbytes].view(dtype_from_name(m.dtype)).view(m.shape)
            if not castable(t.dtype, d.dtype) or (d.shape != t.shape and not fits(t, tuple(d.shape))):
                raise ValidationError(f"tensor {m.name!r} is {t.dtype}{tuple(t.shape)}, its layout slot is "
                                      f"{d.dtype}{tuple(d.shape)}")
            dsts.append(d if d.shape == t.shape else d.view(t.shape))
        pb.cache[key] = dsts
        return dsts

    def _ready_event(self, pb: PoolBuffer) -> torch.cuda.Event:
        if pb.ready is None:
            with torch.cuda.device(pb.tensor.device):
                ev = torch.cuda.Event(interprocess=True)
                ev.ipc_handle()  # creates the event on the buffer's device
            self._events.append(ev)
            pb.ready = ev
        return pb.ready

    def _wait_packs(self) -> None:
        """Every queued pack has finished (before buffers are dropped, and before a push returns: the trainer
        may change its weights right after)."""
        for stream in self._streams.values():
            stream.synchronize()

    def _handle(self, pb: PoolBuffer, engine: int, nbytes: int, live: list[str]) -> dict[str, Any]:
        # One export per (buffer, engine): torch counts one release per export, so each receiver gets its own.
        ipc = pb.exports.get(engine)
        if ipc is None:
            ipc = export_handle(pb.tensor)
            with torch.cuda.device(pb.tensor.device):
                ev = torch.cuda.Event(interprocess=True)
                ipc["release_event"] = base64.b64encode(ev.ipc_handle()).decode()
                ipc["ready_event"] = base64.b64encode(self._ready_event(pb).ipc_handle()).decode()
            self._events.append(ev)
            pb.release_events.append(ev)
            pb.exports[engine] = ipc
        return {"token": pb.token, "nbytes": nbytes, "ipc": ipc, "live": live}

    def handles(self, buf: SendBuffer, engines: int) -> Sequence[ChunkHandle]:
        pb = buf.pooled
        assert pb is not None
        live = self.pool.live_tokens
        bases = [self._handle(pb, i, buf.tensor.numel(), live) for i in range(engines)]
        return handles_with_refs(self.refs, buf.refs, bases)

    async def send(self, buf: SendBuffer, messages: Sequence[UpdateMessage], recipients: Sequence[Recipient]) -> None:
        await deliver(self.refs, buf.refs, messages, recipients)

    def free(self, buf: SendBuffer) -> None:
        pb, buf.pooled, buf.refs = buf.pooled, None, None
        if pb is not None:
            buf.tensor = torch.empty(0, dtype=torch.uint8)
            self.pool.give(pb)

    def push_counts(self) -> Mapping[str, float]:
        return {**self.counts, **{f"refs.{k}": v for k, v in self.refs.counts.items()}}

    def end_push(self, ok: bool) -> None:
        self._wait_packs()
        self.pool.end()
        # Receivers drop the storages a round did not reference (CudaIpcReceiver.end_round); so does the
        # sender, after a success. After a failure it cannot tell what each receiver mapped: export afresh.
        self.refs.end_push(ok)

    def release_pool(self) -> None:
        """Drop every pooled buffer. Memory comes back once receivers dropped their mappings (they do when
        a later handle no longer lists the buffer, or when they close)."""
        if self._pool is not None:
            self._wait_packs()
            self._pool.release()

    async def close(self) -> None:
        if self._pool is not None:
            self._wait_packs()
            self._pool.end()
            self._pool.release()
        self._events.clear()
        self.refs.drop_all()
