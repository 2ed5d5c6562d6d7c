"""Remote transport: broadcasts over a dedicated process group, one per tensor or one per packed chunk.

The group holds the sending rank (rank 0) and every engine worker (ranks 1..N). It is made by a stateless
rendezvous: the sender hosts a `TCPStore` (listening on `master_addr` only), every side builds a
`ProcessGroupNCCL` / `ProcessGroupGloo` object directly on a prefixed view of it. No `init_process_group`, so
neither the trainer's default group nor vLLM's is touched, and a trainer may hold several such groups (one
per `WeightSync`).

NCCL moves CUDA buffers between GPUs and nodes; gloo is the same code for CPU buffers (and also accepts
CUDA tensors, staging them through host memory). NCCL cannot put two ranks on one GPU.

Per chunk, `send` starts every engine's update call and the sender's broadcasts together: an engine's
update enters the matching broadcasts, loads what it must, and returns. Broadcasts are issued in chunk order
on every rank (the send stage is sequential); each handle carries a sequence number so a receiver that got
out of step refuses before it enters a collective, and the protocol, which the receiver checks:

* "direct" (opt-in, `protocol="direct"`): one broadcast per tensor of the chunk's layout (tensors of no bytes
  have none), in layout order, all of a chunk's in one NCCL group (`ncclGroupStart`/`End` through the backend's
  coalescing: one launch). The sender broadcasts a tensor from the trainer's memory when it is on the group's
  device, contiguous and of the layout's dtype; the others (strided views, casts) are first copied into a
  scratch buffer of their size. The receiver posts the same broadcasts, each into the tensor's destination
  where its loader names one (`receiver.Destinations`: a parameter, or a row slice of a fused one) and into
  its slot of a receive buffer otherwise (then the loader copies it, as vLLM's `load_weights` needs). Both
  sides derive the ops from the layout alone, so they agree on count, order and sizes. No copy on either
  side where nothing needs one: the copies used to overlap the broadcasts and slow them (SMs and HBM).
  Small tensors (norms, biases) get a broadcast each too: inside one group they cost a work element of the
  one launch, not a launch, and batching them would need the copies this protocol removes.
  Measured on two H200s it was slower than "chunk" (53.7-80.0 vs 48.9-50.8 ms for the Qwen3-8B shape, 1 GiB chunks;
  docs/benchmarks), hence not the default.
* "chunk" (the default): the chunk is packed into one pool buffer and broadcast once into a receive buffer;
  the loader copies every tensor out. A chunk packed before from the same addresses into the same pool
  buffer replays its pack as one captured CUDA graph. With plain copies, launching a dense chunk's copies
  cost the sender's event loop 1.2-1.6 ms, and the engines' replies waited behind it: 64.2 ms for the
  Qwen3-8B shape on two H200s, against 50.8 ms captured and 44.5 ms for a raw broadcast of the same bytes
  (docs/benchmarks).

With NCCL nothing waits on a host for a copy or a broadcast in the middle of a push; streams wait on events:

  direct    sender    pack stream:  [producer] copies of strided/cast tensors into scratch -> ready(i)
                      comm stream:  [ready(i)] group of broadcasts i -> sent(i)       (from a worker thread)
            receiver  recv stream:  [free(slot) if any tensor is staged; the engine's stream if any goes into
                                    a parameter] group of broadcasts i -> got(i)
                      load stream:  [got(i)] copies of the staged tensors -> free(slot)  (the update returns)
  chunk     sender    pack stream:  [sent(i-w) of this buffer] pack i -> ready(i)
                      comm stream:  [ready(i)] broadcast i -> sent(i)
            receiver  recv stream:  [free(slot)] broadcast i into slot i % 2 -> got(i)
                      load stream:  [got(i)] copies into the parameters -> free(slot)
  both      send(i) returns when every engine acknowledged and broadcast i-1 finished (the last chunk: i, so
            the trainer may change its weights once the push returned); every tensor a broadcast reads is
            marked used by the comm stream, so a failed push that drops it frees nothing still read.
            end of round: waits (bounded) for the receive and load streams before the new version is reported

So the next chunk's pack and the receiver's loads of the previous one overlap broadcast i, and the receiver
posts the next broadcast into its second buffer while it still unpacks the previous one. A direct receive
writes live parameters from the receive stream: the round is marked dirty before it is posted (a push that
fails after that leaves the engine reporting mixed weights), and the engine's stream waits for it. gloo (and
`ordering="host"`) keeps the plain protocol: each side waits for its broadcasts in a thread; the receiver
loads, then acknowledges.

Nothing waits forever: the rendezvous, every collective and every acknowledgement have the group timeout,
and the sender's blocking calls run in worker threads that a failed push abandons. NCCL groups are built
with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (abort the communicator on a timeout, keep the process): torch's
default takes the whole process down when a collective times out, i.e. a frozen receiver would kill the
trainer. A push that fails in the middle of a broadcast leaves the group unusable: later pushes raise until
the transport connects again (`WeightSync.close()` then a push or `connect()`). `close()` aborts the group
(`abort`, not `shutdown`: NCCL's graceful finalize waits for peers that may be dead, frozen or gone) in a
daemon thread and returns within `close_timeout` whatever the peers do.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import torch

from ..errors import EngineError, TransportError, ValidationError
from ..log import get_logger
from ..pack import Layout, TensorMeta, align_up, byte_view, dtype_from_name, fits, pack_into, unpack
from ..sources.base import ChunkPlan
from .base import Receiver, SendBuffer, Transport
from .pool import BufferPool, PoolBuffer, captured, remember

if TYPE_CHECKING:
    from ..engines.base import Engine

BACKENDS = ("gloo", "nccl")
PROTOCOLS = ("direct", "chunk")
CLOSE_TIMEOUT = 10.0
T = TypeVar("T")


async def _in_thread(fn: Callable[..., T], *args: object) -> T:
    """Run a blocking collective call off the event loop; a cancelled push does not wait for it."""
    try:
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
    except TypeError:  # anyio < 4.1 spells it `cancellable`
        return await anyio.to_thread.run_sync(fn, *args, cancellable=True)  # type: ignore[call-arg]


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def host_store(addr: str, port: int, world: int, timeout: timedelta) -> Any:
    """The rendezvous `TCPStore`, listening on `addr` only.

    TCPStore's own server binds every interface whatever host name it is given; a socket bound here and
    handed over (`master_listen_fd`) keeps the store off the other interfaces."""
    import torch.distributed as dist

    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(max(128, 2 * world))
            bound = sock.getsockname()[1]
        except OSError:
            sock.close()
            raise
        # The store owns the descriptor from here on (it closes it when it goes).
        return dist.TCPStore(addr, bound, world, True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=sock.detach())
    except (RuntimeError, OSError) as e:
        raise TransportError(f"cannot host the rendezvous on {addr}:{port}: {e}") from e


def make_group(backend: str, store: Any, rank: int, world_size: int, timeout: timedelta,
               host: str) -> Any:
    """A process-group backend object over `store` (never registered as a torch.distributed group)."""
    pg = _new_backend(backend, store, rank, world_size, timeout, host)
    seq = getattr(pg, "_set_sequence_number_for_group", None)
    if seq is not None:  # as torch does for its own groups (keeps c10d's desync debugging consistent)
        seq()
    return pg


@contextmanager
def _env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _new_backend(backend: str, store: Any, rank: int, world_size: int, timeout: timedelta, host: str) -> Any:
    import torch.distributed as dist

    if backend == "gloo":
        from torch.distributed.distributed_c10d import ProcessGroupGloo

        if _is_loopback(host):  # everyone is on this host: talk over loopback, whatever the hostname says
            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            return ProcessGroupGloo(store, rank, world_size, opts)
        return ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise TransportError("this torch build has no NCCL; use backend='gloo'")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        # The broadcasts are the critical path: their kernels go before the pack and unpack copies that
        # overlap them (those run on ordinary streams).
        opts.is_high_priority_stream = True
        # Read by the constructor: on a timed-out collective abort this group's communicator and raise in
        # the waiter (2), instead of terminating the process (torch's default, 3).
        with _env(TORCH_NCCL_ASYNC_ERROR_HANDLING="2"):
            return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValidationError(f"collective backend must be one of {BACKENDS}, got {backend!r}")


def _bcast_opts() -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return opts


def broadcast(pg: Any, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
    """Blocking broadcast from rank 0. CUDA: returns when the bytes are in place on the device."""
    if not tensor.is_cuda:
        pg.broadcast([tensor], _bcast_opts()).wait()
        return
    with torch.cuda.device(tensor.device):
        s = stream or torch.cuda.current_stream(tensor.device)
        with torch.cuda.stream(s):
            work = pg.broadcast([tensor], _bcast_opts())
            work.wait()  # makes `s` wait for the collective's stream
        s.synchronize()


def launch_broadcast(pg: Any, tensor: torch.Tensor, stream: torch.cuda.Stream,
                     after: torch.cuda.Event | None = None) -> torch.cuda.Event:
    """Queue a broadcast of a CUDA tensor behind `after` on `stream`; returns the event that marks its end.
    Blocks no host: NCCL's stream waits for `stream`, `stream` then waits for NCCL's."""
    with torch.cuda.device(tensor.device), torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        work = pg.broadcast([tensor], _bcast_opts())
        work.wait()
        tensor.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return done


def _sendable(t: torch.Tensor, meta: TensorMeta, device: torch.device) -> bool:
    """Whether the direct protocol broadcasts `t` from where it lies: on the group's device, contiguous, of the
    layout's dtype and shape (or a blocked view of it, `pack.fits`: same row-major bytes)."""
    return (t.device == device and t.is_contiguous() and t.dtype == dtype_from_name(meta.dtype)
            and not t.is_conj() and not t.is_neg()
            and (tuple(t.shape) == meta.shape or fits(t, meta.shape)))


