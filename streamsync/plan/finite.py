"""The non-finite check: which floating tensors hold NaN or inf, in one read of their bytes and one host sync.

A push refuses weights with NaN or inf before any engine byte changes, so the check is a full pass over the
model on the trainer's device; on a GPU it reads every byte once, half the traffic of the push's copy. It is
queued on a side stream (`launch`) and answered later (`Pending.names`): a push starts it first and asks for the
answer only before the first engine call that can change a byte, so the device reads while the host plans,
gathers and packs. Two ways, the fastest that applies:

* CUDA tensors of bf16, fp16 or fp32: one Triton kernel per dtype reads every tensor as integer words and flags
  a word whose exponent bits are all ones (inf and NaN, nothing else), 16 bytes per access over a table of
  tiles, whatever the tensor count, at close to the device's read rate. The table depends only on the tensors'
  addresses and sizes and is kept for the next push of the same tensors.
* Anything else (CPU tensors, fp8, float64, a layout that is not contiguous): one max-norm (largest magnitude)
  per tensor by `torch._foreach_norm`, a few fused launches per (device, dtype) group. NaN propagates through a
  max and inf is its own maximum, while finite values never overflow it (an L1 norm would: a float16 tensor of
  100k ones sums past 65504 to inf).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ..cache import StableList
from ..receiver.kernels import triton_imports

TILE = 1 << 16  # bytes per tile (one program's unit of work)
BLOCK = 2048  # words per load step
ALIGN = 16  # bytes per vector access
#: dtype -> (the integer word of its width, its exponent bits)
_EXPONENT = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
             torch.float32: (torch.int32, 0x7F800000)}
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # tests: the kernel on CPU tensors


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # Offsets are words from one base tensor (negative ones too); in the ALIGNED launch every tile starts and
    # ends on 16 bytes, so loads go 16 bytes at a time. A tile's flag is 1 when any word's exponent is all ones.
    @triton.jit(do_not_specialize=["n_tiles", "programs"])
    def nonfinite_kernel(base, off, count, flags, n_tiles, programs, MASK: tl.constexpr, VEC: tl.constexpr,
                         TILE_WORDS: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
        pid = tl.program_id(0)
        for t in range(pid, n_tiles, programs):
            o = tl.load(off + t)
            n = tl.load(count + t)
            if ALIGNED:
                o = tl.multiple_of(o, VEC)
                n = tl.multiple_of(n, VEC)
            hit = tl.zeros([BLOCK], dtype=tl.int32)
            for i in tl.static_range(0, TILE_WORDS, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                x = tl.load(base + o + offs, mask=offs < n, other=0)
                hit = tl.maximum(hit, ((x & MASK) == MASK).to(tl.int32))
            tl.store(flags + t, tl.max(hit, 0))

    return nonfinite_kernel


class _Tiles:
    """The tile tables of one set of tensors (one device): per dtype, an aligned launch over the 16-byte-aligned
    body of every tensor and an unaligned one over the few words before and after it. Holds no tensor: a call
    passes the same tensors again (same addresses, the cache's key)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        device = tensors[0].device
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(tensors):
            groups.setdefault(t.dtype, []).append(i)
        # runs of words, one launch each: (base tensor index, word dtype, mask, aligned, [(owner, offset, words)])
        launches: list[tuple[int, torch.dtype, int, bool, list[tuple[int, int, int]]]] = []
        for dtype, idx in groups.items():
            word, mask = _EXPONENT[dtype]
            size = tensors[idx[0]].element_size()
            # the base: a tensor of this group at a 16-byte-aligned address where one exists
            b = next((i for i in idx if tensors[i].data_ptr() % ALIGN == 0), idx[0])
            base_addr = tensors[b].data_ptr()
            body: list[tuple[int, int, int]] = []
            edges: list[tuple[int, int, int]] = []
            for i in idx:
                start = tensors[i].data_ptr()
                end = start + tensors[i].numel() * size
                lo = -(-start // ALIGN) * ALIGN if base_addr % ALIGN == 0 else end
                hi = end // ALIGN * ALIGN
                if lo >= hi:
                    lo = hi = end
                for a, z in ((start, lo), (hi, end)):
                    if z > a:
                        edges.append((i, (a - base_addr) // size, (z - a) // size))
                if hi > lo:
                    body.append((i, (lo - base_addr) // size, (hi - lo) // size))
            launches += [(b, word, mask, aligned, runs) for aligned, runs in ((True, body), (False, edges)) if runs]
        # Runs go up (24 bytes each) and are cut into tiles on the device: a 16 GB model has a quarter million.
        all_runs = [r for *_, runs in launches for r in runs]
        r = torch.tensor(all_runs, dtype=torch.int64).to(device)  # [runs, (owner, offset, words)]
        per_tile = torch.tensor([TILE // torch.empty((), dtype=w).element_size()
                                 for _, w, _, _, runs in launches for _ in runs], dtype=torch.int64).to(device)
        tiles = (r[:, 2] + per_tile - 1) // per_tile
        n_tiles = int(tiles.sum())
        run = torch.repeat_interleave(torch.arange(len(all_runs), device=device), tiles, output_size=n_tiles)
        k = torch.arange(n_tiles, device=device) - (torch.cumsum(tiles, 0) - tiles)[run]  # tile within its run
        step = per_tile[run]
        self.off = r[run, 1] + k * step
        self.count = torch.minimum(r[run, 2] - k * step, step)
        self.owner = r[run, 0]
        self.flags = torch.zeros(n_tiles, dtype=torch.int32, device=device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self.launches: list[tuple[Any, ...]] = []
        first_run = first_tile = 0
        counts = tiles.tolist()
        for b, word, mask, aligned, runs in launches:
            n = sum(counts[first_run:first_run + len(runs)])
            vec = ALIGN // torch.empty((), dtype=word).element_size()
            self.launches.append((min(n, 8 * sms), b, word, first_tile, n, mask, vec, aligned))
            first_run += len(runs)
            first_tile += n
        self.device = device

    def bases(self) -> list[int]:
        """Which of the table's tensors each launch reads from (its words are offsets from that one)."""
        return [b for _, b, *_ in self.launches]

    def launch(self, bases: Sequence[torch.Tensor]) -> None:
        """Queue the kernels on the current stream, `bases[j]` being launch j's base tensor (`bases`), at the
        address the table was made for; `collect` answers."""
        kernel = _kernel()
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            for base, (grid, _, word, first, n, mask, vec, aligned) in zip(bases, self.launches, strict=True):
                kernel[(grid,)](base.view(word), self.off[first:], self.count[first:],
                                self.flags[first:first + n], n, grid, MASK=mask, VEC=vec,
                                TILE_WORDS=TILE * vec // ALIGN, BLOCK=BLOCK, ALIGNED=aligned, num_warps=8)

    def collect(self) -> list[int]:
        """Indices of the tensors of the last `launch` holding inf or NaN (the one host sync)."""
        return sorted(set(self.owner[self.flags.nonzero().flatten()].tolist()))

    def __call__(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        self.launch([tensors[b] for b in self.bases()])
        return self.collect()


def _eligible(t: torch.Tensor) -> bool:
    return ((t.device.type == "cuda" or _INTERPRET) and t.dtype in _EXPONENT and t.is_contiguous()
            and t.data_ptr() % t.element_size() == 0)


_checked: dict[torch.device, bool] = {}


def _kernel_works(device: torch.device) -> bool:
    """Whether the compiled kernel flags exactly the right tensors on `device`, checked once per device on known
    bytes (every dtype; inf, -inf and NaN at aligned and unaligned places; the extreme finite values; a view
    over several tiles). A kernel that fails to build or answers wrong is not used: the norms check instead,
    with a warning, so a Triton or driver problem costs speed, never a missed NaN."""
    if device.type != "cuda":
        return True  # the interpreter (tests)
    if device not in _checked:
        _checked[device] = self_check(device)
    return _checked[device]


def self_check(device: torch.device) -> bool:
    """Run the kernel on known bytes on `device` (`_kernel_works`); False, with a warning, where it is wrong."""
    ok = False
    try:
        named: list[tuple[str, torch.Tensor]] = []
        want: list[str] = []
        for dtype in _EXPONENT:
            fin = torch.finfo(dtype)
            buf = torch.ones(2 * TILE + 37, dtype=dtype, device=device)
            buf[:4] = torch.tensor([fin.max, -fin.max, fin.tiny / 4, -0.0], dtype=dtype)
            views = [buf[0:9], buf[9:TILE + 21], buf[TILE + 21:TILE + 22], buf[TILE + 22:]]
            for i, (v, bad) in enumerate(zip(views, (None, -1, 0, TILE), strict=True)):
                name = f"{dtype}-{i}"
                named.append((name, v))
                if bad is not None:
                    v[bad] = (float("inf"), float("nan"), -float("inf"))[i % 3]
                    want.append(name)
        ok = [named[i][0] for i in _Tiles([t for _, t in named])([t for _, t in named])] == want
        if not ok:
            logging.getLogger(__name__).warning("streamsync: the finite check's kernel answered wrong on %s; "
                                                "using per-tensor norms instead", device)
    except Exception as e:  # no working Triton build for this device
        logging.getLogger(__name__).warning("streamsync: the finite check's kernel is unavailable on %s (%s); "
                                            "using per-tensor norms instead", device, e)
    return ok


def warm_finite_check(tensors: Sequence[tuple[str, Any]]) -> None:
    """Ahead of the first push (`WeightSync.connect(model)`): build (or load from Triton's disk cache) and check
    the kernel for the devices `tensors` are on (about a second per dtype), and work out how `tensors` are
    checked (the tile table: tens of milliseconds for thousands of tensors), by checking them once. Pass the
    source's own list (`Source.local_tensors`): a push knows it again by its identity."""
    if triton_imports():
        for device in {t.device for _, t in tensors if t.device.type == "cuda"}:
            _kernel_works(device)
    if tensors:
        launch(tensors).names()


def _norms(tensors: Sequence[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """Queue the max-norms of `tensors`: (the order of the answer's positions, its not-finite mask)."""
    groups: dict[tuple[Any, Any], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    order: list[int] = []
    parts: list[torch.Tensor] = []
    device = tensors[0].device
    for (_, dtype), idx in groups.items():
        ts = [tensors[i] for i in idx]
        try:
            if torch.finfo(dtype).bits < 16:
                raise TypeError("no foreach kernels for 8-bit floats")
            out: Sequence[torch.Tensor] = torch._foreach_norm(ts, float("inf"))
        except (RuntimeError, TypeError):
            out = [t.float().abs().amax() for t in ts]
        # one stacked vector per group and one transfer of the bad positions: a few launches and one host sync
        # whatever the tensor count (per-tensor casts and moves cost more than the norms on an MoE)
        parts.append(torch.stack(list(out)).float().to(device))
        order += idx
    return order, ~torch.cat(parts).isfinite()


class _Prepared:
    """How one set of tensors is checked, worked out once: which are floating and hold elements, which the
    kernel takes (on one device) and its tile table, which the norms take. Kept while every tensor keeps its
    address, size, dtype, contiguity and device (`_key`): a push of an MoE checks thousands of tensors, and
    asking each of them again was a third of the check."""

    def __init__(self, tensors: Sequence[torch.Tensor], kernel: bool | None) -> None:
        floating = [i for i, t in enumerate(tensors) if t.is_floating_point() and t.numel()]
        use = (kernel if kernel is not None else True) and triton_imports()
        fast = [i for i in floating if use and _eligible(tensors[i])]
        if fast:
            device = tensors[fast[0]].device
            fast = [i for i in fast if tensors[i].device == device] if _kernel_works(device) else []
        taken = set(fast)
        self.fast = fast
        self.rest = [i for i in floating if i not in taken]
        self.tiles = _Tiles([tensors[i] for i in fast]) if fast else None
        self.bases = [fast[b] for b in self.tiles.bases()] if self.tiles is not None else []
        self.devices = sorted({tensors[i].device for i in floating if tensors[i].is_cuda}, key=str)
        self.on_host = any(not tensors[i].is_cuda for i in self.rest)  # norms computed as they are queued

    def launch(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], torch.Tensor] | None:
        """Queue the check of `tensors` on the current streams; `collect` answers from what this returns. Touches
        only the few tensors the kernels' offsets start from, whatever the tensor count."""
        if self.tiles is not None:
            self.tiles.launch([tensors[i][1] for i in self.bases])
        return _norms([tensors[i][1] for i in self.rest]) if self.rest else None

    def collect(self, norms: tuple[list[int], torch.Tensor] | None) -> list[int]:
        bad: set[int] = set()
        if self.tiles is not None:
            bad.update(self.fast[k] for k in self.tiles.collect())
        if norms is not None:
            order, mask = norms
            bad.update(self.rest[order[i]] for i in mask.nonzero().flatten().tolist())
        return sorted(bad)


def _key(tensors: Sequence[torch.Tensor], kernel: bool | None) -> tuple[object, ...]:
    T = torch.Tensor
    return (kernel, list(map(T.data_ptr, tensors)), list(map(T.numel, tensors)), [t.dtype for t in tensors],
            list(map(T.is_contiguous, tensors)), list(map(T.get_device, tensors)))


#: the last few sets checked (a sync's sources), newest last: (key, kernel, the `StableList` it last came as, by
#: a weak reference, or None, how it is checked); it holds no tensor
_cache: list[tuple[tuple[object, ...], bool | None, weakref.ref | None, _Prepared]] = []


class Pending:
    """A check queued on side streams of the tensors' devices (after what their current streams queued
    before it), so the caller's other host work and device copies go ahead meanwhile. `done()` asks without
    waiting; `names()` waits and answers. It holds the tensors until then."""

    def __init__(self, tensors: Sequence[tuple[str, Any]], kernel: bool | None) -> None:
        self._named = tensors
        self._answer: list[int] | None = [] if not tensors else None
        self._events: list[torch.cuda.Event] = []
        if not tensors:
            return
        prep = self._prep = _prepared(tensors, kernel)
        with contextlib.ExitStack() as streams:
            for d in prep.devices:
                side = _side(d)
                side.wait_stream(torch.cuda.current_stream(d))  # the check reads what was written before it
                streams.enter_context(torch.cuda.stream(side))
            self._norms = prep.launch(tensors)
            for d in prep.devices:
                ev = torch.cuda.Event()
                ev.record(_side(d))
                self._events.append(ev)

    def done(self) -> bool:
        return self._answer is not None or all(e.query() for e in self._events)

    def wait(self) -> None:
        for e in self._events:
            e.synchronize()

    def names(self) -> list[str]:
        """Names of the floating tensors holding NaN or inf, in the order given."""
        if self._answer is None:
            self.wait()
            self._answer = self._prep.collect(self._norms)
            self._norms = None
        return [self._named[i][0] for i in self._answer]


_sides: dict[torch.device, torch.cuda.Stream] = {}


def _side(device: torch.device) -> torch.cuda.Stream:
    if device not in _sides:
        _sides[device] = torch.cuda.Stream(device)
    return _sides[device]


def _seen(tensors: Sequence[tuple[str, Any]], kernel: bool | None) -> _Prepared | None:
    """The kept `_Prepared` of `tensors` where it is a `StableList` checked before (known by identity)."""
    if isinstance(tensors, StableList):
        for _, kept, ref, prep in _cache:
            if ref is not None and ref() is tensors and kept == kernel:
                return prep
    return None


def _prepared(tensors: Sequence[tuple[str, Any]], kernel: bool | None) -> _Prepared:
    """The kept `_Prepared` of `tensors`, or a new one. A `StableList` (`Source.local_tensors`) is known again
    by its identity, without asking each tensor (1.5 ms for an MoE's 4,719)."""
    seen = _seen(tensors, kernel)
    if seen is not None:
        return seen
    stable = isinstance(tensors, StableList)
    ts = [t for _, t in tensors]
    key = _key(ts, kernel)
    ref = weakref.ref(tensors) if stable else None
    found = next((i for i, (k, *_) in enumerate(_cache) if k == key), None)
    if found is not None:
        _, _, was, prep = _cache[found]
        _cache[found] = (key, kernel, ref or was, prep)
        return prep
    prep = _Prepared(ts, kernel)
    if len(_cache) >= 4:
        _cache.pop(0)
    _cache.append((key, kernel, ref, prep))
    return prep


def known(tensors: Sequence[tuple[str, Any]], kernel: bool | None = None) -> bool:
    """Whether `tensors` is a `StableList` whose check was worked out before: `launch` then only queues a few
    kernels (a quarter of a millisecond for an MoE's 4,719 tensors), cheap enough for an event loop's thread,
    and none of them is checked on the host (where the norms run as they are queued)."""
    return queueing(tensors, kernel) == "kernels"


def queueing(tensors: Sequence[tuple[str, Any]], kernel: bool | None = None) -> str:
    """What `launch` of `tensors` does on the host: "kernels" (only queues kernels: `known`), "on host" (a
    `StableList` worked out before, some of whose tensors are checked on the host as they are queued), "new" (a
    `StableList` not seen before, or whose tensors moved: worked out first) or "list" (a plain list: each tensor
    asked where it lies, `_key`)."""
    if not isinstance(tensors, StableList):
        return "list"
    seen = _seen(tensors, kernel)
    return "new" if seen is None else "on host" if seen.on_host else "kernels"


def launch(tensors: Sequence[tuple[str, Any]], kernel: bool | None = None) -> Pending:
    """Queue the check of `tensors` and return at once (`Pending`); `nonfinite` is this, answered."""
    return Pending(tensors if isinstance(tensors, StableList) else list(tensors), kernel)


def nonfinite(tensors: Sequence[tuple[str, Any]], kernel: bool | None = None) -> list[str]:
    """Names of the floating tensors holding NaN or inf, in the order given. `kernel`: force (True) or refuse
    (False) the Triton kernel for the tensors it can take; None takes it where it applies."""
    return launch(tensors, kernel).names()
