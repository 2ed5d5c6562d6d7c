"""Chunks loaded by replaying a CUDA graph of their copies (`CapturedLoads`), kept by the parts of a chunk
(`chunk_parts`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ....log import get_logger
from .plan import Plan, _Op
from .round import FastRound
from .trace import _TB

Weights = list[tuple[str, torch.Tensor]]


def chunk_parts(info: dict[str, Any], split: tuple[int, int] | None, weights: Weights, serial: int | None = None
                ) -> list[tuple[tuple | None, Weights]]:
    """A chunk's tensors in the parts its captured loads are kept by, each with its key: the packed part by its
    layout and the buffer it arrived in, the referenced part by its reference set (the trainer storages it
    names), so a graph captured for the references at connect serves whichever buffer the packed part comes in.
    `split`: (packed, referenced) tensor counts of the chunk as the receiver joined it. `serial`: the set's
    serial number where the referenced part is the set's views as the receiver made them
    (`ReferenceViews.serial`): its key then pins their addresses (`CapturedLoads.ready`). A chunk loaded
    otherwise (a delta, split tensors) is one part, keyed by all three."""
    handle = info.get("handle")
    if not isinstance(handle, dict):
        return [(None, weights)]
    layout, token, rid = info.get("layout_key"), handle.get("token"), handle.get("refs_id")
    if split is None or sum(split) != len(weights) or (split[1] and not isinstance(rid, str)):
        return [((layout, token, rid), weights)]
    n = split[0]
    parts: list[tuple[tuple | None, Weights]] = []
    if n:
        parts.append((("packed", layout, token), weights[:n] if n < len(weights) else weights))
    if n < len(weights):
        parts.append((("refs", rid, serial), weights[n:] if n else weights))
    return parts


def _pinned(key: object) -> bool:
    """Whether `key` is a reference set's part with its views' serial number (`chunk_parts`)."""
    return isinstance(key, tuple) and len(key) == 3 and key[0] == "refs" and type(key[2]) is int


@dataclass(slots=True)
class _Capture:
    plan: Plan
    sources: tuple[int, ...]  # each source tensor's address when the graph was captured
    graph: torch.cuda.CUDAGraph | None  # None: seen once (loaded plainly)
    failed: bool = False  # cannot be captured: always loaded plainly
    counts: tuple[int, int] = (0, 0)  # the chunk's tensors and bytes, all copied by the graph
    table: torch.Tensor | None = None  # what the graph's segment copy reads (its tile table)
    #: the sourced modules whose whole load the graph makes (their pieces quantized where they lie), and the
    #: `Direct`/`Experts` each was captured with: replayed only while those are theirs and none was started
    modules: tuple[int, ...] = ()
    owners: tuple[int, ...] = ()
    kept: tuple[torch.Tensor, ...] = ()  # what else the graph reads (the quantization's table)
    rest: tuple[int, ...] = ()  # the chunk's tensors the graph leaves out (of modules split across chunks)


def _owners(rnd: FastRound, modules: Sequence[int]) -> tuple[int, ...]:
    return tuple(id(rnd.plan.rebuilt[i].direct) for i in modules)


def _sourced_modules(rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]]
                     ) -> tuple[list[int], list[int]] | bool:
    """The modules a chunk rebuilds that a graph of its load may quantize: `FastRound`'s sourced modules (every
    write one of a quantized tensor) whose every element this chunk brings, none started this round yet; and the
    chunk's tensors that write any other module (one split across chunks: loaded plainly, beside the graph). Else
    a bool: whether a later round may find otherwise (a module not settled yet, none whole in this chunk); a
    module's other tensors (a bias) rule a graph out for good."""
    filled: dict[int, int] = {}
    for ops, _ in fast:
        for op in ops:
            if op.dst is not None:
                continue
            r = rnd.plan.rebuilt[op.module]
            d = r.direct
            if d is None or r.sourceable is None:
                return True
            if (not r.sourceable or r.fresh is None or op.tensor not in d.outs or not set(r.fresh) <= set(d.outs)
                    or op.write.src_offset is None):
                return False
            filled[op.module] = filled.get(op.module, 0) + op.write.numel
    whole = {i for i, n in filled.items() if n == rnd.plan.rebuilt[i].numel and rnd.replayable([i])}
    while True:  # a tensor left out leaves out every module it writes
        rest = [k for k, (ops, _) in enumerate(fast) if any(op.dst is None and op.module not in whole for op in ops)]
        out = {op.module for k in rest for op in fast[k][0] if op.dst is None} & whole
        if not out:
            break
        whole -= out
    if not whole:
        return bool(rest)  # a chunk of split modules alone: its neighbours may differ in a later round
    return sorted(whole), rest


