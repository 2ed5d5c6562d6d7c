"""Control plane to an inference engine, shaped like vLLM's four weight-update phases.

    init_transfer(init_info)        once, after the transport is chosen
    abort_update()                  a failed push: end the round, keep the old version
    start_update()                  begin a round (vLLM: start_weight_update)
    update(update_info)             once per chunk; returns after the engine applied the chunk and closed
                                    its handle: that return is the acknowledgement the release stage waits on
    finish_update(version)          the round is complete; the engine now reports `version`
    reset_cache()                   after finish: drop what was computed under the old weights (prefix cache)
    pause(mode, clear_cache) / resume() / get_version()

Every call has a timeout; a failed or late call raises EngineError naming the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Engine(ABC):
    """One inference engine (all of its workers) as seen by the sender."""

    name: str = "engine"
    #: "cpu" or "cuda:<uuid>"-style location, used to pick a transport when transport="auto".
    device: str = "cpu"

    @abstractmethod
    async def init_transfer(self, init_info: dict[str, Any]) -> None: ...

    @abstractmethod
    async def start_update(self) -> None: ...

    @abstractmethod
    async def update(self, update_info: dict[str, Any]) -> None: ...

    @abstractmethod
    async def finish_update(self, version: int) -> None: ...

    @abstractmethod
    async def get_version(self) -> int | None: ...

    async def abort_update(self) -> None:  # noqa: B027 - optional hook
        """A push failed after `start_update`: end the round without claiming a version, so the engine
        can generate again (vLLM: finish the layerwise reload; layers nothing reached keep their old
        weights) and the next push can start. Must not raise for a round the engine already ended."""

    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        """HF name -> (dtype name, shape) the engine will accept, if it can say; checked before bytes move."""
        return None

    async def reset_cache(self) -> bool:
        """Drop state computed under the previous weights (vLLM: the prefix cache), so no later request reuses
        it. False when the engine could not (vLLM: requests kept across the push still hold cache blocks).
        Engines that cache nothing derived from weights return True."""
        return True

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        raise NotImplementedError(f"engine {self.name!r} cannot pause generation")

    async def resume(self) -> None:
        raise NotImplementedError(f"engine {self.name!r} cannot resume generation")

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Drop connections. Does not stop the engine."""