def _coalesces(pg: Any) -> bool:
    """Whether the backend groups collectives issued between `_start_coalescing()` and `_end_coalescing()` into
    one launch. ProcessGroupNCCL does (ncclGroupStart/End, one Work for the group); gloo does not."""
    try:
        return bool(getattr(pg, "supports_coalescing", False)) and hasattr(pg, "_start_coalescing")
    except RuntimeError:
        return False


def post_broadcasts(pg: Any, tensors: Sequence[torch.Tensor]) -> list[Any]:
    """Issue one broadcast from rank 0 per tensor, in order; returns the Works to wait for.

    Where the backend coalesces (NCCL) the broadcasts form one group: `ncclGroupStart`, one `ncclBroadcast`
    per tensor, `ncclGroupEnd`, i.e. one kernel launch for all of them and one Work that ends when the last
    one did (torch's `_coalescing_manager` makes the same calls through a registered `ProcessGroup`; this
    backend object is not registered, so its own `_start_coalescing`/`_end_coalescing` are called, which take
    no device). Each broadcast in the group still waits for the current stream (torch's syncStream), so the
    caller queues its waits on that stream first. Elsewhere (gloo) one async broadcast per tensor: gloo
    matches them by the tag each gets at issue, so every rank issuing them in the same order is enough.
    Every rank must pass tensors of the same byte sizes in the same order (the layout decides both)."""
    if not tensors:
        return []
    if len(tensors) > 1 and _coalesces(pg):
        pg._start_coalescing()
        try:
            for t in tensors:
                pg.broadcast([t], _bcast_opts())  # inside the group its own Work is not waited for: the group's is
        except BaseException:
            try:  # leave the group (ncclGroupEnd), or every later collective of this thread is swallowed
                pg._end_coalescing()
            except Exception:
                pass
            raise
        work = pg._end_coalescing()
        return [] if work is None else [work]
    return [pg.broadcast([t], _bcast_opts()) for t in tensors]


