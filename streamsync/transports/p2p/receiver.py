"""The p2p receiving half, inside an engine worker (package doc)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ...delta.codec import HEADER, Row, parse_header
from ...errors import TransportError, ValidationError
from ...pack import Layout, TensorSpec, dtype_from_name, plan_layout, unpack
from ...plan.shards import Box
from ..base import Abandons, Receiver
from ..collective.group import CLOSE_TIMEOUT, GroupInit, P2PHandle, dispose, join_group
from ..cuda_ipc.driver import map_storage
from .ipc import MSG_BYTES, colocated, decode_ref, gpu_of, publish_gpu, read_gpus

if TYPE_CHECKING:
    from ...receiver.base_copy import BaseCopy


class P2pReceiver(Receiver, Abandons):
    """Joins the p2p group at construction as rank `rank_offset` + this worker's rank in its engine
    (`init_info["worker_rank"]`, else its rank in its engine's default torch.distributed group, as vLLM
    numbers its workers; 0 in an engine of one worker).

    Per update: one receive per sending trainer rank (each with the group timeout), then each piece is
    copied into its box of the bucket's whole tensors (a buffer of the update's layout, reused). Only the
    tensors this worker received part of are handed to the loader.

    A sharded delta (docs/delta.md): from each sending rank a header first (`delta.codec.parse_header`: each
    piece's encoding, count and digest), then its pieces' encodings, whose size the header gives; each piece is
    applied onto this worker's kept box of it (`delta_views`)."""

    name: ClassVar[str] = "p2p"

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cpu") -> None:
        super().__init__(init_info, device)
        init = GroupInit.parse(init_info, "p2p")
        if init.backend == "nccl" and self.device.type != "cuda":
            raise ValidationError(f"the nccl backend needs a CUDA receiver, got device {self.device}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.init, self.group, self.trainer_ranks, self.worker = init, init.group, init.trainer_ranks, init.worker()
        rank = self.rank = init.rank()
        self.world_size, self.backend, self.timeout = init.world_size, init.backend, init.timeout_s
        # gloo sends and receives host memory (it hands the tensor's pointer to its TCP transport): a CUDA worker
        # receives into host buffers, and its loader copies from them
        self._at = self.device if init.backend == "nccl" else torch.device("cpu")
        self.close_timeout = CLOSE_TIMEOUT
        gpu = gpu_of(self.device) if init.backend == "gloo" else ""
        self._ipc_srcs: set[int] = set()  # trainer ranks on this worker's GPU: they send references (module ipc)
        self._mapped: dict[str, torch.Tensor] = {}  # their buffers, mapped
        self._answer: tuple[list[int], int] = ([], 0)  # (ranks whose buffers this chunk reads, its sequence)
        self._pg, store = join_group(init, rank, self.device, self.close_timeout,
                                     on_store=lambda st: publish_gpu(st, self.group, rank, gpu))
        if gpu:
            try:
                gpus = read_gpus(store, self.group, range(self.trainer_ranks))
            except RuntimeError as e:
                dispose(self._pg).join(self.close_timeout)
                raise TransportError(f"p2p group {self.group}: the trainer ranks' GPUs were not published: {e}") from e
            self._ipc_srcs = {r for r, g in gpus.items() if colocated(gpu, g)}
        self._store = store
        self._seq = 0
        self._staging: torch.Tensor | None = None
        self._recv: dict[int, torch.Tensor] = {}  # sending rank -> its receive buffer (grown as needed)
        self._pending: list[tuple[int, int, list[Any]]] = []
        #: a delta's per sending rank: its header's rows and where each piece's encodings sit in its buffer
        self._rows: dict[int, tuple[list[Row], Layout]] = {}
        self.received_bytes = 0

    def _buffer(self, current: torch.Tensor | None, nbytes: int, device: torch.device | None = None) -> torch.Tensor:
        device = device or self._at
        if current is None or current.numel() < nbytes or current.device != device:
            current = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return current

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> Iterator[torch.Tensor]:
        """Receive every segment of this worker's part of the chunk; yield the buffer `views` assembles the
        chunk's whole tensors in (`nbytes`: the size of their layout)."""
        h = P2PHandle.parse(update_info.get("handle"), self.group, self._seq)
        seq = h.seq
        if self._pg is None:
            raise TransportError("p2p receiver is closed")
        if nbytes is None or not 0 <= nbytes < 1 << 45:
            raise ValidationError(f"p2p open needs the chunk's layout size, got {nbytes!r:.40}")
        segments = h.segments(self.worker, self.trainer_ranks)
        self._seq += 1
        d = update_info.get("delta")
        self._rows = {}
        if isinstance(d, dict) and d.get("sharded") and "base" in d:
            # A delta: each rank's header first, then as many bytes of encodings as its header says.
            heads = {src: torch.empty(len(pieces) * HEADER, dtype=torch.int64, device=self._at)
                     for src, _, pieces in segments}
            self._receive([(src, heads[src].view(torch.uint8)) for src, _, _ in segments], seq)
            sizes = []
            for src, _, pieces in segments:
                rows = parse_header(heads[src].cpu(), [_numel(p) for p in pieces])
                lay = plan_layout(TensorSpec("", dt, (n,)) for r in rows for _, dt, n in r.pieces())
                self._rows[src] = (rows, lay)
                sizes.append((src, lay.metas[-1].offset + lay.metas[-1].nbytes if lay.metas else 0))
        else:
            sizes = [(src, size) for src, size, _ in segments]
        ipc = not self._rows and bool(self._ipc_srcs)  # a delta's messages go over the wire (module ipc)
        bufs, refs = [], []
        for src, size in sizes:
            if size and ipc and src in self._ipc_srcs:
                refs.append((src, size))
            elif size:
                buf = self._recv[src] = self._buffer(self._recv.get(src), size)
                bufs.append((src, buf[:size]))
        ok = False
        try:
            self._receive(bufs, seq, refs)
            self._pending = [(src, size, pieces) for (src, size), (_, _, pieces) in zip(sizes, segments, strict=True)]
            # pieces read on the GPU are assembled there (a colocated worker holds one bucket's whole tensors)
            self._staging = self._buffer(self._staging, max(nbytes, 1), self.device if refs else None)
            yield self._staging[:nbytes]
            ok = True
        finally:
            try:
                self._release()
            except TransportError:
                if ok:  # else the failure already on its way says more
                    raise

    def _receive(self, bufs: list[tuple[int, torch.Tensor]], seq: int,
                 refs: list[tuple[int, int]] | None = None) -> None:
        """One receive per (sending rank, buffer), all posted, then each waited for within the timeout. A rank on
        this worker's GPU (`refs`: rank, bytes) sends a reference instead: its segment is read straight out of
        its mapped buffer, and the rank is answered once the pieces are copied in (`_release`; module ipc)."""
        msgs = {src: torch.empty(MSG_BYTES, dtype=torch.uint8) for src, _ in refs or ()}
        works = [(src, self._pg.recv([buf], src, seq)) for src, buf in [*bufs, *msgs.items()]]
        self._answer = (list(msgs), seq)
        for src, w in works:
            self._wait(w, src, seq)
        for src, size in refs or ():
            export, at, n = decode_ref(msgs[src], src)
            if n != size:
                raise ValidationError(f"p2p IPC reference from trainer rank {src}: {n} bytes, the chunk's segment "
                                      f"has {size}")
            key = f"{export.get('handle')}@{export.get('offset')}+{export.get('size')}"
            mapped = self._mapped.get(key)
            if mapped is None:  # kept: a rank reuses its buffers push after push (unmapping syncs the GPU)
                if len(self._mapped) >= 16:
                    self._mapped.clear()
                mapped = self._mapped[key] = map_storage(export, self.device.index or 0, f"trainer rank {src}")
            if at + n > mapped.numel():
                raise ValidationError(f"p2p IPC reference from trainer rank {src} overruns its buffer")
            self._recv[src] = mapped[at:at + n]

    def _release(self) -> None:
        """Answer the ranks whose buffers this chunk read, once every copy out of them is done: they may then
        reuse the buffers (module ipc). Also on a failure, so that no rank waits for the group timeout."""
        srcs, seq = self._answer
        if not srcs:
            return
        self._answer = ([], 0)
        for src in srcs:
            self._recv.pop(src, None)
        torch.cuda.current_stream(self.device).synchronize()
        done = torch.ones(1, dtype=torch.uint8)
        if self._pg is not None:
            for src, w in [(src, self._pg.send([done], src, seq)) for src in srcs]:
                self._wait(w, src, seq)

    def _wait(self, work: Any, src: int, seq: int) -> None:
        try:
            work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as e:
            raise TransportError(f"worker {self.worker}: nothing from trainer rank {src} for chunk {seq} within "
                                 f"{self.timeout:.1f}s (dead or frozen?): {e}") from e

    def views(self, buf: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
        """Copy each received piece into its box of its whole tensor in `buf` (laid out as `layout`), each
        checked first; return the tensors this worker received part of (the rest of `buf` was not written)."""
        return self._copy_in(buf, layout, self._pieces(layout))

    def _copy_in(self, buf: torch.Tensor, layout: Layout, copies: list[tuple[Any, torch.dtype, Box, Any]]
                 ) -> list[tuple[str, torch.Tensor]]:
        names = set()
        for meta, dtype, box, src_bytes in copies:
            _box_of(buf, meta, dtype, box).copy_(src_bytes.view(dtype).view(box.size))
            names.add(meta.name)
            self.received_bytes += src_bytes.numel()
        self._pending = []
        self._release()
        return [(n, t) for n, t in unpack(buf, layout) if n in names]

    def _pieces(self, layout: Layout, *, delta: bool = False) -> list[tuple[Any, torch.dtype, Box, Any]]:
        """Each received piece checked against the update's layout: (its tensor's meta, dtype, box, and its
        bytes, or with `delta` its header row and encodings by piece name)."""
        metas = {m.name: m for m in layout.metas}
        out: list[tuple[Any, torch.dtype, Box, Any]] = []
        for src, size, pieces in self._pending:
            rows, lay = self._rows.get(src, ([], None))
            at = 0  # the next encoding in `lay`
            for i, piece in enumerate(pieces):
                if not (isinstance(piece, list) and len(piece) == 3 and isinstance(piece[0], str)
                        and type(piece[2]) is int):
                    raise ValidationError(f"p2p piece must be [name, box, offset], got {piece!r:.120}")
                name, box_js, off = piece
                meta = metas.get(name)
                if meta is None:
                    raise ValidationError(f"p2p piece of {name!r}, which the update's layout does not hold")
                box = Box.from_json(box_js)
                if not box.within(meta.shape):
                    raise ValidationError(f"p2p piece {box} of {name!r} lies outside its shape {list(meta.shape)}")
                dtype = dtype_from_name(meta.dtype)
                if delta:
                    row = rows[i]
                    if row.itemsize != dtype.itemsize:
                        raise ValidationError(f"delta header: piece {box} of {name!r} has {row.itemsize}-byte "
                                              f"elements, the layout says {meta.dtype}")
                    assert lay is not None  # `open` read this rank's header
                    enc: dict[str, torch.Tensor] = {}
                    for p, dt, _ in row.pieces():
                        m = lay.metas[at]
                        raw = self._recv[src][m.offset:m.offset + m.nbytes].view(dt)
                        enc[p] = raw.view(dtype) if p == "val" else raw
                        at += 1
                    out.append((meta, dtype, box, (row, enc)))
                    continue
                n = box.numel * dtype.itemsize
                if off < 0 or off + n > size:
                    raise ValidationError(f"p2p piece {box} of {name!r} at byte {off} overruns its segment of "
                                          f"{size} bytes from trainer rank {src}")
                out.append((meta, dtype, box, self._recv[src][off:off + n]))
        return out

    def delta_views(self, buf: torch.Tensor, layout: Layout, base: BaseCopy,
                    delta: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """`views` for a sender that pushes deltas: a full push's pieces are also kept in `base`; a delta's are
        applied onto the boxes kept there (every piece checked, and its base found, before any is written) and
        copied into their boxes of the bucket's whole tensors."""
        if "base" not in delta:
            copies = self._pieces(layout)
            for meta, dtype, box, src_bytes in copies:
                base.keep_box(meta.name, box, src_bytes.view(dtype).view(box.size))
            return self._copy_in(buf, layout, copies)
        pieces = self._pieces(layout, delta=True)
        bases = [base.check_box(meta.name, box, dtype) for meta, dtype, box, _ in pieces]
        names = set()
        for (meta, dtype, box, (row, enc)), have in zip(pieces, bases, strict=True):
            got = base.patch_box(meta.name, box, have, row, enc)
            _box_of(buf, meta, dtype, box).copy_(got)
            names.add(meta.name)
            self.received_bytes += sum(t.numel() * t.element_size() for t in enc.values())
        self._pending = []
        return [(n, t) for n, t in unpack(buf, layout) if n in names]

    def abandon(self) -> None:
        """The round failed: leave the group, so trainer ranks still sending this round fail at once (the
        trainer makes the group anew before its next push, and this worker joins it then)."""
        self.close()

    def stats(self) -> dict[str, float]:
        return {"p2p_received_bytes": float(self.received_bytes)}

    def close(self) -> None:
        pg, store = self._pg, self._store
        self._pg = self._store = None
        if pg is not None or store is not None:
            dispose(pg, store).join(self.close_timeout)
            del pg, store
        self._staging = None
        self._recv = {}
        self._mapped = {}


def _numel(piece: Any) -> int:
    """Elements of a piece as the handle lists it ([name, box, offset]); checked again by `_pieces`."""
    try:
        return Box.from_json(piece[1]).numel
    except (TypeError, ValueError, IndexError, KeyError) as e:
        raise ValidationError(f"p2p piece must be [name, box, offset], got {piece!r:.120}") from e


def _box_of(buf: torch.Tensor, meta: Any, dtype: torch.dtype, box: Box) -> torch.Tensor:
    """`box` of the tensor `meta` places in `buf`."""
    return box.view(buf[meta.offset: meta.offset + meta.nbytes].view(dtype).view(meta.shape))
