"""`Shadow`: what the sender keeps to find what changed, and the encoding of one chunk against it.

The shadow is a copy of every tensor a push carries, in the dtype the engines hold it (after the pack's cast:
float32 norms as bf16), so a diff compares exactly what an engine holds. It lives where the trainer's tensors
are, so the diff runs at that device's speed in a few launches per chunk (`chunked`): on the trainer's GPU where
it has room (bounded by `WeightSync(shadow_device_bytes=...)`), else in pinned host memory, said in
`report.delta.shadow_where`. Its size is the served model's, each tensor rounded up to a block of 65,536
elements (`nbytes`, reported by every delta push); it is refused up front where neither has room for it.

A sharded push's `PieceShadow` keeps host copies of the pieces each rank sends and encodes them tensor by
tensor (`codec.encode`).

Exactness. The shadow is the base of the next delta only while every engine holds its version whole: `held`
is set when a push succeeded and cleared when a push starts writing into the shadow, so a push that fails or
is cancelled half-way leaves no base, and the next push sends every byte (which makes the shadow anew).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ValidationError
from ..pack import TensorSpec, dtype_name
from ..plan.chunk import ChunkPlan
from ..plan.shards import Box, Piece
from .chunked import ChunkShadow, diff_one
from .codec import PIECES, pack_header
from .wsum import BLOCK


@dataclass
class ChunkDelta:
    """One chunk as a delta: the plan of its packed pieces, the pieces, and per HF tensor its entry
    [name, dtype, shape, part, encoding, changed, digest] (the message's `delta.entries`)."""

    wire: ChunkPlan
    tensors: list[torch.Tensor]
    entries: list[list[Any]]
    changed: int = 0
    elements: int = 0
    encodings: dict[str, int] = field(default_factory=dict)


class Shadow:
    """What the engines hold of every chunk (`chunked.ChunkShadow`), by chunk index, where the trainer's tensors
    are: on its GPU where it has room (within `device_bytes`), else in pinned host memory; a CPU trainer's in
    host memory. `where` says which."""

    def __init__(self, *, device_bytes: int | None = None) -> None:
        self.chunks: dict[int, ChunkShadow] = {}
        #: (version, push id) every engine holds whole and the shadow equals; None: no base
        self.held: tuple[int, str] | None = None
        #: delta pushes since the last full one
        self.since_full = 0
        #: the most bytes of the trainer's GPU the shadow may take (None: what leaves a GiB free; 0: none)
        self.device_bytes = device_bytes
        #: where the shadow lives ("cuda:0", "host (pinned)", "host"), with the reason where it is not the
        #: trainer's device
        self.where = ""
        self._sig: object = None
        self._names: dict[str, tuple[int, int]] = {}

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks.values())

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The shadow's whole tensors by HF name (views: writing one changes the shadow); split tensors are not
        in it."""
        return {n: self.chunks[c].view(i) for n, (c, i) in self._names.items()}

    def prepare(self, plans: Sequence[ChunkPlan], device: torch.device | None = None) -> bool:
        """A shadow for every chunk of `plans` (kept while their names, shapes, dtypes and the trainer's device
        stay), placed before any byte moves. True when it was made anew (the next push must be full). Refuses
        one that fits neither the device's budget nor the host's free memory."""
        device = torch.device("cpu") if device is None else torch.device(device)
        sig = (device, tuple((p.index, p.specs) for p in plans))
        if sig == self._sig:
            return False
        self.chunks, self.held, self._sig, self._names = {}, None, None, {}
        need = sum(-(-math.prod(s.shape) // BLOCK) * BLOCK * s.dtype.itemsize for p in plans for s in p.specs)
        where, pin = self._place(need, device)
        self.chunks = {p.index: ChunkShadow(p, where, pin=pin) for p in plans}
        self._names = {s.name: (p.index, i) for p in plans for i, s in enumerate(p.specs) if s.part is None}
        self._sig = sig
        return True

    def _place(self, need: int, device: torch.device) -> tuple[torch.device, bool]:
        if device.type == "cuda":
            # what this process's allocator keeps cached (an earlier shadow, freed) is free for it too
            free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) \
                - torch.cuda.memory_allocated(device)
            limit = free - (1 << 30) if self.device_bytes is None else min(self.device_bytes, free)
            if need <= limit:
                self.where = str(device)
                return device, False
            over = self.device_bytes is not None and need > self.device_bytes
            why = f"over shadow_device_bytes={self.device_bytes}" if over else f"{free / 2**30:.2f} GiB free there"
            _check_room(need)
            self.where = f"host (pinned): {need / 2**30:.2f} GiB, {why}"
            return torch.device("cpu"), True
        _check_room(need)
        self.where = "host"
        return torch.device("cpu"), False

    def seed(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor]) -> None:
        """A full push: the shadow takes the chunk's tensors (cast to the served dtype)."""
        self.chunks[plan.index].seed(tensors)

    def encode(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor], *, verify: bool) -> ChunkDelta:
        """The chunk as a delta against the shadow, which then holds the new tensors. `verify`: each entry
        carries the wsum64 digest of the tensor it makes."""
        pieces: list[TensorSpec] = []
        out: list[torch.Tensor] = []
        entries: list[list[Any]] = []
        delta = ChunkDelta(ChunkPlan(plan.index, (), ()), out, entries)
        for s, (e, dig) in zip(plan.specs, self.chunks[plan.index].encode(tensors, verify=verify), strict=True):
            entries.append([s.name, dtype_name(s.dtype), list(s.shape), list(s.part) if s.part else None, e.enc,
                            e.changed, dig])
            for piece, tensor in zip(PIECES[e.enc], e.pieces, strict=True):
                pieces.append(TensorSpec(f"{s.name}#{piece}", tensor.dtype, (tensor.numel(),)))
                out.append(tensor)
            delta.changed += e.changed
            delta.encodings[e.enc] = delta.encodings.get(e.enc, 0) + 1
        delta.elements += sum(t.numel() for t in tensors)
        delta.wire = ChunkPlan(plan.index, tuple(pieces), tuple(p.name for p in pieces))
        return delta


