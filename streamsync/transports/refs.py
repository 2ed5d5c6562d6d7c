"""One copy, transport-agnostic: tensors that are plain views of the trainer's own storages go by reference.

A colocated transport (CUDA IPC on a GPU, shared memory on a CPU host) can let the receiver map a trainer
storage and copy straight out of it, instead of packing the tensor into a send buffer first. This module holds
what does not depend on how a storage is exported and mapped; a transport holds one of each half and gives it
its one storage-specific hook:

* `References` (the sending half, given a `StorageExporter`): which of a chunk's tensors go by reference (the
  mask, cached per chunk layout and source tensor list) and the compact layout of the rest (`ChunkRefs`); the
  references of a chunk per engine (storage token, byte offset, view shape, strides), cached as *reference
  sets* by id; one export per (engine, storage); and the drop rules: a successful push drops the exports it
  did not use, a failed push or a reconnected engine drops all of them (the sender cannot tell what a
  receiver kept), `close` drops everything.
* `ReferenceViews` (the receiving half, given a function that maps a storage from its export data): the
  bounds-checked view of a reference on a mapped storage, the reference-set cache, per-round tracking of the
  storages used, and `end_round` dropping the others.

Wire format (inside a chunk's handle): `refs_id` (hex token), and the first time an engine sees that set,
`refs`: a list of `[hf name, dtype, hf shape, storage token, byte offset, view shape, view strides(, part)]`,
and `storages`: {token: export data} for the storages the engine has not had yet. The same fields may go
ahead of a chunk's first push, alone (`prime_chunk`, at connect), for the engine to map and keep. The packed part's own
layout replaces the plan's in the update (`ChunkHandle.layout`). The module docs of `cuda_ipc` and `shm` say
how each transport exports and maps a storage.
"""

from __future__ import annotations

import itertools
import math
import re
import secrets
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import torch

from ..cache import BoundedCache
from ..engines.abilities import Primable
from ..errors import StreamSyncError, ValidationError
from ..log import get_logger
from ..message import ChunkHandle, Recipient, UpdateMessage
from ..pack import Layout, TensorMeta, dtype_from_name, dtype_name, plan_layout
from ..plan.chunk import ChunkPlan, layout_key

if TYPE_CHECKING:
    from ..engines.base import Engine

_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")
_MAX_INT = 1 << 50


def storage_address(t: torch.Tensor) -> int:
    """The address of `t`'s storage (cheaper than `t.untyped_storage().data_ptr()`: no storage object)."""
    return int(t.data_ptr() - t.storage_offset() * t.element_size())


# ------------------------------------------------------------------------------------------------ sender


@dataclass
class Export:
    """One trainer storage exported to one engine: `token` names it in references."""

    token: str
    data: dict[str, Any]  # the plain export data the receiver maps it from
    used: int  # the push serial that last referenced it
    sent: bool = False  # the engine got the export data (a later reference sends the token only)
    keep: Any = None  # what the transport holds while the export lives (shm: the storage and a dup of its fd)
    checked: int = -1  # the push serial that last found it alive (`StorageExporter.alive`)


@dataclass
class RefSet:
    """A chunk's references for one engine, as last sent: reused while the same tensors sit at the same
    addresses and every export it names is alive; the engine caches it by `id` once it acknowledged it."""

    id: str
    refs: list[list[Any]]
    exports: list[tuple[int, Export]]  # (storage address, export)
    known: bool = False
    gen: int = -1  # the sender's export generation when every export it names was last seen alive
    checked: int = -1  # the push serial that last found every export it names alive
    memo: Any = None  # the exporter's own, for `StorageExporter.all_alive`


@dataclass(frozen=True)
class Compact:
    """A chunk's packed part when some of its tensors go by reference: its own layout, sent in place of the
    plan's, and which of the plan's tensors it holds."""

    layout: Layout
    layout_json: dict
    layout_key: str
    packed: tuple[int, ...]  # indices into the plan's specs
    refs: tuple[int, ...]


