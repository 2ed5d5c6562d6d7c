"""Control plane to an inference engine, shaped like vLLM's four weight-update phases.

    init_transfer(init_info)        once, after the transport is chosen
    abort_update(version)           a failed (or cancelled) push: end the round; an engine that may hold
                                    part of `version`'s weights says so (`state().mixed`), never the old version
    start_update()                  begin a round (vLLM: start_weight_update)
    update(message)                 once per chunk (`streamsync.message.UpdateMessage`); returns after the engine
                                    applied the chunk and closed its handle: that return is the acknowledgement
                                    the release stage waits on
    finish_update(version)          the round is complete; the engine now reports `version`
    reset_cache()                   after finish: drop what was computed under the old weights (prefix cache)
    pause(mode, clear_cache) / resume() / get_version() / state()

Every call has a timeout; a failed or late call raises EngineError naming the engine and saying what
happened ("engine process exited", "no reply in N s", or the engine's own refusal).

Ownership: `WeightSync.connect` sets `owner` (one id per WeightSync). Engines that can carry it (the
receiver process; every message carries it for the vLLM backend) refuse a round from another owner while one
is open, so two syncs never mix two models under one version.

Capabilities are declared here, never probed: `device`, `remote` and `rendezvous_addr` (where it runs, for
`transport="auto"`), `workers` (how many receiving processes it has), `fused_layout()` (its own fused tensors),
`expected_weights()` (what a push must carry), `pause`/`resume` (whether it can freeze generation),
`delta_base()` (the push a delta sent to it must be computed against), `signals_dispatch` (whether it says
when an update's request has left, `DISPATCHED`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..message import UpdateMessage
from ..plan.shards import EngineLayout

if TYPE_CHECKING:
    import torch

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
    """Decoder layers [start, stop) an engine does not load, and why (`Engine.declined_layers`)."""

    start: int
    stop: int
    reason: str

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.stop


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

    async def locate(self) -> None:  # noqa: B027 - optional hook
        """Learn where the engine runs (set `device`, `remote`, `rendezvous_addr`); `WeightSync.connect` calls
        it before it chooses the transport. Engines whose place is known when they are made need nothing."""

    @abstractmethod
    async def init_transfer(self, init_info: dict[str, Any]) -> None: ...

    @abstractmethod
    async def start_update(self) -> None: ...

    @abstractmethod
    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None:
        """Apply one chunk. `message`: what a push sends, or its wire form as a plain dict (`message.wire`):
        receivers validate every field either way."""

    @abstractmethod
    async def finish_update(self, version: int) -> None: ...

    @abstractmethod
    async def get_version(self) -> int | None: ...

    async def abort_update(self, version: int | None = None) -> None:  # noqa: B027 - optional hook
        """A push of `version` failed or was cancelled after `start_update`: end the round without
        claiming `version`, so the engine can generate again (vLLM: finish the layerwise reload; layers
        nothing reached keep their old weights) and the next push can start. An engine that received any
        chunk of the round must then report itself mixed (`state()`), not its old version. Must not raise
        for a round the engine already ended."""

    async def state(self) -> EngineState:
        """The engine's version and whether a failed push left it holding mixed weights."""
        return EngineState(await self.get_version())

    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """HF name -> (dtype name, shape) the engine will accept, if it can say; checked before bytes move."""
        return None

    async def architectures(self) -> tuple[str, ...]:
        """The model classes the engine serves (its config's `architectures`); empty where it cannot say. A push
        of a trainer of another family is refused before bytes move."""
        return ()

    async def declined_layers(self) -> Declined | None:
        """Decoder layers whose tensors the engine does not load, though its checkpoint holds them (a DeepSeek-V3
        or GLM-4.5 checkpoint's MTP layers, which vLLM's main model skips): a push may carry them (a trainer
        with MTP layers) or not, and reports them as not loaded (`PushReport.not_loaded`). None: every layer."""
        return None

    async def holds(self, hf: Mapping[str, torch.Tensor], tied: bool = False) -> bool | None:
        """Whether the engine computes with exactly these HF weights, bit for bit (`tied`: the checkpoint ties
        lm_head to the embedding); None: it cannot read its weights back."""
        return None

    async def layout(self) -> EngineLayout | None:
        """Which slice of each HF tensor each of the engine's workers holds (`plan.shards`), for sharded
        sending (`transport="p2p"`); None: every worker takes whole tensors."""
        return None

    async def delta_base(self) -> tuple[int, str] | None:
        """(version, push id) of the push whose tensors the engine keeps as the base of delta pushes
        (docs/delta.md), or None: it keeps none, and every push to it sends every byte. Checked before each
        delta push (the engine checks each delta chunk again and refuses one computed against another base)."""
        return None

    async def fused_layout(self) -> dict[str, Any] | None:
        """The engine's own fused tensors and their HF members, as plain data ({name: [[members], shape]},
        `pack.fusions_from_json`), or None: it takes HF names only. Pushes then send each run of packed HF
        tensors that makes up one of them as that one tensor (`WeightSync(engine_layout=True)`)."""
        return None

    async def round_stats(self) -> list[dict[str, Any]] | None:
        """What the engine's workers did in the round that just finished, one plain dict per worker
        (`streamsync.report.EngineRound.from_wire`: the path its tensors took, its timed phases with wall-clock
        stamps, its extra memory), or None where it cannot say. The sender asks once per push, after finish."""
        return None

    #: takes a chunk's references ahead of its first push (`prime`)
    takes_prime: bool = False

    async def prime(self, message: Mapping[str, Any]) -> bool:
        """A chunk's references ahead of its first push (`connect(model)`, one copy; `refs.prime_chunk`): map the
        trainer storages they name and get ready to load them, loading nothing. The chunk's updates then name the
        references by id only. True: every worker took them."""
        return False

    def round_answered(self) -> bool:
        """The round's finish already answered `round_stats` (read without a call): the sender then asks for it and
        the cache reset one after the other instead of in a task group."""
        return False

    def defer_start(self) -> bool:
        """Asked by a push instead of `start_update`: True when the engine opens the round with the push's first
        update instead (one call into the engine fewer); `finish_update` and `abort_update` then do the right
        thing whether or not an update came. False (the default): the push calls `start_update`."""
        return False

    def end_with_chunk(self, chunk: int | None) -> bool:
        """Asked before each push: `chunk` is the push's last chunk where this engine is the push's only one
        (None otherwise). True when the engine ends the round in that chunk's update (its `finish_update` then
        has nothing left to do; a push failing after it is aborted all the same). False: the default."""
        return False

    def reset_with_finish(self, reset: bool) -> None:  # noqa: B027 - optional hook
        """Set before each push's finish: `reset` asks the engine to reset its cache (`reset_cache`) as part of
        `finish_update` where it can do both in one call; `finished_reset()` then says whether it did."""

    def finished_reset(self) -> bool | None:
        """The last finish's cache reset (`reset_cache`'s result), or None where the finish did not reset (the
        sender then calls `reset_cache`)."""
        return None

    async def reset_cache(self) -> bool:
        """Drop state computed under the previous weights (vLLM: the prefix cache), so no later request reuses
        it. False when the engine could not (vLLM: requests kept across the push still hold cache blocks).
        Engines that cache nothing derived from weights return True."""
        return True

    async def greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy-decode `max_tokens` after `prompt_ids`: (tokens, the logprob of each), for checks of what the
        engine computes with (`streamsync.verify`)."""
        raise NotImplementedError(f"engine {self.name!r} cannot generate")

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        raise NotImplementedError(f"engine {self.name!r} cannot pause generation")

    async def resume(self) -> None:
        raise NotImplementedError(f"engine {self.name!r} cannot resume generation")

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Drop connections. Does not stop the engine."""
