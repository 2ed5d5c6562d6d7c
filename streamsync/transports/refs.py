"""One copy, transport-agnostic: tensors that are plain views of the trainer's own storages go by reference.

A colocated transport (CUDA IPC on a GPU, shared memory on a CPU host) can let the receiver map a trainer
storage and copy straight out of it, instead of packing the tensor into a send buffer first. This module holds
what does not depend on how a storage is exported and mapped:

* `RefSender` (a mixin of the sending half): which of a chunk's tensors go by reference (the mask, cached per
  chunk layout and source tensor list) and the compact layout of the rest; the references of a chunk per
  engine (storage token, byte offset, view shape, strides), cached as *reference sets* by id; one export per
  (engine, storage), made by the transport's hook `_ref_export`; and the drop rules: a successful push drops
  the exports it did not use, a failed push or a reconnected engine drops all of them (the sender cannot tell
  what a receiver kept), `close` drops everything.
* `RefReceiver` (a mixin of the receiving half): the bounds-checked view of a reference on a mapped storage,
  the reference-set cache, per-round tracking of the storages used, and `end_round` dropping the others. The
  transport's hook `_ref_map` maps a storage from its export data.

Wire format (inside a chunk's handle): `refs_id` (hex token), and the first time an engine sees that set,
`refs`: a list of `[hf name, dtype, hf shape, storage token, byte offset, view shape, view strides(, part)]`,
and `storages`: {token: export data} for the storages the engine has not had yet. The packed part's own
layout replaces the plan's in the update (`layout`, `layout_key`). The module docs of `cuda_ipc.py` and
`shm.py` say how each transport exports and maps a storage.
"""

from __future__ import annotations

import math
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch

from ..errors import ValidationError
from ..pack import Layout, TensorMeta, dtype_from_name, dtype_name, plan_layout
from ..plan.chunk import ChunkPlan, layout_key
from .base import SendBuffer

_TOKEN = re.compile(r"^[0-9a-f]{8,64}$")
_MAX_INT = 1 << 50


