"""A pool of flat uint8 send buffers on one device, reused across chunks and pushes.

Why a pool: on a GPU, a fresh 1 GiB buffer per chunk costs an allocation and, for CUDA IPC, a new handle
that every receiver must open (cudaIpcOpenMemHandle takes milliseconds and maps the whole allocation).
Reusing at most `max_inflight` buffers lets receivers open each handle once and keep it. All buffers
have one size (the push's largest chunk), so any free buffer fits any chunk. (A transport that packs only
part of each chunk, CUDA IPC with references, begins with its current size instead and lets `take` grow the
buffers to the largest part seen.)

A buffer is given back to the pool only by the release stage, i.e. after every receiver acknowledged
the chunk in it, so a buffer is never overwritten while a receiver still reads it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import BoundedCache


@dataclass
class PoolBuffer:
    """A pooled buffer and what its transport keeps with it while it lives. `token` changes whenever the
    memory does: receivers key their cached mappings by it."""

    tensor: torch.Tensor = field(repr=False)
    size: int
    token: str
    serial: int = 0  # creation order: every push hands buffers out in this order
    #: what the allocator keeps alive with the memory (shared memory: its fd and mapping)
    backing: Any = field(default=None, repr=False)
    #: CUDA IPC: the export of this buffer to each engine, by engine index (one per receiver: torch counts one
    #: release per export)
    exports: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    #: recorded once this buffer's pack ran (receivers and the broadcast wait for it on the device)
    ready: torch.cuda.Event | None = field(default=None, repr=False)
    #: recorded by the broadcast out of this buffer (the next pack into it waits for it)
    sent: torch.cuda.Event | None = field(default=None, repr=False)
    #: CUDA IPC: each receiver's release event (the next pack into this buffer waits for all of them)
    release_events: list[torch.cuda.Event] = field(default_factory=list, repr=False)
    #: per-chunk work made for this buffer (destination views, captured packs), keyed by chunk layout and the
    #: sources' addresses: bounded, since a trainer whose chunking or addresses keep changing makes new keys
    cache: BoundedCache[tuple, Any] = field(default_factory=lambda: BoundedCache(512), repr=False)

    def reset(self) -> None:
        """Forget everything kept with the memory (the buffer was dropped)."""
        self.exports.clear()
        self.release_events.clear()
        self.cache.clear()
        self.ready = self.sent = None


class BufferPool:
    """keep: keep free buffers between pushes (fast steady state); False frees them at every push's end.

    `on_drop` runs after buffers were dropped (CUDA IPC calls torch.cuda.ipc_collect there). `alloc` and
    `destroy` replace the default torch allocation for buffers that live elsewhere (shared memory).
    """

    def __init__(self, device: torch.device, *, keep: bool = True, pin: bool = False,
                 on_drop: Callable[[], None] | None = None, alloc: Callable[[int], PoolBuffer] | None = None,
                 destroy: Callable[[PoolBuffer], None] | None = None) -> None:
        self.device = device
        self.alloc = alloc
        self.destroy = destroy
        self.keep = keep
        self.pin = pin and device.type == "cpu" and torch.cuda.is_available()
        self.on_drop = on_drop
        self.size = 0
        self._made = 0
        self._free: list[PoolBuffer] = []
        self._busy: dict[str, PoolBuffer] = {}

    def begin(self, size: int) -> None:
        """A push starts whose largest chunk is `size` bytes: drop free buffers that are too small.

        Free buffers are handed out first-freed-first, starting each push in creation order, so with a
        steady window chunk i lands in the same buffer every push (per-buffer caches keyed by chunk, such as
        the CUDA IPC transport's captured packs, then hit from the second push on).
        """
        self.size = size
        small = [b for b in self._free if b.size < size]
        if small:
            self._free = [b for b in self._free if b.size >= size]
            self._drop(small)
        self._free.sort(key=lambda b: b.serial)

    def take(self, nbytes: int) -> PoolBuffer:
        for i, b in enumerate(self._free):
            if b.size >= nbytes:
                buf = self._free.pop(i)
                break
        else:
            # No free buffer fits (buffers sized per chunk, see begin): free ones this small will never fit
            # a later chunk either; drop them so the pool stays within the window.
            small = [b for b in self._free if b.size < nbytes]
            if small:
                self._free = [b for b in self._free if b.size >= nbytes]
                self._drop(small)
            self.size = size = max(nbytes, self.size)
            if self.alloc is not None:
                buf = self.alloc(size)
            else:
                t = torch.empty(size, dtype=torch.uint8, device=self.device, pin_memory=self.pin)
                buf = PoolBuffer(t, size, secrets.token_hex(8))
            buf.serial = self._made
            self._made += 1
        self._busy[buf.token] = buf
        return buf

    def give(self, buf: PoolBuffer) -> bool:
        """Back to the free list; False if the buffer was not busy (a second free is a no-op)."""
        if self._busy.pop(buf.token, None) is None:
            return False
        self._free.append(buf)
        return True

    def end(self) -> None:
        """A push ended: buffers still busy (a failed push) are dropped, not reused."""
        busy = list(self._busy.values())
        self._busy.clear()
        if not self.keep:
            busy += self._free
            self._free = []
        self._drop(busy)

    def release(self) -> None:
        """Drop every buffer."""
        bufs = self._free + list(self._busy.values())
        self._free, self._busy = [], {}
        self._drop(bufs)

    @property
    def live_tokens(self) -> list[str]:
        return sorted([b.token for b in self._free] + list(self._busy))

    @property
    def busy(self) -> int:
        return len(self._busy)

    @property
    def buffers(self) -> int:
        return len(self._free) + len(self._busy)

    @property
    def nbytes(self) -> int:
        return sum(b.size for b in self._free) + sum(b.size for b in self._busy.values())

    def _drop(self, bufs: list[PoolBuffer]) -> None:
        if not bufs:
            return
        for b in bufs:
            b.tensor = torch.empty(0, dtype=torch.uint8)
            if self.destroy is not None:
                self.destroy(b)
            b.reset()
        if self.on_drop is not None:
            self.on_drop()


def captured(pb: PoolBuffer, key: tuple, stream: torch.cuda.Stream,
             record: Callable[[], None]) -> tuple[torch.cuda.CUDAGraph | None, bool]:
    """The copies `record()` queues, as a CUDA graph kept in `pb` under `key`: (None, False) the first time
    the key is seen (the caller copies plainly: one-off addresses never cost a capture), (graph, True) the
    second (captured now, not run: the caller replays it), (graph, False) after. Captured on `stream`, which
    records nothing else meanwhile; "thread_local": other threads of the trainer may use CUDA during the
    capture. A RuntimeError means these copies cannot be captured here."""
    graph = pb.cache.get(key)
    if isinstance(graph, torch.cuda.CUDAGraph):
        return graph, False
    if graph is None:
        pb.cache[key] = False
        return None, False
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            record()
        finally:
            graph.capture_end()
    pb.cache[key] = graph
    return graph, True
