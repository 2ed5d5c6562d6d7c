"""The shared-memory sending half (in the trainer): pooled segments, one-copy references."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from ...engines.abilities import Primable
from ...errors import TransportError
from ...log import get_logger
from ...message import ChunkHandle, Recipient, UpdateMessage
from ...pack import ALIGN, Layout
from ...plan.chunk import ChunkPlan
from ..base import Primes, SendBuffer, Transport
from ..pool import BufferPool
from ..refs import Export, References, RefSet, deliver, handles_with_refs, prime_chunk, storage_address
from .segments import TORCH_SHM_LINK, Segment, create_segment, destroy_segment

if TYPE_CHECKING:
    from ...engines.base import Engine
    from ...sources.base import Source


class _Held:
    """What the sender holds while a storage export lives: the storage (its memory, and so its address, stays
    while the trainer drops or replaces the parameter) and a duplicate of torch's fd for it (the number the
    receiver opens; no other file gets it meanwhile). Closed when the export is dropped."""

    __slots__ = ("fd", "ino", "storage")

    def __init__(self, storage: torch.UntypedStorage, fd: int, ino: int) -> None:
        self.storage, self.fd, self.ino = storage, fd, ino

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        self.close()


@dataclass(frozen=True)
class _Shared:
    """A source storage in shared memory, as seen before this push: torch's fd for it, its size and inode."""

    storage: torch.UntypedStorage
    fd: int
    size: int
    ino: int


