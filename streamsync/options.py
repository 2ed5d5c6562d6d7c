"""`WeightSync`'s options, grouped by what they govern, each group a frozen dataclass checked when made.

Users pass them as keywords (`WeightSync(engines, chunk_bytes=..., timeout=...)`); `SyncKwargs` types those
keywords for checkers, and `split_options` routes each into its group, refusing an unknown one by name.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from .errors import ValidationError
from .metrics import DEFAULT as DEFAULT_METRICS
from .metrics import Metrics

if TYPE_CHECKING:
    from .report import ChunkDone, PushReport


@dataclass(frozen=True)
class PushOptions:
    """How a push runs.

    chunk_bytes:  byte budget per chunk (default 1 GiB on GPU, 64 MiB on CPU): bounds the bytes a chunk packs.
                  Tensors a transport sends by reference (CUDA IPC one copy) fill its own budget instead.
    max_inflight: credit window: chunks alive anywhere in the pipeline at once.
    timeout:      seconds any one wait may take (a stage on one chunk, an engine call).
    abort_timeout: seconds ending a failed round may take per engine (default min(10, timeout)): a failed
                  push raises within `timeout` plus this, not twice the timeout.
    reuse_plan:   keep the source and chunk plan for the next push of the same model (`WeightSync.plan`).
    source_options: keywords for the source the model gets (`MegatronSource`: hf_config, dtype, ...).
    engine_layout: engines that say which of their tensors are fused (`Fused.fused_layout`: vLLM-style
                  `qkv_proj`, `gate_up_proj`, stacked MoE experts) get each run of packed HF tensors that makes
                  up one of them as that one tensor (`pipeline.messages`); other engines keep HF names.
    """

    chunk_bytes: int | None = None
    max_inflight: int = 4
    timeout: float = 120.0
    abort_timeout: float | None = None
    reuse_plan: bool = True
    source_options: Mapping[str, Any] = field(default_factory=dict)
    engine_layout: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.max_inflight, bool) or not isinstance(self.max_inflight, int) or self.max_inflight < 1:
            raise ValidationError(f"max_inflight must be an integer >= 1, got {self.max_inflight!r}")
        if not _positive(self.timeout):
            raise ValidationError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if self.abort_timeout is not None and not _positive(self.abort_timeout):
            raise ValidationError(f"abort_timeout must be a positive number of seconds, got {self.abort_timeout!r}")
        if self.chunk_bytes is not None and (isinstance(self.chunk_bytes, bool) or not isinstance(
                self.chunk_bytes, int) or self.chunk_bytes <= 0):
            raise ValidationError(f"chunk_bytes must be a positive integer, got {self.chunk_bytes!r}")
        if not isinstance(self.source_options, Mapping):
            raise ValidationError(f"source_options must be a mapping of keywords, got {self.source_options!r:.80}")

    @property
    def abort_seconds(self) -> float:
        return min(10.0, self.timeout) if self.abort_timeout is None else self.abort_timeout


@dataclass(frozen=True)
class Checks:
    """What a push checks before any byte moves, and what it resets after.

    check_finite: refuse a push whose weights hold NaN or inf, naming the tensors (default). One read of
                  this rank's weights (a Triton kernel on a GPU) and one host sync; False skips it. A Megatron
                  rank that finds one raises at once; the sender then fails at its gather timeout.
    reset_prefix_cache: after every engine finished the round, reset its prefix cache, so no later request
                  reuses KV computed under the old weights (default). With False, a request whose prompt
                  shares a cached prefix (one cache block or more) with an earlier one is answered from KV of
                  the old weights: its logprobs are those of neither model (README, "What a push guarantees").
    strict_dtypes: refuse a trainer whose floating tensors are in another dtype than the engine holds them
                  (an fp32 trainer, a bf16 engine), naming them. By default they are cast to the engine's dtype
                  as they are packed, as vLLM's own loaders cast a checkpoint: said once in the log, and per push
                  in `PushReport.casts`.
    """

    check_finite: bool = True
    reset_prefix_cache: bool = True
    strict_dtypes: bool = False


@dataclass(frozen=True)
class Deltas:
    """Delta pushes (docs/delta.md): per tensor, only the elements that changed since the version every engine
    holds, or the tensor whole, whichever is smaller; engines apply them onto the version they hold.

    delta:        False (default): every push sends every byte. True: deltas through any transport. "auto":
                  deltas where the transport's link is the bound (`Transport.delta_pays`: the collective
                  transport, engines on other hosts), none for shared memory and CUDA IPC, where finding the
                  changes reads as many bytes as the copy they save. The sender then keeps a copy of the
                  served model (`PushReport.delta.shadow_bytes`), each engine one of what it last loaded.
    full_every:   every K-th push is full even when a delta could go (0: only when one must). A full push costs
                  its whole size once per K pushes; the digests below already catch a wrong base.
    verify_delta: each tensor a delta makes is checked on the engine against the sender's digest of it before it
                  is loaded; a mismatch is refused and the sync pushes in full.
    shadow_device_bytes: the most bytes of the trainer's GPU the sender's copy of the served model may take
                  (None: as much as leaves 1 GiB of it free; 0: none). Where it does not fit, the copy goes to
                  pinned host memory and the diff runs on the host (`report.delta.shadow_where` says which).
    engine_base:  where each engine keeps its copy of what it loaded: "auto" (default) on its GPU where that has
                  room for it and 2 GiB more, so deltas are decoded and checked there; "host" in host memory
                  (an engine colocated with the trainer, whose GPU memory the trainer needs). Engines beside the
                  trainer (shared memory, CUDA IPC) and workers of a sharded push keep it on the host either way.
    """

    delta: bool | str = False
    full_every: int = 32
    verify_delta: bool = True
    shadow_device_bytes: int | None = None
    engine_base: str = "auto"

    def __post_init__(self) -> None:
        if self.delta not in (False, True, "auto"):
            raise ValidationError(f"delta must be False, True or 'auto', got {self.delta!r}")
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 0:
            raise ValidationError(f"full_every must be an integer >= 0, got {self.full_every!r}")
        b = self.shadow_device_bytes
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise ValidationError(f"shadow_device_bytes must be None or an integer >= 0, got {b!r}")
        if self.engine_base not in ("auto", "host"):
            raise ValidationError(f"engine_base must be 'auto' or 'host', got {self.engine_base!r}")


@dataclass(frozen=True)
class Observers:
    """Who sees a push.

    trace_dir:  where each push writes its Chrome-trace JSON (default: none written).
    trace_live: serve the trace viewer from this process and stream every push's spans to it while the push
                runs: True (127.0.0.1:8765) or "HOST:PORT" (port 0 picks one); see `WeightSync.viewer_url`.
    on_chunk:   called with a `ChunkDone` after each chunk was acknowledged and freed (sender only).
    on_push:    called with the `PushReport` after each successful push (every rank). A hook that raises is
                logged as a warning; it does not fail the push.
    metrics:    where Prometheus metrics go (default `streamsync.metrics.DEFAULT`); None records none.
    engine_stats: after each round, ask every engine what its workers did (`PushReport.engine_rounds`: the path
                its tensors took, its timed phases, drawn in the trace, its extra memory): one call per engine
                (default). False skips it.
    """

    trace_dir: Path | None = None
    trace_live: bool | str = False
    on_chunk: Callable[[ChunkDone], object] | None = None
    on_push: Callable[[PushReport], object] | None = None
    metrics: Metrics | None = DEFAULT_METRICS
    engine_stats: bool = True

    def __post_init__(self) -> None:
        if self.trace_dir is not None and not isinstance(self.trace_dir, Path):
            object.__setattr__(self, "trace_dir", Path(self.trace_dir))


class SyncKwargs(TypedDict, total=False):
    """Every keyword `WeightSync` takes besides engines and transport (see the groups above)."""

    chunk_bytes: int | None
    max_inflight: int
    timeout: float
    abort_timeout: float | None
    reuse_plan: bool
    source_options: Mapping[str, Any] | None
    engine_layout: bool
    check_finite: bool
    reset_prefix_cache: bool
    strict_dtypes: bool
    delta: bool | str
    full_every: int
    verify_delta: bool
    shadow_device_bytes: int | None
    engine_base: str
    trace_dir: str | os.PathLike[str] | None
    trace_live: bool | str
    on_chunk: Callable[[ChunkDone], object] | None
    on_push: Callable[[PushReport], object] | None
    metrics: Metrics | None
    engine_stats: bool


GROUPS: tuple[type, ...] = (PushOptions, Checks, Deltas, Observers)


def split_options(options: Mapping[str, Any]) -> tuple[PushOptions, Checks, Deltas, Observers]:
    """The groups the keywords make."""
    names = {f.name: g for g in GROUPS for f in fields(g)}
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ValidationError(f"WeightSync got unknown option(s) {unknown}; known: {sorted(names)}")
    per: dict[type, dict[str, Any]] = {g: {} for g in GROUPS}
    for k, v in options.items():
        if k == "source_options" and v is None:
            v = {}
        per[names[k]][k] = v
    return PushOptions(**per[PushOptions]), Checks(**per[Checks]), Deltas(**per[Deltas]), Observers(**per[Observers])


def _positive(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v > 0
