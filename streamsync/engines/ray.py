"""vLLM engines living in Ray actors: how RL stacks that outgrow one machine place their rollout engines.

Two halves, both thin, around the in-process engines of `streamsync.engines.vllm`:

* `StreamsyncEngineMixin` for the user's actor class. The actor builds its `vllm.LLM` / `AsyncLLM` as usual
  (with `engine_kwargs()`) and calls `self.streamsync_attach(llm)`; the mixin wraps it in a `VllmEngine` /
  `AsyncVllmEngine` and serves that engine's calls to the sender through one async actor method. So the
  four-phase protocol, the owner check, mixed-version marking and the engine-core liveness watch are the
  in-process engines' own, run inside the actor.
* `RayVllmEngine(actor_handle)` on the sender (the driver, or a trainer that is itself a Ray actor): an
  `Engine` whose every call is `actor.streamsync_call.remote(...)` awaited under the sync's timeout. A dead
  actor fails the call at once with an EngineError naming the engine ("engine actor died"), not at the
  timeout: Ray fails the pending call when it learns of the death.
* A plain vLLM actor works too, as vLLM's own Ray examples make it (`ray.remote(vllm.LLM).remote(model, ...,
  **engine_kwargs())`): `RayVllmEngine` then drives the `LLM`'s own methods (`init_weight_transfer_engine`,
  `start_weight_update`, `update_weights`, `finish_weight_update`, `collective_rpc`, `sleep`, `wake_up`,
  `reset_prefix_cache`) through `VllmEngine`'s code, each call one `actor.<method>.remote(...)`; where it runs
  is asked through Ray's `__ray_call__`. Only an `LLM` actor (an `AsyncLLM` needs an async actor of the user's).

Placement picks the transport (`transport="auto"`): before the transport is chosen `locate()` asks the actor
for its Ray node and GPUs. An actor on the sender's node (and, for GPU engines, its GPU) is reached through
shared memory or CUDA IPC; any other through the collective transport (gloo on CPU, NCCL on GPU), whose
rendezvous listens on the sender's node IP as Ray reports it. That group is streamsync's own (a TCPStore and
process-group objects, never `init_process_group`), so neither Ray's nor vLLM's groups are touched.

Ray is an optional dependency: `pip install streamsync[ray]`. Only asyncio event loops can await Ray's
object refs (so not trio); `BlockingWeightSync` and async Ray actors run asyncio.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import anyio

from ..errors import EngineError, ValidationError
from ..message import UpdateMessage, wire
from .abilities import (
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
from .base import Declined, Engine, EngineState

if TYPE_CHECKING:
    import torch

#: the calls a sender may make on the actor's engine (nothing else is reachable through the mixin)
CALLS = frozenset({
    "locate", "init_transfer", "start_update", "update", "finish_update", "abort_update", "get_version", "state",
    "expected_weights", "declined_layers", "architectures", "reset_cache", "pause", "resume", "weight_digests",
    "packed_modules", "received_digests", "clear_kv_cache", "greedy", "rpc", "delta_base", "draft_digests",
})
PLACEMENTS = ("auto", "local", "remote")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("streamsync's Ray engines need Ray: pip install streamsync[ray]") from None
    return ray


def node_placement() -> dict[str, Any]:
    """Where the calling process runs, as Ray sees it: node id, node IP and the GPUs Ray gave it."""
    ray = _ray()
    ctx = ray.get_runtime_context()
    try:
        gpus = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
    except Exception:  # the driver of a cluster without GPUs
        gpus = []
    return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(), "gpu_ids": gpus,
            "pid": os.getpid()}


class StreamsyncEngineMixin:
    """Mix into a Ray actor class that holds a vLLM engine; call `streamsync_attach(llm)` once it is built.

        @ray.remote
        class Rollout(StreamsyncEngineMixin):
            def __init__(self, model_dir):
                self.llm = vllm.LLM(model=model_dir, **engine_kwargs())
                self.streamsync_attach(self.llm)

    The mixin's methods are coroutines, so Ray runs the actor as an async actor (one event loop, calls
    interleave). An `LLM`'s blocking calls then run in the engine's own thread (`VllmEngine`), so a slow generate does
    not hold the weight-sync calls back; generate through `self.streamsync_engine` (`greedy`) or keep the
    actor's own blocking methods short. An `AsyncLLM` must be built in the actor (its loop is the actor's).
    `timeout`: the in-actor engine's own limit per vLLM call.
    """

    streamsync_engine: Any = None
    #: one id per actor incarnation: a restarted actor (Ray's max_restarts) reports a new one
    streamsync_incarnation: str = ""

    def streamsync_attach(self, llm: Any, *, timeout: float = 300.0) -> None:
        from .vllm import AsyncVllmEngine, VllmEngine

        if hasattr(llm, "pause_generation"):  # AsyncLLM (LLM has no pause_generation)
            self.streamsync_engine = AsyncVllmEngine(llm, timeout=timeout)
        else:
            self.streamsync_engine = VllmEngine(llm, timeout=timeout)
        self.streamsync_incarnation = uuid.uuid4().hex

    async def streamsync_llm_call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run a call of the attached engine for the actor's own work (`self.llm.generate`, ...): an `LLM`'s
        blocking call runs in the engine's own thread, one at a time with streamsync's calls (LLM is not
        thread-safe), so the actor's event loop stays free to serve a push meanwhile; an `AsyncLLM`'s
        coroutine function is awaited. Failures are EngineErrors; the engine's timeout applies."""
        from .vllm import VllmEngine

        engine = self._streamsync_engine()
        what = getattr(fn, "__name__", "call")
        if isinstance(engine, VllmEngine):  # its locked, timed worker-thread call
            return await engine._call(what, fn, *args, **kw)
        return await engine._run(what, fn, *args, **kw)

    async def streamsync_placement(self) -> dict[str, Any]:
        """Where this actor's engine runs, and how many vLLM workers it has (ranks in a collective group)."""
        engine = self._streamsync_engine()
        place = node_placement()
        place.update(incarnation=self.streamsync_incarnation, workers=_workers(engine),
                     device=engine.device)
        return place

    async def streamsync_call(self, method: str, args: Sequence[Any] = (), *, name: str = "engine",
                              owner: str | None = None) -> Any:
        """Run `method` of the attached engine. The sender's name and WeightSync owner travel with every call,
        so errors raised here name the engine as the sender knows it and rounds carry the right owner."""
        if method not in CALLS:
            raise ValidationError(f"streamsync_call: {method!r} is not an engine call; known: {sorted(CALLS)}")
        engine = self._streamsync_engine()
        engine.name, engine.owner = name, owner
        return await getattr(engine, method)(*args)

    def _streamsync_engine(self) -> Any:
        if self.streamsync_engine is None:
            raise ValidationError(f"{type(self).__name__}: call self.streamsync_attach(llm) once the vLLM engine "
                                  "is built")
        return self.streamsync_engine


def _workers(engine: Any) -> int:
    """vLLM workers of the engine (TP x PP): each joins a collective group as its own rank."""
    core = getattr(engine, "llm", None) or getattr(engine, "engine", None)
    core = getattr(core, "llm_engine", core)
    cfg = getattr(getattr(core, "vllm_config", None), "parallel_config", None)
    return int(getattr(cfg, "world_size", 1) or 1)


def _plain_placement(llm: Any) -> dict[str, Any]:
    """Run in a plain `vllm.LLM` actor (`__ray_call__`): where it runs, its vLLM workers, its device."""
    import torch

    place = node_placement()
    place.update(incarnation=f"{os.getpid()}-{id(llm):x}", workers=_workers_of(llm),
                 device="cuda" if torch.cuda.is_available() else "cpu")
    return place


def _workers_of(llm: Any) -> int:
    cfg = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "parallel_config", None)
    return int(getattr(cfg, "world_size", 1) or 1)


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
    from .vllm import VllmEngine

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
        from ..vllm.digests import expected_digests

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
