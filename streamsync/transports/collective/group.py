"""The process group of the collective and p2p transports: how a worker joins it (`GroupInit`, `join_group`),
rendezvous, backend objects, broadcasts, teardown."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import torch

from ...errors import TransportError, ValidationError

if TYPE_CHECKING:
    pass


BACKENDS = ("gloo", "nccl")

CLOSE_TIMEOUT = 10.0

T = TypeVar("T")


@dataclass(frozen=True)
class GroupInit:
    """How an engine worker joins a sender's group: the `init_info` the collective and p2p transports give each
    engine (`Transport.init_info`), written by the sender with `to_wire` and checked once on the worker by
    `parse`, which refuses a malformed field by name before anything connects.

    Ranks: the senders are ranks 0 .. trainer_ranks-1 (one for the collective transport, every trainer rank
    for p2p); an engine's workers are rank_offset + their rank in the engine (`worker_rank` where given, else
    0 in an engine of one worker, else the worker's rank in its engine's default torch.distributed group, as
    vLLM numbers its workers)."""

    transport: str
    backend: str
    group: str
    master_addr: str
    master_port: int
    world_size: int
    rank_offset: int
    workers: int
    timeout_s: float
    trainer_ranks: int = 1
    worker_rank: int | None = None

    def to_wire(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def parse(cls, info: Mapping[str, Any], kind: str) -> GroupInit:
        """`info` (plain data from the sender) checked field by field; `kind` names the transport in errors."""
        def field(key: str, of: type, lo: int = 0) -> Any:
            v = info.get(key)
            if of is int and (type(v) is not int or v < lo):
                raise ValidationError(f"{kind} init_info {key!r} must be an int >= {lo}, got {v!r:.80}")
            if of is float and (not isinstance(v, int | float) or isinstance(v, bool) or v <= 0):
                raise ValidationError(f"{kind} init_info {key!r} must be a positive number, got {v!r:.80}")
            if of is str and (not isinstance(v, str) or not v or len(v) > 255):
                raise ValidationError(f"{kind} init_info {key!r} must be a non-empty string, got {v!r:.80}")
            return v

        backend = info.get("backend")
        if backend not in BACKENDS:
            raise ValidationError(f"{kind} init_info backend must be one of {BACKENDS}, got {backend!r:.40}")
        senders = field("trainer_ranks", int, 1) if "trainer_ranks" in info else 1
        made = cls(transport=str(info.get("transport") or kind), backend=backend, group=field("group", str),
                   master_addr=field("master_addr", str), master_port=field("master_port", int, 1),
                   world_size=field("world_size", int, 2), rank_offset=field("rank_offset", int, senders),
                   workers=field("workers", int, 1), timeout_s=float(field("timeout_s", float)),
                   trainer_ranks=senders,
                   worker_rank=field("worker_rank", int) if "worker_rank" in info else None)
        return made

    def worker(self) -> int:
        """This worker's rank within its engine (class doc)."""
        if self.worker_rank is not None:
            r = self.worker_rank
        elif self.workers == 1:
            r = 0
        else:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValidationError("an engine of several workers needs 'worker_rank' in init_info or an "
                                      "initialized torch.distributed default group")
            r = dist.get_rank()
        if r >= self.workers:
            raise ValidationError(f"worker rank {r} outside an engine of {self.workers} workers")
        return r

    def rank(self) -> int:
        """This worker's rank in the group; refused outside the group's world."""
        rank = self.rank_offset + self.worker()
        if rank >= self.world_size:
            raise ValidationError(f"{self.transport} rank {rank} outside a world of {self.world_size}")
        return rank


@dataclass(frozen=True)
class BroadcastHandle:
    """A collective chunk's handle (`UpdateMessage.handle`): its group, its sequence number (a receiver out of
    step refuses before it enters a collective), its size, and whether both sides order it on the device.
    Written by the sender with `to_wire`, checked once by each receiver with `parse`."""

    group: str
    seq: int
    nbytes: int
    device_ordered: bool = False

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def parse(cls, h: object, group: str, seq: int) -> BroadcastHandle:
        """`h` checked against the receiver's `group` and the sequence number it expects."""
        if not isinstance(h, Mapping):
            raise ValidationError(f"collective handle must be {{group, seq, nbytes}}, got {h!r:.200}")
        got_group, got_seq = ticket(h, "collective", group, seq)
        size, ordered = h.get("nbytes"), h.get("device_ordered", False)
        if type(size) is not int or not 0 < size < 1 << 45:
            raise ValidationError(f"collective chunk size must be a positive int, got {size!r:.40}")
        if type(ordered) is not bool:
            raise ValidationError(f"collective handle device_ordered must be a bool, got {ordered!r:.40}")
        return cls(got_group, got_seq, size, ordered)


