"""BlockingWeightSync: WeightSync from plain synchronous Python, as most training loops are written."""

from __future__ import annotations

import threading

import anyio
import pytest

from streamsync import BlockingWeightSync, StreamSyncError, WeightSync
from streamsync.checksum import digests
from streamsync.models.synthetic import StateModule, perturb_


def test_five_pushes_in_a_plain_loop(receiver, mixed_model):
    model = StateModule(mixed_model.specs(), fill="random", seed=11)
    with BlockingWeightSync([receiver.engine()], chunk_bytes=4096) as sync:
        engine = sync.engines[0]
        for step in range(5):
            perturb_(model, step)  # a training step
            report = sync.push(model, version=step)
            assert report.version == step and report.chunks > 1
            assert sync.call(engine.get_version) == step
        assert sync.call(engine.checksums) == digests(model.state_dict().items())


def test_pushes_from_another_thread_and_the_main_thread_share_one_loop(receiver, mixed_model):
    model = StateModule(mixed_model.specs(), fill="random", seed=12)
    sync = BlockingWeightSync([receiver.engine()], chunk_bytes=4096)
    versions: list[int] = []
    worker = threading.Thread(target=lambda: versions.append(sync.push(model).version))
    worker.start()
    worker.join()
    versions.append(sync.push(model).version)
    assert versions == [1, 2]
    sync.close()
    sync.close()  # idempotent


def test_paused_pauses_the_engines_for_the_body_only(receiver, mixed_model):
    model = StateModule(mixed_model.specs(), fill="random", seed=13)
    with BlockingWeightSync([receiver.engine()], chunk_bytes=4096) as sync:
        engine = sync.engines[0]
        with sync.paused():
            assert sync.call(engine.call, "status")["paused"]
            sync.push(model)
        assert not sync.call(engine.call, "status")["paused"]
        assert sync.version == 1


def test_a_weight_sync_used_from_a_second_event_loop_says_what_to_do(receiver, mixed_model):
    model = StateModule(mixed_model.specs(), fill="random", seed=14)
    sync = WeightSync([receiver.engine()], chunk_bytes=4096)
    anyio.run(sync.push, model)
    with pytest.raises(StreamSyncError, match="BlockingWeightSync"):
        anyio.run(sync.push, model)  # a new loop per step: the engine's connection belongs to the first
    sync.transport.pool.release()  # its shared-memory segments (a loop-bound close cannot run here)


async def test_inside_an_event_loop_it_points_to_await(mixed_model):
    sync = BlockingWeightSync([])
    with pytest.raises(StreamSyncError, match=r"await sync\.push"):
        sync.push(mixed_model)
    with pytest.raises(StreamSyncError, match="running asyncio event loop"), sync.paused():
        pass
