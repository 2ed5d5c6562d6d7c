"""The p2p receiving half, inside an engine worker (package doc)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar

import torch

from ...errors import TransportError, ValidationError
from ...pack import Layout, dtype_from_name, unpack
from ...plan.shards import Box
from ..base import Receiver
from ..collective.group import BACKENDS, CLOSE_TIMEOUT, broadcast, dispose, make_group
from ..collective.receiver import CollectiveReceiver, _field

_MAX_PIECES = 1 << 20


class P2pReceiver(Receiver):
    """Joins the p2p group at construction as rank `rank_offset` + this worker's rank in its engine
    (`init_info["worker_rank"]`, else its rank in its engine's default torch.distributed group, as vLLM
    numbers its workers; 0 in an engine of one worker).

    Per update: one receive per sending trainer rank (each with the group timeout), then each piece is
    copied into its box of the bucket's whole tensors (a buffer of the update's layout, reused). Only the
    tensors this worker received part of are handed to the loader."""

    name: ClassVar[str] = "p2p"

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cpu") -> None:
        super().__init__(init_info, device)
        import torch.distributed as dist

        backend = init_info.get("backend")
        if backend not in BACKENDS:
            raise ValidationError(f"p2p init_info backend must be one of {BACKENDS}, got {backend!r:.40}")
        if backend == "nccl" and self.device.type != "cuda":
            raise ValidationError(f"the nccl backend needs a CUDA receiver, got device {self.device}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.group = _field(init_info, "group", str)
        world = _field(init_info, "world_size", int, lo=2)
        workers = _field(init_info, "workers", int, lo=1)
        self.trainer_ranks = _field(init_info, "trainer_ranks", int, lo=1)
        self.worker = CollectiveReceiver._worker_rank(init_info, workers)
        rank = _field(init_info, "rank_offset", int, lo=self.trainer_ranks) + self.worker
        if rank >= world:
            raise ValidationError(f"p2p rank {rank} outside a world of {world}")
        addr = _field(init_info, "master_addr", str)
        port = _field(init_info, "master_port", int, lo=1)
        timeout = timedelta(seconds=_field(init_info, "timeout_s", float))
        self.rank, self.world_size, self.backend, self.timeout = rank, world, backend, timeout.total_seconds()
        self.close_timeout = CLOSE_TIMEOUT
        self._pg: Any = None
        self._store: Any = None
        try:
            store = dist.TCPStore(addr, port, world, False, timeout=timeout)
            self._pg = make_group(backend, dist.PrefixStore(self.group, store), rank, world, timeout, addr)
            broadcast(self._pg, torch.zeros(1, dtype=torch.uint8, device=self.device if backend == "nccl" else "cpu"))
        except RuntimeError as e:
            if self._pg is not None:
                dispose(self._pg).join(self.close_timeout)
                self._pg = None
            raise TransportError(f"cannot join p2p group {self.group} as rank {rank}/{world} via {addr}:{port}: "
                                 f"{e}") from e
        self._store = store
        self._seq = 0
        self._staging: torch.Tensor | None = None
        self._recv: dict[int, torch.Tensor] = {}  # sending rank -> its receive buffer (grown as needed)
        self._pending: list[tuple[int, int, list[Any]]] = []
        self.received_bytes = 0

    def _buffer(self, current: torch.Tensor | None, nbytes: int) -> torch.Tensor:
        if current is None or current.numel() < nbytes:
            current = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return current

    def _segments(self, h: dict[str, Any]) -> list[tuple[int, int, list[Any]]]:
        """This worker's receive list: (sending rank, bytes, its pieces unchecked: `views` checks them)."""
        recv = h.get("recv")
        if not isinstance(recv, dict):
            raise ValidationError(f"p2p handle 'recv' must be a dict of worker -> segments, got {recv!r:.120}")
        mine = recv.get(str(self.worker), [])
        if not isinstance(mine, list):
            raise ValidationError(f"p2p handle: worker {self.worker}'s segments must be a list, got {mine!r:.120}")
        out = []
        seen: set[int] = set()
        for seg in mine:
            if not (isinstance(seg, list) and len(seg) == 3 and type(seg[0]) is int and type(seg[1]) is int
                    and isinstance(seg[2], list) and len(seg[2]) <= _MAX_PIECES):
                raise ValidationError(f"p2p segment must be [src rank, nbytes, pieces], got {seg!r:.120}")
            src, nbytes, pieces = seg
            if not 0 <= src < self.trainer_ranks or src in seen:
                raise ValidationError(f"p2p segment from trainer rank {src}: not one of {self.trainer_ranks} "
                                      "ranks, or twice")
            seen.add(src)
            if not 0 < nbytes < 1 << 45:
                raise ValidationError(f"p2p segment from rank {src}: size {nbytes} out of range")
            out.append((src, nbytes, pieces))
        return out

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> Iterator[torch.Tensor]:
        """Receive every segment of this worker's part of the chunk; yield the buffer `views` assembles the
        chunk's whole tensors in (`nbytes`: the size of their layout)."""
        h = update_info.get("handle")
        if not isinstance(h, dict):
            raise ValidationError(f"p2p handle must be {{group, seq, recv}}, got {h!r:.200}")
        if h.get("group") != self.group:
            raise ValidationError(f"chunk is for group {h.get('group')!r:.80}, this receiver joined {self.group!r}")
        seq = h.get("seq")
        if type(seq) is not int or seq != self._seq:
            raise ValidationError(f"p2p chunk sequence {seq!r:.40} out of step (expected {self._seq})")
        if self._pg is None:
            raise TransportError("p2p receiver is closed")
        if nbytes is None or not 0 <= nbytes < 1 << 45:
            raise ValidationError(f"p2p open needs the chunk's layout size, got {nbytes!r:.40}")
        segments = self._segments(h)
        self._seq += 1
        works = []
        for src, size, _ in segments:
            buf = self._recv[src] = self._buffer(self._recv.get(src), size)
            works.append((src, self._pg.recv([buf[:size]], src, seq)))
        for src, w in works:
            try:
                w.wait(timedelta(seconds=self.timeout))
            except RuntimeError as e:
                raise TransportError(f"worker {self.worker}: nothing from trainer rank {src} for chunk {seq} within "
                                     f"{self.timeout:.1f}s (dead or frozen?): {e}") from e
        self._pending = [(src, size, pieces) for src, size, pieces in segments]
        self._staging = self._buffer(self._staging, max(nbytes, 1))
        yield self._staging[:nbytes]

    def views(self, buf: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
        """Copy each received piece into its box of its whole tensor in `buf` (laid out as `layout`), each
        checked first; return the tensors this worker received part of (the rest of `buf` was not written)."""
        metas = {m.name: m for m in layout.metas}
        copies = []
        for src, size, pieces in self._pending:
            for piece in pieces:
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
                n = box.numel * dtype.itemsize
                if off < 0 or off + n > size:
                    raise ValidationError(f"p2p piece {box} of {name!r} at byte {off} overruns its segment of "
                                          f"{size} bytes from trainer rank {src}")
                copies.append((meta, dtype, box, self._recv[src][off:off + n]))
        names = set()
        for meta, dtype, box, src_bytes in copies:
            dst = buf[meta.offset: meta.offset + meta.nbytes].view(dtype).view(meta.shape)
            for d, (s, n) in enumerate(zip(box.start, box.size, strict=True)):
                dst = dst.narrow(d, s, n)
            dst.copy_(src_bytes.view(dtype).view(box.size))
            names.add(meta.name)
            self.received_bytes += src_bytes.numel()
        self._pending = []
        return [(n, t) for n, t in unpack(buf, layout) if n in names]

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
