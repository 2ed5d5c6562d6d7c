"""What an engine can do beyond its round, each a type that the rest of streamsync asks for by type.

An `Engine` has the round and nothing else (`engines.base`). Each ability below is a protocol of one or two
methods: an engine has the ability when it has those methods, and says so by naming the protocol among its
bases (`class VllmEngine(..., Pausable, Generates)`). Callers ask `isinstance(engine, Pausable)`; an engine
without an ability is treated as the ability's docstring says, never probed with a call that may fail.

    Locatable       learns where it runs at connect (device, remote, rendezvous address)
    Checkpointed    names the tensors a push must carry, checked before bytes move
    Family          names the model classes it serves and the layers it does not load
    Fused           takes runs of HF tensors as its own fused tensors
    Sharded         says which slice of each tensor each worker holds (`transport="p2p"`)
    KeepsDeltaBase  keeps the base that delta pushes are computed against
    Primable        maps a chunk's references ahead of the first push (`connect(model)`)
    FoldsRound      opens and ends its round inside updates and resets its cache in the finish
    ReportsRounds   says what its workers did in the round that just finished
    Pausable        pauses and resumes generation
    CachesPrefixes  keeps state computed under old weights, which a push drops
    ReadsBack       compares what it computes with against given weights, bit for bit
    Generates       greedy-decodes, for checks of what it computes with
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from ..plan.shards import EngineLayout
    from .base import Declined


@dataclass(frozen=True)
class RoundPlan:
    """What a push tells an engine of its round before it starts (`FoldsRound.fold_round`).

    last_chunk:  the push's last chunk where this engine is the push's only one, else None
    reset_cache: the push ends by resetting the engines' prefix caches (`Checks.reset_prefix_cache`)
    """

    last_chunk: int | None
    reset_cache: bool


@dataclass(frozen=True)
class Finished:
    """What an engine's `finish_update` did besides committing the version.

    cache_reset: the prefix-cache reset the finish carried (`RoundPlan.reset_cache`): True done, False refused
                 (requests hold cache blocks); None where the finish did not reset (the push asks for it)
    stats:       what the engine's workers did in the round, one plain dict per worker
                 (`report.EngineRound.from_wire`), where the finish answered it; None: ask `round_stats`
    """

    cache_reset: bool | None = None
    stats: tuple[dict[str, Any], ...] | None = None


@runtime_checkable
class Locatable(Protocol):
    async def locate(self) -> None:
        """Learn where the engine runs (set `device`, `remote`, `rendezvous_addr`, `workers`); `connect` calls it
        before it chooses the transport. Engines without it are where they were made."""


@runtime_checkable
class Checkpointed(Protocol):
    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """HF name -> (dtype name, shape) the engine will accept, or None where it cannot say; a push whose
        tensors differ is refused before bytes move."""


@runtime_checkable
class Family(Protocol):
    async def architectures(self) -> tuple[str, ...]:
        """The model classes the engine serves (its config's `architectures`); empty where it cannot say. A push
        of a trainer of another family is refused before bytes move."""

    async def declined_layers(self) -> Declined | None:
        """Decoder layers whose tensors the engine does not load, though its checkpoint holds them (a DeepSeek-V3
        or GLM-4.5 checkpoint's MTP layers, which vLLM's main model skips): a push may carry them or not, and
        reports them as not loaded (`PushReport.not_loaded`). None: every layer."""


@runtime_checkable
class Fused(Protocol):
    async def fused_layout(self) -> dict[str, Any] | None:
        """The engine's own fused tensors and their HF members, as plain data ({name: [[members], shape]},
        `pack.fusions_from_json`), or None: it takes HF names only. Pushes then send each run of packed HF
        tensors that makes up one of them as that one tensor (`WeightSync(engine_layout=True)`)."""


@runtime_checkable
class Sharded(Protocol):
    async def layout(self) -> EngineLayout | None:
        """Which slice of each HF tensor each of the engine's workers holds (`plan.shards`), for sharded sending
        (`transport="p2p"`); None, or no ability: every worker takes whole tensors."""


@runtime_checkable
class KeepsDeltaBase(Protocol):
    async def delta_base(self) -> tuple[int, str] | None:
        """(version, push id) of the push whose tensors the engine keeps as the base of delta pushes
        (docs/delta.md), or None: it keeps none, and every push to it sends every byte. Checked before each
        delta push (the engine checks each delta chunk again and refuses one computed against another base)."""


@runtime_checkable
class Primable(Protocol):
    async def prime(self, message: Mapping[str, Any]) -> bool:
        """A chunk's references ahead of its first push (`connect(model)`, one copy; `refs.prime_chunk`): map the
        trainer storages they name and get ready to load them, loading nothing. The chunk's updates then name the
        references by id only. True: every worker took them."""


@runtime_checkable
class FoldsRound(Protocol):
    def fold_round(self, plan: RoundPlan) -> bool:
        """Asked before each push in place of nothing: the engine folds what it can of the round into the push's
        other calls (one call into the engine each fewer). True: it opens the round with the push's first update,
        and the push does not call `start_update`. Where `plan.last_chunk` is set it may end the round in that
        chunk's update (its `finish_update` then commits nothing more); where `plan.reset_cache` is, it may reset
        its cache in the finish (`Finished.cache_reset`). `finish_update` and `abort_update` do the right thing
        whether or not an update came."""


@runtime_checkable
class ReportsRounds(Protocol):
    async def round_stats(self) -> list[dict[str, Any]] | None:
        """What the engine's workers did in the round that just finished, one plain dict per worker
        (`report.EngineRound.from_wire`: the path its tensors took, its timed phases with wall-clock stamps, its
        extra memory), or None. Asked once per push, after finish, unless `Finished.stats` answered it."""


@runtime_checkable
class Pausable(Protocol):
    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        """Stop generating: "keep" holds requests where they are, "wait" lets them finish, "abort" ends them."""

    async def resume(self) -> None: ...


@runtime_checkable
class CachesPrefixes(Protocol):
    async def reset_cache(self) -> bool:
        """Drop state computed under the previous weights (vLLM: the prefix cache), so no later request reuses
        it. False when the engine could not (vLLM: requests kept across the push still hold cache blocks).
        Engines without the ability cache nothing derived from weights."""


@runtime_checkable
class ReadsBack(Protocol):
    async def holds(self, hf: Mapping[str, torch.Tensor], tied: bool = False) -> bool | None:
        """Whether the engine computes with exactly these HF weights, bit for bit (`tied`: the checkpoint ties
        lm_head to the embedding); None: it cannot read its weights back."""


@runtime_checkable
class Generates(Protocol):
    async def greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        """Greedy-decode `max_tokens` after `prompt_ids`: (tokens, the logprob of each), for checks of what the
        engine computes with (`streamsync.verify`)."""


def lacks(engine: Any, ability: str) -> NotImplementedError:
    """The error for asking `engine` for what it cannot do ("pause generation")."""
    return NotImplementedError(f"engine {getattr(engine, 'name', engine)!r} cannot {ability}")
