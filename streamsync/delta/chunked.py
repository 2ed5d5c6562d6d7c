"""One chunk's shadow, laid out so that its diff and encoding take a few launches per chunk on its device.

Layout. The chunk's tensors, in the dtype the engines hold them, are grouped by element size; a group is one flat
buffer of integers of that width in which every tensor starts at a multiple of BLOCK elements (zeros between).
A delta of the chunk then takes, per group, whatever the tensor count:

    stage    the new tensors copied (and cast) into a buffer of the same layout      one fused copy
    compare  staged != shadow, on the integer bits                                   one launch
    count    changed elements per block: every tensor's count, and idx16's           one reduction, one small
             counts piece                                                            copy to the host
    choose   each tensor's encoding from its count (`codec.sizes`)                   host, no launch
    gather   positions and values of every idx16 or mask tensor, sliced per tensor   one nonzero, one gather
    mask     the bit mask of every mask tensor, sliced per tensor                    one bit packing
    update   the shadow takes the changed values and the tensors that went whole     one scatter (+ a copy
                                                                                     per whole tensor)
    digest   `wsum64` of every tensor that changed, from the blocks' sums            a few launches per 256
                                                                                     blocks

That is the GPU's way. A shadow in host memory takes each tensor in turn instead (`diff_one`: numpy's C loops,
no launches to save, and blake3 digests, several times faster on a host than wsum64's integer products); its
layout is the same. The wire format is `codec`'s, per tensor, either way: receivers decode it as they decode any
delta and check each tensor they make with the algorithm its digest names (`codec.digest`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..plan.chunk import ChunkPlan
from .codec import Encoded, bits, digest, encode, low16, pack_bits, positions, sizes
from .wsum import BLOCK, INT, block_sums, combine

_SPARSE = ("idx16", "mask")


@dataclass(frozen=True)
class _Slot:
    spec: int  # index into the plan's specs
    offset: int  # elements, a multiple of BLOCK
    numel: int

    @property
    def block0(self) -> int:
        return self.offset // BLOCK

    @property
    def blocks(self) -> int:
        return -(-self.numel // BLOCK)


class _Group:
    """The chunk's tensors of one element size in one flat integer buffer."""

    def __init__(self, itemsize: int, slots: list[_Slot], buf: torch.Tensor) -> None:
        self.itemsize, self.slots, self.buf = itemsize, slots, buf

    def stage(self, dtypes: Sequence[torch.dtype], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """A buffer of this layout holding `tensors` (cast to `dtypes`), zeros between."""
        out = torch.zeros(self.buf.shape, dtype=self.buf.dtype, device=self.buf.device)
        self.fill(out, dtypes, tensors)
        return out

    def fill(self, out: torch.Tensor, dtypes: Sequence[torch.dtype], tensors: Sequence[torch.Tensor]) -> None:
        dst = [out[s.offset:s.offset + s.numel].view(dtypes[s.spec]) for s in self.slots]
        src = [tensors[s.spec].detach().reshape(-1) for s in self.slots]
        if dst:
            torch._foreach_copy_(dst, src)  # one launch where dtypes and devices match, else a copy each


class ChunkShadow:
    """What the engines hold of one chunk, on `device` (pinned host memory where `pin`). `fused`: the diff in a
    few launches per chunk (default: on a GPU), else tensor by tensor."""

    def __init__(self, plan: ChunkPlan, device: torch.device, *, pin: bool = False, fused: bool | None = None
                 ) -> None:
        self.fused = device.type != "cpu" if fused is None else fused
        self.dtypes = [s.dtype for s in plan.specs]
        self.shapes = [s.shape for s in plan.specs]
        by_size: dict[int, list[_Slot]] = {}
        ends: dict[int, int] = {}
        for i, s in enumerate(plan.specs):
            n = 1
            for d in s.shape:
                n *= d
            size = s.dtype.itemsize
            at = ends.get(size, 0)
            by_size.setdefault(size, []).append(_Slot(i, at, n))
            ends[size] = at + -(-n // BLOCK) * BLOCK
        pin = pin and device.type == "cpu"
        self.groups = [_Group(size, slots, torch.zeros(max(ends[size], BLOCK), dtype=INT[size], device=device,
                                                       pin_memory=pin))
                       for size, slots in by_size.items()]
        #: per spec, the wsum64 digest of what the shadow holds of it (None: not computed since it changed)
        self.digests: list[str | None] = [None] * len(plan.specs)
        #: per spec, its flat slice of its group's buffer (as the spec's dtype)
        self._flat = [torch.empty(0)] * len(plan.specs)
        for g in self.groups:
            for slot in g.slots:
                self._flat[slot.spec] = g.buf[slot.offset:slot.offset + slot.numel].view(self.dtypes[slot.spec])

    @property
    def nbytes(self) -> int:
        return sum(g.buf.numel() * g.buf.element_size() for g in self.groups)

    def view(self, spec: int) -> torch.Tensor:
        """The shadow's tensor of one spec (a view: writing it changes the shadow)."""
        return self._flat[spec].view(self.shapes[spec])

    def seed(self, tensors: Sequence[torch.Tensor]) -> None:
        """A full push: the shadow takes the chunk's tensors."""
        for g in self.groups:
            g.fill(g.buf, self.dtypes, tensors)
        self.digests = [None] * len(self.digests)

    def encode(self, tensors: Sequence[torch.Tensor], *, verify: bool) -> list[tuple[Encoded, str]]:
        """Each tensor's delta against the shadow, which then holds `tensors`; and the digest of each ("" without
        `verify`): wsum64 from the fused diff, blake3 (or blake2b) from the one tensor by tensor."""
        if not self.fused:
            digests = dict(enumerate(self.digests))
            done = [diff_one(self._flat[i], t, self.dtypes[i], self.shapes[i], i, digests, verify)
                    for i, t in enumerate(tensors)]
            self.digests = [digests.get(i) for i in range(len(self.digests))]
            return done
        out: list[tuple[Encoded, str] | None] = [None] * len(self.dtypes)
        for g in self.groups:
            for slot, enc in zip(g.slots, self._encode_group(g, tensors), strict=True):
                out[slot.spec] = (enc, "")
            if verify:
                self._digest(g, [slot for slot in g.slots if out[slot.spec][0].enc != "same"  # type: ignore[index]
                                 or self.digests[slot.spec] is None])
        for i, o in enumerate(out):
            assert o is not None
            if verify:
                out[i] = (o[0], self.digests[i] or "")
            elif o[0].enc != "same":
                self.digests[i] = None
        return out  # type: ignore[return-value]

    def _encode_group(self, g: _Group, tensors: Sequence[torch.Tensor]) -> list[Encoded]:
        new = g.stage(self.dtypes, tensors)
        changed = new != g.buf
        per_block = changed.view(-1, BLOCK).sum(1, dtype=torch.int32)
        counts = per_block.cpu().numpy()
        encs: list[str] = []
        ks: list[int] = []
        for s in g.slots:
            k = int(counts[s.block0:s.block0 + s.blocks].sum())
            cost = sizes(s.numel, k, g.itemsize)
            encs.append(min(cost, key=lambda e: (cost[e], e != "full")))  # a tie goes to full: nothing to decode
            ks.append(k)
        sparse = [i for i, e in enumerate(encs) if e in _SPARSE]
        idx = vals = pos = packed = None
        if sparse:
            keep = np.zeros(counts.size, dtype=np.bool_)
            for i in sparse:
                s = g.slots[i]
                keep[s.block0:s.block0 + s.blocks] = True
            sel = changed.view(-1, BLOCK) & torch.from_numpy(keep).to(changed.device)[:, None]
            idx = positions(sel.view(-1))
            vals = new[idx]
            if "idx16" in encs:
                pos = low16(idx)
            if "mask" in encs:
                packed = pack_bits(changed)
            g.buf.index_copy_(0, idx, vals)
        result: list[Encoded] = []
        at = 0
        for s, enc, k in zip(g.slots, encs, ks, strict=True):
            dtype = self.dtypes[s.spec]
            if enc == "same":
                result.append(Encoded("same", 0, []))
            elif enc == "full":
                whole = new[s.offset:s.offset + s.numel]
                g.buf[s.offset:s.offset + s.numel].copy_(whole)
                result.append(Encoded("full", k, [whole.view(dtype)]))
            else:
                assert vals is not None
                v = vals[at:at + k].view(dtype)
                if enc == "mask":
                    assert packed is not None
                    result.append(Encoded("mask", k, [packed[s.offset // 8:s.offset // 8 + -(-s.numel // 8)], v]))
                else:
                    assert pos is not None
                    result.append(Encoded("idx16", k, [per_block[s.block0:s.block0 + s.blocks], pos[at:at + k], v]))
                at += k
        return result

    def _digest(self, g: _Group, slots: list[_Slot]) -> None:
        """wsum64 of each of `slots` as the shadow now holds it: one pass over the group where most of its
        blocks are asked for, else a pass over each slot's blocks."""
        if not slots:
            return
        if 2 * sum(s.blocks for s in slots) > g.buf.numel() // BLOCK:
            a, s_ = block_sums(g.buf)
            parts = {s.spec: (a[s.block0:s.block0 + s.blocks], s_[s.block0:s.block0 + s.blocks]) for s in slots}
        else:
            parts = {s.spec: block_sums(g.buf, slice(s.block0, s.block0 + s.blocks)) for s in slots}
        for spec, (a, s_) in parts.items():
            self.digests[spec] = f"wsum64:{combine(a, s_):016x}"


def diff_one(base: torch.Tensor, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], key: Any,
             digests: dict[Any, Any], verify: bool) -> tuple[Encoded, str]:
    """Encode `t` (as `dtype`) against its flat shadow `base` (on the host), which then holds it; and the digest
    of what it holds (kept in `digests[key]` while it does not change), "" without `verify`."""
    new = t.detach().to(base.device, dtype).reshape(-1)
    e = encode(new, base)
    if e.enc == "idx16":
        assert e.positions is not None
        bits(base).index_copy_(0, e.positions, bits(e.pieces[-1]))  # on the bits: fp8 has no index_copy_
    elif e.enc != "same":
        base.copy_(new)
    dig = ""
    if verify:
        cached = digests.get(key) if e.enc == "same" else None
        dig = cached if cached is not None else digest(base.view(shape))
        digests[key] = dig
    elif e.enc != "same":
        digests.pop(key, None)
    return e, dig
