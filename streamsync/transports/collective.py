"""Remote transport: one broadcast per packed chunk over a dedicated process group.

The group holds the sending rank (rank 0) and every engine worker (ranks 1..N). It is made by a stateless
rendezvous: the sender hosts a `TCPStore`, every side builds a `ProcessGroupNCCL` / `ProcessGroupGloo`
object directly on a prefixed view of it. No `init_process_group`, so neither the trainer's default group
nor vLLM's is touched, and a trainer may hold several such groups (one per `WeightSync`).

NCCL moves CUDA buffers between GPUs and nodes; gloo is the same code for CPU buffers (and also accepts
CUDA tensors, staging them through host memory). NCCL cannot put two ranks on one GPU.

Per chunk, `send` starts every engine's update call and the sender's broadcast together: an engine's
update enters the matching broadcast into its own buffer, loads the chunk, and returns. Broadcasts are
issued in chunk order on every rank (the send stage is sequential); each handle carries a sequence number
so a receiver that got out of step refuses before it enters a collective.

Nothing waits forever: the rendezvous and every collective have the group timeout, and the sender's
blocking calls run in worker threads that a failed push abandons. A push that fails in the middle of a
broadcast leaves the group unusable: later pushes raise until `WeightSync` connects again.
"""

from __future__ import annotations

import ipaddress
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import torch

from ..errors import TransportError, ValidationError
from ..sources.base import ChunkPlan
from .base import Receiver, SendBuffer, Transport
from .pool import BufferPool, PoolBuffer

if TYPE_CHECKING:
    from ..engines.base import Engine

BACKENDS = ("gloo", "nccl")
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


def make_group(backend: str, store: Any, rank: int, world_size: int, timeout: timedelta,
               host: str) -> Any:
    """A process-group backend object over `store` (never registered as a torch.distributed group)."""
    pg = _new_backend(backend, store, rank, world_size, timeout, host)
    seq = getattr(pg, "_set_sequence_number_for_group", None)
    if seq is not None:  # as torch does for its own groups (keeps c10d's desync debugging consistent)
        seq()
    return pg


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
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    raise ValidationError(f"collective backend must be one of {BACKENDS}, got {backend!r}")