def storage_address(t: torch.Tensor) -> int:
    """The address of `t`'s storage (cheaper than `t.untyped_storage().data_ptr()`: no storage object)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


# ------------------------------------------------------------------------------------------------ sender


@dataclass
class Export:
    """One trainer storage exported to one engine: `token` names it in references."""

    token: str
    ipc: dict[str, Any]
    used: int  # the push serial that last referenced it
    sent: bool = False  # the engine got the export data (a later reference sends the token only)
    keep: Any = None  # what the transport holds while the export lives (shm: the storage and a dup of its fd)
    checked: int = -1  # the push serial that last found it alive (`_export_alive`)


@dataclass
class RefSet:
    """A chunk's references for one engine, as last sent: reused while the same tensors sit at the same
    addresses and every export it names is alive; the engine caches it by `id` once it acknowledged it."""

    id: str
    refs: list[list[Any]]
    exports: list[tuple[int, Export]]  # (storage address, export)
    known: bool = False
    gen: int = -1  # the sender's export generation when every export it names was last seen alive


@dataclass(frozen=True)
class Compact:
    """A chunk's packed part when some of its tensors go by reference: its own layout, sent in place of the
    plan's, and which of the plan's tensors it holds."""

    layout: Layout
    layout_json: dict
    layout_key: str
    packed: tuple[int, ...]  # indices into the plan's specs
    refs: tuple[int, ...]


class RefSender:
    """The sending half's reference machinery (module doc). A transport calls `_init_refs` in its constructor,
    implements `_ref_export`, fills `_persistent` before a push (the storage addresses that may go by
    reference), and calls `_ref_compact`, `_refs`, `_sent`, `_forget_engine`, `_end_push_refs` and
    `_drop_all_exports` where its own push steps are."""

    name: str

    def _init_refs(self, one_copy: bool, ref_bytes: int | None) -> None:
        self.one_copy = one_copy
        self.ref_bytes = int(ref_bytes) if ref_bytes is not None else None
        #: tensors sent by reference and packed, since construction (for benchmarks and tests)
        self.ref_stats: dict[str, float] = {"referenced": 0, "packed": 0, "exports": 0, "export_ms": 0.0}
        self._persistent: set[int] = set()  # storage addresses of the source's own tensors (this push)
        self._exports: dict[tuple[int, int], Export] = {}  # (engine, storage address) -> export
        self._push_serial = 0
        self._push_ok = True
        self._export_gen = 0  # bumped whenever exports are dropped: a reference set checked since is alive
        self._compact: dict[tuple[str, tuple[bool, ...]], Compact] = {}
        self._refsets: dict[tuple[int, str, tuple], RefSet] = {}  # (engine, layout key, addresses) -> refs
        self._masks: dict[str, tuple[Sequence[torch.Tensor], int, tuple[bool, ...]]] = {}  # see _ref_compact
        self._refs_fast: dict[tuple[int, str], tuple[Sequence[torch.Tensor], RefSet, tuple]] = {}  # see _refs

    def _ref_export(self, t: torch.Tensor) -> tuple[dict[str, Any], Any]:
        """Export the whole storage `t` lies on, for one engine: (plain export data, what to hold while the
        export lives)."""
        raise NotImplementedError

    def _export_alive(self, ex: Export, addr: int) -> bool:
        """Whether export `ex`, made for the storage at `addr`, still names what lies there (checked once per
        push per export before it is used again)."""
        return True

    @property
    def ref_chunk_bytes(self) -> int | None:
        """The per-chunk budget of referenced bytes (`plan_chunks`), None when nothing goes by reference or
        referenced tensors fill the chunk budget like packed ones. A referenced tensor costs the sender no
        memory; chunks of them are few and large, since each costs host work on both sides (an update call,
        its handle, its events)."""
        return self.ref_bytes if self.one_copy else None

    def _ref_compact(self, chunk: ChunkPlan, tensors: Sequence[torch.Tensor], dev: torch.device) -> Compact | None:
        """The chunk's packed part, or None when every tensor is packed: tensors on `dev` that are plain views
        of the source's own storages (`_persistent`) in the plan's dtype go by reference."""
        last = self._masks.get(chunk.layout_key)
        if last is not None and last[0] is tensors and last[1] == self._push_serial - 1:
            mask = last[2]  # the source's cached views of the last push, their storages unchanged since
        else:
            mask = tuple(t.device == dev and t.dtype == s.dtype and t.numel() > 0
                         and storage_address(t) in self._persistent and all(st >= 0 for st in t.stride())
                         for s, t in zip(chunk.specs, tensors, strict=True))
        if len(self._masks) > 4096:
            self._masks.clear()
        self._masks[chunk.layout_key] = (tensors, self._push_serial, mask)
        if not any(mask):
            self.ref_stats["packed"] += len(mask)
            return None
        compact = self._compact.get((chunk.layout_key, mask))
        if compact is None:
            if len(self._compact) > 4096:
                self._compact.clear()
            specs = [s for s, m in zip(chunk.specs, mask, strict=True) if not m]
            layout = plan_layout(specs)
            js = layout.to_json()
            compact = self._compact[(chunk.layout_key, mask)] = Compact(
                layout, js, layout_key(js), tuple(i for i, m in enumerate(mask) if not m),
                tuple(i for i, m in enumerate(mask) if m))
        self.ref_stats["referenced"] += len(compact.refs)
        self.ref_stats["packed"] += len(compact.packed)
        return compact

    def _cached_refset(self, buf: SendBuffer, engine: int) -> tuple[RefSet | None, tuple]:
        """The chunk's reference set for `engine` if one made before is still valid (its tensors at the same
        addresses, every export it names alive), else None; and the set's cache key."""
        compact: Compact = buf.state["compact"]
        plan: ChunkPlan = buf.state["plan"]
        tensors: Sequence[torch.Tensor] = buf.state["tensors"]

        def alive(rs: RefSet | None) -> bool:
            if rs is None:
                return False
            if rs.gen != self._export_gen:  # exports were dropped since: are this set's still there?
                if not all(self._exports.get((engine, a)) is ex for a, ex in rs.exports):
                    return False
                rs.gen = self._export_gen
            return all(self._valid(engine, a, ex) for a, ex in rs.exports)

        fast = self._refs_fast.get((engine, plan.layout_key))
        if fast is not None and fast[0] is tensors and alive(fast[1]):  # a source's cached views: same addresses
            return fast[1], fast[2]
        key = (engine, plan.layout_key, tuple((tensors[i].data_ptr(), tensors[i].stride()) for i in compact.refs))
        rs = self._refsets.get(key)
        return (rs if alive(rs) else None), key

    def _valid(self, engine: int, addr: int, ex: Export) -> bool:
        """`ex` is still the export of the storage at `addr`; a stale one is dropped (a new one is made)."""
        if ex.checked == self._push_serial:
            return True
        if not self._export_alive(ex, addr):
            if self._exports.get((engine, addr)) is ex:
                del self._exports[(engine, addr)]
                self._export_gen += 1
            return False
        ex.checked = self._push_serial
        return True

    def _export(self, engine: int, addr: int, t: torch.Tensor) -> Export:
        """The export of the storage at `addr` (which `t` lies on) to `engine`, made if there is none."""
        ex = self._exports.get((engine, addr))
        if ex is not None and not self._valid(engine, addr, ex):
            ex = None
        if ex is None:
            t0 = time.perf_counter()
            data, keep = self._ref_export(t)
            ex = self._exports[(engine, addr)] = Export(secrets.token_hex(8), data, self._push_serial, keep=keep,
                                                         checked=self._push_serial)
            self.ref_stats["exports"] += 1
            self.ref_stats["export_ms"] += (time.perf_counter() - t0) * 1e3
        return ex

    async def _export_ahead(self, buf: SendBuffer, engines: int, slice_s: float = 3e-4) -> None:
        """Make the exports `buf`'s references need, handing the event loop back every `slice_s` seconds. A
        first push exports hundreds of storages (25-50 us each) while the chunk before it is in flight, and
        the engines' replies to that chunk (which the next update waits for) must not queue behind it: on
        one H200 a reply waited 3-5 ms for a chunk's exports before this."""
        compact: Compact = buf.state["compact"]
        tensors: Sequence[torch.Tensor] = buf.state["tensors"]
        looked = buf.state.setdefault("looked_up", {})
        for engine in range(engines):
            looked[engine] = self._cached_refset(buf, engine)  # `_refs` takes it from here: one lookup per chunk
            if looked[engine][0] is not None:
                continue
            t_last = time.perf_counter()
            for i in compact.refs:
                t = tensors[i]
                addr = storage_address(t)
                ex = self._exports.get((engine, addr))
                if ex is None or not self._valid(engine, addr, ex):
                    self._export(engine, addr, t)
                    if time.perf_counter() - t_last > slice_s:
                        await anyio.sleep(0)
                        t_last = time.perf_counter()

    def _refs(self, buf: SendBuffer, engine: int) -> dict[str, Any]:
        """The handle fields naming `buf`'s referenced tensors for engine `engine`: the references (and the
        exports it has not had yet), or only their id when the engine has them from an earlier push."""
        compact: Compact = buf.state["compact"]
        plan: ChunkPlan = buf.state["plan"]
        tensors: Sequence[torch.Tensor] = buf.state["tensors"]
        looked = buf.state.get("looked_up", {}).pop(engine, None)  # by `_export_ahead`, this chunk
        rs, key = looked if looked is not None else self._cached_refset(buf, engine)
        if rs is not None:
            for _, ex in rs.exports:
                ex.used = self._push_serial
        else:
            refs: list[list[Any]] = []
            exports: list[tuple[int, Export]] = []
            for i in compact.refs:
                t = tensors[i]
                spec = plan.specs[i]
                addr = storage_address(t)
                ex = self._export(engine, addr, t)
                ex.used = self._push_serial
                exports.append((addr, ex))
                ref = [spec.name, dtype_name(spec.dtype), list(spec.shape), ex.token,
                       t.storage_offset() * t.element_size(), list(t.shape), list(t.stride())]
                if spec.part is not None:
                    ref.append(list(spec.part))
                refs.append(ref)
            if len(self._refsets) > 4096:
                self._refsets.clear()
            rs = self._refsets[key] = RefSet(secrets.token_hex(8), refs, exports)
        if len(self._refs_fast) > 4096:
            self._refs_fast.clear()
        self._refs_fast[(engine, plan.layout_key)] = (tensors, rs, key)
        buf.state.setdefault("refsets", {})[engine] = rs
        if rs.known:
            return {"refs_id": rs.id}
        new = {ex.token: ex.ipc for _, ex in rs.exports if not ex.sent}
        return {"refs_id": rs.id, "refs": rs.refs, **({"storages": new} if new else {})}

    def _ref_info(self, buf: SendBuffer, update_info: dict[str, Any], handle: dict[str, Any],
                  engine: int) -> dict[str, Any]:
        """`update_info` for engine `engine` with `handle` and, where the chunk has references, their fields in
        the handle and the packed part's own layout in place of the plan's."""
        compact: Compact | None = buf.state.get("compact")
        if compact is None:
            return {**update_info, "handle": handle}
        ready = buf.state.get("refs_ready", {}).pop(engine, None)  # made when the chunk was packed
        handle = {**handle, **(ready if ready is not None else self._refs(buf, engine))}
        return {**update_info, "handle": handle, "layout": compact.layout_json, "layout_key": compact.layout_key}

    def _sent(self, buf: SendBuffer, engine: int) -> None:
        """Engine `engine` acknowledged a chunk: it holds every export and the reference set it carried."""
        rs: RefSet | None = buf.state.get("refsets", {}).get(engine)
        if rs is not None:
            rs.known = True
            for _, ex in rs.exports:
                ex.sent = True

    def push_succeeded(self) -> None:
        """Every engine acknowledged every chunk of this push (called before `end_push`)."""
        self._push_ok = True

    def _forget_engine(self, index: int) -> None:
        """A (re)connected engine maps nothing yet: every storage is exported to it afresh."""
        self._export_gen += 1
        self._exports = {k: v for k, v in self._exports.items() if k[0] != index}
        self._refsets = {k: v for k, v in self._refsets.items() if k[0] != index}

    def _end_push_refs(self) -> None:
        """Receivers drop the storages a round did not reference (`RefReceiver._end_round_refs`); so does the
        sender, after a success. After a failure it cannot tell what each receiver mapped: export afresh."""
        if self._push_ok:
            kept = {k: v for k, v in self._exports.items() if v.used == self._push_serial}
            if len(kept) != len(self._exports):
                self._export_gen += 1
                self._exports = kept
                self._refsets = {k: v for k, v in self._refsets.items()
                                 if all(ex.used == self._push_serial for _, ex in v.exports)}
        else:
            self._drop_all_exports()

    def _drop_all_exports(self) -> None:
        self._export_gen += 1
        self._exports.clear()
        self._refsets.clear()


