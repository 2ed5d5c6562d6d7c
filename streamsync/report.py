"""What a push reports: `PushReport` per push, `ChunkDone` per chunk."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .errors import ValidationError
from .trace import Trace

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
    shadow_bytes: the sender's copy of the served model, kept between pushes
    shadow_where: where that copy lives ("cuda:0"; "host (pinned): ..." with the reason the GPU did not take it;
                  "host" for a CPU trainer or a sharded push)
    fallback:     this push is the full push that followed a delta an engine refused
    auto:         delta="auto": why this push went as a delta or in full, from this sync's measured pushes
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
    shadow_where: str = ""
    auto: str | None = None

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


PATHS = ("fast", "layerwise", "mixed", "none")


@dataclass(frozen=True)
class EngineRound:
    """What one worker of an engine did in a push's round, as it measured it (`ReportsRounds.round_stats`).

    path:           "fast" (every tensor copied straight into the engine's tensors), "layerwise" (every tensor
                    through vLLM's layerwise reload), "mixed" (counts below), "none" (no tensor arrived)
    fast_tensors, layerwise_tensors, fast_bytes, layerwise_bytes: what went which way (a fused tensor counts once)
    rebuilt_modules: modules whose kernels were derived again from their new tensors (`process_weights_after_loading`)
    direct_modules: of those, quantized by streamsync's kernels, not vLLM's processing (fp8 engines: the same
                    arithmetic, `vllm.worker.fastpath.direct.Direct`, `vllm.worker.quant`)
    sourced_modules: of those, quantized from the pushed tensors, with no fresh bf16 weight
    sourced_copied_bytes: of what those modules received, the bytes copied out of the pushed chunks first (a
                    piece the kernel cannot read where it lies, or a group a chunk left incomplete): 0 where every
                    piece was read where it lies
    traced:         where each tensor goes was traced in this round (the engine's layout changed, or its first)
    phase_ms:       milliseconds per phase in the worker (`vllm.worker.stats`: map, arm, load, process, finish;
                    `call`: the calls that opened and ended the round, whole, around the others)
    extra_bytes:    memory the round took above what the worker held at its start (None: not measured); `memory`
                    says how it was measured
    replayed_chunks: CUDA graphs replayed (`fastpath.CapturedLoads`): one per chunk, or one per part where a chunk
                    both packs and references tensors (the parts are captured apart)
    replayed_tensors: the tensors those graphs copied (fast-path tensors not copied one by one)
    draft_tensors:  tensors loaded into the engine's MTP draft model (an MTP layer's, through vLLM's layerwise
                    reload of the draft; counted in layerwise_tensors too)
    in_place_tensors: tensors a delta was decoded into straight in the engine's own tensors (counted in
                    fast_tensors too; `receiver.base_copy`)
    """

    engine: str
    worker: int
    path: str
    fast_tensors: int
    layerwise_tensors: int
    fast_bytes: int
    layerwise_bytes: int
    rebuilt_modules: int
    traced: bool
    phase_ms: dict[str, float]
    extra_bytes: int | None
    memory: str
    #: (phase, chunk or None, start, end): wall-clock seconds (`time.time`) in the worker
    phases: tuple[tuple[str, int | None, float, float], ...] = field(default=(), repr=False)
    replayed_chunks: int = 0
    replayed_tensors: int = 0
    direct_modules: int = 0
    draft_tensors: int = 0
    in_place_tensors: int = 0
    sourced_modules: int = 0
    sourced_copied_bytes: int = 0

    @classmethod
    def from_wire(cls, engine: str, d: Mapping[str, Any]) -> EngineRound:
        """An engine's plain-data answer, checked field by field (it crossed a process boundary)."""
        def num(key: str) -> int:
            v = d.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValidationError(f"engine {engine!r} round stats: {key} must be an int >= 0, got {v!r:.40}")
            return v

        path = d.get("path")
        if path not in PATHS:
            raise ValidationError(f"engine {engine!r} round stats: path must be one of {PATHS}, got {path!r:.40}")
        phases = []
        for p in d.get("phases") or ():
            if (not isinstance(p, list | tuple) or len(p) != 4 or not isinstance(p[0], str)
                    or not (p[1] is None or isinstance(p[1], int))
                    or not all(isinstance(x, int | float) for x in p[2:])):
                raise ValidationError(f"engine {engine!r} round stats: malformed phase {p!r:.80}")
            phases.append((p[0], p[1], float(p[2]), float(p[3])))
        ms: dict[str, float] = {}
        for name, _, a, b in phases:
            ms[name] = ms.get(name, 0.0) + (b - a) * 1e3
        extra = d.get("extra_bytes")
        return cls(engine, num("rank"), path, num("fast_tensors"), num("layerwise_tensors"), num("fast_bytes"),
                   num("layerwise_bytes"), num("rebuilt_modules"), bool(d.get("traced")), ms,
                   extra if isinstance(extra, int) and not isinstance(extra, bool) else None,
                   str(d.get("memory") or ""), tuple(phases), num("replayed_chunks"), num("replayed_tensors"),
                   num("direct_modules"), num("draft_tensors"), num("in_place_tensors"), num("sourced_modules"),
                   num("sourced_copied_bytes"))

    def to_dict(self) -> dict[str, Any]:
        # shallow (every field but `phase_ms` is immutable): `asdict` deep-copies the phases only to drop them
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "phases"}
        out["phase_ms"] = dict(self.phase_ms)
        return out


