"""Colocated GPU transport: the trainer and the engine share a GPU; chunks move by CUDA IPC handles.

One handle per packed chunk, as plain JSON data, never a pickle: the sender takes the arguments that
`torch.multiprocessing.reductions.reduce_tensor` produces for its buffer (handle bytes as base64, sizes
and offsets as ints) and the receiver type-checks every field before it calls `rebuild_cuda_tensor`
itself, with the tensor and storage classes and the dtype fixed on its side. Handles are routed by the
GPU's UUID, so sender and receiver may number their devices differently (CUDA_VISIBLE_DEVICES).

Buffers come from a pool (at most the credit window of them, see `pool.py`), so in steady state no handle
is created or opened: the sender exports each buffer once per engine, the receiver opens each export once
and keeps the mapping, keyed by the buffer's token. Every handle lists the sender's live tokens; a receiver
drops mappings of buffers that are gone. That keeps torch's cross-process reference count exact (one
rebuild per export, one release per rebuild), so the sender's `torch.cuda.ipc_collect()` can free a
dropped buffer once no receiver maps it, and never earlier.

Ordering on the device (release="event", the default). Each buffer carries two interprocess CUDA events,
exported with its handle:
* ready: the sender records it on its pack stream after the chunk's copies; the receiver's stream waits on
  it before copying out. So the pack stage returns once the copies are queued, and the chunk's handle goes
  out while they run.
* release: the receiver records it on its stream after its copies out and returns from the update call
  without waiting for them. The release stage gives the buffer back to the pool, and the sender's pack
  stream waits on the release event before it packs into that buffer again.
So a buffer is never read before it is packed nor overwritten before every receiver has copied it out, yet
no host waits on a copy: packs, sends and the receivers' copies of different chunks overlap. The receiver's
`finish` (end_round) waits for its last copies before the new version is reported; the sender waits for
its last pack when the push ends. With release="sync", both sides also wait on the host (the sender for
each pack, the receiver for its copies before it returns): the plain protocol, where nothing of one chunk
overlaps the next at window 1 (benchmarks use it as the serial push). `release` may change between pushes:
the events go with every export either way, and each handle says whether the receiver must wait.

One copy (`one_copy=True`, the default). A converted tensor that is a plain view of a trainer parameter (TP=1
Megatron weights, HF modules, the Q/K/V and gate/up splits of fused weights) is not packed: the chunk's
handle names it as a *reference* (storage token, byte offset, shape, strides) and the receiver builds the
view on the trainer's storage, mapped by CUDA IPC once and kept across pushes, and copies from it straight
into its parameters. Only the rest (gathered or cast tensors, temporaries) is packed, into a buffer sized
for them, so the trainer's extra memory for referenced tensors is zero. Storages are the ones the source
lists as its own (`Source.local_tensors`), never conversion temporaries. Each side keeps a storage mapped
only while pushes use it: both drop the storages a successful push did not reference (the sender also drops
all of its exports after a failed push), so a parameter the trainer freed, resized or replaced between
pushes has a new address, gets a new export, and its old memory is freed once the receiver let go (torch
keeps an exported block out of reuse until then); a stale storage is never read. The ready event orders
the receiver's reads after the trainer's writes; the push returns after every receiver's `finish` waited
for its copies, so the trainer may change its weights right after.

Limitation: the exact reference count assumes one receiver process per engine (`ReceiverProcess`, a vLLM
engine with one worker). With several workers per engine sharing one export, the count may go below zero
and a dropped buffer is then only freed when the trainer exits; correctness is unaffected.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..errors import TransportError, ValidationError
from ..log import get_logger
from ..pack import ALIGN, Layout, TensorMeta, batched, castable, coalesce, dtype_from_name, fits, unpack
from ..sources.base import ChunkPlan, own_addresses
from . import cuda_driver
from .base import Receiver, SendBuffer, Transport
from .pool import BufferPool, PoolBuffer, captured
from .pool import remember as _remember
from .refs import RefReceiver, RefSender, _Compact, _Export, _Storage, storage_address  # noqa: F401 - re-export

if TYPE_CHECKING:
    from ..engines.base import Engine

_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")
_UUID = re.compile(r"^[0-9A-Za-z-]{1,80}$")
# torch names its IPC reference-counter files "/torch_{pid}_{random}_{n}": accept nothing else, so a crafted
# handle cannot point the receiver's counter update at another process's shared memory.
_REF_COUNTER = re.compile(rb"^/torch_-?[0-9]{1,20}_-?[0-9]{1,20}_-?[0-9]{1,20}$")
_MAX_INT = 1 << 50


@functools.lru_cache(maxsize=64)
def gpu_uuid(index: int) -> str:
    """Physical identity of a local device: the same string in every process on the host."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _segments_freed(device: torch.device) -> int:
    """How many segments the caching allocator has given back to the driver on `device` (cumulative)."""
    try:  # the raw nested stats: `torch.cuda.memory_stats` flattens ~100 keys in Python first
        return int(torch._C._cuda_memoryStats(device.index)["segment"]["all"]["freed"])
    except Exception:
        return int(torch.cuda.memory_stats(device).get("segment.all.freed", 0))