@dataclass
class ChunkRefs:
    """What a transport keeps for a chunk of which some tensors go by reference, until the chunk is freed."""

    plan: ChunkPlan
    tensors: Sequence[torch.Tensor]
    compact: Compact
    #: the tensors of the packed part (`compact.packed`): the same list while the source hands back the same one
    packed: Sequence[torch.Tensor] = ()
    #: engine -> (its reference set if a valid one was found, the set's cache key), looked up once per chunk
    looked_up: dict[int, tuple[RefSet | None, tuple]] = field(default_factory=dict)
    #: engine -> the handle fields naming its references, made while the chunk was packed
    fields: dict[int, dict[str, Any]] = field(default_factory=dict)
    #: engine -> the reference set its handle carried (acknowledged: the engine holds it)
    carried: dict[int, RefSet] = field(default_factory=dict)


class StorageExporter(Protocol):
    """How a transport shares one trainer storage with one engine."""

    def export(self, t: torch.Tensor) -> tuple[dict[str, Any], Any]:
        """Export the whole storage `t` lies on: (plain export data, what to hold while the export lives)."""
        ...

    def alive(self, export: Export, addr: int) -> bool:
        """Whether `export`, made for the storage at `addr`, still names what lies there (checked once per push
        per export before it is used again)."""
        ...

    def all_alive(self, rs: RefSet) -> bool:
        """`alive` of every export of a reference set, answered at once where the transport can (an MoE chunk's
        set names thousands of storages, and each push asks); `rs.memo` is the transport's to keep what makes
        the answer quick."""
        ...


