"""Colocated CPU transport: shared-memory segments (memfd) mapped by sender and receivers.

Why memfd and a pool rather than a fresh named /dev/shm segment per chunk: creating and faulting in a new
tmpfs segment costs ~7x a memcpy of the same size (35 ms vs 5 ms for 64 MiB on the CI machine), so a push
would spend most of its time in the kernel. Segments are therefore reused: the release stage gives a
segment back to a pool (never more segments than the credit window), and `keep_pool=True` keeps them
between pushes. A memfd has no name in /dev/shm and lives exactly as long as some process holds it, so
no segment can be left behind by a push, a failed push, a crashed receiver or a crashed trainer.

Receivers open a segment through `/proc/<sender pid>/fd/<fd>` (same host, same user), check that it is
exactly the memfd named with the handle's token and large enough, and keep the mapping while the token is live.

One copy (`one_copy=True`, opt-in; numbers and why in `ShmTransport`). A converted tensor that is a plain view of one
of the source's own CPU storages (`Source.local_addresses`) in the plan's dtype is not packed: the chunk's
handle names it by reference (storage token, byte offset, view shape, strides; `refs.py`) and the receiver
copies it straight out of the trainer's memory into its parameters. For that the trainer's storages must be
shared memory: before a push the sender moves every storage of the source that is not shared yet into shared
memory in place (`UntypedStorage.share_memory_()`: torch copies it into a fresh, unlinked `/dev/shm/torch_*`
file, maps it, and swaps the storage's memory, so every view and the Parameter stay valid; this happens once,
and is logged). A storage is exported as `{pid, fd, size, link}`: `fd` is the sender's own duplicate of the
file descriptor torch keeps for it (so the file, and that fd number, stay the same while the export lives),
`link` its `/proc/self/fd` target. The receiver checks that `/proc/<pid>/fd/<fd>` links to exactly `link` and
that `link` is one of torch's shared-memory files (a handle cannot point it at another file of the sender),
before and after it opens it, checks the size, and maps it read-only, once, kept while pushes use it.

Lifetimes: the sender holds each exported storage (and its fd) until its export is dropped: at the end of a
successful push that did not use it, after a failed push (all of them), at reconnect and close; receivers
drop the storages a round did not use. So a parameter the trainer replaced (`p.data = new`) or resized between
pushes has a new storage, a new address and a new export, and its old memory goes once both sides let go.
Each push the sender also checks that the file under every exported address is still the exported one (an
inode compare): a storage freed in place (`untyped_storage().resize_(0)`) whose address a new one took is never
read through the old export.
"""

from __future__ import annotations

import hmac
import mmap
import os
import re
import secrets
import stat
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..errors import TransportError, ValidationError
from ..log import get_logger
from ..pack import ALIGN, Layout, TensorMeta
from ..sources.base import ChunkPlan, own_addresses
from .base import Receiver, SendBuffer, Transport
from .pool import BufferPool, PoolBuffer
from .refs import RefReceiver, RefSender, _Compact, _Storage

if TYPE_CHECKING:
    from ..engines.base import Engine

_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
MEMFD_PREFIX = "streamsync-chunk-"
# torch's file-descriptor sharing names its files "/dev/shm/torch_{pid}_{random}_{n}" and unlinks them at once:
# a storage export must name nothing else, so a handle cannot make a receiver map another file of the sender.
TORCH_SHM_LINK = re.compile(r"^/dev/shm/torch_-?[0-9]{1,20}_-?[0-9]{1,20}_-?[0-9]{1,20} \(deleted\)$")
_MAX_INT = 1 << 50


def _close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still referenced; the mapping goes when it is collected


def _create_segment(size: int) -> PoolBuffer:
    token = secrets.token_hex(8)
    try:
        fd = os.memfd_create(f"{MEMFD_PREFIX}{token}", os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=_FLAGS)
    except OSError as e:
        raise TransportError(f"cannot create a shared-memory segment of {size} bytes: {e}") from e
    return PoolBuffer(torch.frombuffer(mm, dtype=torch.uint8, count=size), size, token, {"fd": fd, "mm": mm})