def broadcast(pg: Any, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
    """Blocking broadcast from rank 0. CUDA: returns when the bytes are in place on the device."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    if not tensor.is_cuda:
        pg.broadcast([tensor], opts).wait()
        return
    with torch.cuda.device(tensor.device):
        s = stream or torch.cuda.current_stream(tensor.device)
        with torch.cuda.stream(s):
            work = pg.broadcast([tensor], opts)
            work.wait()  # makes `s` wait for the collective's stream
        s.synchronize()


def _shutdown(pg: Any) -> None:
    for method in ("shutdown", "abort"):
        fn = getattr(pg, method, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # best effort: the group may be half-built or already broken
                pass


# ------------------------------------------------------------------------------------------------ sender


class CollectiveTransport(Transport):
    """backend: "nccl", "gloo" or "auto" (NCCL when every engine is on CUDA and this torch has CUDA).
    master_addr/master_port: where the sender's rendezvous store listens (port 0: any free port); engines
    must reach it. device: where send buffers live (default: CUDA for NCCL, CPU for gloo).
    An engine with several workers says so with an int attribute `workers` (default 1)."""

    name = "collective"

    def __init__(self, backend: str = "auto", *, master_addr: str = "127.0.0.1", master_port: int = 0,
                 device: torch.device | str | None = None, keep_pool: bool = True,
                 group_timeout: float | None = None) -> None:
        if backend not in (*BACKENDS, "auto"):
            raise ValidationError(f"collective backend must be one of {(*BACKENDS, 'auto')}, got {backend!r}")
        self.backend = backend
        self.master_addr = master_addr
        self.master_port = master_port
        self._device = torch.device(device) if device is not None else None
        self.keep_pool = keep_pool
        self.group_timeout = group_timeout
        self._pool: BufferPool | None = None
        self._pg: Any = None
        self._store: Any = None
        self._infos: list[dict[str, Any]] = []
        self._seq = 0
        self._broken: str | None = None
        self._stream: torch.cuda.Stream | None = None

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
        construction run together and must all finish within `timeout`."""
        import torch.distributed as dist

        await self.close()
        backend = self._resolve_backend(engines)
        workers = [int(getattr(e, "workers", 1)) for e in engines]
        if any(w < 1 for w in workers):
            raise ValidationError(f"every engine needs at least one worker, got {workers}")
        world = 1 + sum(workers)
        gtimeout = timedelta(seconds=self.group_timeout or timeout)
        try:
            self._store = dist.TCPStore(self.master_addr, self.master_port, world, True, timeout=gtimeout,
                                        wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise TransportError(f"cannot host the rendezvous on {self.master_addr}:{self.master_port}: {e}") from e
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

        def join() -> Any:
            pg = make_group(backend, prefixed, 0, world, gtimeout, self.master_addr)
            device = self.device
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

    # -- per push --------------------------------------------------------------------------------------

    def begin_push(self, plans: Sequence[ChunkPlan], push_id: str) -> None:
        self.pool.begin(max(p.nbytes for p in plans))

    def allocate(self, chunk: ChunkPlan, push_id: str) -> SendBuffer:
        pb = self.pool.take(chunk.nbytes)
        return SendBuffer(chunk.index, pb.size, pb.tensor[: chunk.nbytes], {"nbytes": chunk.nbytes}, {"pb": pb})

    async def pack(self, buf: SendBuffer, layout: Any, tensors: Sequence[torch.Tensor]) -> None:
        await super().pack(buf, layout, tensors)
        if buf.tensor.device.type == "cpu":  # device-to-host copies may still be in flight: wait for them
            for dev in {t.device for t in tensors if t.is_cuda}:
                await anyio.to_thread.run_sync(torch.cuda.current_stream(dev).synchronize)

    async def send(self, buf: SendBuffer, update_info: dict[str, Any], engines: Sequence[Engine]) -> None:
        if self._pg is None:
            raise TransportError("collective transport is not connected")
        if self._broken is not None:
            raise TransportError(f"collective group is unusable ({self._broken}); "
                                 "close the WeightSync and connect a new one")
        seq = self._seq
        self._seq += 1
        info = {**update_info, "handle": {"group": self._group, "seq": seq, "nbytes": buf.tensor.numel()}}
        done = False

        async def bcast() -> None:
            nonlocal done
            try:
                await _in_thread(broadcast, self._pg, buf.tensor, self._side_stream_for(buf.tensor))
            except RuntimeError as e:  # c10d's errors name no chunk: say which broadcast failed
                raise TransportError(f"broadcast of chunk {update_info.get('chunk')} (seq {seq}) failed: {e}") from e
            done = True

        try:
            async with anyio.create_task_group() as tg:
                for e in engines:
                    tg.start_soon(e.update, info)
                tg.start_soon(bcast)
        except BaseException:
            if not done:  # some rank may still sit in this broadcast: the group's sequence is lost
                self._broken = f"chunk {update_info.get('chunk')} failed during its broadcast"
            raise

    def _side_stream_for(self, t: torch.Tensor) -> torch.cuda.Stream | None:
        if not t.is_cuda:
            return None
        if self._stream is None or self._stream.device != t.device:
            self._stream = torch.cuda.Stream(t.device)
        return self._stream

    def free(self, buf: SendBuffer) -> None:
        pb: PoolBuffer | None = buf.state.pop("pb", None)
        if pb is not None:
            buf.tensor = torch.empty(0, dtype=torch.uint8)
            self.pool.give(pb)

    def end_push(self) -> None:
        self.pool.end()

    async def close(self) -> None:
        if self._pg is not None:
            _shutdown(self._pg)
        self._pg = None
        self._store = None
        if self._pool is not None:
            self._pool.release()


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
    """

    name = "collective"

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
        try:
            store = dist.TCPStore(addr, port, world, False, timeout=timeout)
            self._pg = make_group(backend, dist.PrefixStore(self.group, store), rank, world, timeout, addr)
            broadcast(self._pg, torch.zeros(1, dtype=torch.uint8, device=self.device if backend == "nccl" else "cpu"))
        except RuntimeError as e:
            raise TransportError(f"cannot join collective group {self.group} as rank {rank}/{world} via "
                                 f"{addr}:{port}: {e}") from e
        self._store = store
        self._seq = 0
        self._buf: torch.Tensor | None = None

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

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = None  # free the old one first: at most one receive buffer alive
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf[:nbytes]

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> Iterator[torch.Tensor]:
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
        if self._pg is None:
            raise TransportError("collective receiver is closed")
        buf = self._buffer(size)
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

    def end_round(self) -> None:
        pass  # the receive buffer is kept for the next round

    def close(self) -> None:
        if self._pg is not None:
            _shutdown(self._pg)
        self._pg = None
        self._store = None
        self._buf = None