class References:
    """The sending half's reference machinery (module doc).

    A transport calls `begin_push(addresses)` with the storage addresses that may go by reference this push,
    `chunk(...)` when it allocates a chunk, `export_ahead` + `prepare` while it packs it, `fields` for each
    engine's handle, `acknowledged` when an engine returned, `forget_engine` when an engine (re)connects and
    `end_push(ok)` / `drop_all` at a push's end and at close."""

    def __init__(self, exporter: StorageExporter, *, one_copy: bool, ref_bytes: int | None) -> None:
        self.exporter = exporter
        self.one_copy = one_copy
        self.ref_bytes = int(ref_bytes) if ref_bytes is not None else None
        #: this push's counts: tensors referenced and packed, exports made, their milliseconds
        self.counts: defaultdict[str, float] = defaultdict(float)
        self.persistent: set[int] = set()  # storage addresses of the source's own tensors (this push)
        self._exports: dict[tuple[int, int], Export] = {}  # (engine, storage address) -> export
        self._serial = 0
        self._gen = 0  # bumped whenever exports are dropped: a reference set checked since is alive
        self._made = 0  # exports made, ever
        #: the reference sets this push's handles carried, and the last push's with `_gen` and `_made` at its end
        self._used: list[RefSet] = []
        self._last: tuple[list[RefSet], int, int] = ([], -1, -1)
        self._compact: BoundedCache[tuple[str, tuple[bool, ...]], Compact] = BoundedCache(4096)
        self._refsets: BoundedCache[tuple[int, str, tuple], RefSet] = BoundedCache(4096)
        # layout key -> (the source's tensor list, the push serial, its mask): see `chunk`
        self._masks: BoundedCache[str, tuple[Sequence[torch.Tensor], int, tuple[bool, ...]]] = BoundedCache(4096)
        # (engine, layout key) -> (tensor list, reference set, its key): see `_cached`
        self._fast: BoundedCache[tuple[int, str], tuple[Sequence[torch.Tensor], RefSet, tuple]] = BoundedCache(4096)
        # layout key -> (the source's tensor list, its compact layout, the packed part's tensors): a transport
        # that sees the same packed list again skips its per-tensor work (cuda_ipc: graph key, stream records)
        self._packed: BoundedCache[str, tuple[Sequence[torch.Tensor], Compact, list[torch.Tensor]]] = (
            BoundedCache(4096))

    @property
    def chunk_bytes(self) -> int | None:
        """The per-chunk budget of referenced bytes, None when nothing goes by reference or referenced tensors
        fill the chunk budget like packed ones. Chunks of references are few and large: each costs host work on
        both sides (an update call, its handle, its events), none costs the sender memory."""
        return self.ref_bytes if self.one_copy else None

    def exports(self) -> Iterator[Export]:
        """The exports alive (one per engine and storage)."""
        return iter(self._exports.values())

    def begin_push(self, addresses: set[int]) -> None:
        self._serial += 1
        self.persistent = addresses
        self.counts = defaultdict(float)
        self._used = []

    def end_push(self, ok: bool) -> None:
        """Receivers drop the storages a round did not reference (`ReferenceViews.end_round`); so does the
        sender, after a success. After a failure it cannot tell what each receiver mapped: export afresh."""
        if not ok:
            self.drop_all()
            return
        sets, (last, gen, made) = self._used, self._last
        # The same reference sets as the last push, and no export made or dropped since: every export (each one
        # the last push used) was used again. A steady push ends here, without a pass over thousands of exports.
        if not (gen == self._gen and made == self._made and len(sets) == len(last)
                and all(a is b for a, b in zip(sets, last, strict=True))):
            for rs in sets:  # the exports this push's sets carried are the ones it used
                for _, ex in rs.exports:
                    ex.used = self._serial
            kept = {k: v for k, v in self._exports.items() if v.used == self._serial}
            if len(kept) != len(self._exports):
                self._gen += 1
                self._exports = kept
                for k in [k for k, v in self._refsets.items()
                          if any(ex.used != self._serial for _, ex in v.exports)]:
                    del self._refsets[k]
        self._last = (sets, self._gen, self._made)

    def forget_engine(self, index: int) -> None:
        """A (re)connected engine maps nothing yet: every storage is exported to it afresh."""
        self._gen += 1
        self._exports = {k: v for k, v in self._exports.items() if k[0] != index}
        for k in [k for k in self._refsets if k[0] == index]:
            del self._refsets[k]

    def drop_stale(self, stale: Callable[[int, Export], bool]) -> None:
        """Drop the exports `stale(address, export)` says no longer name what lies at their address."""
        gone = [k for k, ex in self._exports.items() if stale(k[1], ex)]
        if not gone:
            return
        self._gen += 1
        for k in gone:
            del self._exports[k]
        for key in [key for key, v in self._refsets.items() if any(self._exports.get((key[0], a)) is not ex
                                                                   for a, ex in v.exports)]:
            del self._refsets[key]

    def drop_all(self) -> None:
        self._gen += 1
        self._exports.clear()
        self._refsets.clear()

    def chunk(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor], dev: torch.device) -> ChunkRefs | None:
        """The chunk's references, or None when every tensor is packed: tensors on `dev` that are plain views
        of the source's own storages (`persistent`) in the plan's dtype go by reference."""
        if not self.persistent:
            return None
        last = self._masks.get(plan.layout_key)
        if last is not None and last[0] is tensors and last[1] == self._serial - 1:
            mask = last[2]  # the source's cached views of the last push, their storages unchanged since
        else:
            mask = tuple(t.device == dev and t.dtype == s.dtype and t.numel() > 0
                         and storage_address(t) in self.persistent and all(st >= 0 for st in t.stride())
                         for s, t in zip(plan.specs, tensors, strict=True))
        self._masks[plan.layout_key] = (tensors, self._serial, mask)
        if not any(mask):
            self.counts["packed"] += len(mask)
            return None
        compact = self._compact.get((plan.layout_key, mask))
        if compact is None:
            specs = [s for s, m in zip(plan.specs, mask, strict=True) if not m]
            layout = plan_layout(specs)
            js = layout.to_json()
            compact = self._compact[(plan.layout_key, mask)] = Compact(
                layout, js, layout_key(js), tuple(i for i, m in enumerate(mask) if not m),
                tuple(i for i, m in enumerate(mask) if m))
        self.counts["referenced"] += len(compact.refs)
        self.counts["packed"] += len(compact.packed)
        sub = self._packed.get(plan.layout_key)
        if sub is None or sub[0] is not tensors or sub[1] is not compact:
            sub = self._packed[plan.layout_key] = (tensors, compact, [tensors[i] for i in compact.packed])
        return ChunkRefs(plan, tensors, compact, sub[2])

    def _cached(self, cr: ChunkRefs, engine: int) -> tuple[RefSet | None, tuple]:
        """The chunk's reference set for `engine` if one made before is still valid (its tensors at the same
        addresses, every export it names alive), else None; and the set's cache key."""
        tensors = cr.tensors

        def alive(rs: RefSet | None) -> bool:
            if rs is None:
                return False
            if rs.gen != self._gen:  # exports were dropped since: are this set's still there?
                if not all(self._exports.get((engine, a)) is ex for a, ex in rs.exports):
                    return False
                rs.gen = self._gen
            if rs.checked != self._serial:
                # a dead export makes the set invalid; the chunk's references are then looked up one by one
                # (`export_ahead`), which drops the dead exports and makes new ones
                if not self.exporter.all_alive(rs):
                    return False
                rs.checked = self._serial
            return True

        fast = self._fast.get((engine, cr.plan.layout_key))
        if fast is not None and fast[0] is tensors and alive(fast[1]):  # a source's cached views: same addresses
            return fast[1], fast[2]
        key = (engine, cr.plan.layout_key,
               tuple((tensors[i].data_ptr(), tensors[i].stride()) for i in cr.compact.refs))
        rs = self._refsets.get(key)
        return (rs if alive(rs) else None), key

    def _valid(self, engine: int, addr: int, ex: Export) -> bool:
        """`ex` is still the export of the storage at `addr`; a stale one is dropped (a new one is made)."""
        if ex.checked == self._serial:
            return True
        if not self.exporter.alive(ex, addr):
            if self._exports.get((engine, addr)) is ex:
                del self._exports[(engine, addr)]
                self._gen += 1
            return False
        ex.checked = self._serial
        return True

    def _export(self, engine: int, addr: int, t: torch.Tensor) -> Export:
        """The export of the storage at `addr` (which `t` lies on) to `engine`, made if there is none."""
        ex = self._exports.get((engine, addr))
        if ex is not None and not self._valid(engine, addr, ex):
            ex = None
        if ex is None:
            t0 = time.perf_counter()
            data, keep = self.exporter.export(t)
            ex = self._exports[(engine, addr)] = Export(secrets.token_hex(8), data, self._serial, keep=keep,
                                                        checked=self._serial)
            self._made += 1
            self.counts["exports"] += 1
            self.counts["export_ms"] += (time.perf_counter() - t0) * 1e3
        return ex

    async def export_ahead(self, cr: ChunkRefs, engines: int, slice_s: float = 3e-4) -> None:
        """Make the exports the chunk's references need, handing the event loop back every `slice_s` seconds: a
        first push exports hundreds of storages while the chunk before it is in flight, and the engines' replies
        to that chunk (which the next update waits for) must not queue behind them."""
        for engine in range(engines):
            cr.looked_up[engine] = self._cached(cr, engine)  # `prepare` takes it from here: one lookup per chunk
            if cr.looked_up[engine][0] is not None:
                continue
            t_last = time.perf_counter()
            for i in cr.compact.refs:
                t = cr.tensors[i]
                addr = storage_address(t)
                ex = self._exports.get((engine, addr))
                if ex is None or not self._valid(engine, addr, ex):
                    self._export(engine, addr, t)
                    if time.perf_counter() - t_last > slice_s:
                        await anyio.sleep(0)
                        t_last = time.perf_counter()

    def prepare(self, cr: ChunkRefs, engines: int) -> None:
        """Make every engine's handle fields for the chunk now (while it is packed, not when it is sent)."""
        cr.fields = {i: self._fields(cr, i) for i in range(engines)}

    def fields(self, cr: ChunkRefs, engine: int) -> dict[str, Any]:
        """The handle fields naming the chunk's references for `engine` (made by `prepare` where it ran)."""
        ready = cr.fields.pop(engine, None)
        return ready if ready is not None else self._fields(cr, engine)

    def _fields(self, cr: ChunkRefs, engine: int) -> dict[str, Any]:
        """The references (and the exports the engine has not had yet), or only their id when the engine has
        them from an earlier push."""
        looked = cr.looked_up.pop(engine, None)
        rs, key = looked if looked is not None else self._cached(cr, engine)
        if rs is None:
            refs: list[list[Any]] = []
            exports: list[tuple[int, Export]] = []
            for i in cr.compact.refs:
                t = cr.tensors[i]
                spec = cr.plan.specs[i]
                addr = storage_address(t)
                ex = self._export(engine, addr, t)
                exports.append((addr, ex))
                ref = [spec.name, dtype_name(spec.dtype), list(spec.shape), ex.token,
                       t.storage_offset() * t.element_size(), list(t.shape), list(t.stride())]
                if spec.part is not None:
                    ref.append(list(spec.part))
                refs.append(ref)
            rs = self._refsets[key] = RefSet(secrets.token_hex(8), refs, exports)
        self._used.append(rs)
        self._fast[(engine, cr.plan.layout_key)] = (cr.tensors, rs, key)
        cr.carried[engine] = rs
        if rs.known:
            return {"refs_id": rs.id}
        new = {ex.token: ex.data for _, ex in rs.exports if not ex.sent}
        return {"refs_id": rs.id, "refs": rs.refs, **({"storages": new} if new else {})}

    def acknowledged(self, cr: ChunkRefs, engine: int) -> None:
        """Engine `engine` returned from a chunk's update: it holds every export and the reference set it
        carried."""
        rs = cr.carried.get(engine)
        if rs is not None and not rs.known:  # a set known before: its exports were marked sent then
            rs.known = True
            for _, ex in rs.exports:
                ex.sent = True


