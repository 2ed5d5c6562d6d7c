"""What one push carries through the pipeline: the push itself and each chunk's work."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import torch

from ..engines.base import Engine
from ..plan.chunk import ChunkPlan
from ..sources.base import Source
from ..trace import Trace
from ..transports.base import SendBuffer, Transport

if TYPE_CHECKING:
    from ..delta.push import DeltaPush
    from .messages import Messages


STAGES = ("gather", "convert", "pack", "send", "release")  # the order every chunk goes through


@dataclass
class Work:
    """One chunk on its way through the stages."""

    plan: ChunkPlan
    gathered: object = None
    tensors: Sequence[torch.Tensor] | None = None
    buf: SendBuffer | None = None
    #: what the chunk sends where that is not its plan (a delta push: the plan of its encoded pieces)
    wire: ChunkPlan | None = None
    #: the delta mark of its messages (`UpdateMessage.delta`)
    delta: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class PushJob:
    """What one push is given; built by WeightSync's attempt (`attempt.run_attempt`), read by the stages."""

    push_id: str
    version: int
    source: Source
    transport: Transport | None
    engines: Sequence[Engine]
    plans: Sequence[ChunkPlan]
    trace: Trace
    messages: Messages | None = None  # builds each engine's UpdateMessage (senders only)
    max_inflight: int = 4
    timeout: float = 120.0
    #: chunk -> names of its tensors whose decoder layer continues in a later chunk (receivers keep no views)
    hold: Mapping[int, list[str]] = field(default_factory=dict)
    owner: str | None = None  # the WeightSync's id: every message carries it (receivers refuse others)
    on_chunk: Callable[[int, int], None] | None = None
    engine_layout: bool = True  # engines get chunks in their own fused layout where they declared one
    delta: DeltaPush | None = None  # a sync that pushes deltas: this push's mode and shadow
    # chunk index -> (plan, converted tensors) as last checked: a source that hands back the same list for the
    # same plan (its cached views) is not checked again; kept across pushes by WeightSync (a cache it lends)
    checked: dict[int, tuple[ChunkPlan, Sequence[torch.Tensor]]] = field(default_factory=dict)


@dataclass
class Push:
    """One push as it runs: its job, and what changes while the stages work on it (read by the watchdog, the
    failure path and the report)."""

    job: PushJob
    live: dict[int, SendBuffer] = field(default_factory=dict)
    busy: dict[str, tuple[int, float]] = field(default_factory=dict)  # stage -> (chunk, since), for the watchdog
    cut: dict[str, int] = field(default_factory=dict)  # stage -> chunk it was on when an error or cancel hit
    last: dict[str, int] = field(default_factory=dict)  # stage -> the last chunk it took up
    started: anyio.Event | None = None  # set once every engine opened its round: sends wait for it
    send_idle: bool = False  # the send stage waits for its next chunk
    send_took: anyio.Event | None = None  # set when the send stage takes the chunk the pack stage waits on
    #: chunk -> set once its requests left for every engine (`engines.base.DISPATCHED`), or its send ended
    #: (`Source.gathers_here` on a GPU: the next chunk's gather waits for it)
    dispatched: dict[int, anyio.Event] = field(default_factory=dict)
    sent_any: bool = False  # a chunk was handed to the engines: a failed push may have left them mixed
    bytes_alive: int = 0
    peak_bytes: int = 0
    chunks_alive: int = 0

    def where(self) -> dict[str, int]:
        """stage -> chunk of the stages at work when the push was stopped; a chunk between two stages (one
        finished with it, the next not yet started) counts as the next stage's."""
        at = {stage: chunk for stage, (chunk, _) in self.busy.items()} or dict(self.cut)
        if at or not self.job.source.is_sender or (self.started is not None and not self.started.is_set()):
            return at
        # Chunks go through every stage in order: the first one not yet released is in flight, waiting for
        # the first stage that has not taken it up.
        first = self.last.get("release", -1) + 1
        pending = [p.index for p in self.job.plans if p.index >= first]
        if not pending:
            return {}
        chunk = pending[0]
        for stage in STAGES:
            if self.last.get(stage, -1) < chunk:
                return {stage: chunk}
        return {}

    def running_stage(self) -> str:
        return next(iter(self.where()), "start" if self.started is not None and not self.started.is_set()
                    else "finish")

    def running_chunk(self) -> int | None:
        return next(iter(self.where().values()), None)

    def running(self) -> str:
        """What the push was doing, for a timeout or cancellation message."""
        where = self.where()
        if where:
            return ", ".join(f"{stage} of chunk {chunk} was running" for stage, chunk in where.items())
        return f"{self.running_stage()} was running"
