"""Control plane to an inference engine, shaped like vLLM's four weight-update phases.

    init_transfer(init_info)        once, after the transport is chosen
    abort_update(version)           a failed (or cancelled) push: end the round; an engine that may hold
                                    part of `version`'s weights says so (`state().mixed`), never the old version
    start_update()                  begin a round (vLLM: start_weight_update)
    update(message)                 once per chunk (`streamsync.message.UpdateMessage`); returns after the engine
                                    applied the chunk and closed its handle: that return is the acknowledgement
                                    the release stage waits on
    finish_update(version)          the round is complete; the engine now reports `version` (`Finished`: what
                                    the finish did besides)
    get_version() / state()         what it holds; close() drops the connection

Every call has a timeout; a failed or late call raises EngineError naming the engine and saying what
happened ("engine process exited", "no reply in N s", or the engine's own refusal).

Ownership: `WeightSync.connect` sets `owner` (one id per WeightSync). Engines that can carry it (the
receiver process; every message carries it for the vLLM backend) refuse a round from another owner while one
is open, so two syncs never mix two models under one version.

Where it runs is declared here: `device`, `remote` and `rendezvous_addr` (for `transport="auto"`), `workers`
(how many receiving processes it has), `signals_dispatch` (whether it says when an update's request has left,
`DISPATCHED`). Everything else an engine can do (pause, read its weights back, say its layout, keep a delta
base, ...) is an ability of its own type, asked for with `isinstance` (`engines.abilities`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from ..message import UpdateMessage
from ..plan.chunking import layer_index
from .abilities import Finished

#: Version string a vLLM engine reports after a failed push left part of that push's weights in it.
MIXED = "mixed:"

#: Set while the send stage awaits an engine's `update`: call it once the update's request has left for the
#: engine (on the event loop's thread). The sender's next chunk is gathered and packed only then: on a GPU
#: that is Python on the loop's thread, and an engine call made from another thread (an in-process `LLM`'s
#: blocking call) would otherwise wait for the GIL behind it before its request even went out. Engines that
#: do not say (`Engine.signals_dispatch` False) count as dispatched when `update` is called.
DISPATCHED: ContextVar[Callable[[], None] | None] = ContextVar("streamsync_dispatched", default=None)


@dataclass(frozen=True)
class EngineState:
    """What an engine holds.

    version:  the clean version it holds (every weight from that push), None when unknown or mixed
    mixed:    a failed push left part of its weights in the engine: neither the old nor the new version.
              The next successful push clears it (every tensor is overwritten).
    failed_version: the version of the push that left it mixed, where known
    updating: a round is open (None: the engine cannot say)
    paused:   generation is paused (None: the engine cannot say). An engine found paused at connect was
              paused by another client, often a trainer that died inside `paused()`.
    """

    version: int | None
    mixed: bool = False
    failed_version: int | None = None
    updating: bool | None = None
    paused: bool | None = field(default=None, compare=False)  # beside what it holds: not part of equality


def parse_version(v: object) -> EngineState:
    """An engine's version string ("7", "mixed:8", vLLM's initial "default") as an EngineState."""
    if isinstance(v, int) and not isinstance(v, bool):
        return EngineState(v)
    if isinstance(v, str) and v.isdigit():
        return EngineState(int(v))
    if isinstance(v, str) and v.startswith(MIXED):
        tail = v[len(MIXED):]
        return EngineState(None, mixed=True, failed_version=int(tail) if tail.isdigit() else None)
    return EngineState(None)


@dataclass(frozen=True)
class Declined:
    """What an engine's checkpoint holds that a push need not carry (`Family.declined_layers`): decoder layers
    [start, stop) it does not load, and why (MTP layers, where it runs no MTP draft model); single tensors it does
    not load (`names`, why: `names_reason`; an MTP layer's copies of the embedding and output layer, which its MTP
    draft model shares with the main model); and layers [start, stop) it loads but a push may leave out
    (`optional`: the MTP layers its draft model loads, which a trainer without MTP layers cannot send; the draft
    then keeps the weights it started with). `prefix`: where the checkpoint holds those layers apart from the
    decoder layers (MiMo's `model.mtp_layers.`), the names under it are theirs, declined or optional alike."""

    start: int
    stop: int
    reason: str
    names: frozenset[str] = frozenset()
    names_reason: str = ""
    optional: tuple[int, int] = (0, 0)
    prefix: str = ""

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.stop

    def _in(self, name: str, span: tuple[int, int]) -> bool:
        if span[1] <= span[0]:
            return False
        if self.prefix:
            return name.startswith(self.prefix)
        i = layer_index(name)
        return i is not None and span[0] <= i < span[1]

    def declines(self, name: str) -> bool:
        """The engine does not load the tensor `name` (its layer's, or the tensor itself)."""
        return name in self.names or self._in(name, (self.start, self.stop))

    def may_omit(self, name: str) -> bool:
        """A push may leave out the tensor `name`, which the engine loads if it comes (an `optional` layer's)."""
        return self._in(name, self.optional)


class Engine(ABC):
    """One inference engine (all of its workers) as seen by the sender."""

    name: str = "engine"
    #: the WeightSync this client belongs to (set by `WeightSync.connect`); None: unchecked
    owner: str | None = None
    #: "cpu" or "cuda:<uuid>"-style location, used to pick a transport when transport="auto".
    device: str = "cpu"
    #: receiving processes (vLLM workers) behind the engine; each joins a collective group as a rank of its own
    workers: int = 1
    #: the engine runs on another host (or GPU) than the sender: with transport="auto" only the collective
    #: transport reaches it (shared memory and CUDA IPC need the sender's host)
    remote: bool = False
    #: an address of the sender's host that the engine can reach: where a collective rendezvous listens
    rendezvous_addr: str | None = None
    #: `update` calls `DISPATCHED` itself once its request has left (else the send stage does when it calls it)
    signals_dispatch: bool = False

    @abstractmethod
    async def init_transfer(self, init_info: dict[str, Any]) -> None: ...

    @abstractmethod
    async def start_update(self) -> None: ...

    @abstractmethod
    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None:
        """Apply one chunk. `message`: what a push sends, or its wire form as a plain dict (`message.wire`):
        receivers validate every field either way."""

    @abstractmethod
    async def finish_update(self, version: int) -> Finished | None:
        """End the round: the engine now reports `version`. What the finish did besides (a cache reset it carried,
        the workers' round stats it answered) comes back as `Finished`; None: nothing besides."""

    @abstractmethod
    async def get_version(self) -> int | None: ...

    async def abort_update(self, version: int | None = None) -> None:  # noqa: B027 - a notification
        """A push of `version` failed or was cancelled after `start_update`: end the round without
        claiming `version`, so the engine can generate again (vLLM: finish the layerwise reload; layers
        nothing reached keep their old weights) and the next push can start. An engine that received any
        chunk of the round must then report itself mixed (`state()`), not its old version. Must not raise
        for a round the engine already ended."""

    async def state(self) -> EngineState:
        """The engine's version and whether a failed push left it holding mixed weights."""
        return EngineState(await self.get_version())

    async def close(self) -> None:  # noqa: B027 - a notification
        """Drop connections. Does not stop the engine."""