#: pieces one sending rank may send one worker in one chunk
MAX_PIECES = 1 << 20


@dataclass(frozen=True)
class P2PHandle:
    """A p2p chunk's handle (`UpdateMessage.handle`): its group, its sequence number, and per worker what each
    sending rank sends it (`recv`: worker -> [[src rank, bytes, pieces]]; the pieces are checked where the worker
    reads them). Written by the sender with `to_wire`, checked once by each receiver with `parse` and `segments`."""

    group: str
    seq: int
    recv: Mapping[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return {"group": self.group, "seq": self.seq, "recv": self.recv}

    @classmethod
    def parse(cls, h: object, group: str, seq: int) -> P2PHandle:
        """`h` checked against the receiver's `group` and the sequence number it expects."""
        if not isinstance(h, Mapping):
            raise ValidationError(f"p2p handle must be {{group, seq, recv}}, got {h!r:.200}")
        got_group, got_seq = ticket(h, "p2p", group, seq)
        recv = h.get("recv")
        if not isinstance(recv, Mapping):
            raise ValidationError(f"p2p handle 'recv' must be a dict of worker -> segments, got {recv!r:.120}")
        return cls(got_group, got_seq, recv)

    def segments(self, worker: int, ranks: int) -> list[tuple[int, int, list[Any]]]:
        """Worker `worker`'s receive list from `ranks` sending ranks: (sending rank, bytes, its pieces)."""
        mine = self.recv.get(str(worker), [])
        if not isinstance(mine, list):
            raise ValidationError(f"p2p handle: worker {worker}'s segments must be a list, got {mine!r:.120}")
        out = []
        seen: set[int] = set()
        for seg in mine:
            if not (isinstance(seg, list) and len(seg) == 3 and type(seg[0]) is int and type(seg[1]) is int
                    and isinstance(seg[2], list) and len(seg[2]) <= MAX_PIECES):
                raise ValidationError(f"p2p segment must be [src rank, nbytes, pieces], got {seg!r:.120}")
            src, nbytes, pieces = seg
            if not 0 <= src < ranks or src in seen:
                raise ValidationError(f"p2p segment from trainer rank {src}: not one of {ranks} ranks, or twice")
            seen.add(src)
            if not 0 < nbytes < 1 << 45:
                raise ValidationError(f"p2p segment from rank {src}: size {nbytes} out of range")
            out.append((src, nbytes, pieces))
        return out


def ticket(h: Mapping[str, Any], kind: str, group: str, seq: int) -> tuple[str, int]:
    """A chunk handle's (group, sequence number), refused unless they are the receiver's `group` and the `seq` it
    expects next: the part of every collective and p2p handle a receiver checks before it enters a collective."""
    if h.get("group") != group:
        raise ValidationError(f"chunk is for group {h.get('group')!r:.80}, this receiver joined {group!r}")
    got = h.get("seq")
    if type(got) is not int or got != seq:
        raise ValidationError(f"{kind} chunk sequence {got!r:.40} out of step (expected {seq})")
    return group, got


def join_group(init: GroupInit, rank: int, device: torch.device, close_timeout: float,
               on_store: Callable[[Any], None] | None = None) -> tuple[Any, Any]:
    """Join `init`'s group as `rank` (a worker: the sender hosts the store): (process group, store), after one
    broadcast over the whole group, so every pair is connected before the first push. `on_store` runs once the
    store is reached, before the group is made (p2p publishes the worker's GPU there)."""
    import torch.distributed as dist

    timeout = timedelta(seconds=init.timeout_s)
    pg: Any = None
    try:
        store = dist.TCPStore(init.master_addr, init.master_port, init.world_size, False, timeout=timeout)
        if on_store is not None:
            on_store(store)
        pg = make_group(init.backend, dist.PrefixStore(init.group, store), rank, init.world_size, timeout,
                        init.master_addr)
        broadcast(pg, torch.zeros(1, dtype=torch.uint8, device=device if init.backend == "nccl" else "cpu"))
    except RuntimeError as e:
        if pg is not None:
            dispose(pg).join(close_timeout)
        raise TransportError(f"cannot join {init.transport} group {init.group} as rank {rank}/{init.world_size} "
                             f"via {init.master_addr}:{init.master_port}: {e}") from e
    return pg, store


async def in_thread(fn: Callable[..., T], *args: object) -> T:
    """Run a blocking collective call off the event loop; a cancelled push does not wait for it."""
    try:
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
    except TypeError:  # anyio < 4.1 spells it `cancellable`
        return await anyio.to_thread.run_sync(fn, *args, cancellable=True)


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
            opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
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


async def join_thread(t: threading.Thread, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while t.is_alive() and time.monotonic() < deadline:
        await anyio.sleep(0.005)
    return not t.is_alive()