@functools.lru_cache(maxsize=64)
def local_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid`."""
    for i in range(torch.cuda.device_count()):
        if gpu_uuid(i) == uuid:
            return i
    raise TransportError(f"GPU {uuid} is not visible in this process (CUDA IPC needs sender and receiver "
                         "on the same GPU)")


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


def export_handle(tensor: torch.Tensor) -> dict[str, Any]:
    """The IPC arguments of a flat uint8 CUDA buffer, as plain data."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_cuda:
        raise ValidationError("only flat uint8 CUDA buffers are exported")
    fn, args = reduce_tensor(tensor)
    if fn is not rebuild_cuda_tensor:
        raise TransportError(f"reduce_tensor gave {fn!r}, expected rebuild_cuda_tensor")
    (_cls, size, _stride, tensor_offset, _storage_cls, _dtype, device, handle, storage_size, storage_offset,
     _requires_grad, ref_counter, ref_counter_offset, event, event_sync) = args
    return {
        "gpu": gpu_uuid(int(device)),
        "size": int(size[0]),
        "tensor_offset": int(tensor_offset),
        "handle": base64.b64encode(handle).decode(),
        "storage_size": int(storage_size),
        "storage_offset": int(storage_offset),
        "ref_counter": base64.b64encode(ref_counter).decode(),
        "ref_counter_offset": int(ref_counter_offset),
        "event": base64.b64encode(event if event is not None else b"").decode(),
        "event_sync": bool(event_sync),
    }


# ------------------------------------------------------------------------------------------------ sender


def _flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole of `t`'s storage (what an export maps)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


class CudaIpcTransport(RefSender, Transport):
    """device: where send buffers live (default: the current CUDA device when the first push starts; it
    should be the model's device). keep_pool: keep up to `max_inflight` buffers between pushes.
    graphs: replay a chunk's pack copies as one captured CUDA graph once the same chunk has been packed
    from the same source addresses into the same buffer before (see `pack`).
    one_copy: send tensors that are plain views of the source's own storages by reference (module doc).
    ref_bytes: referenced bytes per chunk (the chunk budget, `chunk_bytes`, bounds only the packed bytes).
    Measured on one H200 (Qwen3-8B shape): 1 GiB of references per chunk 31.7 ms, 2 GiB 16.4 ms, 8 GiB
    15.3 ms, 16 GiB 16.8 ms; each chunk costs an update call and its per-chunk work on both sides."""

    name = "cuda_ipc"

    def __init__(self, device: torch.device | str | None = None, keep_pool: bool = True,
                 release: str = "event", graphs: bool = True, one_copy: bool = True,
                 ref_bytes: int = 8 << 30, ipc: str = "driver") -> None:
        if release not in ("event", "sync"):
            raise ValidationError(f"release must be 'event' or 'sync', got {release!r}")
        if ipc not in ("driver", "torch"):
            raise ValidationError(f"ipc must be 'driver' or 'torch', got {ipc!r}")
        self.ipc = ipc
        self._device = torch.device(device) if device is not None else None
        self.keep_pool = keep_pool
        self.release = release
        self.graphs = graphs
        self._init_refs(one_copy, ref_bytes)
        self._single_worker = True
        self._engines = 0
        #: packs replayed from a captured graph, and graphs captured, since construction (for benchmarks)
        self.graph_stats = {"replayed": 0, "captured": 0}
        self._pool: BufferPool | None = None
        # Exported release events stay alive until close: a receiver may hold one open after its buffer
        # left the pool, and an exported event must outlive its importers' use.
        self._events: list[torch.cuda.Event] = []
        self._driver_warned = False
        self._freed_seen = -1  # the allocator's count of segments freed, at the last push start
        self._segments_freed = True

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
        self._forget_engine(index)  # a (re)connected engine maps nothing yet: every storage is exported afresh
        return super().init_info(index, engine)

    def note_source(self, source: Any, engines: Sequence[Engine]) -> None:
        """Before a push: which storages may go by reference (the source's own tensors on this device)."""
        self._single_worker = all(int(getattr(e, "workers", 1)) == 1 for e in engines)
        self._engines = len(engines)
        self._persistent = set()
        if not self.one_copy or not self._single_worker:
            return
        self._persistent = own_addresses(source, self.pool.device)

    def begin_push(self, plans: Sequence[ChunkPlan], push_id: str) -> None:
        torch.cuda.ipc_collect()  # free buffers dropped earlier whose receivers have let go since
        # Segments the caching allocator gave back to the driver since the last push: only then can an address a
        # driver export names hold a new allocation (`_export_alive` then compares allocation ids).
        freed = _segments_freed(self.pool.device)
        self._segments_freed = freed != self._freed_seen
        self._freed_seen = freed
        self._push_serial += 1
        self._push_ok = False
        # With references a chunk's buffer holds only its packed part: buffers grow to what chunks need
        # (pool.take) instead of every buffer taking the largest chunk's size.
        self.pool.begin(self.pool.size if self._persistent else max(p.nbytes for p in plans))

    def _ref_export(self, t: torch.Tensor) -> tuple[dict[str, Any], Any]:
        """Through the driver (`cuda_driver`: no per-share event or counter file; the storage is held while the
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

    def _export_alive(self, ex: _Export, addr: int) -> bool:
        """A driver export holds its storage: it is stale once that storage no longer lies at `addr` (resized or
        freed in place, FSDP-style), since another storage may since have been allocated there; or, after the
        allocator gave segments back to the driver since the last push, once the allocation at `addr` is another
        (resized to nothing, the cache emptied, resized back: same storage, same address, new memory). PyTorch's
        sharing kept such blocks in limbo instead."""
        held = ex.keep
        if not isinstance(held, cuda_driver.Held):
            return True
        if held.storage.data_ptr() != addr:
            return False
        return not self._segments_freed or cuda_driver.buffer_id(addr) == held.buffer

    def allocate(self, chunk: ChunkPlan, push_id: str) -> SendBuffer:
        pb = self.pool.take(chunk.nbytes)
        return SendBuffer(chunk.index, pb.size, pb.tensor[: chunk.nbytes], {"token": pb.token}, {"pb": pb})

    def allocate_for(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor], push_id: str) -> SendBuffer:
        """The chunk's buffer once its tensors are known: sized for the tensors that are packed; those that
        are plain views of the source's own storages go by reference (module doc)."""
        if not self._persistent:
            return self.allocate(chunk, push_id)
        compact = self._ref_compact(chunk, tensors, self.pool.device)
        if compact is None:
            return self.allocate(chunk, push_id)
        need = max(compact.layout.nbytes if compact.packed else 0, ALIGN)
        pb = self.pool.take(need)
        return SendBuffer(chunk.index, pb.size, pb.tensor[:need], {"token": pb.token},
                          {"pb": pb, "compact": compact, "plan": chunk, "tensors": tensors})

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Queue the chunk's copies (`_pack_copies`), then make its references per engine: a first push's
        exports (~40 us a storage) run here, while the engines load the chunk before, not in `send`, and in
        slices, so that the engines' replies to that chunk are taken as they come (`_export_ahead`)."""
        await self._pack_copies(buf, layout, tensors)
        if buf.state.get("compact") is not None:
            await self._export_ahead(buf, self._engines)
            buf.state["refs_ready"] = {i: self._refs(buf, i) for i in range(self._engines)}

    async def _pack_copies(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Queue the chunk's copies into its buffer on a side stream; with release events, return at once.

        The copies are launched from the event loop's own thread. A worker thread looks cheaper but is not:
        every torch op releases and retakes the GIL, and while the loop thread holds it (convert, send) the
        worker waits for its turn after each of a chunk's tens of launches; that wait was most of a push.
        Launching a dense chunk's copies still costs the loop ~15 us per tensor, so a chunk packed a second
        time from the same source addresses (shape, strides, dtype) into the same buffer is captured as a
        CUDA graph, and every later pack of it is one graph launch. The graph copies from addresses, so
        it stays right whatever those addresses hold then; sources at new addresses (a gathered temporary
        the allocator placed elsewhere) are packed by plain copies. Destination views are made once per
        (buffer, layout); small tensors go in one batched copy.
        """
        pb: PoolBuffer = buf.state["pb"]
        compact: _Compact | None = buf.state.get("compact")
        if compact is not None:  # only the chunk's packed part goes into the buffer
            layout = compact.layout
            tensors = [tensors[i] for i in compact.packed]
        # The same tensor list as this buffer's last pack of this layout (a source that caches its views):
        # its destination views and graph key are the same too, without a pass over hundreds of tensors.
        fast = pb.extra.get(("fast", layout))
        if fast is not None and fast[0] is tensors:
            dsts, key = fast[1], fast[2]
        else:
            dsts = self._dst_views(pb, layout, tensors)
            key = ("graph", layout, tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors))
            _remember(pb, ("fast", layout), (tensors, dsts, key))
        device = pb.tensor.device
        stream = self._side_stream(device)
        ready = self._ready_event(pb)
        producer = torch.cuda.current_stream(device)
        with torch.cuda.device(device):
            graph = self._graph(pb, key, dsts, tensors, stream) if self.graphs and tensors else None
            stream.wait_stream(producer)  # the producer's writes (convert) first
            for ev in pb.extra.get("release_events", ()):  # every receiver's copies out of the previous chunk
                stream.wait_event(ev)
            with torch.cuda.stream(stream):
                if graph is not None:
                    graph.replay()
                    self.graph_stats["replayed"] += 1
                else:
                    _copy_all(dsts, tensors)
                ready.record(stream)  # receivers wait for this on the device
                if self.release == "event":  # nobody waits on the host
                    for t in tensors:  # conversion temporaries may be freed before these copies ran
                        if t.is_cuda:
                            t.record_stream(stream)
                    return
                done = torch.cuda.Event()
                done.record(stream)
        await anyio.to_thread.run_sync(done.synchronize)

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
        self.graph_stats["captured"] += fresh
        return graph

    def _dst_views(self, pb: PoolBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The chunk's destination views in `pb`, shaped like `tensors` (a blocked source, e.g. q as a view
        of a fused QKV, is written in its row-major order). Cached per (buffer, layout, source shapes)."""
        key = ("views", layout, tuple((t.dtype, t.shape) for t in tensors))
        dsts = pb.extra.get(key)
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
        _remember(pb, key, dsts)
        return dsts

    def _ready_event(self, pb: PoolBuffer) -> torch.cuda.Event:
        ev = pb.extra.get("ready")
        if ev is None:
            with torch.cuda.device(pb.tensor.device):
                ev = torch.cuda.Event(interprocess=True)
                ev.ipc_handle()  # creates the event on the buffer's device
            self._events.append(ev)
            pb.extra["ready"] = ev
        return ev

    def _wait_packs(self) -> None:
        """Every queued pack has finished (before buffers are dropped, and before a push returns: the trainer
        may change its weights right after)."""
        streams = self.__dict__.get("_streams", {})
        for stream in streams.values():
            stream.synchronize()

    def _handle(self, pb: PoolBuffer, engine: int, nbytes: int, live: list[str]) -> dict[str, Any]:
        # One export per (buffer, engine): torch counts one release per export, so each receiver gets its own.
        ipc = pb.extra.get(engine)
        if ipc is None:
            ipc = export_handle(pb.tensor)
            # Both events go with every export, whatever `release` is now: it may change between pushes.
            with torch.cuda.device(pb.tensor.device):
                ev = torch.cuda.Event(interprocess=True)
                ipc["release_event"] = base64.b64encode(ev.ipc_handle()).decode()
                ipc["ready_event"] = base64.b64encode(self._ready_event(pb).ipc_handle()).decode()
            self._events.append(ev)
            pb.extra.setdefault("release_events", []).append(ev)
            pb.extra[engine] = ipc
        handle = {"token": pb.token, "nbytes": nbytes, "ipc": ipc, "live": live}
        if self.release == "sync":  # the receiver waits for its copies before it acknowledges
            handle["sync"] = True
        return handle

    def _info(self, buf: SendBuffer, update_info: dict[str, Any], engine: int, live: list[str]) -> dict[str, Any]:
        pb: PoolBuffer = buf.state["pb"]
        # The packed part's own layout replaces the plan's (whose other tensors go by reference).
        return self._ref_info(buf, update_info, self._handle(pb, engine, buf.tensor.numel(), live), engine)

    async def send(self, buf: SendBuffer, update_info: dict[str, Any], engines: Sequence[Engine]) -> None:
        live = self.pool.live_tokens
        if len(engines) == 1:  # the common colocated case: no task group to set up per chunk
            await engines[0].update(self._info(buf, update_info, 0, live))
            self._sent(buf, 0)
            return

        async def one(i: int, e: Engine) -> None:
            await e.update(self._info(buf, update_info, i, live))
            self._sent(buf, i)

        async with anyio.create_task_group() as tg:
            for i, e in enumerate(engines):
                tg.start_soon(one, i, e)

    def free(self, buf: SendBuffer) -> None:
        pb = buf.state.pop("pb", None)
        buf.state.pop("tensors", None)
        if pb is not None:
            buf.tensor = torch.empty(0, dtype=torch.uint8)
            self.pool.give(pb)

    def end_push(self) -> None:
        self._wait_packs()
        self.pool.end()
        # Receivers drop the storages a round did not reference (CudaIpcReceiver.end_round); so does the
        # sender, after a success. After a failure it cannot tell what each receiver mapped: export afresh.
        self._end_push_refs()

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
        self._drop_all_exports()


# ---------------------------------------------------------------------------------------------- receiver


@dataclass(frozen=True)
class IpcHandle:
    """A validated handle. Everything a remote peer sent has been type- and range-checked."""

    token: str
    nbytes: int
    live: tuple[str, ...] | None
    gpu: str
    size: int
    tensor_offset: int
    handle: bytes
    storage_size: int
    storage_offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool
    release_event: bytes | None
    ready_event: bytes | None


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if type(v) is not int or not 0 <= v < _MAX_INT:
        raise ValidationError(f"cuda_ipc handle field {key!r} must be a non-negative int, got {v!r:.80}")
    return v


def _b64(d: dict[str, Any], key: str, max_len: int) -> bytes:
    v = d.get(key)
    if not isinstance(v, str) or len(v) > 4 * max_len:
        raise ValidationError(f"cuda_ipc handle field {key!r} must be a base64 string, got {v!r:.80}")
    try:
        raw = base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ValidationError(f"cuda_ipc handle field {key!r} is not valid base64") from None
    if len(raw) > max_len:
        raise ValidationError(f"cuda_ipc handle field {key!r} holds {len(raw)} bytes, at most {max_len}")
    return raw


def parse_handle(h: object) -> IpcHandle:
    """Validate a handle received as plain data (JSON); raise ValidationError on anything unexpected."""
    if not isinstance(h, dict) or not isinstance(h.get("ipc"), dict):
        raise ValidationError(f"cuda_ipc handle must be {{token, nbytes, ipc, live}}, got {h!r:.200}")
    ipc: dict[str, Any] = h["ipc"]
    token = h.get("token")
    if not isinstance(token, str) or not _TOKEN.match(token):
        raise ValidationError(f"cuda_ipc handle token must be a hex string, got {token!r:.80}")
    live = h.get("live")
    if live is not None:
        if not isinstance(live, list) or len(live) > 1024 or not all(
                isinstance(t, str) and _TOKEN.match(t) for t in live):
            raise ValidationError("cuda_ipc handle 'live' must be a list of hex tokens")
        live = tuple(live)
    gpu = ipc.get("gpu")
    if not isinstance(gpu, str) or not _UUID.match(gpu):
        raise ValidationError(f"cuda_ipc handle gpu must be a device UUID, got {gpu!r:.80}")
    ref_counter = _b64(ipc, "ref_counter", 256)
    if not _REF_COUNTER.match(ref_counter):
        raise ValidationError("cuda_ipc handle ref_counter is not a shared-memory file name")
    event_sync = ipc.get("event_sync")
    if not isinstance(event_sync, bool):
        raise ValidationError("cuda_ipc handle event_sync must be a bool")
    events = {}
    for key in ("release_event", "ready_event"):
        events[key] = _b64(ipc, key, 512) if key in ipc else None
        if events[key] is not None and len(events[key]) != 64:  # sizeof(cudaIpcEventHandle_t)
            raise ValidationError(f"cuda_ipc handle {key} must be a 64-byte CUDA IPC event handle")
    out = IpcHandle(
        token=token, nbytes=_int(h, "nbytes"), live=live, gpu=gpu, size=_int(ipc, "size"),
        tensor_offset=_int(ipc, "tensor_offset"), handle=_b64(ipc, "handle", 512),
        storage_size=_int(ipc, "storage_size"), storage_offset=_int(ipc, "storage_offset"),
        ref_counter=ref_counter, ref_counter_offset=_int(ipc, "ref_counter_offset"),
        event=_b64(ipc, "event", 512), event_sync=event_sync, release_event=events["release_event"],
        ready_event=events["ready_event"],
    )
    if not out.handle or out.size == 0:
        raise ValidationError("cuda_ipc handle names an empty buffer")
    if out.tensor_offset + out.size > out.storage_size:
        raise ValidationError(f"cuda_ipc buffer [{out.tensor_offset}, +{out.size}) exceeds its storage of "
                              f"{out.storage_size} bytes")
    if out.nbytes > out.size:
        raise ValidationError(f"cuda_ipc chunk of {out.nbytes} bytes exceeds its {out.size}-byte buffer")
    if out.event_sync and not out.event:
        raise ValidationError("cuda_ipc handle asks for an event sync but carries no event")
    return out


@dataclass
class _Mapped:
    """An opened export: the buffer, its release event (if the sender sent one), and the raw handle data
    it was validated from (a later chunk with identical data skips the full validation)."""

    tensor: torch.Tensor
    release: torch.cuda.Event | None
    ready: torch.cuda.Event | None
    raw: dict[str, Any]
    views: dict[Layout, list[tuple[str, torch.Tensor]]] = field(default_factory=dict)


def _live(h: dict[str, Any]) -> tuple[str, ...] | None:
    live = h.get("live")
    if live is None:
        return None
    if not isinstance(live, list) or len(live) > 1024 or not all(isinstance(t, str) and _TOKEN.match(t) for t in live):
        raise ValidationError("cuda_ipc handle 'live' must be a list of hex tokens")
    return tuple(live)


def _warm_copies(device: torch.device) -> None:
    """Run each kind of copy a load uses once, on tiny tensors: CUDA loads a kernel on its first use (a few ms
    each), and a first push would otherwise pay that inside its copies. Done while connecting."""
    with torch.cuda.device(device):
        for dt in (torch.bfloat16, torch.float16, torch.float32):
            a = torch.zeros(4, 2, 8, dtype=dt, device="cuda")
            b = torch.ones(2, 4, 8, dtype=dt, device="cuda")
            a.copy_(b.transpose(0, 1))  # strided (Q, K, V views of a fused QKV)
            a[0].copy_(b[0, :2], non_blocking=True)  # contiguous
            torch._foreach_copy_([a[1], a[2]], [b[1, :2], b[0, 2:]], non_blocking=True)  # batched small tensors
            a.copy_(b.float().transpose(0, 1))  # cast
        torch.cuda.current_stream().synchronize()


class CudaIpcReceiver(RefReceiver, Receiver):
    name = "cuda_ipc"

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cuda") -> None:
        super().__init__(init_info, device)
        if self.device.type != "cuda" or not torch.cuda.is_available():
            raise TransportError(f"the cuda_ipc receiver needs a CUDA device, got {self.device}")
        _warm_copies(self.device)
        self._maps: dict[str, _Mapped] = {}
        self._open: _Mapped | None = None
        self._storages: dict[str, _Storage] = {}  # token -> mapped trainer storage (references)
        self._round: set[str] = set()  # storage tokens this round referenced
        # reference set id -> (its views, the storage tokens they lie on); see CudaIpcTransport._refs
        self._refsets: dict[str, tuple[list[tuple[TensorMeta, torch.Tensor]], frozenset[str]]] = {}
        #: host seconds spent opening trainer storages (for benchmarks: part of the receiver's `refs` time)
        self.timing = {"map_storages": 0.0}

    def _ref_map(self, token: str, raw: dict[str, Any]) -> torch.Tensor:
        # No export event to wait on: the chunk's ready event, which every update waits for before its loads,
        # already orders these reads after the trainer's writes (it is recorded after the producer's stream).
        if raw.get("driver") == 1:
            gpu = raw.get("gpu")
            if not isinstance(gpu, str) or not _UUID.match(gpu):
                raise ValidationError(f"cuda_ipc storage {token}: gpu must be a device UUID, got {gpu!r:.80}")
            return cuda_driver.map_storage(raw, local_index(gpu), token)
        return self._rebuild(parse_handle({"token": token, "nbytes": 0, "ipc": raw}), event=False)

    def _rebuild(self, h: IpcHandle, event: bool = True) -> torch.Tensor:
        """Open an export. `event`: make the current stream wait on the export's event (opening that event
        costs about as much as mapping the memory)."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = local_index(h.gpu)
        with torch.cuda.device(index):
            try:
                t = rebuild_cuda_tensor(
                    torch.Tensor, torch.Size([h.size]), (1,), h.tensor_offset, torch.UntypedStorage, torch.uint8,
                    index, h.handle, h.storage_size, h.storage_offset, False, h.ref_counter, h.ref_counter_offset,
                    h.event, h.event_sync and event)
            except RuntimeError as e:
                raise TransportError(f"cannot open CUDA IPC handle of buffer {h.token}: {e}") from e
        if t.numel() != h.size or t.dtype != torch.uint8:
            raise TransportError(f"CUDA IPC buffer {h.token} rebuilt as {t.dtype}[{t.numel()}], expected "
                                 f"uint8[{h.size}]")
        return t

    def _map(self, raw: dict[str, Any]) -> tuple[_Mapped, int, tuple[str, ...] | None]:
        """The mapping a handle names, opening it the first time; (mapping, chunk bytes, live tokens)."""
        token = raw.get("token")
        m = self._maps.get(token) if isinstance(token, str) else None
        if m is not None and raw.get("ipc") == m.raw:  # an export validated before: check the per-chunk fields
            nbytes = raw.get("nbytes")
            if type(nbytes) is not int or not 0 <= nbytes <= m.tensor.numel():
                raise ValidationError(f"cuda_ipc chunk size {nbytes!r:.40} does not fit buffer {token}")
            return m, nbytes, _live(raw)
        h = parse_handle(raw)
        if m is not None:  # same token, different export data: never sent by a well-behaved sender
            raise ValidationError(f"cuda_ipc buffer {h.token} changed its export data")
        tensor = self._rebuild(h)
        events: list[torch.cuda.Event | None] = []
        for handle in (h.release_event, h.ready_event):
            try:
                events.append(None if handle is None else torch.cuda.Event.from_ipc_handle(tensor.device, handle))
            except RuntimeError as e:
                raise TransportError(f"cannot open an IPC event of buffer {h.token}: {e}") from e
        m = self._maps[h.token] = _Mapped(tensor, events[0], events[1], dict(raw["ipc"]))
        return m, h.nbytes, h.live

    def _forget(self, live: tuple[str, ...] | None) -> None:
        if live is None:
            return
        gone = [t for t in self._maps if t not in live]
        if gone:
            self._synchronize()  # copies out of those buffers may still be queued
            for token in gone:
                del self._maps[token]  # torch releases the mapping and its share of the sender's count

    def _devices(self) -> set[torch.device]:
        devs = {m.tensor.device for m in self._maps.values()}
        if self.device.index is not None:
            devs.add(self.device)
        return devs

    def _synchronize(self) -> None:
        for d in self._devices():
            torch.cuda.current_stream(d).synchronize()

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> Iterator[torch.Tensor]:
        raw = update_info.get("handle")
        if not isinstance(raw, dict):
            raise ValidationError(f"cuda_ipc handle must be {{token, nbytes, ipc, live}}, got {raw!r:.200}")
        m, nbytes, live = self._map(raw)
        self._forget(live)
        buf = m.tensor
        try:
            self._open = m
            if m.ready is not None:  # the sender's copies into this chunk come first (on the device)
                torch.cuda.current_stream(buf.device).wait_event(m.ready)
            yield buf[:nbytes]
        finally:
            # The ack. The loader's copies were queued on the current stream. With a release event the
            # sender's next pack into this buffer waits for them on the device; without, wait here.
            stream = torch.cuda.current_stream(buf.device)
            self._open = None
            if m.release is not None and self.device.index in (None, buf.device.index):
                m.release.record(stream)
            if m.release is None or raw.get("sync") is True or self.device.index not in (None, buf.device.index):
                self._synchronize()

    def views(self, buf: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
        """The chunk's views, made once per (mapped buffer, layout) and kept with the mapping: a later push
        of the same plan unpacks nothing. They go when the mapping goes (views hold the memory)."""
        m = self._open
        if m is None or buf.data_ptr() != m.tensor.data_ptr():
            return list(unpack(buf, layout))
        views = m.views.get(layout)
        if views is None:
            if len(m.views) > 64:  # the chunking changed many times: start over
                m.views.clear()
            views = m.views[layout] = list(unpack(m.tensor, layout))
        return views

    def end_round(self) -> None:
        """Before a round's end is acknowledged, every queued copy into the parameters has finished. Trainer
        storages this round did not reference are unmapped (the sender frees or reuses them once we let go)."""
        self._synchronize()
        self._end_round_refs()

    @property
    def mapped(self) -> int:
        """Buffers this receiver holds open."""
        return len(self._maps)

    def close(self) -> None:
        self._synchronize()
        self._maps.clear()
        self._storages.clear()
        self._refsets.clear()
