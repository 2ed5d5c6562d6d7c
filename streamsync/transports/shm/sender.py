"""The shared-memory sending half (in the trainer): pooled segments, one-copy references."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ...errors import TransportError
from ...log import get_logger
from ...pack import ALIGN, Layout
from ...plan.chunk import ChunkPlan
from ...sources.base import own_addresses
from ..base import SendBuffer, Transport
from ..pool import BufferPool
from ..refs import Compact, RefSender
from .segments import TORCH_SHM_LINK, create_segment, destroy_segment

if TYPE_CHECKING:
    from ...engines.base import Engine


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


class ShmTransport(RefSender, Transport):
    """keep_pool: keep up to `max_inflight` segments between pushes (fast steady state); False frees them
    at the end of every push.

    one_copy: send tensors that are plain views of the source's own CPU storages by reference (module doc):
    the receiver copies them once, out of the trainer's memory, and the trainer packs only the rest. Side
    effect: before the first such push every CPU parameter and buffer of the source that is not in shared
    memory yet is moved there in place (`share_memory_()`; one copy of the model, logged): it then lives in
    `/dev/shm` (counted against that filesystem's size; the sender packs instead, with a warning, where
    `/dev/shm` has no room for it), and stays there after the sync closes. torch cannot grow a storage in
    shared memory in place (`t.resize_(larger)` crashes the process in torch 2.x): replace such a parameter
    (`p.data = new`) instead. Opt-in, not the default: on the 2-core CI machine (`python -m benchmarks
    --one-copy --repeat 5`, 0.94 GB bf16 model, 64 MiB chunks, one receiver process;
    `docs/benchmarks/cpu-onecopy.json`) it was faster in steady state, but little at window 4: 197 ms against
    208 ms packed (1.05x; an earlier run on a quieter machine 172 against 271 ms, 1.58x); window 1, 197
    against 362 ms (1.83x). Its first push was slower (787 against 292 ms: the one-time move into shared
    memory and the receiver's first mapping), and it changes where the trainer's parameters live for good,
    with the resize hazard above. It needs no pack work from the trainer and no segment memory for referenced
    tensors: a trainer short of CPU or memory, or pushing at window 1, should ask for it.
    ref_bytes: referenced bytes per chunk (the chunk budget, `chunk_bytes`, then bounds only the packed bytes);
    None (default): referenced tensors fill `chunk_bytes` like packed ones, so the chunking is the packed
    path's. 1 GiB (one chunk for the 0.94 GB model) measured 187 ms at window 4 in the same run (1.11x).
    """

    name = "shm"

    def __init__(self, keep_pool: bool = True, one_copy: bool = False, ref_bytes: int | None = None) -> None:
        self.pool = BufferPool(torch.device("cpu"), keep=keep_pool, alloc=create_segment,
                               destroy=destroy_segment)
        self._init_refs(one_copy, ref_bytes)
        self._shared: dict[int, _Shared] = {}  # storage address -> shared storage (this push)
        #: bytes of trainer storages moved into shared memory, since construction
        self.moved_bytes = 0

    def init_info(self, index: int, engine: Engine) -> dict[str, Any]:
        self._forget_engine(index)  # a (re)connected engine maps nothing yet: every storage is exported afresh
        return super().init_info(index, engine)

    def note_source(self, source: Any, engines: Sequence[Engine]) -> None:
        """Before a push: move the source's own CPU storages into shared memory (the first time), and note
        which may go by reference. Exports whose address now holds another file are dropped."""
        self._persistent = set()
        self._shared = {}
        if not self.one_copy:
            return
        cpu = torch.device("cpu")
        storages: dict[int, torch.UntypedStorage] = {}
        for _, t in source.local_tensors():
            if t.device.type == "cpu" and t.numel():
                st = t.untyped_storage()
                storages.setdefault(st.data_ptr(), st)
        if not self._share(list(storages.values())):
            return
        shared: dict[int, _Shared] = {}
        for st in storages.values():
            try:
                fd, size = st._share_fd_cpu_()
                shared[st.data_ptr()] = _Shared(st, fd, size, os.fstat(fd).st_ino)
            except (RuntimeError, OSError):
                continue  # shared another way (file_system strategy, another process's): packed
        stale = [k for k, ex in self._exports.items() if k[1] in shared and shared[k[1]].ino != ex.keep.ino]
        if stale:
            self._export_gen += 1
            for k in stale:
                del self._exports[k]
            self._refsets = {k: v for k, v in self._refsets.items() if not any(
                self._exports.get((k[0], a)) is not ex for a, ex in v.exports)}
        mine = own_addresses(source, cpu)
        self._shared = shared
        self._persistent = mine & shared.keys()

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

    def _ref_export(self, t: torch.Tensor) -> tuple[dict[str, Any], Any]:
        sh = self._shared[t.data_ptr() - t.storage_offset() * t.element_size()]
        fd = os.dup(sh.fd)  # non-inheritable
        held = _Held(sh.storage, fd, sh.ino)
        link = os.readlink(f"/proc/self/fd/{fd}")
        if not TORCH_SHM_LINK.match(link):
            raise TransportError(f"a shared trainer storage is not one of torch's shared-memory files ({link!r:.80})")
        return {"pid": os.getpid(), "fd": fd, "size": sh.size, "link": link}, held

    def begin_push(self, plans: Sequence[ChunkPlan], push_id: str) -> None:
        self._push_serial += 1
        self._push_ok = False
        # One size, so every segment fits every chunk; with references a segment holds only a chunk's packed
        # part, and segments grow to what chunks need (pool.take).
        self.pool.begin(self.pool.size if self._persistent else max(p.nbytes for p in plans))

    @property
    def segments(self) -> int:
        """Segments alive (busy or pooled)."""
        return self.pool.buffers

    def allocate(self, chunk: ChunkPlan, push_id: str) -> SendBuffer:
        return self._segment(chunk, chunk.nbytes)

    def _segment(self, chunk: ChunkPlan, nbytes: int, state: dict[str, Any] | None = None) -> SendBuffer:
        seg = self.pool.take(nbytes)
        handle = {"pid": os.getpid(), "fd": seg.extra["fd"], "token": seg.token, "nbytes": seg.size}
        return SendBuffer(chunk.index, seg.size, seg.tensor[:nbytes], handle, {"seg": seg, **(state or {})})

    def allocate_for(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor], push_id: str) -> SendBuffer:
        """The chunk's segment once its tensors are known: sized for the tensors that are packed; those that
        are plain views of the source's own storages go by reference (module doc)."""
        if not self._persistent:
            return self.allocate(chunk, push_id)
        compact = self._ref_compact(chunk, tensors, torch.device("cpu"))
        if compact is None:
            return self.allocate(chunk, push_id)
        need = max(compact.layout.nbytes if compact.packed else 0, ALIGN)
        return self._segment(chunk, need, {"compact": compact, "plan": chunk, "tensors": tensors})

    async def pack(self, buf: SendBuffer, layout: Layout, tensors: Sequence[torch.Tensor]) -> None:
        compact: Compact | None = buf.state.get("compact")
        if compact is not None:  # only the chunk's packed part goes into the segment
            if not compact.packed:
                return
            layout = compact.layout
            tensors = [tensors[i] for i in compact.packed]
        await super().pack(buf, layout, tensors)

    async def send(self, buf: SendBuffer, update_info: dict[str, Any], engines: Sequence[Engine]) -> None:
        if "compact" not in buf.state:
            await super().send(buf, update_info, engines)
            return

        async def one(i: int, e: Engine) -> None:
            await e.update(self._ref_info(buf, update_info, buf.handle, i))
            self._sent(buf, i)

        if len(engines) == 1:
            await one(0, engines[0])
            return
        async with anyio.create_task_group() as tg:
            for i, e in enumerate(engines):
                tg.start_soon(one, i, e)

    def free(self, buf: SendBuffer) -> None:
        seg = buf.state.pop("seg", None)
        buf.state.pop("tensors", None)
        if seg is not None:
            buf.tensor = torch.empty(0, dtype=torch.uint8)
            self.pool.give(seg)

    def end_push(self) -> None:
        self.pool.end()  # segments still busy (a failed push) are destroyed, never reused
        self._shared = {}
        self._end_push_refs()

    async def close(self) -> None:
        self.pool.release()
        self._drop_all_exports()
