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


def chunk_parts(info: dict[str, Any], split: tuple[int, int] | None, weights: Weights
                ) -> list[tuple[tuple | None, Weights]]:
    """A chunk's tensors in the parts its captured loads are kept by, each with its key: the packed part by its
    layout and the buffer it arrived in, the referenced part by its reference set (the trainer storages it
    names), so a graph captured for the references at connect serves whichever buffer the packed part comes in.
    `split`: (packed, referenced) tensor counts of the chunk as the receiver joined it. A chunk loaded otherwise
    (a delta, split tensors) is one part, keyed by all three."""
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
        parts.append((("refs", rid), weights[n:] if n else weights))
    return parts


@dataclass(slots=True)
class _Capture:
    plan: Plan
    sources: tuple[int, ...]  # each source tensor's address when the graph was captured
    graph: torch.cuda.CUDAGraph | None  # None: seen once (loaded plainly)
    failed: bool = False  # cannot be captured: always loaded plainly
    counts: tuple[int, int] = (0, 0)  # the chunk's tensors and bytes, all copied by the graph
    table: torch.Tensor | None = None  # what the graph's segment copy reads (its tile table)


class CapturedLoads:
    """A chunk whose copies all go straight into live tensors (COPY modules only), pushed again from the same
    addresses, is loaded by replaying a CUDA graph of its copies: one launch instead of a Python call and a
    launch per write (an MoE chunk makes thousands). The graph is captured the second time the chunk arrives (a
    one-off chunk never costs a capture). A graph copies from and to addresses: it is replayed only while the
    plan (so every destination) is the one it was captured with and every source tensor is at the address it
    had then, which is checked each push; anything else loads plainly.

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
        chunk has thousands); None: not such a chunk (`load` decides)."""
        seen = self._seen.get(key)
        if seen is None or seen.graph is None or seen.plan is not rnd.plan or len(seen.sources) != len(weights):
            return None
        return seen if seen.sources == tuple(map(_TB.data_ptr, [t for _, t in weights])) else None

    def replay(self, seen: _Capture) -> tuple[int, int]:
        """Replay a capture `ready` returned; its chunk's (tensors, bytes)."""
        assert seen.graph is not None
        seen.graph.replay()
        self.replayed += 1
        return seen.counts

    def load(self, key: object, rnd: FastRound, fast: Sequence[tuple[tuple[_Op, ...], torch.Tensor]]) -> bool:
        """Load `fast` by a graph (True), or return False for the caller to load it plainly."""
        sources = tuple(_TB.data_ptr(src) for _, src in fast)
        seen = self._seen.get(key)
        if seen is not None and seen.plan is rnd.plan and seen.sources == sources:
            if seen.failed:
                return False
            if seen.graph is not None:
                seen.graph.replay()
                self.replayed += 1
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
        stream = torch.cuda.current_stream(device)
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device)
        side = self._stream
        side.wait_stream(stream)  # the chunk's ready event, waited on by the current stream, comes first
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    if copies is None:
                        rnd.load(fast)
                    else:
                        for dst, value in fills:
                            dst.fill_(value)
                        copies()
                finally:
                    graph.capture_end()
        except RuntimeError as e:  # a copy this build cannot capture: this chunk loads plainly from now on
            get_logger().info("vllm fast path: a chunk's copies could not be captured", error=str(e))
            self._seen[key] = _Capture(rnd.plan, sources, None, failed=True)
            return False
        stream.wait_stream(side)
        counts = (len(fast), sum(src.numel() * src.element_size() for _, src in fast))
        # Only the tile table is kept: the graph holds addresses, and a kept view would keep a mapped buffer (and
        # the trainer's memory behind it) alive after the transport let it go.
        table = copies.captured() if copies is not None else None
        self._seen[key] = _Capture(rnd.plan, sources, graph, counts=counts, table=table)
        self.captured += 1
        if run:
            graph.replay()  # capturing recorded the copies without making them
        return True

    def clear(self) -> None:
        self._seen.clear()
