"""`WeightReceiver`: the receiving state machine (init, start, update per chunk, finish or abort).

It turns an `update_info` (plain data: layout + transport handle) into (name, tensor) views and hands them to
a `Loader` (the vLLM model protocol `load_weights`, or `ModuleLoader`, which copies into a plain module's
parameters). It closes the chunk's handle before returning, so returning from the update call is the
acknowledgement the sender waits for.

Tensors larger than the sender's chunk budget arrive as row parts in consecutive chunks; the receiver copies
each part into a staging tensor and hands the loader the whole tensor once its last row arrived (so every
receiver, vLLM's included, loads whole tensors, bit for bit what the sender holds).

Delta pushes (docs/delta.md): chunks marked `delta` are applied onto `base`, the receiver's copy of what it
last loaded (`BaseCopy`), and the loader gets the whole tensors they make, so deltas load through the same
loader as full pushes; where the loader holds a tensor as sent (`Loader.direct`), its own tensor is the base and
the delta is decoded into it in place.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import BoundedCache
from ..errors import ValidationError
from ..log import get_logger
from ..pack import Layout, TensorMeta
from ..transports.base import Abandons, Receiver, make_receiver
from . import kernels
from .base_copy import BaseCopy, parse_delta
from .loaders import FunctionLoader, Loader, Weights


class UnknownLayout(ValidationError):
    """An update named its layout by key only, and this receiver has not seen (or no longer keeps) that key.
    Clients that strip known layouts resend the update with its layout."""


class RoundOwned(ValidationError):
    """A call of one WeightSync met a round another WeightSync has open on this receiver."""


@dataclass
class _Staged:
    tensor: torch.Tensor
    rows: int = 0  # rows filled so far


@dataclass
class ReceiverStats:
    """What a receiver did since it started (reported by its status): loads replayed from captured graphs,
    graphs captured, and host seconds in `update` by part: the transport's open (mapping a buffer), the
    references (mapping trainer storages, building views), the load, and closing the buffer (the ack)."""

    replayed: int = 0
    captured: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: {"open": 0.0, "refs": 0.0, "load": 0.0, "close": 0.0})


class WeightReceiver:
    """Four-phase receiving state machine: init -> (start -> update* -> finish)*.

    `version` is the last version finished; it only moves in `finish`. A round that failed half-way leaves
    `dirty` True (its weights are partly new) until the next finished round: `clean_version` is then None.

    Ownership: `start(owner=...)` ties the round to one WeightSync; updates, finish and abort that carry
    another owner are refused (RoundOwned), and so is another owner's `start` or `init` while the round is
    open, so two syncs never mix their models under one version. A round nobody touched for longer than
    the `stale_after` seconds its owner declared (its own timeout: that owner's push has failed by then)
    is abandoned and may be taken over, so a crashed trainer never locks a receiver.

    capture: replay a repeated chunk's load as a captured CUDA graph where the loader allows it (`_load`);
    False loads tensor by tensor every push, as vLLM's reload does. kernel_copies: record the loader's
    `prepare_load` (one segment copy kernel) in captures where Triton runs here; False records its copies.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.transport: Receiver | None = None
        self.version: int | None = None
        self.updating = False
        self.dirty = False
        self.chunks = 0
        self.bytes = 0
        self.capture = True
        self.kernel_copies = True
        self.stats = ReceiverStats()
        self._layouts: BoundedCache[str, Layout] = BoundedCache(4096)  # layout key -> its validated layout
        self._staged: dict[str, _Staged] = {}  # tensors split across chunks, being reassembled
        # (layout, buffer address, reference set, loader, kernel) -> the chunk's load captured as a CUDA graph, or
        # False after its first sighting, True where it cannot be captured (see `_load`)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph | bool] = {}
        self._capture_stream: torch.cuda.Stream | None = None
        self._keep: dict[tuple, Any] = {}  # graph key -> what its captured copies read (a tile table)
        self._rounds = 0  # rounds finished
        self._graph_used: dict[tuple, int] = {}  # graph key -> the round that last loaded it (see `finish`)
        # layout -> (packed views, reference views, loader takes blocked, joined views, joined metas, any part):
        # a chunk whose views and references are the same objects as last time joins nothing again
        self._joined: BoundedCache[Layout, tuple[Any, Any, bool, list, tuple, bool]] = BoundedCache(256)
        self._parts: BoundedCache[Layout, bool] = BoundedCache(4096)  # layout -> holds parts of a split tensor?
        self.owner: str | None = None
        self.stale_after: float | None = None
        self._touched = 0.0
        #: what deltas apply onto (kept only for senders that push deltas)
        self.base = BaseCopy(self.device)
        self._round_transport: Receiver | None = None  # the transport the open round receives through
        #: the update being loaded, where its loader gets the packed views then the references as they came:
        #: (packed tensors, referenced tensors); None otherwise (a delta, parts)
        self.joined_split: tuple[int, int] | None = None

    @property
    def clean_version(self) -> int | None:
        """The version held whole: None from a round's first applied chunk until a round finishes."""
        return None if self.dirty else self.version

    @property
    def idle_s(self) -> float:
        """Seconds since the open round's owner was last heard from."""
        return time.monotonic() - self._touched

    def _owned_by_other(self, owner: str | None) -> bool:
        """An open, fresh round of another owner (a round opened without an owner is anyone's)."""
        if not self.updating or self.owner is None or owner == self.owner:
            return False
        stale = self.stale_after is not None and time.monotonic() - self._touched > self.stale_after
        return not stale

    def _check_owner(self, owner: str | None, what: str) -> None:
        if owner is not None and self.owner is not None and owner != self.owner:
            raise RoundOwned(f"{what} refused: the open round belongs to another WeightSync "
                             f"(owner {self.owner[:8]}, this call's owner {owner[:8]})")
        self._touched = time.monotonic()

    def init(self, init_info: dict[str, Any], owner: str | None = None) -> None:
        if owner is not None and self._owned_by_other(owner):
            raise RoundOwned(f"init refused: a round of another WeightSync (owner {str(self.owner)[:8]}) is open")
        if self.transport is not None:
            self.transport.close()
        self.transport = make_receiver(init_info, self.device)

    def start(self, owner: str | None = None, stale_after: float | None = None) -> None:
        if self._owned_by_other(owner):
            raise RoundOwned(f"start refused: a round of another WeightSync (owner {str(self.owner)[:8]}) is "
                             "open; one receiver takes one sync's pushes at a time")
        if self.updating and self.transport is not None:
            self.transport.end_round()  # the previous round failed half-way: drop what it mapped
        self.updating = True
        self._round_transport = self.transport
        self.owner, self.stale_after = owner, stale_after
        self._touched = time.monotonic()
        self.chunks = self.bytes = 0
        self._staged.clear()
        self.base.begin_round()

    def update(self, update_info: dict[str, Any], load: Loader | Callable[[Weights], Any]) -> int:
        """Receive one chunk and load it (a plain callable is a loader of the vLLM model protocol)."""
        loader = load if isinstance(load, Loader) else FunctionLoader(load)
        if not self.updating:
            raise ValidationError("update outside a round: call start_update first")
        owner = update_info.get("owner")
        if self.owner is None and self.chunks == 0 and isinstance(owner, str):
            self.owner = owner  # a start that carries no owner (vLLM's): the round's first chunk claims it
        self._check_owner(owner, "update")
        if self.transport is None:
            raise ValidationError("update before init: call init_transfer first")
        layout = self._layout(update_info)
        try:
            delta = parse_delta(update_info)
            opened = self.transport.open(update_info, layout.nbytes)
            t0 = time.perf_counter()
            with opened as buf:  # a refused delta is refused with its bytes received: a collective stays in step
                t1 = time.perf_counter()
                refs = self.transport.ref_views(update_info)
                t2 = time.perf_counter()
                self.base.note(update_info, delta)  # a delta onto another base than the one held: refused here
                self.dirty = True
                if buf.numel() < layout.nbytes:
                    raise ValidationError(f"chunk buffer holds {buf.numel()} bytes, layout needs {layout.nbytes}")
                if delta is not None and delta.get("sharded"):  # the transport keeps, or patches, its boxes
                    self.joined_split = None
                    loader.load(self.transport.delta_views(buf, layout, self.base, delta))
                else:
                    self._load_chunk(loader, buf, layout, refs, delta, update_info)
                t3 = time.perf_counter()
                del buf
        except BaseException:
            if isinstance(self.transport, Abandons):  # this round is lost here: senders still sending fail at once
                self.transport.abandon()
            raise
        t4 = time.perf_counter()
        tm = self.stats.seconds
        tm["open"] += t1 - t0
        tm["refs"] += t2 - t1
        tm["load"] += t3 - t2
        tm["close"] += t4 - t3
        nbytes = layout.nbytes + sum(m.nbytes for m, _ in refs)
        self.chunks += 1
        self.bytes += nbytes
        return nbytes

    def _load_chunk(self, loader: Loader, buf: torch.Tensor, layout: Layout,
                    refs: list[tuple[TensorMeta, torch.Tensor]], delta: dict[str, Any] | None,
                    update_info: dict[str, Any]) -> None:
        views: Iterable[tuple[str, torch.Tensor]] = self.transport.views(buf, layout)  # type: ignore[union-attr]
        views, metas, parts = self._join(layout, views, refs, loader)
        self.joined_split = (len(layout.metas), len(refs)) if delta is None and not parts else None
        if delta is not None and "base" in delta:
            loader.load(self.base.apply(views, delta, direct=loader.direct))
        elif delta is not None:  # a full push of a delta sender: keep what is loaded
            loader.load(self.base.tee(self._assemble(views, metas) if parts else views, loader.direct))
        elif parts:
            loader.load(self._assemble(views, metas))
        else:
            self._load(loader, views, layout, buf, update_info)

    def prime(self, update_info: dict[str, Any]) -> list[tuple[TensorMeta, torch.Tensor]] | None:
        """A chunk's references ahead of its first push (`Primable.prime`): the trainer storages they name mapped,
        their views made and kept by their set's id (the push names them by id only). Nothing is loaded and no
        round is touched. None where a round is open or the transport takes no references."""
        if self.updating or self.transport is None:
            return None
        refs = self.transport.ref_views(update_info, in_round=False)
        return refs or None

    def _join(self, layout: Layout, views: Any, refs: list[tuple[TensorMeta, torch.Tensor]],
              loader: Loader) -> tuple[Any, tuple[TensorMeta, ...], bool]:
        """(views, metas, whether any is a part): the packed views, then the tensors sent by reference (one
        copy), reshaped to their HF shapes for loaders that take no blocked views. Cached per layout while the
        transport hands back the same view and reference lists (an MoE chunk has thousands)."""
        if not refs:
            parts = self._parts.get(layout)
            if parts is None:
                parts = self._parts[layout] = any(m.part is not None for m in layout.metas)
            return views, layout.metas, parts
        blocked = loader.accepts_blocked
        hit = self._joined.get(layout)
        if hit is not None and hit[0] is views and hit[1] is refs and hit[2] == blocked:
            return hit[3], hit[4], hit[5]
        # A blocked view the HF shape cannot view (Q of an interleaved QKV) is reshaped into a copy: a copy of
        # this push's bytes, so a join that made one is never cached (a later push would read the old copy).
        copied = False
        fixed = refs
        if not blocked:
            fixed = []
            for m, t in refs:
                if t.shape != m.shape:
                    r = t.reshape(m.shape)
                    copied = copied or r.data_ptr() != t.data_ptr()
                    t = r
                fixed.append((m, t))
        joined = [*views, *((m.name, t) for m, t in fixed)]
        metas = (*layout.metas, *(m for m, _ in fixed))
        parts = any(m.part is not None for m in metas)
        if isinstance(views, list) and not copied:  # a transport's cached views (a fresh generator never is)
            self._joined[layout] = (views, refs, blocked, joined, metas, parts)
        return joined, metas, parts

    def _load(self, loader: Loader, views: Any, layout: Layout, buf: torch.Tensor, update_info: dict[str, Any]
              ) -> None:
        """`loader.load(views)`, or its captured CUDA graph. A loader whose load is nothing but copies into its
        own parameters says so (`Loader.capturable`: the fused stand-in, ModuleLoader; not vLLM's reload). Its
        copies are captured as one graph, and later pushes of the same chunk from the same addresses (the same
        layout in the same mapped buffer, the same reference set: every view is the same tensor) replay it:
        one launch instead of a Python call and a launch per tensor. The capture is made the second time a chunk
        arrives (the first time its copies run plainly: a one-off never costs a capture, and planning a
        chunk's copies costs about what queueing them does). A graph holds addresses, so it stays right
        whatever those addresses hold when it runs; keys change with them (a new buffer address, a new reference
        set once storages change), and graphs not replayed for a few rounds are dropped."""
        if not self.capture or not buf.is_cuda or not loader.capturable:
            loader.load(views)
            return
        h = update_info.get("handle")
        kernel = self.kernel_copies and kernels.available()
        key = (layout, buf.data_ptr(), h.get("refs_id") if isinstance(h, dict) else None, id(loader), kernel)
        graph = self._graphs.get(key)
        self._graph_used[key] = self._rounds
        stream = torch.cuda.current_stream(buf.device)
        if isinstance(graph, torch.cuda.CUDAGraph):
            graph.replay()
            self.stats.replayed += 1
            return
        if graph is True:  # could not be captured
            loader.load(views)
            return
        if graph is None and len(self._graphs) > 1024:
            self._graphs.clear()
            self._keep.clear()
            self._graph_used = {key: self._rounds}
        if graph is None:  # first sighting: plain copies
            self._graphs[key] = False
            loader.load(views)
            return
        if self._capture_stream is None or self._capture_stream.device != buf.device:
            self._capture_stream = torch.cuda.Stream(buf.device)
        copies = None
        if kernel:  # planned outside the capture (its tile table is an upload)
            try:
                kernels.warm(buf.device)
            except Exception as e:  # no working kernel here (a compile or its check failed): record the copies
                self.kernel_copies = False
                get_logger().warning("receiver: the segment copy kernel is unavailable; captured loads record "
                                     "PyTorch's copies", error=str(e))
            else:
                copies = loader.prepare_load(list(views))
        side = self._capture_stream
        side.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    copies() if copies is not None else loader.load(list(views))
                finally:
                    graph.capture_end()
        except RuntimeError:  # a load this build cannot capture: plain copies for this chunk from now on
            self._graphs[key] = True
            loader.load(views)
            return
        stream.wait_stream(side)
        self._graphs[key] = graph
        if copies is not None:
            # The tile table only: the graph holds addresses, and a kept view would keep a mapped buffer (and the
            # trainer's memory behind it) alive after the transport let it go.
            self._keep[key] = copies.captured()
        self.stats.captured += 1
        graph.replay()  # capturing recorded the copies without running them

    def _layout(self, update_info: dict[str, Any]) -> Layout:
        """Parse and validate a chunk's layout once; later pushes of the same plan send the same key and the
        receiver reuses what it validated (the key only selects, it is never trusted for bounds)."""
        key = update_info.get("layout_key")
        layout = self._layouts.get(key) if isinstance(key, str) else None
        if layout is None:
            if update_info.get("layout") is None and isinstance(key, str):
                raise UnknownLayout(f"layout {key} is not known here: send the update with its layout")
            layout = Layout.from_json(update_info.get("layout"))  # type: ignore[arg-type]
            if isinstance(key, str):
                self._layouts[key] = layout
        return layout

    def _assemble(self, views: Iterable[tuple[str, torch.Tensor]], metas: Iterable[TensorMeta]
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        """What the loader gets: whole tensors as they are; parts copied into their tensor's staging copy, which
        is yielded when its last row arrived. Parts must come in row order (the sender plans them so)."""
        for (name, t), m in zip(views, metas, strict=True):
            if m.part is None:
                yield name, t
                continue
            row0, rows = m.part
            n = m.shape[0]
            if t.shape != m.shape:  # a blocked reference: its rows in HF shape
                t = t.reshape(m.shape)
            staged = self._staged.get(name)
            if staged is None:
                staged = self._staged[name] = _Staged(torch.empty((rows, *t.shape[1:]), dtype=t.dtype,
                                                                  device=t.device))
            if row0 != staged.rows or tuple(staged.tensor.shape) != (rows, *m.shape[1:]):
                raise ValidationError(f"tensor {name!r}: part at row {row0} of {rows} does not continue the "
                                      f"{staged.rows} rows received")
            staged.tensor[row0:row0 + n].copy_(t)
            staged.rows += n
            if staged.rows == rows:
                del self._staged[name]
                yield name, staged.tensor

    def finish(self, version: int | None, owner: str | None = None) -> None:
        """End the round. `version` may be None where the engine keeps its own (vLLM does)."""
        if not self.updating:
            raise ValidationError("finish outside a round: call start_update first")
        self._check_owner(owner, "finish")
        if self._staged:
            # A tensor split across chunks is half-loaded: this round was cut short (vLLM ends an aborted round
            # with finish). End it as an abort: the version stays, and `dirty` too if a chunk was applied.
            self.abort(owner)
            return
        self.updating = False
        self.dirty = False
        self.version = None if version is None else int(version)
        self.base.end_round(finished=True)
        if self.transport is not None:
            self.transport.end_round()
        self._rounds += 1
        self._drop_stale_graphs()

    @property
    def graphs_held(self) -> int:
        """Captured loads this receiver holds."""
        return sum(isinstance(g, torch.cuda.CUDAGraph) for g in self._graphs.values())

    def _drop_stale_graphs(self, rounds: int = 4) -> None:
        """Captured loads no round of the last `rounds` replayed are dropped with their tile tables (~24 bytes per
        64 KiB copied): a sender whose storages or chunking keep changing would otherwise pile them up."""
        stale = [k for k, r in self._graph_used.items() if r < self._rounds - rounds]
        for k in stale:
            del self._graph_used[k]
            self._graphs.pop(k, None)
            self._keep.pop(k, None)

    def abort(self, owner: str | None = None) -> None:
        """End a failed round: the version stays; `dirty` stays True if any chunk was applied."""
        if self.updating:
            self._check_owner(owner, "abort")
        if self.updating and self.transport is not None:
            self.transport.end_round()
            # not one made since (vLLM aborts at the next start)
            if self.transport is self._round_transport and isinstance(self.transport, Abandons):
                self.transport.abandon()
        if self.updating:
            self.base.end_round(finished=False)
        self.updating = False
        self._staged.clear()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
