"""The collective receiving half (inside an engine worker)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

from ...cache import BoundedCache
from ...errors import TransportError, ValidationError
from ...pack import Layout, unpack
from ..base import Receiver
from .group import (
    CLOSE_TIMEOUT,
    BroadcastHandle,
    GroupInit,
    broadcast,
    dispose,
    join_group,
    launch_broadcast,
    wait_event,
)


class CollectiveReceiver(Receiver):
    """Joins the sender's group at construction (blocks until every rank joined, or the timeout).

    Rank: `rank_offset` + this worker's rank within its engine. Engines of one worker have rank 0; in a
    multi-worker engine (`workers` > 1) that is `init_info["worker_rank"]` if given, else the worker's rank
    in its engine's default torch.distributed group (how vLLM numbers its workers).

    NCCL: two receive buffers; `open` posts the chunk's broadcast into one of them on a receive stream and
    returns at once, the loader's copies (on the caller's current stream) wait for it on the device, and the
    next chunk's broadcast goes into the other buffer meanwhile (module doc). `end_round` waits for all of it.
    """

    name: ClassVar[str] = "collective"
    SLOTS = 2

    def __init__(self, init_info: dict[str, Any], device: torch.device | str = "cpu") -> None:
        super().__init__(init_info, device)
        init = GroupInit.parse(init_info, "collective")
        if init.backend == "nccl" and self.device.type != "cuda":
            raise ValidationError(f"the nccl backend needs a CUDA receiver, got device {self.device}")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.init = init
        self.group, self.rank, self.world_size, self.backend = init.group, init.rank(), init.world_size, init.backend
        self.timeout = init.timeout_s
        self.close_timeout = CLOSE_TIMEOUT
        self._pg, store = join_group(init, self.rank, self.device, self.close_timeout)
        self._store = store
        self._seq = 0
        self._bufs: list[torch.Tensor | None] = [None] * self.SLOTS
        self._free: list[torch.cuda.Event | None] = [None] * self.SLOTS  # a slot's last load finished
        # (receive buffer, layout) -> the chunk's views: a steady push unpacks nothing
        self._views: BoundedCache[tuple[int, Layout], list[tuple[str, torch.Tensor]]] = BoundedCache(256)
        self._recv_stream: torch.cuda.Stream | None = None
        self._load_streams: set[torch.cuda.Stream] = set()
        self._queued = False  # device-ordered work may be queued (drained by end_round)

    @property
    def _nccl(self) -> bool:
        return self.backend == "nccl"

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes:
            if buf is not None and self._nccl:  # its broadcast or loads may still be queued
                self._drain()
            self._bufs[slot] = None  # free the old one first
            self._views.clear()
            self._bufs[slot] = buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]

    @contextmanager
    def open(self, update_info: dict[str, Any], nbytes: int | None = None) -> Iterator[torch.Tensor]:
        """Receive the chunk; yield its receive buffer (package doc)."""
        h = BroadcastHandle.parse(update_info.get("handle"), self.group, self._seq)
        seq, size, ordered = h.seq, h.nbytes, h.device_ordered
        if nbytes is not None and size != nbytes:  # before the receive buffer grows to what a handle claims
            raise ValidationError(f"collective chunk {seq} is {size} bytes, its layout {nbytes}")
        if self._pg is None:
            raise TransportError("collective receiver is closed")
        if ordered and self._nccl:
            with self._open_streamed(seq, size) as buf:
                yield buf
            return
        if self._queued:  # the host protocol right after device-ordered chunks: their work is done first
            self._drain()
        buf = self._buffer(0, size)
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

    @contextmanager
    def _open_streamed(self, seq: int, size: int) -> Iterator[torch.Tensor]:
        slot = seq % self.SLOTS
        buf = self._buffer(slot, size)
        if self._recv_stream is None:
            self._recv_stream = torch.cuda.Stream(self.device)
        self._seq += 1
        self._queued = True
        try:
            got = launch_broadcast(self._pg, buf, self._recv_stream, self._free[slot])
        except RuntimeError as e:
            raise TransportError(f"broadcast of chunk {seq} failed: {e}") from e
        load = torch.cuda.current_stream(self.device)
        self._load_streams.add(load)
        load.wait_event(got)
        try:
            yield buf
        finally:
            # The ack: the loader's copies are queued on `load`; the next broadcast into this slot waits for them.
            ev = self._free[slot] = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))

    def views(self, buf: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
        """The chunk's views, made once per (receive buffer, layout): a steady push unpacks nothing."""
        key = (buf.data_ptr(), layout)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = list(unpack(buf, layout))
        return views

    def _drain(self) -> None:
        """Every queued broadcast and load has finished (bounded by the group timeout)."""
        for s in [self._recv_stream, *self._load_streams]:
            if s is not None:
                ev = torch.cuda.Event()
                ev.record(s)
                wait_event(ev, self.timeout, f"collective receive of group {self.group}")
        self._queued = False

    def end_round(self) -> None:
        """Before a round's end is acknowledged, every broadcast and copy into the parameters has finished."""
        if self._nccl and self._pg is not None:
            self._drain()

    def close(self) -> None:
        """Abort the group (bounded: returns within `close_timeout` whatever the sender does)."""
        pg, store = self._pg, self._store
        self._pg = self._store = None
        if pg is not None or store is not None:
            dispose(pg, store).join(self.close_timeout)
            del pg, store
        self._bufs = [None] * self.SLOTS
        self._free = [None] * self.SLOTS
        self._views.clear()
