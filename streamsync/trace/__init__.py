"""Spans per chunk and stage, counters, and Chrome-trace export (opens in Perfetto and the viewer).

A span is one stage's work on one chunk; `send` also gets one span per engine (`receiver` set), so a slow
engine shows on its own lane, and each engine's own phases (`engine.*`, `receiver` the engine: what its
workers timed themselves, and its cache reset) get a lane of their own. Counters sample the pipeline's state
(chunks alive, bytes alive, queue depths) whenever it changes. Times are seconds on `time.perf_counter`
relative to `t0`, the push start; `epoch0` is the wall-clock time of `t0`, so exported timestamps are epoch
microseconds and line up with other pushes and with `torch.profiler` traces of the same process (`pid`).

`begin()` and `end()` bracket the push exactly as `PushReport.seconds` measures it (the report takes its
number from `end()`), so the viewer's wall time and the report's are one number. A failed push records its
error (`fail`): stage, chunk, engine and message, written into the file and drawn by the viewer.
"""

from __future__ import annotations

import json
import os
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STAGES = ("gather", "convert", "pack", "send", "release")
#: what an engine did in its own process, drawn on its own lane ("engine <name>"): its workers' phases
#: (`streamsync.vllm.worker.stats`) and the prefix-cache reset (timed by the sender: the scheduler does it)
ENGINE_STAGES = ("engine.map", "engine.arm", "engine.load", "engine.process", "engine.finish", "engine.cache_reset",
                 "engine.call")


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
class TraceError:
    """Where and why a push failed."""

    stage: str
    chunk: int | None
    engine: str | None
    message: str


@dataclass
class Trace:
    """Everything recorded during one push."""

    push_id: str
    t0: float = field(default_factory=time.perf_counter)
    epoch0: float = field(default_factory=time.time)
    pid: int = field(default_factory=os.getpid)
    spans: list[Span] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    counts: dict[str, float] = field(default_factory=dict)
    meta: dict[str, object] = field(default_factory=dict)
    wall: float | None = None  # seconds from begin() to end(): the report's `seconds`
    error: TraceError | None = None
    # re-entrant: a garbage collection can start inside any allocation, also one made while this lock is held,
    # and its callback (`_on_gc`) counts into the trace from the same thread
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def begin(self, at: float | None = None) -> float:
        """Mark the push start (time 0 from here on; `at`: an earlier perf_counter value, the call's start);
        returns the perf_counter value of it."""
        now, epoch = time.perf_counter(), time.time()
        self.t0 = now if at is None else min(at, now)
        self.epoch0 = epoch - (now - self.t0)
        return self.t0

    def end(self) -> float:
        """Mark the push end; returns the push's wall time in seconds."""
        self.wall = self.now()
        return self.wall

    def fail(self, stage: str, chunk: int | None, engine: str | None, message: str) -> None:
        self.error = TraceError(stage, chunk, engine, message)
        self.end()

    @property
    def done(self) -> bool:
        return self.wall is not None

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

    def engine_phases(self, engine: str, phases: Iterable[tuple[str, int | None, float, float]]) -> None:
        """An engine's own phases, stamped with its wall clock (`time.time`), as `engine.<phase>` spans."""
        with self._lock:
            for phase, chunk, a, b in phases:
                self.spans.append(Span(self.push_id, -1 if chunk is None else chunk, f"engine.{phase}",
                                       a - self.epoch0, b - self.epoch0, 0, engine))

    def sample(self, name: str, value: float) -> None:
        with self._lock:
            self.samples.append(Sample(name, self.now(), value))

    def count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    # -- summaries -------------------------------------------------------------------------------------

    def stage_spans(self) -> list[Span]:
        """One span per (chunk, stage): the per-engine send spans and the engines' own phases left out."""
        return [s for s in self.spans if s.receiver is None]

    def engine_spans(self) -> list[Span]:
        """The engines' own phases (`ENGINE_STAGES`)."""
        return [s for s in self.spans if s.stage.startswith("engine.")]

    def busy_seconds(self) -> dict[str, float]:
        out = {s: 0.0 for s in STAGES}
        for sp in self.stage_spans():
            out[sp.stage] = out.get(sp.stage, 0.0) + (sp.end - sp.start)
        return out

    def chunk_lifetimes(self) -> dict[int, tuple[float, float]]:
        """Per chunk: first span start to last span end (alive from its gather to its release)."""
        life: dict[int, tuple[float, float]] = {}
        for sp in self.spans:
            if sp.stage.startswith("engine."):  # the engine's own work: not a chunk alive in the pipeline
                continue
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
        """Chrome trace-event JSON: one process (the trainer's pid), one thread per stage and per engine's
        send, flow arrows from each chunk's gather through its stages to its release, epoch-µs timestamps."""
        pid = self.pid
        us = self.epoch0 * 1e6
        events: list[dict] = [
            {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": "streamsync"}},
        ]
        tids: dict[str, int] = {}
        tid_base = 1_000  # clear of the small thread ids torch.profiler gives its own lanes

        def tid(lane: str) -> int:
            if lane not in tids:
                tids[lane] = tid_base + len(tids)
                events.append({"ph": "M", "pid": pid, "tid": tids[lane], "name": "thread_name",
                               "args": {"name": lane}})
                events.append({"ph": "M", "pid": pid, "tid": tids[lane], "name": "thread_sort_index",
                               "args": {"sort_index": tids[lane]}})
            return tids[lane]

        for s in STAGES:
            tid(s)
        by_chunk: dict[int, list[tuple[Span, int]]] = {}
        for sp in sorted(self.spans, key=lambda s: s.start):
            lane = (sp.stage if sp.receiver is None else f"engine {sp.receiver}" if sp.stage.startswith("engine.")
                    else f"send → {sp.receiver}")
            events.append({
                "ph": "X", "pid": pid, "tid": tid(lane), "name": f"{sp.stage} #{sp.chunk}", "cat": "streamsync",
                "ts": us + sp.start * 1e6, "dur": max(sp.end - sp.start, 0.0) * 1e6,
                "args": {"chunk": sp.chunk, "bytes": sp.bytes, "receiver": sp.receiver, "stage": sp.stage,
                         "push_id": self.push_id},
            })
            if sp.receiver is None:
                by_chunk.setdefault(sp.chunk, []).append((sp, tids[lane]))
        # Flow steps bind to the slice that encloses their timestamp on their thread (the end step too: "bp": "e").
        salt = zlib.crc32(self.push_id.encode()) << 20
        for chunk, steps in by_chunk.items():
            for i, (sp, t) in enumerate(steps):
                ph = "s" if i == 0 else ("f" if i == len(steps) - 1 else "t")
                if len(steps) == 1:
                    break
                events.append({"ph": ph, "pid": pid, "tid": t, "name": f"chunk {chunk}", "cat": "chunk",
                               "id": salt + chunk, "ts": us + sp.start * 1e6, **({"bp": "e"} if ph == "f" else {})})
        for sm in self.samples:
            events.append({"ph": "C", "pid": pid, "name": sm.name, "ts": us + sm.t * 1e6,
                           "args": {sm.name: sm.value}})
        other: dict[str, Any] = {"push_id": self.push_id, "counts": self.counts, "epoch0": self.epoch0,
                                 "pid": pid, "wall_s": self.wall,
                                 "error": asdict(self.error) if self.error else None}
        other.update({k: v if isinstance(v, int | float | str | list | dict | bool) or v is None else str(v)
                      for k, v in self.meta.items()})
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}

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


