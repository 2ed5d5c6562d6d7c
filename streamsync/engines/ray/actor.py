"""The actor's half: runs in the Ray actor that holds the vLLM engine (the user's actor class mixes in
`StreamsyncEngineMixin`; a plain `vllm.LLM` actor runs `_plain_placement` through `__ray_call__`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Any

from ...errors import ValidationError

#: the calls a sender may make on the actor's engine (nothing else is reachable through the mixin)
CALLS = frozenset({
    "locate", "init_transfer", "start_update", "update", "finish_update", "abort_update", "get_version", "state",
    "expected_weights", "declined_layers", "architectures", "reset_cache", "pause", "resume", "weight_digests",
    "packed_modules", "received_digests", "clear_kv_cache", "greedy", "rpc", "delta_base", "draft_digests",
})


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
        from ..vllm import AsyncVllmEngine, VllmEngine

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
        from ..vllm import VllmEngine

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

