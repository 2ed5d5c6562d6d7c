"""What a push reports: `PushReport` per push, `ChunkDone` per chunk."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .trace import Trace

if TYPE_CHECKING:
    pass


MiB = 1 << 20

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class ChunkDone:
    """What `on_chunk` receives once a chunk was acknowledged by every engine and its buffer freed."""

    push_id: str
    version: int
    chunk: int
    chunks: int
    bytes: int
    tensors: int


@dataclass(frozen=True, slots=True)
class DeltaReport:
    """What a push of a sync that pushes deltas did (`WeightSync(delta=...)`, docs/delta.md).

    mode:         "delta" (changed elements against `base`) or "full" (every byte; the shadow made anew)
    why_full:     why a full push went where deltas were on ("first push", "every 32 pushes", "refused: ...")
    wire_bytes:   packed bytes sent (the full push's `bytes` for a full push)
    changed / elements: elements that changed, of those compared (delta mode)
    encodings:    how many tensors went as each encoding (same, idx16, mask, full)
    shadow_bytes: the sender's host copy of the served model, kept between pushes
    fallback:     this push is the full push that followed a delta an engine refused
    """

    mode: str
    wire_bytes: int
    shadow_bytes: int
    why_full: str | None = None
    base: tuple[int, str] | None = None
    changed: int = 0
    elements: int = 0
    encodings: dict[str, int] = field(default_factory=dict)
    fallback: bool = False

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


@dataclass
class PushReport:
    """What one push did. `stage_seconds` is each stage's busy time (sum of its spans)."""

    push_id: str
    version: int
    seconds: float
    bytes: int
    chunks: int
    stage_seconds: dict[str, float]
    peak_bytes_inflight: int
    max_chunks_alive: int
    collectives: int
    engines: list[str]
    #: engine -> whether its prefix cache was reset after the round (absent when `reset_prefix_cache=False`)
    cache_reset: dict[str, bool] = field(default_factory=dict)
    #: milliseconds the interpreter spent in garbage collections during the push (any thread's)
    gc_ms: float = 0.0
    #: "single-sender": one rank sent whole tensors (after gathering them); "sharded": every rank that holds
    #: a slice sent it to the workers that hold it (`transport="p2p"`)
    path: str = "single-sender"
    #: trainer ranks that sent bytes; `bytes` counts what this rank sent
    senders: int = 1
    trace_path: str | None = None
    trace: Trace | None = field(default=None, repr=False)
    #: a sync that pushes deltas: what this push sent (None: delta pushes are off)
    delta: DeltaReport | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        if self.delta is not None:
            out["delta"] = asdict(self.delta)
        return out

    def summary(self) -> str:
        busy = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.stage_seconds.items())
        return (f"push {self.push_id} v{self.version}: {self.bytes / MiB:.1f} MiB in {self.chunks} chunks, "
                f"{self.seconds * 1e3:.0f} ms ({self.gbps:.2f} GB/s) to {len(self.engines)} engine(s); "
                f"busy: {busy}; peak in flight {self.peak_bytes_inflight / MiB:.1f} MiB"
                + (f"; sharded from {self.senders} ranks" if self.path == "sharded" else "")
                + (f"; {self.delta.mode} push, {self.delta.wire_bytes / MiB:.2f} MiB sent" if self.delta else "")
                + (f"; garbage collection {self.gc_ms:.0f} ms" if self.gc_ms >= 1 else "")
                + (f"; trace {self.trace_path}" if self.trace_path else ""))
