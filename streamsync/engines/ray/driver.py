"""The sender's half: `RayVllmEngine`, an `Engine` whose every call is a remote call to the actor, in the
trainer's process (the driver, or a trainer that is itself a Ray actor)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ...errors import EngineError, ValidationError
from ...message import UpdateMessage, wire
from ..abilities import (
    CachesPrefixes,
    Checkpointed,
    Family,
    Finished,
    Generates,
    KeepsDeltaBase,
    Locatable,
    Pausable,
    ReadsBack,
)
from ..base import Declined, Engine, EngineState
from .actor import CALLS, _plain_placement, _ray, node_placement

if TYPE_CHECKING:
    import torch

PLACEMENTS = ("auto", "local", "remote")


class _ActorLLM:
    """A plain `vllm.LLM` actor as the blocking `LLM` that `VllmEngine` calls: each method is a remote call
    waited for at most `timeout` (VllmEngine runs it in its own thread, one at a time)."""

    def __init__(self, actor: Any, timeout: float) -> None:
        self._actor = actor
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = getattr(self._actor, name)

        def call(*args: Any, **kw: Any) -> Any:
            ray = _ray()
            ref = method.remote(*args, **kw)
            try:
                return ray.get(ref, timeout=self._timeout)
            except ray.exceptions.GetTimeoutError:
                _cancel(ray, ref)
                raise TimeoutError(f"{name}: no reply from the actor in {self._timeout:.1f} s") from None
            except ray.exceptions.RayTaskError as e:  # the call raised in the actor: its own message
                raise RuntimeError(f"{type(e.cause).__name__}: {_first_line(e.cause)}") from None
            except ray.exceptions.RayActorError as e:
                raise EngineError("", f"{name} failed: engine actor died ({_first_line(e)})",
                                  unresponsive=True) from None

        call.__name__ = name
        return call


def _plain_engine(actor: Any, name: str, timeout: float) -> Any:
    """`VllmEngine` over a plain `LLM` actor (not in this process: its vLLM version is the worker's)."""
    from ..vllm import VllmEngine

    class PlainActorEngine(VllmEngine):
        in_process = False

        async def _dead(self) -> str | None:
            return None  # Ray fails a dead actor's calls itself

        async def _run(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
            try:
                return await super()._run(what, fn, *args, **kw)
            except EngineError as e:
                if not e.engine:  # raised by _ActorLLM (the actor died): name the engine
                    raise EngineError(self.name, e.message, unresponsive=e.unresponsive) from None
                raise

    return PlainActorEngine(_ActorLLM(actor, timeout), name=name, timeout=timeout)


class RayVllmEngine(Engine, Locatable, Checkpointed, Family, KeepsDeltaBase, Pausable, CachesPrefixes, ReadsBack,
                    Generates):
    """A vLLM engine in a Ray actor: one whose class mixes in `StreamsyncEngineMixin`, or a plain `vllm.LLM`
    actor (`ray.remote(vllm.LLM).remote(model, **engine_kwargs())`; module doc).

    actor:     the actor's handle (it may be passed into another actor: a trainer that is a Ray actor)
    placement: "auto" (same Ray node -> colocated transport, else collective), or "local" / "remote" to force
               one (e.g. the collective path between actors of one machine)
    timeout:   seconds one call may take (the sync's `timeout` also bounds it)
    """

    #: vLLM workers of the actor's engine (learned by `locate`): ranks it adds to a collective group
    workers: int = 1

    def __init__(self, actor: Any, *, name: str | None = None, timeout: float = 300.0,
                 placement: str = "auto") -> None:
        _ray()
        if placement not in PLACEMENTS:
            raise ValidationError(f"placement must be one of {PLACEMENTS}, got {placement!r}")
        self.actor = actor
        actor_id = getattr(actor, "_actor_id", None)
        self.name = name or (f"ray-{actor_id.hex()[:8]}" if actor_id is not None else "ray")
        self.timeout = timeout
        self.placement = placement
        self.where: dict[str, Any] | None = None  # the actor's answer to `locate`
        # a plain LLM actor (no mixin): driven through VllmEngine's code, one remote call per LLM method
        self._plain = None if _has_method(actor, "streamsync_call") else _plain_engine(actor, self.name, timeout)

    # -- placement ----------------------------------------------------------------------------------------

    async def locate(self) -> None:
        """Ask the actor where it runs; decide whether it is colocated with this (the sending) process."""
        if self._plain is not None:
            where = self.where = await self._remote("placement", self.actor.__ray_call__, _plain_placement)
        else:
            where = self.where = await self._remote("placement", self.actor.streamsync_placement)
        me = node_placement()
        self.workers = int(where.get("workers") or 1)
        self.rendezvous_addr = me["node_ip"]
        gpu = str(where.get("device", "cpu")).startswith("cuda")
        if self.placement == "auto":
            same_node = where["node_id"] == me["node_id"]
            # CUDA IPC needs the trainer's GPU: a driver Ray gave no GPUs sees every GPU of its node.
            same_gpu = not gpu or not me["gpu_ids"] or bool(set(where["gpu_ids"]) & set(me["gpu_ids"]))
            self.remote = not (same_node and same_gpu)
        else:
            self.remote = self.placement == "remote"
        self.device = "cuda" if gpu else "cpu"
        await self._call("locate")  # the actor's engine learns its vLLM (refused outside the supported range)

    # -- calls --------------------------------------------------------------------------------------------

    async def _call(self, method: str, *args: Any) -> Any:
        if self._plain is not None:
            if method not in CALLS:
                raise ValidationError(f"{method!r} is not an engine call; known: {sorted(CALLS)}")
            self._plain.name, self._plain.owner = self.name, self.owner
            if self.where is not None:
                self._plain.device = self.device
            return await getattr(self._plain, method)(*args)
        return await self._remote(method, self.actor.streamsync_call, method, list(args), name=self.name,
                                  owner=self.owner)

    async def _remote(self, what: str, actor_method: Any, *args: Any, **kw: Any) -> Any:
        """`actor_method.remote(...)` awaited for at most `timeout`; Ray's failures as EngineErrors."""
        ray = _ray()
        try:
            ref = actor_method.remote(*args, **kw)
        except ray.exceptions.RayActorError as e:
            raise EngineError(self.name, f"{what} failed: engine actor died ({_first_line(e)})",
                              unresponsive=True) from None
        try:
            with anyio.fail_after(self.timeout):
                return await asyncio.wrap_future(ref.future())
        except TimeoutError:
            _cancel(ray, ref)
            raise EngineError(self.name, f"{what}: no reply from the actor in {self.timeout:.1f} s") from None
        except ray.exceptions.RayTaskError as e:  # the call raised in the actor: keep its message
            cause = e.cause
            if isinstance(cause, EngineError):
                raise EngineError(self.name, cause.message, unresponsive=cause.unresponsive) from None
            raise EngineError(self.name, f"{what} failed in the actor: {type(cause).__name__}: "
                                         f"{_first_line(cause)}") from None
        except ray.exceptions.RayActorError as e:  # ActorDiedError, ActorUnavailableError (restarting)
            # Its round died with it: a failed push need not wait to abort it (with max_restarts, Ray would
            # hold that call until the new incarnation is up).
            raise EngineError(self.name, f"{what} failed: engine actor died ({_first_line(e)})",
                              unresponsive=True) from None
        except BaseException:  # cancelled (a failed push elsewhere): the actor need not finish the call
            _cancel(ray, ref)
            raise

    async def init_transfer(self, init_info: dict[str, Any]) -> None:
        await self._call("init_transfer", init_info)

    async def start_update(self) -> None:
        await self._call("start_update")

    async def update(self, message: UpdateMessage | Mapping[str, Any]) -> None:
        await self._call("update", wire(message))  # plain data across the actor boundary

    async def finish_update(self, version: int) -> Finished | None:
        return await self._call("finish_update", version)

    async def abort_update(self, version: int | None = None) -> None:
        await self._call("abort_update", version)

    async def get_version(self) -> int | None:
        return await self._call("get_version")

    async def state(self) -> EngineState:
        return await self._call("state")

    async def expected_weights(self) -> dict[str, tuple[str, tuple[int, ...]]] | None:
        return await self._call("expected_weights")

    async def declined_layers(self) -> Declined | None:
        return await self._call("declined_layers")

    async def architectures(self) -> tuple[str, ...]:
        return tuple(await self._call("architectures"))

    async def reset_cache(self) -> bool:
        return await self._call("reset_cache")

    async def pause(self, mode: str = "keep", clear_cache: bool = False) -> None:
        await self._call("pause", mode, clear_cache)

    async def resume(self) -> None:
        await self._call("resume")

    async def weight_digests(self, device: bool = False) -> dict[str, str]:
        return await self._call("weight_digests", device)

    async def draft_digests(self, device: bool = False) -> dict[str, str]:
        """The actor's engine's MTP draft model's own tensors, digested (`WorkerQueries.draft_digests`)."""
        return await self._call("draft_digests", device)

    async def packed_modules(self) -> dict[str, list[str]]:
        return await self._call("packed_modules")

    async def holds(self, hf: Mapping[str, torch.Tensor], tied: bool = False) -> bool | None:
        from ..vllm.trainer.digests import expected_digests

        return await self.weight_digests() == expected_digests(hf, await self.packed_modules(), tied=tied)

    async def received_digests(self) -> dict[str, str]:
        return await self._call("received_digests")

    async def delta_base(self) -> tuple[int, str] | None:
        held = await self._call("delta_base")
        return None if held is None else (int(held[0]), str(held[1]))

    async def clear_kv_cache(self) -> int:
        return await self._call("clear_kv_cache")

    async def greedy(self, prompt_ids: Sequence[int], max_tokens: int) -> tuple[list[int], list[float]]:
        return await self._call("greedy", list(prompt_ids), max_tokens)

    async def rpc(self, method: str, *args: str) -> list[Any]:
        return await self._call("rpc", method, *args)


def _has_method(actor: Any, name: str) -> bool:
    try:
        getattr(actor, name)
    except AttributeError:
        return False
    return True


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(e).__name__


def _cancel(ray: Any, ref: Any) -> None:
    try:
        ray.cancel(ref)
    except Exception:  # the actor is gone or the call already finished
        pass