class ShmTransport(Transport, Primes):
    """keep_pool: keep up to `max_inflight` segments between pushes (fast steady state); False frees them
    at the end of every push.

    one_copy: send tensors that are plain views of the source's own CPU storages by reference (package doc):
    the receiver copies them once, out of the trainer's memory, and the trainer packs only the rest. Side
    effect: before the first such push (or at `connect(model)`, which sends references ahead to engines that
    take them) every CPU parameter and buffer of the source that is not in shared memory yet is moved there in
    place (`share_memory_()`; one copy of the model, logged): it then lives in
    `/dev/shm` (counted against that filesystem's size; the sender packs instead, with a warning, where
    `/dev/shm` has no room for it), and stays there after the sync closes. torch cannot grow a storage in
    shared memory in place (`t.resize_(larger)` crashes the process in torch 2.x): replace such a parameter
    (`p.data = new`) instead. Opt-in: it changes where the trainer's parameters live for good, its first push
    pays the move, and on a machine with cores to spare for packing it gains little at window 4; it saves the
    trainer the pack work and the segment memory of referenced tensors (docs/benchmarks/README.md, "CPU").
    ref_bytes: referenced bytes per chunk (the chunk budget, `chunk_bytes`, then bounds only the packed bytes);
    None (default): referenced tensors fill `chunk_bytes` like packed ones, so the chunking is the packed
    path's.
    """

    name: ClassVar[str] = "shm"
    reaches: ClassVar[Literal["cpu", "cuda", "remote"]] = "cpu"

    def __init__(self, keep_pool: bool = True, one_copy: bool = False, ref_bytes: int | None = None) -> None:
        super().__init__()
        self.pool = BufferPool(torch.device("cpu"), keep=keep_pool, alloc=create_segment,
                               destroy=destroy_segment)
        self.refs = References(self, one_copy=one_copy, ref_bytes=ref_bytes)
        self._shared: dict[int, _Shared] = {}  # storage address -> shared storage (this push)
        self._engines = 0
        #: bytes of trainer storages moved into shared memory, since construction
        self.moved_bytes = 0

    @property
    def one_copy(self) -> bool:
        return self.refs.one_copy

    @property
    def ref_chunk_bytes(self) -> int | None:
        return self.refs.chunk_bytes

    def init_info(self, index: int, engine: Engine) -> dict[str, Any]:
        self.refs.forget_engine(index)  # a (re)connected engine maps nothing yet: every storage is exported afresh
        return super().init_info(index, engine)

    def begin_push(self, plans: Sequence[ChunkPlan], source: Source, engines: Sequence[Engine], *,
                   by_reference: bool = True) -> None:
        """Move the source's own CPU storages into shared memory (the first time), note which may go by
        reference, and drop exports whose address now holds another file."""
        self._engines = len(engines)
        self.refs.begin_push(self._shareable(source) if self.one_copy and by_reference else set())
        # One size, so every segment fits every chunk; with references a segment holds only a chunk's packed
        # part, and segments grow to what chunks need (pool.take).
        self.pool.begin(self.pool.size if self.refs.persistent else max(p.nbytes for p in plans))

    def begin_prime(self, source: Source, engines: Sequence[Engine]) -> bool:
        if not (self.one_copy and any(isinstance(e, Primable) for e in engines)):
            return False
        self.refs.begin_push(self._shareable(source))
        return bool(self.refs.persistent)

    async def prime(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor], engines: Sequence[Engine],
                    timeout: float) -> int:
        return await prime_chunk(self.refs, plan, tensors, torch.device("cpu"), engines, timeout)

    def end_prime(self, ok: bool) -> None:
        self._shared = {}
        if not ok:  # engines may hold part of it: export afresh (a success keeps every export: no round ended)
            self.refs.drop_all()

    def _shareable(self, source: Source) -> set[int]:
        self._shared = {}
        storages: dict[int, torch.UntypedStorage] = {}
        for _, t in source.local_tensors():
            if t.device.type == "cpu" and t.numel():
                st = t.untyped_storage()
                storages.setdefault(st.data_ptr(), st)
        if not self._share(list(storages.values())):
            return set()
        shared: dict[int, _Shared] = {}
        for st in storages.values():
            try:
                fd, size = st._share_fd_cpu_()
                shared[st.data_ptr()] = _Shared(st, fd, size, os.fstat(fd).st_ino)
            except (RuntimeError, OSError):
                continue  # shared another way (file_system strategy, another process's): packed
        self.refs.drop_stale(lambda addr, ex: addr in shared and shared[addr].ino != ex.keep.ino)
        self._shared = shared
        return source.local_addresses(torch.device("cpu")) & shared.keys()

    def _share(self, storages: list[torch.UntypedStorage]) -> bool:
        """Move the storages not in shared memory yet into it; False (and nothing moved) where that cannot be
        done: another sharing strategy than torch's default, or too little room in /dev/shm."""
        todo = [st for st in storages if not st.is_shared()]
        if not todo:
            return True
        log = get_logger()
        if torch.multiprocessing.get_sharing_strategy() != "file_descriptor":
            log.warning("shm one copy needs torch's file_descriptor sharing strategy; packing instead",
                        strategy=torch.multiprocessing.get_sharing_strategy())
            return False
        need = sum(st.nbytes() for st in todo)
        try:
            vfs = os.statvfs("/dev/shm")
            room = vfs.f_bavail * vfs.f_frsize
        except OSError:
            room = 0
        if need > room * 0.9:
            log.warning("shm one copy: /dev/shm has no room for the trainer's storages; packing instead",
                        need_bytes=need, free_bytes=room)
            return False
        for st in todo:
            st.share_memory_()
        self.moved_bytes += need
        log.info("shm one copy: moved trainer storages into shared memory", storages=len(todo), bytes=need)
        return True

    # StorageExporter (refs.References)
    def export(self, t: torch.Tensor) -> tuple[dict[str, Any], Any]:
        sh = self._shared[storage_address(t)]
        fd = os.dup(sh.fd)  # non-inheritable
        held = _Held(sh.storage, fd, sh.ino)
        link = os.readlink(f"/proc/self/fd/{fd}")
        if not TORCH_SHM_LINK.match(link):
            raise TransportError(f"a shared trainer storage is not one of torch's shared-memory files ({link!r:.80})")
        return {"pid": os.getpid(), "fd": fd, "size": sh.size, "link": link}, held

    def alive(self, export: Export, addr: int) -> bool:
        return True  # a file swapped under an address is found before each push (`_shareable`)

    def all_alive(self, rs: RefSet) -> bool:
        return True

    @property
    def segments(self) -> int:
        """Segments alive (busy or pooled)."""
        return self.pool.buffers

    def allocate(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor]) -> SendBuffer:
        """The chunk's segment: sized for the tensors that are packed; those that are plain views of the
        source's own storages go by reference (package doc)."""
        cr = self.refs.chunk(chunk, tensors, torch.device("cpu"))
        need = chunk.nbytes if cr is None else max(cr.compact.layout.nbytes if cr.compact.packed else 0, ALIGN)
        seg = self.pool.take(need)
        backing: Segment = seg.backing
        handle = {"pid": os.getpid(), "fd": backing.fd, "token": seg.token, "nbytes": seg.size}
        return SendBuffer(chunk.index, seg.size, seg.tensor[:need], handle, pooled=seg, refs=cr)

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        if buf.refs is not None:  # only the chunk's packed part goes into the segment
            if not buf.refs.compact.packed:
                return
            layout = buf.refs.compact.layout
            tensors = buf.refs.packed
        await super().pack(buf, layout, tensors)

    def handles(self, buf: SendBuffer, engines: int) -> Sequence[ChunkHandle]:
        return handles_with_refs(self.refs, buf.refs, [buf.handle] * engines)

    async def send(self, buf: SendBuffer, messages: Sequence[UpdateMessage], recipients: Sequence[Recipient]) -> None:
        await deliver(self.refs, buf.refs, messages, recipients)

    def free(self, buf: SendBuffer) -> None:
        seg, buf.pooled, buf.refs = buf.pooled, None, None
        if seg is not None:
            buf.tensor = torch.empty(0, dtype=torch.uint8)
            self.pool.give(seg)

    def push_counts(self) -> Mapping[str, float]:
        return {f"refs.{k}": v for k, v in self.refs.counts.items()}

    def end_push(self, ok: bool) -> None:
        self.pool.end()  # segments still busy (a failed push) are destroyed, never reused
        self._shared = {}
        self.refs.end_push(ok)

    async def close(self) -> None:
        self.pool.release()
        self.refs.drop_all()
