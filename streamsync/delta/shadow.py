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
from .codec import PIECES, digest, encode


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
        need = sum(TensorSpec(n, d, s).nbytes for n, (d, s) in want.items())
        free = _available_bytes()
        if free is not None and need > free - (1 << 30):
            raise ValidationError(f"delta pushes keep a host copy of the served model ({need / 2**30:.2f} GiB) and "
                                  f"this host has {free / 2**30:.2f} GiB free; pass delta=False (or "
                                  "delta='auto' where only remote engines pay off) or free host memory")
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
            base = self._rows(s)
            new = t.detach().to("cpu", s.dtype).reshape(-1)
            e = encode(new, base)
            if e.enc == "idx16":
                assert e.positions is not None
                base.index_copy_(0, e.positions, e.pieces[-1])
            elif e.enc != "same":
                base.copy_(new)
            key = (s.name, s.part[0] if s.part else 0)
            dig = ""
            if verify:
                cached = self._digests.get(key) if e.enc == "same" else None
                dig = cached if cached is not None else digest(base.view(s.shape))
                self._digests[key] = dig
            elif e.enc != "same":
                self._digests.pop(key, None)
            entries.append([s.name, dtype_name(s.dtype), list(s.shape), list(s.part) if s.part else None, e.enc,
                            e.changed, dig])
            for piece, tensor in zip(PIECES[e.enc], e.pieces, strict=True):
                pieces.append(TensorSpec(f"{s.name}#{piece}", tensor.dtype, (tensor.numel(),)))
                out.append(tensor)
            delta.changed += e.changed
            delta.elements += new.numel()
            delta.encodings[e.enc] = delta.encodings.get(e.enc, 0) + 1
        delta.wire = ChunkPlan(plan.index, tuple(pieces), tuple(p.name for p in pieces))
        return delta


def _available_bytes() -> int | None:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # no psutil: the allocation itself is the check
        return None