# ---------------------------------------------------------------------------------------------- receiver


@dataclass
class MappedStorage:
    """A trainer storage mapped for references, and the views built on it (keyed by their reference)."""

    tensor: torch.Tensor
    raw: dict[str, Any]
    views: dict[tuple, tuple[TensorMeta, torch.Tensor]] = field(default_factory=dict)
    typed: dict[torch.dtype, torch.Tensor | None] = field(default_factory=dict)  # see RefReceiver._ref_view


def _ints(v: object, what: str, n: int | None = None, kind: str = "cuda_ipc") -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > 8 or (n is not None and len(v) != n) or not all(
            type(x) is int and 0 <= x < _MAX_INT for x in v):
        raise ValidationError(f"{kind} reference {what} must be a list of non-negative ints, got {v!r:.80}")
    return tuple(v)


class RefReceiver:
    """The receiving half's reference machinery (module doc). A receiver sets up `_storages` (token -> mapped
    storage), `_round` (tokens this round referenced), `_refsets` (reference set id -> (its views, the
    storage tokens they lie on)) and `timing["map_storages"]` in its constructor, implements `_ref_map`, and
    calls `_end_round_refs` from `end_round`."""

    name: str
    _storages: dict[str, MappedStorage]
    _round: set[str]
    _refsets: dict[str, tuple[list[tuple[TensorMeta, torch.Tensor]], frozenset[str]]]
    timing: dict[str, float]

    def _ref_map(self, token: str, raw: dict[str, Any]) -> torch.Tensor:
        """Map the trainer storage an export names, after validating its data: a flat uint8 tensor over it."""
        raise NotImplementedError

    def _storage(self, token: str, exports: dict[str, Any]) -> MappedStorage:
        st = self._storages.get(token)
        raw = exports.get(token)
        if st is not None:
            if raw is not None and raw != st.raw:
                raise ValidationError(f"{self.name} storage {token} changed its export data")
            return st
        if raw is None:
            raise ValidationError(f"{self.name} reference to storage {token!r:.40}, which this receiver has not "
                                  "mapped and the update does not export")
        t0 = time.perf_counter()
        st = self._storages[token] = MappedStorage(self._ref_map(token, raw), dict(raw))
        self.timing["map_storages"] += time.perf_counter() - t0
        return st

    def ref_views(self, update_info: dict[str, Any]) -> list[tuple[TensorMeta, torch.Tensor]]:
        """The chunk's tensors sent by reference: views on mapped trainer storages, each with its metadata
        (HF name, dtype, shape, part). A view is in the HF shape, or in the sender's *blocked* shape where the
        strides allow no HF-shaped view (Q of an interleaved QKV): same row-major order (see `pack.fits`)."""
        h = update_info.get("handle")
        if not isinstance(h, dict) or ("refs" not in h and "refs_id" not in h):
            return []
        kind = self.name
        rid = h.get("refs_id")
        if rid is not None and (not isinstance(rid, str) or not _TOKEN.match(rid)):
            raise ValidationError(f"{kind} handle refs_id must be a hex token, got {rid!r:.80}")
        refs = h.get("refs")
        if refs is None:
            known = self._refsets.get(rid) if rid is not None else None
            if known is None:
                raise ValidationError(f"{kind} reference set {rid!r:.40} is not known here and the update does "
                                      "not carry it")
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
            self._round.add(token)
            key = tuple(tuple(x) if isinstance(x, list) else x for x in ref)
            hit = st.views.get(key)
            if hit is None:
                hit = st.views[key] = self._ref_view(ref, st.tensor, kind, st.typed)
            out.append(hit)
        if rid is not None:
            if len(self._refsets) > 4096:
                self._refsets.clear()
            self._refsets[rid] = (out, frozenset(r[3] for r in refs))
        return out

    @staticmethod
    def _ref_view(ref: list[Any], storage: torch.Tensor, kind: str = "cuda_ipc",
                  typed: dict[torch.dtype, torch.Tensor | None] | None = None) -> tuple[TensorMeta, torch.Tensor]:
        """The view a reference names on `storage` (flat uint8), after checking it lies inside. `typed`: a cache
        of the storage viewed as each dtype, so that a view is one `as_strided` (a first push builds hundreds,
        an MoE's thousands: ~21 us each on the GPU host with three ops and the generic checks)."""
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
        # reshape (receiver/state.py). Never a failed `view` to find out: each raised error costs ~0.15 ms.
        if shape != hf_shape and view.is_contiguous():
            view = view.view(hf_shape)
        return meta, view

    def _end_round_refs(self) -> None:
        """Trainer storages this round did not reference are unmapped (the sender frees or reuses them once
        we let go)."""
        gone = {t for t in self._storages if t not in self._round}
        for token in gone:
            del self._storages[token]
        if gone:
            self._refsets = {k: v for k, v in self._refsets.items() if not v[1] & gone}
        self._round = set()

    @property
    def storages(self) -> int:
        """Trainer storages this receiver holds mapped for references."""
        return len(self._storages)