def handles_with_refs(refs: References, cr: ChunkRefs | None,
                      bases: Sequence[dict[str, Any]]) -> list[ChunkHandle]:
    """Each engine's handle: its base handle, plus, where the chunk has references, their fields and the packed
    part's own layout in place of the plan's."""
    if cr is None:
        return [ChunkHandle(b) for b in bases]
    c = cr.compact
    return [ChunkHandle({**b, **refs.fields(cr, i)}, c.layout, c.layout_json, c.layout_key)
            for i, b in enumerate(bases)]


async def prime_chunk(refs: References, plan: ChunkPlan, tensors: Sequence[torch.Tensor], dev: torch.device,
                      engines: Sequence[Engine], timeout: float) -> int:
    """Send a chunk's references ahead of its first push to every engine that takes them (`Primable`):
    those engines map the storages and build the views now, and the first push names the chunk's reference set
    by its id only (its packed part, if any, goes as in any push). Between the transport's `begin_push` and
    `end_push`, like a push's chunks; returns the engines that took it."""
    cr = refs.chunk(plan, tensors, dev)
    if cr is None:
        return 0
    took = 0
    for i, e in enumerate(engines):
        if not isinstance(e, Primable):
            continue
        info = {"chunk": plan.index, "handle": refs.fields(cr, i)}
        try:
            with anyio.fail_after(timeout):
                taken = await e.prime(info)
        except (StreamSyncError, TimeoutError) as err:  # an optimization only: the push carries the references
            get_logger().warning("an engine did not take references ahead of the first push", engine=e.name,
                                 chunk=plan.index, error=str(err) or type(err).__name__)
            taken = False
        if taken:
            refs.acknowledged(cr, i)
            took += 1
    return took