@dataclass
class PushReport:
    """What one push did. `bytes` is what went on the wire (a delta push's encoded bytes; a sharded push's, this
    rank's), `model_bytes` the model's bytes it brought up to date. `seconds` is the whole `push` call's wall time:
    planning, the finite check and the ranks' agreement included (the trace's `prepare_ms` is that part).
    `stage_seconds` is each stage's busy time (sum of its spans)."""

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
    #: what each engine's workers did in the round, as they measured it (empty where engines cannot say, or
    #: with `engine_stats=False`); `engine_paths` sums it up per engine
    engine_rounds: list[EngineRound] = field(default_factory=list)
    trace_path: str | None = None
    trace: Trace | None = field(default=None, repr=False)
    #: a sync that pushes deltas: what this push sent (None: delta pushes are off)
    delta: DeltaReport | None = None
    #: engine -> the tensors of this push it did not load (an MTP layer's, where the engine's main model skips
    #: them: `Family.declined_layers`); logged once per engine too
    not_loaded: dict[str, list[str]] = field(default_factory=dict)
    #: "float32 -> bfloat16" -> how many tensors the push cast to the engines' dtype (`Checks.strict_dtypes`)
    casts: dict[str, int] = field(default_factory=dict)
    #: the model's bytes the push brought up to date; `bytes` is what went on the wire (less, for a delta)
    model_bytes: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def engine_paths(self) -> dict[str, str]:
        """Engine -> the path its tensors took: "fast", "layerwise", "mixed" (or "none"), across its workers."""
        out: dict[str, str] = {}
        for r in self.engine_rounds:
            prev = out.get(r.engine)
            out[r.engine] = r.path if prev in (None, r.path) else "mixed"
        return out

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("trace", "engine_rounds")}
        out["engine_rounds"] = [r.to_dict() for r in self.engine_rounds]
        if self.delta is not None:
            out["delta"] = asdict(self.delta)
        return out

    def summary(self) -> str:
        busy = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.stage_seconds.items())
        return (f"push {self.push_id} v{self.version}: {self.bytes / MiB:.1f} MiB in {self.chunks} chunks, "
                f"{self.seconds * 1e3:.0f} ms ({self.gbps:.2f} GB/s) to {len(self.engines)} engine(s); "
                f"busy: {busy}; peak in flight {self.peak_bytes_inflight / MiB:.1f} MiB"
                + (f"; sharded from {self.senders} ranks" if self.path == "sharded" else "")
                + (f"; {self.delta.mode} push of a {self.model_bytes / MiB:.1f} MiB model"
                   + (f", {1 - self.bytes / self.model_bytes:.0%} saved" if self.model_bytes else "")
                   if self.delta else "")
                + (f"; garbage collection {self.gc_ms:.0f} ms" if self.gc_ms >= 1 else "")
                + ("; engine paths " + ", ".join(f"{k} {v}" for k, v in self.engine_paths.items())
                   if self.engine_rounds else "")
                + (f"; trace {self.trace_path}" if self.trace_path else ""))
