"""The collective sending half (in the trainer): the group's rank 0, per-chunk broadcasts."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ...errors import EngineError, TransportError, ValidationError
from ...log import get_logger
from ...pack import Layout, TensorMeta, align_up, byte_view, dtype_from_name, fits, pack_into
from ...plan.chunk import ChunkPlan
from ..base import SendBuffer, Transport
from ..pool import BufferPool, PoolBuffer, captured, remember
from .group import (
    BACKENDS,
    CLOSE_TIMEOUT,
    Stalled,
    _in_thread,
    _join,
    broadcast,
    broadcast_all,
    dispose,
    host_store,
    launch_broadcast,
    launch_broadcasts,
    make_group,
    wait_event,
)

if TYPE_CHECKING:
    from ...engines.base import Engine


PROTOCOLS = ("direct", "chunk")


def _sendable(t: torch.Tensor, meta: TensorMeta, device: torch.device) -> bool:
    """Whether the direct protocol broadcasts `t` from where it lies: on the group's device, contiguous, of the
    layout's dtype and shape (or a blocked view of it, `pack.fits`: same row-major bytes)."""
    return (t.device == device and t.is_contiguous() and t.dtype == dtype_from_name(meta.dtype)
            and not t.is_conj() and not t.is_neg()
            and (tuple(t.shape) == meta.shape or fits(t, meta.shape)))


# ------------------------------------------------------------------------------------------------ sender


