"""The p2p sending half, on every trainer rank (package doc)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
import torch
import torch.distributed as dist

from ...engines.abilities import Sharded
from ...errors import EngineError, StreamSyncError, TransportError, ValidationError
from ...log import get_logger
from ...message import ChunkHandle, Recipient, UpdateMessage
from ...plan.chunk import ChunkPlan, layout_key
from ...plan.shards import EngineLayout
from ...sources.sharded import ShardedSource, gather_objects, trainer_rank_world
from ..base import RanksAgree, SendBuffer, Transport
from ..collective.group import (
    BACKENDS,
    CLOSE_TIMEOUT,
    GroupInit,
    P2PHandle,
    broadcast,
    dispose,
    host_store,
    in_thread,
    join_thread,
    make_group,
)
from ..cuda_ipc.driver import export_storage
from ..pool import BufferPool, PoolBuffer
from .ipc import colocated, encode_ref, gpu_of, publish_gpu, read_gpus

if TYPE_CHECKING:
    from ...engines.base import Engine
    from ...sources.base import Source


def _broadcast_object(obj: object) -> Any:
    """Trainer rank 0's `obj` on every rank of the default group."""
    if trainer_rank_world()[1] == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class P2pTransport(Transport, RanksAgree):
    """Every trainer rank sends its own shards to the engine workers that hold them (package doc). Give it to
    `WeightSync` on every rank of the trainer's default group: the engines on rank 0, `engines=[]` elsewhere.

    backend: "gloo", "nccl" or "auto" (NCCL when every engine is on CUDA and this torch has CUDA).
    master_addr/master_port: where trainer rank 0 hosts the rendezvous; every trainer rank and engine worker
    must reach it. device: where send buffers live (default: CUDA for NCCL, else CPU; CUDA with gloo sends a
    worker on this rank's GPU references by CUDA IPC, package doc). group_timeout: the
    rendezvous, every send and receive (default: the sync's timeout). bucket_bytes: at most this many bytes of
    pieces per rank per bucket (default: the sync's chunk_bytes)."""

    name: ClassVar[str] = "p2p"
    rendezvous: ClassVar[bool] = True
    reaches: ClassVar[Literal["cpu", "cuda", "remote"]] = "remote"
    every_rank: ClassVar[bool] = True
    fusable: ClassVar[bool] = False
    delta_pays: ClassVar[bool] = True  # a link between hosts: the bytes a delta saves are its time

    def __init__(self, backend: str = "auto", *, master_addr: str = "127.0.0.1", master_port: int = 0,
                 device: torch.device | str | None = None, group_timeout: float | None = None,
                 close_timeout: float = CLOSE_TIMEOUT, bucket_bytes: int | None = None) -> None:
        super().__init__()
        if backend not in (*BACKENDS, "auto"):
            raise ValidationError(f"p2p backend must be one of {(*BACKENDS, 'auto')}, got {backend!r}")
        if bucket_bytes is not None and (type(bucket_bytes) is not int or bucket_bytes < 1):
            raise ValidationError(f"bucket_bytes must be a positive integer or None, got {bucket_bytes!r}")
        self.backend, self.master_addr, self.master_port = backend, master_addr, master_port
        self._device = torch.device(device) if device is not None else None
        self.group_timeout, self.close_timeout, self.bucket_bytes = group_timeout, close_timeout, bucket_bytes
        self.rank, self.world = trainer_rank_world()
        self._pg: Any = None
        self._store: Any = None
        self._engines: list[Engine] = []
        self._infos: list[dict[str, Any]] = []
        self._layouts: list[tuple[str, int, EngineLayout | None]] = []
        self._group: str | None = None
        self._backend: str | None = None
        self._offsets: dict[str, int] = {}  # engine -> group rank of its worker 0
        self._timeout = 60.0
        self._seq = 0
        self._broken: str | None = None
        self._pool: BufferPool | None = None
        self._source: ShardedSource | None = None
        self._handles: dict[tuple[int, int, str], tuple[dict[str, Any], Any, dict[str, Any], str]] = {}
        #: a delta push's bucket -> per destination (header offset, bytes; encodings' offset, bytes)
        self._delta_sends: dict[int, list[tuple[tuple[str, int], int, int, int, int]]] = {}
        #: this push: sending ranks, this rank's planned piece bytes (`sent_bytes`), and the bytes it moved by
        #: IPC reference (`ipc_bytes`) and through the process group (`group_bytes`); these two count whole
        #: segments, the alignment gaps between a destination's pieces included
        self.counts: dict[str, float] = {}
        #: group ranks of the workers on this rank's GPU, in other processes (module ipc)
        self._ipc_dests: set[int] = set()
        self._counts_lock = threading.Lock()

    # -- setup -----------------------------------------------------------------------------------------

    def init_info(self, index: int, engine: Engine) -> dict[str, Any]:
        return self._infos[index]

    @property
    def layouts(self) -> list[tuple[str, int, EngineLayout | None]]:
        """(engine, workers, its layout or None) as trainer rank 0 learned them at connect, on every rank."""
        return list(self._layouts)

    async def connect(self, engines: Sequence[Engine], timeout: float) -> None:
        """On every trainer rank at once: agree on where the engines are, build the group with every engine
        worker. Also after a failed push (the old group is aborted, a new one made)."""
        await self.close()
        self._engines = list(engines)
        gtimeout = timedelta(seconds=self.group_timeout or timeout)
        self._timeout = gtimeout.total_seconds()
        with anyio.fail_after(timeout):
            counts = await in_thread(gather_objects, len(engines))
        if not counts[0]:
            raise ValidationError("transport 'p2p': trainer rank 0 must hold the engines (it was given none)")
        others = [r for r, n in enumerate(counts) if r and n]
        if others:
            raise ValidationError(f"transport 'p2p': only trainer rank 0 holds engines; rank(s) {others} were "
                                  "given some (pass engines=[] there)")
        meta: dict[str, Any] | None = None
        if self.rank == 0:
            backend = self.backend
            if backend == "auto":
                cuda = all(e.device.startswith("cuda") for e in engines) and torch.cuda.is_available()
                backend = "nccl" if cuda else "gloo"
            layouts = []
            with anyio.fail_after(timeout):
                for e in engines:
                    layouts.append((e.name, e.workers, await e.layout() if isinstance(e, Sharded) else None))
            world = self.world + sum(e.workers for e in engines)
            self._store = host_store(self.master_addr, self.master_port, world, gtimeout)
            meta = {"group": f"streamsync-p2p-{uuid.uuid4().hex[:12]}", "backend": backend, "world": world,
                    "addr": self.master_addr, "port": int(self._store.port), "layouts": layouts}
        with anyio.fail_after(timeout):
            meta = await in_thread(_broadcast_object, meta)
        assert meta is not None
        self._group, self._backend, self._layouts = meta["group"], meta["backend"], meta["layouts"]
        offset = self.world
        self._infos, self._offsets = [], {}
        for name, workers, _ in self._layouts:
            self._offsets[name] = offset
            self._infos.append(GroupInit(self.name, meta["backend"], meta["group"], meta["addr"], meta["port"],
                                         meta["world"], offset, workers, self._timeout,
                                         trainer_ranks=self.world).to_wire())
            offset += workers
        self._seq, self._broken, self._handles = 0, None, {}
        rank, world, addr, port, backend = self.rank, meta["world"], meta["addr"], meta["port"], meta["backend"]
        device = self.device
        gpu = gpu_of(device, probe=True) if backend == "gloo" else ""  # colocated pairs (module ipc): gloo, CUDA

        def join() -> Any:
            store = self._store if rank == 0 else dist.TCPStore(addr, port, world, False, timeout=gtimeout)
            publish_gpu(store, meta["group"], rank, gpu)
            pg = make_group(backend, dist.PrefixStore(meta["group"], store), rank, world, gtimeout, addr)
            # One collective over the whole group first: every pair is connected before the first push.
            broadcast(pg, torch.zeros(1, dtype=torch.uint8, device=device if backend == "nccl" else "cpu"))
            gpus = read_gpus(store, meta["group"], range(self.world, world)) if gpu else {}
            return pg, store, {r for r, g in gpus.items() if colocated(gpu, g)}

        async def own_side() -> None:
            self._pg, self._store, self._ipc_dests = await in_thread(join)

        try:
            with anyio.fail_after(timeout):
                async with anyio.create_task_group() as tg:
                    for i, e in enumerate(engines):
                        tg.start_soon(e.init_transfer, self._infos[i])
                    tg.start_soon(own_side)
        except TimeoutError:
            await self.close()
            raise TransportError(f"p2p rendezvous ({backend}, {self.world} trainer ranks + "
                                 f"{world - self.world} engine workers) timed out after {timeout:.1f}s: did every "
                                 "rank and worker join?") from None
        except BaseException:
            await self.close()
            raise

    async def before_push(self, timeout: float, error: BaseException | None = None) -> None:
        """Every trainer rank, before a push: one exchange of (this rank cannot push, the group is broken).
        A rank's error fails the push on every rank (that rank raises its own); a broken group is rebuilt by
        every rank together."""
        mine = (f"{type(error).__name__}: {error}" if error is not None else None,
                self._pg is None or self._broken is not None)
        with anyio.fail_after(timeout):
            states: list[Any] = await in_thread(gather_objects, mine)
        refused = [(r, st[0]) for r, st in enumerate(states) if st[0]]
        if error is not None:
            raise error
        if refused:
            r, why = refused[0]
            raise StreamSyncError(f"push refused on trainer rank {r}: {why}")
        if any(st[1] for st in states):
            get_logger().warning("p2p: the group is out of step after a failed push; every rank rebuilds it",
                                 group=self._group, why=self._broken or "not connected")
            await self.connect(self._engines, timeout)

    async def exchange(self, obj: object, timeout: float) -> list[object]:
        with anyio.fail_after(timeout):
            return await in_thread(gather_objects, obj)

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
            self._pool = BufferPool(self.device)
        return self._pool

    def source_for(self, source: Source, chunk_bytes: int) -> Source:
        if not self._layouts:
            raise TransportError("p2p transport is not connected: connect the WeightSync on every trainer rank first")
        if isinstance(source, ShardedSource):
            return source
        return ShardedSource(source, self._layouts, self.bucket_bytes or chunk_bytes)

    # -- per push --------------------------------------------------------------------------------------

    def begin_push(self, plans: Sequence[ChunkPlan], source: Source, engines: Sequence[Engine], *,
                   by_reference: bool = True) -> None:
        if not isinstance(source, ShardedSource):
            raise ValidationError("the p2p transport sends a ShardedSource (WeightSync makes one through source_for)")
        if self._source is not source:
            self._handles = {}
        self._source = source
        self.counts = {"senders": float(source.senders), "sent_bytes": float(source.sent_bytes), "ipc_bytes": 0.0,
                       "group_bytes": 0.0}
        self._delta_sends = {}
        self.pool.begin(max([p.nbytes for p in plans] + [1]))

    def allocate(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor]) -> SendBuffer:
        """A pool buffer for the chunk; a delta push's chunk (`delta.shadow.PieceShadow.encode`: per destination
        a header, then its pieces' encodings) also notes where each destination's two messages lie in it."""
        if chunk.keys and isinstance(chunk.keys[0], tuple):
            self._delta_sends[chunk.index] = _delta_messages(chunk)
        pb = self.pool.take(max(chunk.nbytes, 1))
        return SendBuffer(chunk.index, pb.size, pb.tensor[: chunk.nbytes], {}, pooled=pb)

    async def pack(self, buf: SendBuffer, layout: Any, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            return
        await super().pack(buf, layout, tensors)
        if buf.tensor.device.type == "cpu":  # device-to-host copies may still be in flight: wait for them
            for dev in {t.device for t in tensors if t.is_cuda}:
                await anyio.to_thread.run_sync(torch.cuda.current_stream(dev).synchronize)

    def handles(self, buf: SendBuffer, engines: int) -> Sequence[ChunkHandle]:
        """Each engine's update for the bucket: per worker, what each sending rank sends it (`recv`), and the
        layout of the bucket's whole tensors its workers assemble."""
        if self._pg is None:
            raise TransportError("p2p transport is not connected")
        if self._broken is not None:
            raise TransportError(f"p2p group is unusable ({self._broken}); the next push rebuilds it")
        seq = self._seq
        self._seq += 1
        source, group = self._source, self._group
        assert source is not None and group is not None
        out = []
        for i in range(engines):
            name = self._layouts[i][0]
            key = (id(source), buf.chunk, name)
            hit = self._handles.get(key)
            if hit is None:
                recv: dict[str, Any] = {}
                for (eng, worker), segs in source.segments(buf.chunk).items():
                    if eng == name:
                        recv[str(worker)] = [[s.src, s.nbytes, [[p.name, p.box.to_json(), off] for p, off in s.pieces]]
                                             for s in segs]
                layout = source.delivered(buf.chunk, name)
                js = layout.to_json()
                hit = self._handles[key] = (recv, layout, js, layout_key(js))
            recv, layout, js, lkey = hit
            out.append(ChunkHandle(P2PHandle(group, seq, recv).to_wire(), layout, js, lkey))
        buf.handle = {"seq": seq}
        return out

    def _dest_rank(self, engine: str, worker: int) -> int:
        return self._offsets[engine] + worker

    def _send_all(self, tensor: torch.Tensor, sends: Sequence[tuple[tuple[str, int], int, int]], seq: int,
                  chunk: int, ipc: bool = True, pooled: PoolBuffer | None = None) -> None:
        """Post every message of this rank's bucket (each destination's in order), then wait for each (a send
        completes once its worker received it), within the group timeout. To a worker on this rank's GPU (`ipc`:
        not a delta's messages) a reference goes instead, and the send completes once the worker answers that it
        copied the bytes (module ipc)."""
        def failed(engine: str, worker: int, e: RuntimeError) -> EngineError:
            return EngineError(engine, f"trainer rank {self.rank}: send of bucket {chunk} to worker {worker} "
                               f"failed or timed out ({self._timeout:.1f}s): {e}", unresponsive=True)

        if ipc and tensor.is_cuda and self._ipc_dests:  # the pack's kernels are done before a worker reads the
            torch.cuda.current_stream(tensor.device).synchronize()  # buffer (a host copy and NCCL order themselves)
        host: torch.Tensor | None = None
        by_ref = by_group = 0
        works = []
        for (engine, worker), off, n in sends:
            if not n:
                continue
            dest = self._dest_rank(engine, worker)
            try:  # posting fails at once where gloo already saw the worker's connection close
                if ipc and pooled is not None and tensor.is_cuda and dest in self._ipc_dests:
                    ref = encode_ref(self._export(tensor, pooled), int(tensor.storage_offset()) + off, n)
                    works.append(((engine, worker), self._pg.send([ref], dest, seq)))
                    works.append(((engine, worker), self._pg.recv([torch.empty(1, dtype=torch.uint8)], dest, seq)))
                    by_ref += n
                    continue
                if tensor.is_cuda and self._backend == "gloo":  # gloo moves host memory
                    host = tensor.cpu() if host is None else host
                    part = host[off:off + n]
                else:
                    part = tensor[off:off + n]
                works.append(((engine, worker), self._pg.send([part], dest, seq)))
                by_group += n
            except RuntimeError as e:
                raise failed(engine, worker, e) from e
        for (engine, worker), w in works:
            try:
                w.wait(timedelta(seconds=self._timeout))
            except RuntimeError as e:
                raise failed(engine, worker, e) from e
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        with self._counts_lock:  # buckets' sends may run in several threads at once
            self.counts["ipc_bytes"] = self.counts.get("ipc_bytes", 0.0) + by_ref
            self.counts["group_bytes"] = self.counts.get("group_bytes", 0.0) + by_group

    @staticmethod
    def _export(tensor: torch.Tensor, pooled: PoolBuffer) -> dict[str, Any]:
        """The IPC export of the pool buffer `tensor` lies in, made once and kept with the buffer (the pool
        forgets it when it drops the buffer; a worker's answer already said it stopped reading)."""
        kept = pooled.exports.get(-1)
        if kept is None:
            export, held = export_storage(tensor, gpu_of(tensor.device).partition("/")[0])
            kept = pooled.exports[-1] = {"export": export, "held": held}
        return kept["export"]

    async def send(self, buf: SendBuffer, messages: Sequence[UpdateMessage], recipients: Sequence[Recipient]) -> None:
        """This rank's segments of the bucket and, on rank 0, every engine's update, together."""
        source = self._source
        assert source is not None
        seq = buf.handle["seq"]
        wire = self._delta_sends.pop(buf.chunk, None)
        if wire is None:
            sends = source.sends(buf.chunk)
        else:  # a delta: each destination's header, then its encodings (which may be none)
            sends = [m for dest, h_off, h_n, off, n in wire for m in ((dest, h_off, h_n), (dest, off, n))]
        ok = False

        async def own() -> None:
            if sends:
                await in_thread(self._send_all, buf.tensor, sends, seq, buf.chunk, wire is None, buf.pooled)

        try:
            with anyio.fail_after(self._timeout + 5.0):  # the sends have the group timeout; this is the backstop
                if not recipients:
                    await own()
                else:
                    async with anyio.create_task_group() as tg:
                        for r, m in zip(recipients, messages, strict=True):
                            tg.start_soon(r.update, m)
                        tg.start_soon(own)
            ok = True
        except TimeoutError:
            who = ",".join(r.name for r in recipients) or f"trainer rank {self.rank}"
            raise EngineError(who, f"bucket {buf.chunk}: not received within the group timeout "
                                   f"({self._timeout:.1f}s): a worker or trainer rank frozen or dead?",
                              unresponsive=True) from None
        finally:
            if not ok:  # some rank or worker may still wait for this bucket: the group's sequence is lost
                self._broken = f"bucket {buf.chunk} failed"

    def free(self, buf: SendBuffer) -> None:
        pb, buf.pooled = buf.pooled, None
        if pb is not None:
            buf.tensor = torch.empty(0, dtype=torch.uint8)
            self.pool.give(pb)

    def end_push(self, ok: bool) -> None:
        self.pool.end()
        if not ok and self._broken is None:
            self._broken = "a push failed"

    def push_counts(self) -> Mapping[str, float]:
        return dict(self.counts)

    @property
    def broken(self) -> str | None:
        return self._broken

    async def close(self) -> None:
        pg, store = self._pg, self._store
        self._pg = self._store = None
        if pg is not None or store is not None:
            t = dispose(pg, store)
            del pg, store
            if not await join_thread(t, self.close_timeout):
                get_logger().warning("p2p: group abort did not finish; abandoned", group=self._group,
                                     timeout_s=self.close_timeout)
        if self._pool is not None:
            self._pool.release()
        self._ipc_dests = set()


def _delta_messages(chunk: ChunkPlan) -> list[tuple[tuple[str, int], int, int, int, int]]:
    """Per destination of a delta chunk (keys (engine, worker, piece), a "#header" first): (destination, its
    header's offset and bytes, its encodings' offset and bytes)."""
    metas = chunk.layout.metas
    keys: Sequence[tuple[str, int, str]] = chunk.keys  # type: ignore[assignment]
    out = []
    i = 0
    while i < len(keys):
        j = i + 1
        while j < len(keys) and keys[j][2] != "#header":
            j += 1
        first, last = metas[i + 1] if j > i + 1 else None, metas[j - 1]
        off = first.offset if first is not None else 0
        n = last.offset + last.nbytes - off if first is not None else 0
        out.append(((keys[i][0], keys[i][1]), metas[i].offset, metas[i].nbytes, off, n))
        i = j
    return out
