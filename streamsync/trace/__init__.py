"""Spans per chunk and stage, counters, and Chrome-trace export (opens in Perfetto and the viewer).

A span is one stage's work on one chunk. Counters sample the pipeline's state (chunks alive, bytes alive,
queue depths) whenever it changes. Times are seconds on `time.perf_counter`, relative to the push start.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

STAGES = ("gather", "convert", "pack", "send", "release")


@dataclass(slots=True)
class Span:
    push_id: str
    chunk: int
    stage: str
    start: float
    end: float
    bytes: int = 0
    receiver: str | None = None


@dataclass(slots=True)
class Sample:
    name: str
    t: float
    value: float


@dataclass
class Trace:
    """Everything recorded during one push."""

    push_id: str
    t0: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    meta: dict[str, object] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    @contextmanager
    def span(self, stage: str, chunk: int, nbytes: int = 0, receiver: str | None = None) -> Iterator[None]:
        start = self.now()
        try:
            yield
        finally:
            self.add_span(stage, chunk, start, self.now(), nbytes, receiver)

    def add_span(
        self, stage: str, chunk: int, start: float, end: float, nbytes: int = 0, receiver: str | None = None
    ) -> None:
        with self._lock:
            self.spans.append(Span(self.push_id, chunk, stage, start, end, nbytes, receiver))

    def sample(self, name: str, value: float) -> None:
        with self._lock:
            self.samples.append(Sample(name, self.now(), value))

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    # -- summaries -------------------------------------------------------------------------------------

    def busy_seconds(self) -> dict[str, float]:
        out = {s: 0.0 for s in STAGES}
        for sp in self.spans:
            out[sp.stage] = out.get(sp.stage, 0.0) + (sp.end - sp.start)
        return out

    def chunk_lifetimes(self) -> dict[int, tuple[float, float]]:
        """Per chunk: first span start to last span end (alive from its gather to its release)."""
        life: dict[int, tuple[float, float]] = {}
        for sp in self.spans:
            a, b = life.get(sp.chunk, (sp.start, sp.end))
            life[sp.chunk] = (min(a, sp.start), max(b, sp.end))
        return life

    def max_alive(self) -> int:
        """Most chunks alive at one instant, from the spans alone."""
        events = []
        for a, b in self.chunk_lifetimes().values():
            events += [(a, 1), (b, -1)]
        alive = peak = 0
        for _, d in sorted(events, key=lambda e: (e[0], e[1])):  # ends sort before starts at a tie
            alive += d
            peak = max(peak, alive)
        return peak

    # -- export ----------------------------------------------------------------------------------------

    def to_chrome(self) -> dict:
        """Chrome trace-event JSON: one process per push, one thread per stage (and per receiver)."""
        pid = 1
        events: list[dict] = [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"push {self.push_id}"}},
        ]
        tids: dict[str, int] = {}

        def tid(lane: str) -> int:
            if lane not in tids:
                tids[lane] = len(tids) + 1
                events.append({"ph": "M", "pid": pid, "tid": tids[lane], "name": "thread_name",
                               "args": {"name": lane}})
                events.append({"ph": "M", "pid": pid, "tid": tids[lane], "name": "thread_sort_index",
                               "args": {"sort_index": tids[lane]}})
            return tids[lane]

        for s in STAGES:
            tid(s)
        for sp in sorted(self.spans, key=lambda s: s.start):
            lane = sp.stage if sp.receiver is None or sp.stage != "send" else f"send → {sp.receiver}"
            events.append({
                "ph": "X", "pid": pid, "tid": tid(lane), "name": f"{sp.stage} #{sp.chunk}",
                "ts": sp.start * 1e6, "dur": max(sp.end - sp.start, 0.0) * 1e6,
                "args": {"chunk": sp.chunk, "bytes": sp.bytes, "receiver": sp.receiver, "stage": sp.stage},
            })
        for sm in self.samples:
            events.append({"ph": "C", "pid": pid, "name": sm.name, "ts": sm.t * 1e6, "args": {sm.name: sm.value}})
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {"push_id": self.push_id, "counts": self.counts, **{k: str(v) for k, v in self.meta.items()}},
        }

    def write(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_chrome()))
        tmp.replace(p)
        return p

    def to_dict(self) -> dict:
        return {
            "push_id": self.push_id,
            "spans": [asdict(s) for s in self.spans],
            "samples": [asdict(s) for s in self.samples],
            "counts": dict(self.counts),
        }


def load_spans(path: str | os.PathLike) -> list[Span]:
    """Read the spans back from a Chrome-trace file written by `Trace.write`."""
    data = json.loads(Path(path).read_text())
    push_id = data.get("otherData", {}).get("push_id", "")
    spans = []
    for ev in data["traceEvents"]:
        if ev.get("ph") == "X":
            a = ev["args"]
            start = ev["ts"] / 1e6
            spans.append(Span(push_id, a["chunk"], a["stage"], start, start + ev["dur"] / 1e6,
                              a.get("bytes", 0), a.get("receiver")))
    return spans