def broadcast_all(pg: Any, tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream | None = None) -> None:
    """Blocking broadcasts from rank 0 of every tensor (the host-ordered direct protocol). CUDA tensors:
    returns when the bytes are in place on the device."""
    if not tensors or not tensors[0].is_cuda:
        for w in post_broadcasts(pg, tensors):
            w.wait()
        return
    with torch.cuda.device(tensors[0].device):
        s = stream or torch.cuda.current_stream(tensors[0].device)
        with torch.cuda.stream(s):
            for w in post_broadcasts(pg, tensors):
                w.wait()
        s.synchronize()


def launch_broadcasts(pg: Any, tensors: Sequence[torch.Tensor], stream: torch.cuda.Stream,
                      after: Sequence[torch.cuda.Event | None] = ()) -> torch.cuda.Event:
    """Queue the broadcasts of CUDA tensors (one NCCL group) behind the events `after` on `stream`; returns
    the event that marks their end. Blocks no host. Every tensor is marked used by `stream` (after `stream`
    waited for the group), so memory freed meanwhile is not reused before the broadcasts read or wrote it."""
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        for ev in after:
            if ev is not None:
                stream.wait_event(ev)
        for w in post_broadcasts(pg, tensors):
            w.wait()  # `stream` waits for NCCL's stream
        for t in tensors:
            t.record_stream(stream)
        done = torch.cuda.Event()
        done.record(stream)
    return done


