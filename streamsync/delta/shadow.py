"""`Shadow`: what the sender keeps to find what changed, and the encoding of one chunk against it.

The shadow is a pageable host copy of every tensor a push carries, in the dtype the engines hold it (after the
pack's cast: float32 norms as bf16), so a diff compares exactly what an engine holds. It costs the trainer no
GPU memory; its size is the served model's (`nbytes`, reported by every delta push) and it is refused up
front where the host has no room for it.

Exactness. The shadow is the base of the next delta only while every engine holds its version whole: `held`
is set when a push succeeded and cleared when a push starts writing into the shadow, so a push that fails or
is cancelled half-way leaves no base, and the next push sends every byte (which makes the shadow anew).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ValidationError
from ..pack import TensorSpec, dtype_name
from ..plan.chunk import ChunkPlan
from ..plan.shards import Box, Piece
from .codec import PIECES, Encoded, digest, encode, pack_header


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
    """Host copies of the pushed tensors by HF name (whole tensors; a split tensor's parts are row ranges)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        #: (version, push id) every engine holds whole and the shadow equals; None: no base
        self.held: tuple[int, str] | None = None
        #: delta pushes since the last full one
        self.since_full = 0
        self._digests: dict[tuple[str, int], str] = {}  # (name, first row) -> digest of what the shadow holds

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def prepare(self, plans: Sequence[ChunkPlan]) -> bool:
        """Host tensors for every tensor of `plans` (kept while names, shapes and dtypes stay). True when they
        were made anew (the next push must be full). Refuses a shadow larger than the host's free memory."""
        want: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for p in plans:
            for s in p.specs:
                want[s.name] = (s.dtype, s.full_shape)
        have = {n: (t.dtype, tuple(t.shape)) for n, t in self.tensors.items()}
        if have == want:
            return False
        self.tensors, self.held, self._digests = {}, None, {}
        _check_room(sum(TensorSpec(n, d, s).nbytes for n, (d, s) in want.items()))
        self.tensors = {n: torch.empty(s, dtype=d) for n, (d, s) in want.items()}
        return True

    def _rows(self, s: TensorSpec) -> torch.Tensor:
        """The flat slice of the shadow a spec covers (a part: its rows)."""
        t = self.tensors[s.name]
        if s.part is not None:
            t = t[s.part[0]:s.part[0] + s.shape[0]]
        return t.reshape(-1)

    def seed(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor]) -> None:
        """A full push: copy the chunk's tensors (cast to the served dtype) into the shadow."""
        for s, t in zip(plan.specs, tensors, strict=True):
            self._rows(s).copy_(t.detach().reshape(-1))
            self._digests.pop((s.name, s.part[0] if s.part else 0), None)

    def encode(self, plan: ChunkPlan, tensors: Sequence[torch.Tensor], *, verify: bool) -> ChunkDelta:
        """The chunk as a delta against the shadow, which then holds the new tensors. `verify`: each entry
        carries the digest of the tensor it makes (recomputed only for tensors that changed)."""
        pieces: list[TensorSpec] = []
        out: list[torch.Tensor] = []
        entries: list[list[Any]] = []
        delta = ChunkDelta(ChunkPlan(plan.index, (), ()), out, entries)
        for s, t in zip(plan.specs, tensors, strict=True):
            key = (s.name, s.part[0] if s.part else 0)
            e, dig = _diff(self._rows(s), t, s.dtype, s.shape, key, self._digests, verify, delta)
            entries.append([s.name, dtype_name(s.dtype), list(s.shape), list(s.part) if s.part else None, e.enc,
                            e.changed, dig])
            for piece, tensor in zip(PIECES[e.enc], e.pieces, strict=True):
                pieces.append(TensorSpec(f"{s.name}#{piece}", tensor.dtype, (tensor.numel(),)))
                out.append(tensor)
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
        self._digests: dict[tuple[str, Box, str, int], str] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @staticmethod
    def _key(piece: object) -> tuple[str, Box, str, int]:
        p: Piece = piece  # type: ignore[assignment]
        return (p.name, p.box, p.engine, p.worker)

    def prepare(self, plans: Sequence[ChunkPlan]) -> bool:
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
            e, dig = _diff(self.tensors[key].view(-1), t, s.dtype, s.shape, key, self._digests, verify, delta)
            rows.append((e.enc, e.changed, t.numel(), s.dtype.itemsize, dig))
            for piece, tensor in zip(PIECES[e.enc], e.pieces, strict=True):
                group.append((TensorSpec(f"{s.name}#{piece}", tensor.dtype, (tensor.numel(),)),
                              (*key[2:], piece), tensor))
        flush()
        delta.wire = ChunkPlan(plan.index, tuple(specs), tuple(keys))
        return delta


def _diff(base: torch.Tensor, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], key: Any,
          digests: dict[Any, str], verify: bool, delta: ChunkDelta) -> tuple[Encoded, str]:
    """Encode `t` (as `dtype`) against its flat shadow `base`, which then holds it; and the digest of what it
    holds (cached while it does not change), "" without `verify`."""
    new = t.detach().to("cpu", dtype).reshape(-1)
    e = encode(new, base)
    if e.enc == "idx16":
        assert e.positions is not None
        base.index_copy_(0, e.positions, e.pieces[-1])
    elif e.enc != "same":
        base.copy_(new)
    dig = ""
    if verify:
        cached = digests.get(key) if e.enc == "same" else None
        dig = cached if cached is not None else digest(base.view(shape))
        digests[key] = dig
    elif e.enc != "same":
        digests.pop(key, None)
    delta.changed += e.changed
    delta.elements += new.numel()
    delta.encodings[e.enc] = delta.encodings.get(e.enc, 0) + 1
    return e, dig


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
