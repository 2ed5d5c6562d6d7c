"""The numbers a trace is read by: wall time, bytes, GB/s, the bounding stage, overlap achieved vs ideal.

Computed here once, so `streamsync trace summary`, the viewer's header and the trace index agree.

The bounding stage is found on the critical path: start at the span that ended last and walk back, at
each span, to the dependency that released it last: the same chunk's previous stage, the same stage's
previous chunk (a stage works on one chunk at a time), or, for a gather, the release that returned its
credit (`window` chunks earlier). Each stage's time on that path is how much shorter the push gets if the
stage gets faster; the stage with the most is the bound. Gaps on the path (a stage waiting on a queue slot,
the engines' start and finish calls) are `other`.

Overlap: with no overlap a push takes `serial` = the sum of every stage's busy time; perfectly overlapped
it takes `ideal` = the busiest stage's time. `overlap` = (serial - pipeline) / (serial - ideal), where
`pipeline` is first span start to last span end: 0 for strictly serial stages, 1 for the ideal.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from . import STAGES, Span, Trace


@dataclass
class Summary:
    push_id: str
    version: Any
    chunks: int
    bytes: int
    wall_ms: float
    gbps: float | None  # None for a failed push: its bytes did not all arrive
    bounding_stage: str | None
    critical_ms: dict[str, float]
    busy_ms: dict[str, float]
    pipeline_ms: float
    serial_ms: float
    ideal_ms: float
    overlap: float
    window: Any = None
    transport: Any = None
    engines: list[str] = field(default_factory=list)
    started: float = 0.0  # epoch seconds
    error: dict[str, Any] | None = None
    done: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def header(self) -> str:
        """The viewer's header line, as text."""
        bound = self.bounding_stage or "-"
        gbps = f"{self.gbps:.2f}" if self.gbps is not None else "-"
        return (f"wall {self.wall_ms:.1f} ms · {self.bytes / 2**20:.1f} MiB · {gbps} GB/s · "
                f"bound by {bound} · overlap {self.overlap:.0%} of ideal")

    def text(self, name: str = "") -> str:
        lines = [f"{name + ': ' if name else ''}push {self.push_id} v{self.version}, {self.chunks} chunks, "
                 f"window {self.window}, transport {self.transport}",
                 f"  {self.header()}",
                 f"  pipeline {self.pipeline_ms:.1f} ms; serial {self.serial_ms:.1f} ms, ideal {self.ideal_ms:.1f} ms",
                 f"  {'stage':<8} {'busy ms':>9} {'share':>6} {'critical ms':>12}"]
        wall = self.wall_ms or 1.0
        for st in (*STAGES, "other"):
            busy = self.busy_ms.get(st)
            busy_s = f"{busy:9.1f} {busy / wall:6.0%}" if busy is not None else f"{'':9} {'':6}"
            lines.append(f"  {st:<8} {busy_s} {self.critical_ms.get(st, 0.0):12.1f}")
        if self.error:
            e = self.error
            lines.append(f"  FAILED in {e['stage']} (chunk {e['chunk']}, engine {e['engine'] or '-'}): {e['message']}")
        return "\n".join(lines)


def critical_path(trace: Trace, window: int | None = None) -> list[Span]:
    """The chain of stage spans that bounds the push, last span first (see the module docstring)."""
    spans = trace.stage_spans()
    if not spans:
        return []
    at = {(s.stage, s.chunk): s for s in spans}
    order = {st: i for i, st in enumerate(STAGES)}
    chunks = sorted({s.chunk for s in spans})
    prev_chunk = dict(zip(chunks[1:], chunks[:-1], strict=True))
    pos = {c: i for i, c in enumerate(chunks)}

    def deps(s: Span) -> list[Span]:
        out = []
        k = order.get(s.stage, 0)
        if k > 0:
            out.append(at.get((STAGES[k - 1], s.chunk)))
        if s.chunk in prev_chunk:
            out.append(at.get((s.stage, prev_chunk[s.chunk])))
        if s.stage == "gather" and window and pos[s.chunk] >= window:
            out.append(at.get(("release", chunks[pos[s.chunk] - window])))
        return [d for d in out if d is not None and d.end <= s.start + 1e-6]

    cur: Span | None = max(spans, key=lambda s: s.end)
    path = []
    while cur is not None:
        path.append(cur)
        ds = deps(cur)
        cur = max(ds, key=lambda d: d.end) if ds else None
    return path


def _int(v: object, default: int) -> int:
    return int(v) if isinstance(v, int | float | str) and str(v).isdigit() else default


def summarize(trace: Trace) -> Summary:
    """The header numbers of a finished push, or of one still running (wall time up to now)."""
    spans = trace.stage_spans()
    meta = trace.meta
    window = meta.get("max_inflight")
    chunk_bytes: dict[int, int] = {}
    for s in spans:
        chunk_bytes[s.chunk] = max(chunk_bytes.get(s.chunk, 0), s.bytes)
    nbytes = _int(meta.get("bytes"), sum(chunk_bytes.values()))
    first = min((s.start for s in spans), default=0.0)
    last = max((s.end for s in spans), default=0.0)
    # No wall time yet: a running push (a live trace, t0 on this process's clock), or an older file.
    wall = trace.wall if trace.wall is not None else (trace.now() if trace.t0 else last)
    busy = {st: 0.0 for st in STAGES}
    for s in spans:
        busy[s.stage] = busy.get(s.stage, 0.0) + s.end - s.start
    crit = {st: 0.0 for st in STAGES}
    for s in critical_path(trace, _int(window, 0) or None):
        crit[s.stage] = crit.get(s.stage, 0.0) + s.end - s.start
    crit["other"] = max(wall - sum(crit.values()), 0.0)
    serial, ideal, pipe = sum(busy.values()), max(busy.values()), last - first
    overlap = (serial - pipe) / (serial - ideal) if serial - ideal > 1e-9 else 0.0
    engines = meta.get("engines") or sorted({s.receiver for s in trace.spans if s.receiver})
    return Summary(
        push_id=trace.push_id, version=meta.get("version"), chunks=_int(meta.get("chunks"), len(chunk_bytes)),
        bytes=nbytes, wall_ms=wall * 1e3, gbps=nbytes / wall / 1e9 if wall > 0 and not trace.error else None,
        bounding_stage=max(STAGES, key=lambda st: crit[st]) if spans else None,
        critical_ms={k: v * 1e3 for k, v in crit.items()}, busy_ms={k: v * 1e3 for k, v in busy.items()},
        pipeline_ms=pipe * 1e3, serial_ms=serial * 1e3, ideal_ms=ideal * 1e3, overlap=min(max(overlap, 0.0), 1.0),
        window=window, transport=meta.get("transport"),
        engines=[str(e) for e in engines] if isinstance(engines, list | tuple | set) else [],
        started=trace.epoch0, error=asdict(trace.error) if trace.error else None, done=trace.done,
    )