async def deliver(refs: References, cr: ChunkRefs | None, messages: Sequence[UpdateMessage],
                  recipients: Sequence[Recipient]) -> None:
    """Every engine's update, concurrently; each engine that returned holds the references it was sent."""
    async def one(i: int) -> None:
        await recipients[i].update(messages[i])
        if cr is not None:
            refs.acknowledged(cr, i)

    if len(recipients) == 1:  # the common colocated case: no task group per chunk
        await one(0)
        return
    async with anyio.create_task_group() as tg:
        for i in range(len(recipients)):
            tg.start_soon(one, i)


# ---------------------------------------------------------------------------------------------- receiver


@dataclass
class MappedStorage:
    """A trainer storage mapped for references, and the views built on it (keyed by their reference)."""

    tensor: torch.Tensor
    raw: dict[str, Any]
    views: dict[tuple, tuple[TensorMeta, torch.Tensor]] = field(default_factory=dict)
    typed: dict[torch.dtype, torch.Tensor | None] = field(default_factory=dict)  # see `reference_view`


def _ints(v: object, what: str, n: int | None = None, kind: str = "cuda_ipc") -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 8 or (n is not None and len(v) != n) or not all(
            type(x) is int and 0 <= x < _MAX_INT for x in v):
        raise ValidationError(f"{kind} reference {what} must be a list of non-negative ints, got {v!r:.80}")
    return tuple(v)