_OTHER_KEYS = ("push_id", "counts", "epoch0", "pid", "wall_s", "error")


def from_chrome(data: dict) -> Trace:
    """Rebuild a Trace from the Chrome-trace JSON `Trace.to_chrome` wrote (other events are skipped, so a
    file merged with a torch.profiler trace still loads)."""
    other = data.get("otherData", {}) or {}
    push_id = str(other.get("push_id", ""))
    epoch_us = float(other.get("epoch0") or 0.0) * 1e6
    tr = Trace(push_id, t0=0.0, epoch0=epoch_us / 1e6, pid=int(other.get("pid") or 0))
    for ev in data.get("traceEvents", []):
        a = ev.get("args") or {}
        if ev.get("ph") == "X" and "stage" in a and a.get("push_id", push_id) == push_id:
            start = (ev["ts"] - epoch_us) / 1e6
            tr.spans.append(Span(push_id, a["chunk"], a["stage"], start, start + ev["dur"] / 1e6,
                                 a.get("bytes", 0), a.get("receiver")))
        elif ev.get("ph") == "C" and ev.get("pid") == tr.pid and ev.get("name") in a:
            tr.samples.append(Sample(ev["name"], (ev["ts"] - epoch_us) / 1e6, a[ev["name"]]))
    tr.counts = dict(other.get("counts") or {})
    tr.wall = other.get("wall_s")
    if other.get("error"):
        tr.error = TraceError(**other["error"])
    tr.meta = {k: v for k, v in other.items() if k not in _OTHER_KEYS}
    return tr


def load(path: str | os.PathLike) -> Trace:
    """Read a trace file written by `Trace.write`."""
    return from_chrome(json.loads(Path(path).read_text()))


def load_spans(path: str | os.PathLike) -> list[Span]:
    """Read the spans back from a Chrome-trace file written by `Trace.write`."""
    return load(path).spans


def merge(profiler: dict, *traces: dict) -> dict:
    """One Chrome-trace holding a `torch.profiler` trace and streamsync traces of the same process, on one clock.

    Kineto writes `ts` as epoch microseconds less `baseTimeNanoseconds` (stored in the file); streamsync writes
    plain epoch microseconds, so its events are shifted by that base. Both use the process's pid.
    """
    base_us = float(profiler.get("baseTimeNanoseconds", 0)) / 1e3
    events = list(profiler.get("traceEvents", []))
    for tr in traces:
        events += [{**e, "ts": e["ts"] - base_us} if "ts" in e else e for e in tr.get("traceEvents", [])]
    other = dict(profiler.get("otherData") or {})
    other["streamsync"] = [tr.get("otherData", {}) for tr in traces]
    return {**profiler, "traceEvents": events, "otherData": other}


# -- garbage collections during a push --------------------------------------------------------------------

_gc_traces: list[Trace] = []  # pushes running now (a gc callback adds its pause to each)
_gc_started = [0.0]
_gc_lock = threading.Lock()


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter()
        return
    if not _gc_traces:
        return
    us = int((time.perf_counter() - _gc_started[0]) * 1e6)
    for tr in list(_gc_traces):
        tr.count("gc_us", us)
        tr.count(f"gc_gen{info.get('generation', '?')}")


@contextmanager
def watching_gc(trace: Trace) -> Iterator[None]:
    """Count the interpreter's garbage collections while `trace`'s push runs (`counts["gc_us"]`, and one count
    per generation). A full collection in a trainer process holding many Python objects (megatron) pauses every
    thread for ~0.2 s, whatever the push is doing; the report says so instead of leaving a slow push unexplained."""
    import gc

    with _gc_lock:
        if _on_gc not in gc.callbacks:
            gc.callbacks.append(_on_gc)
        _gc_traces.append(trace)
    try:
        yield
    finally:
        with _gc_lock:
            _gc_traces.remove(trace)