class CapturedLoads:
    """A chunk whose copies all go straight into live tensors (COPY modules), or whose rebuilt modules are all
    fp8 ones quantized from their pieces within it (`FastRound`'s sourced modules), pushed again from the same
    addresses, is loaded by replaying a CUDA graph of its copies and quantization kernels: one launch instead of a
    Python call and a launch per write (an MoE chunk makes thousands), and no host walk of the pieces. The graph
    is captured the second time the chunk arrives (a one-off chunk never costs a capture). A graph copies from
    and to addresses: it is replayed only while the plan (so every destination) is the one it was captured with
    and every source tensor is at the address it had then, which is checked each push (for a reference set's
    views, by the serial number in its key: `chunk_parts`); anything else loads plainly.

    Inside the graph the copies are one segment copy kernel (`receiver.kernels.SegmentCopy`) where Triton runs:
    recorded one by one, an MoE chunk's thousands of expert copies each ramp up and drain on their own and run at
    about half the device's copy rate."""

    def __init__(self, limit: int = 1024) -> None:
        self._seen: dict[object, _Capture] = {}
        self._stream: torch.cuda.Stream | None = None
        self.limit = limit
        self.replayed = 0
        self.captured = 0
        #: record the copies as one segment copy kernel where Triton runs (False: PyTorch's copies)
        self.kernel = True

    @staticmethod
    def capturable(fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]]) -> bool:
        return all(src.is_cuda and all(op.dst is not None for op in ops)
                   and (src.is_contiguous() or all(op.whole and op.dst.is_contiguous()  # type: ignore[union-attr]
                                                   for op in ops if op.write.src_offset is not None))
                   for ops, src in fast)

    def ready(self, key: object, rnd: FastRound, weights: Sequence[tuple[str, torch.Tensor]]) -> _Capture | None:
        """The chunk `key` again, every tensor at the address it was captured from, under the same plan: its
        capture, to `replay` before anything else is looked at (no tensor is matched to its copies again: an MoE
        chunk has thousands); None: not such a chunk (`load` decides). A reference set's part keyed with its
        views' serial number (`chunk_parts`) is at its addresses by its key: no view is asked where it lies (an
        MoE chunk's part holds thousands)."""
        seen = self._seen.get(key)
        if (seen is None or seen.graph is None or seen.plan is not rnd.plan or len(seen.sources) != len(weights)
                or not self._fits(seen, rnd)):
            return None
        if _pinned(key):  # its first and last view asked all the same: a check that costs nothing
            first, last = weights[0][1], weights[-1][1]
            return seen if (first.data_ptr(), last.data_ptr()) == (seen.sources[0], seen.sources[-1]) else None
        return seen if seen.sources == tuple(map(_TB.data_ptr, [t for _, t in weights])) else None

    @staticmethod
    def _fits(seen: _Capture, rnd: FastRound) -> bool:
        return not seen.modules or (rnd.replayable(seen.modules) and seen.owners == _owners(rnd, seen.modules))

    def replay(self, seen: _Capture, rnd: FastRound) -> tuple[int, int]:
        """Replay a capture `ready` returned (its sourced modules counted finished in `rnd`); the (tensors, bytes)
        it loaded. The chunk's tensors at `seen.rest` are the caller's to load."""
        assert seen.graph is not None
        seen.graph.replay()
        rnd.replayed(seen.modules)
        self.replayed += 1
        return seen.counts

    def load(self, key: object, rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]]) -> bool:
        """Load `fast` by a graph (True), or return False for the caller to load it plainly."""
        sources = tuple(_TB.data_ptr(src) for _, src in fast)
        seen = self._seen.get(key)
        if seen is not None and seen.plan is rnd.plan and seen.sources == sources:
            if seen.failed or (seen.graph is not None and not self._fits(seen, rnd)):
                return False
            if seen.graph is not None:
                self.replay(seen, rnd)
                if seen.rest:
                    assert rnd.load([fast[k] for k in seen.rest]) == []  # sourced modules: none for processing
                return True
            return self._capture(key, rnd, fast, sources)
        if len(self._seen) >= self.limit:
            self._seen.clear()
        self._seen[key] = _Capture(rnd.plan, sources, None)
        return False

    def prime(self, key: object, rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]]) -> bool:
        """Capture chunk `key`'s copies ahead of its first push (its references sent at connect), without making
        them: that push replays the graph like any later one. True: captured (now or before)."""
        sources = tuple(_TB.data_ptr(src) for _, src in fast)
        seen = self._seen.get(key)
        same = seen is not None and seen.plan is rnd.plan and seen.sources == sources
        if same and seen is not None and (seen.failed or seen.graph is not None):
            return seen.graph is not None
        if len(self._seen) >= self.limit:
            self._seen.clear()
        return self._capture(key, rnd, fast, sources, run=False)

    def _capture(self, key: object, rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]],
                 sources: tuple[int, ...], run: bool = True) -> bool:
        from ....receiver import kernels

        if any(op.dst is None for ops, _ in fast for op in ops):
            return self._capture_sourced(key, rnd, fast, sources, run)
        if not self.capturable(fast):
            self._seen[key] = _Capture(rnd.plan, sources, None, failed=True)
            return False
        device = fast[0][1].device
        copies: kernels.SegmentCopy | None = None
        fills: list[tuple[torch.Tensor, float]] = []
        if self.kernel and kernels.available():
            try:
                kernels.warm(device)  # compiled outside the capture (normally done at connect)
            except Exception as e:  # no working kernel here: record PyTorch's copies from now on
                self.kernel = False
                get_logger().warning("vllm fast path: the segment copy kernel is unavailable; captured loads "
                                     "record PyTorch's copies", error=str(e))
            else:  # planned outside the capture (its tile table is an upload)
                dsts: list[torch.Tensor] = []
                srcs: list[torch.Tensor] = []
                for dst, src, value in rnd.writes(fast, []):
                    if src is None:
                        fills.append((dst, value))
                    else:
                        dsts.append(dst)
                        srcs.append(src)
                copies = kernels.SegmentCopy(dsts, srcs)

        def body() -> None:
            if copies is None:
                rnd.load(fast)
            else:
                for dst, value in fills:
                    dst.fill_(value)
                copies()

        graph = self._record(device, body)
        if graph is None:  # a copy this build cannot capture: this chunk loads plainly from now on
            self._seen[key] = _Capture(rnd.plan, sources, None, failed=True)
            return False
        counts = (len(fast), sum(src.numel() * src.element_size() for _, src in fast))
        # Only the tile table is kept: the graph holds addresses, and a kept view would keep a mapped buffer (and
        # the trainer's memory behind it) alive after the transport let it go.
        table = copies.captured() if copies is not None else None
        self._seen[key] = _Capture(rnd.plan, sources, graph, counts=counts, table=table)
        self.captured += 1
        if run:
            graph.replay()  # capturing recorded the copies without making them
        return True

    def _capture_sourced(self, key: object, rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]],
                         sources: tuple[int, ...], run: bool) -> bool:
        """`_capture` of a chunk with sourced modules (`_sourced_modules`): its writes walked once, outside the
        graph, then its fills, copies and quantization kernels recorded. Where the walk shows the chunk cannot be
        recorded after all (a source the kernels read from a copy, a table they cannot take, a failed capture),
        what it took is loaded plainly (`run`) and the chunk is loaded plainly from then on. `run`: whether it
        was loaded (False: not walked, the caller loads it); else whether it was captured."""
        from ....receiver import kernels
        from ..quant import quantize_sourced, sourced_launcher

        found = _sourced_modules(rnd, fast) if all(src.is_cuda for _, src in fast) else False
        if isinstance(found, bool):
            self._seen[key] = _Capture(rnd.plan, sources, None, failed=not found)
            return False
        modules, rest = found
        skip = set(rest)
        graphed = [x for k, x in enumerate(fast) if k not in skip]
        temps = rnd.temps
        complete: list[int] = []
        fills: list[tuple[torch.Tensor, float]] = []
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        for dst, src, value in rnd.writes(graphed, complete, batch=False):
            if src is None:
                fills.append((dst, value))
            else:
                dsts.append(dst)
                srcs.append(src)
        pieces, scales, layouts = rnd.take_ready(final=True)
        assert not complete  # `_sourced_modules`: nothing for vLLM's processing
        launch = sourced_launcher(pieces, scales, layouts, upload=True) if pieces and rnd.temps == temps else None
        graph = table = None
        if launch is not None:
            copies = kernels.SegmentCopy(dsts, srcs) if dsts and self.kernel and kernels.available() else None

            def body() -> None:
                for dst, value in fills:
                    dst.fill_(value)
                if copies is not None:
                    copies()
                elif dsts:
                    torch._foreach_copy_(dsts, srcs)
                launch()

            if run:  # the load itself, before the capture: a kernel this chunk's alignment needs compiles here
                body()
            graph = self._record(fast[0][1].device, body)
            table = copies.captured() if copies is not None else None
        if graph is None:
            self._seen[key] = _Capture(rnd.plan, sources, None, failed=True)
            if run and launch is None:  # what the walk took, loaded as `FastRound.load` would
                for dst, value in fills:
                    dst.fill_(value)
                if dsts:
                    torch._foreach_copy_(dsts, srcs, non_blocking=True)
                quantize_sourced(pieces, scales, layouts=layouts)
        else:
            assert launch is not None
            counts = (len(graphed), sum(src.numel() * src.element_size() for _, src in graphed))
            self._seen[key] = _Capture(rnd.plan, sources, graph, counts=counts, table=table, modules=tuple(modules),
                                       owners=_owners(rnd, modules), kept=(launch.table,), rest=tuple(rest))
            self.captured += 1
        if run and rest:  # the tensors of modules split across chunks, as any load takes them
            assert rnd.load([fast[k] for k in rest]) == []
        return run or graph is not None

    def _record(self, device: torch.device, body: Any) -> torch.cuda.CUDAGraph | None:
        """`body`'s launches recorded as a CUDA graph on a side stream that waits for the current one first (the
        chunk's ready event comes first); None where this build cannot capture them."""
        stream = torch.cuda.current_stream(device)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        side = self._stream
        side.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body()
                finally:
                    graph.capture_end()
        except Exception as e:  # e.g. a kernel that would compile inside the capture
            get_logger().info("vllm fast path: a chunk's load could not be captured", error=f"{type(e).__name__}: {e}")
            return None
        stream.wait_stream(side)
        return graph

    def clear(self) -> None:
        self._seen.clear()
