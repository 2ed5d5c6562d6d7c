"""Many copies as one kernel: a receiver's captured load, closer to one large copy's speed.

A chunk's load is thousands of copies into slices of the engine's parameters (an MoE push: thousands of a few
MB, most one expert's gate and up projections as one run). Captured in a CUDA graph as `copy_` or
`_foreach_copy_`, each copy is a kernel or memcpy node that ramps up and drains on its own, well short of one
large copy's speed (`python -m benchmarks.copy_modes` measures the three side by side). `SegmentCopy` turns
every copy whose source and destination are runs of contiguous bytes (a contiguous tensor; Q, K or V of a
fused QKV; a row slice) into
16-byte-aligned tiles listed in a table on the device, and copies all of them with one persistent Triton kernel,
16 bytes per access. Copies it cannot take (a cast, other layouts, unaligned bytes) are queued as PyTorch copies
beside it.

Made once, outside any capture (the tile table is an upload), then called every time the copies are wanted
(`WeightReceiver` captures the call in its chunk's graph and keeps only its tile table, `captured()`). Needs
Triton and CUDA tensors (`available()`); `warm()` compiles the kernel ahead (once per machine, cached on disk
after), where a receiver starts.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

ALIGN = 16  # bytes per access; every run's addresses and length must be multiples
ELEM = 8  # the kernel moves int64 elements, two per access
TILE = 1 << 16  # bytes per tile (one program's unit of work)
BLOCK = 1024  # int64 elements per load/store step (8 KiB)
MAX_RUNS = 1 << 16  # runs per copy; a layout with more goes to PyTorch
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # tests: the kernel on CPU tensors


@functools.cache
def triton_imports() -> bool:
    """Whether Triton imports here (the finite check's kernel uses it too)."""
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception:  # not installed, or installed without a working backend
        return False
    return True


def available() -> bool:
    return torch.cuda.is_available() and triton_imports()


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Offsets are int64 elements from two base pointers (the tables make any address reachable); marked
    # multiples of 2 elements (16 bytes), with counts likewise, so loads and stores go 16 bytes at a time.
    @triton.jit(do_not_specialize=["n_tiles", "programs"])
    def segment_copy_kernel(src_base, dst_base, src_off, dst_off, count, n_tiles, programs,
                            TILE_ELEMS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        for t in range(pid, n_tiles, programs):
            so = tl.multiple_of(tl.load(src_off + t), 2)
            do = tl.multiple_of(tl.load(dst_off + t), 2)
            n = tl.multiple_of(tl.load(count + t), 2)
            for i in tl.static_range(0, TILE_ELEMS, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                mask = offs < n
                x = tl.load(src_base + so + offs, mask=mask)
                tl.store(dst_base + do + offs, x, mask=mask)

    return segment_copy_kernel


def rows_of(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(rows, cols, row stride) in elements when `t`'s row-major elements are `rows` runs of `cols` contiguous
    elements, `row stride` apart; None otherwise."""
    if t.numel() == 0:
        return None
    dims = [(n, s) for n, s in zip(t.shape, t.stride(), strict=True) if n != 1]
    if not dims:
        return (1, 1, 1) if t.numel() == 1 else None
    n, s = dims.pop()
    if s != 1:
        return None
    cols = n
    while dims and dims[-1][1] == cols:  # an outer dim continues the contiguous run
        cols *= dims.pop()[0]
    if not dims:
        return 1, cols, cols
    rows, stride = dims.pop()
    while dims and dims[-1][1] == stride * rows:  # outer dims continue the evenly spaced rows
        rows *= dims.pop()[0]
    if dims or stride < cols:
        return None
    return rows, cols, stride


def paired_runs(a: torch.Tensor, b: torch.Tensor) -> tuple[int, Iterator[tuple[int, int]]] | None:
    """`a` and `b` (same shape, any dtypes) as runs of `cols` elements contiguous on both sides, in row-major
    order: (cols, each run's first byte address in `a` and in `b`); None where either is not evenly spaced rows
    of contiguous elements."""
    ra, rb = rows_of(a), rows_of(b)
    if ra is None or rb is None or a.shape != b.shape:
        return None
    cols = math.gcd(ra[1], rb[1])
    ia, ib, pa, pb = a.element_size(), b.element_size(), a.data_ptr(), b.data_ptr()

    def starts() -> Iterator[tuple[int, int]]:
        for e in range(0, a.numel(), cols):  # the run's first element, in row-major order
            yield (pa + ((e // ra[1]) * ra[2] + e % ra[1]) * ia, pb + ((e // rb[1]) * rb[2] + e % rb[1]) * ib)
    return cols, starts()


def runs(dst: torch.Tensor, src: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """The copy dst <- src (same shape and dtype) as byte runs [(dst address, src address, bytes)], each a
    multiple of `ALIGN` in address and length; None where the copy is not such runs."""
    if dst.dtype != src.dtype or dst.shape != src.shape or dst.numel() == 0:
        return None
    paired = paired_runs(dst, src)
    if paired is None or dst.numel() // paired[0] > MAX_RUNS:
        return None
    length = paired[0] * dst.element_size()
    if length % ALIGN:
        return None
    out: list[tuple[int, int, int]] = []
    for d, s in paired[1]:
        if d % ALIGN or s % ALIGN:
            return None
        if out and out[-1][0] + out[-1][2] == d and out[-1][1] + out[-1][2] == s:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + length)  # continues the run before
        else:
            out.append((d, s, length))
    return out


class SegmentCopy:
    """dst[i] <- src[i] for every pair, queued on the current stream by `__call__`: one kernel for the pairs
    `runs` takes (consecutive runs that continue each other merge), PyTorch copies for the rest. The tensors
    must stay where they are for as long as the object is called (it copies from their addresses)."""

    def __init__(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], programs: int | None = None
                 ) -> None:
        if len(dsts) != len(srcs):
            raise ValueError(f"{len(dsts)} destinations for {len(srcs)} sources")
        self.rest: list[tuple[torch.Tensor, torch.Tensor]] = []
        merged: list[list[int]] = []
        device = None
        bases: tuple[torch.Tensor, torch.Tensor] | None = None
        for d, s in zip(dsts, srcs, strict=True):
            ok = (d.device.type == "cuda" or _INTERPRET) and s.device == d.device and device in (None, d.device)
            r = runs(d, s) if ok else None
            if r is not None and bases is None:
                sb, db = _base(s), _base(d)
                if sb is None or db is None:
                    r = None
                else:
                    bases = (sb, db)
            if r is None:
                self.rest.append((d, s))
                continue
            device = d.device
            for dd, ss, n in r:
                if merged and merged[-1][0] + merged[-1][2] == dd and merged[-1][1] + merged[-1][2] == ss:
                    merged[-1][2] += n
                else:
                    merged.append([dd, ss, n])
        self.runs = len(merged)
        self.bytes = sum(n for _, _, n in merged)
        self.device = device
        self._launch: tuple[Any, ...] | None = None
        if merged and device is not None and bases is not None:
            self._plan(merged, bases, device, programs)

    def _plan(self, merged: list[list[int]], bases: tuple[torch.Tensor, torch.Tensor], device: torch.device,
              programs: int | None) -> None:
        # Tiles of at most TILE bytes; offsets in int64 elements from each side's base (negative ones too). The
        # runs go up (24 bytes each) and the tiles are expanded on the device: built on the host, a 16 GB
        # chunk's quarter million tiles cost tens of ms of tensor ops, which a first push would pay.
        sb, db = bases[0].data_ptr(), bases[1].data_ptr()
        n_tiles = sum((n + TILE - 1) // TILE for _, _, n in merged)
        r = torch.tensor([[(s - sb) // ELEM, (d - db) // ELEM, n // ELEM] for d, s, n in merged],
                         dtype=torch.int64).to(device)  # [runs, (src, dst, elements)]
        step = TILE // ELEM
        tiles = (r[:, 2] + step - 1) // step
        run = torch.repeat_interleave(torch.arange(len(merged), device=device), tiles, output_size=n_tiles)
        off = (torch.arange(n_tiles, device=device) - (torch.cumsum(tiles, 0) - tiles)[run]) * step  # into its run
        rt = r[run]
        table = torch.stack([rt[:, 0] + off, rt[:, 1] + off, (rt[:, 2] - off).clamp(max=step)])
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        grid = min(n_tiles, programs or 4 * sms)
        self._launch = (grid, bases, table, n_tiles)

    def __call__(self) -> None:
        if self._launch is not None:
            assert self.device is not None
            grid, (src_base, dst_base), table, n_tiles = self._launch
            with torch.cuda.device(self.device) if self.device.type == "cuda" else _nothing():
                _kernel()[(grid,)](src_base, dst_base, table[0], table[1], table[2], n_tiles, grid,
                                   TILE_ELEMS=TILE // ELEM, BLOCK=BLOCK, num_warps=4)
        for d, s in self.rest:
            d.copy_(s, non_blocking=True)


    def captured(self) -> torch.Tensor | None:
        """After a capture of `__call__`: what the graph still reads (the tile table), and nothing else. The
        graph holds every address by value, so the tensors this object was made from are let go: a receiver
        must not keep a mapped buffer (and the sender's memory behind it) alive for a graph."""
        table = self._launch[2] if self._launch is not None else None
        self._launch = None
        self.rest = []
        return table


def _base(t: torch.Tensor) -> torch.Tensor | None:
    """A zero-size int64 tensor at `t`'s first byte (the kernel's base pointer: Triton takes tensors), or None
    where its storage offset is not a whole number of int64s."""
    st = t.untyped_storage()
    off = t.data_ptr() - st.data_ptr()
    if off % ELEM:
        return None
    return torch.empty(0, dtype=torch.int64, device=t.device).set_(st, off // ELEM, (0,), (1,))


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


_warm: set[int] = set()


def warm(device: torch.device) -> None:
    """Compile (or load from Triton's disk cache) and run the kernel once per device, before a capture needs
    it: a compile takes about a second and must not happen inside a CUDA graph capture."""
    if not available() or device.type != "cuda":
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index in _warm:
        return
    with torch.cuda.device(index):
        src = torch.arange(4 * TILE // 2, dtype=torch.int16, device="cuda")
        dst = torch.empty_like(src)
        SegmentCopy([dst[:TILE], dst[TILE:]], [src[:TILE], src[TILE:]])()
        torch.cuda.current_stream().synchronize()
        if not torch.equal(dst, src):
            raise RuntimeError("streamsync.kernels: the segment copy kernel copied wrong bytes")
    _warm.add(index)