#: the serial numbers of reference sets' views, unique in the process (`ReferenceViews.serial`)
_SERIALS = itertools.count(1)


class ReferenceViews:
    """The receiving half's reference machinery (module doc). `map_storage(token, export data)` maps a trainer
    storage after validating its data and returns a flat uint8 tensor over it; the receiver calls `views` per
    update, `end_round` from its own `end_round`, and `clear` when it closes."""

    def __init__(self, kind: str, map_storage: Callable[[str, dict[str, Any]], torch.Tensor]) -> None:
        self.kind = kind
        self._map = map_storage
        self._storages: dict[str, MappedStorage] = {}  # token -> mapped trainer storage
        self._round: set[str] = set()  # storage tokens this round referenced
        # reference set id -> (its views, the storage tokens they lie on, the serial number its views were made as)
        self._refsets: BoundedCache[str, tuple[list[tuple[TensorMeta, torch.Tensor]], frozenset[str], int]] = \
            BoundedCache(4096)
        #: host seconds spent mapping trainer storages (part of a receiver's time on a first push)
        self.map_seconds = 0.0

    @property
    def storages(self) -> int:
        """Trainer storages this receiver holds mapped for references."""
        return len(self._storages)

    def _storage(self, token: str, exports: dict[str, Any]) -> MappedStorage:
        st = self._storages.get(token)
        raw = exports.get(token)
        if st is not None:
            if raw is not None and raw != st.raw:
                raise ValidationError(f"{self.kind} storage {token} changed its export data")
            return st
        if raw is None:
            raise ValidationError(f"{self.kind} reference to storage {token!r:.40}, which this receiver has not "
                                  "mapped and the update does not export")
        t0 = time.perf_counter()
        st = self._storages[token] = MappedStorage(self._map(token, raw), dict(raw))
        self.map_seconds += time.perf_counter() - t0
        return st

    def views(self, update_info: dict[str, Any], in_round: bool = True) -> list[tuple[TensorMeta, torch.Tensor]]:
        """The chunk's tensors sent by reference: views on mapped trainer storages, each with its metadata
        (HF name, dtype, shape, part). A view is in the HF shape, or in the sender's *blocked* shape where the
        strides allow no HF-shaped view (Q of an interleaved QKV): same row-major order (see `pack.fits`).
        `in_round=False` (references sent ahead of a push): their storages are not counted as the round's, so
        the next round's end keeps exactly those its push referenced, as the sender does after it."""
        h = update_info.get("handle")
        if not isinstance(h, dict) or ("refs" not in h and "refs_id" not in h):
            return []
        kind = self.kind
        rid = h.get("refs_id")
        if rid is not None and (not isinstance(rid, str) or not _TOKEN.match(rid)):
            raise ValidationError(f"{kind} handle refs_id must be a hex token, got {rid!r:.80}")
        refs = h.get("refs")
        if refs is None:
            known = self._refsets.get(rid) if rid is not None else None
            if known is None:
                raise ValidationError(f"{kind} reference set {rid!r:.40} is not known here and the update does "
                                      "not carry it")
            if in_round:
                self._round |= known[1]
            return known[0]
        exports = h.get("storages") or {}
        if not isinstance(refs, list) or len(refs) > 1 << 16 or not isinstance(exports, dict) or len(exports) > 1 << 16:
            raise ValidationError(f"{kind} handle 'refs' must be a list and 'storages' a dict")
        out = []
        for ref in refs:
            if not isinstance(ref, list) or len(ref) not in (7, 8) or not isinstance(ref[3], str):
                raise ValidationError(f"malformed {kind} reference {ref!r:.200}")
            token = ref[3]
            st = self._storage(token, exports)
            if in_round:
                self._round.add(token)
            key = tuple(tuple(x) if isinstance(x, list) else x for x in ref)
            hit = st.views.get(key)
            if hit is None:
                hit = st.views[key] = reference_view(ref, st.tensor, kind, st.typed)
            out.append(hit)
        if rid is not None:
            self._refsets[rid] = (out, frozenset(r[3] for r in refs), next(_SERIALS))
        return out

    def serial(self, rid: object) -> int | None:
        """The serial number of the views reference set `rid` names here, None where it is not known. Views are
        made once per serial number and lie on storages mapped while it lasts, so while a set's serial stays the
        same so does every address its views read: a graph captured from them can be replayed without asking
        each view where it lies. A set sent again (its storages mapped anew) gets a new serial number, and no
        number is given twice in a process (a receiver made again by a new connect does not count afresh)."""
        known = self._refsets.get(rid) if isinstance(rid, str) else None
        return None if known is None else known[2]

    def end_round(self) -> None:
        """Trainer storages this round did not reference are unmapped (the sender frees or reuses them once
        we let go)."""
        gone = {t for t in self._storages if t not in self._round}
        for token in gone:
            del self._storages[token]
        if gone:
            for rid in [rid for rid, v in self._refsets.items() if v[1] & gone]:
                del self._refsets[rid]
        self._round = set()

    def clear(self) -> None:
        self._storages.clear()
        self._refsets.clear()
        self._round = set()