class CollectiveTransport(Transport):
    """backend: "nccl", "gloo" or "auto" (NCCL when every engine is on CUDA and this torch has CUDA).
    master_addr/master_port: where the sender's rendezvous store listens (port 0: any free port); engines
    must reach it; nothing else can. device: where send buffers live (default: CUDA for NCCL, CPU for gloo).
    group_timeout: the rendezvous, every collective and every acknowledgement (default: the sync's timeout).
    close_timeout: `close()` returns within this many seconds whatever the receivers do.
    ordering: "device" (NCCL with CUDA buffers: streams wait on events, module doc) or "host" (each side
    waits for every broadcast and copy on the host, the first version's protocol; kept for comparison). Each
    handle says which, so it may change between pushes.
    protocol: "direct" (one broadcast per tensor, all of a chunk's in one NCCL group, straight from the
    trainer's tensors where they are contiguous and of the layout's dtype, straight into the receiver's
    parameters where its loader names them: module doc), "chunk" (pack the chunk into one buffer, one
    broadcast, the receiver's loader copies out of its receive buffer) or "auto" (chunk: on two H200s the
    chunk protocol pushed the Qwen3-8B shape in 48.9-50.8 ms and direct in 53.7-80.0 ms, docs/benchmarks; on
    gloo every broadcast costs a TCP round of its own). Each handle says which, so it may change between
    pushes.
    graphs: replay a chunk's pack as a captured CUDA graph once it was packed the same way before.
    An engine with several workers says so with an int attribute `workers` (default 1)."""

    name = "collective"

    def __init__(self, backend: str = "auto", *, master_addr: str = "127.0.0.1", master_port: int = 0,
                 device: torch.device | str | None = None, keep_pool: bool = True,
                 group_timeout: float | None = None, close_timeout: float = CLOSE_TIMEOUT,
                 ordering: str = "device", protocol: str = "auto", graphs: bool = True) -> None:
        if backend not in (*BACKENDS, "auto"):
            raise ValidationError(f"collective backend must be one of {(*BACKENDS, 'auto')}, got {backend!r}")
        if ordering not in ("device", "host"):
            raise ValidationError(f"ordering must be 'device' or 'host', got {ordering!r}")
        if protocol not in (*PROTOCOLS, "auto"):
            raise ValidationError(f"protocol must be one of {(*PROTOCOLS, 'auto')}, got {protocol!r}")
        self.ordering = ordering
        self.protocol = protocol
        self.graphs = graphs
        #: chunk packs replayed from a captured graph, and graphs captured (benchmarks and tests)
        self.graph_stats = {"replayed": 0, "captured": 0}
        self.backend = backend
        self.master_addr = master_addr
        self.master_port = master_port
        self._device = torch.device(device) if device is not None else None
        self.keep_pool = keep_pool
        self.group_timeout = group_timeout
        self.close_timeout = close_timeout
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
        workers = [int(getattr(e, "workers", 1)) for e in engines]
        if any(w < 1 for w in workers):
            raise ValidationError(f"every engine needs at least one worker, got {workers}")
        world = 1 + sum(workers)
        gtimeout = timedelta(seconds=self.group_timeout or timeout)
        self._timeout = gtimeout.total_seconds()
        self._store = host_store(self.master_addr, self.master_port, world, gtimeout)
        group = f"streamsync-{uuid.uuid4().hex[:12]}"
        self._infos, offset = [], 1
        for w in workers:
            self._infos.append({
                "transport": self.name, "backend": backend, "group": group,
                "master_addr": self.master_addr, "master_port": int(self._store.port),
                "world_size": world, "rank_offset": offset, "workers": w,
                "timeout_s": gtimeout.total_seconds(),
            })
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
            self._pg = await _in_thread(join)

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
        elif getattr(self, "_backend", self.backend) == "nccl":
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
        """Device-ordered protocol (module doc): NCCL with CUDA buffers."""
        return t.is_cuda and getattr(self, "_backend", self.backend) == "nccl" and self.ordering == "device"

    # -- per push --------------------------------------------------------------------------------------

    def begin_push(self, plans: Sequence[ChunkPlan], push_id: str) -> None:
        self.pool.begin(max(p.nbytes for p in plans))
        self._last_chunk = max(p.index for p in plans)
        self._prev_sent = None

    @property
    def ops_per_tensor(self) -> bool:
        """The direct protocol: the receiver derives one broadcast per tensor from the layout it gets, so it
        must get the sender's (the pipeline sends no fused engine layout then)."""
        return self.chunk_protocol == "direct"

    @property
    def chunk_protocol(self) -> str:
        """The protocol of the chunks allocated now ("direct" or "chunk"; `protocol` resolved)."""
        # "auto" is the measured faster one (the docstring); direct stays for where the receiver's copies
        # or the sender's packs contend with the link more than per-tensor broadcasts cost.
        return self.protocol if self.protocol != "auto" else "chunk"

    def allocate(self, chunk: ChunkPlan, push_id: str) -> SendBuffer:
        if self.chunk_protocol == "direct":
            # No pool buffer: `pack` makes a scratch buffer only for the tensors that cannot be sent as they are.
            # `nbytes` counts the chunk: its scratch plus the converted tensors it keeps alive until its
            # broadcast ran stay within it.
            empty = torch.empty(0, dtype=torch.uint8, device=self.device)
            return SendBuffer(chunk.index, chunk.nbytes, empty, {"nbytes": chunk.nbytes}, {"direct": True})
        pb = self.pool.take(chunk.nbytes)
        return SendBuffer(chunk.index, pb.size, pb.tensor[: chunk.nbytes], {"nbytes": chunk.nbytes}, {"pb": pb})

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        if buf.state.get("direct"):
            await self._pack_direct(buf, layout, tensors)
            return
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
        (addresses, dtypes, shapes, strides) are packed into it the same way: a dense chunk's ~14 copy
        launches cost the event loop ~1 ms, which the replies of the engines' updates waited behind."""
        fast = pb.extra.get(("fast", layout))
        if fast is not None and fast[0] is tensors:  # a source's cached views: the same key
            key = fast[1]
        else:
            key = ("graph", layout, dst.data_ptr(),
                   tuple((t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors))
            remember(pb, ("fast", layout), (tensors, key))
        try:
            graph, fresh = captured(pb, key, stream, lambda: pack_into(dst, layout, tensors))
        except RuntimeError as e:  # a copy this build cannot capture: plain copies from now on
            get_logger().warning("collective: pack capture failed; packing with plain copies", error=str(e))
            self.graphs = False
            return None
        self.graph_stats["captured"] += fresh
        return graph

    def _pack_streamed(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """Queue the copies on the pack stream behind the producer's writes and behind the last broadcast out
        of this buffer; return at once (the broadcast waits for `ready` on the device). A chunk packed before
        from the same addresses into the same buffer replays its captured pack (`_graph`)."""
        pb: PoolBuffer = buf.state["pb"]
        dev = buf.tensor.device
        stream = self._side_stream(dev)
        with torch.cuda.device(dev):
            graph = self._graph(pb, buf.tensor, layout, tensors, stream) if self.graphs else None
            stream.wait_stream(torch.cuda.current_stream(dev))
            sent = pb.extra.get("sent")
            if sent is not None:
                stream.wait_event(sent)
            with torch.cuda.stream(stream):
                if graph is not None:
                    graph.replay()
                    self.graph_stats["replayed"] += 1
                else:
                    pack_into(buf.tensor, layout, tensors)
                for t in tensors:  # conversion temporaries may be freed before these copies ran
                    if t.is_cuda:
                        t.record_stream(stream)
                buf.tensor.record_stream(stream)  # a failed push drops the buffer while copies may be queued
                ready = pb.extra.get("ready")
                if ready is None:
                    ready = pb.extra["ready"] = torch.cuda.Event()
                ready.record(stream)

    async def _pack_direct(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        """The direct protocol's pack: decide per tensor whether it is broadcast from where it is, copy the others
        (strided views, casts, tensors on another device) into a scratch buffer of their size, and keep, in
        layout order, the flat byte view each broadcast will read (`buf.state["sends"]`).

        Device-ordered: the copies are queued on the pack stream behind the producer's stream and `ready`
        marks both (the producer's writes of the tensors sent as they are, and the copies); returns at once.
        Otherwise the copies and the producer's writes have finished when this returns."""
        if len(tensors) != len(layout.metas):
            raise ValidationError(f"{len(tensors)} tensors for a layout of {len(layout.metas)}")
        dev = buf.tensor.device
        direct = [_sendable(t, m, dev) for t, m in zip(tensors, layout.metas, strict=True)]
        copy_metas, copy_tensors, offset = [], [], 0
        for t, m, d in zip(tensors, layout.metas, direct, strict=True):
            if not d and m.nbytes:
                copy_metas.append(TensorMeta(m.name, m.dtype, m.shape, offset, m.nbytes, m.part))
                copy_tensors.append(t)
                offset = align_up(offset + m.nbytes)
        sub = Layout(tuple(copy_metas), offset)
        scratch: torch.Tensor | None = None
        streamed = self._streamed(buf.tensor)
        if streamed:
            with torch.cuda.device(dev):
                producer = torch.cuda.current_stream(dev)
                ready = torch.cuda.Event()
                if copy_metas:
                    stream = self._side_stream(dev)
                    stream.wait_stream(producer)
                    with torch.cuda.stream(stream):
                        scratch = torch.empty(offset, dtype=torch.uint8, device=dev)
                        pack_into(scratch, sub, copy_tensors)
                        for t in copy_tensors:  # conversion temporaries may be freed before these copies ran
                            if t.is_cuda:
                                t.record_stream(stream)
                        ready.record(stream)
                else:
                    ready.record(producer)
            buf.state["ready"] = ready
        elif copy_metas:
            scratch = torch.empty(offset, dtype=torch.uint8, device=dev)
            await Transport.pack(self, SendBuffer(buf.chunk, offset, scratch, {}), sub, copy_tensors)
        if not streamed:  # the host protocol: every device write of what is broadcast has finished
            for d in {t.device for t in tensors if t.is_cuda}:
                await anyio.to_thread.run_sync(torch.cuda.current_stream(d).synchronize)
        sends, k = [], 0
        for t, m, d in zip(tensors, layout.metas, direct, strict=True):
            if not m.nbytes:
                continue  # nothing to move; the receiver skips it too
            if d:
                sends.append(byte_view(t.detach()))
            else:
                sends.append(scratch[copy_metas[k].offset: copy_metas[k].offset + m.nbytes])  # type: ignore[index]
                k += 1
        buf.state["sends"] = sends
        buf.state["scratch"] = scratch

    async def send(self, buf: SendBuffer, update_info: dict[str, Any], engines: Sequence[Engine]) -> None:
        if self._pg is None:
            raise TransportError("collective transport is not connected")
        if self._broken is not None:
            raise TransportError(f"collective group is unusable ({self._broken}); "
                                 "close the WeightSync (or transport) and connect again")
        seq = self._seq
        self._seq += 1
        chunk = update_info.get("chunk")
        streamed = self._streamed(buf.tensor)
        direct = bool(buf.state.get("direct"))
        nbytes = int(buf.handle["nbytes"]) if direct else buf.tensor.numel()
        info = {**update_info, "handle": {"group": self._group, "seq": seq, "nbytes": nbytes,
                                          "device_ordered": streamed, "protocol": "direct" if direct else "chunk"}}
        pending = {e.name for e in engines}
        ok = False

        async def bcast() -> None:
            try:
                if direct and streamed:
                    sent = await _in_thread(launch_broadcasts, self._pg, buf.state["sends"],
                                            self._side_stream_for(buf.tensor), (buf.state["ready"],))
                    for ev in (self._prev_sent, sent if chunk == self._last_chunk else None):
                        if ev is not None:
                            await _in_thread(wait_event, ev, self._timeout, f"broadcast before chunk {chunk}")
                    self._prev_sent = sent
                elif direct:
                    await _in_thread(broadcast_all, self._pg, buf.state["sends"], self._side_stream_for(buf.tensor))
                elif streamed:
                    pb: PoolBuffer = buf.state["pb"]
                    comm = self._side_stream_for(buf.tensor)
                    pb.extra["sent"] = sent = await _in_thread(launch_broadcast, self._pg, buf.tensor, comm,
                                                               pb.extra.get("ready"))
                    # Bounded host work: the previous broadcast has finished (the last chunk: this one too).
                    for ev in (self._prev_sent, sent if chunk == self._last_chunk else None):
                        if ev is not None:
                            await _in_thread(wait_event, ev, self._timeout, f"broadcast before chunk {chunk}")
                    self._prev_sent = sent
                else:
                    await _in_thread(broadcast, self._pg, buf.tensor, self._side_stream_for(buf.tensor))
            except RuntimeError as e:  # c10d's errors name no chunk or peer: say which broadcast, and who owes it
                # Engines that had not acknowledged are dead, frozen, or inside the broken collective until
                # its timeout: the failed push does not wait for them again (unresponsive).
                who = ",".join(sorted(pending)) or ",".join(eng.name for eng in engines)
                raise EngineError(who, f"broadcast of chunk {chunk} (seq {seq}) failed: {e}",
                                  unresponsive=bool(pending) or isinstance(e, Stalled)) from e

        async def update(e: Engine) -> None:
            await e.update(info)
            pending.discard(e.name)

        try:
            with anyio.fail_after(self._timeout):
                async with anyio.create_task_group() as tg:
                    for e in engines:
                        tg.start_soon(update, e)
                    tg.start_soon(bcast)
            ok = True
        except TimeoutError:
            who = ",".join(sorted(pending)) or ",".join(e.name for e in engines)
            raise EngineError(who, f"chunk {chunk}: no acknowledgement of its broadcast within the group timeout "
                                   f"({self._timeout:.1f}s): receiver frozen or dead?", unresponsive=True) from None
        finally:
            if not ok:  # some rank may still sit in this broadcast: the group's sequence is lost
                self._broken = f"chunk {chunk} failed during its broadcast"

    def _side_stream_for(self, t: torch.Tensor) -> torch.cuda.Stream | None:
        if not t.is_cuda:
            return None
        if self._stream is None or self._stream.device != t.device:
            self._stream = torch.cuda.Stream(t.device)
        return self._stream

    def free(self, buf: SendBuffer) -> None:
        # The direct protocol's tensors and scratch: marked used by the broadcast's stream (launch_broadcasts),
        # so dropping them here, even with the broadcast still queued, frees nothing it reads.
        for key in ("sends", "scratch", "ready"):
            buf.state.pop(key, None)
        pb: PoolBuffer | None = buf.state.pop("pb", None)
        if pb is not None:
            buf.tensor = torch.empty(0, dtype=torch.uint8)
            self.pool.give(pb)

    def end_push(self) -> None:
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
            if not await _join(t, self.close_timeout):
                get_logger().warning("collective: group abort did not finish; abandoned", group=self._group,
                                     timeout_s=self.close_timeout)
        if self._pool is not None:
            self._pool.release()
        # Fresh streams for the next group: an aborted broadcast must not stand in front of new work.
        self._prev_sent = self._stream = None
        self.__dict__.pop("_streams", None)