def _destroy_segment(buf: PoolBuffer) -> None:
    _close(buf.extra["mm"])  # the caller dropped the tensor view first
    os.close(buf.extra["fd"])


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
    (`p.data = new`) instead. Opt-in, not the default: on the 2-core CI machine (`python -m streamsync bench
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
        self.pool = BufferPool(torch.device("cpu"), keep=keep_pool, alloc=_create_segment,
                               destroy=_destroy_segment)
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
        compact: _Compact | None = buf.state.get("compact")
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


def _field(raw: dict[str, Any], key: str, low: int) -> int:
    v = raw.get(key)
    if type(v) is not int or not low <= v < _MAX_INT:
        raise ValidationError(f"shm storage export field {key!r} must be an int >= {low}, got {v!r:.80}")
    return v


class ShmReceiver(RefReceiver, Receiver):
    name = "shm"

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cpu") -> None:
        super().__init__(init_info, device)
        self._maps: dict[tuple[int, int, str], mmap.mmap] = {}
        self._used: set[tuple[int, int, str]] = set()
        self._storages: dict[str, _Storage] = {}  # token -> mapped trainer storage (references)
        self._round: set[str] = set()  # storage tokens this round referenced
        # reference set id -> (its views, the storage tokens they lie on); see refs.RefSender._refs
        self._refsets: dict[str, tuple[list[tuple[TensorMeta, torch.Tensor]], frozenset[str]]] = {}
        #: host seconds spent mapping trainer storages (part of the receiver's `refs` time)
        self.timing = {"map_storages": 0.0}

    def _ref_map(self, token: str, raw: dict[str, Any]) -> torch.Tensor:
        """Map a trainer storage read-only, after checking the export names one of torch's shared-memory
        files and that `/proc/<pid>/fd/<fd>` is exactly that file (before and after opening it)."""
        if not isinstance(raw, dict):
            raise ValidationError(f"shm storage export must be {{pid, fd, size, link}}, got {raw!r:.200}")
        pid, fd, size = _field(raw, "pid", 1), _field(raw, "fd", 0), _field(raw, "size", 1)
        link = raw.get("link")
        if not isinstance(link, str) or not TORCH_SHM_LINK.match(link):
            raise ValidationError(f"shm storage export link {link!r:.80} is not one of torch's shared-memory files")
        path = f"/proc/{pid}/fd/{fd}"

        def same(target: str, where: str) -> None:
            if not hmac.compare_digest(target.encode(), link.encode()):
                raise ValidationError(f"{where} is not the trainer storage this export names (link mismatch)")

        try:
            same(os.readlink(path), path)
            f = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            raise TransportError(f"trainer storage {path} is gone (sender exited?)") from None
        except PermissionError as e:
            raise TransportError(f"cannot open {path}: {e} (sender and receiver must share host and user)") from e
        try:
            same(os.readlink(f"/proc/self/fd/{f}"), path)  # what was opened, not what the link said a moment ago
            st = os.fstat(f)
            if not stat.S_ISREG(st.st_mode) or st.st_size < size:
                raise ValidationError(f"trainer storage {path} holds {st.st_size} bytes, its export says {size}")
            mm = mmap.mmap(f, size, flags=_FLAGS, prot=mmap.PROT_READ)
        except OSError as e:
            raise TransportError(f"cannot map trainer storage {path}: {e}") from e
        finally:
            os.close(f)
        with warnings.catch_warnings():  # read-only on purpose: a loader can never write the trainer's weights
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mm, dtype=torch.uint8, count=size)

    def _map(self, pid: int, fd: int, token: str, nbytes: int) -> mmap.mmap:
        path = f"/proc/{pid}/fd/{fd}"
        try:  # the handle must name a streamsync segment with this token, not any file the sender has open
            target = os.readlink(path)
        except FileNotFoundError:
            raise TransportError(f"shared-memory segment {path} is gone (sender exited?)") from None
        except PermissionError as e:
            raise TransportError(f"cannot open {path}: {e} (sender and receiver must share host and user)") from e
        # Exact match (a prefix test let one right character pass), and the real name stays out of the error:
        # it holds the segment's token, which is what proves a handle came from the sender.
        if not hmac.compare_digest(target.encode(), f"/memfd:{MEMFD_PREFIX}{token} (deleted)".encode()):
            raise ValidationError(f"{path} is not the streamsync segment this handle names (token mismatch)")
        try:
            f = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise TransportError(f"shared-memory segment {path} is gone (sender exited?)") from None
        except PermissionError as e:
            raise TransportError(f"cannot open {path}: {e} (sender and receiver must share host and user)") from e
        try:
            size = os.fstat(f).st_size
            if size < nbytes:
                raise TransportError(f"segment {path} holds {size} bytes, handle says {nbytes}")
            return mmap.mmap(f, nbytes, flags=_FLAGS)
        finally:
            os.close(f)

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> Iterator[torch.Tensor]:
        h = update_info.get("handle")
        try:
            key = (int(h["pid"]), int(h["fd"]), str(h["token"]))  # type: ignore[index]
            nbytes = int(h["nbytes"])  # type: ignore[index]
            if nbytes <= 0 or key[0] <= 0 or key[1] < 0 or not key[2].isalnum():
                raise ValueError
        except (TypeError, KeyError, ValueError):
            raise ValidationError(f"shm handle must be {{pid, fd, token, nbytes}}, got {h!r:.200}") from None
        mm = self._maps.get(key)
        if mm is None or len(mm) < nbytes:
            mm = self._maps[key] = self._map(key[0], key[1], key[2], nbytes)
        self._used.add(key)
        yield torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)

    def end_round(self) -> None:
        """Keep mappings this round used (the sender's pool reuses them next round); drop the rest. Trainer
        storages this round did not reference are unmapped once their views are gone."""
        for key in [k for k in self._maps if k not in self._used]:
            _close(self._maps.pop(key))
        self._used.clear()
        self._end_round_refs()

    def close(self) -> None:
        for mm in self._maps.values():
            _close(mm)
        self._maps.clear()
        self._storages.clear()
        self._refsets.clear()