class PieceShadow:
    """A sharded push's shadow (transport "p2p"): host copies of the pieces this rank sends, one per
    destination, keyed by (HF name, box, engine, worker), so each mirrors what one worker keeps of it. Its size
    is the bytes this rank sends in a push. Same rules as `Shadow`; `encode` lays a chunk out per destination
    as a header (`codec.pack_header`: each piece's encoding, count and digest) and then its pieces' encodings,
    which the transport sends as two messages (a worker learns the second's size from the first)."""

    def __init__(self) -> None:
        self.tensors: dict[tuple[str, Box, str, int], torch.Tensor] = {}
        self.held: tuple[int, str] | None = None
        self.since_full = 0
        self.where = "host"
        self._digests: dict[tuple[str, Box, str, int], str] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @staticmethod
    def _key(piece: object) -> tuple[str, Box, str, int]:
        p: Piece = piece  # type: ignore[assignment]
        return (p.name, p.box, p.engine, p.worker)

    def prepare(self, plans: Sequence[ChunkPlan], device: torch.device | None = None) -> bool:
        self.where = "host"
        want = {self._key(k): (s.dtype, s.shape) for p in plans for s, k in zip(p.specs, p.keys, strict=True)}
        have = {k: (t.dtype, tuple(t.shape)) for k, t in self.tensors.items()}
        if have == want:
            return False
        self.tensors, self.held, self._digests = {}, None, {}
        _check_room(sum(TensorSpec("", d, s).nbytes for d, s in want.values()))
        self.tensors = {k: torch.empty(s, dtype=d) for k, (d, s) in want.items()}
        return True

    def seed(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor]) -> None:
        for k, t in zip(plan.keys, tensors, strict=True):
            key = self._key(k)
            self.tensors[key].view(-1).copy_(t.detach().reshape(-1))
            self._digests.pop(key, None)

    def encode(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor], *, verify: bool) -> ChunkDelta:
        specs: list[TensorSpec] = []
        keys: list[object] = []
        out: list[torch.Tensor] = []
        delta = ChunkDelta(ChunkPlan(plan.index, (), ()), out, [])
        rows: list[tuple[str, int, int, int, str]] = []
        group: list[tuple[TensorSpec, object, torch.Tensor]] = []
        dest: tuple[str, int] | None = None

        def flush() -> None:  # one destination's header, then its pieces
            if dest is None:
                return
            header = pack_header(rows)
            specs.append(TensorSpec("#header", torch.int64, (header.numel(),)))
            keys.append((*dest, "#header"))
            out.append(header)
            for spec, key, tensor in group:
                specs.append(spec)
                keys.append(key)
                out.append(tensor)
            rows.clear()
            group.clear()

        for s, k, t in zip(plan.specs, plan.keys, tensors, strict=True):
            key = self._key(k)
            if dest != key[2:]:
                flush()
                dest = key[2:]
            e, dig = diff_one(self.tensors[key].view(-1), t, s.dtype, s.shape, key, self._digests, verify)
            delta.changed += e.changed
            delta.elements += t.numel()
            delta.encodings[e.enc] = delta.encodings.get(e.enc, 0) + 1
            rows.append((e.enc, e.changed, t.numel(), s.dtype.itemsize, dig))
            for piece, tensor in zip(PIECES[e.enc], e.pieces, strict=True):
                group.append((TensorSpec(f"{s.name}#{piece}", tensor.dtype, (tensor.numel(),)),
                              (*key[2:], piece), tensor))
        flush()
        delta.wire = ChunkPlan(plan.index, tuple(specs), tuple(keys))
        return delta


def _check_room(need: int) -> None:
    free = _available_bytes()
    if free is not None and need > free - (1 << 30):
        raise ValidationError(f"delta pushes keep a host copy of the served model ({need / 2**30:.2f} GiB) and "
                              f"this host has {free / 2**30:.2f} GiB free; pass delta=False (or "
                              "delta='auto' where only remote engines pay off) or free host memory")


def _available_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # no psutil: the allocation itself is the check
        return None