def reference_view(ref: list[Any], storage: torch.Tensor, kind: str = "cuda_ipc",
                   typed: dict[torch.dtype, torch.Tensor | None] | None = None) -> tuple[TensorMeta, torch.Tensor]:
    """The view a reference names on `storage` (flat uint8), after checking it lies inside. `typed`: a cache
    of the storage viewed as each dtype, so that a view is one `as_strided` (a first push builds hundreds,
    an MoE's thousands; `python -m benchmarks.ref_view_cost` measures both ways)."""
    name, dt, hf_shape = ref[0], ref[1], ref[2]
    if not isinstance(name, str) or not isinstance(dt, str):
        raise ValidationError(f"malformed {kind} reference {ref!r:.200}")
    dtype = dtype_from_name(dt)
    hf_shape = _ints(hf_shape, f"{name!r} shape", kind=kind)
    offset = ref[4]
    if type(offset) is not int or not 0 <= offset < _MAX_INT:
        raise ValidationError(f"{kind} reference {name!r} offset must be a non-negative int")
    shape = _ints(ref[5], f"{name!r} view shape", kind=kind)
    stride = _ints(ref[6], f"{name!r} view strides", len(shape), kind=kind)
    item = dtype.itemsize
    numel = math.prod(hf_shape)
    if len(ref) == 8:  # a part: its fields are checked where metadata is parsed
        meta = TensorMeta.from_json([name, dt, list(hf_shape), 0, numel * item, ref[7]])
    else:  # name, dtype and shape are checked above
        meta = TensorMeta(name, dt, hf_shape, 0, numel * item)
    if math.prod(shape) != numel or numel == 0 or shape[len(shape) - len(hf_shape) + 1:] != hf_shape[1:]:
        raise ValidationError(f"{kind} reference {name!r}: view {list(shape)} is not a blocked form of "
                              f"{list(hf_shape)}")
    span = (1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))) * item
    if offset % item or (storage.data_ptr() + offset) % item or offset + span > storage.numel():
        raise ValidationError(f"{kind} reference {name!r} [{offset}, +{span}) misaligned or outside its "
                              f"{storage.numel()}-byte storage")
    whole = None
    if typed is not None:
        whole = typed.get(dtype, storage)
        if whole is storage:  # not made yet: the storage as `dtype` where its size and address allow
            whole = None
            if storage.numel() % item == 0 and storage.data_ptr() % item == 0:
                try:
                    whole = storage.view(dtype)
                except RuntimeError:  # a storage offset `view` does not take: slice per reference
                    pass
            typed[dtype] = whole
    if whole is not None:
        view = whole.as_strided(shape, stride, offset // item)
    else:
        view = storage[offset:offset + span].view(dtype).as_strided(shape, stride)
    # Otherwise blocked (Q of an interleaved QKV): loaders that take blocked tensors copy it as is, others
    # reshape (receiver/state.py). Never a failed `view` to find out: a raised error costs far more than a check.
    if shape != hf_shape and view.is_contiguous():
        view = view.view(hf_shape)
    return meta, view