class Stalled(TransportError):
    """A collective did not finish in time: a peer died or froze."""


def wait_event(ev: torch.cuda.Event, timeout: float, what: str) -> None:
    """Wait for `ev` from the host for at most `timeout` seconds (polling: a stuck collective never returns
    from `synchronize`). Polls at most 100 us apart: the sender's next broadcast launch waits on this."""
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not ev.query():
        if time.monotonic() > deadline:
            raise Stalled(f"{what} did not finish within {timeout:.1f}s (a peer died or froze?)")
        time.sleep(pause)
        pause = min(pause * 2, 1e-4)


def _abort(pg: Any) -> None:
    """Tear the group down locally. `abort` first: `shutdown` finalizes NCCL communicators, which waits for
    every peer and never returns when one is dead or frozen."""
    for method in ("abort", "shutdown"):
        fn = getattr(pg, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # best effort: the group may be half-built or already broken
                pass


def dispose(*objs: Any) -> threading.Thread:
    """Abort process groups (and drop stores) in a daemon thread that holds the last references, so that no
    destructor runs on the caller's thread either. Join it with a timeout; if it hangs, it is abandoned."""
    box = [o for o in objs if o is not None]

    def run() -> None:
        while box:
            o = box.pop()
            if hasattr(o, "abort") or hasattr(o, "shutdown"):
                _abort(o)
            del o

    t = threading.Thread(target=run, name="streamsync-collective-close", daemon=True)
    t.start()
    return t


async def _join(t: threading.Thread, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while t.is_alive() and time.monotonic() < deadline:
        await anyio.sleep(0.005)
    return not t.is_alive()


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


# ---------------------------------------------------------------------------------------------- receiver


def _field(info: dict[str, Any], key: str, kind: type, *, lo: int = 0) -> Any:
    v = info.get(key)
    if kind is int and (type(v) is not int or v < lo):
        raise ValidationError(f"collective init_info {key!r} must be an int >= {lo}, got {v!r:.80}")
    if kind is float and (not isinstance(v, int | float) or isinstance(v, bool) or v <= 0):
        raise ValidationError(f"collective init_info {key!r} must be a positive number, got {v!r:.80}")
    if kind is str and (not isinstance(v, str) or not v or len(v) > 255):
        raise ValidationError(f"collective init_info {key!r} must be a non-empty string, got {v!r:.80}")
    return v


class CollectiveReceiver(Receiver):
    """Joins the sender's group at construction (blocks until every rank joined, or the timeout).

    Rank: `rank_offset` + this worker's rank within its engine. Engines of one worker have rank 0; in a
    multi-worker engine (`workers` > 1) that is `init_info["worker_rank"]` if given, else the worker's rank
    in its engine's default torch.distributed group (how vLLM numbers its workers).

    NCCL: two receive buffers; `open` posts the chunk's broadcast into one of them on a receive stream and
    returns at once, the loader's copies (on the caller's current stream) wait for it on the device, and the
    next chunk's broadcast goes into the other buffer meanwhile (module doc). `end_round` waits for all of it.
    """

    name = "collective"
    SLOTS = 2

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cpu") -> None:
        super().__init__(init_info, device)
        import torch.distributed as dist

        backend = init_info.get("backend")
        if backend not in BACKENDS:
            raise ValidationError(f"collective init_info backend must be one of {BACKENDS}, got {backend!r:.40}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValidationError(f"the nccl backend needs a CUDA receiver, got device {self.device}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = _field(init_info, "group", str)
        world = _field(init_info, "world_size", int, lo=2)
        workers = _field(init_info, "workers", int, lo=1)
        rank = _field(init_info, "rank_offset", int, lo=1) + self._worker_rank(init_info, workers)
        if rank >= world:
            raise ValidationError(f"collective rank {rank} outside a world of {world}")
        addr = _field(init_info, "master_addr", str)
        port = _field(init_info, "master_port", int, lo=1)
        timeout = timedelta(seconds=_field(init_info, "timeout_s", float))
        self.rank, self.world_size, self.backend = rank, world, backend
        self.timeout = timeout.total_seconds()
        self.close_timeout = CLOSE_TIMEOUT
        self._pg: Any = None
        try:
            store = dist.TCPStore(addr, port, world, False, timeout=timeout)
            self._pg = make_group(backend, dist.PrefixStore(self.group, store), rank, world, timeout, addr)
            broadcast(self._pg, torch.zeros(1, dtype=torch.uint8, device=self.device if backend == "nccl" else "cpu"))
        except RuntimeError as e:
            if self._pg is not None:
                dispose(self._pg).join(self.close_timeout)
                self._pg = None
            raise TransportError(f"cannot join collective group {self.group} as rank {rank}/{world} via "
                                 f"{addr}:{port}: {e}") from e
        self._store = store
        self._seq = 0
        self._bufs: list[torch.Tensor | None] = [None] * self.SLOTS
        self._free: list[torch.cuda.Event | None] = [None] * self.SLOTS  # a slot's last load finished
        self._views: dict[tuple[int, Layout], list[tuple[str, torch.Tensor]]] = {}
        self._recv_stream: torch.cuda.Stream | None = None
        self._load_streams: set[torch.cuda.Stream] = set()
        self._queued = False  # device-ordered work may be queued (drained by end_round)

    @staticmethod
    def _worker_rank(info: dict[str, Any], workers: int) -> int:
        if "worker_rank" in info:
            r = _field(info, "worker_rank", int)
        elif workers == 1:
            r = 0
        else:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValidationError("an engine of several workers needs 'worker_rank' in init_info or an "
                                      "initialized torch.distributed default group")
            r = dist.get_rank()
        if r >= workers:
            raise ValidationError(f"worker rank {r} outside an engine of {workers} workers")
        return r

    @property
    def _nccl(self) -> bool:
        return self.backend == "nccl"

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes:
            if buf is not None and self._nccl:  # its broadcast or loads may still be queued
                self._drain()
            self._bufs[slot] = None  # free the old one first
            self._views.clear()
            self._bufs[slot] = buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None, *, layout: Layout | None = None,
             targets: list[torch.Tensor | None] | None = None,
             before_write: Callable[[], None] | None = None) -> Iterator[torch.Tensor]:
        """Receive the chunk; yield its receive buffer (module doc).

        Direct protocol (the handle says so): needs the chunk's `layout`, and receives tensor i into
        `targets[i]` where that is given (the whole tensor or, for a part, its rows of the destination: a
        contiguous tensor of the meta's dtype and shape on this receiver's device), into its slot of the receive
        buffer otherwise. On entry `targets[i]` is left set exactly where tensor i was (or is queued to be)
        written there: those the caller must not load again; the others are set to None (the chunk protocol sets
        them all to None). `before_write` is called before anything is written into a target."""
        h = update_info.get("handle")
        if not isinstance(h, dict):
            raise ValidationError(f"collective handle must be {{group, seq, nbytes}}, got {h!r:.200}")
        if h.get("group") != self.group:
            raise ValidationError(f"chunk is for group {h.get('group')!r:.80}, this receiver joined {self.group!r}")
        seq, size = h.get("seq"), h.get("nbytes")
        if type(seq) is not int or seq != self._seq:
            raise ValidationError(f"collective chunk sequence {seq!r:.40} out of step (expected {self._seq})")
        if type(size) is not int or not 0 < size < 1 << 45:
            raise ValidationError(f"collective chunk size must be a positive int, got {size!r:.40}")
        if nbytes is not None and size != nbytes:  # before the receive buffer grows to what a handle claims
            raise ValidationError(f"collective chunk {seq} is {size} bytes, its layout {nbytes}")
        ordered = h.get("device_ordered", False)
        if type(ordered) is not bool:
            raise ValidationError(f"collective handle device_ordered must be a bool, got {ordered!r:.40}")
        protocol = h.get("protocol", "chunk")
        if protocol not in PROTOCOLS:
            raise ValidationError(f"collective handle protocol must be one of {PROTOCOLS}, got {protocol!r:.40}")
        if protocol == "direct" and layout is None:
            raise ValidationError(f"collective chunk {seq} uses the direct protocol: its receiver must pass the "
                                  "chunk's layout to open (one broadcast per tensor)")
        if layout is not None and layout.nbytes != size:
            raise ValidationError(f"collective chunk {seq} is {size} bytes, its layout {layout.nbytes}")
        if targets is not None and layout is not None and len(targets) != len(layout.metas):
            raise ValidationError(f"{len(targets)} targets for a layout of {len(layout.metas)} tensors")
        if self._pg is None:
            raise TransportError("collective receiver is closed")
        if protocol == "direct":
            assert layout is not None
            with self._open_direct(seq, layout, targets, before_write, ordered and self._nccl) as buf:
                yield buf
            return
        if targets is not None:  # the chunk protocol writes nothing but its receive buffer
            targets[:] = [None] * len(targets)
        if ordered and self._nccl:
            with self._open_streamed(seq, size) as buf:
                yield buf
            return
        if self._queued:  # the host protocol right after device-ordered chunks: their work is done first
            self._drain()
        buf = self._buffer(0, size)
        self._seq += 1
        try:
            broadcast(self._pg, buf)
        except RuntimeError as e:
            raise TransportError(f"broadcast of chunk {seq} failed: {e}") from e
        try:
            yield buf
        finally:
            if buf.is_cuda:  # the loader's copies out of the buffer finish before the ack
                torch.cuda.current_stream(buf.device).synchronize()

    @contextmanager
    def _open_streamed(self, seq: int, size: int) -> Iterator[torch.Tensor]:
        slot = seq % self.SLOTS
        buf = self._buffer(slot, size)
        if self._recv_stream is None:
            self._recv_stream = torch.cuda.Stream(self.device)
        self._seq += 1
        self._queued = True
        try:
            got = launch_broadcast(self._pg, buf, self._recv_stream, self._free[slot])
        except RuntimeError as e:
            raise TransportError(f"broadcast of chunk {seq} failed: {e}") from e
        load = torch.cuda.current_stream(self.device)
        self._load_streams.add(load)
        load.wait_event(got)
        try:
            yield buf
        finally:
            # The ack: the loader's copies are queued on `load`; the next broadcast into this slot waits for them.
            ev = self._free[slot] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))

    def _accepts(self, target: torch.Tensor | None, meta: TensorMeta) -> bool:
        return (target is not None and target.device == self.device and target.is_contiguous()
                and target.dtype == dtype_from_name(meta.dtype) and tuple(target.shape) == meta.shape)

    @contextmanager
    def _open_direct(self, seq: int, layout: Layout, targets: list[torch.Tensor | None] | None,
                     before_write: Callable[[], None] | None, streamed: bool) -> Iterator[torch.Tensor]:
        """One broadcast per tensor of the layout (none for an empty one), in layout order, as the sender posts
        them: into its target where one is given and fits, else into its slot of the receive buffer (made only
        if some tensor lands there). Device-ordered (NCCL): one group on the receive stream behind the slot's
        last loads (staged tensors) and the current stream's work (targets: nothing queued before this chunk on
        the engine's stream still reads or writes them); the current stream waits for the group."""
        metas = layout.metas
        tg: list[torch.Tensor | None] = targets if targets is not None else [None] * len(metas)
        for i, m in enumerate(metas):
            if tg[i] is not None and not self._accepts(tg[i], m):
                tg[i] = None
        staged = any(t is None and m.nbytes for t, m in zip(tg, metas, strict=True))
        slot = seq % self.SLOTS
        buf = (self._buffer(slot, layout.nbytes) if staged
               else torch.empty(0, dtype=torch.uint8, device=self.device))
        recvs = [byte_view(t) if t is not None else buf[m.offset: m.offset + m.nbytes]
                 for t, m in zip(tg, metas, strict=True) if m.nbytes]
        writes = any(t is not None for t in tg)
        if writes and before_write is not None:
            before_write()
        self._seq += 1
        if not streamed:
            if self._queued:  # the host protocol right after device-ordered chunks: their work is done first
                self._drain()
            try:
                broadcast_all(self._pg, recvs)
            except RuntimeError as e:
                raise TransportError(f"broadcast of chunk {seq} failed: {e}") from e
            try:
                yield buf
            finally:
                if buf.is_cuda:  # the loader's copies out of the buffer finish before the ack
                    torch.cuda.current_stream(buf.device).synchronize()
            return
        if self._recv_stream is None:
            self._recv_stream = torch.cuda.Stream(self.device)
        self._queued = True
        load = torch.cuda.current_stream(self.device)
        after: list[torch.cuda.Event | None] = [self._free[slot] if staged else None]
        if writes:
            engine = torch.cuda.Event()
            engine.record(load)
            after.append(engine)
        try:
            got = launch_broadcasts(self._pg, recvs, self._recv_stream, after)
        except RuntimeError as e:
            raise TransportError(f"broadcast of chunk {seq} failed: {e}") from e
        self._load_streams.add(load)
        load.wait_event(got)
        try:
            yield buf
        finally:
            if staged:  # the ack: the next broadcast into this slot waits for the loader's copies
                ev = self._free[slot] = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(self.device))

    def views(self, buf: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
        """The chunk's views, made once per (receive buffer, layout): a steady push unpacks nothing."""
        key = (buf.data_ptr(), layout)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            views = self._views[key] = list(unpack(buf, layout))
        return views

    def _drain(self) -> None:
        """Every queued broadcast and load has finished (bounded by the group timeout)."""
        for s in [self._recv_stream, *self._load_streams]:
            if s is not None:
                ev = torch.cuda.Event()
                ev.record(s)
                wait_event(ev, self.timeout, f"collective receive of group {self.group}")
        self._queued = False

    def end_round(self) -> None:
        """Before a round's end is acknowledged, every broadcast and copy into the parameters has finished."""
        if self._nccl and self._pg is not None:
            self._drain()

    def close(self) -> None:
        """Abort the group (bounded: returns within `close_timeout` whatever the sender does)."""
        pg, store = self._pg, getattr(self, "_store", None)
        self._pg = self._store = None
        if pg is not None or store is not None:
            dispose(pg, store).join(self.close_timeout)
            del pg, store
        self._bufs = [None] * self.SLOTS
        self._free = [None] * self.SLOTS
        self._views.clear()
